"""Claims: which slots a session's dequeues take, and the section and
payload-cache work for them (its enqueues' reservations: ``_reserve``).

A dequeue claims ready slots from the tail, each served from its payload
cache record when that holds the entry, else read from its row. Nothing
found: a dead holder in the queue's way is recovered
(``_help.help_recover``).

:class:`Claims` works on the session's :class:`~._link.Link` and adds the
slots it takes to the link's ops in flight; the transaction finishes them.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta, tzinfo
from operator import itemgetter
from typing import Any, cast

import numpy as np
import posix_ipc
import psycopg
from psycopg.pq import TransactionStatus

from ..driver import wire
from ..ring import Cached, Op, OpKind, QueueInfo, Ring, RowState, Run, stretch
from ..rows import help_recover
from ..section import layout as L
from ._link import Link
from ._message import Message, cached_message, cached_messages
from ._transaction import Transaction
from ._validate import check_count, check_wait

logger = logging.getLogger("ringq.engine")

_INERROR = TransactionStatus.INERROR
_INTRANS = TransactionStatus.INTRANS

Due = tuple[float | None, datetime | None]  # (delay s, not_before), as _validate.check_due

# A waiting dequeuer is woken by the commit that makes an entry ready (a
# semaphore post); it also looks again this often, in seconds, as a safety net.
CLAIM_RECHECK_S = 1.0

_TIMEZONES: dict[bytes | None, tzinfo] = {}

_ENQ_US = itemgetter(3)  # a cache hit's enqueue time (us)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_US = timedelta(microseconds=1)


def _us(at: datetime) -> int:
    """A row's ``enq_at`` as the payload cache keeps it: us since the epoch
    (exact: timedelta // timedelta is an int)."""
    return (at - _EPOCH) // _ONE_US


def conn_timezone(conn: psycopg.Connection[Any]) -> tzinfo:
    """The connection's time zone (as ``conn.info.timezone``), by its
    TimeZone parameter: one libpq call per dequeue, no ConnectionInfo."""
    name = conn.pgconn.parameter_status(b"TimeZone")
    tz = _TIMEZONES.get(name)
    if tz is None:
        tz = _TIMEZONES[name] = conn.info.timezone
    return tz


def unwait(link: Link, ring: Ring, kind: OpKind, want: int = 1) -> None:
    """Undo a waiter registration when an exception leaves the wait."""
    sec = link.section
    sec.lock_queue(ring.qidx)
    try:
        ring.abandon_wait(kind, want)
    finally:
        sec.unlock_queue(ring.qidx)


class RowsPlan:
    """A dequeue's read of rows (:meth:`Claims.rows_plan`): the claimed
    slots, what the cache held of them, the ops to read and the statement."""

    __slots__ = ("cached", "info", "ops", "seqs", "slots", "statement")

    def __init__(
        self, info: QueueInfo, slots: list[int], seqs: list[int],
        cached: list[Cached | None], ops: list[Op], statement: wire.Statement,
    ) -> None:
        self.info, self.slots, self.seqs, self.cached = info, slots, seqs, cached
        self.ops, self.statement = ops, statement


class Claims:
    """A session's dequeues over the rings of its link (its enqueues:
    :class:`~._reserve.Reservations`)."""

    def __init__(self, link: Link) -> None:
        self.link = link

    def dequeue_checked(self, queue: str, max_n: int, wait: float | None) -> list[Message]:
        """``Session.dequeue_many``'s arguments checked (before any I/O), then
        :meth:`dequeue_many`."""
        check_count("max_n", max_n)
        check_wait("wait", wait)
        t0 = time.perf_counter_ns()
        info = self.link.info(queue)
        deadline = None if wait is None else time.monotonic() + wait
        return self.dequeue_many(info, max_n, deadline, t0)

    def dequeue_one(self, queue: str, wait: float | None) -> Message | None:
        """``Session.dequeue``: the lean path when it needs no waiting and the
        oldest ready entry is in the payload cache (one lock round, one op,
        one message); anything else goes the way of :meth:`dequeue_many`."""
        check_wait("wait", wait)
        t0 = time.perf_counter_ns()
        link = self.link
        info = link.info(queue)
        if wait is None:
            ring = link.ring(info)
            if ring.stride:
                sec = link.section
                exclusive = info.dequeue_mode == "single"
                sec.lock_queue(ring.qidx)
                try:
                    r = ring.take_one(link.owner, link.backend_pid, exclusive=exclusive)
                finally:
                    sec.unlock_queue(ring.qidx)
                if r is not None:
                    slot, seq, cached = r
                    if not any(op.kind is OpKind.DEQUEUE for op in link.ops):
                        sec.note_hold(link.cidx)  # the lease runs from the first entry
                    if cached is not None:
                        link.ops.append(Op(ring, info, slot, seq, OpKind.DEQUEUE,
                                           time.perf_counter_ns() - t0, None, None, True,
                                           cached[3]))
                        sec.count_client(link.cidx, L.C_N_DEQ, 1)
                        return cached_message(queue, seq, cached, conn_timezone(link.conn))
                    # read from its row (repaired if it does not match: then on as below)
                    got = self._dequeue_rows(info, ring, [slot], [seq], None, t0, exclusive)
                    if got:
                        sec.count_client(link.cidx, L.C_N_DEQ, 1)
                        return got[0]
        deadline = None if wait is None else time.monotonic() + wait
        got = self.dequeue_many(info, 1, deadline, t0)
        return got[0] if got else None

    def dequeue_many(
        self, info: QueueInfo, max_n: int, deadline: float | None, t0: int
    ) -> list[Message]:
        """Take up to ``max_n`` ready entries (oldest first) in one statement."""
        link = self.link
        ring = link.ring(info)
        exclusive = info.dequeue_mode == "single"
        holding = any(op.kind is OpKind.DEQUEUE for op in link.ops)
        for _attempt in range(64):
            slots, seqs, cached, arrays = self.claim(ring, info, max_n, deadline, exclusive)
            if not slots:
                return []
            if not holding:  # the queue's lease runs from the transaction's first entry
                link.section.note_hold(link.cidx)
                holding = True
            if cached is not None and None not in cached:
                # All served from the payload cache: the consuming writes wait for the commit.
                return self.take_cached(info, ring, slots, seqs, cached, arrays, t0)
            messages = self._dequeue_rows(info, ring, slots, seqs, cached, t0, exclusive)
            if messages:
                link.section.count_client(link.cidx, L.C_N_DEQ, len(messages))
                return messages
        return []

    def _dequeue_rows(
        self, info: QueueInfo, ring: Ring, slots: list[int], seqs: list[int],
        cached: list[Cached | None] | None, t0: int, exclusive: bool,
    ) -> list[Message]:
        """The messages of claimed slots, some (or all) read from their rows
        in one statement; a slot whose row does not match is repaired."""
        link = self.link
        plan = self.rows_plan(info, ring, slots, seqs, cached, t0)
        ops, statement = plan.ops, plan.statement
        fetch = link.execute(*statement, binary=True, queue=info.name, qid=info.id,
                             seq=ops[0].seq)
        messages, stale = self.rows_apply(plan, fetch, t0)
        if stale:
            repair_dequeue(link, info, ring, stale, exclusive)
        return messages

    def rows_plan(
        self, info: QueueInfo, ring: Ring, slots: list[int], seqs: list[int],
        cached: list[Cached | None] | None, t0: int,
    ) -> RowsPlan:
        """The claimed slots join the transaction (as ops); those not served
        from the payload cache are read from their rows by one statement,
        built here (both faces send it: see :meth:`_dequeue_rows`)."""
        link = self.link
        queue = info.name
        if cached is None:
            cached = [None] * len(slots)
        ops = [
            Op(ring, info, slot, seq, OpKind.DEQUEUE, consume=c is not None,
               enq_us=0 if c is None else c[3])
            for slot, seq, c in zip(slots, seqs, cached, strict=True)
        ]
        link.ops.extend(ops)
        lat = (time.perf_counter_ns() - t0) // len(ops)
        for op in ops:
            if op.consume:
                op.latency_ns = lat
        ops = [op for op in ops if not op.consume]
        if len(ops) == 1:
            statement: wire.Statement = (link.stmt("dequeue", queue), (ops[0].slot, ops[0].seq))
        else:
            span = stretch(np.fromiter((op.slot for op in ops), np.int64, len(ops)),
                           np.fromiter((op.seq for op in ops), np.int64, len(ops)))
            statement = (
                (link.stmt("dequeue_span", queue), (span[0], span[0] + span[1], span[2]))
                if span is not None
                else (link.stmt("dequeue_many", queue),
                      (wire.int_array(op.slot for op in ops),
                       wire.int_array(op.seq for op in ops)))
            )
        return RowsPlan(info, slots, seqs, cached, ops, statement)

    def rows_apply(
        self, plan: RowsPlan, fetch: wire.Fetch, t0: int
    ) -> tuple[list[Message], list[Op]]:
        """After the rows' statement of ``plan``: the messages, and the ops
        whose row did not match (to repair: :func:`repair_dequeue`)."""
        link = self.link
        queue = plan.info.name
        ops = plan.ops
        if len(ops) == 1:
            row = fetch.fetchone()
            rows = [] if row is None else [(ops[0].slot, ops[0].seq, *row)]
        else:
            rows = fetch.fetchall()
        got = {r[0]: r for r in rows}
        lat = (time.perf_counter_ns() - t0) // len(ops)
        stale = [op for op in ops if op.slot not in got]
        messages = []
        tz = conn_timezone(link.conn)
        for slot, seq, c in zip(plan.slots, plan.seqs, plan.cached, strict=True):
            if c is not None:
                messages.append(cached_message(queue, seq, c, tz))
            elif slot in got:
                _slot, seq, payload, producer, pseq, enq_at, deliveries, group, trace = got[slot]
                messages.append(
                    Message(queue, seq, bytes(payload), producer, pseq, enq_at,
                            deliveries + 1, group, trace)
                )
        for op in ops:
            op.latency_ns = lat
            r = got.get(op.slot)
            if r is not None:
                op.enq_us = _us(r[5])
        return messages, stale

    def commit_and_dequeue(
        self, txn: Transaction, info: QueueInfo
    ) -> tuple[Message | None] | None:
        """``Session.commit_and_dequeue``: claim the oldest ready entry and
        commit with ``txn``, the dequeue of its row in the same message when
        it can (see there). Returns None if it committed alone (the caller
        dequeues next), else (the message, or None if nothing was taken)."""
        link = self.link
        queue = info.name
        ring = link.ring(info)
        exclusive = info.dequeue_mode == "single"
        ops = link.ops
        if not (
            link.conn.pgconn.transaction_status == _INTRANS
            and any(op.kind == OpKind.DEQUEUE and not op.held for op in ops)
            and not any(op.held for op in ops)
            and not link.deferred
        ):
            txn.commit()
            return None
        t0 = time.perf_counter_ns()
        slots, seqs, cached_list, _arrays = self.claim(ring, info, 1, None, exclusive)
        if not slots:
            txn.commit()
            return None
        slot, seq = slots[0], seqs[0]
        cached = None if cached_list is None else cached_list[0]
        op = Op(ring, info, slot, seq, OpKind.DEQUEUE, consume=cached is not None,
                enq_us=0 if cached is None else cached[3])
        if cached is not None:
            try:
                txn.commit()
            except BaseException:
                txn.finish([op], committed=False, count_delivery=False)  # not taken after all
                raise
            tz = conn_timezone(link.conn)
            self._taken([op], t0)
            return (cached_message(queue, seq, cached, tz),)
        cur = txn.commit(then=op, then_stmt=(link.stmt("dequeue", queue), (slot, seq)))
        if cur is None:
            return (None,)  # committed; the entry was given back
        row = cur.fetchone()
        if row is None:
            link.ops.append(op)  # for the repair, which finishes it
            repair_dequeue(link, info, ring, [op], exclusive)
            return (None,)
        self._taken([op], t0)
        payload, producer, pseq, enq_at, deliveries, group, trace = row
        op.enq_us = _us(enq_at)
        return (Message(queue, seq, bytes(payload), producer, pseq, enq_at, deliveries + 1, group,
                        trace),)

    def claim(
        self, ring: Ring, info: QueueInfo, max_n: int, deadline: float | None, exclusive: bool
    ) -> tuple[list[int], list[int], list[Cached | None] | None,
               tuple[np.ndarray, np.ndarray] | None]:
        """Claim up to ``max_n`` ready slots: their slots, seqs and, in a
        queue with a payload cache, each one's record if it holds the entry
        (read under the queue lock; None: read the row), else None; and
        the slots and seqs as int64 arrays when the claim made them (a
        batch past SMALL_BATCH), else None (:meth:`take_cached` makes them
        for a run; one entry is held as an op, as ``enqueue_many``'s).

        A waiter registers with how many entries it wants, so a commit wakes
        as many as its entries make work for; woken, it looks at the bitmaps
        without the lock first, and if another took the entries it sleeps
        again, still registered, without a lock round."""
        link = self.link
        sec = link.section
        waiting = False
        sem = None
        while True:
            slots, seqs, cached, arrays, waiting = self.claim_once(
                ring, max_n, deadline, exclusive, waiting)
            if slots:
                return slots, seqs, cached, arrays
            try:
                if recover_in_way(self.link, ring, info):
                    continue  # a dead holder's slots were decided: look again now
            except BaseException:
                if waiting:
                    unwait(self.link, ring, OpKind.DEQUEUE, max_n)
                raise
            if not waiting:
                return [], [], None, None
            assert deadline is not None
            if sem is None:
                sem = sec.semaphore(info.id, "r")
            try:
                while True:
                    sem.acquire(max(0.0, min(
                        deadline - time.monotonic(), CLAIM_RECHECK_S, ring.until_due_s()
                    )))
                    # Woken: if the entries are gone already, sleep again
                    # (still registered) rather than queue for the lock.
                    if ring.maybe_ready() or deadline <= time.monotonic():
                        break
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass  # timed out, or a signal whose handler did not raise: look again
            except BaseException:
                unwait(self.link, ring, OpKind.DEQUEUE, max_n)
                raise

    def claim_once(
        self, ring: Ring, max_n: int, deadline: float | None, exclusive: bool, waiting: bool
    ) -> tuple[list[int], list[int], list[Cached | None] | None,
               tuple[np.ndarray, np.ndarray] | None, bool]:
        """One look under the queue's lock (see :meth:`claim`, which both
        faces share this step of): what was claimed, and whether the caller
        is now registered as a waiter (nothing claimed, ``deadline`` ahead;
        ``waiting``: it was registered, and is not any more)."""
        link = self.link
        sec = link.section
        qidx = ring.qidx
        cached: list[Cached | None] | None = None
        arrays = None
        sec.lock_queue(qidx)
        try:
            if waiting:
                ring.remove_waiter(OpKind.DEQUEUE, max_n)
                waiting = False
            if max_n == 1:
                r = ring.take_one(link.owner, link.backend_pid, exclusive=exclusive)
                if r is None:
                    slots: list[int] = []
                    seqs: list[int] = []
                else:
                    slots, seqs = [r[0]], [r[1]]
                    if ring.stride:
                        cached = [r[2]]
            else:
                slots, seqs, cached, arrays = ring.take_many(
                    link.owner, link.backend_pid, max_n, exclusive=exclusive
                )
            if not slots:
                ring.note_empty()
                if deadline is not None and deadline > time.monotonic():
                    # Registered inside the same critical section as the
                    # failed scan, so a commit right after cannot miss us.
                    ring.add_waiter(OpKind.DEQUEUE, max_n)
                    waiting = True
        finally:
            sec.unlock_queue(qidx)
        return slots, seqs, cached, arrays, waiting

    def take_cached(
        self, info: QueueInfo, ring: Ring, slots: list[int], seqs: list[int],
        cached: list[Cached | None], arrays: tuple[np.ndarray, np.ndarray] | None, t0: int,
    ) -> list[Message]:
        """Claimed slots all served from the payload cache join the
        transaction: their consuming writes wait for the commit."""
        link = self.link
        lat = (time.perf_counter_ns() - t0) // len(slots)
        dq = OpKind.DEQUEUE
        if len(slots) > 1:
            hits = cast(list[Cached], cached)  # no None in it
            enq_us = np.fromiter(map(_ENQ_US, hits), dtype=np.int64, count=len(hits))
            sl, sq = arrays or (np.array(slots, dtype=np.int64), np.array(seqs, dtype=np.int64))
            link.ops.append(Run(ring, info, dq, sl, sq, lat, consume=True, enq_us=enq_us))
        else:
            link.ops.extend([
                Op(ring, info, slot, seq, dq, lat, None, None, True, c[3])
                for slot, seq, c in zip(slots, seqs, cached, strict=True)
                if c is not None
            ])
        link.section.count_client(link.cidx, L.C_N_DEQ, len(slots))
        return cached_messages(info.name, seqs, cached, conn_timezone(link.conn))

    def _taken(self, ops: list[Op], t0: int) -> None:
        """Ops of a dequeue join the transaction (its lease runs from now)."""
        link = self.link
        lat = (time.perf_counter_ns() - t0) // len(ops)
        for op in ops:
            op.latency_ns = lat
        link.ops.extend(ops)
        link.section.note_hold(link.cidx)
        link.section.count_client(link.cidx, L.C_N_DEQ, len(ops))



def repair_dequeue(
    link: Link, info: QueueInfo, ring: Ring, stale: list[Op], exclusive: bool
) -> None:
    """The rows did not match the section: decide those slots from the rows."""
    for op in stale:
        link.ops.remove(op)
    link.record_error(L.ERR_ROW_MISMATCH, info.id, stale[0].seq)
    rows = link.execute(
        link.stmt("rows", info.name),
        ([op.slot for op in stale],),
        queue=info.name,
        qid=info.id,
        seq=stale[0].seq,
    ).fetchall()
    by_slot = {slot: (state, seq, due) for slot, state, seq, _group, due in rows}
    need_resync = False
    sec = link.section
    sec.lock_queue(ring.qidx)
    try:
        for op in stale:
            if not ring.held_by(op.slot, link.owner):
                continue
            state, seq, due = by_slot.get(op.slot, (RowState.FREE, -1, None))
            if state == RowState.QUEUED and seq == op.seq:
                # Queued, but not due yet (the dequeue refuses a row whose due
                # time is to come): it waits, no delivery counted.
                ring.finish_dequeue(op.slot, consumed=False, exclusive=exclusive,
                                    due_us=due or 0)
                continue
            # Not there (void) or already consumed: the slot is done.
            ring.finish_stale(op.slot, exclusive=exclusive)
            if state == RowState.QUEUED and seq != op.seq:
                need_resync = True  # an entry the section does not know about
    finally:
        sec.unlock_queue(ring.qidx)
    logger.warning(
        "ringq: queue %s: %d stale section entries repaired from rows", info.name, len(stale)
    )
    if need_resync:
        link.resync(info)


def recover_in_way(link: Link, ring: Ring, info: QueueInfo) -> bool:
    """Decide the slots of dead holders in the queue's way (True if any was)."""
    return help_recover(
        link.section, link.dsn, ring, info.name, owner=link.owner, instance=link.instance
    )
