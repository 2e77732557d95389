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
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import psycopg
import pytest
import ringq.engine as engine
from conftest import drain, enqueue_committed, terminate_backend, wait_for
from ringq.engine import Message, Session
from ringq.engine.driver import awire
from ringq.engine.ring import OpKind
from ringq.worker import Actions, AsyncWorker

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


def _slow_commit_table(dsn: str, name: str) -> str:
    """A table whose rows are checked at COMMIT by a deferred trigger: a row
    'fast' passes at once; any other sleeps 0.5 s (a COMMIT running long
    enough to be cancelled on the server, or left running by a client gone),
    then a row 'fail' is refused."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"""
            CREATE TABLE {name} (v text);
            CREATE FUNCTION {name}_check() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.v = 'fast' THEN RETURN NULL; END IF;
                PERFORM pg_sleep(0.5);
                IF NEW.v = 'fail' THEN RAISE EXCEPTION 'refused at commit'; END IF;
                RETURN NULL;
            END $$;
            CREATE CONSTRAINT TRIGGER {name}_check AFTER INSERT ON {name}
                DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {name}_check();
        """)  # test-local names, not user input
    return name


def _rows_of(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as c:
        return [r[0] for r in c.execute(f"SELECT v FROM {table}").fetchall()]


def _cancel_in_the_check(monkeypatch: pytest.MonkeyPatch, dsn: str, pid: int) -> None:
    """Cancel the task that next awaits the wire once its backend ``pid``
    runs the COMMIT's check (waiting in its pg_sleep): the COMMIT is on the
    server then, neither before it nor answered."""
    real = awire.wait

    def in_check() -> bool:
        with psycopg.connect(dsn, autocommit=True) as c:
            row = c.execute("SELECT wait_event, query FROM pg_stat_activity WHERE pid = %s",
                            (pid,)).fetchone()
        return row is not None and row[0] == "PgSleep" and row[1] == "COMMIT"

    async def cancel_then(task: asyncio.Task[Any]) -> None:
        await asyncio.to_thread(wait_for, in_check, 10, "the COMMIT to run its check")
        task.cancel()

    async def wait(aconn: psycopg.AsyncConnection[Any], gen: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        monkeypatch.setattr(awire, "wait", real)  # the first await only
        canceller = asyncio.ensure_future(cancel_then(task))
        try:
            return await real(aconn, gen)
        finally:
            await asyncio.shield(canceller)

    monkeypatch.setattr(awire, "wait", wait)


@pytest.mark.parametrize("slow", [False, True], ids=["answered", "cancelled-on-server"])
def test_a_commit_with_no_row_writes_cancelled_decides_once(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch, slow: bool
) -> None:
    """A commit with nothing held (the dequeue's read took the row already;
    the caller's row goes with it: a bare COMMIT, ``_end``) cancelled on the
    wire: the cancel is sent and the answer read. Answered (a fast COMMIT,
    cancelled at its first await) the section learns the server's outcome;
    cancelled on the server (while its deferred check runs) the transaction
    is rolled back. As the rows say (the caller's row committed or not),
    the entry is consumed, or given back and taken again once; the section
    agrees: nothing locked, no op left."""
    q = make_queue(cache_payload=0)
    table = _slow_commit_table(dsn, "t_" + q)
    enqueue_committed(dsn, q, b"in")

    async def main() -> list[bytes]:
        async with await engine.connect_async(dsn) as s:
            m = await s.dequeue(q)
            assert m is not None and m.payload == b"in"
            await s.connection.execute(f"INSERT INTO {table} VALUES (%s)",
                                       ("slow" if slow else "fast",))
            link = s.session._link
            assert link.ops and not any(op.held for op in link.ops) and not link.deferred
            if slow:
                _cancel_in_the_check(monkeypatch, dsn, s.backend_pid)
            else:
                _cancel_on_the_wire(monkeypatch, 1)
            with pytest.raises(asyncio.CancelledError):
                await s.commit()
            monkeypatch.undo()
            assert link.ops == []
            assert s.session.ring(q).counts()["locked"] == 0
            again = await s.dequeue(q, wait=0.5)  # given back: ready now
            await s.commit()
            return [] if again is None else [again.payload]

    again = run(main())
    assert drain(dsn, q) == []
    rows = _rows_of(dsn, table)
    # as the rows say: consumed with the caller's row, or given back without it
    assert (again, rows) in (([], ["fast"]), ([b"in"], []))
    if slow:  # the cancel reached the running check: rolled back
        assert (again, rows) == ([b"in"], [])


def _backend_state(dsn: str, pid: int) -> tuple[str, str] | None:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT state, query FROM pg_stat_activity WHERE pid = %s",
                        (pid,)).fetchone()
    return None if row is None else (row[0], row[1])


@pytest.mark.parametrize("server", ["committed", "running"])
def test_a_commit_cancelled_twice_is_decided_by_the_rows(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, server: str,
) -> None:
    """The commit's task is cancelled on the wire, then again while it asks
    the server to cancel the COMMIT: the cancel is never sent, the answer
    never read, the connection closed (``pgconn.finish``), and the rows
    decide. 'committed': the server had finished the COMMIT (its answer
    unread): the entry is consumed with the caller's row. 'running': the
    COMMIT was still in its deferred check (the decision ends that backend):
    rolled back, the entry given back and taken again once, without the
    row. Never both, never lost; the section agrees."""
    q = make_queue(cache_payload=0)
    table = _slow_commit_table(dsn, "t_" + q)
    enqueue_committed(dsn, q, b"in")
    real_try_cancel = psycopg.AsyncConnection._try_cancel
    tries = [0]

    async def main() -> list[bytes]:
        async with await engine.connect_async(dsn) as s:
            m = await s.dequeue(q)
            assert m is not None and m.payload == b"in"
            await s.connection.execute(f"INSERT INTO {table} VALUES (%s)",
                                       ("fast" if server == "committed" else "slow",))
            old = s.backend_pid

            async def cancelled_again(self: psycopg.AsyncConnection[Any], *a: Any,
                                      **k: Any) -> None:
                tries[0] += 1
                if server == "committed":  # the server is done; its answer waits unread
                    await asyncio.to_thread(wait_for, lambda: _backend_state(dsn, old) == (
                        "idle", "COMMIT"), 10, "the COMMIT to end on the server")
                task = asyncio.current_task()
                assert task is not None
                task.cancel()  # the second cancellation, before the cancel request goes out
                await asyncio.sleep(0)
                await real_try_cancel(self, *a, **k)  # not reached

            if server == "committed":
                _cancel_on_the_wire(monkeypatch, 1)
            else:
                _cancel_in_the_check(monkeypatch, dsn, old)
            monkeypatch.setattr(psycopg.AsyncConnection, "_try_cancel", cancelled_again)
            with pytest.raises(asyncio.CancelledError):
                await s.commit()
            monkeypatch.undo()
            assert tries == [1]
            assert s.session._link.ops == []
            assert s.session.ring(q).counts()["locked"] == 0
            again = await s.dequeue(q, wait=0.5)
            await s.commit()
            assert s.backend_pid != old  # the connection was closed under the commit
            return [] if again is None else [again.payload]

    with caplog.at_level("INFO", logger="ringq.engine"):
        again = run(main())
    assert "cancel interrupted" in caplog.text  # the path of the answer never read
    assert drain(dsn, q) == []
    rows = _rows_of(dsn, table)
    assert (again, rows) == (([], ["fast"]) if server == "committed" else ([b"in"], []))


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


@pytest.mark.parametrize("cache", [None, 0], ids=["cached", "rows"])
def test_a_backend_terminated_under_a_waiting_session_is_survived(
    dsn: str, make_queue: Callable[..., str], cache: int | None
) -> None:
    """A ``dequeue(wait=...)`` task is in its wait (its waiter counted in the
    section) when its backend is terminated; an entry committed afterwards
    wakes it. As on the sync face, the wait ends with the documented error
    of the lost connection (served from the cache: the entry, then the
    commit rolled back; read from its row: DatabaseUnavailable), the entry
    is given back and the session reconnects; the entry is consumed exactly
    once: the retry takes it, nothing is left."""
    q = make_queue(cache_payload=cache)

    async def main() -> list[str]:
        async with await engine.connect_async(dsn) as s:
            await s.queue_info(q)
            waiters = s.session.section.queues
            at = s.session.ring(q).qb + engine.layout.Q_WAIT_READY
            task = asyncio.create_task(s.dequeue(q, wait=30))
            while waiters[at] == 0:  # the task's waiter is counted: it is in the wait
                await asyncio.sleep(0.005)
            old = s.backend_pid
            await asyncio.to_thread(terminate_backend, dsn, old)
            assert not task.done() and waiters[at] == 1  # still waiting, on the loop
            (seq,) = await asyncio.to_thread(enqueue_committed, dsn, q, b"after")
            outcomes: list[str] = []
            try:
                m = await asyncio.wait_for(task, 10)
                outcomes.append(f"took {m.payload!r}" if m else "took nothing")
                await s.commit()
                outcomes.append("committed")
            except engine.RingqError as err:
                outcomes.append(type(err).__name__)
            assert waiters[at] == 0
            again = await s.dequeue(q, wait=5)  # the application's retry
            assert again is not None, f"the entry was lost after {outcomes}"
            assert (again.payload, again.seq) == (b"after", seq)
            await s.commit()
            assert s.backend_pid != old
            return outcomes

    outcomes = run(main())
    assert drain(dsn, q) == []
    # what a sync Session's dequeue waiting in a thread meets in the same place
    assert outcomes == (["took b'after'", "RolledBack"] if cache is None
                        else ["DatabaseUnavailable"])


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


# An action of each kind that holds its entry a little (so that overlaps would
# show) and records when it began and ended (monotonic: one process).
_CONCURRENT_ACTIONS = {
    "async": """
        @app.action({q!r})
        async def act(msg, session):
            began = time.monotonic_ns()
            await asyncio.sleep(0.005)
            await session.connection.execute("INSERT INTO {done} VALUES (%s, %s, %s)",
                                             (msg.seq, began, time.monotonic_ns()))
    """,
    "sync": """
        @app.action({q!r})
        def act(msg, session):
            began = time.monotonic_ns()
            time.sleep(0.005)
            session.connection.execute("INSERT INTO {done} VALUES (%s, %s, %s)",
                                       (msg.seq, began, time.monotonic_ns()))
    """,
}


def _most_at_once(spans: list[tuple[int, int]]) -> int:
    """The most of these (began, ended) spans that overlapped at one time."""
    events = sorted([(b, 1) for b, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in events:  # an end sorts before a beginning at the same time
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_the_worker_runs_async_actions_with_concurrency(
    dsn: str, make_queue: Callable[..., str], tmp_path: Any, kind: str
) -> None:
    """``ringq worker mod:app --concurrency 8`` awaits async actions in 8
    coroutines of one process (sync ones in threads), more than one at a
    time; SIGTERM stops it, exit 0, each entry once."""
    q = make_queue(capacity=256, dequeue_mode="shared")
    done = "t_done_" + q
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE {done} (seq bigint PRIMARY KEY, began bigint, ended bigint)")
    (tmp_path / "aioapp.py").write_text(textwrap.dedent("""
        import asyncio, time
        from ringq.worker import Actions
        app = Actions()
    """) + textwrap.dedent(_CONCURRENT_ACTIONS[kind]).format(q=q, done=done))
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
    with psycopg.connect(dsn) as c:
        spans = c.execute(f"SELECT began, ended FROM {done}").fetchall()
    assert _most_at_once(spans) > 1


def test_a_sync_action_past_its_time_limit_writes_nothing_into_the_next_entry(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """Under concurrency a sync action runs in a thread, which the time limit
    cannot stop: what it writes after the limit must go with its own rollback,
    never commit with the transaction of the next entry of its consumer."""
    slow, other, out = make_queue(), make_queue(), make_queue()
    effects = "t_effects_" + slow
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE {effects} (note text)")
    stray_written = threading.Event()
    app = Actions()

    @app.action(slow, timeout=0.2)
    def late(msg: Message, session: Session) -> None:
        if msg.deliveries == 1:
            time.sleep(0.6)  # past the limit: nothing interrupts Python in a thread
            session.enqueue(out, b"stray")
            session.connection.execute(f"INSERT INTO {effects} VALUES ('stray')")
            stray_written.set()
        else:
            session.enqueue(out, b"slow, delivery %d" % msg.deliveries)

    @app.action(other)
    def next_entry(msg: Message, session: Session) -> None:
        # Without the wait for the thread, this runs while it sleeps: hold
        # this entry's transaction open until the stray writes are in.
        stray_written.wait(5)
        session.enqueue(out, b"other")

    enqueue_committed(dsn, slow, b"slow")
    enqueue_committed(dsn, other, b"other")
    # one consumer: its next entry (the other queue's, round robin) is the one
    # whose transaction the stray writes would join
    w = AsyncWorker(app, dsn, concurrency=1)
    assert w.run(max_messages=3) == 3
    assert sorted(m.payload for m in drain(dsn, out)) == [b"other", b"slow, delivery 2"]
    with psycopg.connect(dsn) as c:
        assert c.execute(f"SELECT note FROM {effects}").fetchall() == []
    assert w.stats()["timeouts"] == 1 and w.stats()["handled"] == 2
    assert drain(dsn, slow) == [] and drain(dsn, other) == []


def test_a_post_taken_for_a_wait_that_ended_meanwhile_goes_back_to_the_semaphore() -> None:
    """The waker's thread takes a post for a coroutine whose wait then ends
    (timed out, cancelled) before the loop runs the hand-over: the post is
    released for another waiter, not dropped (dropped, that waiter would
    sleep until its recheck)."""
    import posix_ipc
    from ringq.engine.session import _waker

    sem = posix_ipc.Semaphore(f"/ringq-test-hand-{os.getpid()}", posix_ipc.O_CREX,
                              initial_value=0)
    try:
        async def main() -> tuple[int, bool]:
            loop = asyncio.get_running_loop()
            ended: asyncio.Future[None] = loop.create_future()
            ended.cancel()  # its wait ended before the hand-over ran
            _waker._hand(ended, sem)
            after_ended = sem.value
            waiting: asyncio.Future[None] = loop.create_future()
            _waker._hand(waiting, sem)
            return after_ended, waiting.done()

        after_ended, woken = run(main())
        assert after_ended == 1  # given back
        assert woken and sem.value == 1  # a live waiter gets it, nothing released
    finally:
        sem.unlink()
        sem.close()


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_batch_larger_than_the_ring_fails_at_once_and_leaves_nothing(
    dsn: str, make_queue: Callable[..., str], face: str
) -> None:
    """A batch the ring can never hold whole: QueueFull at once on both faces
    (its own reservation holds the tail: waiting could never succeed), not
    after the queue's full_timeout, and nothing of it is enqueued."""
    q = make_queue(capacity=4, full_policy="block", full_timeout=30)
    t0 = time.monotonic()
    if face == "sync":
        with engine.connect(dsn) as s:
            with pytest.raises(engine.QueueFull):
                s.enqueue_many(q, [b"x"] * 6)
            s.rollback()
    else:
        async def main() -> None:
            async with await engine.connect_async(dsn) as s:
                with pytest.raises(engine.QueueFull):
                    await s.enqueue_many(q, [b"x"] * 6)
                await s.rollback()

        run(main())
    assert time.monotonic() - t0 < 5.0  # the full_timeout is 30 s
    assert drain(dsn, q) == []
    enqueue_committed(dsn, q, b"after")  # the ring is whole again
    assert [m.payload for m in drain(dsn, q)] == [b"after"]
