"""Exactly-once effects: the "updates applied" table.

A consumer whose effect commits in the same transaction as its dequeue needs
nothing more: the dequeue is the record (a delivery that rolled back applied
nothing). This helper is for the other case, where the effect commits on its
own and the dequeue after it: the effect lives in another database (a
"peek, apply, then remove" consumer, as in the transfer example), or an
entry can reach a consumer twice by another road (moved by a mover and also
re-sent, re-queued from the exception table). Then the effect's transaction
records which entries it applied, and a second delivery is recognized::

    msg = queue_session.dequeue("deposits")
    with bank.transaction():                       # the consumer's own transaction
        if not already_applied(bank, "deposit", msg):
            bank.execute("UPDATE accounts ...")    # the effect, once
    queue_session.commit()                         # a crash before this redelivers

``ringq.applied (consumer, queue, seq, enqueued_at)`` is the record; a moved entry (see
:func:`ringq.move.unwrap`) is recorded by its origin (``instance:queue`` and
the source sequence), which is the same however often and by whatever road it
arrives. Rows are never deleted by ringq; prune old ones (``applied_at``) once
no redelivery can be older.

A plain entry is recorded by its queue's *name* and sequence, with its
enqueue time: a sequence is unique within one database's history, but the
sequences of entries lost in an asynchronous fail-over's gap are given again
(and a queue dropped and created again starts over), so a record of the same
sequence with another enqueue time is another entry's, and is replaced. A consumer
that applies entries of same-named queues from several databases should use
one consumer name per source database.
"""

from __future__ import annotations

import os
import threading
from datetime import datetime
from typing import Any

import psycopg
from ringq.engine import ConfigError, Message, Session, StatementRejected, pg

from ._mover import Moved, is_moved, unwrap
from ._queries import SQL

_ready: set[str] = set()  # DSNs whose table is known to exist (this process)
_ready_lock = threading.Lock()
_created_here: set[str] = set()  # DSNs where this process created it in a caller's transaction


def _after_fork_in_child() -> None:
    # Another thread may have held the lock at the fork; the child has no such thread.
    global _ready_lock
    _ready_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def create_applied_table(dsn: str) -> None:
    """Create ``ringq.applied`` if absent (idempotent; safe from several processes at once).

    :raises DatabaseUnavailable, DatabaseError:
    """
    with pg.connect(dsn, connect_timeout=10) as conn:
        for _attempt in range(5):
            try:
                pg.run(conn, SQL["applied_create"], dsn=dsn)
                break
            except StatementRejected as exc:
                if exc.sqlstate != pg.UNIQUE_VIOLATION:
                    raise
                # Two first creations raced in the catalog: the other won.
    with _ready_lock:
        _ready.add(dsn)


def applied_identity(msg: Message | Moved) -> tuple[str, int]:
    """``(queue, seq)`` recorded for an entry: its origin's if it was moved."""
    queue, seq, _enqueued_at = _identity(msg)
    return queue, seq


def _identity(msg: Message | Moved) -> tuple[str, int, datetime]:
    """``(queue, seq, enqueued_at)`` of an entry: its origin's if it was moved."""
    if isinstance(msg, Moved):
        return msg.origin, msg.origin_seq, msg.enqueued_at
    if is_moved(msg.payload):
        m = unwrap(msg.payload)
        return m.origin, m.origin_seq, m.enqueued_at
    return msg.queue, msg.seq, msg.enqueued_at


def already_applied(
    session: Session | psycopg.Connection[Any], consumer: str, msg: Message | Moved
) -> bool:
    """Record ``msg`` as applied by ``consumer`` in the current transaction of
    ``session``; return True if it was recorded before (skip the effect).

    ``session`` is the transaction the effect commits in: a ringq
    :class:`Session` (its connection) or a psycopg connection. The record
    commits or rolls back with the effect. A concurrent transaction recording
    the same entry waits for this one, then sees it.

    :raises ConfigError: ``consumer`` is empty.
    :raises DatabaseUnavailable, DatabaseError:
    """
    if not consumer:
        raise ConfigError("consumer must be a non-empty name")
    queue, seq, enqueued_at = _identity(msg)
    if isinstance(session, Session):
        conn, dsn = session.connection, session.dsn
        with _ready_lock:
            known = dsn in _ready
        if not known:
            _ensure(conn, dsn)
    else:
        conn, dsn = session, session.info.dsn
        with _ready_lock:
            known = dsn in _ready
        if not known:
            _ensure_in_transaction(conn, dsn)
    cur = pg.run(conn, SQL["applied_record"], (consumer, queue, seq, enqueued_at), dsn=dsn)
    return cur.fetchone() is None


def _ensure(conn: psycopg.Connection[Any], dsn: str) -> None:
    """Create the table on first use (checked on the caller's connection, created on another)."""
    row = pg.run(conn, SQL["applied_exists"], dsn=dsn).fetchone()
    if row and row[0]:
        with _ready_lock:
            _ready.add(dsn)
        return
    create_applied_table(dsn)


def _ensure_in_transaction(conn: psycopg.Connection[Any], dsn: str) -> None:
    """For a bare connection (whose password we do not know): create the table in a
    savepoint of the caller's transaction; it exists for others once that commits."""
    row = pg.run(conn, SQL["applied_exists"], dsn=dsn).fetchone()
    if row and row[0]:
        if dsn not in _created_here:
            # Not our own (maybe uncommitted) creation: it is there for good.
            with _ready_lock:
                _ready.add(dsn)
        return
    try:
        with pg.transaction(conn, dsn=dsn):  # a savepoint of the caller's transaction
            conn.execute(SQL["applied_create"])
        _created_here.add(dsn)  # exists for good only if the caller commits
    except StatementRejected as exc:
        if exc.sqlstate != pg.UNIQUE_VIOLATION:
            raise
        # created concurrently by another first user: it is there now
