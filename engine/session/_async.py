"""The asyncio face: :class:`AsyncSession`, the Session's twin for an event loop.

One engine, two faces. An AsyncSession holds a sync :class:`~._session.Session`
(its link, transaction, claims, reservations, two-phase commit) and calls the
same steps: the statements of a commit, a strike or a dequeue's read of rows
are built by the shared ``plan`` steps and read back by the shared ``apply``
steps; only the round trip between them is its own, through
:mod:`~ringq.engine.driver.awire` on a psycopg ``AsyncConnection`` (the same
libpq exchange, awaited). What works in shared memory only (an enqueue, a
dequeue served from the payload cache, finishing slots after a commit) is
the sync code itself, called on the loop: it never waits on anything but the
queue's short lock. A dequeue waiting for an entry, and an enqueue waiting
for room in a full queue, wait on the loop between attempts that do not wait
(the queue's semaphore posts reach it through :mod:`._waker`).

The ``AsyncConnection`` (:attr:`AsyncSession.connection`) and the link's sync
connection are two psycopg fronts over ONE libpq connection: the caller's
SQL, the session's statements and the rare paths below all run in the same
transaction. The session's calls are never concurrent (one task at a time
per session, as one thread at a time per Session), so the fronts never
overlap.

In a thread (``asyncio.to_thread``), on the sync code, because they are rare
and their logic is long and must stay one: opening and closing; a lost
connection (reconnecting, deciding the slots in flight from the rows), a
commit that failed or whose answer was lost, a stale section's resync, a
dequeue's repair of rows that did not match; recovering dead holders in the
queue's way; the first look-up of a queue; an enqueue that writes a key (its
attempts; the wait for room between them is on the loop); ``flush``,
two-phase commit, ``publish``. A call in a thread
is seen through: if its task is cancelled, the call still finishes (the
session's state is never left half-changed) and ``CancelledError`` is raised
after it.

Cancellation (``asyncio.timeout``, ``Task.cancel``):

- a dequeue waiting for an entry stops waiting and takes nothing;
- an enqueue waiting for room in a full queue stops waiting and holds
  nothing (no slot; a batch is reserved whole or not at all while it waits);
- a dequeue whose read of rows was on the wire gives its entries back: the
  read took the rows in the transaction, so the transaction is rolled back
  (no delivery counted); if it held anything else, the next :meth:`commit`
  raises :class:`RolledBack` rather than commit the rest;
- a commit cancelled on the wire (psycopg asks the server to cancel it and
  reads the answer): the section learns what the server answered, or, with
  no answer, the rows decide as for a lost connection; ``CancelledError`` is
  raised either way, after the section knows;
- a rollback is not cancelled: it finishes, then ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Self, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from ..driver import awire, resolve_dsn
from ..driver.awire import Box
from ..driver.errors import (
    InDoubt,
    RingqError,
    RolledBack,
    SessionClosed,
    StaleSection,
    TransactionError,
)
from ..driver.pg import from_callers_statement
from ..ring import OpKind, QueueInfo, Ring, each_op
from ..rows import help_due
from ..section import layout as L
from . import _claim, _otel, _reserve
from ._claim import RowsPlan, recover_in_way, repair_dequeue, unwait
from ._message import Message
from ._reserve import WouldBlock
from ._session import Session
from ._validate import as_groups, as_payloads, check_count, check_due, check_wait
from ._waker import waker_for

logger = logging.getLogger("ringq.engine")

T = TypeVar("T")

_IDLE = TransactionStatus.IDLE
_INTRANS = TransactionStatus.INTRANS
_INERROR = TransactionStatus.INERROR


async def connect_async(
    dsn: str | None = None,
    *,
    producer: str | None = None,
    connect_timeout: float = 10.0,
    application_name: str = "ringq",
) -> AsyncSession:
    """Open an asyncio session (as :func:`~ringq.engine.connect`; connecting
    and attaching the section run in a thread, off the loop)::

        async with await ringq.engine.connect_async(dsn) as session:
            await session.enqueue("jobs", b"...")
            await session.commit()

    :raises DatabaseUnavailable, SchemaMissing, SectionIncompatible: as ``connect``.
    """
    resolved = resolve_dsn(dsn)
    session = await asyncio.to_thread(
        Session, resolved, producer=producer, connect_timeout=connect_timeout,
        application_name=application_name,
    )
    return AsyncSession(session)


async def _finish_anyway(fut: asyncio.Future[T]) -> T:
    """Await ``fut``; if the caller is cancelled meanwhile, wait for it
    still, then raise ``CancelledError`` (its own error is logged)."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        if not fut.cancelled() and fut.exception() is not None:
            logger.info("ringq: a call finished after its task was cancelled raised: %s",
                        fut.exception())
        raise


