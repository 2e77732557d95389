"""ringq.engine: the linked client API.

Sessions enqueue and dequeue inside the caller's own PostgreSQL transaction;
a shared-memory global section finds ready slots without scanning tables.
"""

from ._dsn import resolve_dsn, ringq_home
from ._errors import (
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    EntryNotFound,
    InDoubt,
    InvalidQueueName,
    PayloadTooLarge,
    QueueError,
    QueueExists,
    QueueFull,
    QueueNotFound,
    RingqError,
    SchemaMissing,
    SectionError,
    SectionIncompatible,
    SessionClosed,
    TransactionError,
    redact_dsn,
)
from ._events import CHANNEL as EVENTS_CHANNEL
from ._events import Event, Subscription, publish, subscribe
from ._names import validate_queue_name
from ._section import Section
from ._session import Message, QueueInfo, Session, connect

__all__ = [
    "EVENTS_CHANNEL",
    "ConfigError",
    "DatabaseError",
    "DatabaseUnavailable",
    "EntryNotFound",
    "Event",
    "InDoubt",
    "InvalidQueueName",
    "Message",
    "PayloadTooLarge",
    "QueueError",
    "QueueExists",
    "QueueFull",
    "QueueInfo",
    "QueueNotFound",
    "RingqError",
    "SchemaMissing",
    "Section",
    "SectionError",
    "SectionIncompatible",
    "Session",
    "SessionClosed",
    "Subscription",
    "TransactionError",
    "connect",
    "publish",
    "redact_dsn",
    "resolve_dsn",
    "ringq_home",
    "subscribe",
    "validate_queue_name",
]

# Limits of the global section (a queue's capacity is checked against them).
from ._layout import MAX_CAPACITY, MAX_QUEUES

__all__ += ["MAX_CAPACITY", "MAX_QUEUES"]

# Moving entries between databases, and exactly-once effects (issue 7).
from ._applied import already_applied, applied_identity, create_applied_table
from ._move import (
    MoveConfig,
    Moved,
    MoveLockHeld,
    Mover,
    MoveSourceShared,
    is_moved,
    move_key,
    unwrap,
    wrap,
)

__all__ += [
    "MoveConfig",
    "MoveLockHeld",
    "MoveSourceShared",
    "Moved",
    "Mover",
    "already_applied",
    "applied_identity",
    "create_applied_table",
    "is_moved",
    "move_key",
    "unwrap",
    "wrap",
]

# Workers: the container that runs an action for each message (issue 8).
from ._worker import (
    Action,
    ActionAborted,
    ActionInterrupted,
    Actions,
    ActionTimeout,
    Decline,
    PoolConfig,
    Worker,
    WorkerConfig,
    WorkerExit,
    WorkerPool,
    load_actions,
)

__all__ += [
    "Action",
    "ActionAborted",
    "ActionInterrupted",
    "ActionTimeout",
    "Actions",
    "Decline",
    "PoolConfig",
    "Worker",
    "WorkerConfig",
    "WorkerExit",
    "WorkerPool",
    "load_actions",
]
