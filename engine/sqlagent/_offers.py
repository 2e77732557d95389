"""The SQL path's agent: it sets ready entries aside for SQL consumers
(``ringq.dequeue``, for other hosts and languages) and decides them from the rows.

SQL cannot reach the global section, so a linked process (the monitor) acts
for SQL consumers. :class:`SqlAgent` claims ready entries in the section under
the owner ``OWNER_SQL`` (linked clients read past them, as past any locked
entry) and lists them in ``ringq.offers``; ``ringq.dequeue`` takes listed
entries by updating their ring rows in the caller's transaction, as a linked
dequeue does. On each pass the agent reads the rows back:

- consumed (state 2, committed): unlisted and finished in the section;
- a take that did not commit (the row's ``xmax`` holds its xid, and no take
  holds the row now): struck, as a linked rollback is (``deliveries + 1``;
  at ``max_deliveries`` the entry moves to the exceptions), and offered again
  at its place; takers pass such a row until then, so a delivery is never
  missed by a take that came first;
- untaken while no SQL consumer asked for :data:`DEMAND_S`: taken back (under
  an advisory lock every take holds shared, so no take under way can still
  see them) and given back to linked consumers.

The rows decide: a section rebuilt from them locks the listed entries for
SQL again (``load_rows(offered=...)``); entries locked for SQL but not listed
(the agent died between its claim and its insert) are given back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from ..driver import QUERIES as _Q
from ..driver import queue_table
from ..ring import POISON_REASON, OpKind, QueueInfo, Ring, RowState, after_finish
from ..rows import load_queue
from ..rows.recovery import queue_infos
from ..section import Section
from ..section import layout as L

logger = logging.getLogger("ringq.sql")

# Entries kept set aside per queue: four times what SQL consumers took since
# the last pass, within these bounds; topped up once fewer than 3/4 wait.
OFFER_MIN = 64
OFFER_MAX = 1024
ROLE_ASK_NS = 50_000_000  # single: how long linked dequeuers leave a free role to the SQL path
DEMAND_S = 5.0  # a queue keeps entries set aside this long after its last ask or take
# Between passes while SQL consumers are busy. Starved (asked, nothing takeable
# set aside): new entries are seen only by looking, so look often. Supplied:
# a consumer that runs out asks at once (ringq_want wakes the agent), so a
# pass is needed only to top up and to finish what was taken; a pass costs the
# monitor and its backend about a millisecond of CPU, which the consumers'
# own backends need on a small host.
STARVED_WAIT_S = 0.002
SUPPLIED_WAIT_S = 0.010
SCAN_S = 1.0  # how often an idle agent looks for queues with entries set aside
WANT_CHANNEL = "ringq_want"  # ringq.dequeue() found nothing: payload, the queue's name
READY_CHANNEL = "ringq_ready"  # the agent set entries aside: payload, the queue's name


@dataclass
class AgentFigures:
    """What the agent did since it started."""

    offered: int = 0
    taken: int = 0
    struck: int = 0
    poisoned: int = 0
    withdrawn: int = 0
    given_back: int = 0  # locked for SQL but not listed (an agent died mid-offer)
    lease_expired: int = 0  # SQL consumers' backends ended for holding an entry too long

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class SqlAgent:
    """One database's agent for SQL consumers; :meth:`run` is one pass, on an
    autocommit connection of the database whose section ``sec`` is."""

    clock: Callable[[], float] = time.monotonic
    figures: AgentFigures = field(default_factory=AgentFigures)
    _asked: dict[str, float] = field(default_factory=dict)  # queue name -> last ask or take
    _listed: set[int] = field(default_factory=set)  # queue ids with entries set aside
    _scanned: float = float("-inf")
    _infos: dict[int, QueueInfo] = field(default_factory=dict)
    _target: dict[int, int] = field(default_factory=dict)  # queue id -> entries to keep aside

    @staticmethod
    def prepare(conn: psycopg.Connection[Any]) -> None:
        """Make ``conn`` the agent's: LISTEN for asks, commit without waiting for the flush."""
        conn.execute(_Q["agent_listen"])
        conn.execute(_Q["agent_async_commit"])

    def forget(self) -> None:
        """Look at every queue again on the next pass (a new connection: asks
        sent while there was none are lost)."""
        self._scanned = float("-inf")

    def asked(self, queue: str) -> None:
        """A SQL consumer found nothing in ``queue`` (its NOTIFY on ``ringq_want``)."""
        self._asked[queue] = self.clock()

    def run(self, sec: Section, conn: psycopg.Connection[Any]) -> float | None:
        """One pass over the queues SQL consumers use; returns when to come
        back (seconds): :data:`STARVED_WAIT_S` while a queue SQL consumers
        asked for has nothing takeable set aside (new entries are seen only by
        looking), :data:`SUPPLIED_WAIT_S` while they have entries set aside
        (one that runs out asks at once, ``ringq_want``), None when none is
        busy."""
        now = self.clock()
        wanted = {n for n, t in self._asked.items() if now - t < DEMAND_S}
        if now - self._scanned >= SCAN_S:
            self._listed = {int(r[0]) for r in conn.execute(_Q["offers_queues"]).fetchall()}
            self._scanned = now
            self._infos = queue_infos(conn)
            self._reconcile_all(sec, conn)
            self._end_overdue(conn)
        if wanted and not {i.name for i in self._infos.values()} >= wanted:
            self._infos = queue_infos(conn)
        busy = starved = False
        for info in list(self._infos.values()):
            if info.id in self._listed or info.name in wanted:
                pace = self._pass_queue(sec, conn, info, info.name in wanted)
                busy |= pace is not None
                starved |= pace == STARVED_WAIT_S
        for name in [n for n, t in self._asked.items() if now - t >= DEMAND_S]:
            del self._asked[name]
        if starved:
            return STARVED_WAIT_S
        return SUPPLIED_WAIT_S if busy else None

    # -- one queue --------------------------------------------------------------------

    def _pass_queue(
        self, sec: Section, conn: psycopg.Connection[Any], info: QueueInfo, wanted: bool
    ) -> float | None:
        """One queue's pass; returns its pace (see :meth:`run`)."""
        qidx = sec.find_queue(info.id)
        if qidx is None:
            qidx = load_queue(sec, conn, info)
        ring = Ring(sec, qidx)
        table = queue_table(info.name)
        runs: list[tuple[int, int, int]] = []  # (seq, slot, n) listed
        changed: list[tuple[Any, ...]] = []  # listed entries not plainly takeable now
        held = 0  # listed entries a take under way holds
        if info.id in self._listed:  # only this agent lists: nothing listed, nothing to read
            for kind, seq, slot, n, state, touched, due_us, due, live in conn.execute(
                sql.SQL(_Q["offers_changes"]).format(table=table), {"queue_id": info.id}
            ).fetchall():
                if kind == 0:
                    runs.append((int(seq), int(slot), int(n)))
                elif live and state == RowState.QUEUED:
                    held += 1  # a take under way: decided on a later pass
                else:
                    changed.append((int(seq), int(slot), state, touched, due_us, due))
        total = sum(n for _seq, _slot, n in runs)
        waiting = total - held - len(changed)  # the entries not shipped are takeable now
        pending: list[Write] = []  # sent with the offer's writes: one round trip for both
        done: list[tuple[int, int]] = []  # consumed, or no longer at that seq
        aborted: list[tuple[int, int]] = []
        for seq, slot, state, touched, _due_us, due in changed:
            if state is None or state != RowState.QUEUED:
                done.append((slot, seq))
            elif touched:
                aborted.append((slot, seq))
            elif due:
                waiting += 1  # fell due between the query's two looks at the clock
        poisoned = self._strike(conn, info, table, aborted) if aborted else []
        if done or poisoned:
            self._finish(sec, ring, info, done + poisoned)
            gone = {seq for _slot, seq in done + poisoned}
            pending = _relist_writes(info, _minus(runs, gone))
            self.figures.taken += len(done)
            self._asked[info.name] = self.clock()
            wanted = True
        listed = total - len(done) - len(poisoned)
        target = self._target.get(info.id, OFFER_MIN)
        if done:
            target = min(OFFER_MAX, max(target, 4 * len(done)))
        else:
            target = max(OFFER_MIN, target - target // 16)  # a quiet pass: keep less aside
        self._target[info.id] = target
        if wanted and waiting < target - target // 4:
            offered = self._offer(sec, conn, ring, info, target - waiting, pending)
            listed += offered
            waiting += offered
        else:
            _send(conn, pending)
            if not wanted and waiting:
                listed -= self._withdraw(sec, conn, ring, info, table)
        if listed > 0:
            self._listed.add(info.id)
        else:
            self._listed.discard(info.id)
        if wanted and not waiting:
            return STARVED_WAIT_S
        return SUPPLIED_WAIT_S if wanted or listed > 0 else None

    def _strike(
        self, conn: psycopg.Connection[Any], info: QueueInfo, table: sql.Composable,
        aborted: list[tuple[int, int]],
    ) -> list[tuple[int, int]]:
        """Count the deliveries of takes that did not commit; returns the
        entries that reached ``max_deliveries`` (moved to the exceptions)."""
        slots = [s for s, _q in aborted]
        seqs = [q for _s, q in aborted]
        with conn.transaction():
            # Durable at once, whatever the connection's setting: a strike lost
            # in a crash after its row was cleaned would be counted twice.
            conn.execute(_Q["agent_sync_commit"])
            free = conn.execute(
                sql.SQL(_Q["offers_aborted"]).format(table=table), (slots, seqs)
            ).fetchall()
            if not free:
                return []  # all still held by live takes
            struck = conn.execute(sql.SQL(_Q["strike"]).format(table=table), {
                "max_deliveries": info.max_deliveries,
                "slots": [int(r[0]) for r in free],
                "seqs": [int(r[1]) for r in free],
                "queue_id": info.id,
                "reason": POISON_REASON,
            }).fetchall()
        again = [r for r in struck if r[2] == RowState.QUEUED]
        if again:
            with conn.transaction():
                conn.execute(_Q["agent_sync_commit"])
                conn.execute(sql.SQL(_Q["offers_clean"]).format(table=table),
                             ([int(r[0]) for r in again], [int(r[1]) for r in again]))
        self.figures.struck += len(struck)
        out = [(int(r[0]), int(r[1])) for r in struck if r[2] == RowState.CONSUMED]
        self.figures.poisoned += len(out)
        return out

    def _finish(
        self, sec: Section, ring: Ring, info: QueueInfo, done: list[tuple[int, int]]
    ) -> None:
        """Finish consumed entries in the section; wake blocked enqueuers (as a
        linked commit's finish does: one reclaim, the full period closed)."""
        exclusive = info.dequeue_mode == "single"
        sec.lock_queue(ring.qidx)
        try:
            n = ring.finish_consumed(done, L.OWNER_SQL, exclusive=exclusive)
            _ready, space = after_finish(ring, 0, n)
            ready = self._role_freed(ring, exclusive)
        finally:
            sec.unlock_queue(ring.qidx)
        if space:
            sec.post(ring.qid, "s", space)
        if ready:
            sec.post(ring.qid, "r", ready)

    @staticmethod
    def _role_freed(ring: Ring, exclusive: bool) -> int:
        """Linked dequeuers to wake when the SQL path let go of a ``single``
        queue's dequeuer role (it has nothing set aside any more)."""
        if not exclusive or ring.role_owner() != 0:
            return 0
        return min(1, ring.waiters(OpKind.DEQUEUE))

    def _offer(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo, n: int,
        before: list[Write],
    ) -> int:
        """Set up to ``n`` ready entries aside, the writes ``before`` first in
        the same transaction; returns how many."""
        slots = seqs = np.zeros(0, dtype=np.int64)
        try:
            slots, seqs = self._claim(sec, ring, info, n)
        finally:
            if not slots.size:
                _send(conn, before)
        if not slots.size:
            return 0
        table = queue_table(info.name)
        runs = _runs(slots, seqs)
        try:
            _send(conn, [
                *before,
                (sql.SQL(_Q["offers_clean_runs"]).format(table=table), runs),
                (_Q["offers_runs"], {"queue_id": info.id, **runs}),
                (_Q["offers_ready"], (info.name,)),
            ])
        except BaseException:
            self._give_back(sec, ring, info,
                            [(sl, sq, 0) for sl, sq in zip(slots.tolist(), seqs.tolist(),
                                                           strict=True)])
            raise
        self.figures.offered += int(slots.size)
        return int(slots.size)

    @staticmethod
    def _claim(
        sec: Section, ring: Ring, info: QueueInfo, n: int
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Lock up to ``n`` ready entries for the SQL path in the section:
        their (slots, seqs)."""
        none = np.zeros(0, dtype=np.int64)
        exclusive = info.dequeue_mode == "single"
        sec.lock_queue(ring.qidx)
        try:
            if exclusive:
                # single: the role takes turns between the kinds. Held by a
                # linked dequeuer: ask for it (the next linked claim to find it
                # free leaves it to us). Ours while linked dequeuers wait: let
                # what is set aside drain, then theirs. Free while they wait:
                # theirs, unless we asked first.
                role = ring.role_owner()
                if role not in (0, L.OWNER_SQL):
                    ring.ask_role_for_sql(ROLE_ASK_NS)
                    return none, none
                linked_wait = ring.waiters(OpKind.DEQUEUE) > 0
                if linked_wait and (role == L.OWNER_SQL or not ring.role_asked_for_sql()):
                    return none, none
            slots, seqs = ring.claim_batch(L.OWNER_SQL, 0, n, exclusive=exclusive)
            if exclusive and slots.size:
                ring.Q[ring.qb + L.Q_SQL_ASKS_ROLE_NS] = 0  # our turn came
        finally:
            sec.unlock_queue(ring.qidx)
        return slots, seqs

    @staticmethod
    def _relist(
        conn: psycopg.Connection[Any], info: QueueInfo, runs: list[tuple[int, int, int]]
    ) -> None:
        """Write the queue's listing again as ``runs`` (seq, slot, n), in a
        transaction (a savepoint in the caller's)."""
        with conn.transaction():
            for query, params in _relist_writes(info, runs):
                conn.execute(query, params)

    def _withdraw(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo,
        table: sql.Composable,
    ) -> int:
        """Take back untaken entries of a queue no SQL consumer asked for lately;
        returns how many."""
        with conn.transaction():
            got = conn.execute(_Q["offers_quiet"], (info.id,)).fetchone()
            if not got or not got[0]:
                return 0  # a take is under way: later
            # Read again under the lock: a take may have committed since.
            rows = conn.execute(
                sql.SQL(_Q["offers_state"]).format(table=table), (info.id,)
            ).fetchall()
            back = [(int(slot), int(seq), int(due_us or 0))
                    for seq, slot, state, touched, due_us, _due in rows
                    if state == RowState.QUEUED and not touched]
            if not back:
                return 0
            # What stays listed: takes under way or not counted yet (touched),
            # and what was consumed since (the next pass finishes it).
            gone = {seq for _slot, seq, _due in back}
            keep = [r for r in rows if r[0] not in gone]  # (seq, slot, ...)
            kept = _runs(np.array([r[1] for r in keep], dtype=np.int64),
                         np.array([r[0] for r in keep], dtype=np.int64))
            self._relist(conn, info, list(zip(kept["run_seqs"], kept["run_slots"],
                                              kept["run_ns"], strict=True)))
        self._give_back(sec, ring, info, back)
        self.figures.withdrawn += len(back)
        return len(back)

    def _give_back(
        self, sec: Section, ring: Ring, info: QueueInfo, entries: list[tuple[int, int, int]]
    ) -> int:
        """Make entries (slot, seq, due time in epoch µs or 0) locked for SQL
        ready for linked consumers again, or waiting if not due yet (a retry's
        backoff); no delivery counted: none took them."""
        exclusive = info.dequeue_mode == "single"
        n = 0
        sec.lock_queue(ring.qidx)
        try:
            for slot, seq, due_us in entries:
                if ring.held_by(slot, L.OWNER_SQL) and ring.seq_of(slot) == seq:
                    ring.finish_dequeue(slot, consumed=False, exclusive=exclusive,
                                        due_us=due_us)
                    # Not a dequeue nor a rollback: take back what the claim and
                    # the finish counted.
                    ring.Q[ring.qb + L.Q_N_DEQ] -= 1
                    ring.Q[ring.qb + L.Q_N_DEQ_ROLLBACK] -= 1
                    n += 1
            wake = min(n, ring.waiters(OpKind.DEQUEUE))
        finally:
            sec.unlock_queue(ring.qidx)
        if wake:
            sec.post(ring.qid, "r", wake)
        return n

    def _end_overdue(self, conn: psycopg.Connection[Any]) -> None:
        """End the backends of SQL consumers holding a set-aside entry past
        the queue's lease (as the monitor ends linked sessions): their
        transaction rolls back and the entry comes back counted."""
        for info in self._infos.values():
            if info.id not in self._listed or info.lease <= 0:
                continue
            stmt = sql.SQL(_Q["offers_overdue"]).format(table=queue_table(info.name))
            for (pid,) in conn.execute(stmt, (info.id, info.lease)).fetchall():
                conn.execute(_Q["offers_end"], (pid,))
                self.figures.lease_expired += 1
                logger.warning("ringq: SQL consumer backend %s held an entry of queue %s past "
                               "its lease (%g s): ended", pid, info.name, info.lease)

    def _reconcile_all(self, sec: Section, conn: psycopg.Connection[Any]) -> None:
        """Settle entries locked for SQL in a queue with none listed (an agent
        that died between its claim and its listing, or between a withdraw's
        commit and its give-back) by their rows: a queued one is given back,
        waiting if its row's due time (a struck entry's backoff) is still to
        come; one consumed (or no longer at that seq) is finished."""
        listed_ids = self._listed
        for qidx in sec.loaded_queues():
            ring = Ring(sec, qidx)
            if ring.qid in listed_ids:
                continue
            info = self._infos.get(ring.qid)
            if info is None:
                continue
            sec.lock_queue(qidx)
            try:
                owners = sec.owner[ring.base : ring.base + ring.cap]
                cand = np.flatnonzero(owners == L.OWNER_SQL)
                lost = {int(s): ring.seq_of(int(s)) for s in cand
                        if ring.held_by(int(s), L.OWNER_SQL)}
            finally:
                sec.unlock_queue(qidx)
            if not lost:
                continue
            # Nothing listed, so no take can hold them (a take needs the listing).
            rows = conn.execute(sql.SQL(_Q["rows"]).format(table=queue_table(info.name)),
                                (list(lost),)).fetchall()
            queued = {int(slot): int(due or 0) for slot, state, seq, _group, due in rows
                      if state == RowState.QUEUED and seq == lost[slot]}
            back = [(slot, seq, queued[slot]) for slot, seq in lost.items() if slot in queued]
            done = [(slot, seq) for slot, seq in lost.items() if slot not in queued]
            if done:
                self._finish(sec, ring, info, done)
            self.figures.given_back += self._give_back(sec, ring, info, back)
            logger.warning("ringq: %d entries of queue %s locked for SQL consumers but not "
                           "listed were settled by their rows (%d given back)", len(lost),
                           info.name, len(back))


Write = tuple[str | sql.Composed, Any]  # a statement and its parameters


def _send(conn: psycopg.Connection[Any], writes: list[Write]) -> None:
    """Run ``writes`` in one round trip, as one transaction: in pipeline mode
    on the agent's autocommit connection, the statements up to the pipeline's
    Sync are one implicit transaction, all or nothing (a failed one raises
    here, and none of them took effect)."""
    if not writes:
        return
    with conn.pipeline():
        for query, params in writes:
            conn.execute(query, params)


def _relist_writes(info: QueueInfo, runs: list[tuple[int, int, int]]) -> list[Write]:
    """The writes that make the queue's listing ``runs`` (seq, slot, n): a
    write per run, whatever left the listing."""
    writes: list[Write] = [(_Q["offers_clear"], (info.id,))]
    if runs:
        writes.append((_Q["offers_runs"], {
            "queue_id": info.id,
            "run_seqs": [r[0] for r in runs],
            "run_slots": [r[1] for r in runs],
            "run_ns": [r[2] for r in runs],
        }))
    return writes


def _runs(slots: np.ndarray[Any, Any], seqs: np.ndarray[Any, Any]) -> dict[str, list[int]]:
    """The entries at ``slots`` with ``seqs`` (int64 arrays, any order) as
    runs of consecutive seqs at consecutive slots (so a run never wraps past
    the ring's last slot: its next seq is at slot 0): ``offers_runs``' and
    ``offers_clean_runs``' parameters."""
    if not seqs.size:
        return {"run_seqs": [], "run_slots": [], "run_ns": []}
    order = np.argsort(seqs, kind="stable")
    seqs, slots = seqs[order], slots[order]
    starts = np.flatnonzero(np.r_[True, (np.diff(seqs) != 1) | (np.diff(slots) != 1)])
    ns = np.diff(np.r_[starts, seqs.size])
    return {"run_seqs": seqs[starts].tolist(), "run_slots": slots[starts].tolist(),
            "run_ns": ns.tolist()}


def _minus(runs: list[tuple[int, int, int]], gone: set[int]) -> list[tuple[int, int, int]]:
    """``runs`` (seq, slot, n) less the entries whose seq is in ``gone``, as
    runs again (a run split where an entry left it, runs that meet joined, as
    ``_runs`` makes them); the work is in the runs and the entries gone, not
    in the entries listed."""
    out: list[tuple[int, int, int]] = []
    for seq, slot, n in sorted(runs):
        cut = sorted(g for g in gone if seq <= g < seq + n) if gone else []
        start = seq
        for g in [*cut, seq + n]:
            if g <= start:
                start = max(start, g + 1)
                continue
            at = slot + (start - seq)
            if out and out[-1][0] + out[-1][2] == start and out[-1][1] + out[-1][2] == at:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + g - start)  # one run again
            else:
                out.append((start, at, g - start))
            start = g + 1
    return out
