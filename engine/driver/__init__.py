"""The driver boundary: connections, the wire, SQL files, error conversion, DSNs, queue names.

The engine's bottom layer: it imports no other layer. Its face, below, is
what the layers above use: the exception tree, the one mapping of psycopg's
errors into it, connections and statements (:mod:`._pg`), the engine's named
SQL (``QUERIES``, from ``engine/queries.sql``), DSNs and queue names; and its
public module :mod:`.wire` (how a session's statements go on the wire).
"""

from __future__ import annotations

from ._dsn import check_dsn, dsn_file, read_dsn_file, resolve_dsn, ringq_home
from ._errors import (
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    EntryNotFound,
    InDoubt,
    InFlight,
    InvalidArgument,
    InvalidArgumentType,
    InvalidQueueName,
    PayloadTooLarge,
    QueueError,
    QueueExists,
    QueueFull,
    QueueNotFound,
    Retryable,
    RingqError,
    RolledBack,
    SchemaMissing,
    SectionError,
    SectionIncompatible,
    SessionClosed,
    StaleSection,
    StatementRejected,
    TransactionConflict,
    TransactionError,
    one_line,
    password_fragments,
    redact_dsn,
    scrub,
    scrub_exception,
)
from ._names import queue_table, validate_queue_name
from ._pg import (
    STALE_SQLSTATE,
    UNIQUE_VIOLATION,
    Params,
    connect,
    connected,
    converted,
    from_callers_statement,
    from_psycopg,
    run,
    stale_section,
    transaction,
)
from ._queries import QUERIES
from ._sqlfile import compose, load

__all__ = [
    "QUERIES",
    "STALE_SQLSTATE",
    "UNIQUE_VIOLATION",
    "ConfigError",
    "DatabaseError",
    "DatabaseUnavailable",
    "EntryNotFound",
    "InDoubt",
    "InFlight",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidQueueName",
    "Params",
    "PayloadTooLarge",
    "QueueError",
    "QueueExists",
    "QueueFull",
    "QueueNotFound",
    "Retryable",
    "RingqError",
    "RolledBack",
    "SchemaMissing",
    "SectionError",
    "SectionIncompatible",
    "SessionClosed",
    "StaleSection",
    "StatementRejected",
    "TransactionConflict",
    "TransactionError",
    "check_dsn",
    "compose",
    "connect",
    "connected",
    "converted",
    "dsn_file",
    "from_callers_statement",
    "from_psycopg",
    "load",
    "one_line",
    "password_fragments",
    "queue_table",
    "read_dsn_file",
    "redact_dsn",
    "resolve_dsn",
    "ringq_home",
    "run",
    "scrub",
    "scrub_exception",
    "stale_section",
    "transaction",
    "validate_queue_name",
]
