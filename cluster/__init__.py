"""ringq.cluster: the embedded PostgreSQL cluster (``ringq db``): a private
server under ``$RINGQ_HOME``, and optionally a streaming standby of it on the
same host, with promotion and rebuild. It depends on the engine alone; the
CLI, the scripting and the regression use it. ``CLUSTER.md`` has the details.
"""

from ._cluster import Cluster
from ._errors import ClusterError, NoStandby, PostgresNotFound
from ._programs import find_bindir
from ._server import ClusterStatus
from ._standby import StandbyStatus

__all__ = [
    "Cluster",
    "ClusterError",
    "ClusterStatus",
    "NoStandby",
    "PostgresNotFound",
    "StandbyStatus",
    "find_bindir",
]
