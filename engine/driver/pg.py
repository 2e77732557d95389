"""The one way ringq reaches PostgreSQL: connections opened, statements and
transaction blocks run, and psycopg errors turned into ringq's tree.

Every package (cluster, scripting, monitor, move, regression, cli, rtv,
worker) opens its connections with :func:`connect` or :func:`connected` and
runs its statements with :func:`run` or inside :func:`transaction`; none
catches a psycopg error to convert it. :func:`from_psycopg` is the one
mapping from a psycopg error to a ringq class; the session's ``Link.call``
(``session/_link.py``) applies the same mapping to the session's own work.
"""

from __future__ import annotations

import re
import select
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from .errors import (
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    QueueExists,
    QueueFull,
    QueueNotFound,
    RingqError,
    SchemaMissing,
    StaleSection,
    StatementRejected,
    TransactionConflict,
    redact_dsn,
    scrub_exception,
)

# What Connection.execute takes.
Query = LiteralString | bytes | sql.SQL | sql.Composed
Params = Sequence[Any] | Mapping[str, Any] | None

# SQLSTATEs (and classes) that say the database, or this connection to it,
# is gone: retrying later (reconnecting) may succeed.
# connection exception; insufficient resources (too many connections)
_UNAVAILABLE_CLASSES = ("08", "53")
_UNAVAILABLE_STATES = frozenset(
    {
        "57P01",  # admin_shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now
        "57P04",  # database_dropped
        "57P05",  # idle_session_timeout
        "25P03",  # idle_in_transaction_session_timeout: the server closed the session
    }
)
# The transaction lost a conflict: retrying the whole transaction may succeed.
_CONFLICT_STATES = frozenset({"40001", "40P01", "55P03"})
# A deferred row write found its row not as the global section said
# (ringq.expect_rows, scripting/ddl.sql): retry the transaction.
STALE_SQLSTATE = "RQ001"
# ringq.enqueue() / ringq.enqueue_many() found no room in the queue for a
# SQL producer's entries (ringq.make_room, scripting/ddl.sql): QueueFull.
FULL_SQLSTATE = "RQ002"
# The statement itself is refused: the same call fails the same way.
_REJECTED_CLASSES = ("22", "23", "42", "54")


# The undefined_object error of ddl.sql's queue block whose exception queue is missing.
_EXCEPTION_QUEUE_RE = re.compile(r'ringq: exception queue "([^"]+)"')
UNIQUE_VIOLATION = "23505"


def from_psycopg(
    exc: BaseException,
    *,
    dsn: str | None = None,
    queue: str | None = None,
    creating: bool = False,
    attaching: bool = False,
    parsing: str | None = None,
) -> RingqError:
    """Map a psycopg exception to the ringq class a user can act on.

    What the caller was doing, when it says, gives the error its meaning:
    ``queue`` names the queue the statement is about (a missing table is
    :class:`QueueNotFound`); ``creating``: the statement creates ``queue``
    with the caller's settings (ddl.sql's own checks: duplicate_object ->
    :class:`QueueExists`, its undefined exception queue -> :class:`QueueNotFound`,
    invalid_parameter_value and program_limit_exceeded -> :class:`ConfigError`);
    ``attaching``: it reads ringq's own tables to attach to the database (a
    missing one -> :class:`SchemaMissing`, "create a queue first");
    ``parsing``: the error came from parsing the DSN read from ``parsing``,
    before any connection (-> :class:`ConfigError`, the DSN not echoed).
    ``dsn`` is named, redacted, in a :class:`DatabaseUnavailable`.

    By SQLSTATE: 08 (connection), 53 (resources), 57P01-57P05 (shutdown,
    crash, cannot connect now, database dropped, session timeout) ->
    :class:`DatabaseUnavailable`; 40001, 40P01, 55P03 (serialization,
    deadlock, lock not available) -> :class:`TransactionConflict`; 22, 23,
    42, 54 (data, integrity, syntax/access, limits) -> :class:`StatementRejected`;
    RQ001 (a guarded row write did not match) -> :class:`StaleSection`;
    RQ002 (ringq.enqueue() found the queue full) -> :class:`QueueFull`.
    A driver error without a code (refused connection, lost connection) is
    :class:`DatabaseUnavailable`; any other is :class:`DatabaseError`.

    With ``dsn``, no text of it that could be a password shows, whichever way
    libpq split it (its messages quote what it read as a host, a port, a
    database: see :func:`ringq.engine.scrub`): the error returned is scrubbed,
    and so is ``exc`` with its chain, in place, so that ``raise ... from exc``
    prints no password in the cause of a traceback either.
    """
    if dsn:
        scrub_exception(exc, dsn)
    made = _mapped(exc, dsn, queue, creating, attaching, parsing)
    if dsn:
        scrub_exception(made, dsn)
    return made


