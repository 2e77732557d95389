"""Loading a queue block's positions and bitmaps from its table's rows
(a queue's first use, a resync, a rebuild): :func:`load_rows`, on a
:class:`~._ring.Ring` whose block the caller holds (its queue lock, or the
section lock for a block just allocated)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np

from ..section import layout as L
from ._kinds import RowState
from ._ring import Ring
from ._scan import group_tag, set_bits


def load_rows(
    ring: Ring,
    slots: np.ndarray,
    states: np.ndarray,
    seqs: np.ndarray,
    *,
    keep_locked: bool,
    held: list[tuple[int, int]] | None = None,
    groups: Sequence[tuple[int, str]] = (),
    offered: Sequence[tuple[int, int]] = (),
    dues: Sequence[tuple[int, int]] = (),
    reserved: Sequence[tuple[int, int]] = (),
) -> None:
    """Set head, tail and the bitmaps from the rows (``SELECT slot, state, seq``),
    and the group tags from ``groups``: (slot, group) of the queued rows that have one.
    ``dues`` lists (slot, due us) of the queued rows not due yet (the
    database's clock at the read): they wait (``_waiting``), their bits clear.

    ``keep_locked`` preserves slots locked by live clients (a resync under
    traffic); ``held`` lists (slot, seq) pairs of in-doubt prepared
    transactions, kept locked with no owner until recovery decides them;
    ``offered`` the (slot, seq) pairs set aside for SQL consumers
    (``ringq.offers``), locked for them (owner ``OWNER_SQL``) while their
    rows still hold them queued; ``reserved`` the (slot, seq) pairs of slots
    reserved for SQL producers (``ringq.slots``), reserved for them again
    (owner ``OWNER_SQL``, neither bit) while their rows do not hold that seq
    queued yet (a put may be under way).
    """
    cap = ring.cap
    Q, b = ring.Q, ring.qb
    # A new epoch: no record written before this load is trusted (a
    # random one, as a reused block's records carry a former queue's).
    Q[b + L.Q_CACHE_EPOCH] = secrets.randbits(62) | 1
    seq_by_slot = np.full(cap, -1, dtype=np.int64)
    state_by_slot = np.zeros(cap, dtype=np.int64)
    seq_by_slot[slots] = seqs
    state_by_slot[slots] = states
    nwords = (cap + 63) // 64
    g0, g1 = ring.w0, ring.w0 + nwords
    s = ring.sec

    old_lck = s.lck[g0:g1].copy() if keep_locked else np.zeros(nwords, dtype=np.uint64)
    # slots locked by live clients (resync): kept as they are
    old_locked = np.zeros(cap, dtype=bool)
    at = set_bits(old_lck)
    old_locked[at[at < cap]] = True
    locked_seqs = [ring.seq_of(int(slot)) for slot in np.flatnonzero(old_locked)]
    max_seq = int(seq_by_slot.max()) if cap else -1
    head = max_seq + 1
    if keep_locked:
        head = max(head, Q[b + L.Q_HEAD])
    held = held or []
    for _slot, seq in held:
        head = max(head, seq + 1)
    # A reserved slot not written yet is in flight: the head passes it, the
    # tail stops at it (a put may still fill it).
    open_reserved = [(r_slot, r_seq) for r_slot, r_seq in reserved
                     if 0 <= r_slot < cap and r_seq % cap == r_slot
                     and not (seq_by_slot[r_slot] == r_seq
                              and state_by_slot[r_slot] >= RowState.QUEUED)]
    for _slot, seq in open_reserved:
        head = max(head, seq + 1)
    queued = seq_by_slot[state_by_slot == RowState.QUEUED]
    candidates = [int(queued.min())] if queued.size else []
    candidates += locked_seqs + [seq for _slot, seq in held] + [q for _s, q in open_reserved]
    tail = min(candidates) if candidates else head
    tail = max(tail, head - cap, 0)

    pos = np.arange(tail, head, dtype=np.int64)
    at = pos % cap
    written = seq_by_slot[at] == pos
    enq = np.zeros(cap, dtype=bool)
    deq = np.zeros(cap, dtype=bool)
    enq[at] = written & (state_by_slot[at] >= RowState.QUEUED)
    # consumed, or void (never written)
    deq[at] = ~(written & (state_by_slot[at] == RowState.QUEUED))
    # Queued entries not due yet wait: neither ENQ nor DEQ (a prepared
    # transaction's slot, set below, is held whatever its row says).
    waiting = np.zeros(cap, dtype=bool)
    due_by_slot = np.zeros(cap, dtype=np.int64)
    for d_slot, d_us in dues:
        if 0 <= d_slot < cap and enq[d_slot] and not deq[d_slot]:
            waiting[d_slot] = True
            due_by_slot[d_slot] = d_us
    enq &= ~waiting
    lck = np.zeros(cap, dtype=bool)
    for h_slot, h_seq in held:
        lck[h_slot] = True
        enq[h_slot] = seq_by_slot[h_slot] == h_seq and state_by_slot[h_slot] >= RowState.QUEUED
        deq[h_slot] = bool(enq[h_slot])  # a held dequeue; a held enqueue has neither bit

    def words(bits: np.ndarray) -> np.ndarray:
        padded = np.zeros(nwords * 64, dtype=bool)
        padded[:cap] = bits
        return np.packbits(padded, bitorder="little").view(np.uint64)

    new_enq, new_deq, new_lck = words(enq), words(deq), words(lck)
    tags = np.zeros(cap, dtype=np.int64)
    if groups:
        tags[[slot for slot, _g in groups]] = [group_tag(g) for _s, g in groups]
    # a locked slot keeps the tag its reservation wrote
    tags[old_locked] = s.group[ring.base : ring.base + cap][old_locked]
    s.group[ring.base : ring.base + cap] = tags
    Q[b + L.Q_GROUPED] = int(bool(np.any(tags)))
    if keep_locked:
        new_enq = (new_enq & ~old_lck) | (s.enq[g0:g1] & old_lck)
        new_deq = (new_deq & ~old_lck) | (s.deq[g0:g1] & old_lck)
        new_lck = new_lck | old_lck
    else:
        s.owner[ring.base : ring.base + cap] = 0
        Q[b + L.Q_DEQ_OWNER] = 0
        Q[b + L.Q_DEQ_INFLIGHT] = 0
    # Slots of prepared transactions that no live client here holds: locked
    # with owner HELD (set before the LCK bits), for recovery to decide from
    # the rows once the transaction is resolved (recovery.resolve_prepared,
    # or recover_dead_clients when someone else resolved it).
    for h_slot, _h_seq in held:
        if not old_locked[h_slot]:
            s.holder_w[ring.base + h_slot] = 0
            s.owner_w[ring.base + h_slot] = L.OWNER_HELD
    # Entries set aside for SQL consumers stay theirs: a take may be under way
    # (its row update not committed yet reads as queued here).
    n_sql = 0
    lck_sql = np.zeros(cap, dtype=bool)
    for o_slot, o_seq in offered:
        if (0 <= o_slot < cap and not old_locked[o_slot] and tail <= o_seq < head
                and seq_by_slot[o_slot] == o_seq and state_by_slot[o_slot] == RowState.QUEUED):
            lck_sql[o_slot] = True
            s.holder_w[ring.base + o_slot] = 0
            s.owner_w[ring.base + o_slot] = L.OWNER_SQL
            n_sql += 1
    if n_sql:
        # Held for SQL consumers like a dequeue in flight (ENQ, DEQ, LCK), not
        # waiting even if not due: the takers check the row's due time.
        waiting &= ~lck_sql
        sql_words = words(lck_sql)
        new_enq = new_enq | sql_words
        new_lck = new_lck | sql_words
        new_deq = new_deq | sql_words
        if Q[b + L.Q_MODE] == 0 and not Q[b + L.Q_DEQ_OWNER]:
            Q[b + L.Q_DEQ_OWNER] = L.OWNER_SQL
            Q[b + L.Q_DEQ_INFLIGHT] = n_sql
    # Slots reserved for SQL producers and not written yet stay theirs.
    lck_put = np.zeros(cap, dtype=bool)
    for r_slot, r_seq in open_reserved:
        if not old_locked[r_slot] and tail <= r_seq < head:
            lck_put[r_slot] = True
            s.holder_w[ring.base + r_slot] = 0
            s.owner_w[ring.base + r_slot] = L.OWNER_SQL
    if lck_put.any():
        put_words = words(lck_put)
        new_enq &= ~put_words
        new_deq &= ~put_words
        new_lck |= put_words
        waiting &= ~lck_put
    # Waiting entries: due times and counters before the bits (see _waiting);
    # a slot kept locked (resync) is its holder's, whatever its row says now.
    waiting &= ~old_locked
    waiting[[h for h, _q in held]] = False
    s.due[ring.base : ring.base + cap][waiting] = due_by_slot[waiting]
    n_wait = int(np.count_nonzero(waiting))
    Q[b + L.Q_N_WAITING] = n_wait
    Q[b + L.Q_NEXT_DUE_US] = int(due_by_slot[waiting].min()) if n_wait else 0
    # Tail first, then bits, then head: readers only look inside [tail, head).
    Q[b + L.Q_TAIL] = tail
    s.enq[g0:g1] = new_enq
    s.deq[g0:g1] = new_deq
    s.lck[g0:g1] = new_lck
    Q[b + L.Q_HEAD] = head
    Q[b + L.Q_DEPTH_HINT] = int(np.count_nonzero(state_by_slot == RowState.QUEUED))
    # Slots reserved for SQL producers now (those kept locked by a resync too).
    at = set_bits(new_lck & ~new_enq & ~new_deq)
    at = at[at < cap]
    Q[b + L.Q_SQL_PUTS] = int(np.count_nonzero(s.owner[ring.base + at] == L.OWNER_SQL))
    ring.reclaim()

