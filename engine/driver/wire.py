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

import re
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from struct import Struct
from typing import Any, NoReturn, Protocol, cast

import psycopg
from psycopg import generators
from psycopg.adapt import Transformer
from psycopg.errors import error_from_result
from psycopg.pq import ExecStatus, TransactionStatus

Params = Sequence[Any] | Mapping[str, Any] | None
Statement = tuple[str, Params]  # (query, parameters)

_IDLE = TransactionStatus.IDLE
_TUPLES_OK = ExecStatus.TUPLES_OK
_COMMAND_OK = ExecStatus.COMMAND_OK


# -- ringq's own prepared statements ---------------------------------------------------
#
# psycopg's execute() costs 35-50 us of client CPU per statement beside
# libpq's own 15-20 (a cursor, the query's conversion, a Transformer dumping
# each parameter, the prepared-statement manager, the result's loaders),
# measured on a one-row UPDATE in autocommit. The engine's hot statements
# (the row writes of a commit, the dequeue that reads rows) have parameters
# ringq makes itself, so it prepares them once per connection and sends them through
# psycopg's libpq wrapper (pgconn) and its C wait loop (Connection.wait),
# which keeps Ctrl-C cancelling the statement as psycopg's execute does.

_PLACEHOLDER = re.compile(r"%(?:\((\w+)\))?([sb%])")
_ARRAY_HEAD = Struct("!iiIii")  # ndim, has-nulls, element oid, length, lower bound
_LEN = Struct("!i")
_BYTEA_OID = 17
_ROWS = object()  # marks a statement's command in Prepared.run


class PgQuery:
    """A statement the engine may send through libpq itself: from its text
    for psycopg (``%s``, ``%b``, ``%(name)s`` placeholders), its libpq form
    (``$n``), the parameters' order and formats (``%b``: binary).

    Its parameters are None, int, str, lists of int (an array literal),
    bytes (``%b``) or lists of bytes (``%b``: a bytea array); any other value
    sends it through psycopg. Its results come back in binary, loaded by
    psycopg's loaders (:class:`Rows`)."""

    __slots__ = ("formats", "libpq", "names")

    def __init__(self, query: str) -> None:
        names: list[str] = []
        formats: list[int] = []

        def number(m: re.Match[str]) -> str:
            name, kind = m.group(1), m.group(2)
            if kind == "%":
                return "%"
            if name is not None and name in names:
                return f"${names.index(name) + 1}"
            names.append(name or "")
            formats.append(1 if kind == "b" else 0)
            return f"${len(names)}"

        self.libpq = _PLACEHOLDER.sub(number, query).encode()
        # the parameters' names in $n order (None: positional)
        self.names = tuple(names) if names and names[0] else None
        self.formats = tuple(formats)

    def encode(self, params: Params) -> list[bytes | None] | None:
        """The parameters as libpq sends them; None if one is not a kind
        this path encodes (the statement then goes through psycopg)."""
        if params is None:
            return []
        kind = type(params)
        if self.names is not None:
            if kind is not dict and not isinstance(params, Mapping):
                return None
            named = cast("Mapping[str, Any]", params)
            values: Sequence[Any] = [named[n] for n in self.names]
        elif kind is tuple or kind is list:  # (ahead of Mapping: an ABC check costs more)
            values = cast("Sequence[Any]", params)
        elif isinstance(params, Mapping):
            return None
        else:
            values = params
        if len(values) != len(self.formats):
            return None
        out: list[bytes | None] = []
        for v, binary in zip(values, self.formats, strict=True):
            t = type(v)
            if v is None:
                out.append(None)
            elif binary:
                if t is bytes:
                    out.append(v)
                elif t is list and all(type(x) is bytes for x in v):
                    out.append(bytea_array(v))
                elif t is bytearray or t is memoryview:
                    out.append(bytes(v))
                else:
                    return None
            elif t is int:
                out.append(str(v).encode())
            elif t is str and "\x00" not in v:  # libpq would cut a text at a NUL
                out.append(v.encode())
            elif t is list and all(type(x) is int for x in v):
                out.append(int_array(v).encode())  # an array literal, typed by its place
            else:
                return None  # psycopg refuses (a NUL) or dumps it
        return out


