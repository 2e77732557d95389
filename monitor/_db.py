"""The short-lived connections of the monitor's standalone steps (the SQL inbox
pump, key pruning), which a test or a tool may also run on their own."""

from __future__ import annotations

from typing import Any

import psycopg
from ringq.engine import from_psycopg


def connect_step(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection for one step (5 s to connect); use it as a context manager.

    :raises DatabaseUnavailable: the database cannot be reached.
    :raises RingqError: any other connection error, converted.
    """
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=5)
    except psycopg.Error as exc:
        raise from_psycopg(exc, dsn=dsn) from exc
