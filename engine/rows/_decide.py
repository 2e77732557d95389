"""Deciding slots from rows: the section is a cache, the queue tables are the truth.

What a session runs after its connection was lost, and what recovery (the
monitor, or any linked client) runs for a dead client: once the old backend
has ended, each in-flight slot is decided from its row (:func:`decide_ops`).
Also here: loading a queue's block from its table (:func:`load_queue`),
re-reading a loaded one (:func:`resync_queue`), telling a caller whether
a commit in doubt committed (:func:`in_doubt_outcome`), deciding a session's
own slots after its connection was lost (:func:`decide_lost`), and telling
whether a dead holder is in a queue's way (:func:`dead_in_the_way`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from ..driver import QUERIES as _Q
from ..driver import queue_table
from ..driver.errors import DatabaseError, DatabaseUnavailable, InDoubt, InFlight
from ..driver.pg import connect, connected
from ..ring import Op, OpKind, QueueInfo, Ring, RowState, group_tag, load_rows
from ..section import Section
from ..section import layout as L
from . import tracelog


def mark_dropped(sec: Section, existing: set[int]) -> None:
    """Mark blocks of queues no longer in the database as dropped (caller holds the
    section lock)."""
    for qidx in sec.loaded_queues():
        if sec.q(qidx, L.Q_QID) not in existing:
            sec.mark_queue_dropped(qidx)


def latest_start(registered_ns: int) -> float:
    """The latest start (epoch seconds, server clock) of a backend its client
    registered at ``registered_ns`` (client clock): a backend with that pid
    started later is another one, the pid reused. A second of slack for the
    two clocks and the registration after the connect."""
    return registered_ns / 1e9 + 1.0


def wait_backend_gone(
    conn: psycopg.Connection[Any],
    pid: int,
    timeout: float = 30.0,
    *,
    not_after_ns: int | None = None,
) -> None:
    """Until the old backend has ended its transaction may still commit: end it and wait.

    With ``not_after_ns`` (when its client registered it, time.time_ns()), a
    backend with that pid that started later is another one (the pid reused,
    after a restart or on a promoted standby): never terminated, the old one
    is gone.
    """
    if not pid:
        return

    def ours() -> bool:
        row = conn.execute(_Q["backend_alive"], (pid,)).fetchone()
        if row is None or row[0] is None:
            return False
        return not_after_ns is None or float(row[0]) <= latest_start(not_after_ns)

    if not ours():
        return
    try:
        if not_after_ns is None:
            conn.execute(_Q["terminate"], (pid,))
        else:
            conn.execute(_Q["terminate_started_by"], (pid, latest_start(not_after_ns)))
    except psycopg.Error:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not ours():
            return
        time.sleep(0.01)
    raise DatabaseUnavailable(f"backend {pid} did not end within {timeout:g}s")


def held_slots(conn: psycopg.Connection[Any], qid: int) -> list[tuple[int, int]]:
    """(slot, seq) of prepared two-phase transactions in this queue: in doubt until resolved."""
    rows = conn.execute(_Q["held_slots"], (qid,)).fetchall()
    return [(int(s), int(q)) for s, q in rows]


def offered_slots(conn: psycopg.Connection[Any], qid: int) -> list[tuple[int, int]]:
    """(slot, seq) of the entries set aside for SQL consumers (``ringq.offers``)."""
    return _listed(conn, "has_offers", "offered_slots", qid)


def reserved_slots(conn: psycopg.Connection[Any], qid: int) -> list[tuple[int, int]]:
    """(slot, seq) of the slots reserved for SQL producers (``ringq.slots``)."""
    return _listed(conn, "has_slots", "reserved_slots", qid)


def _listed(conn: psycopg.Connection[Any], has: str, query: str, qid: int) -> list[tuple[int, int]]:
    """(slot, seq) of a listing of the SQL path (none in a schema older than it)."""
    row = conn.execute(_Q[has]).fetchone()
    if not row or not row[0]:
        return []
    return [(int(s), int(q)) for s, q in conn.execute(_Q[query], (qid,)).fetchall()]


@contextmanager
def one_snapshot(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """The reads inside see one snapshot of the database: a queue's rows and
    the listings of the SQL path that say which of them are whose must agree
    (a put or a take committing between two reads would otherwise leave an
    entry neither queued nor reserved, or queued twice). ``conn`` is
    autocommit; a connection already in a transaction reads in it as it is."""
    if not conn.autocommit:
        yield
        return
    with conn.transaction():
        conn.execute(_Q["one_snapshot"])
        yield


def load_block(
    sec: Section,
    qidx: int,
    info: QueueInfo,
    conn: psycopg.Connection[Any],
) -> None:
    """Fill a freshly allocated block (caller holds the section lock) from
    its rows (``all_rows``: slot, state, seq, group), its prepared
    transactions' slots and its entries set aside for SQL consumers, read on
    ``conn`` (autocommit)."""
    with one_snapshot(conn):
        rows = conn.execute(
            sql.SQL(_Q["all_rows"]).format(table=queue_table(info.name))).fetchall()
        held = held_slots(conn, info.id)
        offered = offered_slots(conn, info.id)
        reserved = reserved_slots(conn, info.id)
    ring = Ring(sec, qidx)
    ring.configure(
        max_payload=info.max_payload,
        block_when_full=info.full_policy == "block",
        single_dequeuer=info.dequeue_mode == "single",
        full_timeout_ms=int(info.full_timeout * 1000),
        max_deliveries=info.max_deliveries,
    )
    sec.set_lease(qidx, info.lease)
    arr, groups, dues = _split_rows(rows, sec)
    load_rows(
        ring, arr[:, 0], arr[:, 1], arr[:, 2], keep_locked=False, held=held, groups=groups,
        offered=offered, dues=dues, reserved=reserved,
    )
    sec.mark_queue_ready(qidx)


def _split_rows(
    rows: Sequence[tuple[int, int, int, str | None, int | None, int]], sec: Section,
) -> tuple[np.ndarray, list[tuple[int, str]], list[tuple[int, int]]]:
    """``all_rows`` rows as an (n, 3) array of (slot, state, seq), the
    (slot, group) of those that have a group, and the (slot, due us) of those
    not due yet; the database's clock they carry is noted in ``sec``."""
    arr = np.array([r[:3] for r in rows], dtype=np.int64).reshape(-1, 3)
    if rows:
        sec.note_db_clock(int(rows[0][5]))
    return (arr, [(r[0], r[3]) for r in rows if r[3] is not None],
            [(r[0], r[4]) for r in rows if r[4] is not None])


