"""A session's transaction: what is written, and when.

The row writes a session holds (its enqueues', and the consuming writes of
dequeues served from the payload cache) go in one round trip: with the
COMMIT (:meth:`Transaction.commit`), or earlier (:meth:`Transaction.flush`).
A rollback drops them and sends the strikes of its dequeues with the
ROLLBACK. Only once the database has answered is the section told the
outcome (:meth:`Transaction.finish`); a commit whose answer was lost is
decided from the rows (in doubt if they cannot tell).

It works on the slots in flight that the :class:`~._link.Link` holds, and
calls down only: the link, the wire, the rings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from contextlib import suppress
from typing import Any, NoReturn, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from ..driver import wire
from ..driver.errors import (
    InDoubt,
    RingqError,
    RolledBack,
    StaleSection,
    TransactionError,
    one_line,
)
from ..driver.pg import stale_section
from ..ring import (
    POISON_REASON,
    DueWrite,
    Item,
    Op,
    OpKind,
    QueueInfo,
    Ring,
    RowState,
    RowWrite,
    Run,
    Write,
    after_finish,
    each_op,
    finish_batch,
    finish_one,
    finish_run,
)
from ..rows import in_flight
from ..section import layout as L
from ._link import Link

logger = logging.getLogger("ringq.engine")

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

# entries from which a committed run is finished as arrays (below: per slot, as ops)
# (a dequeue run goes as a run at any size: see _per_op)
RUN_VECTOR_FROM = 8  # as the ring's VECTOR_FROM: an 8-entry run measured no dearer as arrays

_INERROR = TransactionStatus.INERROR
_IDLE = TransactionStatus.IDLE
_ENDED_STATES = frozenset({"57P01", "57P02", "57P05", "25P03"})


class WritePlan:
    """The round trip that sends a transaction's held row writes: its
    statements, built by :meth:`Transaction.plan_writes`, read back by
    :meth:`Transaction.apply_writes` (the sync face sends it through
    ``wire.send``, the asyncio face through ``awire.send``)."""

    __slots__ = ("alone", "enqueues", "skip", "statements", "writes")

    def __init__(
        self, writes: Sequence[Item], statements: list[wire.Statement],
        enqueues: list[tuple[int, list[Op]]], alone: bool, skip: int = 0,
    ) -> None:
        # skip: the caller's deferred statements first (``Session.execute(defer=True)``)
        self.writes, self.statements, self.enqueues, self.alone, self.skip = (
            writes, statements, enqueues, alone, skip)


class Transaction:
    """The transaction open on a session's link (one per session, reused)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        # enq_at (us) of the rows the transaction's enqueue writes made, once sent
        self.enq_at_us: int | None = None

    # -- commit -------------------------------------------------------------------

    def commit(
        self, then: Op | None = None, then_stmt: wire.Statement | None = None
    ) -> psycopg.Cursor[Any] | None:
        """Commit in one round trip (see ``Session.commit``); with ``then``
        (a claimed slot whose entry is read from its row: the transaction
        holds no row write and is open), the COMMIT carries ``then_stmt`` in
        a new transaction. Returns its cursor, or None if the COMMIT stood but
        the statement failed (``then`` given back); if the commit fails,
        ``then`` is given back too, without a strike."""
        link = self.link
        if link.tpc_open:
            raise TransactionError("a two-phase transaction is open: use tpc_commit()")
        ops = link.ops
        if link.conn.pgconn.transaction_status == _INERROR:  # libpq's int: nothing made
            self.rollback()
            raise TransactionError("the transaction failed earlier and was rolled back")
        writes = [op for op in ops if op.held]
        cur = None
        try:
            if then is not None:
                assert then_stmt is not None and not writes
                query, params = then_stmt
                cur = link.call(
                    lambda: wire.commit_then(link.conn, query, params), recover=False
                )
            elif writes or link.deferred:
                try:
                    self.send_writes(writes, commit=True)
                except StaleSection as err:
                    self.after_stale(err, writes)
                    raise
            else:
                link.call(link.conn.commit, recover=False)
        except StaleSection:
            raise  # rolled back and resynced already
        except RingqError as err:
            self.commit_failed(err, ops, then)
            return None
        self.committed(ops)
        return cur

    def committed(self, ops: list[Item]) -> None:
        """The database committed ``ops`` (the transaction's): tell the section."""
        self.link.ops = []
        self.finish(ops, committed=True)

    def commit_failed(self, err: RingqError, items: list[Item], then: Op | None) -> None:
        """The commit of ``items`` (and ``then``) raised ``err``: decide what
        that means, tell the section, and raise (or return None when the
        COMMIT stood after all)."""
        link = self.link
        exc = err.__cause__
        # A stale write's rollback ran already (then its resync failed):
        # nothing committed, whatever the error says.
        rolled_back = link.ops is not items
        link.ops = []
        ops = each_op(items)
        lost = link.conn.broken or link.conn.closed or (_answer_lost(exc) and not rolled_back)
        if then is not None and not lost and link.conn.pgconn.transaction_status == _INERROR:
            # The COMMIT went through; the statement after it failed.
            with suppress(RingqError):
                link.call(link.conn.rollback, recover=False)
            self.finish(ops, committed=True)
            self.finish([then], committed=False, count_delivery=False)
            logger.warning("ringq: queue %s: the dequeue sent with a commit failed: %s",
                           then.info.name, exc)
            return
        if lost:
            # The answer may have been lost after the COMMIT ran: a backend
            # terminated during the pipeline can leave psycopg with "cannot
            # exit pipeline mode while busy" (no SQLSTATE) on a connection
            # that does not read as broken yet. Decide from the rows (the
            # slot claimed after the COMMIT, if any, with them: its
            # transaction never committed, so it comes back).
            decided = ops if then is None else [*ops, then]
            backend = (link.backend_pid, link.section.c(link.cidx, L.C_STARTED_NS))
            committed = link.recover(decided, reason=f"commit answer lost: {exc}")
            if committed is None and link.section.lease_ended(link.cidx):
                # past the lease
                committed = False if any(op.kind == OpKind.DEQUEUE for op in ops) else None
            if committed is None:
                raise self.commit_in_doubt(ops, exc, backend) from exc
            if committed:
                logger.warning("ringq: commit answer lost, but the rows show it committed")
                return
            link.record_ops_error(L.ERR_COMMIT_FAILED, ops)
            raise RolledBack.lost(
                "commit failed and was rolled back (the connection was lost; the rows show "
                "nothing of it committed: retry the transaction)",
                exc,
            ) from exc
        # The server refused the commit (deferred constraint, serialization,
        # a row write that failed): rolled back, or to be rolled back when
        # a failed statement kept the COMMIT behind it from running.
        with suppress(RingqError):
            link.call(link.conn.rollback, recover=False)
        self.finish(ops, committed=False)
        if then is not None:
            self.finish([then], committed=False, count_delivery=False)
        if ops:
            link.record_ops_error(L.ERR_COMMIT_FAILED, ops)
        raise err

    def commit_in_doubt(
        self, ops: list[Op], cause: object, backend: tuple[int, int]
    ) -> InDoubt:
        """The commit of ``ops`` lost its answer (``cause``) and the rows do
        not tell whether it ran: counted as an in-doubt error; returns the
        error to raise (``backend``: the lost connection's, as ``InDoubt``)."""
        self.link.record_ops_error(L.ERR_IN_DOUBT, ops)
        return InDoubt(
            f"commit outcome unknown: {one_line(str(cause))}",
            entries=in_flight(ops),
            backend=backend,
        )

    def after_stale(self, err: StaleSection, writes: Sequence[Item]) -> None:
        """A row write of a commit did not match: roll back (no strikes: not
        the entries' fault) and resync the queue's block from the rows."""
        info = self.stale_queue(err, writes)
        self.rollback(count_delivery=False)
        self.resync_stale(info)

    def resync_stale(self, info: QueueInfo) -> None:
        """After the rollback of a stale row write: resync the queue's block."""
        self.link.resync(info)
        logger.warning(
            "ringq: queue %s: stale section (a row write did not match its row): resynced",
            info.name,
        )

    def stale_queue(self, err: StaleSection, writes: Sequence[Item]) -> QueueInfo:
        """The queue whose row write did not match (recorded as our error)."""
        group = [op for op in writes if op.info.name == err.queue] or writes
        self.link.record_ops_error(L.ERR_ROW_MISMATCH, group)
        return group[0].info

    # -- the row writes -------------------------------------------------------------

    def held_writes(self) -> list[Item]:
        """The ops whose row write the session still holds."""
        return [op for op in self.link.ops if op.held]

    def send_writes(self, writes: Sequence[Item], *, commit: bool) -> None:
        """Send the row writes the session holds for ``writes`` in one round
        trip: after a BEGIN if no transaction is open, one statement per
        queue and kind, then the COMMIT if ``commit``. The enqueues' payloads
        stay with their ops (``fill``; a run's ``sent``) for the payload
        cache, with the rows' enqueue time (:attr:`enq_at_us`); delayed
        enqueues get their rows' due times (``Op.due_us``).

        Every write is guarded: a row that does not match makes its statement
        fail (SQLSTATE RQ001), so nothing after it runs; :class:`StaleSection`
        is raised, and the caller rolls the whole transaction back and resyncs.
        """
        link = self.link
        plan = self.plan_writes(writes, commit=commit)
        cursors = link.call(
            lambda: wire.send(link.conn, plan.statements, commit=commit,
                              may_begin=not link.tpc_open, prepared=link.prepared),
            recover=not commit,  # commit() decides itself what a lost answer means
        )
        self.apply_writes(plan, cursors)

    def plan_writes(self, writes: Sequence[Item], *, commit: bool) -> WritePlan:
        """The statements of :meth:`send_writes` (both faces build them here)."""
        link = self.link
        # The caller's deferred statements go first, in this round trip.
        statements: list[wire.Statement] = link.deferred
        link.deferred = []
        skip = len(statements)
        # (index of the statement in statements, its ops) of each enqueue statement
        enqueues: list[tuple[int, list[Op]]] = []
        single = writes[0] if len(writes) == 1 and isinstance(writes[0], Op) else None
        # One row write that is the whole transaction (a commit on an idle
        # connection) goes without the server-side guard: checked here.
        alone = (
            single is not None and commit and not link.tpc_open and not skip
            and link.conn.pgconn.transaction_status == _IDLE and not link.conn.autocommit
        )
        if single is not None:  # a single entry: no grouping
            if single.write is not None:
                enqueues.append((0, [single]))
                statements.append(self._write_statement(single.info.name, [single], alone=alone))
            else:
                statements.append(self._consume_statement(single.info.name, [single], alone=alone))
            by_queue: dict[str, list[Item]] = {}
        else:
            by_queue = _by_key(writes, lambda op: op.info.name) if writes else {}
        for name, group in by_queue.items():
            # held items: an enqueue's is its row write, a dequeue's its consuming write
            enq = [op for op in group if op.kind is OpKind.ENQUEUE]
            if enq:
                statement, due_ops = self._enqueue_statement(name, enq)
                enqueues.append((len(statements), due_ops))
                statements.append(statement)
            consume = [op for op in group if op.kind is not OpKind.ENQUEUE]
            if consume:
                statements.append(self._consume_statement(name, consume))
        link.sent_any = True
        return WritePlan(writes, statements, enqueues, alone, skip)

    def apply_writes(self, plan: WritePlan, cursors: Sequence[wire.Fetch]) -> None:
        """After the round trip of ``plan``: check what came back (a write
        sent alone that found no row is :class:`StaleSection`), and keep with
        the ops what the payload cache and the due times need."""
        link = self.link
        writes, enqueues, alone = plan.writes, plan.enqueues, plan.alone
        cursors = cursors[plan.skip:]  # (the caller's deferred statements' first)
        if alone and not enqueues and cursors[0].fetchone() is None:
            raise stale_section(writes[0].info.name)  # wrote nothing: RQ001's case
        for i, (at, due_ops) in enumerate(enqueues):
            row = cursors[at].fetchone()
            if alone and row is None:
                raise stale_section(writes[0].info.name)
            if i == 0:
                self.enq_at_us = None if row is None else int(row[1])
            if row is not None and len(row) > 2:  # enqueue_due: the rows' due times
                _n, _enq_at, slots, dues, clock_us = row
                link.section.note_db_clock(clock_us)
                due_by = dict(zip(slots or (), dues or (), strict=True))
                for op in due_ops:
                    op.due_us = due_by.get(op.slot, 0)
        for item in writes:
            if isinstance(item, Op):
                item.fill, item.write, item.consume = item.write, None, False
            else:
                item.sent, item.consume = True, False

    def _consume_statement(
        self, queue: str, items: Sequence[Item], *, alone: bool = False
    ) -> wire.Statement:
        """The guarded consuming write of ``items`` (cached dequeues of one
        queue); ``alone``: the whole transaction (see ``send_writes``)."""
        first = items[0]
        if len(items) == 1 and isinstance(first, Op):
            name = "consume_alone" if alone else "consume"
            return self.link.stmt(name, queue), (first.slot, first.seq)
        if len(items) == 1 and isinstance(first, Run):
            span = first.span()
            if span is not None:
                lo, n, offset = span
                return self.link.stmt("consume_span", queue), (lo, lo + n, offset, n)
        slots, seqs = _slots_seqs(items)
        return self.link.stmt("consume_many", queue), (
            wire.int_array(slots), wire.int_array(seqs), len(slots),
        )

    def _enqueue_statement(
        self, queue: str, items: list[Item]
    ) -> tuple[wire.Statement, list[Op]]:
        """The guarded row write of the enqueues ``items`` of one queue, and
        the ops whose due times its answer gives (those of ``enqueue_due``)."""
        if len(items) == 1 and isinstance(items[0], Run):
            run = items[0]
            assert run.payloads is not None
            n = len(run.slots)
            return (self.link.stmt("enqueue_many", queue), (
                run.trace,
                wire.int_array(run.slots.tolist()),
                wire.int_array(run.seqs.tolist()),
                run.payloads,
                wire.text_array([run.producer] * n),
                wire.int_array(range(run.pseq0, run.pseq0 + n)),
                wire.text_array(run.groups or [None] * n),
                n,
            )), []
        ops = each_op(items)
        return self._write_statement(queue, ops), ops

    def _write_statement(
        self, queue: str, ops: list[Op], *, alone: bool = False
    ) -> wire.Statement:
        """The guarded row write of ``ops`` (enqueues of one queue): one
        statement (``enqueue_due`` when an entry has a due time, or entries
        carry trace contexts; one entry due at once: ``enqueue``, with its
        trace context); ``alone``: the whole transaction (see ``send_writes``)."""
        writes = [op.write for op in ops if op.write is not None]
        if len(ops) == 1:
            op = ops[0]
            w = writes[0]
            if type(w) is RowWrite or (
                isinstance(w, DueWrite) and w.delay is None and w.not_before is None
            ):
                return self.link.stmt("enqueue_alone" if alone else "enqueue", queue), (
                    op.seq,
                    w.payload,
                    w.producer,
                    w.producer_seq,
                    w.group,
                    w.trace if isinstance(w, DueWrite) else None,
                    op.slot,
                    op.seq,
                )
        if any(type(w) is DueWrite for w in writes):
            return self.link.stmt("enqueue_due", queue), {
                "slots": wire.int_array(op.slot for op in ops),
                "seqs": wire.int_array(op.seq for op in ops),
                "payloads": [w.payload for w in writes],
                "producers": wire.text_array([w.producer for w in writes]),
                "pseqs": wire.int_array(w.producer_seq for w in writes),
                "groups": wire.text_array([w.group for w in writes]),
                "delays": wire.text_array([_delay(w) for w in writes]),
                "nbs": wire.text_array([_not_before(w) for w in writes]),
                "traces": wire.text_array([_trace(w) for w in writes]),
                "n": len(ops),
            }
        return self.link.stmt("enqueue_many", queue), (
            None,  # no trace context (entries that carry one went to enqueue_due)
            wire.int_array(op.slot for op in ops),
            wire.int_array(op.seq for op in ops),
            [w.payload for w in writes],
            wire.text_array([w.producer for w in writes]),
            wire.int_array(w.producer_seq for w in writes),
            wire.text_array([w.group for w in writes]),
            len(ops),
        )

    # -- rollback -------------------------------------------------------------------

    def rollback(self, *, count_delivery: bool = True, retry_after: float | None = None) -> None:
        """Roll back in one round trip at most (see ``Session.rollback``)."""
        link = self.link
        ops, link.ops = each_op(link.ops), []
        link.deferred = []  # never sent: nothing of them ran
        deq = [op for op in ops if op.kind == OpKind.DEQUEUE] if count_delivery else []
        poisoned: set[tuple[int, int]] = set()
        try:
            if deq:
                poisoned = self._strike(deq, rollback=True, retry_after=retry_after)
            else:
                link.call(link.conn.rollback, recover=False)
        except RingqError as err:
            self.rollback_failed(err, ops)
        self.finish(ops, committed=False, poisoned=poisoned)

    def rollback_failed(self, err: RingqError, ops: list[Op]) -> NoReturn:
        """The rollback of ``ops`` failed with ``err``: decide them from the
        rows on a new connection, and raise."""
        committed = self.link.recover(ops, reason=f"rollback failed: {err.__cause__}")
        if committed is False:
            raise RolledBack.lost(
                "the connection was lost at rollback; the rows show nothing of the "
                "transaction committed",
                err.__cause__ or err,
            ) from err
        raise err

    # -- telling the section ----------------------------------------------------------

    def finish(
        self,
        items: Sequence[Item],
        *,
        committed: bool,
        count_delivery: bool = True,
        poisoned: set[tuple[int, int]] | None = None,
    ) -> None:
        """Tell the section the outcome of ``items`` (the database already decided).

        Not committed, rolled-back dequeues count a delivery (unless
        ``count_delivery`` is false), unless ``poisoned`` is given: the
        strikes were written already, and these (slot, seq) were poisoned.
        A committed run is finished as a run (arrays; a few entries in plain
        ints); anything else per op.
        """
        if not items:
            return
        link = self.link
        sec = link.section
        sec.clear_hold(link.cidx)
        ops: Sequence[Item] = items
        if committed and poisoned is None:
            poisoned = set()
        else:  # per op (a run is finished as arrays only when committed)
            plain = each_op(items)
            ops = plain
            if poisoned is None:
                poisoned = (
                    self._strike([op for op in plain if op.kind == OpKind.DEQUEUE])
                    if count_delivery else set()
                )
        enq_at_us, self.enq_at_us = self.enq_at_us, None
        first = ops[0]
        if len(ops) == 1 and isinstance(first, Op):  # a single entry: one fused finish
            self._finish_one(first, committed, poisoned, enq_at_us)
            return
        # (one item, as a consumer's take: no grouping)
        by_ring = ({first.ring.qidx: [first]} if len(ops) == 1
                   else _by_key(ops, lambda op: op.ring.qidx))
        posts: list[tuple[int, str, int]] = []
        for group in by_ring.values():
            ring = group[0].ring
            wake_r, wake_s = self._finish_in(ring, group, committed, poisoned, enq_at_us)
            if wake_r:
                posts.append((ring.qid, "r", wake_r))
            if wake_s:
                posts.append((ring.qid, "s", wake_s))
        sec.count_client(link.cidx, L.C_N_COMMIT if committed else L.C_N_ROLLBACK)
        for qid, kind, n in posts:
            sec.post(qid, kind, n)

    def _finish_in(
        self, ring: Ring, group: list[Item], committed: bool, poisoned: set[tuple[int, int]],
        enq_at_us: int | None,
    ) -> tuple[int, int]:
        """:meth:`finish` of the items of one queue, under its lock: the
        wake-ups to post (ready, space) once it is released."""
        link = self.link
        sec = link.section
        exclusive = group[0].info.dequeue_mode == "single"
        plain = [op for op in group if isinstance(op, Op)]
        runs = [r for r in group if isinstance(r, Run)]
        if runs and any(_per_op(r) for r in runs):
            # a few entries: per slot costs less than numpy's calls
            plain += each_op([r for r in runs if _per_op(r)])
            runs = [r for r in runs if not _per_op(r)]
        wake_r = wake_s = 0
        sec.lock_queue(ring.qidx)
        try:
            if plain:
                wake_r, wake_s = finish_batch(
                    ring, plain, link.owner, committed=committed, poisoned=poisoned,
                    exclusive=exclusive, enq_at_us=enq_at_us,
                )
            if runs:  # committed (a run is finished as a run only then)
                n_ready = n_space = 0
                for run in runs:
                    r, sp = finish_run(ring, run, link.owner, exclusive=exclusive,
                                       enq_at_us=enq_at_us)
                    n_ready += r
                    n_space += sp
                r, sp = after_finish(ring, n_ready, n_space)
                wake_r += r
                wake_s += sp
        finally:
            sec.unlock_queue(ring.qidx)
        return wake_r, wake_s

    def _finish_one(
        self, op: Op, committed: bool, poisoned: set[tuple[int, int]], enq_at_us: int | None
    ) -> None:
        """:meth:`finish` of a single op: one lock round, the fused finish."""
        link = self.link
        sec = link.section
        ring = op.ring
        qidx = ring.qidx
        sec.lock_queue(qidx)
        try:
            wake_r, wake_s = finish_one(
                ring, op, link.owner, committed=committed, poisoned=poisoned,
                exclusive=op.info.dequeue_mode == "single", enq_at_us=enq_at_us,
            )
        finally:
            sec.unlock_queue(qidx)
        sec.count_client(link.cidx, L.C_N_COMMIT if committed else L.C_N_ROLLBACK)
        if wake_r:
            sec.post(ring.qid, "r", wake_r)
        if wake_s:
            sec.post(ring.qid, "s", wake_s)

    def hold(self, items: Sequence[Item]) -> None:
        """Keep slots locked with no live owner (in doubt) for recovery to decide."""
        sec = self.link.section
        for op in each_op(items):
            sec.lock_queue(op.ring.qidx)
            try:
                op.ring.hold(op.slot)
            finally:
                sec.unlock_queue(op.ring.qidx)

    def _strike(
        self, deq_ops: list[Op], *, rollback: bool = False, retry_after: float | None = None
    ) -> set[tuple[int, int]]:
        """Count a failed delivery on each rolled-back dequeue; returns the poisoned ones.

        One round trip: the ROLLBACK of the open transaction (with
        ``rollback``; else the transaction has ended already), then one
        strike statement per queue, in autocommit (and, with ``retry_after``,
        one ``retry_after`` statement per queue: that delay wins over the
        queue's backoff). An entry that comes back with a due time gets it
        in its op (``due_us``), for the section.

        :raises RingqError: with ``rollback`` only, when the connection was
            lost (recovery decides the slots); a strike that fails otherwise
            is logged and skipped.
        """
        if not deq_ops:
            return set()
        link = self.link
        plan = self.strike_plan(deq_ops, retry_after)
        try:
            # ROLLBACK (if a transaction is open) and, after it, each queue's
            # strike in autocommit: one round trip.
            cursors = link.call(lambda: wire.rollback_then(link.conn, plan[1]), recover=False)
        except RingqError as err:
            return self.strike_failed(err, rollback=rollback)
        return self.strike_apply(deq_ops, plan, cursors)

    def strike_plan(
        self, deq_ops: list[Op], retry_after: float | None
    ) -> tuple[dict[str, list[Op]], list[wire.Statement]]:
        """The strike statements of :meth:`_strike` (both faces build them here)."""
        link = self.link
        by_queue: dict[str, list[Op]] = {}
        for op in deq_ops:
            by_queue.setdefault(op.info.name, []).append(op)
        statements: list[wire.Statement] = []
        for name, group in by_queue.items():
            info = group[0].info
            params = {
                "max_deliveries": info.max_deliveries,
                "slots": [op.slot for op in group],
                "seqs": [op.seq for op in group],
                "queue_id": info.id,
                "reason": POISON_REASON,
            }
            statements.append((link.stmt("strike", name), params))
        if retry_after is not None:
            for name, group in by_queue.items():
                statements.append((link.stmt("retry_after", name), (
                    retry_after, wire.int_array(op.slot for op in group),
                    wire.int_array(op.seq for op in group),
                )))
        return by_queue, statements

    def strike_failed(self, err: RingqError, *, rollback: bool) -> set[tuple[int, int]]:
        """The strikes' round trip failed: with ``rollback``, a lost connection
        is raised (the ROLLBACK may not have run: the caller recovers);
        otherwise nothing is poisoned."""
        link = self.link
        if rollback and (link.conn.broken or link.conn.closed):
            raise err
        # Losing a strike is harmless: the entry is redelivered; the
        # monitor counts strikes of clients that die.
        logger.warning("ringq: could not record a failed delivery", exc_info=err)
        return set()

    def strike_apply(
        self, deq_ops: list[Op], plan: tuple[dict[str, list[Op]], list[wire.Statement]],
        cursors: Sequence[wire.Fetch],
    ) -> set[tuple[int, int]]:
        """After the strikes' round trip: which entries were poisoned, and the
        due times of those that come back later."""
        link = self.link
        by_queue = plan[0]
        poisoned: set[tuple[int, int]] = set()
        due_by: dict[tuple[int, int, int], int] = {}  # (queue id, slot, seq) -> due us
        sec = link.section
        for (name, group_ops), cur in zip(by_queue.items(), cursors, strict=False):
            qid = group_ops[0].info.id
            for (slot, seq, state, deliveries, moved_to, kept_because, group, due_us,
                 clock_us) in cur.fetchall():
                if due_us:
                    due_by[(qid, slot, seq)] = due_us
                    sec.note_db_clock(clock_us)
                if state == RowState.CONSUMED:
                    poisoned.add((slot, seq))
                    logger.warning(
                        "ringq: entry %s/%s%s poisoned after %s deliveries: "
                        "moved to ringq.exceptions%s",
                        name,
                        seq,
                        "" if group is None else f" (group {group!r}, which goes on without it)",
                        deliveries,
                        f" and queue {moved_to}"
                        if moved_to
                        else f" only ({kept_because})"
                        if kept_because
                        else "",
                    )
        for (_name, group_ops), cur in zip(by_queue.items(), cursors[len(by_queue):],
                                           strict=False):
            qid = group_ops[0].info.id
            for slot, seq, due_us, clock_us in cur.fetchall():
                due_by[(qid, slot, seq)] = due_us
                sec.note_db_clock(clock_us)
        if due_by:
            for op in deq_ops:
                op.due_us = due_by.get((op.info.id, op.slot, op.seq), 0)
        return poisoned


