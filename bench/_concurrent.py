"""The concurrent figure of ``bench_engine.py``: producers and consumers on one queue at once.

``producers`` processes each commit one-entry enqueue transactions and
``consumers`` processes each commit one-entry dequeue transactions, all on the
same queue, all for the same ``seconds``. Every process is forked (the fork
context) and opens its own connection or session; they start together at a
time the parent sets once all of them are connected, and stop at a common end
time (both on CLOCK_MONOTONIC, one clock for all processes of a host). A
transaction counts when its commit returned by the end time. The figure is the
consumers' count over ``seconds``: entries dequeued and committed per second.

Afterwards the parent takes what the consumers left from the queue (so the
next run starts empty) and checks that nothing was lost: every committed
enqueue was either dequeued by a consumer or is taken by that drain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import psycopg
from _benchlib import run_together
from ringq.engine import QueueFull, connect

WHO = "concurrent: a process"  # named in a failure



def _timed(pipe: Connection, step: Callable[[float], bool]) -> dict[str, int]:
    """Say ready, wait for the (start, end) times, run ``step(seconds left)`` until the end.

    ``step`` returns True when it committed an entry, False when it had none to
    commit (a full queue for a producer, an empty one for a consumer)."""
    pipe.send(("ready", None))
    t_start, t_end = pipe.recv()
    time.sleep(max(0.0, t_start - time.monotonic()))
    in_time = total = idle = 0
    while (now := time.monotonic()) < t_end:
        if step(t_end - now):
            total += 1
            in_time += time.monotonic() <= t_end
        else:
            idle += 1
    return {"in_time": in_time, "total": total, "idle": idle}


def _report(pipe: Connection, body: Callable[[], dict[str, int]]) -> None:
    """Run a child's ``body`` and send its counts, or its error, to the parent."""
    try:
        counts = body()
        pipe.send(("done", counts))
    except BaseException as exc:  # report to the parent instead of hanging it
        pipe.send(("error", repr(exc)))
        raise


def _ringq_process(dsn: str, queue: str, payload: bytes, role: str, pipe: Connection) -> None:
    def body() -> dict[str, int]:
        with connect(dsn) as s:
            s.queue_info(queue)

            def produce(left: float) -> bool:
                try:
                    s.enqueue(queue, payload, timeout=left)  # a full queue blocks, then raises
                except QueueFull:
                    return False
                s.commit()
                return True

            def consume(left: float) -> bool:
                if s.dequeue(queue, wait=left) is None:  # sleeps on the queue's wake-up
                    return False
                s.commit()
                return True

            return _timed(pipe, produce if role == "producer" else consume)

    _report(pipe, body)


def _skq_process(
    dsn: str, enqueue_sql: Any, dequeue_sql: Any, payload: bytes, role: str, pipe: Connection
) -> None:
    def body() -> dict[str, int]:
        with psycopg.connect(dsn) as conn:

            def produce(left: float) -> bool:
                conn.execute(enqueue_sql, (payload,))
                conn.commit()
                return True

            def consume(left: float) -> bool:
                row = conn.execute(dequeue_sql).fetchone()
                conn.commit()  # also when empty: never sleep inside a transaction
                if row is None:
                    time.sleep(min(0.001, left))  # poll an empty table every millisecond
                    return False
                return True

            return _timed(pipe, produce if role == "producer" else consume)

    _report(pipe, body)


def _run(
    target: Callable[..., None],
    args: tuple[Any, ...],
    producers: int,
    consumers: int,
    seconds: float,
) -> dict[str, dict[str, int]]:
    """Fork the processes, start them together, return the summed counts of each role."""
    roles = ["producer"] * producers + ["consumer"] * consumers
    sums = {role: {"in_time": 0, "total": 0, "idle": 0} for role in ("producer", "consumer")}
    _t, results = run_together(
        target, [(*args, role) for role in roles], lambda t: (t, t + seconds),
        seconds + 60.0, WHO,
    )
    for role, counts in zip(roles, results, strict=True):
        for k, v in counts.items():
            sums[role][k] += v
    return sums




def _result(
    sums: dict[str, dict[str, int]], left: int, producers: int, consumers: int, seconds: float
) -> dict[str, Any]:
    prod, cons = sums["producer"], sums["consumer"]
    return {
        "producers": producers,
        "consumers": consumers,
        "seconds": seconds,
        "committed_entries_per_s": cons["in_time"] / seconds,  # the figure
        "enqueued_entries_per_s": prod["in_time"] / seconds,
        "enqueued": prod["total"],
        "dequeued": cons["total"],
        "left_on_queue": left,
        "lost": prod["total"] - cons["total"] - left,
        "producer_full_waits": prod["idle"],  # enqueues that found the queue full to the end
        "consumer_empty_polls": cons["idle"],  # dequeues that found nothing
    }


def concurrent_ringq(
    dsn: str, queue: str, payload: bytes, producers: int, consumers: int, seconds: float
) -> dict[str, Any]:
    """Producers and consumers on a ringq queue (made with ``dequeue_mode="shared"`` so that
    the consumers dequeue side by side)."""
    sums = _run(_ringq_process, (dsn, queue, payload), producers, consumers, seconds)
    left = 0
    with connect(dsn) as s:
        while got := s.dequeue_many(queue, 1000):
            s.commit()
            left += len(got)
    return _result(sums, left, producers, consumers, seconds)


def concurrent_skq(
    dsn: str,
    statements: Sequence[Any],
    payload: bytes,
    producers: int,
    consumers: int,
    seconds: float,
) -> dict[str, Any]:
    """The same on a SKIP LOCKED table; ``statements`` are its enqueue, dequeue and batched
    dequeue (``LIMIT %s``) statements."""
    enqueue_sql, dequeue_sql, dequeue_many_sql = statements
    sums = _run(
        _skq_process, (dsn, enqueue_sql, dequeue_sql, payload), producers, consumers, seconds
    )
    left = 0
    with psycopg.connect(dsn) as conn:
        while rows := conn.execute(dequeue_many_sql, (1000,)).fetchall():
            conn.commit()
            left += len(rows)
        conn.commit()
    return _result(sums, left, producers, consumers, seconds)