def load_queue(sec: Section, conn: psycopg.Connection[Any], info: QueueInfo) -> int:
    """Bring a queue into the section from its table (its first user on this
    host); returns its block. ``conn`` reads committed rows (autocommit).

    Takes the section lock; a queue another process loaded meanwhile is not
    loaded again.
    """
    sec.lock_section()
    try:
        qidx = sec.find_queue(info.id)
        if qidx is not None:
            return qidx
        mark_dropped(sec, {r[0] for r in conn.execute(_Q["queue_ids"]).fetchall()})
        qidx = sec.allocate_queue(info.id, info.name, info.capacity, info.cache_payload)
        load_block(sec, qidx, info, conn)
        return qidx
    finally:
        sec.unlock_section()


def resync_queue(sec: Section, ring: Ring, info: QueueInfo, dsn: str) -> None:
    """Re-read a loaded queue's rows into the section, keeping slots locked by clients.

    Holds the queue's lock while reading (rare: a repair), so no slot changes
    hands between the read and the update.
    """
    with connect(dsn) as aux:
        sql_rows = sql.SQL(_Q["all_rows"]).format(table=queue_table(info.name))
        sec.lock_queue(ring.qidx)
        try:
            with one_snapshot(aux):
                held = held_slots(aux, info.id)
                offered = offered_slots(aux, info.id)
                reserved = reserved_slots(aux, info.id)
                found = aux.execute(sql_rows).fetchall()
            arr, groups, dues = _split_rows(found, sec)
            load_rows(
                ring, arr[:, 0], arr[:, 1], arr[:, 2], keep_locked=True, held=held, groups=groups,
                offered=offered, dues=dues, reserved=reserved,
            )
            ring.note_resync()
        finally:
            sec.unlock_queue(ring.qidx)


