"""The ringq exception tree.

Every error ringq raises on purpose derives from :class:`RingqError`; psycopg
errors are converted in exactly one place (:func:`convert`), so a caller never
has to catch a driver exception to handle a ringq failure.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg


class RingqError(Exception):
    """Root of every error ringq raises on purpose."""


class ConfigError(RingqError, ValueError):
    """A setting or argument is invalid (bad name, bad number, bad mode)."""


class InvalidArgument(ConfigError):
    """An argument of a call has a value it cannot take (a negative wait,
    ``max_n`` below 1, an idempotency key too long); nothing was done."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of a call has a type it cannot take (a ``str`` payload, an
    ``int`` key); nothing was done."""


class InvalidQueueName(ConfigError):
    """A queue name does not match ``^[a-z][a-z0-9_]{0,47}$``."""


class QueueError(RingqError):
    """An operation on one queue failed."""

    def __init__(self, message: str, *, queue: str | None = None) -> None:
        super().__init__(message)
        self.queue = queue


class QueueNotFound(QueueError):
    """The named queue does not exist in the management table."""


class EntryNotFound(QueueError):
    """No entry with that sequence number where it was looked for (an exception
    entry of the queue that was requeued, discarded or never there)."""

    def __init__(self, message: str, *, queue: str | None = None, seq: int | None = None) -> None:
        super().__init__(message, queue=queue)
        self.seq = seq


class QueueExists(QueueError):
    """A queue of that name exists with different settings."""


class QueueFull(QueueError):
    """The queue has no free slot and its policy (or the timeout) says not to wait longer."""


class PayloadTooLarge(QueueError):
    """The payload is longer than the queue's ``max_payload`` bytes."""


class DuplicateKey(QueueError):
    """Reserved: an idempotency key conflict that could not be resolved."""


class SessionClosed(RingqError):
    """The session was closed (or its connection lost) and cannot be used."""


class TransactionError(RingqError):
    """The transaction is in a state that does not allow the operation."""


class TransactionConflict(TransactionError):
    """PostgreSQL rolled the transaction back to resolve a conflict with a
    concurrent one (SQLSTATE class 40: serialization failure, deadlock; or
    55P03 lock not available). Nothing of it committed: retry the transaction.
    ``sqlstate`` is PostgreSQL's code."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class StaleSection(TransactionError):
    """A queue row write sent at commit (or ``flush()``) did not find its row
    as the global section said (the section was stale: rebuilt, restored,
    or the table written around ringq), so PostgreSQL refused it and nothing
    of the transaction committed. The transaction was rolled back, its
    reservations voided and the queue's block resynced from the rows: retry
    the transaction, as after a serialization failure. ``queue`` names the queue."""

    def __init__(self, message: str, *, queue: str | None = None) -> None:
        super().__init__(message)
        self.queue = queue


@dataclass(frozen=True, slots=True)
class InFlight:
    """One queue operation of a transaction whose commit is in doubt: its
    queue, the entry's sequence, ``kind`` ("enqueue" or "dequeue"), the ring
    slot it used, and for an enqueue the entry's producer and producer
    sequence (None where the session no longer had them)."""

    queue: str
    seq: int
    kind: str
    slot: int
    producer: str | None = None
    producer_seq: int | None = None


class InDoubt(TransactionError):
    """The commit's answer was lost: the outcome is decided later from the rows.

    The entries are never lost or duplicated; the session (or the monitor)
    decides each slot from its row once the old backend has ended.
    ``entries`` are the transaction's queue operations (empty for a
    two-phase transaction, which its coordinator's decision settles);
    :meth:`Session.in_doubt_outcome` tells from the rows whether it
    committed, once a server answers.
    """

    def __init__(
        self,
        message: str,
        *,
        entries: tuple[InFlight, ...] = (),
        backend: tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(message)
        self.entries = entries
        # the backend that ran the commit: (pid, when its client registered it, ns)
        self.backend = backend


class DatabaseUnavailable(RingqError):
    """The database cannot be reached (the DSN is named without its password)."""


class DatabaseError(RingqError):
    """PostgreSQL reported an error that ringq does not map to a more precise
    class. ``sqlstate`` is PostgreSQL's code when it gave one."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class StatementRejected(DatabaseError):
    """PostgreSQL refused a statement for its data or a limit (SQLSTATE class
    22 data exception, 23 integrity violation, 42 syntax or access rule, 54
    program limit exceeded, e.g. an idempotency key too long for its index).
    Retrying the same call fails the same way. The message is PostgreSQL's
    primary message and code, never the statement or its values."""


class SchemaMissing(RingqError):
    """The ringq schema is absent or of an unknown version: create a queue first."""


