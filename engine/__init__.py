"""ringq.engine: the linked client API.

Sessions enqueue and dequeue inside the caller's own PostgreSQL transaction;
a shared-memory global section finds ready slots without scanning tables.

The engine imports no other ringq package; the others build on it. Beside
the names below, its public submodules are :mod:`~ringq.engine.layout` (the
section's word indexes and limits), :mod:`~ringq.engine.recovery` (rebuild,
reclaim, dead clients, prepared transactions), :mod:`~ringq.engine.metrics`
(counter names), :mod:`~ringq.engine.exits` (exit codes),
:mod:`~ringq.engine.sqlfile` (named SQL blocks in ``.sql`` files) and
:mod:`~ringq.engine.pg` (the one way every package reaches PostgreSQL:
connections, statements, psycopg errors turned into the tree below).
"""

from .driver._dsn import check_dsn, dsn_file, read_dsn_file, resolve_dsn, ringq_home
from .driver._errors import (
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
from .driver._names import queue_table, validate_queue_name
from .driver._pg import converted, from_psycopg
from .ring._queue_info import DEFAULT_LEASE
from .ring._ring import Ring
from .rows._tracelog import enable_trace
from .section._layout import MAX_CAPACITY, MAX_QUEUES
from .section._section import Section, pid_alive, section_name
from .section._shm import (
    SectionInUse,
    SectionOnHost,
    ServerScan,
    Tidied,
    database_state,
    remove_section_on_host,
    scan_server,
    sections_on_host,
    tidy_sections,
)
from .session._events import CHANNEL as EVENTS_CHANNEL
from .session._events import Event, Subscription, publish, subscribe
from .session._session import Message, QueueInfo, Session, connect
from .session._validate import (
    MAX_DELAY,
    check_group,
    is_finite_number,
    validate_int,
    validate_seconds,
)

__all__ = [
    "DEFAULT_LEASE",
    "EVENTS_CHANNEL",
    "MAX_CAPACITY",
    "MAX_DELAY",
    "MAX_QUEUES",
    "ConfigError",
    "DatabaseError",
    "DatabaseUnavailable",
    "EntryNotFound",
    "Event",
    "InDoubt",
    "InFlight",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidQueueName",
    "Message",
    "PayloadTooLarge",
    "QueueError",
    "QueueExists",
    "QueueFull",
    "QueueInfo",
    "QueueNotFound",
    "Retryable",
    "Ring",
    "RingqError",
    "RolledBack",
    "SchemaMissing",
    "Section",
    "SectionError",
    "SectionInUse",
    "SectionIncompatible",
    "SectionOnHost",
    "ServerScan",
    "Session",
    "SessionClosed",
    "StaleSection",
    "StatementRejected",
    "Subscription",
    "Tidied",
    "TransactionConflict",
    "TransactionError",
    "check_dsn",
    "check_group",
    "connect",
    "converted",
    "database_state",
    "dsn_file",
    "enable_trace",
    "from_psycopg",
    "is_finite_number",
    "one_line",
    "password_fragments",
    "pid_alive",
    "publish",
    "queue_table",
    "read_dsn_file",
    "redact_dsn",
    "remove_section_on_host",
    "resolve_dsn",
    "ringq_home",
    "scan_server",
    "scrub",
    "scrub_exception",
    "section_name",
    "sections_on_host",
    "subscribe",
    "tidy_sections",
    "validate_int",
    "validate_queue_name",
    "validate_seconds",
]
