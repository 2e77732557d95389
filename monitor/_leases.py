"""Step ``leases``: end the sessions that hold a dequeued entry past its queue's lease."""

from __future__ import annotations

import logging

from ringq.engine import layout as L
from ringq.engine.recovery import end_holders, overdue_holders

from . import _events as E
from ._link import Link
from ._recover import RecoveryStep
from ._section import Attachment
from ._step import Note, Settings


class ExpireLeases(RecoveryStep):
    """Step ``leases``. A holding left alone once (a prepared transaction, a
    backend that would not end) is not tried again every pass: recovery
    decides it later."""

    def __init__(self, attachment: Attachment, link: Link, settings: Settings, note: Note) -> None:
        super().__init__(attachment, link, settings, note)
        self.expired = 0  # leases expired since the monitor started
        # (client, hold start) past the lease, not ended
        self._left: set[tuple[int, int]] = set()

    def run(self) -> None:
        sec = self._attachment.current()
        found = overdue_holders(sec)
        still = {(h.cidx, h.since_ns) for h in found}
        self._left = {k for k in self._left if k in still}
        holders = [h for h in found if (h.cidx, h.since_ns) not in self._left]
        if not holders:
            return
        ended = end_holders(sec, self._settings().dsn, holders)
        done = {(h.cidx, h.since_ns) for h, _rec in ended}
        for h in holders:
            if (h.cidx, h.since_ns) not in done and sec.c(h.cidx, L.C_HOLD_SINCE_NS) == h.since_ns:
                self._left.add((h.cidx, h.since_ns))
                self._note(
                    "entry.lease_not_ended", logging.WARNING, **h.as_dict(),
                    reason="past the lease, but in a prepared transaction, or its backend "
                    "could not be ended (the monitor's role may not signal it)",
                )
        for holder, rec in ended:
            self.expired += 1
            info = {**holder.as_dict(), "slots": rec.slots, "rolled_back": rec.rolled_back,
                    "committed": rec.committed}
            self._note(
                "entry.lease_expired", logging.WARNING,
                reason="held a dequeued entry past the queue's lease: backend terminated", **info,
            )
            queue = holder.queues[0] if holder.queues else None
            self._link.publish(E.make_event(E.ENTRY_LEASE_EXPIRED, queue, **info))
