"""Ring operations on one queue block of the global section.

Every method except the constructor must be called with the queue's lock held
(``Section.lock_queue``); none does I/O. Writes are ordered so that a process
killed between any two of them leaves a state the monitor can decide from the
rows: the owner and holder and the LCK bit are set before the head moves,
ENQ/DEQ are set before LCK is cleared, and the tail only passes slots that
are done.

A slot is locked by an *owner* (the session's token, ``L.token_of``) and a
*holder* (the backend pid whose transaction holds it): recovery decides a
dead owner's slot once its holder backend has ended.

Slot ``s`` of the queue is bit ``base + s`` of the pool bitmaps; ``base`` is a
multiple of 64, so a queue never shares a bitmap word with another queue.

The Ring is the only writer of its block's words after allocation
(``Section.allocate_queue``): positions, counters, waiters, latency
histograms, the dequeuer role and the configuration; and of its slots'
payload cache records (``L.R_*``): written by the session whose commit made
the entry, before the ENQ bit is set; read by the dequeuer that claimed the
slot; trusted only when their tag is the entry's seq and their epoch the
queue's (every load from the rows starts a new epoch).

Groups: a slot's entry may belong to a group (its tag, ``group_tag(name)``,
in the GROUP array, written with the reservation). At most one entry of a
group is held by dequeuers at a time: a claim reads past a ready entry whose
group has an entry held (LCK and DEQ set), and takes at most one entry per
group. The busy groups are the tags of the held slots, read under the queue
lock at each claim of a grouped queue, so they are decided with the slots
(a rollback, a recovery, a poisoning frees the group) and no other state can
disagree with them after a kill -9.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import _layout as L
from ._cache import Cached, PayloadCache
from ._ops import OpKind, RowState
from ._scan import RingScan, bit_mask, set_bits
from ._section import Section

if TYPE_CHECKING:
    from ._ops import Op

_U64 = (1 << 64) - 1
_VECTOR_FROM = 8  # ops from which a finish works on arrays (below, numpy's call cost dominates)

def group_tag(group: str | None) -> int:
    """The section's tag of a group name: 64 bits of its BLAKE2b digest
    (never 0, which means no group). Two groups that share a tag (odds of
    2**-64 per pair) are served as one group: in order, never wrongly."""
    if group is None:
        return 0
    tag = int.from_bytes(
        hashlib.blake2b(group.encode(), digest_size=8).digest(), "little", signed=True
    )
    return tag or 1


class Ring(RingScan):
    """A view of queue block ``qidx`` (cheap to make; holds no lock itself)."""

    __slots__ = ("cache", "cbase", "qid", "stride")

    def __init__(self, sec: Section, qidx: int) -> None:
        super().__init__(sec, qidx)
        self.qid = self.Q[self.qb + L.Q_QID]
        self.cache = PayloadCache(sec, self.qb)
        self.stride = self.cache.stride  # bytes of a slot's cache record (0: no cache)
        self.cbase = self.Q[self.qb + L.Q_CACHE_BASE]

    # -- positions ----------------------------------------------------------------

    @property
    def head(self) -> int:
        return self.Q[self.qb + L.Q_HEAD]

    @property
    def tail(self) -> int:
        return self.Q[self.qb + L.Q_TAIL]

    def seq_of(self, slot: int) -> int:
        """The sequence number slot ``slot`` holds within the current window."""
        tail = self.Q[self.qb + L.Q_TAIL]
        return tail + (slot - tail) % self.cap

    def _bit(self, slot: int) -> tuple[int, int]:
        return self.w0 + (slot >> 6), 1 << (slot & 63)

    def bits(self, slot: int) -> tuple[bool, bool, bool, int]:
        """(ENQ, DEQ, LCK, owner) of a slot, for inspection and recovery."""
        w, m = self._bit(slot)
        s = self.sec
        return (
            bool(s.enq_w[w] & m),
            bool(s.deq_w[w] & m),
            bool(s.lck_w[w] & m),
            s.owner_w[self.base + slot],
        )

    def holder(self, slot: int) -> int:
        """The backend pid recorded with a locked slot's owner."""
        return self.sec.holder_w[self.base + slot]

    def held_by(self, slot: int, owner: int) -> bool:
        """True if ``owner`` holds the slot's entry lock (guards against finishing twice)."""
        w, m = self._bit(slot)
        return bool(self.sec.lck_w[w] & m) and self.sec.owner_w[self.base + slot] == owner

    # -- enqueue ------------------------------------------------------------------

    def reserve(self, owner: int, backend: int, tag: int = 0) -> tuple[int, int] | None:
        """Reserve the head slot for ``owner`` (held by ``backend``), for an
        entry of group ``tag`` (0: none); None if full."""
        Q, b = self.Q, self.qb
        head = Q[b + L.Q_HEAD]
        if head - Q[b + L.Q_TAIL] >= self.cap:
            self.reclaim()
            if head - Q[b + L.Q_TAIL] >= self.cap:
                return None
        slot = head % self.cap
        w, m = self._bit(slot)
        s = self.sec
        s.enq_w[w] &= ~m & _U64
        s.deq_w[w] &= ~m & _U64
        s.holder_w[self.base + slot] = backend
        s.owner_w[self.base + slot] = owner
        s.group_w[self.base + slot] = tag
        if tag:
            Q[b + L.Q_GROUPED] = 1
        s.lck_w[w] |= m
        Q[b + L.Q_HEAD] = head + 1
        Q[b + L.Q_N_ENQ] += 1
        return slot, head

    def reserve_many(
        self, owner: int, backend: int, n: int, tags: Sequence[int] | None = None
    ) -> tuple[int, int]:
        """Reserve up to ``n`` slots at the head for ``owner`` (held by
        ``backend``), the i-th for group ``tags[i]`` (None: no groups), as
        array writes in :meth:`reserve`'s order (bits cleared, holders,
        owners and groups, then LCK, then the head moves). Returns (first
        seq, how many): the slots are the seqs modulo the capacity."""
        Q, b = self.Q, self.qb
        head = Q[b + L.Q_HEAD]
        room = self.cap - (head - Q[b + L.Q_TAIL])
        if room < n:
            self.reclaim()
            room = self.cap - (head - Q[b + L.Q_TAIL])
        k = min(n, room)
        if k <= 0:
            return head, 0
        if k < _VECTOR_FROM:
            for i in range(k):
                self.reserve(owner, backend, tags[i] if tags else 0)
            return head, k
        slots = (head + np.arange(k, dtype=np.int64)) % self.cap
        s = self.sec
        lo, mask = bit_mask(slots)
        at = slice(self.w0 + lo, self.w0 + lo + mask.size)
        s.enq[at] &= ~mask
        s.deq[at] &= ~mask
        g = self.base + slots
        s.holder[g] = backend
        s.owner[g] = owner
        if tags:
            s.group[g] = np.asarray(tags[:k], dtype=np.int64)
            if any(tags[:k]):
                Q[b + L.Q_GROUPED] = 1
        else:
            s.group[g] = 0
        s.lck[at] |= mask
        Q[b + L.Q_HEAD] = head + k
        Q[b + L.Q_N_ENQ] += k
        return head, k

    def set_group(self, slot: int, tag: int) -> None:
        """Give a locked slot's entry the group ``tag`` (before it is published)."""
        self.sec.group_w[self.base + slot] = tag
        if tag:
            self.Q[self.qb + L.Q_GROUPED] = 1

    def finish_enqueue(self, slot: int, committed: bool) -> None:
        """Publish a committed entry (ENQ) or void a rolled-back one (DEQ), then unlock."""
        w, m = self._bit(slot)
        s = self.sec
        if committed:
            s.enq_w[w] |= m
            self.Q[self.qb + L.Q_DEPTH_HINT] += 1
            self.Q[self.qb + L.Q_N_ENQ_COMMIT] += 1
        else:
            s.deq_w[w] |= m
            self.Q[self.qb + L.Q_N_ENQ_ROLLBACK] += 1
        s.lck_w[w] &= ~m & _U64
        s.owner_w[self.base + slot] = 0

    # -- dequeue ------------------------------------------------------------------

    def claim(self, owner: int, backend: int, *, exclusive: bool) -> tuple[int, int] | None:
        """Lock the oldest ready entry for ``owner`` (held by ``backend``): (slot, seq) or None.

        Entries locked by others are read past, never waited on. With
        ``exclusive`` (single-dequeuer mode) a queue whose dequeuer role is
        held by another client has nothing for us.
        """
        Q, b = self.Q, self.qb
        if exclusive:
            holder = Q[b + L.Q_DEQ_OWNER]
            if holder and holder != owner:
                return None
        tail = Q[b + L.Q_TAIL]
        n = Q[b + L.Q_HEAD] - tail
        if n <= 0:
            return None
        if Q[b + L.Q_GROUPED]:
            found = self._ready_slots(tail, n, 1)
            slot = found[0] if found else None
        else:
            slot = self._find(tail % self.cap, n, ready=True)
        if slot is None:
            return None
        w, m = self._bit(slot)
        s = self.sec
        s.holder_w[self.base + slot] = backend
        s.owner_w[self.base + slot] = owner
        s.lck_w[w] |= m
        s.deq_w[w] |= m
        if exclusive:
            Q[b + L.Q_DEQ_OWNER] = owner
            Q[b + L.Q_DEQ_INFLIGHT] += 1
        Q[b + L.Q_N_DEQ] += 1
        return slot, tail + (slot - tail) % self.cap

    def claim_many(
        self, owner: int, backend: int, n: int, *, exclusive: bool
    ) -> list[tuple[int, int]]:
        """Lock up to ``n`` of the oldest ready entries for ``owner``: (slot, seq) pairs."""
        slots, seqs = self.claim_batch(owner, backend, n, exclusive=exclusive)
        return list(zip(slots.tolist(), seqs.tolist(), strict=True))

    def claim_batch(
        self, owner: int, backend: int, n: int, *, exclusive: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Lock up to ``n`` of the oldest ready entries for ``owner`` (held by
        ``backend``) with one scan: their slots and seqs (int64 arrays, oldest
        first). The holders and owners are written before the LCK bits, the
        LCK bits before the DEQ bits, as one array write each."""
        Q, b = self.Q, self.qb
        none = np.empty(0, dtype=np.int64)
        if exclusive:
            holder = Q[b + L.Q_DEQ_OWNER]
            if holder and holder != owner:
                return none, none
        tail = Q[b + L.Q_TAIL]
        window = Q[b + L.Q_HEAD] - tail
        if window <= 0:
            return none, none
        slots = self.ready_array(tail, window, n)
        if not slots.size:
            return none, none
        s = self.sec
        g = self.base + slots
        s.holder[g] = backend
        s.owner[g] = owner
        lo, mask = bit_mask(slots)
        at = slice(self.w0 + lo, self.w0 + lo + mask.size)
        s.lck[at] |= mask
        s.deq[at] |= mask
        if exclusive:
            Q[b + L.Q_DEQ_OWNER] = owner
            Q[b + L.Q_DEQ_INFLIGHT] += slots.size
        Q[b + L.Q_N_DEQ] += slots.size
        return slots, tail + (slots - tail) % self.cap

    def finish_dequeue(
        self, slot: int, consumed: bool, *, exclusive: bool, reclaim: bool = True
    ) -> None:
        """Mark a dequeued entry consumed (DEQ stays) or ready again, then unlock."""
        w, m = self._bit(slot)
        s = self.sec
        Q, b = self.Q, self.qb
        if consumed:
            Q[b + L.Q_DEPTH_HINT] -= 1
            Q[b + L.Q_N_DEQ_COMMIT] += 1
        else:
            s.deq_w[w] &= ~m & _U64
            Q[b + L.Q_N_DEQ_ROLLBACK] += 1
        if self.stride:
            # Consumed, or its row counts a delivery now: a record serves one
            # first delivery (a redelivery, or a section that went wrong,
            # reads the row).
            s.cache_w[self.cache.cw0 + slot * self.cache.sw + L.R_TAG] = 0
        s.lck_w[w] &= ~m & _U64
        s.owner_w[self.base + slot] = 0
        if exclusive and Q[b + L.Q_DEQ_INFLIGHT] > 0:
            Q[b + L.Q_DEQ_INFLIGHT] -= 1
            if Q[b + L.Q_DEQ_INFLIGHT] == 0:
                Q[b + L.Q_DEQ_OWNER] = 0
        if reclaim and consumed and slot == Q[b + L.Q_TAIL] % self.cap:
            self.reclaim()

    def release_role(self, owner: int) -> None:
        """Give up the single-dequeuer role if ``owner`` holds it with nothing in flight."""
        b = self.qb
        if self.Q[b + L.Q_DEQ_OWNER] == owner:
            self.Q[b + L.Q_DEQ_INFLIGHT] = 0
            self.Q[b + L.Q_DEQ_OWNER] = 0

    def hold(self, slot: int) -> None:
        """Keep a slot locked with no live owner (``OWNER_HELD``: a prepared
        two-phase transaction whose session is gone), for recovery to decide."""
        self.sec.owner_w[self.base + slot] = L.OWNER_HELD

    def finish_stale(self, slot: int, *, exclusive: bool) -> None:
        """Finish a dequeue whose row did not match the section (void, or
        consumed already): the slot is done, but it was not a consumption;
        counted as a repair."""
        self.finish_dequeue(slot, consumed=True, exclusive=exclusive)
        Q, b = self.Q, self.qb
        Q[b + L.Q_DEPTH_HINT] += 1
        Q[b + L.Q_N_DEQ_COMMIT] -= 1
        Q[b + L.Q_N_REPAIRS] += 1

    def finish_batch(
        self,
        ops: Sequence[Op],
        owner: int,
        *,
        committed: bool,
        poisoned: set[tuple[int, int]],
        exclusive: bool,
        enq_at_us: int | None = None,
    ) -> tuple[int, int]:
        """Finish ``owner``'s slots ``ops`` once the database has decided:
        enqueued entries become ready (``committed``) or void, dequeued ones
        consumed (committed, or ``poisoned``: (slot, seq) pairs) or ready again.

        With ``enq_at_us`` (the rows' enqueue time in us), committed enqueues
        whose row write the op still carries (``fill``) are written to the
        payload cache before they become ready.

        Slots ``owner`` no longer holds (decided by recovery) are passed over.
        Records the latencies, reclaims once, and counts poisoned entries and
        wake-ups. Returns (ready, space): how many sleeping dequeuers and
        enqueuers the caller wakes (after releasing the lock).
        """
        if len(ops) < _VECTOR_FROM:
            return self._finish_each(ops, owner, committed=committed, poisoned=poisoned,
                                     exclusive=exclusive, enq_at_us=enq_at_us)
        Q, b = self.Q, self.qb
        s = self.sec
        n_ready = n_space = n_poisoned = 0
        enq = [op for op in ops if op.kind is OpKind.ENQUEUE]
        deq = [op for op in ops if op.kind is not OpKind.ENQUEUE]
        if enq:
            enq, slots = self._held(enq, owner)
            if slots.size:
                lo, mask = bit_mask(slots)
                at = slice(self.w0 + lo, self.w0 + lo + mask.size)
                if committed:
                    if enq_at_us is not None and self.stride:
                        filled = [op for op in enq if op.fill is not None]
                        self.cache.put_many(
                            [op.slot for op in filled], [op.seq for op in filled],
                            [op.fill for op in filled if op.fill is not None], enq_at_us,
                        )
                    s.enq[at] |= mask
                    Q[b + L.Q_DEPTH_HINT] += slots.size
                    Q[b + L.Q_N_ENQ_COMMIT] += slots.size
                    n_ready += slots.size
                else:
                    s.deq[at] |= mask
                    Q[b + L.Q_N_ENQ_ROLLBACK] += slots.size
                s.lck[at] &= ~mask
                s.owner[self.base + slots] = 0
                self._record_latencies(OpKind.ENQUEUE, enq)
        if deq:
            deq, slots = self._held(deq, owner)
            if slots.size:
                if poisoned:
                    hit = [(op.slot, op.seq) in poisoned for op in deq]
                    n_poisoned = sum(hit)
                    consumed = np.array(hit, dtype=bool) | committed
                else:
                    consumed = np.full(slots.size, committed, dtype=bool)
                n_consumed = int(np.count_nonzero(consumed))
                was_owner = Q[b + L.Q_DEQ_OWNER]
                # a consumed entry of a group frees the group: its next entry
                # may be what a sleeping dequeuer waits for
                freed = int(np.count_nonzero(consumed & (s.group[self.base + slots] != 0)))
                Q[b + L.Q_DEPTH_HINT] -= n_consumed
                Q[b + L.Q_N_DEQ_COMMIT] += n_consumed
                back = slots[~consumed]
                if back.size:
                    lo, mask = bit_mask(back)
                    s.deq[self.w0 + lo : self.w0 + lo + mask.size] &= ~mask
                    Q[b + L.Q_N_DEQ_ROLLBACK] += back.size
                # Consumed, or its row counts a delivery now: a record serves
                # one first delivery (a redelivery reads the row).
                self.cache.clear(slots)
                lo, mask = bit_mask(slots)
                s.lck[self.w0 + lo : self.w0 + lo + mask.size] &= ~mask
                s.owner[self.base + slots] = 0
                if exclusive and Q[b + L.Q_DEQ_INFLIGHT] > 0:
                    Q[b + L.Q_DEQ_INFLIGHT] = max(0, Q[b + L.Q_DEQ_INFLIGHT] - slots.size)
                    if Q[b + L.Q_DEQ_INFLIGHT] == 0:
                        Q[b + L.Q_DEQ_OWNER] = 0
                n_space += n_consumed
                n_ready += (slots.size - n_consumed) + freed + int(
                    exclusive and bool(was_owner) and not Q[b + L.Q_DEQ_OWNER]
                )
                self._record_latencies(OpKind.DEQUEUE, deq)
        if n_poisoned:
            Q[b + L.Q_N_POISONED] += n_poisoned
        return self._after_finish(n_ready, n_space)

    def _after_finish(self, n_ready: int, n_space: int) -> tuple[int, int]:
        """Reclaim once and count the wake-ups a finish makes: (ready, space)."""
        Q, b = self.Q, self.qb
        if n_space:
            self.reclaim()  # once per queue, not once per entry
        wake_r = self._wake_count(n_ready)
        wake_s = min(n_space, Q[b + L.Q_WAIT_SPACE])
        if n_space and Q[b + L.Q_FULL_SINCE_NS]:
            Q[b + L.Q_FULL_NS] += time.monotonic_ns() - Q[b + L.Q_FULL_SINCE_NS]
            Q[b + L.Q_FULL_SINCE_NS] = 0
        if wake_r:
            Q[b + L.Q_N_WAKEUPS] += wake_r
        return wake_r, wake_s

    def _finish_each(
        self,
        ops: Sequence[Op],
        owner: int,
        *,
        committed: bool,
        poisoned: set[tuple[int, int]],
        exclusive: bool,
        enq_at_us: int | None,
    ) -> tuple[int, int]:
        """:meth:`finish_batch` one slot at a time: for a few ops, plain ints
        cost less than numpy's per-call overhead."""
        Q, b = self.Q, self.qb
        n_ready = n_space = 0
        for op in ops:
            if not self.held_by(op.slot, owner):
                continue  # already decided by recovery (never finish a slot twice)
            if op.kind is OpKind.ENQUEUE:
                if committed and enq_at_us is not None and op.fill is not None and self.stride:
                    f = op.fill
                    self.cache.put(
                        op.slot, op.seq, f.payload, f.producer.encode(), f.producer_seq, enq_at_us,
                        None if f.group is None else f.group.encode(),
                    )
                self.finish_enqueue(op.slot, committed)
                n_ready += committed
            else:
                consumed = committed or (op.slot, op.seq) in poisoned
                was_owner = Q[b + L.Q_DEQ_OWNER]
                freed_group = consumed and self.sec.group_w[self.base + op.slot] != 0
                self.finish_dequeue(op.slot, consumed, exclusive=exclusive, reclaim=False)
                n_space += consumed
                n_ready += (
                    (not consumed)
                    or freed_group
                    or (exclusive and was_owner and not Q[b + L.Q_DEQ_OWNER])
                )
                if consumed and not committed:
                    Q[b + L.Q_N_POISONED] += 1
            self.record_latency(op.kind, op.latency_ns)
        return self._after_finish(n_ready, n_space)

    def _held(self, ops: list[Op], owner: int) -> tuple[list[Op], np.ndarray]:
        """``ops`` whose slots ``owner`` still holds (LCK set, its token in
        OWNER; the others were decided by recovery: never finish a slot
        twice), and their slots (int64)."""
        s = self.sec
        slots = np.fromiter((op.slot for op in ops), dtype=np.int64, count=len(ops))
        lck = (s.lck[self.w0 + (slots >> 6)] >> (slots & 63).astype(np.uint64)) & np.uint64(1)
        held = (lck != 0) & (s.owner[self.base + slots] == owner)
        if held.all():
            return ops, slots
        return [op for op, h in zip(ops, held.tolist(), strict=True) if h], slots[held]

    def _record_latencies(self, kind: OpKind, ops: list[Op]) -> None:
        # a batch's ops share one latency: one histogram update per distinct value
        for ns, n in Counter(op.latency_ns for op in ops).items():
            self.record_latency(kind, ns, n)

    def _wake_count(self, n_ready: int) -> int:
        """How many sleeping dequeuers ``n_ready`` new ready entries make
        work for: each waiter recorded how many it wants (``Q_WAIT_WANT``),
        so a batch wakes enough waiters to take it, not every waiter."""
        Q, b = self.Q, self.qb
        waiters = Q[b + L.Q_WAIT_READY]
        if not n_ready or waiters <= 0:
            return 0
        per = max(1, Q[b + L.Q_WAIT_WANT] // waiters)  # entries a waiter wants, on average
        return min(waiters, -(-n_ready // per))

    # -- payload cache ---------------------------------------------------------------

    def cache_put(
        self,
        slot: int,
        seq: int,
        payload: bytes,
        producer: bytes,
        producer_seq: int,
        enq_at_us: int,
        group: bytes | None = None,
    ) -> bool:
        """Write the cache record of ``slot``'s new entry (see :meth:`PayloadCache.put`)."""
        return self.cache.put(slot, seq, payload, producer, producer_seq, enq_at_us, group)

    def cache_get(self, slot: int, seq: int) -> Cached | None:
        """Entry ``seq`` from ``slot``'s cache record, or None (see :meth:`PayloadCache.get`)."""
        return self.cache.get(slot, seq)

    # -- counters and waiters ---------------------------------------------------------

    def record_latency(self, kind: OpKind, ns: int, n: int = 1) -> None:
        """Add ``n`` enqueue or dequeue calls' latency (ns each) to its histogram and sum."""
        if ns <= 0:
            return
        if kind == OpKind.ENQUEUE:
            hist_word, sum_word = L.Q_ENQ_HIST, L.Q_ENQ_LAT_NS
        else:
            hist_word, sum_word = L.Q_DEQ_HIST, L.Q_DEQ_LAT_NS
        us = ns // 1000
        bucket = min(us.bit_length(), L.HIST_BUCKETS - 1)
        self.Q[self.qb + hist_word + bucket] += n
        self.Q[self.qb + sum_word] += ns * n

    def note_full(self) -> None:
        """An enqueue found no free slot: count it; the queue is full from now if it was not."""
        Q, b = self.Q, self.qb
        Q[b + L.Q_N_FULL] += 1
        if not Q[b + L.Q_FULL_SINCE_NS]:
            Q[b + L.Q_FULL_SINCE_NS] = time.monotonic_ns()

    def note_empty(self) -> None:
        """A dequeue found nothing ready: count it."""
        self.Q[self.qb + L.Q_N_EMPTY] += 1

    def note_resync(self) -> None:
        """The queue was re-read from its table: count it."""
        self.Q[self.qb + L.Q_N_RESYNC] += 1

    @staticmethod
    def _wait_word(kind: OpKind) -> int:
        # An enqueuer waits for space, a dequeuer for a ready entry.
        return L.Q_WAIT_SPACE if kind == OpKind.ENQUEUE else L.Q_WAIT_READY

    def waiters(self, kind: OpKind) -> int:
        """How many ``kind`` callers (enqueuers or dequeuers) sleep on the queue's wake-up."""
        return self.Q[self.qb + self._wait_word(kind)]

    def add_waiter(self, kind: OpKind, want: int = 1) -> None:
        """A ``kind`` caller is about to sleep on the queue's wake-up; a
        dequeuer says how many entries it wants."""
        self.Q[self.qb + self._wait_word(kind)] += 1
        if kind is OpKind.DEQUEUE:
            self.Q[self.qb + L.Q_WAIT_WANT] += want

    def remove_waiter(self, kind: OpKind, want: int = 1) -> None:
        """A ``kind`` caller woke up (registered by :meth:`add_waiter` with ``want``)."""
        self.Q[self.qb + self._wait_word(kind)] -= 1
        if kind is OpKind.DEQUEUE:
            self.Q[self.qb + L.Q_WAIT_WANT] = max(0, self.Q[self.qb + L.Q_WAIT_WANT] - want)

    def abandon_wait(self, kind: OpKind, want: int = 1) -> None:
        """A ``kind`` caller left its wait by an exception: undo its registration, if any."""
        word = self.qb + self._wait_word(kind)
        if self.Q[word] > 0:
            self.Q[word] -= 1
            if kind is OpKind.DEQUEUE:
                self.Q[self.qb + L.Q_WAIT_WANT] = max(0, self.Q[self.qb + L.Q_WAIT_WANT] - want)

    def maybe_ready(self) -> bool:
        """Whether the bitmaps show a ready entry in the window, read without
        the queue lock: a hint. A dequeuer woken by a post sees every bit the
        poster set before it (the semaphore orders them), so a False here
        means another took the entries: it sleeps again, still registered,
        without a lock round."""
        tail = self.Q[self.qb + L.Q_TAIL]
        n = self.Q[self.qb + L.Q_HEAD] - tail
        return n > 0 and self._find(tail % self.cap, n, ready=True) is not None

    # -- configuration ------------------------------------------------------------------

    def configure(
        self,
        *,
        max_payload: int,
        block_when_full: bool,
        single_dequeuer: bool,
        full_timeout_ms: int,
        max_deliveries: int,
    ) -> None:
        """Write the queue's settings into a freshly allocated block (section lock held)."""
        Q, b = self.Q, self.qb
        Q[b + L.Q_MAX_PAYLOAD] = max_payload
        Q[b + L.Q_POLICY] = 0 if block_when_full else 1
        Q[b + L.Q_MODE] = 0 if single_dequeuer else 1
        Q[b + L.Q_FULL_TIMEOUT_MS] = full_timeout_ms
        Q[b + L.Q_MAX_DELIVERIES] = max_deliveries
        Q[b + L.Q_LOADED_NS] = time.time_ns()

    # -- reclaim ------------------------------------------------------------------

    def reclaim(self) -> int:
        """Advance the tail over consumed and void slots; returns how many."""
        Q, b = self.Q, self.qb
        tail = Q[b + L.Q_TAIL]
        n = Q[b + L.Q_HEAD] - tail
        if n <= 0:
            return 0
        first_busy = self._find(tail % self.cap, n, ready=False)
        done = n if first_busy is None else (first_busy - tail) % self.cap
        if done:
            Q[b + L.Q_TAIL] = tail + done
        return done

    def locked_slots(self) -> list[tuple[int, int, int]]:
        """(slot, owner, holder) of every locked slot of the queue (a vectorized scan)."""
        s = self.sec
        # a copy: other processes change the words under a caller without the lock
        # (few words hold a locked slot: only those are unpacked)
        slots = set_bits(s.lck[self.w0 : self.w0 + (self.cap + 63) // 64].copy())
        owners = s.owner[self.base + slots]
        holders = s.holder[self.base + slots]
        return [(int(a), int(b), int(c)) for a, b, c in zip(slots, owners, holders, strict=True)]

    def group_counts(self) -> dict[str, int]:
        """Groups of the queue, for inspection (a vectorized scan; call it
        under the queue lock for an exact answer): ``ready`` groups have a
        ready entry and none held, ``busy`` groups have one held, and
        ``oldest_seq`` / ``oldest_slot`` name the oldest ready entry of any
        group (-1: none): the head of the group that has waited longest."""
        out = {"ready": 0, "busy": 0, "oldest_seq": -1, "oldest_slot": -1}
        if not self.Q[self.qb + L.Q_GROUPED]:
            return out
        s = self.sec
        nw = (self.cap + 63) // 64
        g0 = self.w0
        words = s.enq[g0 : g0 + nw] & ~s.deq[g0 : g0 + nw] & ~s.lck[g0 : g0 + nw]
        busy = self.busy_groups()
        out["busy"] = len(busy)
        slots = set_bits(words)
        tags = s.group[self.base + slots]
        grouped = tags != 0
        if not grouped.any():
            return out
        slots, tags = slots[grouped], tags[grouped]
        out["ready"] = len(set(tags.tolist()) - busy)
        tail = self.tail
        seqs = tail + (slots - tail) % self.cap
        i = int(np.argmin(seqs))
        out["oldest_seq"], out["oldest_slot"] = int(seqs[i]), int(slots[i])
        return out

    def role_owner(self) -> int:
        """The token holding the single-dequeuer role, 0 if none."""
        return self.Q[self.qb + L.Q_DEQ_OWNER]

    # -- counts -----------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Ready, locked and done slots within the window (a full scan; for inspection)."""
        tail, head = self.tail, self.head
        bits = self.window_bits()
        return {
            "window": head - tail,
            "ready": int(np.count_nonzero(bits["enq"] & ~bits["deq"] & ~bits["lck"])),
            "locked": int(np.count_nonzero(bits["lck"])),
            "done": int(np.count_nonzero(bits["deq"] & ~bits["lck"])),
        }

    def window_bits(self) -> dict[str, np.ndarray]:
        """Boolean arrays (ENQ, DEQ, LCK) for positions tail..head-1, in sequence order."""
        tail, head = self.tail, self.head
        slots = np.arange(tail, head, dtype=np.int64) % self.cap
        out = {}
        for key, arr in (("enq", self.sec.enq), ("deq", self.sec.deq), ("lck", self.sec.lck)):
            words = arr[self.w0 : self.w0 + (self.cap + 63) // 64]
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.cap].astype(bool)
            out[key] = bits[slots]
        return out

    # -- rebuild ------------------------------------------------------------------------

    def load_rows(
        self,
        slots: np.ndarray,
        states: np.ndarray,
        seqs: np.ndarray,
        *,
        keep_locked: bool,
        held: list[tuple[int, int]] | None = None,
        groups: Sequence[tuple[int, str]] = (),
    ) -> None:
        """Set head, tail and the bitmaps from the rows (``SELECT slot, state, seq``),
        and the group tags from ``groups``: (slot, group) of the queued rows that have one.

        ``keep_locked`` preserves slots locked by live clients (a resync under
        traffic); ``held`` lists (slot, seq) pairs of in-doubt prepared
        transactions, kept locked with no owner until recovery decides them.
        """
        cap = self.cap
        Q, b = self.Q, self.qb
        # A new epoch: no record written before this load is trusted (a
        # random one, as a reused block's records carry a former queue's).
        Q[b + L.Q_CACHE_EPOCH] = secrets.randbits(62) | 1
        seq_by_slot = np.full(cap, -1, dtype=np.int64)
        state_by_slot = np.zeros(cap, dtype=np.int64)
        seq_by_slot[slots] = seqs
        state_by_slot[slots] = states
        nwords = (cap + 63) // 64
        g0, g1 = self.w0, self.w0 + nwords
        s = self.sec

        old_lck = s.lck[g0:g1].copy() if keep_locked else np.zeros(nwords, dtype=np.uint64)
        # slots locked by live clients (resync): kept as they are
        old_locked = np.zeros(cap, dtype=bool)
        at = set_bits(old_lck)
        old_locked[at[at < cap]] = True
        locked_seqs = [self.seq_of(int(slot)) for slot in np.flatnonzero(old_locked)]
        max_seq = int(seq_by_slot.max()) if cap else -1
        head = max_seq + 1
        if keep_locked:
            head = max(head, Q[b + L.Q_HEAD])
        held = held or []
        for _slot, seq in held:
            head = max(head, seq + 1)
        queued = seq_by_slot[state_by_slot == RowState.QUEUED]
        candidates = [int(queued.min())] if queued.size else []
        candidates += locked_seqs + [seq for _slot, seq in held]
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
        tags[old_locked] = s.group[self.base : self.base + cap][old_locked]
        s.group[self.base : self.base + cap] = tags
        Q[b + L.Q_GROUPED] = int(bool(np.any(tags)))
        if keep_locked:
            new_enq = (new_enq & ~old_lck) | (s.enq[g0:g1] & old_lck)
            new_deq = (new_deq & ~old_lck) | (s.deq[g0:g1] & old_lck)
            new_lck = new_lck | old_lck
        else:
            s.owner[self.base : self.base + cap] = 0
            Q[b + L.Q_DEQ_OWNER] = 0
            Q[b + L.Q_DEQ_INFLIGHT] = 0
        # Slots of prepared transactions that no live client here holds: locked
        # with owner HELD (set before the LCK bits), for recovery to decide from
        # the rows once the transaction is resolved (recovery.resolve_prepared,
        # or recover_dead_clients when someone else resolved it).
        for h_slot, _h_seq in held:
            if not old_locked[h_slot]:
                s.holder_w[self.base + h_slot] = 0
                s.owner_w[self.base + h_slot] = L.OWNER_HELD
        # Tail first, then bits, then head: readers only look inside [tail, head).
        Q[b + L.Q_TAIL] = tail
        s.enq[g0:g1] = new_enq
        s.deq[g0:g1] = new_deq
        s.lck[g0:g1] = new_lck
        Q[b + L.Q_HEAD] = head
        Q[b + L.Q_DEPTH_HINT] = int(np.count_nonzero(state_by_slot == RowState.QUEUED))
        self.reclaim()
