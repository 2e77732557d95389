"""The ring's bitmap scans against a brute-force reading of the same bits.

No database: a private global section (conftest's ``section``).
The scan has a plain-int fast path for the first words and a numpy path for
the rest; random bitmaps of every density, capacities around word edges and
windows that wrap exercise both and their seam.
"""

from __future__ import annotations

import random

import pytest
from ringq.engine import Ring, Section
from ringq.engine import layout as L


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
