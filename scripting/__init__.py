"""ringq.scripting: SQL generation for queues (queue scripting), queue
administration, and the embedded PostgreSQL cluster."""

from ._admin import QueueDetails, QueueSummary, connect_admin, describe_queue, list_queues
from ._cluster import Cluster, ClusterError, ClusterStatus, PostgresNotFound
from ._ddl import (
    SCHEMA_VERSION,
    QueueSpec,
    create_queue,
    create_queue_script,
    create_schema,
    drop_queue,
)

__all__ = [
    "SCHEMA_VERSION",
    "Cluster",
    "ClusterError",
    "ClusterStatus",
    "PostgresNotFound",
    "QueueDetails",
    "QueueSpec",
    "QueueSummary",
    "connect_admin",
    "create_queue",
    "create_queue_script",
    "create_schema",
    "describe_queue",
    "drop_queue",
    "list_queues",
]
