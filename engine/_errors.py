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


# Redaction errs towards hiding: where libpq and the writer of a DSN may read
# it differently, the longer reading of the password is hidden.
#
# URLs: libpq ends the user information at the FIRST "@" before any "/"
# ("u:pa@ss/word@h" is password "pa", host "ss", dbname "word@h"), but whoever
# wrote an unescaped "@", "/", "?" or "#" into a password meant it to run to the
# LAST "@" before the host part, so that is where the hidden part ends. A "@"
# in the query string ("?application_name=a@b") is not that "@": the query
# starts at "?key=" after a "@", or after a plain host list and path.
_SCHEME_RE = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://")
_QUERY_KEY_RE = re.compile(r"\?[A-Za-z_]+=")
_HOST = r"(?:\[[^\]/]*\]|[^:/@,\[\]?]*)(?::[0-9]*)?"
_HOSTS_PATH_RE = re.compile(rf"{_HOST}(?:,{_HOST})*(?:/[^@?]*)?")
# "user:" at the start of the authority, and a port after it (not a password).
_USER_COLON_RE = re.compile(r"[^:/?@\[\s]*:")
_PORT_RE = re.compile(r"[0-9]*(?:[,/?]|$)")
# password=... in a URL query: libpq ends the value at "&"; it runs here to the
# next "&key=" ("a&b" is one value) or the end of the URL.
_QUERY_SECRET_RE = re.compile(r"([?&][A-Za-z_]*password=)(.*?)(?=&[A-Za-z_]+=|$)", re.IGNORECASE)
# key=value DSNs (libpq skips blanks around "=", reads '...' with backslash
# escapes, and a backslash escapes a blank in an unquoted value), and any
# PGPASSWORD=..., sslpassword=...; quoted pieces run on ('it''s' is hidden
# whole, though libpq rejects it), an unterminated quote to the end.
_KEYWORD_SECRET_RE = re.compile(
    r"\b(\w*password\s*=\s*)((?:'(?:[^'\\]|\\[\s\S])*'?|\\[\s\S]?|[^\s'\\])*)", re.IGNORECASE
)
# A token in a URL or a logged request line (?token=..., &token=...).
_TOKEN_RE = re.compile(r"([?&;]token=)([^&#\s\"']*)", re.IGNORECASE)


def one_line(exc: BaseException | str) -> str:
    """An error for a log line: its type and message on one line (libpq's
    messages carry newlines and tabs: "server closed the connection
    unexpectedly\\n\\tThis probably means ...")."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, str) else f"{type(exc).__name__}: {text}"


def redact_dsn(dsn: str) -> str:
    """Return ``dsn`` with any password replaced by ``***``.

    Covers URL DSNs (``postgresql://user:***@host``, the password running to
    the last ``@`` before the host, even where libpq would cut it shorter),
    key=value DSNs and query parameters (``password=***``, quoted or escaped
    values whole), DSNs libpq rejects (a password with blanks), and tokens
    in URLs or logged request lines (``?token=***``), so that the text may
    be printed or logged. Several DSNs in one text are each redacted.
    """
    out: list[str] = []
    pos = 0
    while (m := _SCHEME_RE.search(dsn, pos)) is not None:
        out.append(_redact_keywords(dsn[pos : m.end()]))
        shown, pos = _redact_url(dsn, m.end())
        out.append(shown)
    out.append(_redact_keywords(dsn[pos:]))
    return _TOKEN_RE.sub(lambda t: t.group(1) + "***", "".join(out))


def _redact_keywords(text: str) -> str:
    return _KEYWORD_SECRET_RE.sub(lambda k: k.group(1) + "***", text)


def _url_end(text: str, start: int) -> int:
    blank = re.search(r"\s", text[start:])
    return start + blank.start() if blank else len(text)


def _redact_url(text: str, start: int) -> tuple[str, int]:
    """The URL whose authority starts at ``text[start]``, redacted, and where
    it ends (at a blank, or past a blank inside a password libpq rejects)."""
    end = _url_end(text, start)
    url = _QUERY_SECRET_RE.sub(lambda k: k.group(1) + "***", text[start:end])
    query = len(url)
    for key in _QUERY_KEY_RE.finditer(url):
        before = url[: key.start()]
        if "@" in before or _HOSTS_PATH_RE.fullmatch(before):
            query = key.start()
            break
    at = url.rfind("@", 0, query)
    if at >= 0:
        user = url.find(":", 0, at)
        return (url if user < 0 else url[: user + 1] + "***" + url[at:]), end
    user_colon = _USER_COLON_RE.match(url)
    if user_colon is None or _PORT_RE.match(url, user_colon.end()):
        return url, end
    # "user:secret" and no "@" before a blank: a password with blanks (libpq
    # rejects it) ends at a "@" further on the line, else hide the rest.
    line_end = text.find("\n", end)
    at = text.find("@", end, line_end if line_end >= 0 else len(text))
    if at < 0:
        return url[: user_colon.end()] + "***", end
    host_end = _url_end(text, at)
    return url[: user_colon.end()] + "***" + text[at:host_end], host_end


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
    if (state is None and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)) or (
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
