"""Scanning the bitmaps of one queue block: which slots are ready, which are done.

A slot is *ready* when its ENQ bit is set and its DEQ and LCK bits are not;
*done* (the tail may pass it) when DEQ is set and LCK is not. Scans read the
block's words near the tail as plain ints (numpy's per-call cost is most of
a short scan) and further on in numpy chunks that grow fourfold, so a
claim near the tail costs a few word reads and a scan across the whole ring
stays vectorised. :class:`RingScan` is the base of :class:`~._ring.Ring`;
like it, every method must be called under the queue's lock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

from ..section import Section
from ..section import layout as L

_U64 = (1 << 64) - 1

_FIRST_CHUNK = 2
_MAX_CHUNK = 1024
_GROUPED_PY_WORDS = 4  # words a grouped claim reads as plain ints before numpy chunks
_ISIN_FROM = 16  # busy groups from which np.isin beats one comparison per group
# Below these sizes plain ints beat numpy, whose per-call cost is most of a
# small batch's work (a take of 8: bit_mask and set_bits were ~8 % of an
# asyncio consumer's CPU in numpy's call overhead alone).
SMALL_BATCH = 32  # slots
_PY_WORDS = 4  # words
# words a claim of a few reads as plain ints before numpy chunks: past the
# tail, 32 consumers taking 8 each hold about 4 words locked
_COLLECT_PY_WORDS = 16


def lowest_bit(x: int) -> int:
    return (x & -x).bit_length() - 1


def set_bits(words: np.ndarray) -> np.ndarray:
    """Positions (word * 64 + bit, ascending) of the set bits of ``words``
    (uint64), unpacking only the words that have one."""
    if words.size <= _PY_WORDS:
        out: list[int] = []
        for i, x in enumerate(words.tolist()):
            while x:
                low = x & -x
                out.append(i * 64 + low.bit_length() - 1)
                x ^= low
        return np.array(out, dtype=np.intp)
    nz = np.flatnonzero(words)
    if not nz.size:
        return nz
    rows, cols = np.nonzero(
        np.unpackbits(words[nz].view(np.uint8), bitorder="little").reshape(-1, 64)
    )
    return nz[rows] * 64 + cols


def not_in(tags: np.ndarray, busy: set[int]) -> np.ndarray:
    """A mask of the ``tags`` not in ``busy`` (non-empty)."""
    if len(busy) >= _ISIN_FROM:
        return ~np.isin(tags, np.fromiter(busy, dtype=np.int64, count=len(busy)))
    keep = np.ones(tags.shape, dtype=bool)
    for tag in busy:
        keep &= tags != tag
    return keep


def bit_mask(slots: np.ndarray) -> tuple[int, np.ndarray]:
    """(first word, uint64 words) with the bits of ``slots`` (queue-relative,
    int64, not empty) set: OR it into, or clear it from, the block's words
    from that word on."""
    if slots.size <= SMALL_BATCH:
        xs = slots.tolist()
        lo = min(xs) >> 6
        out = [0] * ((max(xs) >> 6) - lo + 1)
        for x in xs:
            out[(x >> 6) - lo] |= 1 << (x & 63)
        return lo, np.array(out, dtype=np.uint64)
    lo = int(slots.min()) >> 6
    hi = int(slots.max()) >> 6
    bits = np.zeros((hi - lo + 1) * 64, dtype=bool)
    bits[slots - lo * 64] = True
    return lo, np.packbits(bits, bitorder="little").view(np.uint64)


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


class RingScan:
    """The scans of queue block ``qidx`` (the geometry :class:`~._ring.Ring` reads)."""

    __slots__ = ("Q", "base", "cap", "qb", "qidx", "sec", "w0")

    def __init__(self, sec: Section, qidx: int) -> None:
        self.sec = sec
        self.qidx = qidx
        self.qb = qidx * L.QUEUE_WORDS
        self.Q = sec.queues
        self.cap = self.Q[self.qb + L.Q_CAPACITY]
        self.base = self.Q[self.qb + L.Q_BASE]
        self.w0 = self.base >> 6

    def _ready_slots(self, tail: int, window: int, n: int) -> list[int]:
        """Up to ``n`` of the oldest ready slots of the window (``window``
        slots from ``tail``); in a grouped queue, passing over entries whose
        group is busy, or waits for an older entry not due yet, and at most
        one per group."""
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
        if busy is not None and slots and self.Q[self.qb + L.Q_N_WAITING]:
            slots = self._behind_waiting(tail, window, n, slots)
        return slots

    def _behind_waiting(self, tail: int, window: int, n: int, first: list[int]) -> list[int]:
        """A grouped claim's slots when entries wait: a group's entries
        after its oldest waiting entry wait for it (the group waits for its
        head). The plain collection ``first`` stands when none of its groups
        has an entry waiting ahead of it; else the ready slots are walked in
        order past those. The waiting entries are never walked in Python:
        one vectorized pass matches their groups against the claim's, and a
        group's head is looked up only for the groups the claim meets."""
        cap, G, base = self.cap, self.sec.group_w, self.base
        tags = {G[base + slot] for slot in first}
        tags.discard(0)
        if not tags:
            return first
        waiting, wtags = self._window_waiting(tail, window)
        if not_in(wtags[waiting], tags).all():
            return first  # none of the claim's groups waits
        heads: dict[int, int | None] = {}

        def behind(slot: int) -> bool:
            tag = G[base + slot]
            if not tag:
                return False
            if tag not in heads:  # its oldest waiting entry: slots from the tail, or None
                hit = waiting & (wtags == tag)
                first_hit = int(np.argmax(hit))
                heads[tag] = first_hit if hit[first_hit] else None
            head = heads[tag]
            return head is not None and (slot - tail) % cap > head

        if not any(behind(slot) for slot in first):
            return first
        busy = self.busy_groups()
        out: list[int] = []
        for a, b in self._spans(tail, window):
            for slot, tag in self._ready_tagged(a, b, busy):
                if tag and (tag in busy or behind(slot)):
                    continue
                if tag:
                    busy.add(tag)
                out.append(slot)
                if len(out) >= n:
                    return out
        return out

    def _window_waiting(self, tail: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(waiting, tags) of the ``window`` slots from ``tail``, index = slots
        from the tail: whether each waits (ENQ, DEQ and LCK clear, see
        ``_waiting``), and its group tag."""
        masks, tags = [], []
        for a, b in self._spans(tail, window):
            words = self._waiting_words(a, b)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little").view(bool)
            masks.append(bits[a & 63 : (a & 63) + b - a])
            tags.append(self.sec.group[self.base + a : self.base + b])
        if len(masks) == 1:
            return masks[0], tags[0]
        return np.concatenate(masks), np.concatenate(tags)

    def first_waiting(self, tail: int) -> int | None:
        """How many slots from the tail come before the oldest waiting entry
        (None: none waits): a single-dequeuer queue's claim stops there."""
        slots = self.waiting_slots()
        if not slots.size:
            return None
        return int(((slots - tail) % self.cap).min())

    def waiting_slots(self) -> np.ndarray:
        """The queue's waiting slots (ENQ, DEQ and LCK clear inside the
        window: see ``_waiting``), int64, in no particular order."""
        tail = self.Q[self.qb + L.Q_TAIL]
        window = self.Q[self.qb + L.Q_HEAD] - tail
        if window <= 0:
            return np.empty(0, dtype=np.int64)
        parts = []
        for a, b in self._spans(tail, window):
            words = self._waiting_words(a, b)
            if a & 63:
                words[0] &= np.uint64((_U64 << (a & 63)) & _U64)
            if b & 63:
                words[-1] &= np.uint64((1 << (b & 63)) - 1)
            parts.append((a >> 6) * 64 + set_bits(words))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _spans(self, tail: int, window: int) -> list[tuple[int, int]]:
        """The ``window`` slots from ``tail`` as queue-relative ranges [a, b):
        one, or two where the window wraps past the ring's last slot."""
        start = tail % self.cap
        end = start + window
        return [(start, end)] if end <= self.cap else [(start, self.cap), (0, end - self.cap)]

    def _waiting_words(self, a: int, b: int) -> np.ndarray:
        """The words covering slots [a, b) with a slot's bit set where ENQ, DEQ
        and LCK are all clear (a waiting entry, inside the window; see
        ``_waiting``), unmasked at the edges: a copy."""
        s = self.sec
        g0, g1 = self.w0 + (a >> 6), self.w0 + ((b - 1) >> 6) + 1
        words: np.ndarray = ~(s.enq[g0:g1] | s.deq[g0:g1] | s.lck[g0:g1])
        return words

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
        for a, b in self._spans(tail, window):
            g0, g1 = self.w0 + (a >> 6), self.w0 + ((b - 1) >> 6) + 1
            held = (a >> 6) * 64 + set_bits(s.lck[g0:g1] & s.deq[g0:g1])
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
        w = self._collect_near(a, b, n, out)
        chunk = _FIRST_CHUNK * 4
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

    def _collect_near(self, a: int, b: int, n: int, out: list[int]) -> int:
        """:meth:`_collect`'s first ``_COLLECT_PY_WORDS`` words, as plain ints
        through the memoryviews (inline: a word passed over costs a few
        hundred ns), taking bits only until ``out`` holds ``n``. A take of 8
        from full words once unpacked every bit of two words, and the words
        that many consumers hold locked past the tail went to numpy. Returns
        the next word to read (past ``b``'s last word once ``out`` is full)."""
        wl = (b - 1) >> 6
        if len(out) >= n:
            return wl + 1
        w = a >> 6
        s = self.sec
        enq_w, deq_w, lck_w, w0 = s.enq_w, s.deq_w, s.lck_w, self.w0
        stop = min(wl + 1, w + _COLLECT_PY_WORDS)
        while w < stop:
            g = w0 + w
            x = enq_w[g] & ~(deq_w[g] | lck_w[g])
            if x:
                if w == a >> 6 and a & 63:
                    x &= (_U64 << (a & 63)) & _U64
                if w == wl and b & 63:
                    x &= (1 << (b & 63)) - 1
                while x:
                    low = x & -x
                    out.append((w << 6) + low.bit_length() - 1)
                    if len(out) >= n:
                        return wl + 1
                    x ^= low
            w += 1
        return w

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
            slots = w * 64 + set_bits(self._words(w, we, a, b, ready=True))  # in order
            if slots.size:
                tags = self.sec.group[base + slots]
                if busy:
                    keep = not_in(tags, busy)
                    self.Q[self.qb + L.Q_N_GROUP_SKIPS] += int(slots.size - np.count_nonzero(keep))
                    slots, tags = slots[keep], tags[keep]
                yield from zip(slots.tolist(), tags.tolist(), strict=True)
            w = we
            chunk = min(chunk * 4, _MAX_CHUNK)


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
        words: np.ndarray
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
                return (w << 6) + lowest_bit(word)
            w += 1
        chunk = _FIRST_CHUNK * 4
        while w <= wl:
            we = min(wl + 1, w + chunk)
            words = self._words(w, we, a, b, ready=ready)
            nz = np.flatnonzero(words)
            if nz.size:
                i = int(nz[0])
                return ((w + i) << 6) + lowest_bit(int(words[i]))
            w = we
            chunk = min(chunk * 4, _MAX_CHUNK)
        return None

    # -- holders ------------------------------------------------------------------------


    def ready_array(self, tail: int, window: int, n: int) -> np.ndarray:
        """:meth:`_ready_slots` as an int64 array; an ungrouped queue's scan
        stays in numpy (no Python per slot)."""
        if self.Q[self.qb + L.Q_GROUPED]:
            return np.array(self._ready_slots(tail, window, n), dtype=np.int64)
        start = tail % self.cap
        end = start + window
        if end <= self.cap:
            return self._ready_in(start, end, n)
        first = self._ready_in(start, self.cap, n)
        if first.size >= n:
            return first
        return np.concatenate((first, self._ready_in(0, end - self.cap, n - first.size)))

    def _ready_in(self, a: int, b: int, n: int) -> np.ndarray:
        """Up to ``n`` ready slots in [a, b), oldest first (int64)."""
        wl = (b - 1) >> 6
        w = a >> 6
        chunk = max(_FIRST_CHUNK, (n + 63) >> 6)
        parts: list[np.ndarray] = []
        have = 0
        while w <= wl and have < n:
            we = min(wl + 1, w + chunk)
            pos = set_bits(self._words(w, we, a, b, ready=True))
            if pos.size:
                pos = pos[: n - have] + w * 64
                parts.append(pos)
                have += pos.size
            w = we
            chunk = min(chunk * 4, _MAX_CHUNK)
        if not parts:
            return np.empty(0, dtype=np.int64)
        out: np.ndarray = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return out

    # -- inspection ---------------------------------------------------------------

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
        tail = self.Q[self.qb + L.Q_TAIL]
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
        tail, head = self.Q[self.qb + L.Q_TAIL], self.Q[self.qb + L.Q_HEAD]
        bits = self.window_bits()
        return {
            "window": head - tail,
            "ready": int(np.count_nonzero(bits["enq"] & ~bits["deq"] & ~bits["lck"])),
            "locked": int(np.count_nonzero(bits["lck"])),
            "done": int(np.count_nonzero(bits["deq"] & ~bits["lck"])),
        }

    def window_bits(self) -> dict[str, np.ndarray]:
        """Boolean arrays (ENQ, DEQ, LCK) for positions tail..head-1, in sequence order."""
        tail, head = self.Q[self.qb + L.Q_TAIL], self.Q[self.qb + L.Q_HEAD]
        slots = np.arange(tail, head, dtype=np.int64) % self.cap
        out = {}
        for key, arr in (("enq", self.sec.enq), ("deq", self.sec.deq), ("lck", self.sec.lck)):
            words = arr[self.w0 : self.w0 + (self.cap + 63) // 64]
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.cap].astype(bool)
            out[key] = bits[slots]
        return out
