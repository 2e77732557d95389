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
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import _layout as L
from ._ops import OpKind, RowState
from ._section import Section

if TYPE_CHECKING:
    from ._ops import Op

_U64 = (1 << 64) - 1
# A payload cache hit: (payload, producer, producer_seq, enqueued at in us, group).
Cached = tuple[bytes, str, int, int, str | None]
_FIRST_CHUNK = 2
_MAX_CHUNK = 1024
_GROUPED_PY_WORDS = 4  # words a grouped claim reads as plain ints before numpy chunks
_ISIN_FROM = 16  # busy groups from which np.isin beats one comparison per group


def _lowest_bit(x: int) -> int:
    return (x & -x).bit_length() - 1


def _set_bits(words: np.ndarray) -> np.ndarray:
    """Positions (word * 64 + bit, ascending) of the set bits of ``words``
    (uint64), unpacking only the words that have one."""
    nz = np.flatnonzero(words)
    if not nz.size:
        return nz
    rows, cols = np.nonzero(
        np.unpackbits(words[nz].view(np.uint8), bitorder="little").reshape(-1, 64)
    )
    return nz[rows] * 64 + cols


def _not_in(tags: np.ndarray, busy: set[int]) -> np.ndarray:
    """A mask of the ``tags`` not in ``busy`` (non-empty)."""
    if len(busy) >= _ISIN_FROM:
        return ~np.isin(tags, np.fromiter(busy, dtype=np.int64, count=len(busy)))
    keep = np.ones(tags.shape, dtype=bool)
    for tag in busy:
        keep &= tags != tag
    return keep


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


