"""Recovery: what the monitor runs (and any linked client may run) to keep the
section true to the rows after failures.

- :func:`rebuild` attaches (or creates) a database's section and loads every queue.
- :func:`recover_dead_clients` decides the slots of clients killed at any point,
  once their PostgreSQL backend has ended, from the rows; and orphaned slots,
  whose owner token no live entry carries any more (a session that lost its
  connection and could not decide them), once their holder backend has ended.
- :func:`repair_lock_holders` re-reads a queue whose lock holder died inside
  the critical section.
- :func:`reclaim_all` advances tails and wakes blocked enqueuers.
- :func:`resolve_prepared` finishes two-phase transactions whose coordinator died.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from ..driver import QUERIES as _Q
from ..driver import queue_table
from ..driver.errors import DatabaseUnavailable, SchemaMissing, SectionError
from ..driver.pg import connect
from ..ring import POISON_REASON, Op, OpKind, QueueInfo, Ring, RowState
from ..section import Section, pid_alive, shared_section
from ..section import layout as L
from . import tracelog
from ._decide import (
    decide_ops,
    latest_start,
    load_block,
    mark_dropped,
    resync_queue,
)
from ._gid import is_ringq_gid

logger = logging.getLogger("ringq.recovery")

HELD = L.OWNER_HELD  # owner of slots of a prepared transaction whose client died: kept locked
# Held slots alone (no dead client, no orphan) make recovery connect to see
# whether their transactions are still prepared at most this often, in
# seconds, per section: a dead coordinator's transaction may stay prepared
# for prepared_timeout (60 s), and the monitor recovers every 100 ms.
HELD_CHECK_S = 1.0
_held_checked: dict[str, float] = {}  # section name -> monotonic time of the last look


@dataclass
class Recovered:
    """One dead client whose slots were decided (``pid`` 0: orphaned slots,
    whose entry had been freed or renewed; ``backend_pid`` their holder)."""

    cidx: int
    pid: int
    backend_pid: int
    slots: int = 0
    committed: int = 0
    rolled_back: int = 0
    held: int = 0
    queues: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Every field but the client entry's index (reused: it names no client)."""
        fields = asdict(self)
        del fields["cidx"]
        return fields


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return connect(dsn, connect_timeout=5)