def bytea_array(values: Sequence[bytes]) -> bytes:
    """A one-dimensional bytea[] in PostgreSQL's binary array format."""
    parts = [_ARRAY_HEAD.pack(1, 0, _BYTEA_OID, len(values), 1)]
    for v in values:
        parts.append(_LEN.pack(len(v)))
        parts.append(v)
    return b"".join(parts)


class Fetch(Protocol):
    """What the engine reads of a statement's results: a psycopg cursor, or :class:`Rows`."""

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Rows:
    """A statement's rows, loaded by psycopg's own (C) loaders for the
    connection's types, and read as psycopg's cursor reads them
    (``fetchone``, ``fetchall``)."""

    __slots__ = ("_rows",)

    def __init__(
        self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], result: Any
    ) -> None:
        tx = Transformer.from_context(conn)
        tx.set_pgresult(result)
        self._rows: list[tuple[Any, ...]] = tx.load_rows(0, result.ntuples, tuple)

    @classmethod
    def empty(cls) -> Rows:
        """No rows (a command that returned none)."""
        rows = cls.__new__(cls)
        rows._rows = []
        return rows

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self._rows = self._rows, []
        return rows


class Prepared:
    """ringq's prepared statements on a session's connection (names
    ``ringq_<n>``, apart from psycopg's ``_pg3_<n>``); forgotten when the
    connection is a new one. A statement is prepared in the same round trip
    as its first execution."""

    def __init__(self) -> None:
        self._pgconn: Any = None
        self._names: dict[bytes, bytes] = {}
        self._made = 0  # statements prepared on the connection (for the next name)
        self._watching = False  # psycopg's DEALLOCATE ALL is seen (_watch)
        self._queries: dict[str, PgQuery] = {}  # the statements this path sends

    def add(self, query: str) -> str:
        """Let ``query`` go through this path (see :class:`PgQuery`); returns it."""
        if query not in self._queries:
            self._queries[query] = PgQuery(query)
        return query

    def run(
        self,
        conn: psycopg.Connection[Any],
        statements: Sequence[Statement],
        *,
        begin: bool,
        commit: bool,
    ) -> list[Rows] | None:
        """Send ``statements`` (each a :class:`PgQuery`) in one round trip:
        after a BEGIN with ``begin``, then a COMMIT with ``commit``; on an
        idle connection without either, they run in autocommit as one
        implicit transaction. Raises the first statement's error as psycopg
        would (the rest was skipped by the server). None, having sent
        nothing, when a parameter is not for this path or the connection
        prepares nothing (``prepare_threshold`` None, as behind a
        transaction-mode pooler): use psycopg then."""
        encoded = self.encoded(conn, statements)
        if encoded is None:
            return None
        with conn.lock:
            return conn.wait(self.exchange(conn, encoded, begin=begin, commit=commit))

    def encoded(
        self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
        statements: Sequence[Statement],
    ) -> list[tuple[PgQuery, list[bytes | None]]] | None:
        """``statements`` as this path sends them, the connection watched
        (see :meth:`_watch`); None if they go through psycopg instead (see
        :meth:`run`). Shared by both faces: :meth:`run` here, and the
        asyncio face's twin (``driver.awire``)."""
        if conn.prepare_threshold is None:
            return None
        encoded: list[tuple[PgQuery, list[bytes | None]]] = []
        queries = self._queries
        for text, params in statements:
            query = queries.get(text)
            if query is None:
                return None
            values = query.encode(params)
            if values is None:
                return None
            encoded.append((query, values))
        if conn.pgconn is not self._pgconn:
            self._pgconn, self._names, self._made = conn.pgconn, {}, 0
            self._watching = self._watch(conn)
        if not self._watching:
            return None
        return encoded

    def exchange(
        self,
        conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any],
        encoded: Sequence[tuple[PgQuery, list[bytes | None]]],
        *,
        begin: bool,
        commit: bool,
    ) -> Generator[Any, Any, list[Rows]]:
        """The round trip of :meth:`run` as a psycopg generator (``PQGen``):
        the sync face runs it with ``Connection.wait``, the asyncio face with
        ``await AsyncConnection.wait``; the same libpq calls either way."""
        pg = conn.pgconn
        names = self._names
        if len(encoded) == 1 and not begin and not commit:
            # The usual exchange, one statement prepared already: no pipeline.
            query, values = encoded[0]
            name = names.get(query.libpq)
            if name is not None:
                pg.send_query_prepared(name, values, param_formats=query.formats,
                                       result_format=1)
                res = (yield from generators.execute(pg))[-1]
                if res.status in (_TUPLES_OK, _COMMAND_OK):
                    return [Rows(conn, res)]
                self._failed(conn, res)
        # (the command, and what its result is: _ROWS a statement's, the
        # query text of a new prepare, None a BEGIN's or COMMIT's)
        commands: list[tuple[Any, Any]] = []
        if begin:
            commands.append((_sender(pg.send_query_params, begin_statement(conn).encode(),
                                     None), None))
        for query, values in encoded:
            name = names.get(query.libpq)
            if name is None:
                name = b"ringq_%d" % self._made
                self._made += 1
                commands.append((_sender(pg.send_prepare, name, query.libpq),
                                 (query.libpq, name)))
            commands.append((_sender(pg.send_query_prepared, name, values,
                                     param_formats=query.formats, result_format=1),
                             _ROWS))
        if commit:
            commands.append((_sender(pg.send_query_params, b"COMMIT", None), None))
        if len(commands) == 1:
            commands[0][0]()
            results = [(yield from generators.execute(pg))[-1]]
        else:
            results = yield from _pipeline(conn, [send for send, _ in commands])
        rows: list[Rows] = []
        error: psycopg.Error | None = None
        for res, (_send, what) in zip(results, commands, strict=True):
            status = res.status
            if status in (_TUPLES_OK, _COMMAND_OK):
                if what is _ROWS:
                    # (no rows, as a deferred INSERT's: no Transformer to make)
                    rows.append(Rows(conn, res) if res.ntuples else Rows.empty())
                elif what is not None:  # prepared: later runs skip the Parse
                    names[what[0]] = what[1]
            elif status != ExecStatus.PIPELINE_ABORTED and error is None:
                error = _error_of(conn, res)  # the first; the rest were skipped
        if error is not None:
            self._failed(conn, error)
        return rows

    def _watch(self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
        """Forget our statements whenever psycopg deallocates all of the
        connection's: after a ROLLBACK (its ``rollback()``, or a statement),
        a DROP, an ALTER or a DISCARD ALL, psycopg sends ``DEALLOCATE ALL``
        if it had prepared any statement itself, and ours go with it. It may
        send it later than it decides to (with its next statement, say the
        caller's own after a ROLLBACK in a pipeline), so what is watched is
        the sending: its ``_deallocate(None)``, wrapped on this connection
        only. False where psycopg has no such method (then this path is not
        used on the connection: psycopg sends the statements)."""
        deallocate = getattr(conn, "_deallocate", None)
        if deallocate is None:
            return False

        def deallocating(name: bytes | None) -> Any:
            if name is None:  # DEALLOCATE ALL
                self._names = {}
            return deallocate(name)

        conn._deallocate = deallocating  # type: ignore[method-assign]
        return True

    def _failed(
        self, conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], error: Any
    ) -> NoReturn:
        """Raise ``error`` (or the error of a result) as psycopg would."""
        if not isinstance(error, psycopg.Error):
            error = _error_of(conn, error)
        if error.sqlstate == "26000":  # a statement of ours is gone (DEALLOCATE)
            self._names = {}
        raise error


