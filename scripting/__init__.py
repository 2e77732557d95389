"""ringq.scripting: SQL generation for queues (queue scripting), queue
administration, and the embedded PostgreSQL cluster."""

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
from ._cluster import (
    Cluster,
    ClusterError,
    ClusterStatus,
    NoStandby,
    PostgresNotFound,
    StandbyStatus,
)
from ._ddl import (
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
    "MAX_FULL_TIMEOUT",
    "MAX_LEASE",
    "MAX_PAYLOAD",
    "SCHEMA_VERSION",
    "Cluster",
    "ClusterError",
    "ClusterStatus",
    "ExceptionEntry",
    "NoStandby",
    "PostgresNotFound",
    "QueueDetails",
    "QueueSpec",
    "QueueSummary",
    "StandbyStatus",
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
