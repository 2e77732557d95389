"""The ringq exception tree.

Every error ringq raises on purpose derives from :class:`RingqError`; psycopg
errors are converted in exactly one place (:func:`convert`), so a caller never
has to catch a driver exception to handle a ringq failure.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

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


class InDoubt(TransactionError):
    """The commit's answer was lost: the outcome is decided later from the rows.

    The entries are never lost or duplicated; the session (or the monitor)
    decides each slot from its row once the old backend has ended.
    """


class DatabaseUnavailable(RingqError):
    """The database cannot be reached (the DSN is named without its password)."""


class DatabaseError(RingqError):
    """PostgreSQL reported an error that ringq does not map to a more precise class."""


class SchemaMissing(RingqError):
    """The ringq schema is absent or of an unknown version: create a queue first."""


class SectionError(RingqError):
    """The shared-memory global section is missing, full or of a foreign layout."""


class SectionIncompatible(SectionError):
    """The global section was made by another layout version; refuse to use it."""


_PASSWORD_RE = re.compile(r"(password\s*=\s*)('[^']*'|\S+)|(://[^:/@]+:)([^@]+)(@)", re.IGNORECASE)


def redact_dsn(dsn: str) -> str:
    """Return ``dsn`` with any password replaced by ``***``."""

    def _sub(m: re.Match[str]) -> str:
        if m.group(1):
            return m.group(1) + "***"
        return m.group(3) + "***" + m.group(5)

    return _PASSWORD_RE.sub(_sub, dsn)


def from_psycopg(exc: BaseException, *, dsn: str | None = None, queue: str | None = None) -> RingqError:
    """Map a psycopg exception to the ringq class a user can act on."""
    if isinstance(exc, RingqError):
        return exc
    if isinstance(exc, psycopg.errors.UndefinedTable) and queue:
        return QueueNotFound(f"queue {queue!r} does not exist", queue=queue)
    if isinstance(exc, psycopg.errors.InvalidSchemaName | psycopg.errors.UndefinedTable):
        return SchemaMissing(f"ringq schema missing or incomplete: {exc}")
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        where = f" at {redact_dsn(dsn)!r}" if dsn else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return DatabaseUnavailable(f"database unavailable{where}: {first}")
    return DatabaseError(str(exc).strip() or type(exc).__name__)


@contextmanager
def converted(*, dsn: str | None = None, queue: str | None = None) -> Iterator[None]:
    """Run a block and re-raise any psycopg error as its ringq class (``raise X from exc``)."""
    try:
        yield
    except psycopg.Error as exc:
        raise from_psycopg(exc, dsn=dsn, queue=queue) from exc