def _per_op(run: Run) -> bool:
    """Whether a committed run is finished per op: an enqueue run of a few
    entries (as arrays, numpy's calls cost more); a dequeue run is finished
    as a run at any size (a few entries in plain ints: ``finish_run``)."""
    return run.kind is OpKind.ENQUEUE and len(run) < RUN_VECTOR_FROM


def _by_key(ops: Sequence[T], key: Callable[[T], K]) -> dict[K, list[T]]:
    """``ops`` grouped by ``key``, in order; a transaction's ops usually
    share one queue: then one comparison per op."""
    first = key(ops[0])
    if all(key(op) == first for op in ops):
        return {first: list(ops)}
    groups: dict[K, list[T]] = {}
    for op in ops:
        groups.setdefault(key(op), []).append(op)
    return groups


def _slots_seqs(items: Sequence[Item]) -> tuple[list[int], list[int]]:
    """The slots and seqs of ``items`` (ops and runs), in order."""
    slots: list[int] = []
    seqs: list[int] = []
    for i in items:
        if isinstance(i, Op):
            slots.append(i.slot)
            seqs.append(i.seq)
        else:
            slots.extend(i.slots.tolist())
            seqs.extend(i.seqs.tolist())
    return slots, seqs


def _delay(w: Write) -> str | None:
    """A write's delay (seconds) as an array element (None: none)."""
    return repr(w.delay) if type(w) is DueWrite and w.delay is not None else None


def _not_before(w: Write) -> str | None:
    """A write's not_before as an array element (None: none)."""
    return w.not_before.isoformat() if type(w) is DueWrite and w.not_before is not None else None


def _trace(w: Write) -> str | None:
    """A write's trace context as an array element (None: none)."""
    return w.trace if type(w) is DueWrite else None


def _answer_lost(exc: BaseException | None) -> bool:
    """Whether ``exc``, raised by a commit, leaves its outcome unknown: no
    verdict of the server (a client-side error, no SQLSTATE), or the server
    ended the connection (admin or crash shutdown, a session timeout, a
    connection exception: SQLSTATE class 08), perhaps after the COMMIT ran."""
    state = getattr(exc, "sqlstate", None)
    return state is None or state in _ENDED_STATES or state.startswith("08")
