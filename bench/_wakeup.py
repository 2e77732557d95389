"""The wake-up figures of ``bench_engine.py``: commit-to-dequeue latency, and its floor.

- :func:`bench_wakeup`: a consumer process sleeps in ``dequeue(wait=...)``; the
  producer enqueues and commits; the time from the producer's ``commit()``
  returning to the consumer's ``dequeue()`` returning.
- :func:`bench_sem_wakeup`: the same for a bare posix-ipc semaphore post waking
  a sleeping process (the kind of wake-up the engine uses), with no database.

Both read CLOCK_MONOTONIC (``time.monotonic_ns``), which the processes of one
host share.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time
from multiprocessing.connection import Connection
from typing import Any

import posix_ipc
from _contenders import latency_summary
from ringq.engine import connect, metrics

FORK = mp.get_context("fork")


def _wake_consumer(dsn: str, queue: str, n: int, pipe: Connection) -> None:
    """Child process: block in dequeue(wait=...) n times; send back (seq, monotonic ns at
    return)."""
    out: list[tuple[int, int]] = []
    try:
        with connect(dsn) as s:
            s.queue_info(queue)
            for _ in range(n):
                pipe.send(("ready", None))
                m = s.dequeue(queue, wait=10.0)
                t = time.monotonic_ns()
                s.commit()
                if m is None:
                    raise RuntimeError("wake-up: no entry within 10 s")
                out.append((m.seq, t))
        pipe.send(("done", out))
    except BaseException as exc:  # report to the parent instead of hanging it
        pipe.send(("error", repr(exc)))
        raise


def bench_wakeup(dsn: str, queue: str, payload: bytes, n: int) -> dict[str, Any]:
    """Commit-to-dequeue latency: producer's clock after commit() returns, consumer's after
    dequeue() returns.

    Both read CLOCK_MONOTONIC (time.monotonic_ns), which is shared by the
    processes of one host. Before each enqueue the producer waits until the
    section shows the consumer registered as a sleeping dequeuer, then 1 ms more
    so that it is inside the semaphore wait, not between registering and sleeping.
    """
    parent, child = FORK.Pipe()
    proc = FORK.Process(target=_wake_consumer, args=(dsn, queue, n, child), daemon=True)
    proc.start()
    sent: dict[int, int] = {}
    confirmed = 0
    try:
        with connect(dsn) as prod:
            prod.queue_info(queue)
            for _ in range(n):
                what, detail = parent.recv()
                if what != "ready":
                    raise RuntimeError(f"wake-up consumer: {detail}")
                deadline = time.monotonic() + 2.0
                while prod.stats(queue)[metrics.WAIT_READY] == 0 and time.monotonic() < deadline:
                    time.sleep(0.0002)
                confirmed += prod.stats(queue)[metrics.WAIT_READY] > 0
                time.sleep(0.001)
                seq = prod.enqueue(queue, payload)
                prod.commit()
                sent[seq] = time.monotonic_ns()
        what, got = parent.recv()
        if what != "done":
            raise RuntimeError(f"wake-up consumer: {got}")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    diffs = [t - sent[seq] for seq, t in got if seq in sent]
    out = latency_summary(diffs)
    out["consumer_confirmed_asleep"] = confirmed
    out["negative"] = sum(
        d < 0 for d in diffs
    )  # consumer returned before the producer's commit() did
    return out


def _sem_waiter(name: str, n: int, pipe: Connection) -> None:
    sem = posix_ipc.Semaphore(name)
    out: list[int] = []
    try:
        for _ in range(n):
            pipe.send("ready")
            sem.acquire(10.0)
            out.append(time.monotonic_ns())
        pipe.send(out)
    finally:
        sem.close()


def bench_sem_wakeup(n: int) -> dict[str, Any]:
    """The floor under the wake-up figure: a bare posix-ipc semaphore post waking a sleeping
    process (the kind of wake-up the engine uses), timed the same way, with no database."""
    name = f"/ringq-bench-{os.getpid()}-{secrets.token_hex(4)}"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=0)
    parent, child = FORK.Pipe()
    proc = FORK.Process(target=_sem_waiter, args=(name, n, child), daemon=True)
    proc.start()
    sent: list[int] = []
    try:
        for _ in range(n):
            parent.recv()
            time.sleep(0.001)
            sem.release()
            sent.append(time.monotonic_ns())
        got = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        sem.unlink()
        sem.close()
    return latency_summary([g - s for g, s in zip(got, sent, strict=True)])