def decide_ops(
    sec: Section,
    conn: psycopg.Connection[Any],
    ops: Sequence[Op],
    owner: int | None = None,
    *,
    why: str = "rows",
) -> bool | None:
    """Decide in-flight slots from their rows (the old backend has ended).

    An enqueue committed iff its row holds its sequence (queued or consumed);
    a dequeue committed iff its row is consumed. With ``owner``, only slots
    it still holds are decided. Returns whether the transaction committed
    (None if no op tells), after updating the section. ``why`` names the
    occasion in the trace (``ringq.trace``: one line per queue).
    """
    tracing = tracelog.log.isEnabledFor(logging.DEBUG)
    by_queue: dict[int, list[Op]] = {}
    for op in ops:
        by_queue.setdefault(op.info.id, []).append(op)
    outcome: bool | None = None
    for group in by_queue.values():
        ring, info = group[0].ring, group[0].info
        rows = conn.execute(
            sql.SQL(_Q["rows"]).format(table=queue_table(info.name)),
            ([op.slot for op in group],),
        ).fetchall()
        by_slot = {slot: (state, seq, group, due) for slot, state, seq, group, due in rows}
        exclusive = info.dequeue_mode == "single"
        done_ops: tuple[list[Op], list[Op]] = ([], [])  # (rolled back, committed), traced
        sec.lock_queue(ring.qidx)
        try:
            for op in group:
                if owner is not None and not ring.held_by(op.slot, owner):
                    continue  # someone else decided it already
                state, row_seq, group, due = by_slot.get(
                    op.slot, (RowState.FREE, -1, None, None)
                )
                done = op.committed_in(state, row_seq)
                # the row's due time, if it is still to come (a delayed
                # enqueue, or a backoff the strike wrote)
                due_us = due or 0 if row_seq == op.seq else 0
                if op.kind == OpKind.ENQUEUE:
                    if done and group is not None:
                        # the row's group: a slot held since a load (a prepared
                        # enqueue, its row invisible then) has no tag yet
                        ring.set_group(op.slot, group_tag(group))
                    ring.finish_enqueue(op.slot, committed=done, due_us=due_us)
                else:
                    ring.finish_dequeue(
                        op.slot, consumed=done, exclusive=exclusive, due_us=due_us
                    )
                outcome = done if outcome is None else (outcome or done)
                if tracing:
                    done_ops[done].append(op)
        finally:
            sec.unlock_queue(ring.qidx)
        if tracing and (done_ops[0] or done_ops[1]):
            tracelog.decided(why, info.name, owner, done_ops[1], done_ops[0])
    return outcome


def decide_lost(
    sec: Section,
    dsn: str,
    ops: list[Op],
    old_pid: int,
    old_token: int,
    *,
    cidx: int,
    connect_timeout: float,
) -> bool | None:
    """Decide the slots of a session's lost connection (backend ``old_pid``)
    that ``old_token`` still holds, once that backend has ended; then give up
    a single-dequeuer role that token holds with nothing left in flight.
    ``cidx`` is the session's client entry (its start time tells its backend
    from a later one with the same pid)."""
    if not ops:
        return None
    with connect(dsn, connect_timeout=connect_timeout) as aux:
        # a backend of that pid that started after we registered is not ours
        wait_backend_gone(aux, old_pid, not_after_ns=sec.c(cidx, L.C_STARTED_NS))
        committed = decide_ops(sec, aux, ops, old_token, why="connection-lost")
        if committed is None:
            # Recovery (the monitor, another session) decided our slots
            # first: the section knows, and the rows still tell us.
            committed = rows_outcome(aux, in_flight(ops))
    for op in ops:
        sec.lock_queue(op.ring.qidx)
        try:
            if op.ring.role_owner() == old_token and not sec.locked_under(
                old_token, [op.ring.qidx]
            ):
                op.ring.release_role(old_token)
        finally:
            sec.unlock_queue(op.ring.qidx)
    return committed


