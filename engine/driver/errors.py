"""The ringq exception tree, and the redaction of DSNs in its messages.

Every error ringq raises on purpose derives from :class:`RingqError`. psycopg
errors become these classes through one mapping, :func:`ringq.engine.pg.from_psycopg`
(``engine/driver/pg.py``), applied where ringq meets PostgreSQL: the functions of
:mod:`ringq.engine.pg` that every package opens connections and runs
statements with, and the session's ``Link.call`` (``engine/session/_link.py``). So a
caller never has to catch a driver exception to handle a ringq failure.
This module holds no psycopg import: the tree is the API, the mapping is the
boundary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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


class BehindSqlPuts(QueueFull):
    """The SQL inbox's pump only (``Session.behind_sql_puts``): slots of the
    queue are reserved for SQL producers, so nothing is reserved for the
    inbox's entries now (they would get seqs past slots a producer's later
    puts may still fill)."""


class PayloadTooLarge(QueueError):
    """The payload is longer than the queue's ``max_payload`` bytes."""


class DuplicateKey(QueueError):
    """Reserved: an idempotency key conflict that could not be resolved."""


class SessionClosed(RingqError):
    """The session was closed (or its connection lost) and cannot be used."""


class TransactionError(RingqError):
    """The transaction is in a state that does not allow the operation."""


class Retryable(TransactionError):
    """Nothing of the transaction committed, and it is known: retry it whole.

    The base of every error after which the same transaction, run again,
    may well succeed: :class:`TransactionConflict` (PostgreSQL chose it as
    a victim), :class:`StaleSection` (the section was stale) and
    :class:`RolledBack` (the connection was lost and the rows show it did
    not commit). A retry loop catches this one class. :class:`InDoubt` is
    not one of them: its outcome is not known yet."""


