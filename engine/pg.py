"""The one way ringq reaches PostgreSQL, public: every ringq package opens its
connections and runs its statements through these, and never converts a
psycopg error itself::

    from ringq.engine import pg

    with pg.connected(dsn, connect_timeout=5) as conn:   # errors -> ringq's tree
        row = conn.execute(Q["x"]).fetchone()
    conn = pg.connect(dsn, application_name="ringq-x")  # DatabaseUnavailable, DSN redacted
    pg.run(conn, Q["y"], (name,), queue=name).fetchall()
    with pg.transaction(conn, queue=name):
        ...

:func:`from_psycopg` is the one mapping from a psycopg error to a ringq class.
The functions are defined in ``ringq/engine/driver/pg.py``.
"""

from __future__ import annotations

from .driver.pg import (
    FULL_SQLSTATE,
    STALE_SQLSTATE,
    UNIQUE_VIOLATION,
    Params,
    connect,
    connected,
    converted,
    from_psycopg,
    notifies,
    run,
    transaction,
)

__all__ = [
    "FULL_SQLSTATE",
    "STALE_SQLSTATE",
    "UNIQUE_VIOLATION",
    "Params",
    "connect",
    "connected",
    "converted",
    "from_psycopg",
    "notifies",
    "run",
    "transaction",
]
