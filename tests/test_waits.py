"""The enqueue-to-dequeue wait: an entry's enqueue (its row's enq_at) to the
commit of the dequeue that consumed it, counted per queue in the section
(``Q_WAIT_HIST``, ``Q_WAIT_US``) by that commit, served from the payload cache
or read from the row, one entry or a batch.

The tests sleep between an enqueue and its dequeue: that sleep is the
quantity measured, not a synchronisation.
"""

from __future__ import annotations

import array
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import present
from ringq.engine import Ring, connect
from ringq.engine import layout as L
from ringq.engine import metrics as M
from ringq.engine.ring import _finish as F

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


def test_a_batch_of_many_enqueue_times_is_bucketed_as_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past WAIT_VECTOR_FROM distinct enqueue times a batch's waits go through
    numpy: the same buckets and sum as Ring.record_wait one by one, at the
    bucket edges (2**k - 1, 2**k) too, a negative wait (clocks apart) as 0."""
    now_us = 1_800_000_000_000_000
    monkeypatch.setattr(F, "time", SimpleNamespace(time_ns=lambda: now_us * 1000))
    waits_us = [0, 1, 2, 3, 4, 7, 8, 1023, 1024, 199_999, 200_000, 262_143, 262_144,
                -5, 2**31, 2**40]
    waits_us += [3**k + 5 for k in range(F.WAIT_VECTOR_FROM)]
    ops: list[Any] = [SimpleNamespace(enq_us=now_us - w) for w in waits_us]
    ops += [SimpleNamespace(enq_us=now_us - 200_000)] * 3 + [SimpleNamespace(enq_us=0)]
    assert len({op.enq_us for op in ops}) > F.WAIT_VECTOR_FROM

    def fake_ring() -> Any:
        words = memoryview(array.array("q", [0] * L.QUEUE_WORDS)).cast("B").cast("q")
        ring = SimpleNamespace(Q=words, qb=0)
        ring.record_wait = lambda us, n=1: Ring.record_wait(ring, us, n)  # type: ignore[arg-type]
        return ring

    vector, one_by_one = fake_ring(), fake_ring()
    F._record_waits(vector, ops)
    for op in ops:
        if op.enq_us:
            Ring.record_wait(one_by_one, now_us - op.enq_us)
    assert vector.Q.tolist() == one_by_one.Q.tolist()
    assert sum(vector.Q[L.Q_WAIT_HIST : L.Q_WAIT_HIST + L.HIST_BUCKETS]) == len(ops) - 1
    every = [max(0, w) for w in waits_us] + [200_000] * 3
    for b in range(1, L.HIST_BUCKETS - 1):  # bucket b: [2**(b-1), 2**b) us, by range
        assert vector.Q[L.Q_WAIT_HIST + b] == sum(2 ** (b - 1) <= w < 2**b for w in every), b
    assert vector.Q[L.Q_WAIT_HIST] == 2  # 0 and the negative wait
    last = L.HIST_BUCKETS - 1  # from 2**30 us (about 18 minutes) on: 2**31, 2**40, 3**19 …
    assert vector.Q[L.Q_WAIT_HIST + last] == sum(w >= 2 ** (last - 1) for w in every) >= 3


def test_a_batch_of_entries_from_many_transactions_records_each_wait(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=64)
    n = F.WAIT_VECTOR_FROM + 6
    with connect(dsn) as s:
        before_enq = time.time_ns() // 1000
        for i in range(n):  # one transaction each: n distinct enqueue times
            s.enqueue(q, b"%d" % i)
            s.commit()
        after_enq = time.time_ns() // 1000
        time.sleep(WAIT_S)  # the wait measured
        assert len(s.dequeue_many(q, n)) == n
        before_deq = time.time_ns() // 1000
        s.commit()
        after_deq = time.time_ns() // 1000
        hist, total = waits(s, q)
    lo, hi = before_deq - after_enq, after_deq - before_enq
    assert sum(hist) == n and n * lo <= total <= n * hi
    assert in_buckets(hist, lo, hi) == n