class Ring:
    """A view of queue block ``qidx`` (cheap to make; holds no lock itself)."""

    __slots__ = ("Q", "base", "cache_payload", "cap", "cbase", "qb", "qid", "qidx", "sec",
                 "stride", "w0")

    def __init__(self, sec: Section, qidx: int) -> None:
        self.sec = sec
        self.qidx = qidx
        self.qb = qidx * L.QUEUE_WORDS
        self.Q = sec.queues
        self.qid = self.Q[self.qb + L.Q_QID]
        self.cap = self.Q[self.qb + L.Q_CAPACITY]
        self.base = self.Q[self.qb + L.Q_BASE]
        self.w0 = self.base >> 6
        self.cache_payload = self.Q[self.qb + L.Q_CACHE_PAYLOAD]
        self.stride = self.Q[self.qb + L.Q_CACHE_STRIDE]
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
        """Lock up to ``n`` of the oldest ready entries for ``owner`` with one scan."""
        Q, b = self.Q, self.qb
        if exclusive:
            holder = Q[b + L.Q_DEQ_OWNER]
            if holder and holder != owner:
                return []
        tail = Q[b + L.Q_TAIL]
        window = Q[b + L.Q_HEAD] - tail
        if window <= 0:
            return []
        slots = self._ready_slots(tail, window, n)
        s = self.sec
        out = []
        for slot in slots:
            w, m = self._bit(slot)
            s.holder_w[self.base + slot] = backend
            s.owner_w[self.base + slot] = owner
            s.lck_w[w] |= m
            s.deq_w[w] |= m
            out.append((slot, tail + (slot - tail) % self.cap))
        if out:
            if exclusive:
                Q[b + L.Q_DEQ_OWNER] = owner
                Q[b + L.Q_DEQ_INFLIGHT] += len(out)
            Q[b + L.Q_N_DEQ] += len(out)
        return out

    def _ready_slots(self, tail: int, window: int, n: int) -> list[int]:
        """Up to ``n`` of the oldest ready slots of the window (``window``
        slots from ``tail``); in a grouped queue, passing over entries whose
        group is busy, and at most one per group."""
        busy = self.busy_groups() if self.Q[self.qb + L.Q_GROUPED] else None
        start = tail % self.cap
        slots: list[int] = []
        end = start + window
        if end <= self.cap:
            self._collect(start, end, n, slots, busy)
        else:
            self._collect(start, self.cap, n, slots, busy)
            if len(slots) < n:
                self._collect(0, end - self.cap, n, slots, busy)
        return slots

    def busy_groups(self) -> set[int]:
        """Tags of the groups with an entry held by a dequeuer (LCK and DEQ
        set: dequeued, or in a prepared transaction) in this queue: a scan of
        the window's words (slots outside it are done, never locked)."""
        s = self.sec
        tail = self.Q[self.qb + L.Q_TAIL]
        window = self.Q[self.qb + L.Q_HEAD] - tail
        if window <= 0:
            return set()
        busy: set[int] = set()
        start = tail % self.cap
        end = start + window
        spans = [(start, end)] if end <= self.cap else [(start, self.cap), (0, end - self.cap)]
        for a, b in spans:
            g0, g1 = self.w0 + (a >> 6), self.w0 + ((b - 1) >> 6) + 1
            held = (a >> 6) * 64 + _set_bits(s.lck[g0:g1] & s.deq[g0:g1])
            tags = s.group[self.base + held]
            busy.update(tags[tags != 0].tolist())
        return busy

    def _collect(
        self, a: int, b: int, n: int, out: list[int], busy: set[int] | None = None
    ) -> None:
        """Append ready slots in [a, b) to ``out``, oldest first, until it
        holds ``n``. With ``busy`` (a grouped queue), a slot whose group tag is
        in it is passed over, and each slot taken adds its group."""
        if busy is not None:
            self._collect_grouped(a, b, n, out, busy)
            return
        wl = (b - 1) >> 6
        chunk = _FIRST_CHUNK
        w = a >> 6
        while w <= wl and len(out) < n:
            we = min(wl + 1, w + chunk)
            words = self._words(w, we, a, b, ready=True)
            for i in np.flatnonzero(words):
                x = int(words[i])
                while x and len(out) < n:
                    low = x & -x
                    out.append(((w + int(i)) << 6) + low.bit_length() - 1)
                    x ^= low
                if len(out) >= n:
                    return
            w = we
            chunk = min(chunk * 4, _MAX_CHUNK)

    def _collect_grouped(self, a: int, b: int, n: int, out: list[int], busy: set[int]) -> None:
        skipped = 0
        for slot, tag in self._ready_tagged(a, b, busy):
            if tag:
                if tag in busy:
                    skipped += 1
                    continue
                busy.add(tag)
            out.append(slot)
            if len(out) >= n:
                break
        if skipped:
            self.Q[self.qb + L.Q_N_GROUP_SKIPS] += skipped

    def _ready_tagged(self, a: int, b: int, busy: set[int]) -> Iterator[tuple[int, int]]:
        """Ready slots in [a, b), oldest first, each with its group tag. A
        numpy chunk leaves out the slots whose group is in ``busy`` as the
        chunk is read (counted as group skips); the caller tests the rest."""
        wl = (b - 1) >> 6
        G, base = self.sec.group_w, self.base
        # Near the tail, as _find_in: plain ints through the memoryviews
        # (numpy's per-call cost is most of a short scan).
        w = a >> 6
        stop = min(wl + 1, w + _GROUPED_PY_WORDS)
        while w < stop:
            word = self._word(w, a, b, ready=True)
            while word:
                low = word & -word
                word ^= low
                slot = (w << 6) + low.bit_length() - 1
                yield slot, G[base + slot]
            w += 1
        chunk = _FIRST_CHUNK * 4
        while w <= wl:
            we = min(wl + 1, w + chunk)
            slots = w * 64 + _set_bits(self._words(w, we, a, b, ready=True))  # in order
            if slots.size:
                tags = self.sec.group[base + slots]
                if busy:
                    keep = _not_in(tags, busy)
                    self.Q[self.qb + L.Q_N_GROUP_SKIPS] += int(slots.size - np.count_nonzero(keep))
                    slots, tags = slots[keep], tags[keep]
                yield from zip(slots.tolist(), tags.tolist(), strict=True)
            w = we
            chunk = min(chunk * 4, _MAX_CHUNK)

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
            s.cache_w[(self._record(slot) >> 3) + L.R_TAG] = 0
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
        Q, b = self.Q, self.qb
        n_ready = n_space = 0
        latencies: dict[tuple[OpKind, int], int] = {}  # a batch's ops share one latency
        for op in ops:
            if not self.held_by(op.slot, owner):
                continue  # already decided by recovery (never finish a slot twice)
            if op.kind == OpKind.ENQUEUE:
                if committed and enq_at_us is not None and op.fill is not None and self.stride:
                    f = op.fill
                    self.cache_put(
                        op.slot, op.seq, f.payload, f.producer.encode(), f.producer_seq, enq_at_us,
                        None if f.group is None else f.group.encode(),
                    )
                self.finish_enqueue(op.slot, committed)
                n_ready += committed
            else:
                consumed = committed or (op.slot, op.seq) in poisoned
                was_owner = Q[b + L.Q_DEQ_OWNER]
                # a consumed entry of a group frees the group: its next entry
                # may be what a sleeping dequeuer waits for
                freed_group = consumed and self.sec.group_w[self.base + op.slot] != 0
                self.finish_dequeue(op.slot, consumed, exclusive=exclusive, reclaim=False)
                n_space += consumed
                n_ready += (
                    (not consumed)
                    or freed_group
                    or (exclusive and was_owner and not Q[b + L.Q_DEQ_OWNER])
                )
            key = (op.kind, op.latency_ns)
            latencies[key] = latencies.get(key, 0) + 1
        for (kind, ns), n in latencies.items():
            self.record_latency(kind, ns, n)
        if n_space:
            self.reclaim()  # once per queue, not once per entry
        if (poisoned_here := sum(1 for op in ops if (op.slot, op.seq) in poisoned)):
            Q[b + L.Q_N_POISONED] += poisoned_here
        wake_r = min(n_ready, Q[b + L.Q_WAIT_READY])
        wake_s = min(n_space, Q[b + L.Q_WAIT_SPACE])
        if n_space and Q[b + L.Q_FULL_SINCE_NS]:
            Q[b + L.Q_FULL_NS] += time.monotonic_ns() - Q[b + L.Q_FULL_SINCE_NS]
            Q[b + L.Q_FULL_SINCE_NS] = 0
        if wake_r:
            Q[b + L.Q_N_WAKEUPS] += wake_r
        return wake_r, wake_s

    # -- payload cache ---------------------------------------------------------------

    def _record(self, slot: int) -> int:
        """Where ``slot``'s cache record starts in the pool (bytes; a multiple of 8)."""
        return self.cbase + slot * self.stride

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
        """Write the record of ``slot``'s new entry ``seq`` (the caller holds
        the slot and the queue lock, and has not set ENQ yet). False if the
        queue has no cache or the entry does not fit its record."""
        if (
            len(payload) > self.cache_payload
            or len(producer) > L.CACHE_PRODUCER_BYTES
            or (group is not None and len(group) > L.GROUP_BYTES)
        ):
            return False
        off = self._record(slot)
        s = self.sec
        cw, w = s.cache_w, off >> 3
        cw[w + L.R_TAG] = 0  # not trusted while half written (and a wrong tag anyway)
        cw[w + L.R_EPOCH] = self.Q[self.qb + L.Q_CACHE_EPOCH]
        cw[w + L.R_LEN] = len(payload)
        cw[w + L.R_PRODUCER_LEN] = len(producer)
        cw[w + L.R_PRODUCER_SEQ] = producer_seq
        cw[w + L.R_ENQ_AT_US] = enq_at_us
        cw[w + L.R_GROUP_LEN] = -1 if group is None else len(group)
        at = off + L.RECORD_WORDS * 8
        s.cache[at : at + len(producer)] = producer
        if group:
            at = off + L.RECORD_GROUP
            s.cache[at : at + len(group)] = group
        at = off + L.RECORD_HEAD
        s.cache[at : at + len(payload)] = payload
        cw[w + L.R_TAG] = seq + 1
        return True

    def cache_get(self, slot: int, seq: int) -> Cached | None:
        """(payload, producer, producer_seq, enqueued at in us, group) of
        entry ``seq`` from its record, if the record holds it (the caller
        holds the slot and the queue lock); else None, and the caller reads
        the row. Counted."""
        if not self.stride:
            return None
        off = self._record(slot)
        s = self.sec
        cw, w = s.cache_w, off >> 3
        Q, b = self.Q, self.qb
        if cw[w + L.R_TAG] != seq + 1 or cw[w + L.R_EPOCH] != Q[b + L.Q_CACHE_EPOCH]:
            Q[b + L.Q_N_CACHE_MISSES] += 1
            return None
        n, pn = cw[w + L.R_LEN], cw[w + L.R_PRODUCER_LEN]
        at = off + L.RECORD_WORDS * 8
        producer = bytes(s.cache[at : at + pn]).decode()
        gn = cw[w + L.R_GROUP_LEN]
        at = off + L.RECORD_GROUP
        group = None if gn < 0 else bytes(s.cache[at : at + gn]).decode()
        at = off + L.RECORD_HEAD
        Q[b + L.Q_N_CACHE_HITS] += 1
        return (bytes(s.cache[at : at + n]), producer, cw[w + L.R_PRODUCER_SEQ],
                cw[w + L.R_ENQ_AT_US], group)

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

    def add_waiter(self, kind: OpKind) -> None:
        """A ``kind`` caller is about to sleep on the queue's wake-up."""
        self.Q[self.qb + self._wait_word(kind)] += 1

    def remove_waiter(self, kind: OpKind) -> None:
        """A ``kind`` caller woke up (registered by :meth:`add_waiter`)."""
        self.Q[self.qb + self._wait_word(kind)] -= 1

    def abandon_wait(self, kind: OpKind) -> None:
        """A ``kind`` caller left its wait by an exception: undo its registration, if any."""
        word = self.qb + self._wait_word(kind)
        if self.Q[word] > 0:
            self.Q[word] -= 1

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

    # -- scanning -------------------------------------------------------------------

    def _find(self, start: int, n: int, *, ready: bool) -> int | None:
        """First slot from ``start`` over ``n`` slots (wrapping) that is ready
        (ENQ, not DEQ, not LCK) or, with ``ready=False``, not done (DEQ unset or LCK set)."""
        end = start + n
        if end <= self.cap:
            return self._find_in(start, end, ready)
        found = self._find_in(start, self.cap, ready)
        if found is not None:
            return found
        return self._find_in(0, end - self.cap, ready)

    def _word(self, w: int, a: int, b: int, *, ready: bool) -> int:
        """Queue-relative word ``w`` of the ready bits (ENQ, not DEQ, not
        LCK) or, with ``ready=False``, of the not-done bits (DEQ unset or LCK
        set), as a plain int masked to the slots [a, b)."""
        s = self.sec
        g = self.w0 + w
        if ready:
            word = s.enq_w[g] & ~s.deq_w[g] & ~s.lck_w[g]
        else:
            word = (~s.deq_w[g] | s.lck_w[g]) & _U64
        if w == a >> 6 and a & 63:
            word &= (_U64 << (a & 63)) & _U64
        if w == (b - 1) >> 6 and b & 63:
            word &= (1 << (b & 63)) - 1
        return word

    def _words(self, w: int, we: int, a: int, b: int, *, ready: bool) -> np.ndarray:
        """Queue-relative words [w, we) as :meth:`_word` makes one, as a
        numpy array (a copy)."""
        s = self.sec
        g0, g1 = self.w0 + w, self.w0 + we
        if ready:
            words = s.enq[g0:g1] & ~s.deq[g0:g1] & ~s.lck[g0:g1]
        else:
            words = ~s.deq[g0:g1] | s.lck[g0:g1]
        if w == a >> 6 and a & 63:
            words[0] &= np.uint64((_U64 << (a & 63)) & _U64)
        if we == ((b - 1) >> 6) + 1 and b & 63:
            words[-1] &= np.uint64((1 << (b & 63)) - 1)
        return words

    def _find_in(self, a: int, b: int, ready: bool) -> int | None:
        wa, wl = a >> 6, (b - 1) >> 6  # first and last word (inclusive), queue-relative
        # The answer is nearly always within a word or two of the tail: read
        # those as plain ints through the memoryviews (numpy's per-call cost,
        # a microsecond per operation, is the larger part of a short scan).
        w = wa
        stop = min(wl + 1, wa + _FIRST_CHUNK)
        while w < stop:
            word = self._word(w, a, b, ready=ready)
            if word:
                return (w << 6) + _lowest_bit(word)
            w += 1
        chunk = _FIRST_CHUNK * 4
        while w <= wl:
            we = min(wl + 1, w + chunk)
            words = self._words(w, we, a, b, ready=ready)
            nz = np.flatnonzero(words)
            if nz.size:
                i = int(nz[0])
                return ((w + i) << 6) + _lowest_bit(int(words[i]))
            w = we
            chunk = min(chunk * 4, _MAX_CHUNK)
        return None

    # -- holders ------------------------------------------------------------------------

    def locked_slots(self) -> list[tuple[int, int, int]]:
        """(slot, owner, holder) of every locked slot of the queue (a vectorized scan)."""
        s = self.sec
        # a copy: other processes change the words under a caller without the lock
        # (few words hold a locked slot: only those are unpacked)
        slots = _set_bits(s.lck[self.w0 : self.w0 + (self.cap + 63) // 64].copy())
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
        slots = _set_bits(words)
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
        at = _set_bits(old_lck)
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