class AsyncSession:
    """A session for asyncio code: the :class:`~ringq.engine.Session` API
    with ``await``. Not safe for concurrent use: one task at a time (run
    many consumers as many sessions, one each)."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self._link = session._link
        self._txn = session._txn
        self._claims = session._claims
        self._reservations = session._reservations
        self._aconn: psycopg.AsyncConnection[Any] | None = None
        self._doomed = False  # rolled back by a cancelled dequeue: the next commit refuses
        self.dsn = session.dsn

    # -- the connection ------------------------------------------------------------

    def _conn(self) -> psycopg.AsyncConnection[Any]:
        """The AsyncConnection over the link's libpq connection (made again
        when the link has a new one: a reconnect)."""
        conn = self._link.conn
        aconn = self._aconn
        if aconn is None or aconn.pgconn is not conn.pgconn:
            aconn = psycopg.AsyncConnection(conn.pgconn)
            aconn._autocommit = conn.autocommit
            aconn.prepare_threshold = conn.prepare_threshold
            aconn.row_factory = conn.row_factory  # type: ignore[assignment]
            # the sync front prepares nothing of psycopg's: its DEALLOCATE ALL
            # would drop the AsyncConnection's statements behind its back
            conn.prepare_threshold = None
            self._aconn = aconn
        return aconn

    @property
    def connection(self) -> psycopg.AsyncConnection[Any]:
        """The psycopg AsyncConnection whose transaction queue operations join
        (read it again after an error: a lost connection is replaced).

        :raises SessionClosed: the session is closed."""
        self._s._require_open()
        return self._conn()

    @property
    def session(self) -> Session:
        """The sync Session this face runs on (for inspection; do not call it
        while a coroutine of this session runs)."""
        return self._s

    @property
    def backend_pid(self) -> int:
        return self._link.backend_pid

    @property
    def owner(self) -> int:
        return self._link.owner

    @property
    def producer(self) -> str:
        return self._link.producer

    @property
    def closed(self) -> bool:
        return self._s.closed

    async def _blocking(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (sync engine code that makes round trips) in a thread,
        seen through if cancelled (see the module's docstring)."""
        return await _finish_anyway(asyncio.ensure_future(asyncio.to_thread(fn)))

    async def _check(self) -> None:
        s, link = self._s, self._link
        s._require_open()
        if os.getpid() != s._pid:
            raise SessionClosed("an asyncio session does not cross fork(): open one in the child")
        if self._settle_needed():
            await self._blocking(lambda: link.settle(two_phase_prepared=s._tpc.prepared))

    def _settle_needed(self) -> bool:
        """Whether ``Link.settle`` would make round trips (then it runs in a thread)."""
        link = self._link
        if not link.ops:
            return (link.conn.closed and not link.closing) or link.section.unlinked_lately()
        return (link.sent_any and link.conn.pgconn.transaction_status == _IDLE
                and not self._s._tpc.prepared and bool(link.sent()))

    async def _ready(self, queue: str) -> tuple[QueueInfo, Ring]:
        """The queue's info and ring (looked up, or loaded, in a thread the first time)."""
        await self._check()
        link = self._link
        info = link.queues.get(queue)
        if info is None or info.id not in link.rings:
            return await self._blocking(lambda: (link.info(queue), link.ring(link.info(queue))))
        return info, link.rings[info.id]

    # -- life cycle ---------------------------------------------------------------------

    async def close(self) -> None:
        """Roll back anything open and release the connection (in a thread); a
        second call does nothing."""
        if self._s.closed and not self._link.ops:
            self._s.close()
            return
        await self._blocking(self._s.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.close()

    # -- enqueue ---------------------------------------------------------------------

    async def enqueue(
        self,
        queue: str,
        payload: bytes,
        *,
        key: str | None = None,
        group: str | None = None,
        timeout: float | None = None,
        delay: float | None = None,
        not_before: datetime | None = None,
        trace: str | None = None,
    ) -> int:
        """As ``Session.enqueue``: nothing goes to the database now (the slot
        is reserved in shared memory); with ``key`` the row is written now, in
        a thread; a full queue is waited for on the loop (cancellable: then
        nothing is enqueued). With the ``otel`` extra, the producer span as
        the sync face's.

        :raises: as ``Session.enqueue``.
        """
        sp = _otel.spans()
        if sp is None:
            return await self._enqueue(queue, payload, key, group, timeout, delay, not_before,
                                       trace)
        with sp.enqueue(queue, "enqueue") as span:
            seq = await self._enqueue(queue, payload, key, group, timeout, delay, not_before,
                                      trace or span.traceparent)
            span.seqs = (seq,)
        return seq

    async def _enqueue(
        self, queue: str, payload: bytes, key: str | None, group: str | None,
        timeout: float | None, delay: float | None, not_before: datetime | None,
        trace: str | None,
    ) -> int:
        await self._ready(queue)
        res = self._reservations

        def call() -> int:
            return res.enqueue_checked(queue, payload, key, group, timeout, delay, not_before,
                                       trace)

        return await self._reserve(call, in_thread=key is not None)

    async def enqueue_many(
        self,
        queue: str,
        payloads: Iterable[bytes],
        *,
        group: str | Iterable[str | None] | None = None,
        timeout: float | None = None,
        delay: float | None = None,
        not_before: datetime | None = None,
        trace: str | None = None,
    ) -> list[int]:
        """As ``Session.enqueue_many``; a full queue is waited for on the loop,
        until the whole batch has room (the sync face takes room as it comes).

        :raises: as ``Session.enqueue_many``.
        """
        sp = _otel.spans()
        if sp is None:
            return await self._enqueue_many(queue, payloads, group, timeout, delay, not_before,
                                            trace)
        with sp.enqueue(queue, "enqueue_many") as span:
            span.seqs = seqs = await self._enqueue_many(
                queue, payloads, group, timeout, delay, not_before, trace or span.traceparent)
        return seqs

    async def _enqueue_many(
        self, queue: str, payloads: Iterable[bytes], group: str | Iterable[str | None] | None,
        timeout: float | None, delay: float | None, not_before: datetime | None,
        trace: str | None,
    ) -> list[int]:
        await self._ready(queue)
        res = self._reservations
        # An attempt may be made again (after waiting for room): iterators are
        # read once, here, with the sync face's checks (a list goes as it is).
        items = payloads if isinstance(payloads, list | tuple) else as_payloads(payloads)
        groups = (group if group is None or isinstance(group, str | list | tuple)
                  else as_groups(group, len(items)))

        def call() -> list[int]:
            return res.enqueue_many_checked(queue, items, groups, timeout, delay, not_before,
                                            trace)

        return await self._reserve(call)

    async def _reserve(self, call: Callable[[], T], *, in_thread: bool = False) -> T:
        """``call`` (a reservation of slots; ``in_thread``: with a key's row
        write, whose round trips run in a thread) in attempts that never
        wait: where the queue is full, the room is waited for on the loop
        between them (:meth:`_wait_for_room`), as long as the sync face would
        wait; then :class:`QueueFull` as it. Cancelled while it waits, it
        holds nothing (no slot, no waiter registration)."""
        res, link = self._reservations, self._link

        def attempt() -> T:
            res.nonblocking = True
            try:
                return call()
            finally:
                res.nonblocking = False

        start = time.monotonic()
        while True:
            try:
                return await self._attempt_in_thread(attempt) if in_thread else attempt()
            except WouldBlock as blocked:
                full = blocked
            try:
                if not await self._wait_for_room(full, start + full.wait):
                    raise res.queue_full(full.info, full.ring, full.wait)
            finally:
                if full.waiting:
                    unwait(link, full.ring, OpKind.ENQUEUE)  # the next attempt registers anew

    async def _attempt_in_thread(self, attempt: Callable[[], T]) -> T:
        """``attempt`` in a thread, seen through if cancelled; a WouldBlock
        it raised meanwhile has its waiter registration undone (no one waits)."""
        fut = asyncio.ensure_future(asyncio.to_thread(attempt))
        try:
            return await _finish_anyway(fut)
        except asyncio.CancelledError:
            exc = None if fut.cancelled() else fut.exception()
            if isinstance(exc, WouldBlock) and exc.waiting:
                unwait(self._link, exc.ring, OpKind.ENQUEUE)
            raise

    async def _wait_for_room(self, full: WouldBlock, deadline: float) -> bool:
        """One round of ``Reservations._reserve_many``'s wait, on the loop: a
        dead holder in the way recovered (in a thread), or a wait for the
        space semaphore's post (through :mod:`._waker`) of at most
        ``ROOM_RECHECK_S``. False: no room is to be waited for any more."""
        link, ring, info = self._link, full.ring, full.info
        if help_due(link.instance, ring.qid) and await self._blocking(
            lambda: recover_in_way(link, ring, info)
        ):
            return True  # a dead holder's slots were decided: try again now
        remaining = deadline - time.monotonic()
        if not full.waiting or remaining <= 0:
            return False
        waker = waker_for(link.section.semaphore(info.id, "s"))
        # read at use, as the sync face does: one setting for both faces
        await waker.wait(min(remaining, _reserve.ROOM_RECHECK_S))
        return True

    # -- dequeue ----------------------------------------------------------------------

    async def dequeue(self, queue: str, *, wait: float | None = None) -> Message | None:
        """As ``Session.dequeue``: the oldest ready entry, or None (after
        waiting up to ``wait`` seconds, without blocking the loop).
        Cancellable at any await (see the module's docstring).

        :raises InvalidArgumentType, InvalidArgument: ``wait`` not a number,
            negative, NaN or infinite (as ``Session.dequeue``).
        """
        check_wait("wait", wait)
        sp = _otel.spans()
        if sp is None:
            got = await self._dequeue_many(queue, 1, wait)
            return got[0] if got else None
        with sp.dequeue(queue, "dequeue") as span:
            span.messages = got = await self._dequeue_many(queue, 1, wait)
        return got[0] if got else None

    async def dequeue_many(
        self, queue: str, max_n: int, *, wait: float | None = None
    ) -> list[Message]:
        """As ``Session.dequeue_many``.

        :raises InvalidArgumentType, InvalidArgument: as ``Session.dequeue_many``.
        """
        check_count("max_n", max_n)
        check_wait("wait", wait)
        sp = _otel.spans()
        if sp is None:
            return await self._dequeue_many(queue, max_n, wait)
        with sp.dequeue(queue, "dequeue_many") as span:
            span.messages = msgs = await self._dequeue_many(queue, max_n, wait)
        return msgs

    async def _dequeue_many(
        self, queue: str, max_n: int, wait: float | None
    ) -> list[Message]:
        t0 = time.perf_counter_ns()
        info, ring = await self._ready(queue)
        link = self._link
        exclusive = info.dequeue_mode == "single"
        deadline = None if wait is None else time.monotonic() + wait
        holding = any(op.kind is OpKind.DEQUEUE for op in link.ops)
        for _attempt in range(64):
            slots, seqs, cached, arrays = await self._claim(ring, info, max_n, deadline,
                                                            exclusive)
            if not slots:
                return []
            if not holding:  # the queue's lease runs from the transaction's first entry
                link.section.note_hold(link.cidx)
                holding = True
            if cached is not None and None not in cached:
                return self._claims.take_cached(info, ring, slots, seqs, cached, arrays, t0)
            messages = await self._dequeue_rows(info, ring, slots, seqs, cached, t0, exclusive)
            if messages:
                link.section.count_client(link.cidx, L.C_N_DEQ, len(messages))
                return messages
        return []

    async def _claim(
        self, ring: Ring, info: QueueInfo, max_n: int, deadline: float | None, exclusive: bool
    ) -> tuple[list[int], list[int], Any, Any]:
        """``Claims.claim`` with the waiting on the loop (the semaphore's
        posts reach it through :mod:`._waker`)."""
        claims, link = self._claims, self._link
        waiting = False
        waker = None
        while True:
            slots, seqs, cached, arrays, waiting = claims.claim_once(
                ring, max_n, deadline, exclusive, waiting)
            if slots:
                return slots, seqs, cached, arrays
            try:
                if help_due(link.instance, ring.qid) and await self._blocking(
                    lambda: recover_in_way(link, ring, info)
                ):
                    continue  # a dead holder's slots were decided: look again now
            except BaseException:
                if waiting:
                    unwait(link, ring, OpKind.DEQUEUE, max_n)
                raise
            if not waiting:
                return [], [], None, None
            assert deadline is not None
            if waker is None:
                waker = waker_for(link.section.semaphore(info.id, "r"))
            try:
                while True:
                    await waker.wait(max(0.0, min(
                        # read at use, as the sync claim does: one setting for both faces
                        deadline - time.monotonic(), _claim.CLAIM_RECHECK_S, ring.until_due_s()
                    )))
                    if ring.maybe_ready() or deadline <= time.monotonic():
                        break
            except BaseException:
                unwait(link, ring, OpKind.DEQUEUE, max_n)
                raise

    async def _dequeue_rows(
        self, info: QueueInfo, ring: Ring, slots: list[int], seqs: list[int],
        cached: Any, t0: int, exclusive: bool,
    ) -> list[Message]:
        """``Claims._dequeue_rows`` with its one statement awaited."""
        claims, link = self._claims, self._link
        before = len(link.ops)
        opened = link.conn.pgconn.transaction_status != _IDLE
        plan = claims.rows_plan(info, ring, slots, seqs, cached, t0)
        box = Box()
        try:
            query, params = plan.statement
            fetch = await self._execute(query, params, box=box, queue=info.name, qid=info.id,
                                        seq=plan.ops[0].seq)
        except asyncio.CancelledError:
            await self._give_back(plan, had_more=before > 0 or opened)
            raise
        messages, stale = claims.rows_apply(plan, fetch, t0)
        if stale:
            await self._blocking(lambda: repair_dequeue(link, info, ring, stale, exclusive))
        return messages

    async def _give_back(self, plan: RowsPlan, *, had_more: bool) -> None:
        """A dequeue cancelled while its rows were read: roll the transaction
        back (the read took the rows in it), no delivery counted."""
        txn = self._txn
        await self._blocking(lambda: txn.rollback(count_delivery=False))
        if had_more:
            self._doomed = True
        logger.info("ringq: queue %s: a cancelled dequeue gave back %d entries",
                    plan.info.name, len(plan.slots))

    # -- the round trips -------------------------------------------------------------

    async def _execute(
        self, query: str, params: Any, *, box: Box | None = None, queue: str | None = None,
        qid: int = 0, seq: int = -1, binary: bool = True, cursor: bool = False,
    ) -> Any:
        """``Link.execute`` awaited: one statement, its BEGIN with it; errors
        as ``Link.call`` (a lost connection recovered in a thread)."""
        link = self._link
        link.round_trips += 1
        link.sent_any = True
        try:
            return await awire.execute(self._conn(), query, params, binary=binary,
                                       may_begin=not link.tpc_open, prepared=link.prepared,
                                       box=box, cursor=cursor)
        except psycopg.Error as exc:
            raise await self._failed(exc, queue=queue, qid=qid, seq=seq) from exc

    async def _failed(
        self, exc: psycopg.Error, *, queue: str | None = None, qid: int = 0, seq: int = -1,
        recover: bool = True,
    ) -> RingqError:
        link = self._link
        if recover and link.is_lost():
            return await self._blocking(
                lambda: link.failed(exc, queue=queue, qid=qid, seq=seq, recover=True))
        return link.failed(exc, queue=queue, qid=qid, seq=seq, recover=recover)

    async def _end(self, commit: bool, box: Box | None = None) -> None:
        """COMMIT or ROLLBACK of the open transaction (psycopg's own, awaited)."""
        aconn = self._conn()
        self._link.round_trips += 1
        try:
            async with aconn.lock:
                gen = aconn._commit_gen() if commit else aconn._rollback_gen()
                await awire.wait(aconn, awire._boxed(gen, box))
        except psycopg.Error as exc:
            raise await self._failed(exc, recover=False) from exc

    # -- transactions -------------------------------------------------------------------

    async def execute(
        self, query: str, params: Any = None, *, prepare: bool = False, defer: bool = False
    ) -> Any:
        """As ``Session.execute``: your own statement in the session's
        transaction, its BEGIN in the same message; its rows' cursor.
        ``defer``: sent with the commit's round trip (see ``Session.execute``).

        :raises StatementRejected, TransactionConflict, DatabaseError: as ``Session.execute``.
        """
        await self._check()
        link = self._link
        if prepare:
            link.prepared.add(query)
        if defer:
            link.deferred.append((query, params))
            return None
        if link.deferred:
            await self.flush()  # they run first, in order
        try:
            got = await self._execute(query, params, binary=False, cursor=True)
            return _AsyncRows(got) if isinstance(got, awire.Rows) else got
        except RingqError as err:
            if err.__cause__ is None:
                raise
            raise from_callers_statement(err.__cause__, err) from err.__cause__

    async def commit(self) -> None:
        """As ``Session.commit``: one round trip (the held row writes and the
        COMMIT); then the section learns the outcome. Cancelled on the wire,
        the section still learns it (see the module's docstring).

        :raises StaleSection, InDoubt, RolledBack, TransactionError: as ``Session.commit``.
        """
        sp = _otel.spans()
        if sp is None:
            await self._commit()
            return
        with sp.settle("commit", self._link.ops):
            await self._commit()

    async def _commit(self) -> None:
        await self._check()
        link, txn = self._link, self._txn
        if self._doomed:
            self._doomed = False
            await self._blocking(lambda: txn.rollback(count_delivery=False))
            raise RolledBack("the transaction was rolled back when a dequeue in it was "
                             "cancelled: nothing of it committed", reason="cancelled")
        if link.tpc_open:
            raise TransactionError("a two-phase transaction is open: use tpc_commit()")
        if link.conn.pgconn.transaction_status == _INERROR:
            await self._blocking(txn.rollback)
            raise TransactionError("the transaction failed earlier and was rolled back")
        ops = link.ops
        writes = [op for op in ops if op.held]
        box = Box()
        plan = None
        try:
            try:
                if writes or link.deferred:
                    plan = txn.plan_writes(writes, commit=True)
                    link.round_trips += 1
                    try:
                        cursors = await awire.send(
                            self._conn(), plan.statements, commit=True,
                            may_begin=not link.tpc_open, prepared=link.prepared, box=box)
                    except psycopg.Error as exc:
                        raise await self._failed(exc, recover=False) from exc
                    txn.apply_writes(plan, cursors)
                else:
                    await self._end(True, box)
            except StaleSection as err:
                stale = err
                await self._blocking(lambda: txn.after_stale(stale, writes))
                raise
        except StaleSection:
            raise
        except RingqError as err:
            failure = err
            await self._blocking(lambda: txn.commit_failed(failure, ops, None))
            return
        except asyncio.CancelledError:
            await self._commit_cancelled(box, plan, ops, writes)
            raise
        txn.committed(ops)

    async def _commit_cancelled(self, box: Box, plan: Any, ops: list[Any],
                                writes: list[Any]) -> None:
        """The commit's task was cancelled on the wire: tell the section what
        the server answered, or let the rows decide (then raise CancelledError)."""
        link, txn = self._link, self._txn
        try:
            if box.done:
                if plan is not None:
                    try:
                        txn.apply_writes(plan, box.value)
                    except StaleSection as err:
                        stale = err
                        await self._blocking(lambda: txn.after_stale(stale, writes))
                        return
                txn.committed(ops)
                return
            exc = box.error
            if not isinstance(exc, psycopg.Error):
                # no answer read: the connection's state is unknown; close it,
                # and decide the transaction's slots from the rows
                link.conn.pgconn.finish()
                exc = psycopg.OperationalError("the commit was cancelled before its answer")
            failure = link.failed(exc, recover=False)
            failure.__cause__ = exc
            if isinstance(failure, StaleSection):
                stale_err = failure
                await self._blocking(lambda: txn.after_stale(stale_err, writes))
            else:
                await self._blocking(lambda: txn.commit_failed(failure, ops, None))
        except RingqError as outcome:
            logger.info("ringq: a cancelled commit: %s", outcome)

    async def rollback(self, *, count_delivery: bool = True,
                       retry_after: float | None = None) -> None:
        """As ``Session.rollback`` (one round trip at most; not cancelled
        half-way: it finishes, then ``CancelledError``).

        :raises InvalidArgument: ``retry_after`` negative, NaN or infinite."""
        sp = _otel.spans()
        if sp is None:
            await self._rollback_checked(count_delivery, retry_after)
            return
        with sp.settle("rollback", self._link.ops):
            await self._rollback_checked(count_delivery, retry_after)

    async def _rollback_checked(self, count_delivery: bool, retry_after: float | None) -> None:
        s = self._s
        s._require_open()
        self._doomed = False
        retry_after = None if retry_after is None else check_due(retry_after, None)[0]
        if s._tpc.xid is not None:
            await self._blocking(s.tpc_rollback)
            return
        await _finish_anyway(asyncio.ensure_future(self._rollback(count_delivery, retry_after)))

    async def _rollback(self, count_delivery: bool, retry_after: float | None) -> None:
        link, txn = self._link, self._txn
        ops, link.ops = each_op(link.ops), []
        link.deferred = []  # never sent: nothing of them ran
        deq = [op for op in ops if op.kind == OpKind.DEQUEUE] if count_delivery else []
        poisoned: set[tuple[int, int]] = set()
        try:
            if deq:
                plan = txn.strike_plan(deq, retry_after)
                link.round_trips += 1
                try:
                    try:
                        cursors = await awire.rollback_then(self._conn(), plan[1])
                    except psycopg.Error as exc:
                        raise await self._failed(exc, recover=False) from exc
                except RingqError as err:
                    poisoned = txn.strike_failed(err, rollback=True)
                else:
                    poisoned = txn.strike_apply(deq, plan, cursors)
            else:
                await self._end(False)
        except RingqError as err:
            failure = err
            await self._blocking(lambda: txn.rollback_failed(failure, ops))
        txn.finish(ops, committed=False, poisoned=poisoned)

    async def in_doubt_outcome(self, exc: InDoubt, *, timeout: float = 30.0) -> bool | None:
        """As ``Session.in_doubt_outcome``: whether the commit that raised
        ``exc`` committed, from the rows of the server the DSN reaches now
        (in a thread: it connects anew, and may wait up to ``timeout``
        seconds for the old backend to end).

        :raises DatabaseUnavailable, DatabaseError: as ``Session.in_doubt_outcome``.
        """
        s = self._s
        return await self._blocking(lambda: s.in_doubt_outcome(exc, timeout=timeout))

    async def flush(self) -> None:
        """As ``Session.flush`` (in a thread)."""
        await self._blocking(self._s.flush)

    def transaction(self) -> _Transaction:
        """``async with session.transaction():`` commits on normal exit, rolls
        back on an exception (which propagates), cancellation included."""
        return _Transaction(self)

    # -- two-phase commit (in a thread: the coordinator's path, not the hot one) -------------

    def xid(self, gtrid: str) -> Any:
        return self._s.xid(gtrid)

    async def tpc_begin(self, xid: Any) -> None:
        await self._blocking(lambda: self._s.tpc_begin(xid))

    async def tpc_prepare(self) -> None:
        await self._blocking(self._s.tpc_prepare)

    async def tpc_decide(self) -> None:
        await self._blocking(self._s.tpc_decide)

    async def tpc_commit(self) -> None:
        await self._blocking(self._s.tpc_commit)

    async def tpc_rollback(self) -> None:
        await self._blocking(self._s.tpc_rollback)

    # -- the rest -----------------------------------------------------------------------

    async def queue_info(self, name: str) -> QueueInfo:
        return (await self._ready(name))[0]

    async def publish(self, name: str, **data: Any) -> None:
        await self._blocking(lambda: self._s.publish(name, **data))

    async def recover_dead_holders(self, queue: str, *, timeout: float = 30.0) -> None:
        await self._blocking(lambda: self._s.recover_dead_holders(queue, timeout=timeout))

    def stats(self, queue: str) -> dict[str, int]:
        return self._s.stats(queue)


class _AsyncRows:
    """Rows read already, with an AsyncCursor's ``fetchone``/``fetchall``
    (:meth:`AsyncSession.execute` answers alike whichever way it went)."""

    def __init__(self, rows: awire.Rows) -> None:
        self._rows = rows

    async def fetchone(self) -> Any:
        return self._rows.fetchone()

    async def fetchall(self) -> list[Any]:
        return self._rows.fetchall()


class _Transaction:
    def __init__(self, session: AsyncSession) -> None:
        self._session = session

    async def __aenter__(self) -> AsyncSession:
        return self._session

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            await self._session.commit()
        elif not self._session.closed and not self._session._s._tpc.decided:
            await self._session.rollback()