def _instance(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute(_Q["instance"]).fetchone()  # (instance id, schema version, backend pid)
    if not row or row[0] is None:
        raise SchemaMissing("ringq schema missing or incomplete: ringq.meta has no instance_id")
    return str(row[0])


def queue_infos(conn: psycopg.Connection[Any]) -> dict[int, QueueInfo]:
    rows = conn.execute(_Q["queue_infos"]).fetchall()
    return {r[0]: QueueInfo(*r) for r in rows}


def history_of(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(system identifier, timeline) of the server ``conn`` is connected to;
    the timeline is -1 on a standby. Runs one statement on ``conn``."""
    row = conn.execute(_Q["history"]).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def section_following(instance_id: str, history: tuple[int, int], where: str = "") -> Section:
    """This process's attachment of the section of ``instance_id``, made to
    describe the database history ``history`` (:func:`history_of`): a section
    that describes another one (the database failed over to a standby, or was
    restored on a new timeline) is replaced by a new one, loaded from the
    rows of this history's server by its first users; its bits might show
    entries this history never committed.

    :raises DatabaseUnavailable: the server is a standby (in recovery).
    :raises SectionError: the section could not be replaced.
    """
    sysid, timeline = history
    if timeline < 0:
        raise DatabaseUnavailable(
            f"the server{' at ' + where if where else ''} is a standby (in recovery): "
            "ringq needs the primary"
        )
    for _attempt in range(3):
        # The process's one attachment: a second one would not exclude this
        # process's other users (fcntl locks are per process, and closing any
        # descriptor of the segment drops them all).
        sec = shared_section(instance_id)
        if sec.follow_history(sysid, timeline):
            return sec
        old_sysid, old_timeline = sec.history()
        sec.replace(
            instance_id,
            f"the database's history changed (system {old_sysid}, timeline {old_timeline} -> "
            f"system {sysid}, timeline {timeline}: a fail-over or a restore); "
            "queues are loaded again from the rows",
        )
    raise SectionError(f"the global section of {instance_id} could not follow the database")


def rebuild(dsn: str) -> Section:
    """Attach (creating if absent) the database's section and load every queue not loaded.

    A section of another database history is replaced first
    (:func:`section_following`). Blocks of queues dropped from the database
    are marked dropped.
    """
    with _connect(dsn) as conn:
        sec = section_following(_instance(conn), history_of(conn), "")
        _load_queues(sec, conn)
    return sec


def rebuild_into(dsn: str, instance_id: str) -> Section:
    """Load every queue from the tables into the section named by ``instance_id``,
    a reference to compare the database's live section with (see
    :func:`section_differences`); never the database's own section.

    The caller closes it and removes it (``Section.unlink(instance_id)``).
    :raises SectionError: ``instance_id`` is the database's own, or already has queues.
    """
    with _connect(dsn) as conn:
        if instance_id == _instance(conn):
            raise SectionError("rebuild_into needs a section other than the database's own")
        sec = Section.attach(instance_id)
        if sec.loaded_queues():
            sec.close()
            raise SectionError(f"section {sec.name} is not fresh: it already has queues")
        try:
            _load_queues(sec, conn)
        except BaseException:
            sec.close()
            raise
    return sec


def _load_queues(sec: Section, conn: psycopg.Connection[Any]) -> None:
    infos = queue_infos(conn)
    mark_dropped(sec, set(infos))
    for info in infos.values():
        if sec.find_queue(info.id) is not None:
            continue
        sec.lock_section()
        try:
            if sec.find_queue(info.id) is not None:
                continue
            qidx = sec.allocate_queue(info.id, info.name, info.capacity, info.cache_payload)
            load_block(sec, qidx, info, conn)
            logger.info(
                "ringq: queue %s loaded into the section (%d slots)", info.name, info.capacity
            )
        finally:
            sec.unlock_section()


def section_differences(live: Section, fresh: Section, qid: int) -> list[str]:
    """How queue ``qid``'s block in ``live`` differs from ``fresh`` (a rebuild
    from the tables, :func:`rebuild_into`); empty when they agree.

    Meant for a quiet queue (no transaction in flight) whose tail both have
    reclaimed. Compared: tail, head, and the ENQ, DEQ and LCK bits (and the
    owner of a locked slot) of every slot in the rebuilt window [tail, head), and that no slot
    of the live window is locked, and the queue's lock holder and dequeuer
    role. One difference is allowed: a reservation voided at the head (its
    row never written) is absent from the rows, so the live head may be
    ahead of the rebuilt one over slots that are void (DEQ only).
    """
    out: list[str] = []
    li, fi = live.find_queue(qid), fresh.find_queue(qid)
    if li is None or fi is None:
        return [f"queue {qid} not loaded (live {li}, fresh {fi})"]
    lr, fr = Ring(live, li), Ring(fresh, fi)
    if lr.cap != fr.cap:
        return [f"capacity {lr.cap} != {fr.cap}"]
    if lr.head < fr.head or lr.head - fr.head > lr.cap:
        out.append(f"head {lr.head} != rebuilt {fr.head}")
        return out
    for seq in range(fr.head, lr.head):
        # Reclaim moves the tail without clearing bits: a void slot keeps DEQ alone.
        if lr.bits(seq % lr.cap)[:3] != (False, True, False):
            out.append(
                f"head {lr.head} ahead of rebuilt {fr.head} over seq {seq}, "
                f"not void: {lr.bits(seq % lr.cap)}"
            )
    # With nothing pending the rebuilt tail is its head; the live one may have
    # reclaimed the void slots beyond it too.
    empty_ok = fr.tail == fr.head and fr.head <= lr.tail <= lr.head
    if lr.tail != fr.tail and not empty_ok:
        out.append(f"tail {lr.tail} != rebuilt {fr.tail}")
    for seq in range(fr.tail, fr.head):
        slot = seq % fr.cap
        lb, fb = lr.bits(slot), fr.bits(slot)
        # An owner counts only under LCK: a client killed between clearing LCK and
        # the owner word (or between writing the owner and setting LCK) leaves
        # a stale owner that nothing reads.
        if lb[:3] != fb[:3] or (lb[2] and lb[3] != fb[3]):
            out.append(f"seq {seq} (slot {slot}): live (ENQ, DEQ, LCK, owner) {lb} != rebuilt {fb}")
    for seq in range(lr.tail, lr.head):
        if lr.bits(seq % lr.cap)[2]:
            out.append(f"seq {seq} (slot {seq % lr.cap}) locked in the live section")
    for word in (L.Q_LOCK_HOLDER, L.Q_DEQ_OWNER):
        if live.q(li, word) != fresh.q(fi, word):
            out.append(f"queue word {word}: live {live.q(li, word)} != rebuilt {fresh.q(fi, word)}")
    return out


def _backends_alive(
    conn: psycopg.Connection[Any], pids: list[int], not_after_ns: dict[int, int] | None = None
) -> set[int]:
    """The pids among ``pids`` that are backends of this database. With
    ``not_after_ns`` (pid -> client registration time), a backend that started
    after its client registered is a reused pid, not the client's backend."""
    if not pids:
        return set()
    rows = conn.execute(_Q["backends_started"], (pids,)).fetchall()
    alive = set()
    for pid, started in rows:
        limit = (not_after_ns or {}).get(pid)
        if limit is not None and started is not None and float(started) > latest_start(limit):
            continue  # pid reused by a newer backend
        alive.add(pid)
    return alive


