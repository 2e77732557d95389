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

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import psycopg
from _benchlib import expect
from ringq.engine import QueueFull, connect

WHO = "concurrent: a process"  # named in a failure

FORK = mp.get_context("fork")
START_DELAY = 0.05  # s between the last process ready and the common start


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
    procs: list[tuple[Any, Connection]] = []
    sums = {role: {"in_time": 0, "total": 0, "idle": 0} for role in ("producer", "consumer")}
    try:
        for role in roles:
            parent, child = FORK.Pipe()
            proc = FORK.Process(target=target, args=(*args, role, child), daemon=True)
            proc.start()
            procs.append((proc, parent))
        for _proc, pipe in procs:
            expect(pipe, "ready", 60.0, WHO)
        t_start = time.monotonic() + START_DELAY
        for _proc, pipe in procs:
            pipe.send((t_start, t_start + seconds))
        for role, (_proc, pipe) in zip(roles, procs, strict=True):
            counts = expect(pipe, "done", seconds + 60.0, WHO)
            for k, v in counts.items():
                sums[role][k] += v
    finally:
        for proc, _pipe in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
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
