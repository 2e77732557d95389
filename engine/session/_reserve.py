"""Reservations: the slots a session's enqueues take at a ring's head
(waiting for room as the queue's policy says), each leaving its row write
with the transaction (a keyed enqueue writes at once); the transaction
finishes them. The dequeue side is :mod:`._claim`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime

import numpy as np
import posix_ipc
from psycopg.pq import TransactionStatus

from ..driver import QUERIES as _Q
from ..driver.errors import (
    BehindSqlPuts,
    PayloadTooLarge,
    QueueFull,
    SectionError,
    TransactionError,
)
from ..ring import DueWrite, Op, OpKind, QueueInfo, Ring, RowWrite, Run, Write, group_tag
from ..section import layout as L
from ._claim import Due, recover_in_way, unwait
from ._link import Link
from ._validate import (
    as_groups,
    as_payload,
    as_payloads,
    check_due,
    check_group,
    check_key,
    check_trace,
    check_wait,
)

logger = logging.getLogger("ringq.engine")

_INERROR = TransactionStatus.INERROR
_AT_ONCE: Due = (None, None)  # no delay, no not_before

# An enqueuer waiting for room looks again this often, in seconds: a commit
# that frees slots posts the space semaphore, a reclaim by the monitor does not.
ROOM_RECHECK_S = 0.5


class WouldBlock(Exception):
    """An enqueue found its queue full and would wait for room (or recover a
    dead holder in its way): raised, with nothing reserved, only where
    :attr:`Reservations.nonblocking` is set (the asyncio face, which then
    waits on its event loop and calls again).

    ``wait``: the seconds the sync face would wait in all (the timeout, or
    the queue's full_timeout; 0 under the 'raise' policy). ``waiting``: the
    caller is registered as a waiter for space (in the same critical section
    as the failed reservation, so a commit right after cannot miss it) and
    must undo that (:func:`~._claim.unwait`) once it stops waiting."""

    def __init__(self, info: QueueInfo, ring: Ring, wait: float, waiting: bool) -> None:
        super().__init__(f"queue {info.name!r} is full")
        self.info, self.ring, self.wait, self.waiting = info, ring, wait, waiting


class Reservations:
    """A session's enqueues over the rings of its link."""

    def __init__(self, link: Link) -> None:
        self.link = link
        # set by the asyncio face around its attempts: a full queue raises
        # WouldBlock rather than wait, and a batch takes room for all its
        # entries or none (so nothing is kept while the loop waits)
        self.nonblocking = False

    def check_payload(self, info: QueueInfo, payload: bytes) -> None:
        """:raises PayloadTooLarge: over the queue's max_payload (recorded)."""
        if len(payload) > info.max_payload:
            self.link.record_error(L.ERR_PAYLOAD_TOO_LARGE, info.id)
            raise PayloadTooLarge(
                f"payload of {len(payload):,} bytes exceeds queue {info.name!r} "
                f"max_payload {info.max_payload:,}",
                queue=info.name,
            )

    def check_not_failed(self) -> None:
        """An enqueue sends nothing: refuse it here if the transaction failed
        already (its commit would only roll back)."""
        # libpq's int: no objects made per call
        if self.link.conn.pgconn.transaction_status == _INERROR:
            raise TransactionError("the transaction failed earlier: roll it back")

    def enqueue_checked(
        self, queue: str, payload: object, key: str | None, group: str | None,
        timeout: float | None, delay: float | None, not_before: datetime | None,
        trace: str | None = None,
    ) -> int:
        """``Session.enqueue``'s arguments checked (before any I/O), then
        :meth:`enqueue` (or :meth:`enqueue_key` with a ``key``) after the
        checks of the payload's size and of the transaction. ``trace``: the
        entry's trace context (beside the payload, not counted in its size)."""
        if (type(payload) is bytes and key is None and group is None and timeout is None
                and delay is None and not_before is None and trace is None):
            # the usual call: nothing to check but the payload's size
            t0 = time.perf_counter_ns()
            info = self.link.info(queue)
            if len(payload) > info.max_payload:
                self.check_payload(info, payload)
            self.check_not_failed()
            return self.enqueue(info, payload, None, 0, None, t0)
        data = as_payload(payload)
        check_key(key)
        check_group(group)
        check_wait("timeout", timeout)
        check_trace(trace)
        due = _due(delay, not_before)
        t0 = time.perf_counter_ns()
        info = self.link.info(queue)
        self.check_payload(info, data)
        self.check_not_failed()
        tag = group_tag(group)
        if key is None:
            return self.enqueue(info, data, group, tag, timeout, t0, due, trace)
        return self.enqueue_key(info, data, key, group, tag, timeout, t0, due, trace)

    def enqueue(
        self, info: QueueInfo, payload: bytes, group: str | None, tag: int,
        timeout: float | None, t0: int, due: Due | None = None, trace: str | None = None,
    ) -> int:
        """Reserve a slot and hold its row write for the commit; returns its seq."""
        link = self.link
        ring = link.ring(info)
        # The lean path: one lock round; the generic one (waiting for room,
        # recovery of a dead holder in the way) only when the ring is full.
        sec = link.section
        sec.lock_queue(ring.qidx)
        try:
            got = ring.reserve(link.owner, link.backend_pid, tag)
        finally:
            sec.unlock_queue(ring.qidx)
        slot, seq = got if got is not None else self._reserve(info, timeout, tag)
        link.producer_seq += 1
        write: Write = (
            RowWrite(payload, link.producer_seq, link.producer, group)
            if due is None and trace is None
            else DueWrite(payload, link.producer_seq, link.producer, group,
                          *(due or _AT_ONCE), trace)
        )
        link.ops.append(
            Op(ring, info, slot, seq, OpKind.ENQUEUE, time.perf_counter_ns() - t0, write)
        )
        sec.count_client(link.cidx, L.C_N_ENQ)
        return seq

    def enqueue_key(
        self, info: QueueInfo, payload: bytes, key: str, group: str | None, tag: int,
        timeout: float | None, t0: int, due: Due | None = None, trace: str | None = None,
    ) -> int:
        """Reserve a slot and write its row with ``key`` now; returns its seq,
        or the seq of the entry that holds ``key`` already."""
        link = self.link
        queue = info.name
        for _attempt in range(8):
            slot, seq = self._reserve(info, timeout, tag)
            link.producer_seq += 1
            op = Op(link.ring(info), info, slot, seq, OpKind.ENQUEUE)
            link.ops.append(op)
            row = link.execute(
                link.stmt("enqueue_key", queue),
                {
                    "queue_id": info.id,
                    "key": key,
                    "seq": seq,
                    "payload": payload,
                    "producer": link.producer,
                    "producer_seq": link.producer_seq,
                    "group": group,
                    "slot": slot,
                    "delay": None if due is None else due[0],
                    "not_before": None if due is None else due[1],
                    "trace": trace,
                },
                queue=queue,
                qid=info.id,
                seq=seq,
            ).fetchone()
            assert row is not None
            inserted, updated, existing, due_us, clock_us = row
            link.section.note_db_clock(clock_us)
            op.due_us = due_us or 0
            if inserted == 0 and existing is None:
                # Another transaction held the key uncommitted; the
                # INSERT waited for its commit, but under READ
                # COMMITTED this statement's snapshot predates it:
                # read the key again (a new statement, a new snapshot).
                again = link.execute(
                    _Q["key_seq"], (info.id, key), queue=queue, qid=info.id, seq=seq
                ).fetchone()
                existing = None if again is None else again[0]
            if inserted == 1 and updated == 0:
                link.execute(
                    _Q["key_forget"], (info.id, key, seq), queue=queue, qid=info.id, seq=seq
                )
            if inserted == 1 and updated == 1:
                op.latency_ns = time.perf_counter_ns() - t0
                link.section.count_client(link.cidx, L.C_N_ENQ)
                return seq
            link.ops.remove(op)
            self._void(op)
            if existing is not None and not (inserted == 1 and updated == 0):
                return int(existing)  # idempotent repeat: the first entry's sequence
            # The section was stale: the row holds something newer. Re-read the queue.
            link.record_error(L.ERR_ROW_MISMATCH, info.id, seq)
            link.resync(info)
        raise SectionError(
            f"queue {queue!r}: could not reserve a slot after 8 attempts (section unstable)"
        )

    def enqueue_many_checked(
        self, queue: str, payloads: object, group: object, timeout: float | None,
        delay: float | None, not_before: datetime | None, trace: str | None = None,
    ) -> list[int]:
        """``Session.enqueue_many``'s arguments checked (before any I/O), then
        :meth:`enqueue_many` after the checks of each payload's size and of
        the transaction, with the groups' tags."""
        items = as_payloads(payloads)
        groups = as_groups(group, len(items))
        check_wait("timeout", timeout)
        check_trace(trace)
        due = _due(delay, not_before)
        t0 = time.perf_counter_ns()
        info = self.link.info(queue)
        limit = info.max_payload
        for p in items:
            if len(p) > limit:
                self.check_payload(info, p)
        if not items:
            return []
        self.check_not_failed()
        tags = None if groups is None else [group_tag(g) for g in groups]
        return self.enqueue_many(info, items, groups, tags, timeout, t0, due, trace)

    def enqueue_many(
        self, info: QueueInfo, items: list[bytes], groups: list[str | None] | None,
        tags: list[int] | None, timeout: float | None, t0: int, due: Due | None = None,
        trace: str | None = None,
    ) -> list[int]:
        """Reserve a slot for each of ``items`` and hold their row writes:
        one :class:`~._ops.Run` (entries due later: an op each; one entry:
        :meth:`enqueue`'s op, whose commit sends the one-row statement where a
        run's sends the arrays' one: on an SQL enqueue's way through the
        monitor's pump, a batch of one, that was bench_sql's "SQL enqueue ->
        linked consumer" step)."""
        if len(items) == 1:
            return [self.enqueue(info, items[0], None if groups is None else groups[0],
                                 0 if tags is None else tags[0], timeout, t0, due, trace)]
        link = self.link
        ring = link.ring(info)
        chunks: list[tuple[int, int]] = []  # (first seq, how many): contiguous reservations
        done = 0
        try:
            while done < len(items):
                first, k = self._reserve_many(
                    info, len(items) - done, timeout, None if tags is None else tags[done:],
                )
                chunks.append((first, k))
                done += k
        except BaseException:
            for first, k in chunks:
                for seq in range(first, first + k):
                    self._void(Op(ring, info, seq % ring.cap, seq, OpKind.ENQUEUE))
            raise
        pseq = link.producer_seq
        link.producer_seq += len(items)
        lat = (time.perf_counter_ns() - t0) // len(items)
        if len(chunks) == 1:
            first, k = chunks[0]
            seqs = np.arange(first, first + k, dtype=np.int64)
        else:
            seqs = np.concatenate(
                [np.arange(first, first + k, dtype=np.int64) for first, k in chunks]
            )
        link.section.count_client(link.cidx, L.C_N_ENQ, len(items))
        if due is None:
            link.ops.append(Run(
                ring, info, OpKind.ENQUEUE, seqs % ring.cap, seqs, lat, list(items),
                link.producer, pseq + 1, groups, trace=trace,
            ))
            return seqs.tolist()
        seq_list = seqs.tolist()
        link.ops.extend([
            Op(ring, info, seq % ring.cap, seq, OpKind.ENQUEUE, latency_ns=lat,
               write=DueWrite(payload, pseq + i, link.producer,
                              None if groups is None else groups[i - 1], *due, trace))
            for i, (seq, payload) in enumerate(zip(seq_list, items, strict=True), start=1)
        ])
        return seq_list

    def _reserve(self, info: QueueInfo, timeout: float | None, tag: int) -> tuple[int, int]:
        first, _k = self._reserve_many(info, 1, timeout, (tag,) if tag else None)
        return first % self.link.ring(info).cap, first

    def _reserve_many(
        self, info: QueueInfo, n: int, timeout: float | None, tags: Sequence[int] | None = None
    ) -> tuple[int, int]:
        """Reserve up to ``n`` slots (at least one, waiting for room as the
        queue's policy says), the i-th for group tag ``tags[i]`` (None: no
        groups). Returns (first seq, how many): the slots are the seqs
        modulo the capacity."""
        link = self.link
        ring = link.ring(info)
        sec = link.section
        wait = info.full_timeout if timeout is None else timeout
        if info.full_policy == "raise" and timeout is None:
            wait = 0.0
        deadline = time.monotonic() + wait
        waiting = False
        # Where the caller waits on its own, a batch the ring could hold is
        # reserved whole or not at all (one larger than the ring can never be
        # held whole: it goes in parts, as here, and ends in QueueFull).
        whole = self.nonblocking and n <= ring.cap
        while True:
            sec.lock_queue(ring.qidx)
            try:
                if waiting:
                    ring.remove_waiter(OpKind.ENQUEUE)
                    waiting = False
                if link.behind_sql_puts and ring.Q[ring.qb + L.Q_SQL_PUTS] > 0:
                    # checked under the queue's lock the agent reserves under
                    raise BehindSqlPuts(f"queue {info.name!r} has slots reserved for SQL "
                                        "producers", queue=info.name)
                first, k = ring.reserve_many(
                    link.owner, link.backend_pid, n, tags[:n] if tags else None, whole=whole
                )
                self_blocked = False
                if not k:
                    ring.note_full()
                    # The ring frees slots only in order: if the oldest busy
                    # slot is our own uncommitted reservation, waiting can
                    # never succeed (we would wait on ourselves).
                    _e, _d, locked, holder = ring.bits(ring.tail % ring.cap)
                    self_blocked = locked and holder == link.owner
                    remaining = deadline - time.monotonic()
                    if remaining > 0 and not self_blocked:
                        ring.add_waiter(OpKind.ENQUEUE)
                        waiting = True
            finally:
                sec.unlock_queue(ring.qidx)
            if k:
                return first, k
            if self.nonblocking and not self_blocked:
                # The asyncio face: no waiting (nor recovery) here; it waits
                # on its loop, registered still, and calls again (nothing kept).
                raise WouldBlock(info, ring, wait, waiting)
            try:
                if not self_blocked and recover_in_way(self.link, ring, info):
                    continue  # a dead holder's slots were decided: try again now
            except BaseException:
                if waiting:
                    unwait(self.link, ring, OpKind.ENQUEUE)
                raise
            if not waiting:
                raise self.queue_full(info, ring, wait, self_blocked=self_blocked)
            try:
                sec.semaphore(info.id, "s").acquire(min(remaining, ROOM_RECHECK_S))
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass  # timed out or a signal: look again (a reclaim by the monitor posts nothing)
            except BaseException:
                unwait(self.link, ring, OpKind.ENQUEUE)
                raise

    def queue_full(
        self, info: QueueInfo, ring: Ring, wait: float, *, self_blocked: bool = False
    ) -> QueueFull:
        """The error of a reservation that found no room within ``wait``
        seconds (recorded), for both faces (the asyncio one waits on its loop)."""
        self.link.record_error(L.ERR_QUEUE_FULL, info.id, ring.head)
        if self_blocked:
            return QueueFull(
                f"queue {info.name!r} is full ({info.capacity:,} slots) "
                "and its oldest slot is held by this transaction: "
                "commit or roll back (or raise the capacity); waiting cannot help",
                queue=info.name,
            )
        return QueueFull(
            f"queue {info.name!r} is full ({info.capacity:,} slots)"
            + (f" after waiting {wait:g}s" if wait else ""),
            queue=info.name,
        )

    def _void(self, op: Op) -> None:
        sec = self.link.section
        sec.lock_queue(op.ring.qidx)
        try:
            if op.ring.held_by(op.slot, self.link.owner):
                op.ring.finish_enqueue(op.slot, committed=False)
        finally:
            sec.unlock_queue(op.ring.qidx)

    # -- dequeue -----------------------------------------------------------------------


def _due(delay: float | None, not_before: datetime | None) -> Due | None:
    """(delay, not_before) checked, or None: due at once (the common case, no check)."""
    if delay is None and not_before is None:
        return None
    return check_due(delay, not_before)
