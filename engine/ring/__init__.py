"""One queue block's operations: scan, claim bits, waiting entries, cache, finish, load.

Imports only the section and driver layers. Its face: the :class:`Ring` (one
queue block's words under its lock), the ops a session holds in flight and
the row codes that decide them, and the steps built on the ring: finishing
ops once the database decided, loading a block from its rows.
"""

from __future__ import annotations

from ._cache import Cached
from ._finish import after_finish, finish_batch, finish_one, finish_run
from ._kinds import POISON_REASON, DueWrite, OpKind, RowState, RowWrite, Write
from ._load import load_rows
from ._ops import Item, Op, Run, each_op, stretch
from ._queue_info import DEFAULT_LEASE, QueueInfo
from ._ring import Ring
from ._scan import group_tag

__all__ = [
    "DEFAULT_LEASE",
    "POISON_REASON",
    "Cached",
    "DueWrite",
    "Item",
    "Op",
    "OpKind",
    "QueueInfo",
    "Ring",
    "RowState",
    "RowWrite",
    "Run",
    "Write",
    "after_finish",
    "each_op",
    "finish_batch",
    "finish_one",
    "finish_run",
    "group_tag",
    "load_rows",
    "stretch",
]