class TransactionConflict(Retryable):
    """PostgreSQL rolled the transaction back to resolve a conflict with a
    concurrent one (SQLSTATE class 40: serialization failure, deadlock; or
    55P03 lock not available). Nothing of it committed: retry the transaction.
    ``sqlstate`` is PostgreSQL's code."""

    def __init__(self, message: str, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class StaleSection(Retryable):
    """A queue row write sent at commit (or ``flush()``) did not find its row
    as the global section said (the section was stale: rebuilt, restored,
    or the table written around ringq), so PostgreSQL refused it and nothing
    of the transaction committed. The transaction was rolled back, its
    reservations voided and the queue's block resynced from the rows: retry
    the transaction, as after a serialization failure. ``queue`` names the queue."""

    def __init__(self, message: str, *, queue: str | None = None) -> None:
        super().__init__(message)
        self.queue = queue


class RolledBack(Retryable):
    """The connection was lost during the transaction (a commit whose answer
    never came, a rollback that could not be sent, a fail-over), and the
    engine decided from the rows, once the old backend had ended, that
    nothing of it committed: its dequeues come back (counted as a
    delivery), its enqueues never were. Retry the transaction; the session
    is usable again (on a new connection). ``reason`` is what was lost."""

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason

    @classmethod
    def lost(cls, what: str, cause: object) -> RolledBack:
        """``what`` happened (and nothing committed), then ``cause``'s text on
        one line, which is also the error's ``reason``."""
        reason = one_line(str(cause))
        return cls(f"{what}: {reason}", reason=reason)


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


def _query_and_at(url: str) -> tuple[int, int]:
    """Where the query of the URL whose authority starts ``url`` begins (its
    first ``key=`` after an "@" or after the hosts and a path; else the
    URL's end), and the last "@" before it (-1: none)."""
    query = len(url)
    for key in _QUERY_KEY_RE.finditer(url):
        before = url[: key.start()]
        if "@" in before or _HOSTS_PATH_RE.fullmatch(before):
            query = key.start()
            break
    return query, url.rfind("@", 0, query)


def _redact_url(text: str, start: int) -> tuple[str, int]:
    """The URL whose authority starts at ``text[start]``, redacted, and where
    it ends (at a blank, or past a blank inside a password libpq rejects)."""
    end = _url_end(text, start)
    url = _QUERY_SECRET_RE.sub(lambda k: k.group(1) + "***", text[start:end])
    at = _query_and_at(url)[1]
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


# Scrubbing: libpq's own messages quote pieces of the DSN it read, and where it
# read a password's piece as a host, a port or a database name, the piece is
# shown ("failed to resolve host 'word@127.0.0.1'" for the password "Pa55@word").
# redact_dsn cannot see these: they are no longer a DSN. So every text of the
# DSN that could be a password, under any reading, is hidden in a message:
# the password to the LAST "@" before the host (the writer's) and to the first
# "@" before any "/" (libpq's), each raw and URL-decoded, a password=... value
# read as libpq does and to the next "key=", and every piece of these between
# the characters libpq may split a DSN at.
#
# Where a fragment is hidden: never inside a longer run of letters and digits
# (a password "word" leaves "password" alone: blanking "pass***" would also
# tell the password by what is left around it). A fragment of SHORT (4)
# characters or more is hidden wherever else it occurs; a shorter one only
# between the characters that bound what libpq quotes of a DSN (blanks, quotes,
# DSN punctuation) or the text's ends, not next to "." or "-": a password "a"
# or "1" is hidden in "host 'a@h'", 'after "a"', "port '1'", but "127.0.0.1"
# and "[Errno -2]" stay readable.
SHORT = 4
_PIECE_SPLIT_RE = re.compile(r"[@/?#:,&=;\s'\"\\\[\]]+")
_EDGE = r"""\s@/?#:,&=;'"\\\[\]()<>"""
_KEYWORD_START_RE = re.compile(r"(?<!\w)\w*password\s*=\s*", re.IGNORECASE)
_NEXT_KEYWORD_RE = re.compile(r"(?:\s+|&)[A-Za-z_]+\s*=")
_QUOTED_RE = re.compile(r"'((?:[^'\\]|\\[\s\S])*)'?")


def password_fragments(*dsns: str | None) -> tuple[str, ...]:
    """Every text of ``dsns`` that could be a password, longest first.

    For a URL, the password up to the last "@" before the host part and up to
    the first "@" before any "/" (where libpq ends it), even with no "@" at
    all (``u:pa/ss@h`` is host "u", port "pa" to libpq); for ``password=``
    (key=value, or a URL's query; ``sslpassword=`` too) its value as libpq
    reads it and up to the next ``key=``; each raw and URL-decoded or
    unquoted, and each cut at every character libpq may split a DSN at
    (``@ / ? # : , & = ;``, blanks, quotes). Texts that are no DSN give none.
    """
    readings: set[str] = set()
    for dsn in dsns:
        if not dsn:
            continue
        urls = list(_SCHEME_RE.finditer(dsn))
        for i, m in enumerate(urls):
            end = urls[i + 1].start() if i + 1 < len(urls) else len(dsn)
            readings.update(_url_passwords(dsn[m.end() : end]))
        for k in _KEYWORD_START_RE.finditer(dsn):
            rest = dsn[k.end() :]
            if dsn[k.start() - 1 : k.start()] in ("?", "&"):
                # a URL's query: libpq ends the value at "&"
                readings.add(rest.split("&", 1)[0])
            elif (narrow := _KEYWORD_SECRET_RE.match(dsn, k.start())) is not None:
                readings.add(narrow.group(2))
            broad = _NEXT_KEYWORD_RE.search(rest)
            readings.add(rest[: broad.start()] if broad else rest)
    fragments: set[str] = set()
    for reading in readings:
        for form in (reading, _unquote(reading), _unescape(reading)):
            fragments.add(form.strip())
            fragments.update(_PIECE_SPLIT_RE.split(form))
    fragments.discard("")
    return tuple(sorted(fragments, key=lambda f: (-len(f), f)))


def _url_passwords(url: str) -> list[str]:
    """The readings of the password of the URL whose authority starts ``url``
    (which runs to the text's end: a password with blanks is read whole)."""
    query, at = _query_and_at(url)
    out: list[str] = []
    if at >= 0:
        colon = url.find(":", 0, at)
        if colon >= 0:
            out.append(url[colon + 1 : at])
        first = re.search(r"[@/]", url)
        if first is not None and first.group() == "@":
            colon = url.find(":", 0, first.start())
            if colon >= 0:
                out.append(url[colon + 1 : first.start()])
    else:
        user_colon = _USER_COLON_RE.match(url)
        if user_colon is not None and not _PORT_RE.match(url, user_colon.end()):
            out.append(url[user_colon.end() : query])
    return out


def _unquote(text: str) -> str:
    """``text`` URL-decoded as libpq decodes a URL's parts (``+`` stays)."""
    from urllib.parse import unquote

    return unquote(text)


def _unescape(text: str) -> str:
    """A key=value value as libpq reads it: quotes off, backslash escapes undone."""
    text = text.strip()
    quoted = _QUOTED_RE.fullmatch(text)
    if quoted is not None:
        text = quoted.group(1)
    return re.sub(r"\\([\s\S])", r"\1", text)


# The pattern of each DSN's fragments, made once (an error converted with its
# DSN is scrubbed: a conflict under contention should not rebuild it each time).
_PATTERNS: dict[tuple[str | None, ...], re.Pattern[str] | None] = {}


def _pattern(dsns: tuple[str | None, ...]) -> re.Pattern[str] | None:
    try:
        return _PATTERNS[dsns]
    except KeyError:
        pass
    made = _fragment_re(password_fragments(*dsns))
    if len(_PATTERNS) >= 64:
        _PATTERNS.clear()
    _PATTERNS[dsns] = made
    return made


def _fragment_re(fragments: tuple[str, ...]) -> re.Pattern[str] | None:
    alternatives = [
        rf"(?<![^\W_]){re.escape(f)}(?![^\W_])"
        if len(f) >= SHORT
        else rf"(?<![^{_EDGE}]){re.escape(f)}(?![^{_EDGE}])"
        for f in fragments
    ]
    return re.compile("|".join(alternatives)) if alternatives else None


def scrub(text: str, *dsns: str | None) -> str:
    """``text`` fit to print or log, given the DSNs it may quote pieces of:
    :func:`redact_dsn`, then every :func:`password_fragments` of ``dsns``
    replaced by ``***``, never inside a longer run of letters and digits (a
    password "word" leaves "password" readable). Fragments of :data:`SHORT`
    (4) characters or more are hidden wherever else they occur, shorter ones
    only where they stand alone between blanks, quotes, DSN punctuation
    (``@ / ? # : , & = ; [ ] ( ) < >``) or the text's ends: a password "a"
    is hidden in ``host 'a@h'``, but "127.0.0.1" stays readable when the
    password is "1"."""
    text = redact_dsn(text)
    pattern = _pattern(dsns)
    return text if pattern is None else pattern.sub("***", text)


def scrub_exception(exc: BaseException, *dsns: str | None) -> None:
    """Scrub ``exc`` in place (see :func:`scrub`), and every exception chained
    to it (``__cause__``, ``__context__``): their messages (``args``) and notes
    are what ``str``, ``repr`` and a printed traceback show."""
    pattern = _pattern(dsns)

    def clean(text: str) -> str:
        text = redact_dsn(text)
        return text if pattern is None else pattern.sub("***", text)

    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.args = tuple(clean(a) if isinstance(a, str) else a for a in e.args)
        notes = getattr(e, "__notes__", None)
        if isinstance(notes, list):
            notes[:] = [clean(n) if isinstance(n, str) else n for n in notes]
        todo += [e.__cause__, e.__context__]
