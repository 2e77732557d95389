"""Many consumers in one process: N coroutines, one event loop, one transaction per message.

An :class:`AsyncWorker` runs ``concurrency`` consumers, each a coroutine
with its own :class:`~ringq.engine.AsyncSession`: it takes a message of its
queues, awaits the queue's action (``async def action(msg, session)``;
``session`` is that consumer's AsyncSession, whose ``connection`` is an
``AsyncConnection``), and commits; an action that raises is rolled back (the
entry comes back, counted; :class:`Retry` asks for a delay), as the sync
:class:`~._worker.Worker` does. A sync action runs in a thread of the loop's
default executor (it gets the sync Session under the AsyncSession).

Time limits: the action runs under ``asyncio.timeout(action.timeout)`` (the
coroutine is cancelled at its next await; the engine's awaits give back
what they hold, see ``ringq.engine.AsyncSession``), then rolled back as
timed out. :meth:`AsyncWorker.stop` lets messages in flight finish;
``stop(abort=True)`` cancels the actions in flight (rolled back, counted as
aborted). Like the Worker, it is driven by :meth:`run` (which runs its own
event loop) and stopped from a signal handler or another thread.

A sync action's thread cannot be interrupted, and its Session is the slot's:
at its time limit (or an abort) the statement it runs is cancelled (as
``statement_timeout`` does for a Worker outside the main thread) and the
slot waits for the thread to return before it rolls back and takes its
next message. Its writes after the limit so go with its own rollback;
left running, they would join the slot's next transaction. A thread that
never returns holds its slot until the third stop request kills the process.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Final, cast

import psycopg
from ringq.engine import (
    AsyncSession,
    InDoubt,
    Message,
    Retryable,
    RingqError,
    Session,
    connect_async,
    one_line,
    process_span,
)

from ._actions import Action, Actions, Decline, Retry
from ._worker import (
    ABORTED,
    BUSY_NS,
    DECLINED,
    FAILED,
    HANDLED,
    IN_DOUBT,
    POISONED,
    STATS_KEYS,
    TIMEOUTS,
    WorkerConfig,
)

logger = logging.getLogger("ringq.worker")

CANCEL_TIMEOUT: Final = 5.0  # seconds for the server to take a timed-out action's cancel


class AsyncWorker:
    """``concurrency`` consumer coroutines over the actions' queues (see the module).

    The interface of :class:`~._worker.Worker` that the pool uses: ``open``,
    ``run``, ``stop``, ``aborted``, ``stats``, ``close``.
    """

    def __init__(
        self,
        actions: Actions,
        dsn: str | None = None,
        *,
        config: WorkerConfig | None = None,
        concurrency: int = 8,
    ) -> None:
        self.actions = actions
        self.config = config or WorkerConfig()
        self.concurrency = concurrency
        self._dsn = dsn
        self.queues = list(self.config.queues or actions.queues)
        self._stats = dict.fromkeys(STATS_KEYS, 0)
        self._stop = threading.Event()
        self._abort = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._max_deliveries: dict[str, int] = {}
        # cancels of timed-out sync actions' statements: a thread of their own,
        # as the loop's default executor may be full of those very actions
        self._canceller: ThreadPoolExecutor | None = None

    def open(self) -> AsyncWorker:
        return self

    def close(self) -> None:
        """Nothing outlives :meth:`run` (each consumer closes its session)."""

    def stop(self, *, abort: bool = False) -> None:
        """Ask the consumers to stop after their message (``abort``: cancel
        the actions in flight, rolled back). Safe from a signal handler or
        another thread."""
        self._abort = self._abort or abort
        self._stop.set()
        loop = self._loop
        if abort and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._cancel_all)

    def _cancel_all(self) -> None:
        for t in self._tasks:
            t.cancel()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def aborted(self) -> bool:
        return self._abort

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def run(self, *, max_messages: int | None = None) -> int:
        """Run the consumers until :meth:`stop` (or ``max_messages`` in all);
        returns how many messages were handled."""
        return asyncio.run(self.run_async(max_messages=max_messages))

    async def run_async(self, *, max_messages: int | None = None) -> int:
        """:meth:`run` inside a running event loop."""
        self._loop = asyncio.get_running_loop()
        budget = [max_messages]
        self._canceller = ThreadPoolExecutor(1, thread_name_prefix="ringq-cancel")
        try:
            return await self._run_consumers(budget)
        finally:
            self._canceller.shutdown(wait=False)

    async def _run_consumers(self, budget: list[int | None]) -> int:
        sessions = [await connect_async(self._dsn) for _ in range(self.concurrency)]
        try:
            for q in self.queues:
                self._max_deliveries[q] = (await sessions[0].queue_info(q)).max_deliveries
            self._tasks = {asyncio.create_task(self._consume(s, i, budget))
                           for i, s in enumerate(sessions)}
            counts = await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            for s in sessions:
                try:
                    await s.close()
                except RingqError as exc:
                    logger.warning("ringq worker: close failed: %s", one_line(exc))
        errors = [c for c in counts if isinstance(c, BaseException)
                  and not isinstance(c, asyncio.CancelledError)]
        if errors:
            raise errors[0]
        return sum(c for c in counts if isinstance(c, int))

    async def _consume(self, s: AsyncSession, index: int, budget: list[int | None]) -> int:
        qs, n, rr, handled = self.queues, len(self.queues), index, 0
        wait = self.config.idle_wait
        while not self._stop.is_set():
            if budget[0] is not None:
                if budget[0] <= 0:
                    break
                budget[0] -= 1
            msg = None
            for i in range(n):  # one pass without sleeping, then sleep on one queue
                msg = await s.dequeue(qs[(rr + i) % n])
                if msg is not None:
                    rr = (rr + i + 1) % n
                    break
            if msg is None:
                msg = await s.dequeue(qs[rr % n], wait=wait)
                rr += 1
            if msg is None:
                if budget[0] is not None:
                    budget[0] += 1
                continue
            await self._handle(s, msg)
            handled += 1
        return handled

    async def _handle(self, s: AsyncSession, msg: Message) -> None:
        act = self.actions[msg.queue]
        t0 = time.perf_counter_ns()
        try:
            try:
                # with the otel extra: the action runs in a span, its entry's
                # producer's child (current in this task only: contextvars)
                with process_span(msg):
                    async with asyncio.timeout(act.timeout):
                        result = await self._call(act, msg, s)
                if isinstance(result, Decline) and result.reply_to is not None:
                    await s.enqueue(result.reply_to,
                                    result.reply if result.reply is not None else b"")
            except (Exception, asyncio.CancelledError) as exc:
                await self._rolled_back(s, msg, act, exc)
                if isinstance(exc, asyncio.CancelledError) and not self._abort:
                    raise
                return
            try:
                await s.commit()
            except InDoubt as exc:
                self._stats[IN_DOUBT] += 1
                logger.warning("ringq worker: queue %s seq %s: commit in doubt (%s); the rows "
                               "decide it", msg.queue, msg.seq, exc)
                return
            except (Retryable, RingqError) as exc:
                self._count(msg, FAILED, f"commit failed ({type(exc).__name__}: "
                            f"{one_line(str(exc))})")
                return
            self._stats[HANDLED] += 1
            if isinstance(result, Decline):
                self._stats[DECLINED] += 1
        finally:
            self._stats[BUSY_NS] += time.perf_counter_ns() - t0

    async def _call(self, act: Action, msg: Message, s: AsyncSession) -> object:
        if inspect.iscoroutinefunction(act.func):
            return await cast("Callable[[Message, AsyncSession], Awaitable[object]]",
                              act.func)(msg, s)
        # a sync action: in a thread, with the sync Session under the AsyncSession
        func = cast("Callable[[Message, Session], object]", act.func)
        # read here: Session.connection settles the session, not to be done
        # from the loop while the thread runs (for _outlive's cancel)
        conn = s.session.connection
        thread = asyncio.ensure_future(asyncio.to_thread(func, msg, s.session))
        try:
            return await asyncio.shield(thread)
        except asyncio.CancelledError:
            # The time limit or an abort: the thread goes on, on this slot's
            # Session. Until it returns nothing else may touch the Session (not
            # thread-safe); rolled back before, its later writes would join the
            # slot's next transaction. So: cut its statement short, wait for it,
            # and only then let the rollback run (see the module).
            await self._outlive(thread, conn, msg)
            raise

    async def _outlive(self, thread: asyncio.Future[object], conn: psycopg.Connection[Any],
                       msg: Message) -> None:
        """Wait until a sync action's ``thread`` returns, the statement it
        runs on ``conn`` cancelled first (the server ignores a cancel while no
        statement runs). The cancel is waited for too: the rollback is sent
        after both, so it is never the one cancelled. Another cancellation
        (an abort on top of a time limit) does not stop the wait."""
        waits: set[asyncio.Future[Any]] = {thread}
        cancel = None
        if not thread.done():
            assert self._canceller is not None
            cancel = asyncio.get_running_loop().run_in_executor(
                self._canceller, partial(conn.cancel_safe, timeout=CANCEL_TIMEOUT))
            waits.add(cancel)
        while not all(f.done() for f in waits):
            try:
                await asyncio.wait(waits)
            except asyncio.CancelledError:
                continue
        if cancel is not None and cancel.exception() is not None:
            logger.warning("ringq worker: could not cancel a timed-out action's statement: %s",
                           one_line(str(cancel.exception())))
        exc = None if thread.cancelled() else thread.exception()
        logger.info("ringq worker: queue %s seq %s: the action's thread returned after its "
                    "time limit or abort%s", msg.queue, msg.seq,
                    f" ({type(exc).__name__}: {one_line(str(exc))})" if exc else "")

    async def _rolled_back(
        self, s: AsyncSession, msg: Message, act: Action, exc: BaseException
    ) -> None:
        if isinstance(exc, TimeoutError) and act.timeout is not None:
            kind, what = TIMEOUTS, f"timed out after {act.timeout:g}s"
        elif isinstance(exc, asyncio.CancelledError):
            kind, what = ABORTED, "aborted"
        else:
            kind, what = FAILED, f"failed: {type(exc).__name__}: {exc}"
        retry_after = exc.after if isinstance(exc, Retry) else None
        try:
            if not s.closed:
                await s.rollback(retry_after=retry_after)
        except RingqError as rb:
            logger.warning("ringq worker: rollback after a failed action failed: %s",
                           one_line(rb))
        self._count(msg, kind, what)

    def _count(self, msg: Message, kind: str, what: str) -> None:
        self._stats[kind] += 1
        limit = self._max_deliveries.get(msg.queue, 0)
        if limit and msg.deliveries >= limit:
            self._stats[POISONED] += 1
        logger.warning("ringq worker: queue %s seq %s delivery %s/%s %s (rolled back)",
                       msg.queue, msg.seq, msg.deliveries, limit, what)
