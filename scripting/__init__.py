"""ringq.scripting: SQL generation for queues, and the embedded PostgreSQL cluster."""

from ._cluster import Cluster, ClusterError, ClusterStatus, PostgresNotFound

__all__ = ["Cluster", "ClusterError", "ClusterStatus", "PostgresNotFound"]
