"""Queue names: validated once, then used only through ``psycopg.sql.Identifier``."""

from __future__ import annotations

import re

from psycopg import sql

from .errors import InvalidQueueName

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
SCHEMA = "ringq"


def validate_queue_name(name: object) -> str:
    """Return ``name`` if it is a valid queue name.

    :raises InvalidQueueName: it is not a string matching ``^[a-z][a-z0-9_]{0,47}$``.
    """
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidQueueName(
            f"invalid queue name {name!r}: use 1-48 characters, a lowercase letter first, "
            "then lowercase letters, digits or '_'"
        )
    return name


def queue_table(name: str) -> sql.Identifier:
    """The queue's table, ``ringq.q_<name>``, as a quoted SQL identifier."""
    return sql.Identifier(SCHEMA, "q_" + validate_queue_name(name))