class SectionError(RingqError):
    """The shared-memory global section is missing, full or of a foreign layout."""


class SectionIncompatible(SectionError):
    """The global section was made by another layout version; refuse to use it."""


# A URL's user information ends at the last "@" before the host part: a
# password with an unescaped "@" (or "/") is hidden whole, not cut at its
# first "@". The host part runs to the path, the query or the end.
_URL_PASSWORD_RE = re.compile(r"(://[^:/@?#\s]*:)(\S*?)(@[^@/?#\s]*(?:[/?#\s]|$))")
# key=value DSNs and query strings: password='it''s \' quoted' or password=word,
# and a token in a URL or request line (?token=..., &token=...).
_KEYWORD_SECRET_RE = re.compile(
    r"\b((?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|\S*)|([?&;]token=)([^&#\s\"']*)", re.IGNORECASE
)


def one_line(exc: BaseException | str) -> str:
    """An error for a log line: its type and message on one line (libpq's
    messages carry newlines and tabs: "server closed the connection
    unexpectedly\\n\\tThis probably means ...")."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, str) else f"{type(exc).__name__}: {text}"


def redact_dsn(dsn: str) -> str:
    """Return ``dsn`` with any password replaced by ``***``.

    Covers URL DSNs (``postgresql://user:***@host``, the password running to
    the last ``@`` before the host), key=value DSNs and query parameters
    (``password=***``), and tokens in URLs or logged request lines
    (``?token=***``), so that the text may be printed or logged.
    """
    text = _URL_PASSWORD_RE.sub(lambda m: m.group(1) + "***" + m.group(3), dsn)

    def _keyword(m: re.Match[str]) -> str:
        if m.group(1):
            return m.group(1) + "***"
        return m.group(3) + "***"

    return _KEYWORD_SECRET_RE.sub(_keyword, text)


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
# The statement itself is refused: the same call fails the same way.
_REJECTED_CLASSES = ("22", "23", "42", "54")


def from_psycopg(
    exc: BaseException, *, dsn: str | None = None, queue: str | None = None
) -> RingqError:
    """Map a psycopg exception to the ringq class a user can act on.

    By SQLSTATE: 08 (connection), 53 (resources), 57P01-57P05 (shutdown,
    crash, cannot connect now, database dropped, session timeout) ->
    :class:`DatabaseUnavailable`; 40001, 40P01, 55P03 (serialization,
    deadlock, lock not available) -> :class:`TransactionConflict`; 22, 23,
    42, 54 (data, integrity, syntax/access, limits) -> :class:`StatementRejected`;
    RQ001 (a guarded row write did not match) -> :class:`StaleSection`.
    A driver error without a code (refused connection, lost connection) is
    :class:`DatabaseUnavailable`; any other is :class:`DatabaseError`.
    """
    if isinstance(exc, RingqError):
        return exc
    if isinstance(exc, psycopg.errors.UndefinedTable) and queue:
        return QueueNotFound(f"queue {queue!r} does not exist", queue=queue)
    if isinstance(exc, psycopg.errors.InvalidSchemaName | psycopg.errors.UndefinedTable):
        return SchemaMissing(f"ringq schema missing or incomplete: {exc}")
    state: str | None = getattr(exc, "sqlstate", None)
    if state is None and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) or (
        state is not None and (state[:2] in _UNAVAILABLE_CLASSES or state in _UNAVAILABLE_STATES)
    ):
        where = f" at {redact_dsn(dsn)!r}" if dsn else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return DatabaseUnavailable(f"database unavailable{where}: {redact_dsn(first)}")
    if state == STALE_SQLSTATE:
        table = getattr(getattr(exc, "diag", None), "table_name", None) or ""
        name = table.removeprefix("q_") or queue
        return StaleSection(
            f"queue {name!r}: a row write did not find its row as the global section said "
            "(stale section); nothing of the transaction committed: retry it",
            queue=name,
        )
    if state is not None and (state in _CONFLICT_STATES or state[:2] == "40" and state != "40002"):
        return TransactionConflict(
            f"transaction rolled back, retry it: {_primary(exc)}", sqlstate=state
        )
    if state is not None and state[:2] in _REJECTED_CLASSES:
        return StatementRejected(_primary(exc), sqlstate=state)
    return DatabaseError(str(exc).strip() or type(exc).__name__, sqlstate=state)


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
def converted(*, dsn: str | None = None, queue: str | None = None) -> Iterator[None]:
    """Run a block and re-raise any psycopg error as its ringq class (``raise X from exc``)."""
    try:
        yield
    except psycopg.Error as exc:
        raise from_psycopg(exc, dsn=dsn, queue=queue) from exc