def _error_of(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], result: Any
) -> psycopg.Error:
    """The error a result that is not a success stands for, as psycopg makes it."""
    if result.status == ExecStatus.FATAL_ERROR:
        return error_from_result(result, encoding=conn.info.encoding)
    return psycopg.InterfaceError(f"unexpected result from the server: {result.status.name}")


def _sender(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return lambda: fn(*args, **kwargs)


def _pipeline(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], sends: Sequence[Any]
) -> Generator[Any, Any, list[Any]]:
    """Send the commands (``sends``, each queuing one) as one libpq
    pipeline closed by one Sync: one round trip (a psycopg generator).
    Returns each command's last result (FATAL_ERROR, or PIPELINE_ABORTED for
    those the server skipped after an error). A connection left in pipeline
    mode by an interruption is closed (the session then recovers by the rows)."""
    pg = conn.pgconn
    pg.enter_pipeline_mode()
    done = False
    try:
        for send in sends:
            send()
        pg.pipeline_sync()
        yield from generators.send(pg)
        out = []
        for _ in sends:
            out.append((yield from generators.fetch_many(pg))[-1])
        yield from generators.fetch_many(pg)  # the Sync's
        done = True
    finally:
        try:
            pg.exit_pipeline_mode()
        except psycopg.Error:
            if done:
                raise
            close_now(conn)
    return out


