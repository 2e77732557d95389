"""The global section's pool space for queues made after others were dropped.

No database: a private global section (conftest's ``section``).
"""

from __future__ import annotations

from ringq.engine import Section
from ringq.engine import layout as L


def _cache(sec: Section, qidx: int) -> tuple[int, int]:
    """(first byte, bytes) of block ``qidx``'s payload cache space."""
    b = qidx * L.QUEUE_WORDS
    return int(sec.queues[b + L.Q_CACHE_BASE]), int(sec.queues[b + L.Q_CACHE_AREA])


def test_a_queue_made_when_the_cache_pool_is_used_up_gets_a_dropped_queues_space(
    section: Section,
) -> None:
    """Once the cache pool's end is reached (queues made and dropped over a
    long life), a new queue's cache takes the space a dropped queue left if it
    is large enough, whatever block the new queue gets; space in use is never
    given out twice; and with nothing large enough the queue runs without one."""
    a = section.allocate_queue(1, "a", 64, cache_payload=1000)
    kept = section.allocate_queue(2, "kept", 64, cache_payload=1000)
    a_space, kept_space = _cache(section, a), _cache(section, kept)
    assert a_space[1] > 0 and kept_space[1] > 0
    section.mark_queue_dropped(a)
    section.header[L.H_NEXT_CACHE] = L.CACHE_POOL - 64  # the pool's end reached
    # More slots than a's block holds (a fresh block), a smaller cache: a's space.
    b = section.allocate_queue(3, "b", 128, cache_payload=100)
    assert b not in (a, kept)
    assert _cache(section, b) == a_space and _cache(section, a) == (0, 0)
    # Given once: the next one finds no dropped space left, and runs without a cache.
    c = section.allocate_queue(4, "c", 128, cache_payload=100)
    assert _cache(section, c) == (0, 0)
    assert _cache(section, kept) == kept_space