def _mapped(
    exc: BaseException, dsn: str | None, queue: str | None, creating: bool, attaching: bool,
    parsing: str | None,
) -> RingqError:
    """:func:`from_psycopg`'s mapping (its arguments, in its order), before any scrubbing."""
    if isinstance(exc, RingqError):
        return exc
    if parsing is not None:
        return ConfigError(
            f"invalid {parsing} (not shown, it may hold a password): {_first_line(exc)}"
        )
    if creating and (made := _creating(exc, queue)) is not None:
        return made
    if attaching and isinstance(exc, psycopg.errors.UndefinedTable):
        where = f" in {redact_dsn(dsn)!r}" if dsn else ""
        return SchemaMissing(f"no ringq schema{where}: create a queue first (ringq queue create)")
    if isinstance(exc, psycopg.errors.UndefinedTable) and queue:
        return QueueNotFound(f"queue {queue!r} does not exist", queue=queue)
    if isinstance(exc, psycopg.errors.InvalidSchemaName | psycopg.errors.UndefinedTable):
        return SchemaMissing(f"ringq schema missing or incomplete: {exc}")
    state: str | None = getattr(exc, "sqlstate", None)
    if (state is None and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)) or (
        state is not None and (state[:2] in _UNAVAILABLE_CLASSES or state in _UNAVAILABLE_STATES)
    ):
        where = f" at {redact_dsn(dsn)!r}" if dsn else ""
        return DatabaseUnavailable(f"database unavailable{where}: {redact_dsn(_first_line(exc))}")
    if state == STALE_SQLSTATE:
        table = getattr(getattr(exc, "diag", None), "table_name", None) or ""
        return stale_section(table.removeprefix("q_") or queue)
    if state == FULL_SQLSTATE:
        table = getattr(getattr(exc, "diag", None), "table_name", None) or ""
        return QueueFull(_primary(exc), queue=table.removeprefix("q_") or queue)
    conflict = state is not None and (
        state in _CONFLICT_STATES or (state[:2] == "40" and state != "40002")
    )
    if conflict:
        return TransactionConflict(
            f"transaction rolled back, retry it: {_primary(exc)}", sqlstate=state
        )
    if state is not None and state[:2] in _REJECTED_CLASSES:
        return StatementRejected(_primary(exc), sqlstate=state)
    return DatabaseError(str(exc).strip() or type(exc).__name__, sqlstate=state)


