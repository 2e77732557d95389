"""Deciding slots from rows: the section is a cache, the queue tables are the truth.

What a session runs after its connection was lost, and what recovery (the
monitor, or any linked client) runs for a dead client: once the old backend
has ended, each in-flight slot is decided from its row (:func:`decide_ops`).
Also here: loading a queue's block from its table (:func:`load_queue`) and
re-reading a loaded one (:func:`resync_queue`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from . import _layout as L
from ._errors import DatabaseUnavailable
from ._names import queue_table
from ._ops import Op, OpKind, RowState
from ._queries import QUERIES as _Q
from ._queue_info import QueueInfo
from ._ring import Ring, group_tag
from ._section import Section


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


def load_block(
    sec: Section,
    qidx: int,
    info: QueueInfo,
    rows: Sequence[tuple[int, int, int, str | None]],
    held: list[tuple[int, int]],
) -> None:
    """Fill a freshly allocated block (caller holds the section lock) from
    its rows (``all_rows``: slot, state, seq, group)."""
    ring = Ring(sec, qidx)
    ring.configure(
        max_payload=info.max_payload,
        block_when_full=info.full_policy == "block",
        single_dequeuer=info.dequeue_mode == "single",
        full_timeout_ms=int(info.full_timeout * 1000),
        max_deliveries=info.max_deliveries,
    )
    sec.set_lease(qidx, info.lease)
    arr, groups = _split_rows(rows)
    ring.load_rows(
        arr[:, 0], arr[:, 1], arr[:, 2], keep_locked=False, held=held, groups=groups
    )
    sec.mark_queue_ready(qidx)


def _split_rows(
    rows: Sequence[tuple[int, int, int, str | None]],
) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """``all_rows`` rows as an (n, 3) array of (slot, state, seq), and the
    (slot, group) of those that have a group."""
    arr = np.array([r[:3] for r in rows], dtype=np.int64).reshape(-1, 3)
    return arr, [(r[0], r[3]) for r in rows if r[3] is not None]


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
        rows = conn.execute(sql.SQL(_Q["all_rows"]).format(table=queue_table(info.name))).fetchall()
        held = held_slots(conn, info.id)
        load_block(sec, qidx, info, rows, held)
        return qidx
    finally:
        sec.unlock_section()


def resync_queue(sec: Section, ring: Ring, info: QueueInfo, dsn: str) -> None:
    """Re-read a loaded queue's rows into the section, keeping slots locked by clients.

    Holds the queue's lock while reading (rare: a repair), so no slot changes
    hands between the read and the update.
    """
    with psycopg.connect(dsn, autocommit=True) as aux:
        sql_rows = sql.SQL(_Q["all_rows"]).format(table=queue_table(info.name))
        held = held_slots(aux, info.id)
        sec.lock_queue(ring.qidx)
        try:
            arr, groups = _split_rows(aux.execute(sql_rows).fetchall())
            ring.load_rows(
                arr[:, 0], arr[:, 1], arr[:, 2], keep_locked=True, held=held, groups=groups
            )
            ring.note_resync()
        finally:
            sec.unlock_queue(ring.qidx)


def decide_ops(
    sec: Section,
    conn: psycopg.Connection[Any],
    ops: Sequence[Op],
    owner: int | None = None,
) -> bool | None:
    """Decide in-flight slots from their rows (the old backend has ended).

    An enqueue committed iff its row holds its sequence (queued or consumed);
    a dequeue committed iff its row is consumed. With ``owner``, only slots
    it still holds are decided. Returns whether the transaction committed
    (None if no op tells), after updating the section.
    """
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
        by_slot = {slot: (state, seq, group) for slot, state, seq, group in rows}
        exclusive = info.dequeue_mode == "single"
        sec.lock_queue(ring.qidx)
        try:
            for op in group:
                if owner is not None and not ring.held_by(op.slot, owner):
                    continue  # someone else decided it already
                state, row_seq, group = by_slot.get(op.slot, (RowState.FREE, -1, None))
                done = op.committed_in(state, row_seq)
                if op.kind == OpKind.ENQUEUE:
                    if done and group is not None:
                        # the row's group: a slot held since a load (a prepared
                        # enqueue, its row invisible then) has no tag yet
                        ring.set_group(op.slot, group_tag(group))
                    ring.finish_enqueue(op.slot, committed=done)
                else:
                    ring.finish_dequeue(op.slot, consumed=done, exclusive=exclusive)
                outcome = done if outcome is None else (outcome or done)
        finally:
            sec.unlock_queue(ring.qidx)
    return outcome
