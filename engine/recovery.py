"""Recovery, public: what the monitor runs (and any linked client may run) to
keep the global section true to the rows after failures::

    from ringq.engine.recovery import rebuild, reclaim_all, recover_dead_clients

    sec = rebuild(dsn)               # attach (or create) the section, load every queue
    recover_dead_clients(sec, dsn)   # decide the slots of clients killed at any point
    end_holders(sec, dsn, overdue_holders(sec))  # end sessions holding entries past the lease
    recover_lost_backends(sec, conn) # decide slots of live clients whose backend ended
    reclaim_all(sec)                 # advance tails, wake blocked enqueuers

The functions are defined in ``ringq/engine/rows/recovery.py`` and ``_lease.py``.
"""

from __future__ import annotations

from .rows import Holder, end_holders, overdue_holders, recover_lost_backends
from .rows.recovery import (
    DECIDED_GRACE_S,
    Recovered,
    history_of,
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
from .section import shared_section

__all__ = [
    "DECIDED_GRACE_S",
    "Holder",
    "Recovered",
    "end_holders",
    "history_of",
    "overdue_holders",
    "queue_room",
    "rebuild",
    "rebuild_into",
    "reclaim_all",
    "recover_dead_clients",
    "recover_lost_backends",
    "repair_lock_holders",
    "resolve_prepared",
    "section_differences",
    "section_following",
    "shared_section",
]

