"""Runs of consecutive entries (seq, slot, n), the SQL agent's unit of listing,
and what it holds in the section, for both its sides (consumers' offers,
producers' reserved slots)."""

from __future__ import annotations

from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from ..driver import QUERIES as _Q
from ..driver.wire import int_array
from ..ring import Ring
from ..section import Section
from ..section import layout as L

Runs = list[tuple[int, int, int]]  # (seq, slot, n): n consecutive entries at consecutive slots
Entries = tuple["np.ndarray[Any, Any]", "np.ndarray[Any, Any]"]  # (seqs, slots), by seq
NONE: Entries = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


def sql_slots(sec: Section, ring: Ring, *, reserved: bool) -> np.ndarray[Any, Any]:
    """The slots of ``ring`` the section holds for the SQL path: entries
    claimed for SQL consumers (ENQ set), or, ``reserved``, slots reserved for
    SQL producers (neither ENQ nor DEQ: no entry published yet). One pass of
    array operations over the queue's words, not a look per slot (the pump
    asks at every pass)."""
    cap = ring.cap
    words = slice(ring.w0, ring.w0 + (cap + 63) // 64)

    def bits(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.unpackbits(arr[words].view(np.uint8), bitorder="little")[:cap].astype(bool)

    enq, deq, lck = bits(sec.enq), bits(sec.deq), bits(sec.lck)
    mine = lck & (sec.owner[ring.base : ring.base + cap] == L.OWNER_SQL)
    return np.flatnonzero(mine & (~enq & ~deq if reserved else enq))


def reserved_mask(
    sec: Section, ring: Ring, slots: np.ndarray[Any, Any], seqs: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """Which of ``slots`` (int64) are still reserved for SQL producers at
    ``seqs``: held by the owner ``OWNER_SQL`` (:meth:`Ring.held_mask`),
    neither ENQ nor DEQ (no entry published), the slot at that seq; for all
    at once (the queue's lock held)."""
    w = ring.w0 + (slots >> 6)
    shift = (slots & 63).astype(np.uint64)

    def clear(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        out: np.ndarray[Any, Any] = ((arr[w] >> shift) & np.uint64(1)) == 0
        return out

    tail = int(ring.Q[ring.qb + L.Q_TAIL])
    mask: np.ndarray[Any, Any] = (
        ring.held_mask(slots, L.OWNER_SQL) & clear(sec.enq) & clear(sec.deq)
        & (tail + (slots - tail) % ring.cap == seqs))
    return mask


def held(sec: Section, ring: Ring, *, reserved: bool) -> Entries:
    """What the section holds for the SQL path in ``ring`` (:func:`sql_slots`),
    as (seqs, slots) by seq."""
    sec.lock_queue(ring.qidx)
    try:
        slots = sql_slots(sec, ring, reserved=reserved).astype(np.int64)
        tail = int(ring.Q[ring.qb + L.Q_TAIL])
    finally:
        sec.unlock_queue(ring.qidx)
    seqs = tail + (slots - tail) % ring.cap  # Ring.seq_of, for every slot at once
    order = np.argsort(seqs, kind="stable")
    return seqs[order], slots[order]


def as_lists(entries: Entries) -> tuple[list[int], list[int]]:
    return entries[0].tolist(), entries[1].tolist()


def expand(runs: Runs) -> Entries:
    """The entries of ``runs`` (seq, slot, n): (seqs, slots)."""
    if not runs:
        return NONE
    arr = np.array(runs, dtype=np.int64).reshape(-1, 3)
    n = arr[:, 2]
    offs = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return np.repeat(arr[:, 0], n) + offs, np.repeat(arr[:, 1], n) + offs


Write = tuple[str | sql.Composed, Any]  # a statement and its parameters


def send(conn: psycopg.Connection[Any], writes: list[Write]) -> None:
    """Run ``writes`` in one round trip, as one transaction: in pipeline mode
    on the agent's autocommit connection, the statements up to the pipeline's
    Sync are one implicit transaction, all or nothing (a failed one raises
    here, and none of them took effect)."""
    if not writes:
        return
    with conn.pipeline():
        for query, params in writes:
            conn.execute(query, params)


def indexed(
    conn: psycopg.Connection[Any], query: sql.Composed, params: Any, *, binary: bool = False
) -> list[Any]:
    """The rows of ``query``, planned with ring rows found by their primary
    key (``agent_index_scans`` first, in the same implicit transaction);
    ``binary``: its results in binary (payloads are not hex-decoded)."""
    with conn.pipeline():
        conn.execute(_Q["agent_index_scans"])
        cur = conn.execute(query, params, binary=binary)
    rows: list[Any] = cur.fetchall()
    return rows


def runs_of(
    slots: np.ndarray[Any, Any], seqs: np.ndarray[Any, Any], limit: int = 0
) -> dict[str, str]:
    """The entries at ``slots`` with ``seqs`` (int64 arrays, any order) as
    runs of consecutive seqs at consecutive slots (so a run never wraps past
    the ring's last slot: its next seq is at slot 0), each at most ``limit``
    long (0: any): ``offers_runs``' and ``offers_clean_runs``' parameters,
    as array literals (each query casts them: ``%s::bigint[]``): psycopg's
    dump of a list, element by element, was an eighth of the agent's CPU."""
    if not seqs.size:
        return {"run_seqs": "{}", "run_slots": "{}", "run_ns": "{}"}
    order = np.argsort(seqs, kind="stable")
    seqs, slots = seqs[order], slots[order]
    brk = np.r_[True, (np.diff(seqs) != 1) | (np.diff(slots) != 1)]
    if limit:
        # a new run every ``limit`` entries within a run
        run_id = np.cumsum(brk) - 1
        first = np.flatnonzero(brk)
        pos = np.arange(seqs.size) - first[run_id]
        brk = brk | (pos % limit == 0)
    starts = np.flatnonzero(brk)
    ns = np.diff(np.r_[starts, seqs.size])
    return {"run_seqs": int_array(seqs[starts].tolist()),
            "run_slots": int_array(slots[starts].tolist()), "run_ns": int_array(ns.tolist())}


def minus(entries: Entries, seqs: np.ndarray[Any, Any]) -> Entries:
    """``entries`` less those whose seq is in ``seqs``."""
    keep = ~np.isin(entries[0], seqs)
    return entries[0][keep], entries[1][keep]


def plus(entries: Entries, more: Entries) -> Entries:
    """``entries`` and ``more``, by seq."""
    a, b = np.concatenate([entries[0], more[0]]), np.concatenate([entries[1], more[1]])
    order = np.argsort(a, kind="stable")
    return a[order], b[order]


def sort_listing(rows: list[Any]) -> tuple[Runs, Runs, Runs]:
    """Listed chunks (seq, slot, n, touched, live) as (all, free, touched):
    free ones no transaction touched; touched ones a transaction that is not
    running now touched (it did not commit); those a running one holds are
    decided on a later pass."""
    chunks: Runs = []
    free: Runs = []
    touched: Runs = []
    for seq, slot, n, touch, live in rows:
        chunk = (int(seq), int(slot), int(n))
        chunks.append(chunk)
        if not touch:
            free.append(chunk)
        elif not live:
            touched.append(chunk)
    return chunks, free, touched


def split_gone(mine: Entries, chunks: Runs) -> tuple[Entries, Entries]:
    """``mine`` as (no longer listed in ``chunks``, still listed)."""
    gone = ~np.isin(mine[0], expand(chunks)[0])
    return (mine[0][gone], mine[1][gone]), (mine[0][~gone], mine[1][~gone])


def post(sec: Section, ring: Ring, ready: int, space: int) -> None:
    """Wake ``ready`` dequeuers and ``space`` enqueuers waiting on the queue."""
    if ready:
        sec.post(ring.qid, "r", ready)
    if space:
        sec.post(ring.qid, "s", space)
