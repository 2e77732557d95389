"""ringq.scripting: SQL generation for queues (queue scripting) and queue
administration. The embedded PostgreSQL cluster is ringq.cluster."""

from ._admin import (
    ExceptionEntry,
    QueueDetails,
    QueueSummary,
    connect_admin,
    describe_queue,
    discard_exception,
    exception_queue_of,
    list_exceptions,
    list_queues,
    remove_section,
    requeue_exception,
)
from ._ddl import (
    DEFAULT_CACHE_PAYLOAD,
    MAX_CACHE_PAYLOAD,
    MAX_FULL_TIMEOUT,
    MAX_LEASE,
    MAX_PAYLOAD,
    SCHEMA_VERSION,
    QueueSpec,
    create_queue,
    create_queue_script,
    create_schema,
    drop_queue,
)

__all__ = [
    "DEFAULT_CACHE_PAYLOAD",
    "MAX_CACHE_PAYLOAD",
    "MAX_FULL_TIMEOUT",
    "MAX_LEASE",
    "MAX_PAYLOAD",
    "SCHEMA_VERSION",
    "ExceptionEntry",
    "QueueDetails",
    "QueueSpec",
    "QueueSummary",
    "connect_admin",
    "create_queue",
    "create_queue_script",
    "create_schema",
    "describe_queue",
    "discard_exception",
    "drop_queue",
    "exception_queue_of",
    "list_exceptions",
    "list_queues",
    "remove_section",
    "requeue_exception",
]