def _locked_by(ring: Ring, owner: int) -> list[int]:
    sec = ring.sec
    owners = sec.owner[ring.base : ring.base + ring.cap]
    cand = np.flatnonzero(owners == owner)
    return [int(s) for s in cand if ring.bits(int(s))[2]]


def recover_dead_clients(sec: Section, dsn: str, *, terminate: bool = True) -> list[Recovered]:
    """Decide the slots of dead clients from the rows and free their entries;
    then decide orphaned slots.

    A client is dead when its process is gone, or it handed its slots over
    (in doubt). Its slots (those locked under its token) are decided only
    after its backend has ended (we terminate a backend whose client process
    is gone, then wait for it); until then its transaction might still
    commit. Slots of a prepared two-phase transaction stay locked (owner
    HELD) for :func:`resolve_prepared`.

    A slot is orphaned when its token is no live entry's current one (the
    entry was freed, or renewed its token on a reconnect): it is decided once
    the backend recorded with it (its holder) has ended or sits outside any
    transaction, whoever holds the entry now; a single-dequeuer role such a
    token holds is then given up.

    One recoverer at a time per section: if another process (or thread) is
    recovering, this returns [] at once and leaves the work to it.
    """
    if not sec.try_lock_recovery():
        return []
    try:
        dead = sec.dead_clients()
        orphans, held = _orphaned_slots(sec)
        now = time.monotonic()
        if held and now - _held_checked.get(sec.name, 0.0) < HELD_CHECK_S:
            held = {}  # looked at less than HELD_CHECK_S ago
        if not dead and not orphans and not held:
            return []
        with _connect(dsn) as conn:
            infos = queue_infos(conn)
            prepared = _prepared_slots(conn)  # read after the held slots: see _decide_unheld
            out = (
                _recover_dead(sec, conn, infos, prepared, dead, terminate=terminate) if dead else []
            )
            if orphans:
                out += _recover_orphans(sec, conn, infos, prepared, orphans)
            if held:
                _held_checked[sec.name] = now
                _decide_unheld(sec, conn, infos, prepared, held)
        return out
    finally:
        sec.unlock_recovery()