def close_now(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Close ``conn`` without waiting (an AsyncConnection's ``close`` is a
    coroutine: its libpq connection is finished instead, and reads as broken)."""
    if isinstance(conn, psycopg.Connection):
        conn.close()
    else:
        conn.pgconn.finish()


def begin_statement(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
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
def _no_implicit_begin(
    conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], allowed: bool = True
) -> Iterator[bool]:
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
    prepared: Prepared | None = None,
) -> Fetch:
    """Run one statement in the connection's transaction: one round trip.

    On an idle connection the BEGIN that opens the transaction travels with
    the statement, as one simple-protocol message (``BEGIN; <statement>``,
    its parameters bound client-side): measured against a pipeline of the
    two, it took 10 % less time and 20 % less client CPU per dequeue, and
    the same for batches. The cursor is then positioned on the statement's
    rows (text results: the same Python values). ``may_begin=False`` leaves
    the BEGIN to psycopg (inside a two-phase transaction).

    With ``prepared``, a statement it knows goes as ringq's prepared
    statement instead, after a BEGIN in the same libpq pipeline on an idle
    connection (the server plans it once per connection; psycopg's cursor
    and client-side binding cost more client CPU than the pipeline).
    """
    if prepared is not None and may_begin and not conn.autocommit:
        rows = prepared.run(
            conn, [(query, params)], begin=conn.pgconn.transaction_status == _IDLE, commit=False
        )
        if rows is not None:
            return rows[0]
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
    prepared: Prepared | None = None,
) -> list[psycopg.Cursor[Any]] | list[Rows]:
    """Send ``statements`` in one round trip (a failing statement raises: the
    first psycopg error); returns a cursor on each one's rows. With
    ``commit`` the transaction ends with them; else it stays open, opened by
    a BEGIN sent with them if none was.

    On an idle connection a commit needs neither BEGIN nor COMMIT: the
    statements run in autocommit, one implicit transaction up to the Sync
    (all or nothing), the least PostgreSQL can be sent. After an error the
    transaction is in a failed state (roll it back), or was rolled back.
    """
    if prepared is not None and may_begin and not conn.autocommit:
        idle = conn.pgconn.transaction_status == _IDLE
        begin, end = idle and not commit, commit and not idle
        try:
            rows = prepared.run(conn, statements, begin=begin, commit=end)
        except psycopg.errors.InvalidSqlStatementName:
            # Our statements were deallocated (DEALLOCATE ALL, DISCARD ALL by
            # the caller): forgotten already. Sent alone in autocommit nothing
            # ran, so they go again, prepared anew; in a transaction it failed.
            if not (idle and commit):
                raise
            rows = prepared.run(conn, statements, begin=begin, commit=end)
        if rows is not None:
            return rows
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
