"""The asyncio face (ringq.engine.connect_async): the API, the wait on the
loop, cancellation at each await of a dequeue and of a commit, and failures
(kill -9 of an async consumer, a backend terminated under a session).

Tests drive their coroutines with ``asyncio.run`` (no plugin); concurrency
is scripted with events, never with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import psycopg
import pytest
import ringq.engine as engine
from conftest import drain, enqueue_committed, terminate_backend
from ringq.engine.driver import awire
from ringq.engine.ring import OpKind

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_enqueue_commit_dequeue_commit(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()

    async def main() -> list[bytes]:
        async with await engine.connect_async(dsn) as s:
            seq = await s.enqueue(q, b"one")
            seqs = await s.enqueue_many(q, [b"two", b"three"])
            assert seqs == [seq + 1, seq + 2]
            await s.commit()
            got = [m.payload for m in await s.dequeue_many(q, 3)]
            await s.commit()
            assert await s.dequeue(q) is None
            return got

    assert run(main()) == [b"one", b"two", b"three"]
    assert drain(dsn, q) == []


def test_own_sql_joins_the_transaction(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()
    table = "t_" + q
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (v text)")  # test-local name, not user input

    async def main() -> None:
        async with await engine.connect_async(dsn) as s:
            await s.execute(f"INSERT INTO {table} VALUES ('through execute')")
            await s.connection.execute(f"INSERT INTO {table} VALUES ('through connection')")
            await s.enqueue(q, b"with the rows")
            await s.rollback()  # neither
            await s.connection.execute(f"INSERT INTO {table} VALUES ('kept')")
            await s.enqueue(q, b"kept")
            await s.commit()  # both

    run(main())
    with psycopg.connect(dsn) as c:
        assert c.execute(f"SELECT v FROM {table}").fetchall() == [("kept",)]
    assert [m.payload for m in drain(dsn, q)] == [b"kept"]


def test_a_waiting_dequeue_leaves_the_loop_free_and_a_commit_wakes_it(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()

    async def main() -> tuple[bytes, int, float]:
        ticks = 0
        waiting = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                waiting.set()
                await asyncio.sleep(0.005)

        async with await engine.connect_async(dsn) as c, await engine.connect_async(dsn) as p:
            await c.queue_info(q)
            t = asyncio.create_task(ticker())
            got = asyncio.create_task(c.dequeue(q, wait=30))
            await waiting.wait()
            while ticks < 10:  # the loop runs while the dequeue waits
                await asyncio.sleep(0.005)
            await p.enqueue(q, b"wake")
            t0 = time.monotonic()
            await p.commit()
            m = await got
            woke = time.monotonic() - t0
            await c.commit()
            t.cancel()
            assert m is not None
            return m.payload, ticks, woke

    payload, ticks, woke = run(main())
    assert payload == b"wake" and ticks >= 10
    assert woke < 0.5  # the post reached the loop, not the 1 s recheck


def test_a_cancelled_wait_takes_nothing_and_leaves_no_waiter(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()

    async def main() -> None:
        async with await engine.connect_async(dsn) as s:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await s.dequeue(q, wait=10)
            ring = s.session.ring(q)
            assert s.session.section.queues[ring.qb + engine.layout.Q_WAIT_READY] == 0
            assert s.session._link.ops == []

    run(main())
    enqueue_committed(dsn, q, b"after")
    assert [(m.payload, m.deliveries) for m in drain(dsn, q)] == [(b"after", 1)]


@pytest.mark.parametrize("kind", ["enqueue", "enqueue_many", "keyed"])
def test_an_enqueue_waiting_for_room_is_cancelled_and_leaves_nothing(
    dsn: str, make_queue: Callable[..., str], kind: str
) -> None:
    """An enqueue into a full queue waits for room on the loop: cancelled
    there (``asyncio.timeout(0.2)``; the queue's full_timeout is 30 s) it
    raises TimeoutError at once, nothing of it is enqueued nor left waiting,
    and the session goes on (a rollback, then an enqueue that commits)."""
    q = make_queue(capacity=4, full_policy="block", full_timeout=30)
    enqueue_committed(dsn, q, b"0", b"1", b"2", b"3")
    puts: dict[str, Callable[[engine.AsyncSession], Coroutine[Any, Any, Any]]] = {
        "enqueue": lambda s: s.enqueue(q, b"late"),
        "enqueue_many": lambda s: s.enqueue_many(q, [b"late1", b"late2"]),
        "keyed": lambda s: s.enqueue(q, b"late", key="k"),
    }

    async def main() -> float:
        async with await engine.connect_async(dsn) as s:
            await s.queue_info(q)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await puts[kind](s)
            took = time.monotonic() - t0
            ring = s.session.ring(q)
            assert ring.counts()["locked"] == 0  # no slot held
            assert ring.waiters(OpKind.ENQUEUE) == 0  # no waiter left registered
            await s.rollback()
            assert [m.payload for m in drain(dsn, q)] == [b"0", b"1", b"2", b"3"]
            await s.enqueue(q, b"after")
            await s.commit()
            return took

    assert run(main()) < 1.0
    assert [m.payload for m in drain(dsn, q)] == [b"after"]


def test_an_enqueue_waiting_for_room_is_woken_by_a_commit_and_times_out_as_sync(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for room on the loop: a consumer's commit wakes it (its
    post, not the recheck: ROOM_RECHECK_S is raised to 60 s); with no room
    it ends in the sync face's QueueFull once ``timeout`` has passed."""
    from ringq.engine.session import _reserve

    monkeypatch.setattr(_reserve, "ROOM_RECHECK_S", 60.0)
    q = make_queue(capacity=4, full_policy="block", full_timeout=30)
    enqueue_committed(dsn, q, b"0", b"1", b"2", b"3")

    async def main() -> tuple[float, float]:
        async with await engine.connect_async(dsn) as p, await engine.connect_async(dsn) as c:
            await p.queue_info(q)
            ring = p.session.ring(q)
            t0 = time.monotonic()
            with pytest.raises(engine.QueueFull, match=r"after waiting 0\.3s"):
                await p.enqueue_many(q, [b"a", b"b"], timeout=0.3)
            timed_out = time.monotonic() - t0
            put = asyncio.create_task(p.enqueue_many(q, [b"a", b"b"]))
            while ring.waiters(OpKind.ENQUEUE) < 1:  # it registered as a waiter
                await asyncio.sleep(0.001)
            assert [m.payload for m in await c.dequeue_many(q, 2)] == [b"0", b"1"]
            await c.commit()
            committed = time.monotonic()
            await put
            woke = time.monotonic() - committed
            await p.commit()
            assert ring.waiters(OpKind.ENQUEUE) == 0
            return timed_out, woke

    timed_out, woke = run(main())
    assert 0.3 <= timed_out < 2.0
    assert woke < 5.0  # far below the 60 s recheck and the 30 s full_timeout
    assert [m.payload for m in drain(dsn, q)] == [b"2", b"3", b"a", b"b"]


def _cancel_on_the_wire(monkeypatch: pytest.MonkeyPatch, which: int) -> list[int]:
    """Cancel the running task at its ``which``-th await on the wire (counted
    from 1; the engine's exchanges await ``awire.wait``, psycopg's own
    cursors ``AsyncConnection.wait``): the server is asked to cancel and
    the answer read, then CancelledError raised. Returns the count of awaits
    so far."""
    real, real_awire = psycopg.AsyncConnection.wait, awire.wait
    seen = [0]

    def cancel_at_which() -> None:
        seen[0] += 1
        if seen[0] == which:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()

    async def wait(self: psycopg.AsyncConnection[Any], gen: Any, *a: Any, **k: Any) -> Any:
        cancel_at_which()
        return await real(self, gen, *a, **k)

    async def wait_awire(aconn: psycopg.AsyncConnection[Any], gen: Any) -> Any:
        cancel_at_which()
        return await real_awire(aconn, gen)

    monkeypatch.setattr(psycopg.AsyncConnection, "wait", wait)
    monkeypatch.setattr(awire, "wait", wait_awire)
    return seen


@pytest.mark.parametrize("cache", [None, 0], ids=["cached", "rows"])
def test_a_dequeue_cancelled_on_the_wire_gives_its_entries_back_once(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch, cache: int | None
) -> None:
    """Cache: the dequeue makes no round trip (nothing to cancel there), the
    commit does; rows: the dequeue's read of the row is cancelled."""
    q = make_queue(cache_payload=cache)
    enqueue_committed(dsn, q, b"a", b"b")

    async def main() -> list[bytes]:
        async with await engine.connect_async(dsn) as s:
            await s.queue_info(q)
            _cancel_on_the_wire(monkeypatch, 1)
            with pytest.raises(asyncio.CancelledError):
                await s.dequeue_many(q, 2)
                await s.commit()
            monkeypatch.undo()
            assert s.session._link.ops == []
            got = await s.dequeue_many(q, 2)
            await s.commit()
            return [m.payload for m in got]

    taken = run(main())
    left = [m.payload for m in drain(dsn, q)]
    # all or nothing, never twice: consumed by the cancelled commit (if the
    # server committed it), else given back and taken again (or left)
    assert sorted(taken + left) in ([], [b"a", b"b"])
    if cache == 0:  # the read itself was cancelled: nothing was committed
        assert sorted(taken + left) == [b"a", b"b"]


@pytest.mark.parametrize("at", [1, 2], ids=["first-await", "second-await"])
def test_a_commit_cancelled_on_the_wire_decides_once(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    """A consumer's transaction (dequeue read from its row, an enqueue) whose
    awaits on the wire are cancelled one by one: whatever the server
    answered, each entry ends exactly once (consumed or back, enqueued or
    not), and the section agrees with the rows (the queue drains cleanly)."""
    q, out = make_queue(cache_payload=0), make_queue()
    enqueue_committed(dsn, q, b"in")

    async def main() -> bool:
        async with await engine.connect_async(dsn) as s:
            await s.queue_info(q)
            await s.queue_info(out)
            _cancel_on_the_wire(monkeypatch, at)
            cancelled = False
            try:
                m = await s.dequeue(q)  # await 1: the row's read
                assert m is not None
                await s.enqueue(out, b"out")
                await s.commit()  # await 2: the commit
            except asyncio.CancelledError:
                cancelled = True
            monkeypatch.undo()
            assert s.session._link.ops == []
            # a later transaction works (a doomed one refuses first, once)
            with contextlib.suppress(engine.RolledBack):
                await s.commit()
            return cancelled

    assert run(main())
    left = [m.payload for m in drain(dsn, q)]
    sent = [m.payload for m in drain(dsn, out)]
    assert (left, sent) in (([b"in"], []), ([], [b"out"]))


def test_many_consumers_in_one_loop_take_each_entry_once(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=512, dequeue_mode="shared")
    n = 400
    enqueue_committed(dsn, q, *[b"%d" % i for i in range(n)])

    async def consumer(got: list[bytes], per_txn: int) -> None:
        async with await engine.connect_async(dsn) as s:
            while True:
                ms = await s.dequeue_many(q, per_txn, wait=0.2)
                if not ms:
                    return
                await s.commit()
                got.extend(m.payload for m in ms)

    async def main() -> list[bytes]:
        got: list[bytes] = []
        await asyncio.gather(*[consumer(got, 1 + i % 3) for i in range(8)])
        return got

    got = run(main())
    assert sorted(got, key=int) == [b"%d" % i for i in range(n)]


_HOLDER = textwrap.dedent("""
    import asyncio, sys, time
    import ringq.engine as engine

    async def main():
        s = await engine.connect_async(sys.argv[1])
        m = await s.dequeue(sys.argv[2], wait=10)
        print("held", m.seq, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def test_kill_9_of_an_async_consumer_gives_its_entry_back(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared")
    (seq,) = enqueue_committed(dsn, q, b"held")
    with subprocess.Popen([sys.executable, "-c", _HOLDER, dsn, q], stdout=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().split() == ["held", str(seq)]
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    async def main() -> list[tuple[bytes, int]]:
        async with await engine.connect_async(dsn) as s:
            await s.recover_dead_holders(q)
            got = await s.dequeue_many(q, 10, wait=5)
            await s.commit()
            return [(m.payload, m.seq) for m in got]

    assert run(main()) == [(b"held", seq)]
    assert drain(dsn, q) == []


def test_a_backend_terminated_under_a_waiting_session_is_survived(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()

    async def main() -> bytes:
        async with await engine.connect_async(dsn) as s:
            await s.enqueue(q, b"x")
            await s.commit()
            m = await s.dequeue(q)
            assert m is not None
            terminate_backend(dsn, s.backend_pid)
            with pytest.raises(engine.RingqError):
                await s.commit()
            again = await s.dequeue(q, wait=5)
            assert again is not None and again.seq == m.seq
            await s.commit()
            return again.payload

    assert run(main()) == b"x"
    assert drain(dsn, q) == []


def _example(name: str, dsn: str, *args: str) -> str:
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / name
    p = subprocess.run([sys.executable, str(path), "--dsn", dsn, *args], check=False,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_the_async_examples_run(dsn: str) -> None:
    """The handler writes each order and its event together (the refused one
    neither); the async worker then handles every event once."""
    out = _example("async_handler.py", dsn, "--requests", "40")
    assert "orders made 39, refused 1" in out
    assert "orders in the table 39, events on the queue 39" in out
    assert "every order has its event, and only those: True" in out
    out = _example("async_worker.py", dsn, "--once")
    assert "notified rows 39, distinct events 39" in out, out
    assert drain(dsn, "ex_async_events") == []
    assert len(drain(dsn, "ex_async_mails")) == 39


def test_the_worker_runs_async_actions_with_concurrency(
    dsn: str, make_queue: Callable[..., str], tmp_path: Any
) -> None:
    """``ringq worker mod:app --concurrency 8`` awaits async actions in 8
    coroutines of one process; SIGTERM stops it, exit 0, each entry once."""
    q = make_queue(capacity=256, dequeue_mode="shared")
    done = "t_done_" + q
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE {done} (seq bigint PRIMARY KEY)")
    (tmp_path / "aioapp.py").write_text(textwrap.dedent(f"""
        from ringq.worker import Actions
        app = Actions()

        @app.action({q!r})
        async def act(msg, session):
            await session.connection.execute("INSERT INTO {done} VALUES (%s)", (msg.seq,))
    """))
    enqueue_committed(dsn, q, *[b"%d" % i for i in range(100)])
    env = {**os.environ, "RINGQ_DSN": dsn, "PYTHONPATH": str(tmp_path)}
    ringq = os.path.join(os.path.dirname(sys.executable), "ringq")
    with subprocess.Popen([ringq, "worker", "aioapp:app", "--concurrency", "8"], env=env,
                          cwd=tmp_path, stderr=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + 60
        n = 0
        while time.monotonic() < deadline:
            with psycopg.connect(dsn) as c:
                row = c.execute(f"SELECT count(*) FROM {done}").fetchone()
                n = row[0] if row else 0
            if n == 100:
                break
            time.sleep(0.1)  # polling another process's progress, not synchronizing
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert n == 100, err
    assert proc.returncode == 0, err
    assert drain(dsn, q) == []