def _decide_unheld(
    sec: Section,
    conn: psycopg.Connection[Any],
    infos: dict[int, QueueInfo],
    prepared: set[tuple[int, int]],
    held: dict[int, list[int]],
) -> None:
    """Decide from the rows the slots held (owner HELD) for a prepared
    transaction that is prepared no longer: someone resolved it (its own
    session on a new connection after a fail-over, an administrator) other
    than :func:`resolve_prepared`, which decides the slots it resolves. A
    slot is held only while its transaction is prepared and a transaction
    leaves that state once, so one not in ``prepared`` (read after the held
    slots were) has its final row."""
    ops: list[Op] = []
    for qidx, slots in held.items():
        ring = Ring(sec, qidx)
        info = infos.get(ring.qid)
        if info is None:
            continue
        ops += [_slot_op(ring, info, slot) for slot in slots if (info.id, slot) not in prepared]
    if ops:
        decide_ops(sec, conn, ops, HELD, why="prepared-resolved-elsewhere")
        logger.warning(
            "ringq: %d slots held for prepared transactions resolved elsewhere decided from rows",
            len(ops),
        )


def _recover_dead(
    sec: Section,
    conn: psycopg.Connection[Any],
    infos: dict[int, QueueInfo],
    prepared: set[tuple[int, int]],
    dead: list[int],
    *,
    terminate: bool,
) -> list[Recovered]:
    out: list[Recovered] = []
    backends = {cidx: sec.c(cidx, L.C_BACKEND_PID) for cidx in dead}
    registered = {sec.c(cidx, L.C_BACKEND_PID): sec.c(cidx, L.C_STARTED_NS) for cidx in dead}
    alive = _backends_alive(conn, [b for b in backends.values() if b], registered)
    if alive and terminate:
        for b in alive:
            conn.execute(_Q["terminate"], (b,))
        deadline = time.monotonic() + 2.0
        while alive and time.monotonic() < deadline:
            time.sleep(0.005)
            alive = _backends_alive(conn, list(alive), registered)
    for cidx in dead:
        if backends[cidx] in alive:
            continue  # its transaction may still end either way: next round
        rec = Recovered(cidx, sec.c(cidx, L.C_PID), backends[cidx])
        token = sec.c(cidx, L.C_TOKEN)
        ops: list[Op] = []
        for qidx in sec.loaded_queues():
            ring = Ring(sec, qidx)
            info = infos.get(ring.qid)
            if info is None:
                continue
            slots = _locked_by(ring, token)
            ops += _ops_or_hold(sec, ring, info, slots, prepared, rec)
            if slots and info.name not in rec.queues:
                rec.queues.append(info.name)
        rec.slots = len(ops) + rec.held
        if ops:
            _decide_and_strike(sec, conn, ops, rec, token)
        # The single-dequeuer role is given up only now that the dead
        # client's entries are decided (ready again, or consumed). Given up
        # before, another dequeuer could take the queue while those entries
        # were still locked, read past them and take later ones first: out
        # of order, and a mover would then prune the idempotency keys of
        # entries it had not yet seen come back (moved twice).
        for qidx in sec.loaded_queues():
            ring = Ring(sec, qidx)
            sec.lock_queue(qidx)
            try:
                ring.release_role(token)
            finally:
                sec.unlock_queue(qidx)
        sec.free_client(cidx)
        logger.warning("ringq: dead client pid %s recovered: %s", rec.pid, rec.as_dict())
        out.append(rec)
    return out


def _ops_or_hold(
    sec: Section,
    ring: Ring,
    info: QueueInfo,
    slots: list[int],
    prepared: set[tuple[int, int]],
    rec: Recovered,
) -> list[Op]:
    """Ops to decide for ``slots`` of a dead holder; slots of a prepared
    transaction are held instead (owner HELD), for :func:`resolve_prepared`."""
    ops: list[Op] = []
    for slot in slots:
        if (info.id, slot) in prepared:
            sec.lock_queue(ring.qidx)
            try:
                ring.hold(slot)
            finally:
                sec.unlock_queue(ring.qidx)
            tracelog.log.debug("hold queue=%s slot=%d seq=%d: prepared, left to resolve_prepared",
                             info.name, slot, ring.seq_of(slot))
            rec.held += 1
            continue
        ops.append(_slot_op(ring, info, slot))
    return ops


def _slot_op(ring: Ring, info: QueueInfo, slot: int) -> Op:
    """The op a locked slot stands for: a dequeue if its entry was committed
    (ENQ set), else an enqueue (reserved)."""
    enq, _deq, _lck, _owner = ring.bits(slot)
    return Op(ring, info, slot, ring.seq_of(slot), OpKind.DEQUEUE if enq else OpKind.ENQUEUE)


