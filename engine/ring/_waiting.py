"""Entries that wait for their due time: a delayed enqueue, or a delivery
given back with a retry backoff (issue 24).

A waiting entry is committed but neither ready nor done: inside the window,
its ENQ, DEQ and LCK bits are clear (no other slot inside the window looks
so: a reserved slot has LCK, a void or consumed one DEQ), and its due time
(the database's clock, us since the epoch) is in the DUE array. Ready scans
pass it by for free (they look for ENQ), and the tail stops at it (it is not
done). The queue block counts the waiting entries (``Q_N_WAITING``) and keeps
the earliest due time (``Q_NEXT_DUE_US``); a claim looks at the count only
(one word), and once the database's clock as this host estimates it
(``Section.db_clock_us``) passes the earliest due time it releases every
entry due (sets ENQ) with one vectorized pass over the window, then counts
again. So a queue with none pays one word read per claim, and a claim walks
the waiting entries only when one of them falls due.

Every function here is called under the queue's lock. Order of writes
(a process killed between two of them leaves a state the next claim or load
repairs): the due time and the counters before the bits change; on a
release, the ENQ bits before the counters, which are recounted from the
bits (a count left too high costs one more pass, never a lost entry).
"""

from __future__ import annotations

from ..section import layout as L
from ._scan import RingScan, bit_mask

# A sleeping dequeuer looks again at most this late after the next due time
# (its wake-up is bounded by it; the estimate of the database's clock is
# behind by about a round trip, so it may find the entry not due yet once).
_DUE_SLACK_S = 0.001


def waits(ring: RingScan, due_us: int) -> bool:
    """Whether an entry due at ``due_us`` (0: none) is not due yet."""
    return due_us > 0 and due_us > ring.sec.db_clock_us()


def make_waiting(ring: RingScan, slot: int, due_us: int) -> None:
    """Record that the entry of ``slot`` (still locked by its finisher) waits
    until ``due_us``; the caller then clears its bits (ENQ, DEQ) and LCK."""
    Q, b = ring.Q, ring.qb
    ring.sec.due_w[ring.base + slot] = due_us
    Q[b + L.Q_N_WAITING] += 1
    nd = Q[b + L.Q_NEXT_DUE_US]
    if not nd or due_us < nd:
        Q[b + L.Q_NEXT_DUE_US] = due_us


def release_due(ring: RingScan) -> int:
    """Release the waiting entries that are due (set ENQ), once the database's
    clock passed the earliest due time; returns how many became ready."""
    Q, b = ring.Q, ring.qb
    nd = Q[b + L.Q_NEXT_DUE_US]
    if nd and nd > ring.sec.db_clock_us():
        return 0
    s = ring.sec
    now = s.db_clock_us()
    slots = ring.waiting_slots()
    released = 0
    if slots.size:
        dues = s.due[ring.base + slots]
        ripe = dues <= now
        if ripe.any():
            out = slots[ripe]
            lo, mask = bit_mask(out)
            s.enq[ring.w0 + lo : ring.w0 + lo + mask.size] |= mask
            released = int(out.size)
            dues = dues[~ripe]
        Q[b + L.Q_N_WAITING] = int(dues.size)
        Q[b + L.Q_NEXT_DUE_US] = int(dues.min()) if dues.size else 0
    else:
        Q[b + L.Q_N_WAITING] = 0
        Q[b + L.Q_NEXT_DUE_US] = 0
    return released


def until_due_s(ring: RingScan) -> float:
    """Seconds until the queue's earliest waiting entry falls due (by the
    estimate of the database's clock), read without the lock: a sleeping
    dequeuer's wake-up is bounded by it. A large number if none waits."""
    Q, b = ring.Q, ring.qb
    if not Q[b + L.Q_N_WAITING]:
        return 3600.0
    nd = Q[b + L.Q_NEXT_DUE_US]
    now = ring.sec.db_clock_us()
    if not nd or not now:
        return 3600.0 if not nd else 0.1
    return max(0.0, (nd - now) / 1e6 + _DUE_SLACK_S)


def due_now(ring: RingScan) -> bool:
    """Whether a waiting entry has fallen due (read without the lock: a hint)."""
    Q, b = ring.Q, ring.qb
    if not Q[b + L.Q_N_WAITING]:
        return False
    nd = Q[b + L.Q_NEXT_DUE_US]
    return not nd or nd <= ring.sec.db_clock_us()
