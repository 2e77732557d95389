"""Deciding from the rows what the section cannot: recovery, in-doubt outcomes, leases.

Imports only the ring, section and driver layers. What it offers the layers
above: its public modules :mod:`.recovery` (what the monitor runs, and any
linked client may: ``ringq.engine.recovery`` shows it) and :mod:`.tracelog`
(the ``ringq.trace`` logger, on which the session's trace writes too); and,
below, deciding slots from their rows (a lost connection's, a dead client's,
a commit in doubt), loading and resyncing a queue's block, a session's help
with recovery, leases, and the gids of ringq's prepared transactions.
"""

from __future__ import annotations

from ._decide import (
    decide_lost,
    decide_ops,
    in_doubt_outcome,
    in_flight,
    load_queue,
    resync_queue,
    rows_outcome,
    wait_backend_gone,
)
from ._gid import TPC_BRANCH, gid_of
from ._help import help_due, help_recover, wait_dead_holders
from ._lease import Holder, end_holders, overdue_holders, recover_lost_backends

__all__ = [
    "TPC_BRANCH",
    "Holder",
    "decide_lost",
    "decide_ops",
    "end_holders",
    "gid_of",
    "help_due",
    "help_recover",
    "in_doubt_outcome",
    "in_flight",
    "load_queue",
    "overdue_holders",
    "recover_lost_backends",
    "resync_queue",
    "rows_outcome",
    "wait_backend_gone",
    "wait_dead_holders",
]