@dataclass
class _Orphans:
    """Slots locked under one orphaned token, queue block by queue block."""

    holder: int  # the backend pid recorded with them (0: unknown)
    slots: dict[int, list[int]] = field(default_factory=dict)  # qidx -> slots
    roles: list[int] = field(default_factory=list)  # qidx of single-mode queues whose role it holds


def _orphaned_slots(sec: Section) -> tuple[dict[int, _Orphans], dict[int, list[int]]]:
    """Locked slots (and single-dequeuer roles) whose token no entry carries
    now, by token; and the slots held for prepared transactions (owner HELD),
    by queue block. Read under each queue's lock, so a slot being locked is
    seen with its owner and holder."""
    out: dict[int, _Orphans] = {}
    held: dict[int, list[int]] = {}
    for qidx in sec.loaded_queues():
        ring = Ring(sec, qidx)
        sec.lock_queue(qidx)
        try:
            locked = ring.locked_slots()
            role = ring.role_owner()
        finally:
            sec.unlock_queue(qidx)
        for slot, token, holder in locked:
            if token > 0 and sec.token_holder(token) is None:
                out.setdefault(token, _Orphans(holder)).slots.setdefault(qidx, []).append(slot)
            elif token == HELD:
                held.setdefault(qidx, []).append(slot)
        if role > 0 and sec.token_holder(role) is None:
            out.setdefault(role, _Orphans(0)).roles.append(qidx)
    return out, held


def _recover_orphans(
    sec: Section,
    conn: psycopg.Connection[Any],
    infos: dict[int, QueueInfo],
    prepared: set[tuple[int, int]],
    orphans: dict[int, _Orphans],
) -> list[Recovered]:
    holders = [o.holder for o in orphans.values() if o.holder]
    busy = {
        int(pid)
        for pid, in_tx in conn.execute(_Q["backends_in_transaction"], (holders,)).fetchall()
        if in_tx
    }
    out: list[Recovered] = []
    for token, orphan in orphans.items():
        if orphan.holder in busy:
            continue  # its transaction may still commit: next round
        rec = Recovered(L.token_client(token), 0, orphan.holder)
        ops: list[Op] = []
        for qidx, slots in orphan.slots.items():
            ring = Ring(sec, qidx)
            info = infos.get(ring.qid)
            if info is None:
                continue
            ops += _ops_or_hold(sec, ring, info, slots, prepared, rec)
            rec.queues.append(info.name)
        rec.slots = len(ops) + rec.held
        if ops:
            _decide_and_strike(sec, conn, ops, rec, token)
        for qidx in {*orphan.roles, *orphan.slots}:
            ring = Ring(sec, qidx)
            sec.lock_queue(qidx)
            try:
                if not sec.locked_under(token, [qidx]):
                    ring.release_role(token)
            finally:
                sec.unlock_queue(qidx)
        if rec.slots:
            logger.warning("ringq: orphaned slots of token %s recovered: %s", token, rec.as_dict())
            out.append(rec)
    return out


def _strike_dequeues(conn: psycopg.Connection[Any], ops: list[Op]) -> None:
    """Count a failed delivery on the dequeues of ``ops`` whose rows are still
    queued at their seq (their transaction did not commit), while the slots
    are still locked: each waits for the queue's backoff, and one at
    max_deliveries becomes a consumed row (poison)."""
    for info_id in {op.info.id for op in ops if op.kind == OpKind.DEQUEUE}:
        group = [op for op in ops if op.info.id == info_id and op.kind == OpKind.DEQUEUE]
        info = group[0].info
        conn.execute(
            sql.SQL(_Q["strike"]).format(table=queue_table(info.name)),
            {
                "max_deliveries": info.max_deliveries,
                "slots": [o.slot for o in group],
                "seqs": [o.seq for o in group],
                "queue_id": info.id,
                "reason": POISON_REASON,
            },
        )


