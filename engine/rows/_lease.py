"""Leases and lost backends: deciding the entries of a session that still lives.

Recovery (:mod:`.recovery`) decides the slots of dead clients. Two cases leave
the slots of a *live* client undecided while its process goes on:

- Its lease expired: it holds a dequeued entry longer than its queue's lease
  (``ringq.queues.lease``) without committing (an idle session, a stuck
  action; RTR's inactivity timeout). :func:`overdue_holders` finds it from the
  section alone; :func:`end_holders` terminates its backend, so PostgreSQL
  rolls its transaction back, and decides its slots from the rows: each
  dequeued entry is ready again, counted as a delivery.
- Its backend ended under it (the database restarted, an operator terminated
  it) while the process sleeps: :func:`recover_lost_backends` decides its
  slots from the rows.

Either way the client entry stays the session's own: on its next call the
session finds its connection lost and its slots decided (a slot is never
decided twice: every decision checks, under the queue's lock, that the owner
still holds it). Slots of prepared two-phase transactions are left to
``resolve_prepared``: terminating a backend does not end a prepared transaction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg

from ..driver import QUERIES as _Q
from ..ring import Op, OpKind, QueueInfo, Ring
from ..section import Section, pid_alive
from ..section import layout as L
from .recovery import (
    Recovered,
    _backends_alive,
    _connect,
    _decide_and_strike,
    _prepared_slots,
    queue_infos,
)

TERMINATE_WAIT_S = 2.0  # how long a terminated backend is waited for before the next pass


@dataclass
class Holder:
    """A live client holding dequeued entries past its queue's lease."""

    cidx: int
    pid: int
    backend_pid: int
    token: int  # C_TOKEN when found: its slots are decided under this one only
    since_ns: int  # C_HOLD_SINCE_NS: monotonic ns of its transaction's first dequeue
    held_s: float
    lease_s: float  # the shortest lease among the queues it holds entries in
    queues: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "backend_pid": self.backend_pid,
            "held_s": round(self.held_s, 3),
            "lease_s": self.lease_s,
            "queues": self.queues,
        }


def _locked_slots(ring: Ring, owner: int, *, dequeued: bool | None = None) -> list[int]:
    """Slots ``owner`` (an owner token, ``C_TOKEN``) holds the lock of; with
    ``dequeued``, only dequeues (ENQ set) or only enqueue reservations (ENQ clear)."""
    owners = ring.sec.owner[ring.base : ring.base + ring.cap]
    out = []
    for s in np.flatnonzero(owners == owner):
        enq, _deq, lck, _owner = ring.bits(int(s))
        if lck and (dequeued is None or enq == dequeued):
            out.append(int(s))
    return out


def _client_rings(sec: Section, cidx: int) -> list[Ring]:
    return [Ring(sec, q) for q in sec.client_queues(cidx) if sec.q(q, L.Q_STATE) == L.QS_READY]