def _creating(exc: BaseException, queue: str | None) -> RingqError | None:
    """The meaning of ddl.sql's own checks while it creates ``queue``; None for any other error."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) or str(exc)
    if isinstance(exc, psycopg.errors.DuplicateObject):
        return QueueExists(f"queue {queue!r} exists with different settings", queue=queue)
    if isinstance(exc, psycopg.errors.UndefinedObject):
        # Only the exception queue check is ours: any other (an unknown
        # tablespace) is PostgreSQL's, mapped as any statement's.
        named = _EXCEPTION_QUEUE_RE.match(primary)
        if named is None:
            return None
        return QueueNotFound(
            f"exception queue {named[1]!r} of queue {queue!r} does not exist (create it first)",
            queue=named[1],
        )
    if isinstance(exc, psycopg.errors.InvalidParameterValue):
        return ConfigError(primary.removeprefix("ringq: "))
    if isinstance(exc, psycopg.errors.ProgramLimitExceeded):
        # The section budget check: a usage error, as a capacity over
        # MAX_CAPACITY is (the message says what is taken, the hint what to do).
        hint = getattr(diag, "message_hint", None)
        return ConfigError(primary.removeprefix("ringq: ") + (f"; {hint}" if hint else ""))
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def stale_section(queue: str | None) -> StaleSection:
    """A guarded row write of ``queue`` found its row not as the section said
    (RQ001 from the server, or no row back from a write sent alone)."""
    return StaleSection(
        f"queue {queue!r}: a row write did not find its row as the global section said "
        "(stale section); nothing of the transaction committed: retry it",
        queue=queue,
    )


def from_callers_statement(exc: BaseException, converted: RingqError) -> RingqError:
    """The ringq error of the caller's own statement (``Session.execute``):
    as ``converted`` (:func:`from_psycopg`'s), except that a missing table
    or schema is the statement's error, not a sign of a missing ringq schema."""
    if isinstance(exc, psycopg.errors.InvalidSchemaName | psycopg.errors.UndefinedTable):
        return StatementRejected(_primary(exc), sqlstate=exc.sqlstate)
    return converted


def _primary(exc: BaseException) -> str:
    """PostgreSQL's primary message and its code: never the statement (psycopg's
    text may quote it, with its values, after the first line)."""
    diag = getattr(exc, "diag", None)
    primary = (
        getattr(diag, "message_primary", None)
        or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    )
    state = getattr(exc, "sqlstate", None)
    return f"{primary} (SQLSTATE {state})" if state else primary


@contextmanager
def converted(
    *,
    dsn: str | None = None,
    queue: str | None = None,
    creating: bool = False,
    attaching: bool = False,
) -> Iterator[None]:
    """Run a block and re-raise any psycopg error as its ringq class (``raise X
    from exc``: the psycopg error stays as ``__cause__``); the keywords as for
    :func:`from_psycopg`."""
    try:
        yield
    except psycopg.Error as exc:
        raise from_psycopg(
            exc, dsn=dsn, queue=queue, creating=creating, attaching=attaching
        ) from exc


def connect(
    dsn: str,
    *,
    autocommit: bool = True,
    connect_timeout: float | None = None,
    application_name: str | None = None,
    **kwargs: Any,
) -> psycopg.Connection[Any]:
    """Open a connection to ``dsn`` (use it as a context manager to close it).

    Autocommit unless told otherwise: a connection of ours is never left idle
    in a transaction that nobody opened on purpose. ``connect_timeout``
    (seconds, rounded down, at least 1) and ``application_name`` are passed
    when given; ``kwargs`` go to :func:`psycopg.connect` as they are.

    :raises DatabaseUnavailable: the server cannot be reached or refuses the
        connection; the message names ``dsn`` without its password.
    :raises RingqError: any other connection error, converted.
    """
    if connect_timeout is not None:
        kwargs["connect_timeout"] = max(1, int(connect_timeout))
    if application_name is not None:
        kwargs["application_name"] = application_name
    with converted(dsn=dsn):
        return psycopg.connect(dsn, autocommit=autocommit, **kwargs)


@contextmanager
def connected(
    dsn: str,
    *,
    autocommit: bool = True,
    connect_timeout: float | None = None,
    application_name: str | None = None,
    queue: str | None = None,
    attaching: bool = False,
    **kwargs: Any,
) -> Iterator[psycopg.Connection[Any]]:
    """A connection for one block (as :func:`connect`), closed at its end; a
    psycopg error in the block is converted as :func:`from_psycopg` says (with
    ``dsn``, ``queue``, ``attaching``). A connection not in autocommit commits
    at the block's end, or rolls back on an error, as psycopg's does."""
    conn = connect(
        dsn,
        autocommit=autocommit,
        connect_timeout=connect_timeout,
        application_name=application_name,
        **kwargs,
    )
    with converted(dsn=dsn, queue=queue, attaching=attaching), conn:
        yield conn


def run(
    conn: psycopg.Connection[Any],
    query: Query,
    params: Params = None,
    *,
    dsn: str | None = None,
    queue: str | None = None,
    attaching: bool = False,
) -> psycopg.Cursor[Any]:
    """Execute one statement on ``conn``; its cursor holds the rows.

    :raises RingqError: the statement failed (converted by :func:`from_psycopg`
        with ``dsn``, ``queue`` and ``attaching``).
    """
    with converted(dsn=dsn, queue=queue, attaching=attaching):
        return conn.execute(query, params)


@contextmanager
def transaction(
    conn: psycopg.Connection[Any],
    *,
    dsn: str | None = None,
    queue: str | None = None,
    creating: bool = False,
) -> Iterator[psycopg.Connection[Any]]:
    """A transaction block on ``conn`` (a savepoint inside one already open):
    it commits at the block's end, or rolls back on an error, which is then
    converted (after the rollback) as :func:`from_psycopg` says."""
    with converted(dsn=dsn, queue=queue, creating=creating), conn.transaction():
        yield conn


def notifies(conn: psycopg.Connection[Any], timeout: float) -> list[psycopg.Notify]:
    """The notifications ``conn`` has received, waiting up to ``timeout`` s
    for the first. A wait on the socket, then psycopg's read of what came:
    psycopg's own ``notifies(timeout=...)`` cost a thread about 1 ms of CPU
    per call whatever the timeout (psycopg 3.3), which a loop that waits a
    few ms at a time paid on every turn."""
    got = list(conn.notifies(timeout=0))  # those a statement's results brought already
    if not got:
        select.select([conn.fileno()], [], [], timeout)
        got = list(conn.notifies(timeout=0))
    return got
