"""The driver boundary: connections, the wire, SQL files, error conversion, DSNs, queue names.

The engine's bottom layer: it imports no other layer. What it offers the
layers above: its public modules :mod:`.errors` (the exception tree, which
``ringq.engine`` shows whole), :mod:`.pg` (connections and statements, psycopg's
errors turned into the tree; ``ringq.engine.pg`` shows it) and :mod:`.wire`
(how a session's statements go on the wire); and, below, the engine's named
SQL (``QUERIES``, from ``engine/queries.sql``), SQL files, DSNs and queue names.
"""

from __future__ import annotations

from ._dsn import check_dsn, dsn_file, read_dsn_file, resolve_dsn, ringq_home
from ._names import queue_table, validate_queue_name
from ._queries import QUERIES
from ._sqlfile import compose, load

__all__ = [
    "QUERIES",
    "check_dsn",
    "compose",
    "dsn_file",
    "load",
    "queue_table",
    "read_dsn_file",
    "resolve_dsn",
    "ringq_home",
    "validate_queue_name",
]