def overdue_holders(sec: Section, now_ns: int | None = None) -> list[Holder]:
    """Active clients holding a dequeued entry longer than the lease of its
    queue (the shortest lease among the queues they hold entries in). Reads
    the section only; cheap while no client holds an entry that long."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    out: list[Holder] = []
    for cidx in sec.active_clients():
        since = sec.c(cidx, L.C_HOLD_SINCE_NS)
        if since <= 0 or sec.c(cidx, L.C_STATE) != L.CS_ACTIVE:
            continue
        held_ms = (now - since) // 1_000_000
        due = [r for r in _client_rings(sec, cidx) if 0 < sec.q(r.qidx, L.Q_LEASE_MS) <= held_ms]
        token = sec.c(cidx, L.C_TOKEN)
        holding = [r for r in due if _locked_slots(r, token, dequeued=True)]
        if not holding:
            continue
        out.append(Holder(
            cidx=cidx,
            pid=int(sec.c(cidx, L.C_PID)),
            backend_pid=int(sec.c(cidx, L.C_BACKEND_PID)),
            token=int(token),
            since_ns=int(since),
            held_s=held_ms / 1000,
            lease_s=min(sec.q(r.qidx, L.Q_LEASE_MS) for r in holding) / 1000,
            queues=[sec.queue_name(r.qidx) for r in holding],
        ))
    return out


def end_holders(sec: Section, dsn: str, holders: list[Holder]) -> list[tuple[Holder, Recovered]]:
    """Terminate the backends of ``holders`` (from :func:`overdue_holders`) and
    decide their slots from the rows once each backend has ended: the
    dequeued entries are ready again, each counted as a delivery (at the
    queue's max_deliveries it is poisoned, as for any rollback). A holder that
    finished its transaction meanwhile, or holds slots of a prepared
    transaction, is left alone; one whose backend is still ending is decided
    by :func:`recover_lost_backends` later.

    :raises DatabaseUnavailable: the database cannot be reached.
    """
    done: list[tuple[Holder, Recovered]] = []
    with _connect(dsn) as conn:
        infos = queue_infos(conn)
        prepared = _prepared_slots(conn)
        ended: list[Holder] = []
        for h in holders:
            if (
                sec.c(h.cidx, L.C_HOLD_SINCE_NS) != h.since_ns
                or sec.c(h.cidx, L.C_BACKEND_PID) != h.backend_pid
                or sec.c(h.cidx, L.C_TOKEN) != h.token
            ):
                continue  # committed, rolled back or reconnected since it was found
            if any(
                (r.qid, s) in prepared
                for r in _client_rings(sec, h.cidx)
                for s in _locked_slots(r, h.token)
            ):
                continue  # a prepared transaction outlives its backend: resolve_prepared decides
            if h.backend_pid:
                conn.execute(_Q["terminate"], (h.backend_pid,))
            ended.append(h)
        registered = {h.backend_pid: sec.c(h.cidx, L.C_STARTED_NS) for h in ended}
        alive = _backends_alive(conn, [h.backend_pid for h in ended if h.backend_pid], registered)
        deadline = time.monotonic() + TERMINATE_WAIT_S
        while alive and time.monotonic() < deadline:
            time.sleep(0.005)
            alive = _backends_alive(conn, list(alive), registered)
        for h in ended:
            if h.backend_pid in alive:
                continue
            rec = _decide_client(sec, conn, infos, prepared, h.cidx, h.token, h.backend_pid)
            if not rec.committed:
                # its commit, if it tries one, learns it rolled back
                sec.end_hold(h.cidx, h.since_ns)
            done.append((h, rec))
    return done


def recover_lost_backends(sec: Section, conn: psycopg.Connection[Any]) -> list[Recovered]:
    """Decide the slots of live clients whose backend has ended (the database
    restarted, or someone terminated it) while they hold slots: they would
    otherwise stay locked until the client calls again, and a single-dequeuer
    queue would deliver nothing meanwhile. Dequeued entries come back counted
    as a delivery. Returns the clients decided (those that held slots).

    ``conn`` is an autocommit connection to the database (one query when no
    backend was lost, so a monitor can run this every interval on its own).

    :raises psycopg.Error: the caller converts it.
    """
    # (backend, token) of each active client, the pair read together: a
    # reconnect renews both, and a new session in a freed entry has others.
    found: dict[int, tuple[int, int]] = {}
    sec.lock_section()
    try:
        for cidx in sec.active_clients():
            backend = int(sec.c(cidx, L.C_BACKEND_PID))
            if sec.c(cidx, L.C_STATE) == L.CS_ACTIVE and backend:
                found[cidx] = (backend, int(sec.c(cidx, L.C_TOKEN)))
    finally:
        sec.unlock_section()
    if not found:
        return []
    out: list[Recovered] = []
    registered = {b: sec.c(cidx, L.C_STARTED_NS) for cidx, (b, _t) in found.items()}
    alive = _backends_alive(conn, [b for b, _t in found.values()], registered)
    lost = {
        cidx: (b, token) for cidx, (b, token) in found.items()
        if b not in alive
        and any(_locked_slots(r, token) for r in _client_rings(sec, cidx))
    }
    if not lost:
        return []
    infos = queue_infos(conn)
    prepared = _prepared_slots(conn)
    for cidx, (backend, token) in lost.items():
        if (
            sec.c(cidx, L.C_BACKEND_PID) != backend
            or sec.c(cidx, L.C_TOKEN) != token
            or not pid_alive(sec.c(cidx, L.C_PID))
        ):
            # reconnected meanwhile (its own recovery decides), or dead (recover_dead_clients)
            continue
        rec = _decide_client(sec, conn, infos, prepared, cidx, token, backend)
        if rec.slots:
            out.append(rec)
    return out


def _decide_client(
    sec: Section,
    conn: psycopg.Connection[Any],
    infos: dict[int, QueueInfo],
    prepared: set[tuple[int, int]],
    cidx: int,
    owner: int,
    backend_pid: int,
) -> Recovered:
    """Decide the slots live client ``cidx`` holds under token ``owner`` (its
    connection whose backend has ended) and give up its single-dequeuer roles
    it holds nothing under; its entry stays."""
    rec = Recovered(cidx, int(sec.c(cidx, L.C_PID)), backend_pid)
    ops: list[Op] = []
    rings = _client_rings(sec, cidx)
    for ring in rings:
        info = infos.get(ring.qid)
        if info is None:
            continue
        slots = [s for s in _locked_slots(ring, owner) if (info.id, s) not in prepared]
        for slot in slots:
            kind = OpKind.DEQUEUE if ring.bits(slot)[0] else OpKind.ENQUEUE
            ops.append(Op(ring, info, slot, ring.seq_of(slot), kind))
        if slots:
            rec.queues.append(info.name)
    rec.slots = len(ops)
    if ops:
        _decide_and_strike(sec, conn, ops, rec, owner)
    for ring in rings:
        sec.lock_queue(ring.qidx)
        try:
            if not _locked_slots(ring, owner):
                ring.release_role(owner)
        finally:
            sec.unlock_queue(ring.qidx)
    return rec
