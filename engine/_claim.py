"""Claims and reservations: which slots a session takes, and the section and
payload-cache work for them.

An enqueue reserves slots at the ring's head (waiting for room as the
queue's policy says) and leaves its row write with the transaction; a
dequeue claims ready slots from the tail, each served from its payload cache
record when that holds the entry, else read from its row. Nothing found: a
dead holder in the queue's way is recovered (``_recovery.help_recover``).

:class:`Claims` works on the session's :class:`~._link.Link` and adds the
slots it takes to the link's ops in flight; the transaction finishes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

import posix_ipc
import psycopg
from psycopg.pq import TransactionStatus

from . import _layout as L
from . import _wire
from ._cache import Cached
from ._errors import PayloadTooLarge, QueueFull, SectionError, TransactionError
from ._link import Link
from ._message import Message, cached_message
from ._ops import DueWrite, Op, OpKind, RowState, RowWrite, Write
from ._queries import QUERIES as _Q
from ._queue_info import QueueInfo
from ._recovery import help_recover
from ._ring import Ring, group_tag
from ._transaction import Transaction

logger = logging.getLogger("ringq.engine")

_INERROR = TransactionStatus.INERROR
_INTRANS = TransactionStatus.INTRANS

Due = tuple[float | None, datetime | None]  # (delay s, not_before), as _validate.check_due

# A waiting dequeuer is woken by the commit that makes an entry ready (a
# semaphore post); it also looks again this often, in seconds, as a safety net.
CLAIM_RECHECK_S = 1.0

_TIMEZONES: dict[bytes | None, tzinfo] = {}

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


class Claims:
    """A session's enqueues and dequeues over the rings of its link."""

    def __init__(self, link: Link) -> None:
        self.link = link

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

    # -- enqueue -----------------------------------------------------------------------

    def enqueue_checked(
        self, info: QueueInfo, payload: bytes, key: str | None, group: str | None,
        timeout: float | None, t0: int, due: Due | None = None,
    ) -> int:
        """:meth:`enqueue` (or :meth:`enqueue_key` with a ``key``) after the
        checks of the payload's size and of the transaction; ``due``: (delay,
        not_before) as ``check_due`` gave them (None: at once)."""
        self.check_payload(info, payload)
        self.check_not_failed()
        tag = group_tag(group)
        if key is None:
            return self.enqueue(info, payload, group, tag, timeout, t0, due)
        return self.enqueue_key(info, payload, key, group, tag, timeout, t0, due)

    def enqueue(
        self, info: QueueInfo, payload: bytes, group: str | None, tag: int,
        timeout: float | None, t0: int, due: Due | None = None,
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
            if due is None
            else DueWrite(payload, link.producer_seq, link.producer, group, *due)
        )
        link.ops.append(
            Op(ring, info, slot, seq, OpKind.ENQUEUE, time.perf_counter_ns() - t0, write)
        )
        sec.count_client(link.cidx, L.C_N_ENQ)
        return seq

    def enqueue_key(
        self, info: QueueInfo, payload: bytes, key: str, group: str | None, tag: int,
        timeout: float | None, t0: int, due: Due | None = None,
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
        self, info: QueueInfo, items: list[bytes], groups: list[str | None] | None,
        timeout: float | None, t0: int, due: Due | None = None,
    ) -> list[int]:
        """:meth:`enqueue_many` after the checks of each payload's size and
        of the transaction, with the groups' tags."""
        limit = info.max_payload
        for p in items:
            if len(p) > limit:
                self.check_payload(info, p)
        if not items:
            return []
        self.check_not_failed()
        tags = None if groups is None else [group_tag(g) for g in groups]
        return self.enqueue_many(info, items, groups, tags, timeout, t0, due)

    def enqueue_many(
        self, info: QueueInfo, items: list[bytes], groups: list[str | None] | None,
        tags: list[int] | None, timeout: float | None, t0: int, due: Due | None = None,
    ) -> list[int]:
        """Reserve a slot for each of ``items`` and hold their row writes."""
        link = self.link
        ring = link.ring(info)
        reserved: list[tuple[int, int]] = []
        try:
            while len(reserved) < len(items):
                reserved.extend(
                    self._reserve_many(
                        info, len(items) - len(reserved), timeout,
                        None if tags is None else tags[len(reserved):],
                    )
                )
        except BaseException:
            for slot, seq in reserved:
                self._void(Op(ring, info, slot, seq, OpKind.ENQUEUE))
            raise
        pseq = link.producer_seq
        link.producer_seq += len(items)
        lat = (time.perf_counter_ns() - t0) // len(items)
        ops = [
            Op(
                ring,
                info,
                slot,
                seq,
                OpKind.ENQUEUE,
                latency_ns=lat,
                write=RowWrite(
                    payload, pseq + i, link.producer, None if groups is None else groups[i - 1]
                ),
            )
            for i, ((slot, seq), payload) in enumerate(zip(reserved, items, strict=True), start=1)
        ]
        if due is not None:
            for op in ops:
                w = op.write
                assert w is not None
                op.write = DueWrite(w.payload, w.producer_seq, w.producer, w.group, *due)
        link.ops.extend(ops)
        link.section.count_client(link.cidx, L.C_N_ENQ, len(ops))
        return [op.seq for op in ops]

    def _reserve(self, info: QueueInfo, timeout: float | None, tag: int) -> tuple[int, int]:
        got = self._reserve_many(info, 1, timeout, (tag,) if tag else None)
        return got[0]

    def _reserve_many(
        self, info: QueueInfo, n: int, timeout: float | None, tags: Sequence[int] | None = None
    ) -> list[tuple[int, int]]:
        """Reserve up to ``n`` slots (at least one, waiting for room as the
        queue's policy says), the i-th for group tag ``tags[i]`` (None: no groups)."""
        link = self.link
        ring = link.ring(info)
        sec = link.section
        wait = info.full_timeout if timeout is None else timeout
        if info.full_policy == "raise" and timeout is None:
            wait = 0.0
        deadline = time.monotonic() + wait
        waiting = False
        while True:
            got: list[tuple[int, int]] = []
            sec.lock_queue(ring.qidx)
            try:
                if waiting:
                    ring.remove_waiter(OpKind.ENQUEUE)
                    waiting = False
                first, k = ring.reserve_many(
                    link.owner, link.backend_pid, n, tags[:n] if tags else None
                )
                cap = ring.cap
                got = [((first + i) % cap, first + i) for i in range(k)]
                self_blocked = False
                if not got:
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
            if got:
                return got
            try:
                if not self_blocked and _recover_in_way(self.link, ring, info):
                    continue  # a dead holder's slots were decided: try again now
            except BaseException:
                if waiting:
                    self._unwait(ring, OpKind.ENQUEUE)
                raise
            if not waiting:
                link.record_error(L.ERR_QUEUE_FULL, info.id, ring.head)
            if self_blocked:
                raise QueueFull(
                    f"queue {info.name!r} is full ({info.capacity:,} slots) "
                    "and its oldest slot is held by this transaction: "
                    "commit or roll back (or raise the capacity); waiting cannot help",
                    queue=info.name,
                )
            if not waiting:
                raise QueueFull(
                    f"queue {info.name!r} is full ({info.capacity:,} slots)"
                    + (f" after waiting {wait:g}s" if wait else ""),
                    queue=info.name,
                )
            try:
                sec.semaphore(info.id, "s").acquire(min(remaining, 0.5))
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass  # timed out or a signal: look again (a reclaim by the monitor posts nothing)
            except BaseException:
                self._unwait(ring, OpKind.ENQUEUE)
                raise

    def _void(self, op: Op) -> None:
        sec = self.link.section
        sec.lock_queue(op.ring.qidx)
        try:
            if op.ring.held_by(op.slot, self.link.owner):
                op.ring.finish_enqueue(op.slot, committed=False)
        finally:
            sec.unlock_queue(op.ring.qidx)

    # -- dequeue -----------------------------------------------------------------------

    def dequeue_many(
        self, info: QueueInfo, max_n: int, deadline: float | None, t0: int
    ) -> list[Message]:
        """Take up to ``max_n`` ready entries (oldest first) in one statement."""
        link = self.link
        queue = info.name
        ring = link.ring(info)
        exclusive = info.dequeue_mode == "single"
        holding = any(op.kind is OpKind.DEQUEUE for op in link.ops)
        for _attempt in range(64):
            slots, seqs, cached = self.claim(ring, info, max_n, deadline, exclusive)
            if not slots:
                return []
            if not holding:  # the queue's lease runs from the transaction's first entry
                link.section.note_hold(link.cidx)
                holding = True
            if cached is not None and None not in cached:
                # All served from the payload cache: the consuming writes wait for the commit.
                lat = (time.perf_counter_ns() - t0) // len(slots)
                dq = OpKind.DEQUEUE
                link.ops.extend([
                    Op(ring, info, slot, seq, dq, lat, None, None, True, c[3])
                    for slot, seq, c in zip(slots, seqs, cached, strict=True)
                    if c is not None
                ])
                link.section.count_client(link.cidx, L.C_N_DEQ, len(slots))
                tz = conn_timezone(link.conn)
                return [
                    cached_message(queue, seq, c, tz)
                    for seq, c in zip(seqs, cached, strict=True)
                    if c is not None
                ]
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
            row = link.execute(
                link.stmt("dequeue", queue), (ops[0].slot, ops[0].seq),
                binary=True, queue=queue, qid=info.id, seq=ops[0].seq,
            ).fetchone()
            rows = [] if row is None else [(ops[0].slot, ops[0].seq, *row)]
        else:
            rows = link.execute(
                link.stmt("dequeue_many", queue),
                (_wire.int_array(op.slot for op in ops), _wire.int_array(op.seq for op in ops)),
                binary=True,
                queue=queue,
                qid=info.id,
                seq=ops[0].seq,
            ).fetchall()
        got = {r[0]: r for r in rows}
        lat = (time.perf_counter_ns() - t0) // len(ops)
        stale = [op for op in ops if op.slot not in got]
        if stale:
            repair_dequeue(link, info, ring, stale, exclusive)
        messages = []
        tz = conn_timezone(link.conn)
        for slot, seq, c in zip(slots, seqs, cached, strict=True):
            if c is not None:
                messages.append(cached_message(queue, seq, c, tz))
            elif slot in got:
                _slot, seq, payload, producer, pseq, enq_at, deliveries, group = got[slot]
                messages.append(
                    Message(queue, seq, bytes(payload), producer, pseq, enq_at,
                            deliveries + 1, group)
                )
        for op in ops:
            op.latency_ns = lat
            r = got.get(op.slot)
            if r is not None:
                op.enq_us = _us(r[5])
        return messages

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
        ):
            txn.commit()
            return None
        t0 = time.perf_counter_ns()
        slots, seqs, cached_list = self.claim(ring, info, 1, None, exclusive)
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
        payload, producer, pseq, enq_at, deliveries, group = row
        op.enq_us = _us(enq_at)
        return (Message(queue, seq, bytes(payload), producer, pseq, enq_at, deliveries + 1, group),)

    def claim(
        self, ring: Ring, info: QueueInfo, max_n: int, deadline: float | None, exclusive: bool
    ) -> tuple[list[int], list[int], list[Cached | None] | None]:
        """Claim up to ``max_n`` ready slots: their slots, seqs and, in a
        queue with a payload cache, each one's record if it holds the entry
        (read under the queue lock; None: read the row), else None.

        A waiter registers with how many entries it wants, so a commit wakes
        as many as its entries make work for; woken, it looks at the bitmaps
        without the lock first, and if another took the entries it sleeps
        again, still registered, without a lock round."""
        link = self.link
        sec = link.section
        waiting = False
        sem = None
        qidx = ring.qidx
        while True:
            cached: list[Cached | None] | None = None
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
                    sl, sq = ring.claim_batch(
                        link.owner, link.backend_pid, max_n, exclusive=exclusive
                    )
                    if sl.size and ring.stride:
                        cached = ring.cache.get_many(sl, sq)
                    slots, seqs = sl.tolist(), sq.tolist()
                if not slots:
                    ring.note_empty()
                    if deadline is not None and deadline > time.monotonic():
                        # Registered inside the same critical section as the
                        # failed scan, so a commit right after cannot miss us.
                        ring.add_waiter(OpKind.DEQUEUE, max_n)
                        waiting = True
            finally:
                sec.unlock_queue(qidx)
            if slots:
                return slots, seqs, cached
            try:
                if _recover_in_way(self.link, ring, info):
                    continue  # a dead holder's slots were decided: look again now
            except BaseException:
                if waiting:
                    self._unwait(ring, OpKind.DEQUEUE, max_n)
                raise
            if not waiting:
                return [], [], None
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
                self._unwait(ring, OpKind.DEQUEUE, max_n)
                raise

    def _taken(self, ops: list[Op], t0: int) -> None:
        """Ops of a dequeue join the transaction (its lease runs from now)."""
        link = self.link
        lat = (time.perf_counter_ns() - t0) // len(ops)
        for op in ops:
            op.latency_ns = lat
        link.ops.extend(ops)
        link.section.note_hold(link.cidx)
        link.section.count_client(link.cidx, L.C_N_DEQ, len(ops))

    def _unwait(self, ring: Ring, kind: OpKind, want: int = 1) -> None:
        """Undo a waiter registration when an exception leaves the wait."""
        sec = self.link.section
        sec.lock_queue(ring.qidx)
        try:
            ring.abandon_wait(kind, want)
        finally:
            sec.unlock_queue(ring.qidx)


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
    by_slot = {slot: (state, seq) for slot, state, seq, _group, _due in rows}
    need_resync = False
    sec = link.section
    sec.lock_queue(ring.qidx)
    try:
        for op in stale:
            if not ring.held_by(op.slot, link.owner):
                continue
            state, seq = by_slot.get(op.slot, (RowState.FREE, -1))
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


def _recover_in_way(link: Link, ring: Ring, info: QueueInfo) -> bool:
    """Decide the slots of dead holders in the queue's way (True if any was)."""
    return help_recover(
        link.section, link.dsn, ring, info.name, owner=link.owner, instance=link.instance
    )
