"""The short-lived connections of the monitor's standalone steps (the SQL inbox
pump, key pruning, vacuum after a released snapshot), which a test or a tool
may also run on their own."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import psycopg
from ringq.engine import pg


def connect_step(dsn: str) -> AbstractContextManager[psycopg.Connection[Any]]:
    """An autocommit connection for one step's ``with`` block (5 s to connect),
    closed at its end; psycopg errors in the block are converted.

    :raises DatabaseUnavailable: the database cannot be reached.
    :raises RingqError: any other database error, converted.
    """
    return pg.connected(dsn, connect_timeout=5)
