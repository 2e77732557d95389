"""The ring's bitmap scans against a brute-force reading of the same bits.

No database: a private global section is made for the test and removed after.
The scan has a plain-int fast path for the first words and a numpy path for
the rest; random bitmaps of every density, capacities around word edges and
windows that wrap exercise both and their seam.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator

import pytest
from ringq.engine import Ring, Section


@pytest.fixture
def section() -> Iterator[Section]:
    instance = "ringtest" + secrets.token_hex(6)
    sec = Section.attach(instance)
    try:
        yield sec
    finally:
        Section.unlink(instance)


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