def _decide_and_strike(
    sec: Section, conn: psycopg.Connection[Any], ops: list[Op], rec: Recovered, token: int
) -> None:
    _strike_dequeues(conn, ops)
    decide_ops(sec, conn, ops, token, why=f"dead-client:{rec.pid}" if rec.pid else "orphaned")
    rows_by_q: dict[int, dict[int, tuple[int, int]]] = {}
    for op in ops:
        info = op.info
        if info.id not in rows_by_q:
            rows = conn.execute(
                sql.SQL(_Q["rows"]).format(table=queue_table(info.name)),
                ([o.slot for o in ops if o.info.id == info.id],),
            ).fetchall()
            rows_by_q[info.id] = {r[0]: (r[1], r[2]) for r in rows}  # (slot, state, seq, group)
        state, row_seq = rows_by_q[info.id].get(op.slot, (RowState.FREE, -1))
        # An enqueue committed if its row holds it; a dequeue only if consumed
        # (a poisoned entry counts as consumed: it left the queue).
        if op.committed_in(state, row_seq):
            rec.committed += 1
        else:
            rec.rolled_back += 1
        # Wake a sleeping dequeuer: the entry may be ready again.
        if op.ring.waiters(OpKind.DEQUEUE) > 0:
            sec.post(op.ring.qid, "r", 1)


def _prepared_slots(conn: psycopg.Connection[Any]) -> set[tuple[int, int]]:
    rows = conn.execute(_Q["prepared_slots"]).fetchall()
    return {(int(q), int(s)) for q, s in rows}


def repair_lock_holders(sec: Section, dsn: str) -> list[str]:
    """Re-sync queues whose lock holder died inside the critical section."""
    repaired: list[str] = []
    suspects = [
        qidx
        for qidx in sec.loaded_queues()
        if (h := sec.q(qidx, L.Q_LOCK_HOLDER)) and not pid_alive(h)
    ]
    if not suspects:
        return repaired
    with _connect(dsn) as conn:
        infos = queue_infos(conn)
    for qidx in suspects:
        ring = Ring(sec, qidx)
        info = infos.get(ring.qid)
        if info is None:
            continue
        # The kernel released the dead holder's fcntl lock; resync takes it.
        resync_queue(sec, ring, info, dsn)
        repaired.append(info.name)
        logger.warning("ringq: queue %s re-read from rows: lock holder died inside", info.name)
    return repaired


def reclaim_all(sec: Section) -> dict[str, int]:
    """Advance every queue's tail over consumed and void slots; wake blocked enqueuers."""
    out: dict[str, int] = {}
    for qidx in sec.loaded_queues():
        ring = Ring(sec, qidx)
        sec.lock_queue(qidx)
        try:
            n = ring.reclaim()
            waiters = ring.waiters(OpKind.ENQUEUE)
        finally:
            sec.unlock_queue(qidx)
        if n:
            out[sec.queue_name(qidx)] = n
            if waiters:
                sec.post(ring.qid, "s", min(n, waiters))
    return out


# seconds a decided branch with no queue operations is left to its own session
DECIDED_GRACE_S = 30.0


