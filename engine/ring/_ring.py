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

The Ring, with the two steps built on it in this layer (finishing a
transaction's ops, ``_finish``; loading the block from the rows, ``_load``),
is the only writer of its block's words after allocation
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

import time
from collections.abc import Sequence

import numpy as np

from ..section import Section
from ..section import layout as L
from ._cache import Cached, PayloadCache
from ._kinds import OpKind
from ._scan import SMALL_BATCH, RingScan, bit_mask
from ._waiting import due_now, make_waiting, release_due, until_due_s, waits

_U64 = (1 << 64) - 1

VECTOR_FROM = 8  # slots from which a batch works on arrays (below, numpy's call cost dominates)


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
        self, owner: int, backend: int, n: int, tags: Sequence[int] | None = None,
        *, whole: bool = False,
    ) -> tuple[int, int]:
        """Reserve up to ``n`` slots at the head for ``owner`` (held by
        ``backend``), the i-th for group ``tags[i]`` (None: no groups), as
        array writes in :meth:`reserve`'s order (bits cleared, holders,
        owners and groups, then LCK, then the head moves). Returns (first
        seq, how many): the slots are the seqs modulo the capacity.
        ``whole``: all ``n`` or none (a caller that waits for room holds
        nothing meanwhile)."""
        Q, b = self.Q, self.qb
        head = Q[b + L.Q_HEAD]
        room = self.cap - (head - Q[b + L.Q_TAIL])
        if room < n:
            self.reclaim()
            room = self.cap - (head - Q[b + L.Q_TAIL])
        k = min(n, room)
        if k <= 0 or (whole and k < n):
            return head, 0
        if k < VECTOR_FROM:
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

    def finish_enqueue(self, slot: int, committed: bool, due_us: int = 0) -> None:
        """Publish a committed entry (ENQ; or, due at ``due_us`` still in the
        future, waiting) or void a rolled-back one (DEQ), then unlock."""
        w, m = self._bit(slot)
        s = self.sec
        if committed:
            if due_us and waits(self, due_us):
                make_waiting(self, slot, due_us)  # no ENQ: it waits
            else:
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
        if exclusive and self._not_our_turn(owner):
            return None
        tail = Q[b + L.Q_TAIL]
        n = Q[b + L.Q_HEAD] - tail
        if n <= 0:
            return None
        if Q[b + L.Q_N_WAITING]:
            n = self._due_window(tail, n, exclusive)
            if n <= 0:
                return None
        s = self.sec
        if Q[b + L.Q_GROUPED]:
            found = self._ready_slots(tail, n, 1)
            slot = found[0] if found else None
        else:
            # The tail's own word first, inline (nearly always the answer).
            start = tail % self.cap
            off = start & 63
            g = self.w0 + (start >> 6)
            word = ((s.enq_w[g] & ~s.deq_w[g] & ~s.lck_w[g]) >> off) & (
                (1 << min(n, 64 - off, self.cap - start)) - 1
            )
            if word:
                slot = start + (word & -word).bit_length() - 1
            else:
                slot = self._find(start, n, ready=True)
        if slot is None:
            return None
        w, m = self.w0 + (slot >> 6), 1 << (slot & 63)
        s.holder_w[self.base + slot] = backend
        s.owner_w[self.base + slot] = owner
        s.lck_w[w] |= m
        s.deq_w[w] |= m
        if exclusive:
            Q[b + L.Q_DEQ_OWNER] = owner
            Q[b + L.Q_DEQ_INFLIGHT] += 1
        Q[b + L.Q_N_DEQ] += 1
        return slot, tail + (slot - tail) % self.cap

    def _role_asked_for_sql(self, owner: int) -> bool:
        """A free ``single`` role that the SQL path's agent asked for lately
        (``Q_SQL_ASKS_ROLE_NS``): linked dequeuers leave it for the agent."""
        until = self.Q[self.qb + L.Q_SQL_ASKS_ROLE_NS]
        return bool(until) and owner != L.OWNER_SQL and until > time.monotonic_ns()

    def ask_role_for_sql(self, for_ns: int) -> None:
        """The SQL path wants a ``single`` queue's role, held by a linked
        dequeuer: the next linked claim that finds it free leaves it (for
        ``for_ns``, or until the agent takes it)."""
        self.Q[self.qb + L.Q_SQL_ASKS_ROLE_NS] = time.monotonic_ns() + for_ns

    def role_asked_for_sql(self) -> bool:
        return self._role_asked_for_sql(0)

    def take_one(
        self, owner: int, backend: int, *, exclusive: bool
    ) -> tuple[int, int, Cached | None] | None:
        """:meth:`claim`, and the slot's cache record read in the same
        critical section: (slot, seq, the record if it holds the entry, else
        None: read the row), or None if nothing is ready."""
        got = self.claim(owner, backend, exclusive=exclusive)
        if got is None:
            return None
        slot, seq = got
        return slot, seq, self.cache.get(slot, seq) if self.stride else None

    def take_many(
        self, owner: int, backend: int, n: int, *, exclusive: bool
    ) -> tuple[list[int], list[int], list[Cached | None] | None,
               tuple[np.ndarray, np.ndarray] | None]:
        """:meth:`claim_batch`, and the slots' cache records read in the same
        critical section (as :meth:`take_one`): (slots, seqs, each one's
        record if it holds the entry, else None; None if the queue has no
        cache; the slots and seqs as int64 arrays when the claim made them,
        else None). A few entries (up to SMALL_BATCH) go in plain ints."""
        if n <= SMALL_BATCH:
            slots, seqs = self.claim_few(owner, backend, n, exclusive=exclusive)
            cached = self.cache.get_few(slots, seqs) if slots and self.stride else None
            return slots, seqs, cached, None
        sl, sq = self.claim_batch(owner, backend, n, exclusive=exclusive)
        cached = self.cache.get_many(sl, sq) if sl.size and self.stride else None
        return sl.tolist(), sq.tolist(), cached, (sl, sq)

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
        LCK bits before the DEQ bits, as one array write each (a few
        entries: :meth:`claim_few`, in plain ints)."""
        if n <= SMALL_BATCH:
            sl, sq = self.claim_few(owner, backend, n, exclusive=exclusive)
            return np.array(sl, dtype=np.int64), np.array(sq, dtype=np.int64)
        none = np.empty(0, dtype=np.int64)
        tail, window = self._claim_window(owner, exclusive)
        if window <= 0:
            return none, none
        slots = self.ready_array(tail, window, n)
        if not slots.size:
            return none, none
        Q, b, s = self.Q, self.qb, self.sec
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

    def claim_few(
        self, owner: int, backend: int, n: int, *, exclusive: bool
    ) -> tuple[list[int], list[int]]:
        """:meth:`claim_batch` of a few entries (``n`` up to SMALL_BATCH) in
        plain ints: numpy's per-call cost was most of a take of 8. The same
        writes in the same order: holders and owners, then the LCK bits,
        then the DEQ bits (one word write per bitmap word)."""
        tail, window = self._claim_window(owner, exclusive)
        if window <= 0:
            return [], []
        slots = self._ready_slots(tail, window, n)
        if not slots:
            return [], []
        s = self.sec
        holder_w, owner_w, base = s.holder_w, s.owner_w, self.base
        for slot in slots:
            holder_w[base + slot] = backend
            owner_w[base + slot] = owner
        masks = self._word_masks(slots)
        lck_w, deq_w = s.lck_w, s.deq_w
        for w, m in masks.items():
            lck_w[w] |= m
        for w, m in masks.items():
            deq_w[w] |= m
        Q, b, cap = self.Q, self.qb, self.cap
        if exclusive:
            Q[b + L.Q_DEQ_OWNER] = owner
            Q[b + L.Q_DEQ_INFLIGHT] += len(slots)
        Q[b + L.Q_N_DEQ] += len(slots)
        return slots, [tail + (slot - tail) % cap for slot in slots]

    def _claim_window(self, owner: int, exclusive: bool) -> tuple[int, int]:
        """(tail, how many slots from it a claim may look at): 0 when a
        single-dequeuer queue's role is another's, or nothing is due."""
        Q, b = self.Q, self.qb
        if exclusive and self._not_our_turn(owner):
            return 0, 0
        tail = Q[b + L.Q_TAIL]
        window = Q[b + L.Q_HEAD] - tail
        if window > 0 and Q[b + L.Q_N_WAITING]:
            window = self._due_window(tail, window, exclusive)
        return tail, window

    def finish_dequeue(
        self, slot: int, consumed: bool, *, exclusive: bool, reclaim: bool = True,
        due_us: int = 0,
    ) -> None:
        """Mark a dequeued entry consumed (DEQ stays) or ready again (or,
        given back with a backoff due at ``due_us`` still in the future,
        waiting), then unlock."""
        w, m = self._bit(slot)
        s = self.sec
        Q, b = self.Q, self.qb
        if consumed:
            Q[b + L.Q_DEPTH_HINT] -= 1
            Q[b + L.Q_N_DEQ_COMMIT] += 1
        else:
            # DEQ before ENQ: a process killed between the two leaves ENQ
            # set, and recovery still reads the locked slot as a dequeue
            # (ENQ clear would read as a reserved enqueue, which its row
            # "commits" with DEQ still set: a void slot, the entry lost).
            s.deq_w[w] &= ~m & _U64
            if due_us and waits(self, due_us):
                make_waiting(self, slot, due_us)
                s.enq_w[w] &= ~m & _U64
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

    def finish_consumed(
        self, done: Sequence[tuple[int, int]], owner: int, *, exclusive: bool
    ) -> int:
        """Finish the consumed dequeues ``done`` ((slot, seq) pairs) that
        ``owner`` still holds at that seq, as :meth:`finish_dequeue` with
        ``consumed`` does one at a time (the SQL path's agent finishes what SQL
        consumers committed: often hundreds a pass), as one array write per word
        kind; no reclaim (the caller reclaims once, ``_finish.after_finish``).
        Returns how many."""
        if len(done) < VECTOR_FROM:
            n = 0
            for slot, seq in done:
                if self.held_by(slot, owner) and self.seq_of(slot) == seq:
                    self.finish_dequeue(slot, consumed=True, exclusive=exclusive, reclaim=False)
                    n += 1
            return n
        Q, b = self.Q, self.qb
        slots = np.fromiter((d[0] for d in done), dtype=np.int64, count=len(done))
        seqs = np.fromiter((d[1] for d in done), dtype=np.int64, count=len(done))
        tail = Q[b + L.Q_TAIL]
        slots = slots[self.held_mask(slots, owner) & (seqs == tail + (slots - tail) % self.cap)]
        n = int(slots.size)
        if n:
            self.end_consumed(slots, exclusive)
        return n

    def held_mask(self, slots: np.ndarray, owner: int) -> np.ndarray:
        """Which of ``slots`` (int64) ``owner`` holds: LCK set and its token in OWNER."""
        s = self.sec
        if slots.size <= SMALL_BATCH:  # plain ints (see SMALL_BATCH)
            return np.array(self.held_few(slots.tolist(), owner), dtype=bool)
        lck = (s.lck[self.w0 + (slots >> 6)] >> (slots & 63).astype(np.uint64)) & np.uint64(1)
        held: np.ndarray = (lck != 0) & (s.owner[self.base + slots] == owner)
        return held

    def end_consumed(self, slots: np.ndarray, exclusive: bool) -> None:
        """Held dequeued ``slots`` whose entries were consumed: counted and
        unlocked (their DEQ bits stay)."""
        Q, b = self.Q, self.qb
        Q[b + L.Q_DEPTH_HINT] -= slots.size
        Q[b + L.Q_N_DEQ_COMMIT] += slots.size
        self.unlock_dequeued(slots, exclusive)

    def _word_masks(self, slots: list[int]) -> dict[int, int]:
        """The section's word index -> the bits of ``slots`` in it (plain ints)."""
        w0 = self.w0
        masks: dict[int, int] = {}
        for x in slots:
            w = w0 + (x >> 6)
            masks[w] = masks.get(w, 0) | 1 << (x & 63)
        return masks

    def held_few(self, slots: list[int], owner: int) -> list[bool]:
        """:meth:`held_mask` of a few slots, in plain ints (see SMALL_BATCH)."""
        lck_w, owner_w, w0, base = self.sec.lck_w, self.sec.owner_w, self.w0, self.base
        return [lck_w[w0 + (x >> 6)] >> (x & 63) & 1 == 1 and owner_w[base + x] == owner
                for x in slots]

    def end_consumed_few(self, slots: list[int], exclusive: bool) -> None:
        """:meth:`end_consumed` of a few slots, in plain ints (see SMALL_BATCH):
        the same writes in the same order (counters; records, LCK, owners)."""
        Q, b, s = self.Q, self.qb, self.sec
        n = len(slots)
        Q[b + L.Q_DEPTH_HINT] -= n
        Q[b + L.Q_N_DEQ_COMMIT] += n
        self.cache.clear_few(slots)
        lck_w, owner_w, base = s.lck_w, s.owner_w, self.base
        for w, m in self._word_masks(slots).items():
            lck_w[w] &= ~m & _U64
        for x in slots:
            owner_w[base + x] = 0
        if exclusive and Q[b + L.Q_DEQ_INFLIGHT] > 0:
            Q[b + L.Q_DEQ_INFLIGHT] = max(0, Q[b + L.Q_DEQ_INFLIGHT] - n)
            if Q[b + L.Q_DEQ_INFLIGHT] == 0:
                Q[b + L.Q_DEQ_OWNER] = 0

    def unlock_dequeued(self, slots: np.ndarray, exclusive: bool) -> None:
        """Unlock dequeued ``slots`` (their DEQ bits already as they stay) and
        give back the single-dequeuer role once nothing is in flight. Their
        records are cleared: consumed, or the row counts a delivery now, a record
        serves one first delivery (a redelivery reads the row)."""
        Q, b, s = self.Q, self.qb, self.sec
        self.cache.clear(slots)
        lo, mask = bit_mask(slots)
        s.lck[self.w0 + lo : self.w0 + lo + mask.size] &= ~mask
        s.owner[self.base + slots] = 0
        if exclusive and Q[b + L.Q_DEQ_INFLIGHT] > 0:
            Q[b + L.Q_DEQ_INFLIGHT] = max(0, Q[b + L.Q_DEQ_INFLIGHT] - slots.size)
            if Q[b + L.Q_DEQ_INFLIGHT] == 0:
                Q[b + L.Q_DEQ_OWNER] = 0

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

    def record_wait(self, us: int, n: int = 1) -> None:
        """Add ``n`` consumed entries' wait (us each: enqueue to the dequeue's
        commit) to the wait histogram and sum; a negative wait (the clocks of
        the server that stamped enq_at and of this host disagree) counts as 0."""
        us = max(0, us)
        b = self.qb
        self.Q[b + L.Q_WAIT_HIST + min(us.bit_length(), L.HIST_BUCKETS - 1)] += n
        self.Q[b + L.Q_WAIT_US] += us * n

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

    def _not_our_turn(self, owner: int) -> bool:
        """Whether a single-dequeuer queue's role is another's (or the SQL
        path asked for it): nothing for ``owner``. Entries fallen due are still
        released, so the queue's next due time moves on (a dequeuer waiting
        here sleeps until then, rather than trying again at once)."""
        Q, b = self.Q, self.qb
        holder = Q[b + L.Q_DEQ_OWNER]
        if (holder and holder != owner) or (not holder and self._role_asked_for_sql(owner)):
            if Q[b + L.Q_N_WAITING]:
                release_due(self)
            return True
        return False

    def _due_window(self, tail: int, window: int, exclusive: bool) -> int:
        """A claim in a queue with waiting entries: release those due; in a
        single-dequeuer queue the claim's window then ends at the oldest one
        still waiting (the head waits: order is the promise)."""
        release_due(self)
        if exclusive and self.Q[self.qb + L.Q_N_WAITING]:
            first = self.first_waiting(tail)
            if first is not None:
                return min(window, first)
        return window

    def until_due_s(self) -> float:
        """Seconds until the earliest waiting entry falls due (a large
        number if none waits): a sleeping dequeuer wakes by then."""
        return until_due_s(self)

    def maybe_ready(self) -> bool:
        """Whether the bitmaps show a ready entry in the window, read without
        the queue lock: a hint. A dequeuer woken by a post sees every bit the
        poster set before it (the semaphore orders them), so a False here
        means another took the entries: it sleeps again, still registered,
        without a lock round."""
        tail = self.Q[self.qb + L.Q_TAIL]
        n = self.Q[self.qb + L.Q_HEAD] - tail
        return n > 0 and (self._find(tail % self.cap, n, ready=True) is not None or due_now(self))

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
