"""The ring's bitmap scans against a brute-force reading of the same bits.

No database: a private global section (conftest's ``section``).
The scan has a plain-int fast path for the first words and a numpy path for
the rest; random bitmaps of every density, capacities around word edges and
windows that wrap exercise both and their seam.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import numpy as np
import pytest
from ringq.engine import Ring, Section
from ringq.engine import layout as L
from ringq.engine.ring import (
    Cached,
    OpKind,
    QueueInfo,
    Run,
    after_finish,
    finish_batch,
    finish_run,
)


def _store(ring: Ring, words: memoryview, bits: list[bool]) -> None:
    for w in range((len(bits) + 63) // 64):
        v = 0
        for i, bit in enumerate(bits[w * 64 : w * 64 + 64]):
            v |= bit << i
        words[ring.w0 + w] = v


@pytest.mark.parametrize("capacity", [1, 5, 63, 64, 65, 130, 700])
def test_find_agrees_with_a_brute_force_scan(section: Section, capacity: int) -> None:
    rng = random.Random(capacity)
    ring = Ring(section, section.allocate_queue(1000 + capacity, f"q{capacity}", capacity))
    for _ in range(120):
        density = rng.choice((0.0, 0.002, 0.02, 0.3, 0.9, 1.0))
        enq = [rng.random() < density for _ in range(capacity)]
        deq = [rng.random() < 0.3 for _ in range(capacity)]
        lck = [rng.random() < 0.1 for _ in range(capacity)]
        _store(ring, section.enq_w, enq)
        _store(ring, section.deq_w, deq)
        _store(ring, section.lck_w, lck)
        start, n = rng.randrange(capacity), rng.randint(1, capacity)
        window = [(start + k) % capacity for k in range(n)]
        ready = next((s for s in window if enq[s] and not deq[s] and not lck[s]), None)
        busy = next((s for s in window if not deq[s] or lck[s]), None)
        assert ring._find(start, n, ready=True) == ready
        assert ring._find(start, n, ready=False) == busy


@pytest.mark.parametrize("exclusive", [False, True])
def test_finishing_consumed_entries_as_arrays_matches_one_at_a_time(
    section: Section, exclusive: bool
) -> None:
    """The SQL path's agent finishes what SQL consumers committed in one array
    pass (8 or more) or one slot at a time: the same words either way, and
    pairs it does not hold at that seq (given back, a wrong seq, another
    owner's) are passed over."""
    rng = random.Random(7)
    cap = 300
    rings = []
    for k in range(2):
        ring = Ring(section, section.allocate_queue(2000 + k, f"f{k}", cap))
        qb = ring.qb
        section.queues[qb + L.Q_HEAD] = 1000 + cap  # a window of cap entries, seq 1000 on
        section.queues[qb + L.Q_TAIL] = 1000
        _store(ring, section.enq_w, [True] * cap)
        rings.append(ring)
    claimed = [r.claim_many(L.OWNER_SQL, 4242, 120, exclusive=exclusive) for r in rings]
    assert claimed[0] == claimed[1] and len(claimed[0]) == 120
    other = [r.claim_many(77, 4343, 10, exclusive=False) for r in rings] if not exclusive else []
    done = rng.sample(claimed[0], 90) + [(s, q + cap) for s, q in claimed[0][:5]]
    if other:
        done += other[0][:5]
    rng.shuffle(done)
    n_vec = rings[0].finish_consumed(done, L.OWNER_SQL, exclusive=exclusive)
    n_one = sum(rings[1].finish_consumed(done[i : i + 5], L.OWNER_SQL, exclusive=exclusive)
                for i in range(0, len(done), 5))
    assert n_vec == n_one == 90
    words = (cap + 63) // 64
    for arr in (section.enq, section.deq, section.lck):
        assert list(arr[rings[0].w0 : rings[0].w0 + words]) == list(
            arr[rings[1].w0 : rings[1].w0 + words])
    assert list(section.owner[rings[0].base : rings[0].base + cap]) == list(
        section.owner[rings[1].base : rings[1].base + cap])
    for word in (L.Q_DEPTH_HINT, L.Q_N_DEQ_COMMIT, L.Q_DEQ_INFLIGHT, L.Q_DEQ_OWNER):
        assert section.queues[rings[0].qb + word] == section.queues[rings[1].qb + word]
    assert rings[0].counts()["locked"] == 30 + (0 if exclusive else 10)


@pytest.mark.parametrize("capacity", [5, 64, 130, 700, 2500])
def test_a_claim_of_a_few_takes_the_oldest_ready_slots(section: Section, capacity: int) -> None:
    """``claim_few`` (plain ints, a take of up to SMALL_BATCH) and the
    scans it shares with ``claim_batch`` take the oldest ready slots of the
    window, as a brute-force reading of the bits does, and lock exactly
    those: holder and owner set, LCK and DEQ set, every other bit as it was."""
    rng = random.Random(capacity)
    ring = Ring(section, section.allocate_queue(3000 + capacity, f"c{capacity}", capacity))
    words = (capacity + 63) // 64
    for _ in range(60):
        density = rng.choice((0.02, 0.3, 0.9, 1.0))
        enq = [rng.random() < density for _ in range(capacity)]
        deq = [rng.random() < 0.2 for _ in range(capacity)]
        lck = [rng.random() < 0.1 for _ in range(capacity)]
        for words_of, bits in ((section.enq_w, enq), (section.deq_w, deq),
                               (section.lck_w, lck)):
            _store(ring, words_of, bits)
        tail = 10 * capacity + rng.randrange(capacity)
        window = rng.randint(1, capacity)
        section.queues[ring.qb + L.Q_TAIL] = tail
        section.queues[ring.qb + L.Q_HEAD] = tail + window
        order = [(tail + k) % capacity for k in range(window)]
        ready = [s for s in order if enq[s] and not deq[s] and not lck[s]]
        for n in (1, 8, 33, capacity):  # 33: past SMALL_BATCH, the numpy scan
            assert ring.ready_array(tail, window, n).tolist() == ready[:n]
        n = rng.randint(1, 32)
        before = [list(a[ring.w0 : ring.w0 + words]) for a in (section.enq, section.deq,
                                                               section.lck)]
        slots, seqs = ring.claim_few(77, 4242, n, exclusive=False)
        assert slots == ready[:n]
        assert seqs == [tail + (s - tail) % capacity for s in slots]
        for s in range(capacity):
            took = s in slots
            assert ring.bits(s)[:3] == (enq[s], deq[s] or took, lck[s] or took)
            if took:
                assert (ring.holder(s), ring.bits(s)[3]) == (4242, 77)
        assert list(section.enq[ring.w0 : ring.w0 + words]) == before[0]
        assert section.queues[ring.qb + L.Q_TAIL] == tail


@pytest.mark.parametrize("n", [2, 5, 8, 32])
def test_finishing_a_few_consumed_as_a_run_matches_one_at_a_time(
    section: Section, n: int
) -> None:
    """A committed dequeue run of a few entries is finished in plain ints;
    per op (``finish_batch``) the words come out the same: bitmaps, owners,
    cache records untrusted, the queue's counters, latencies and waits. A
    slot decided meanwhile (another owner's now) is passed over by both."""
    cap = 200
    rings: list[Ring] = []
    for k in range(2):
        qidx = section.allocate_queue(4000 + 10 * n + k, f"r{n}_{k}", cap, cache_payload=32)
        ring = Ring(section, qidx)
        section.queues[ring.qb + L.Q_TAIL] = 500
        section.queues[ring.qb + L.Q_HEAD] = 500 + 60
        _store(ring, section.enq_w, [True] * cap)
        rings.append(ring)
    info = QueueInfo(1, "q", cap, 32, "block", 0.0, "shared", 5, None, 0.0, 32)
    enq_us = time.time_ns() // 1000 - 100_000_000  # 100 s ago: one bucket for both
    runs = []
    for ring in rings:
        for slot in range(100, 100 + 60):
            seq = ring.seq_of(slot)
            ring.cache.put(slot, seq, b"p", b"producer", seq, enq_us)
        slots, seqs = ring.claim_few(77, 4242, n, exclusive=False)
        section.owner_w[ring.base + slots[-1]] = 99  # decided by recovery, another's now
        runs.append(Run(ring, info, OpKind.DEQUEUE, np.array(slots), np.array(seqs), 1500,
                        consume=True, enq_us=np.full(n, enq_us, dtype=np.int64)))
    r = finish_run(rings[0], runs[0], 77, exclusive=False, enq_at_us=None)
    got = after_finish(rings[0], *r)
    want = finish_batch(rings[1], runs[1].ops(), 77, committed=True, poisoned=set(),
                        exclusive=False)
    assert got == want
    a, b = rings
    words = (cap + 63) // 64
    for arr in (section.enq, section.deq, section.lck):
        assert list(arr[a.w0 : a.w0 + words]) == list(arr[b.w0 : b.w0 + words])
    assert list(section.owner[a.base : a.base + cap]) == list(section.owner[b.base : b.base + cap])
    tags = [[section.cache_w[r.cache.cw0 + s * r.cache.sw + L.R_TAG] for s in range(cap)]
            for r in rings]
    assert tags[0] == tags[1]
    assert sum(t == 0 for t in tags[0][100:160]) == n - 1  # the held ones, untrusted
    for word in (L.Q_TAIL, L.Q_DEPTH_HINT, L.Q_N_DEQ_COMMIT, L.Q_N_DEQ, L.Q_DEQ_LAT_NS,
                 *range(L.Q_DEQ_HIST, L.Q_DEQ_HIST + L.HIST_BUCKETS),
                 *range(L.Q_WAIT_HIST, L.Q_WAIT_HIST + L.HIST_BUCKETS)):
        assert section.queues[a.qb + word] == section.queues[b.qb + word], word


def test_reading_records_a_few_at_a_time_or_as_arrays_matches_one_by_one(
    section: Section,
) -> None:
    """A batch's cache records read by ``get_few`` (a few, one pass) or
    ``get_many`` (arrays) give what ``get`` gives for each: two producers,
    entries in a group, a record of an older entry (wrong tag) and one of
    an older load (wrong epoch) missed; hits and misses counted alike."""
    rng = random.Random(5)
    ring = Ring(section, section.allocate_queue(5000, "records", 200, cache_payload=64))
    cache = ring.cache
    for slot in range(200):
        group = rng.choice((None, None, b"g1", "grüppe".encode()))
        producer = rng.choice((b"p-one", b"p-two", b""))
        cache.put(slot, slot + 1000, b"%d" % slot * rng.randint(0, 20), producer, slot, 7 + slot,
                  group)
    section.cache_w[cache.cw0 + 3 * cache.sw + L.R_TAG] = 999  # an older entry's record
    section.cache_w[cache.cw0 + 4 * cache.sw + L.R_EPOCH] = -5  # an older load's
    qb = ring.qb

    Read = Callable[[list[int], list[int]], list[Cached | None]]

    def counted(read: Read, slots: list[int]) -> tuple[list[Cached | None], int, int]:
        h0, m0 = section.queues[qb + L.Q_N_CACHE_HITS], section.queues[qb + L.Q_N_CACHE_MISSES]
        got = read(slots, [s + 1000 for s in slots])
        return (got, section.queues[qb + L.Q_N_CACHE_HITS] - h0,
                section.queues[qb + L.Q_N_CACHE_MISSES] - m0)

    def one_by_one(slots: list[int], seqs: list[int]) -> list[Cached | None]:
        return [cache.get(s, q) for s, q in zip(slots, seqs, strict=True)]

    def as_arrays(slots: list[int], seqs: list[int]) -> list[Cached | None]:
        return cache.get_many(np.array(slots), np.array(seqs))

    for slots in ([0, 1, 2, 3, 4, 5], list(range(8)), rng.sample(range(200), 32),
                  rng.sample(range(200), 60)):
        want = counted(one_by_one, slots)
        assert counted(cache.get_few, slots) == want == counted(as_arrays, slots)
        assert want[2] == (3 in slots) + (4 in slots)  # the two missed
