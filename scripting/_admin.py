"""Queue administration: the admin connection, what ``ringq queue list|show``
read, and the exception entries (``ringq queue exceptions|requeue|discard``).

Data only: these functions return dataclasses and the CLI renders them. psycopg
errors are converted by the engine's :mod:`ringq.engine.pg`, which every
statement here runs through, so callers handle ringq errors alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from ringq.engine import (
    EntryNotFound,
    QueueInfo,
    QueueNotFound,
    Section,
    check_dsn,
    pg,
    queue_table,
    validate_queue_name,
)
from ringq.engine.sqlfile import compose, load

from . import _queries as Qy

# A CLI waiting psycopg's default (130 s) on a host that drops packets looks
# hung; a DSN's own connect_timeout (or PGCONNECT_TIMEOUT) still wins.
DEFAULT_CONNECT_TIMEOUT = 10  # seconds
APPLICATION_NAME = "ringq-admin"

_Q = load("ringq.scripting", "admin.sql")


@dataclass(frozen=True)
class QueueSummary:
    """One line of ``ringq queue list``. ``depth``: committed entries waiting (ring + inbox)."""

    name: str
    capacity: int
    depth: int
    max_payload: int  # bytes
    dequeue_mode: str
    full_policy: str


@dataclass(frozen=True)
class QueueDetails(QueueInfo):
    """Everything ``ringq queue show`` reports about one queue: its settings
    (the fields of :class:`~ringq.engine.QueueInfo`), then the storage settings
    and the figures of this moment.

    ``depth`` counts committed entries waiting, in the ring (``queued``) and in
    the SQL inbox (``inbox``); ``exceptions`` counts poison entries moved aside.
    Sizes are in bytes, ``full_timeout`` in seconds.
    """

    fillfactor: int
    tablespace: str | None
    created_at: datetime
    depth: int
    inbox: int
    exceptions: int
    free: int
    queued: int
    consumed: int
    table_bytes: int
    dead_rows: int


def connect_admin(dsn: str) -> psycopg.Connection[Any]:
    """Open an autocommit connection for administration (use it as a context manager).

    :raises ConfigError: ``dsn`` cannot be parsed.
    :raises DatabaseUnavailable: the server cannot be reached or refuses the
        connection; the message names the DSN without its password.
    """
    params = check_dsn(dsn)  # a malformed DSN is a ConfigError, before any connection
    # The DSN's own settings (or libpq's variables) win over ours.
    timeout = None
    if "connect_timeout" not in params and not os.environ.get("PGCONNECT_TIMEOUT"):
        timeout = DEFAULT_CONNECT_TIMEOUT
    appname = None
    if "application_name" not in params and not os.environ.get("PGAPPNAME"):
        appname = APPLICATION_NAME
    return pg.connect(dsn, connect_timeout=timeout, application_name=appname)


def remove_section(conn: psycopg.Connection[Any]) -> str | None:
    """Remove the database's global section and the wake-up semaphores of
    every queue it ever had (dropped ones too) from this host's shared memory.
    For when nothing uses them any more (``ringq run --stop``, after its
    monitor stopped): a client still attached keeps its mapping, and the next
    one rebuilds the section from the tables.

    :returns: the section's instance id, or None when there is no ringq schema.
    """
    if not _schema_present(conn):
        return None
    row = pg.run(conn, _Q["section_ids"]).fetchone()
    if row is None or not row[0]:
        return None
    instance, last_id = str(row[0]), int(row[1])
    Section.unlink(instance)
    Section.unlink_semaphores(instance, list(range(1, last_id + 1)))
    return instance


def list_queues(conn: psycopg.Connection[Any]) -> list[QueueSummary]:
    """Every queue, by name; an empty list when the ringq schema is absent.

    :raises DatabaseUnavailable: the connection was lost.
    """
    if not _schema_present(conn):
        return []
    rows = pg.run(conn, _Q["list_queues"]).fetchall()
    return [QueueSummary(*row) for row in rows]


def describe_queue(conn: psycopg.Connection[Any], name: str) -> QueueDetails:
    """The queue's settings and its current figures, read in one snapshot.

    :raises InvalidQueueName: ``name`` is not a valid queue name.
    :raises QueueNotFound: no such queue (or no ringq schema at all).
    """
    table = queue_table(validate_queue_name(name))
    with pg.transaction(conn, queue=name):
        # One snapshot, so depth, inbox and slot counts agree with each other.
        conn.execute(_Q["snapshot"])
        if not _schema_present(conn):
            raise QueueNotFound(f"queue {name!r} does not exist (no ringq schema)", queue=name)
        row = conn.execute(_Q["describe_queue"], (name,)).fetchone()
        if row is None:
            raise QueueNotFound(f"queue {name!r} does not exist", queue=name)
        states = conn.execute(compose(_Q["ring_states"], table=table)).fetchone()
        storage = conn.execute(_Q["ring_storage"], (f"ringq.q_{name}",)).fetchone()
    assert states is not None and storage is not None  # aggregates always return a row
    return QueueDetails(*row, *states, *storage)


@dataclass(frozen=True)
class ExceptionEntry:
    """One poison entry of a queue, as ``ringq queue exceptions`` lists it.

    ``deliveries``: deliveries that did not commit before it was moved;
    ``size``: payload bytes; ``moved_at``: when it was moved aside;
    ``group``: the group it left (None: none).
    """

    seq: int
    deliveries: int
    reason: str
    moved_at: datetime
    size: int | None
    producer: str | None
    producer_seq: int | None
    enqueued_at: datetime | None
    group: str | None = None


def list_exceptions(conn: psycopg.Connection[Any], name: str) -> list[ExceptionEntry]:
    """The queue's entries in ``ringq.exceptions``, oldest move first.

    :raises InvalidQueueName: ``name`` is not a valid queue name.
    :raises QueueNotFound: no such queue (or no ringq schema at all).
    """
    with pg.transaction(conn, queue=name):
        qid = _queue_id(conn, name)
        rows = conn.execute(_Q["list_exceptions"], (qid,)).fetchall()
    return [ExceptionEntry(*row) for row in rows]


def requeue_exception(conn: psycopg.Connection[Any], name: str, seq: int) -> int:
    """Put exception entry ``seq`` back on queue ``name``; returns its SQL inbox id.

    In one transaction the entry leaves ``ringq.exceptions`` and enters the
    queue's SQL inbox, so it can be neither lost nor doubled (two operators
    requeueing it at once: one wins, the other gets :class:`EntryNotFound`).
    The monitor (or any linked client) moves it into the ring, as a new
    entry: a new seq, deliveries counted from 0.

    :raises QueueNotFound: no such queue.
    :raises EntryNotFound: the queue has no exception entry ``seq``.
    """
    with pg.transaction(conn, queue=name):
        qid = _queue_id(conn, name)
        row = conn.execute(_Q["requeue_exception"], (qid, seq)).fetchone()
        if row is None:
            raise _no_entry(name, seq)
        conn.execute(_Q["inbox_notify"], (name,))
    return int(row[0])


def discard_exception(conn: psycopg.Connection[Any], name: str, seq: int) -> None:
    """Delete exception entry ``seq`` of queue ``name`` for good.

    :raises QueueNotFound: no such queue.
    :raises EntryNotFound: the queue has no exception entry ``seq``.
    """
    with pg.transaction(conn, queue=name):
        qid = _queue_id(conn, name)
        if conn.execute(_Q["discard_exception"], (qid, seq)).fetchone() is None:
            raise _no_entry(name, seq)


def exception_queue_of(conn: psycopg.Connection[Any], name: str) -> list[str]:
    """The queues that name ``name`` as their exception queue (by name).

    Dropping ``name`` leaves their poison entries in ``ringq.exceptions`` only.
    """
    if not _schema_present(conn):
        return []
    rows = pg.run(conn, _Q["exception_queue_of"], (name,), queue=name).fetchall()
    return [str(r[0]) for r in rows]


def _queue_id(conn: psycopg.Connection[Any], name: str) -> int:
    validate_queue_name(name)
    if not _schema_present(conn):
        raise QueueNotFound(f"queue {name!r} does not exist (no ringq schema)", queue=name)
    row = conn.execute(_Q["queue_id"], (name,)).fetchone()
    if row is None:
        raise QueueNotFound(f"queue {name!r} does not exist", queue=name)
    return int(row[0])


def _no_entry(name: str, seq: int) -> EntryNotFound:
    return EntryNotFound(
        f"queue {name!r} has no exception entry {seq} (see 'ringq queue exceptions {name}')",
        queue=name,
        seq=seq,
    )


def _schema_present(conn: psycopg.Connection[Any]) -> bool:
    row = pg.run(conn, Qy.SCHEMA_PRESENT).fetchone()
    return bool(row and row[0])
