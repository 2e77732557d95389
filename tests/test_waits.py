"""The enqueue-to-dequeue wait: an entry's enqueue (its row's enq_at) to the
commit of the dequeue that consumed it, counted per queue in the section
(``Q_WAIT_HIST``, ``Q_WAIT_US``) by that commit, served from the payload cache
or read from the row, one entry or a batch.

The tests sleep between an enqueue and its dequeue: that sleep is the
quantity measured, not a synchronisation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import present
from ringq.engine import connect
from ringq.engine import layout as L
from ringq.engine import metrics as M

WAIT_S = 0.2  # the known wait between the enqueue's commit and the dequeue's


def waits(s: Any, queue: str) -> tuple[list[int], int]:
    """The queue's wait histogram and its sum (us), as the section holds them."""
    qidx = s.ring(queue).qidx
    return M.wait_histogram(s.section, qidx), M.queue_stats(s.section, qidx)[M.WAIT_US]


def in_buckets(hist: list[int], lo_us: int, hi_us: int) -> int:
    """Counts of ``hist`` in the buckets waits of ``lo_us`` … ``hi_us`` fall in."""
    return sum(hist[lo_us.bit_length() : min(hi_us.bit_length(), L.HIST_BUCKETS - 1) + 1])


@pytest.mark.parametrize("cache_payload", [16, 0], ids=["cache-hit", "row-read"])
def test_a_committed_dequeue_records_its_entries_wait(
    dsn: str, make_queue: Callable[..., str], cache_payload: int
) -> None:
    q = make_queue(capacity=32, cache_payload=cache_payload)
    with connect(dsn) as s:
        # One entry (a finish of one op) and a batch of ten (the vectorised finish).
        before_enq = time.time_ns() // 1000
        s.enqueue(q, b"one")
        s.enqueue_many(q, [b"b%d" % i for i in range(10)])
        s.commit()
        after_enq = time.time_ns() // 1000
        assert waits(s, q) == ([0] * L.HIST_BUCKETS, 0)
        time.sleep(WAIT_S)  # the wait measured

        assert present(s.dequeue(q)).payload == b"one"
        s.rollback(count_delivery=False)  # a dequeue that does not commit waits on
        assert waits(s, q) == ([0] * L.HIST_BUCKETS, 0)
        assert present(s.dequeue(q)).payload == b"one"
        before_deq = time.time_ns() // 1000
        s.commit()
        after_deq = time.time_ns() // 1000
        hist, total = waits(s, q)
        lo, hi = before_deq - after_enq, after_deq - before_enq
        assert lo >= WAIT_S * 1e6
        assert sum(hist) == 1 and lo <= total <= hi, (lo, total, hi)
        assert hist[total.bit_length()] == 1  # the bucket of the call latencies' encoding
        # p50 as the sampler reads it: the bucket's upper bound, at most twice the wait
        assert lo <= M.percentile_us(hist, 0.5) <= 2 * hi

        got = s.dequeue_many(q, 10)
        assert len(got) == 10
        before_deq = time.time_ns() // 1000
        s.commit()
        after_deq = time.time_ns() // 1000
        hist2, total2 = waits(s, q)
        lo, hi = before_deq - after_enq, after_deq - before_enq
        assert sum(hist2) == 11
        assert 10 * lo <= total2 - total <= 10 * hi, (lo, (total2 - total) / 10, hi)
        assert in_buckets([a - b for a, b in zip(hist2, hist, strict=True)], lo, hi) == 10


def test_commit_and_dequeue_records_the_wait_of_the_entry_it_commits(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """The dequeue that ``commit_and_dequeue`` takes is counted at the next commit."""
    q = make_queue(capacity=8, cache_payload=0)
    with connect(dsn) as s:
        before_enq = time.time_ns() // 1000
        s.enqueue_many(q, [b"a", b"b"])
        s.commit()
        time.sleep(WAIT_S)  # the wait measured
        assert present(s.dequeue(q)).payload == b"a"
        assert present(s.commit_and_dequeue(q)).payload == b"b"  # commits "a", takes "b"
        hist, total = waits(s, q)
        assert sum(hist) == 1 and total >= WAIT_S * 1e6
        s.commit()
        hist, total2 = waits(s, q)
        assert sum(hist) == 2
        assert WAIT_S * 1e6 <= total2 - total <= time.time_ns() // 1000 - before_enq