def dead_in_the_way(sec: Section, ring: Ring, owner: int) -> bool:
    """Whether a slot of the queue, or its dequeuer role, is held under a
    token (not ``owner``, ours) whose holder is dead as the section tells
    (see Section.token_dead)."""
    tokens = {t for _slot, t, _holder in ring.locked_slots() if t > 0}
    tokens.add(ring.role_owner())
    tokens -= {0, owner}
    return any(sec.token_dead(t) for t in tokens)


def in_flight(ops: Sequence[Op]) -> tuple[InFlight, ...]:
    """What :class:`InDoubt` tells of a transaction's queue operations."""
    out = []
    for op in ops:
        if op.kind == OpKind.ENQUEUE:
            w = op.write or op.fill
            out.append(InFlight(op.info.name, op.seq, "enqueue", op.slot,
                                w.producer if w else None, w.producer_seq if w else None))
        else:
            out.append(InFlight(op.info.name, op.seq, "dequeue", op.slot))
    return tuple(out)


def _verdict(entry: InFlight, row: tuple[int, int, str | None, int | None]) -> bool | None:
    """What one row (state, seq, producer, producer_seq) says of its
    operation's transaction, once the backend that ran it has ended.

    A sequence this history never committed may be given again after an
    asynchronous fail-over (the ring goes on from the rows the standby had):
    an enqueue's row must also hold its producer and producer sequence. A
    row written later tells nothing, nor does a consumed entry (a
    redelivery's commit consumes it too)."""
    state, row_seq, producer, producer_seq = row
    if entry.kind == "enqueue":
        if row_seq == entry.seq:
            if state not in (RowState.QUEUED, RowState.CONSUMED):
                return False
            return entry.producer is None or (
                (producer, producer_seq) == (entry.producer, entry.producer_seq)
            )
        return False if row_seq < entry.seq else None
    if row_seq == entry.seq and state == RowState.QUEUED:
        return False  # not consumed: its dequeue did not commit
    return None


def in_doubt_outcome(
    dsn: str, exc: InDoubt, *, timeout: float = 30.0, connect_timeout: float = 10.0
) -> bool | None:
    """Whether the transaction whose commit raised ``exc`` committed, from the
    rows of the server ``dsn`` reaches, once the backend that ran it has
    ended (ended by force if it still runs; ``timeout`` seconds at most).
    None when the rows do not tell.

    :raises DatabaseUnavailable: no server answers (yet), or the backend did not end in time.
    :raises DatabaseError:
    """
    if not exc.entries:
        return None
    pid, registered_ns = exc.backend
    with connected(dsn, connect_timeout=connect_timeout) as conn:
        wait_backend_gone(conn, pid, timeout, not_after_ns=registered_ns or None)
        return rows_outcome(conn, exc.entries)


def rows_outcome(conn: psycopg.Connection[Any], entries: Sequence[InFlight]) -> bool | None:
    """Whether the transaction of ``entries`` committed, as their rows tell
    (read on ``conn``, once the backend that ran it has ended; see
    :func:`_verdict`); None when they do not. The section is not touched.

    :raises DatabaseError: the rows disagree.
    """
    verdicts: set[bool] = set()
    by_queue: dict[str, list[InFlight]] = {}
    for entry in entries:
        by_queue.setdefault(entry.queue, []).append(entry)
    for queue, group in by_queue.items():
        rows = conn.execute(
            sql.SQL(_Q["in_doubt_rows"]).format(table=queue_table(queue)),
            ([e.slot for e in group],),
        ).fetchall()
        by_slot = {r[0]: r[1:] for r in rows}
        for e in group:
            verdict = _verdict(e, by_slot.get(e.slot, (RowState.FREE, -1, None, None)))
            if verdict is not None:
                verdicts.add(verdict)
    if len(verdicts) > 1:
        # A transaction commits whole: its rows cannot disagree unless written around ringq.
        raise DatabaseError(f"the rows disagree on the outcome of {tuple(entries)}")
    return verdicts.pop() if verdicts else None
