"""How a session's statements go on the wire: one round trip per transaction.

psycopg opens a transaction with an implicit ``BEGIN`` sent as a round trip
of its own before the first statement; in pipeline mode too, since it syncs
the pipeline right after that BEGIN to learn its outcome (psycopg PR 401).
So the session keeps psycopg from sending it and writes what the exchange
needs itself, in the same message:

- a commit on an idle connection (only the session's own row writes are in
  the transaction): the writes alone, in autocommit; several statements
  are one implicit transaction up to the Sync, all or nothing;
- a commit in a transaction the caller's statements opened: the writes,
  then COMMIT;
- ``flush()`` on an idle connection: BEGIN, then the writes;
- a statement that opens the transaction (a dequeue, a keyed enqueue):
  ``BEGIN; <statement>``.

Row writes go as one pipeline closed by one Sync (extended protocol:
prepared plans, binary payloads). A statement that fails makes the server
skip the rest up to the Sync, so a COMMIT queued behind a failed row write
never runs. Measured against one simple-protocol message with client-side
literals, the pipeline committed more transactions per second in three
cases of four (one entry in the caller's transaction +23 %, two queues
+28 %, 100 entries of 2 kB +108 %; 100 entries of 100 B: -4 %), the
server parsing and planning each literal statement afresh. An opening
statement carries no payload, and there the simple-protocol message won:
psycopg's pipeline machinery costs client CPU that one plain exchange does
not (see :func:`execute`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

Params = Sequence[Any] | Mapping[str, Any] | None
Statement = tuple[str, Params]  # (query, parameters)

_IDLE = TransactionStatus.IDLE


def begin_statement(conn: psycopg.Connection[Any]) -> str:
    """The BEGIN psycopg would send: the connection's isolation level,
    read-only and deferrable settings."""
    parts = ["BEGIN"]
    if conn.isolation_level is not None:
        parts.append("ISOLATION LEVEL " + conn.isolation_level.name.replace("_", " "))
    if conn.read_only is not None:
        parts.append("READ ONLY" if conn.read_only else "READ WRITE")
    if conn.deferrable is not None:
        parts.append("DEFERRABLE" if conn.deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


@contextmanager
def _no_implicit_begin(conn: psycopg.Connection[Any], allowed: bool = True) -> Iterator[bool]:
    """While the block runs psycopg sends no implicit BEGIN. Yields whether
    the connection was idle (no transaction open): the caller then sends its
    own BEGIN, or means its statements to run in autocommit. Yields False
    and changes nothing if not ``allowed`` (psycopg then begins as usual).

    psycopg decides on its implicit BEGIN from the connection's private
    ``_autocommit`` flag alone (``Connection._start_query``, psycopg 3.0 to
    3.3). The public ``autocommit`` setter refuses to restore it once a
    transaction is open, which is exactly the state this leaves behind, so
    the flag is set directly, only around one exchange, and always restored.
    (tests/test_deferred.py counts the round trips, should psycopg change.)
    """
    if not allowed or conn.autocommit:
        yield False
        return
    idle = conn.pgconn.transaction_status == _IDLE  # libpq's int: no ConnectionInfo made
    conn._autocommit = True
    try:
        yield idle
    finally:
        conn._autocommit = False


def execute(
    conn: psycopg.Connection[Any],
    query: str,
    params: Params,
    *,
    binary: bool = False,
    may_begin: bool = True,
) -> psycopg.Cursor[Any]:
    """Run one statement in the connection's transaction: one round trip.

    On an idle connection the BEGIN that opens the transaction travels with
    the statement, as one simple-protocol message (``BEGIN; <statement>``,
    its parameters bound client-side): measured against a pipeline of the
    two, it took 10 % less time and 20 % less client CPU per dequeue, and
    the same for batches. The cursor is then positioned on the statement's
    rows (text results: the same Python values). ``may_begin=False`` leaves
    the BEGIN to psycopg (inside a two-phase transaction).
    """
    with _no_implicit_begin(conn, may_begin) as idle:
        if not idle:
            return conn.execute(query, params, binary=binary)
        cur = psycopg.ClientCursor(conn)
        cur.execute(begin_statement(conn) + "; " + cur.mogrify(query, params))
        cur.nextset()  # past the BEGIN's result
        return cur


def commit_then(conn: psycopg.Connection[Any], query: str, params: Params) -> psycopg.Cursor[Any]:
    """COMMIT the open transaction, then BEGIN another and run ``query`` in
    it: one simple-protocol message, one round trip. The cursor is positioned
    on the query's rows. If the COMMIT fails the rest does not run (the
    connection is then idle, the transaction rolled back); if the query fails
    after it, the COMMIT stands and the new transaction is failed."""
    cur = psycopg.ClientCursor(conn)
    cur.execute("COMMIT; " + begin_statement(conn) + "; " + cur.mogrify(query, params))
    cur.nextset()  # past the COMMIT's result
    cur.nextset()  # past the BEGIN's
    return cur


def send(
    conn: psycopg.Connection[Any],
    statements: Sequence[Statement],
    *,
    commit: bool,
    may_begin: bool = True,
) -> list[psycopg.Cursor[Any]]:
    """Send ``statements`` in one round trip (a failing statement raises: the
    first psycopg error); returns a cursor on each one's rows. With
    ``commit`` the transaction ends with them; else it stays open, opened by
    a BEGIN sent with them if none was.

    On an idle connection a commit needs neither BEGIN nor COMMIT: the
    statements run in autocommit, one implicit transaction up to the Sync
    (all or nothing), the least PostgreSQL can be sent. After an error the
    transaction is in a failed state (roll it back), or was rolled back.
    """
    if len(statements) == 1 and commit and may_begin and not conn.autocommit:
        # The common case (one queue's writes, committed): as
        # _no_implicit_begin, inline (its generator costs more than the rest).
        query, params = statements[0]
        conn._autocommit = True
        try:
            if conn.pgconn.transaction_status == _IDLE:
                return [conn.execute(query, params)]
        finally:
            conn._autocommit = False
    with _no_implicit_begin(conn, may_begin) as idle:
        message = list(statements)
        if idle and not commit:
            message.insert(0, (begin_statement(conn), None))
        elif commit and not idle:
            message.append(("COMMIT", None))
        if len(message) == 1:
            query, params = message[0]
            return [conn.execute(query, params)]
        cursors = [conn.cursor() for _ in statements]
        other = conn.cursor()
        with conn.pipeline():
            at = 0
            for query, params in message:
                if params is None:  # BEGIN, COMMIT
                    other.execute(query, prepare=False)
                else:
                    cursors[at].execute(query, params)
                    at += 1
        return cursors


def rollback_then(
    conn: psycopg.Connection[Any], statements: Sequence[Statement]
) -> list[psycopg.Cursor[Any]]:
    """ROLLBACK the open transaction (if any) and run ``statements`` after it
    in autocommit, in one round trip. Returns each statement's cursor, to read
    its rows. If a statement fails the ROLLBACK has still happened; the error
    is raised."""
    cursors = [conn.cursor() for _ in statements]
    # The statements run after the ROLLBACK in the implicit transaction that
    # the Sync commits; psycopg must not open one for them.
    with _no_implicit_begin(conn) as idle, conn.pipeline():
        if not idle:
            conn.execute("ROLLBACK", prepare=False)
        for cur, (query, params) in zip(cursors, statements, strict=True):
            cur.execute(query, params)
    return cursors


def int_array(values: Iterable[int]) -> str:
    """A PostgreSQL array literal of integers: one text parameter (psycopg
    dumps a list element by element, a regular expression each)."""
    return "{" + ",".join(map(str, values)) + "}"


def text_array(values: Sequence[str | None]) -> str:
    """A PostgreSQL array literal of strings (None: NULL), each quoted; the
    usual case (one producer, or one group, for the whole batch) quoted once."""
    def quoted(v: str | None) -> str:
        if v is None:
            return "NULL"
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'

    first = values[0] if values else ""
    if all(v == first for v in values):
        return "{" + ",".join([quoted(first)] * len(values)) + "}"
    return "{" + ",".join(map(quoted, values)) + "}"
