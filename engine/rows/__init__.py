"""Deciding from the rows what the section cannot: recovery, in-doubt outcomes, leases.

Imports only the ring, section and driver layers. Its face: deciding slots
from their rows (a lost connection's, a dead client's, a commit in doubt),
loading and resyncing a queue's block, recovery and leases, the gids of
ringq's prepared transactions; and its public module :mod:`.tracelog` (the
``ringq.trace`` logger, on which the session's trace writes too).
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
from ._help import help_recover, wait_dead_holders
from ._lease import Holder, end_holders, overdue_holders, recover_lost_backends
from ._recovery import (
    DECIDED_GRACE_S,
    Recovered,
    history_of,
    queue_infos,
    queue_room,
    rebuild,
    rebuild_into,
    reclaim_all,
    recover_dead_clients,
    repair_lock_holders,
    resolve_prepared,
    section_differences,
    section_following,
)

__all__ = [
    "DECIDED_GRACE_S",
    "TPC_BRANCH",
    "Holder",
    "Recovered",
    "decide_lost",
    "decide_ops",
    "end_holders",
    "gid_of",
    "help_recover",
    "history_of",
    "in_doubt_outcome",
    "in_flight",
    "load_queue",
    "overdue_holders",
    "queue_infos",
    "queue_room",
    "rebuild",
    "rebuild_into",
    "reclaim_all",
    "recover_dead_clients",
    "recover_lost_backends",
    "repair_lock_holders",
    "resolve_prepared",
    "resync_queue",
    "rows_outcome",
    "section_differences",
    "section_following",
    "wait_backend_gone",
    "wait_dead_holders",
]