def resolve_prepared(
    sec: Section, dsn: str, timeout_s: float = 60.0, *, decided_grace_s: float = DECIDED_GRACE_S
) -> list[tuple[str, str]]:
    """Finish ringq's prepared transactions whose client is gone: commit if
    the coordinator recorded its decision, else roll back once older than
    ``timeout_s`` seconds; then decide their slots from the rows. Returns
    [(gid, "commit" | "rollback")].

    A prepared transaction is ringq's if it logged slots (``tpc_log``), has a
    decision (``tpc_decisions``), or is named by ``Session.xid``; any other
    is the user's own and never touched. A branch with queue operations is
    left alone while a live session owns its slots; one without has no slots
    to tell, so it is committed only once its decision is ``decided_grace_s``
    seconds old (rolled back, undecided, after ``timeout_s`` as the others).
    Decisions whose gid is no longer prepared are deleted once older than
    ``timeout_s`` (their transaction committed; the session died before
    clearing them), and slot logs of transactions no longer prepared once
    no live session owns their slots.
    """
    done: list[tuple[str, str]] = []
    with _connect(dsn) as conn:
        conn.execute(_Q["tpc_decisions_expire"], (timeout_s,))
        _forget_unprepared_logs(sec, conn)
        found = conn.execute(_Q["tpc_prepared"]).fetchall()
        rows = [
            (gid, age, decided)
            for gid, age, decided, decided_age, logged in found
            if logged
            or (decided and decided_age >= decided_grace_s)
            or (not decided and is_ringq_gid(gid))
        ]
        if not rows:
            return done
        infos = queue_infos(conn)
        for gid, age, decided in rows:
            slots = conn.execute(_Q["tpc_slots"], (gid,)).fetchall()
            # A live client still owns these slots: it is between prepare and commit.
            live = False
            ops: list[Op] = []
            for qid, slot, seq, kind in slots:
                qidx = sec.find_queue(qid)
                if qidx is None or qid not in infos:
                    continue
                ring = Ring(sec, qidx)
                if _owned_by_live_client(sec, ring, slot):
                    live = True
                    break
                ops.append(Op(ring, infos[qid], int(slot), int(seq), OpKind(str(kind))))
            if live:
                continue
            if decided:
                verb = "commit"
            elif age >= timeout_s:
                verb = "rollback"
            else:
                continue
            conn.execute(
                sql.SQL(_Q["commit_prepared" if verb == "commit" else "rollback_prepared"]).format(
                    gid=sql.Literal(gid)
                )
            )
            if ops:
                if verb == "rollback":
                    _strike_dequeues(conn, ops)  # a delivery that did not commit
                decide_ops(sec, conn, ops, HELD, why=f"prepared-{verb} gid={gid}")
            conn.execute(_Q["tpc_forget"], (gid,))
            conn.execute(_Q["tpc_undecide"], (gid,))
            done.append((gid, verb))
            logger.warning("ringq: prepared transaction %s resolved: %s", gid, verb)
    return done


def _owned_by_live_client(sec: Section, ring: Ring, slot: int) -> bool:
    """Whether a live session's current token owns ``slot``."""
    cidx = sec.token_holder(sec.owner_w[ring.base + slot])
    return (
        cidx is not None
        and sec.c(cidx, L.C_STATE) == L.CS_ACTIVE
        and pid_alive(sec.c(cidx, L.C_PID))
    )


def _forget_unprepared_logs(sec: Section, conn: psycopg.Connection[Any]) -> None:
    """Delete the slot logs of transactions that are not prepared and whose
    slots no live session owns: left behind by a session that died before
    its PREPARE, or lost its connection before it cleared the log after the
    commit. Left, such a log would make a later transaction that reuses the
    gid look like ringq's (rolled back after the timeout, even an
    application's own) and tell recovery slots and sequences of the past.
    A live owner is between its log and its PREPARE (or its COMMIT PREPARED
    and clearing the log): its log stays."""
    slots_of: dict[str, list[tuple[int, int]]] = {}
    for gid, qid, slot in conn.execute(_Q["tpc_log_unprepared"]).fetchall():
        slots_of.setdefault(gid, []).append((qid, slot))
    stale = []
    for gid, slots in slots_of.items():
        rings = ((sec.find_queue(qid), slot) for qid, slot in slots)
        if not any(
            qidx is not None and _owned_by_live_client(sec, Ring(sec, qidx), slot)
            for qidx, slot in rings
        ):
            stale.append(gid)
    if stale:
        conn.execute(_Q["tpc_forget_unprepared"], (stale,))
        logger.info("ringq: slot logs of %d transactions no longer prepared deleted", len(stale))


def queue_room(sec: Section, qid: int) -> int | None:
    """Free slots of queue ``qid`` in the section now, after advancing its tail
    over consumed slots; None if the queue is not loaded in the section."""
    qidx = sec.find_queue(qid)
    if qidx is None:
        return None
    ring = Ring(sec, qidx)
    sec.lock_queue(qidx)
    try:
        freed = ring.reclaim()
        room = ring.cap - (ring.head - ring.tail)
        waiters = sec.q(qidx, L.Q_WAIT_SPACE)
    finally:
        sec.unlock_queue(qidx)
    if freed and waiters:
        sec.post(ring.qid, "s", min(freed, waiters))
    return room
