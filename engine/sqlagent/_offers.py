"""The SQL path's agent: it lists ready entries for SQL consumers
(``ringq.dequeue``, for other hosts and languages) and decides them from the rows.

SQL cannot reach the global section, so a linked process (the monitor) acts
for SQL consumers. :class:`SqlAgent` claims ready entries in the section under
the owner ``OWNER_SQL`` (linked clients read past them, as past any locked
entry) and lists them in ``ringq.offers`` as chunks of at most :data:`CHUNK`
consecutive entries. A take (``ringq.dq_<name>``) claims whole chunks with
``FOR UPDATE SKIP LOCKED``, deletes them (or shortens the last it takes part
of) and consumes their ring rows by one range each, all or nothing, in the
caller's transaction. On each pass the agent reads the listing back:

- entries it listed that are no longer listed were taken by a take that
  committed: checked by their rows (only those not consumed come back from
  the query: given back), then finished in the section;
- a chunk whose xmax is set and that no take holds was touched by a take that
  did not commit: the rows that take updated are struck, as a linked rollback
  is (``deliveries + 1``; at ``max_deliveries`` the entry moves to the
  exceptions), and the chunk goes back to the section (waiting out the
  queue's backoff); a ``single`` queue gives back everything listed with it,
  so that the order holds;
- SQL consumers waiting (``ringq.waiters``) are woken one per takeable chunk;
- untaken while no SQL consumer asked for :data:`DEMAND_S`: taken back (the
  chunks no take holds, locked with SKIP LOCKED; a ``single`` queue's under
  the advisory lock its one taker holds) and given back to linked consumers.

The rows decide: a section rebuilt from them locks the listed entries for
SQL again (``load_rows(offered=...)``); entries the section holds for SQL that
are not listed (the agent died between its claim and its listing, or a take
committed while it was away) are settled by their rows on the agent's first
look at the queue.
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
from ..driver.errors import SchemaMissing
from ..ring import POISON_REASON, OpKind, QueueInfo, Ring, RowState, after_finish
from ..rows import load_queue
from ..rows.recovery import history_of, queue_infos
from ..section import Section
from ..section import layout as L
from ._puts import SqlPuts
from ._runs import (
    NONE,
    Entries,
    Runs,
    as_lists,
    expand,
    held,
    indexed,
    post,
    runs_of,
    send,
    sort_listing,
    split_gone,
)

logger = logging.getLogger("ringq.sql")

# Entries kept listed per queue: four times what SQL consumers took since the
# last pass, within these bounds; topped up once fewer than 3/4 are takeable.
OFFER_MIN = 64
OFFER_MAX = 4096
CHUNK = 16  # entries per listed chunk at most
ROLE_ASK_NS = 50_000_000  # single: how long linked dequeuers leave a free role to the SQL path
DEMAND_S = 5.0  # a queue keeps entries set aside this long after its last ask or take
# Between passes while SQL consumers are busy. Starved (asked, nothing takeable
# listed): new entries are seen only by looking, so look often. Supplied: a
# consumer that runs out asks at once (ringq_want wakes the agent), so a pass
# is needed only to top up and to finish what was taken.
STARVED_WAIT_S = 0.002
SUPPLIED_WAIT_S = 0.010
QUIET_LOOK_S = 0.1  # a queue with nothing listed nor ready: its rows read this often at most
STALE_WAIT_S = 0.05  # a section of another history: until it is replaced
SCAN_S = 1.0  # how often an idle agent looks for queues with entries set aside
WANT_CHANNEL = "ringq_want"  # ringq.dequeue() found nothing: payload, the queue's name
# A waiting SQL consumer hears its wake-up on READY_CHANNEL + "_" + its backend's
# pid (payload: the queue's name); ringq.dequeue() LISTENs on it for the caller.
READY_CHANNEL = "ringq_ready"

@dataclass
class AgentFigures:
    """What the agent did since it started."""

    offered: int = 0
    taken: int = 0
    struck: int = 0
    poisoned: int = 0
    withdrawn: int = 0
    given_back: int = 0  # held for SQL but not listed, nor consumed (an agent died mid-offer)
    lease_expired: int = 0  # SQL consumers' backends ended for holding an entry too long
    woken: int = 0  # waiting SQL consumers notified

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


PUT_CHANNEL = "ringq_put"  # ringq.enqueue_many put a batch: payload, the queue's name


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
    _target: dict[int, int] = field(default_factory=dict)  # queue id -> entries to keep listed
    # queue id -> the entries the agent listed and has not settled (seqs, slots)
    _mine: dict[int, Entries] = field(default_factory=dict)
    _looked: dict[int, float] = field(default_factory=dict)  # queue id -> its last listing read
    _dry: set[int] = field(default_factory=set)  # queue ids with nothing takeable at that read
    puts: SqlPuts = field(default_factory=SqlPuts)  # the producers' side
    _held_sql: set[int] = field(default_factory=set)  # queues the section holds for SQL (a scan)
    # (system identifier, timeline) of the server the connection reaches (read once per connection)
    _history: tuple[int, int] | None = None
    _generation: int | None = None  # the section the agent's memory describes (H_GENERATION)

    @staticmethod
    def prepare(conn: psycopg.Connection[Any]) -> None:
        """Make ``conn`` the agent's: LISTEN for asks and puts, commit without
        waiting for the flush."""
        row = conn.execute(_Q["agent_schema"]).fetchone()
        if not row or not row[0]:
            raise SchemaMissing("the SQL path's tables (ringq.waiters, ringq.slots) are "
                                 "missing: run `ringq db upgrade`")
        for listen in ("agent_listen", "agent_listen_puts"):
            conn.execute(_Q[listen])
        conn.execute(_Q["agent_async_commit"])

    def forget(self) -> None:
        """Look at every queue again on the next pass, settling what the
        section holds for SQL from the rows (a new connection: asks sent while
        there was none are lost)."""
        self._scanned = float("-inf")
        self._mine.clear()
        self._looked.clear()
        self._history = None
        self.puts.forget()

    def asked(self, queue: str) -> None:
        """A SQL consumer found nothing in ``queue`` (its NOTIFY on ``ringq_want``)."""
        self._asked[queue] = self.clock()

    def heard(self, channel: str, queue: str) -> None:
        """A notification on the agent's connection: a SQL consumer's ask
        (``ringq_want``) or a SQL producer's batch (``ringq_put``)."""
        if channel == PUT_CHANNEL:
            self.puts.asked(queue)
        elif channel == WANT_CHANNEL:
            self.asked(queue)

    def run(self, sec: Section, conn: psycopg.Connection[Any]) -> float | None:
        """One pass over the queues SQL consumers use; returns when to come
        back (seconds): :data:`STARVED_WAIT_S` while a queue SQL consumers
        asked for has nothing takeable listed (new entries are seen only by
        looking), :data:`SUPPLIED_WAIT_S` while they have entries listed (one
        that runs out asks at once, ``ringq_want``), None when none is busy."""
        generation = int(sec.generation)
        if generation != self._generation:
            # Another section (replaced after a fail-over, or removed): what
            # the agent remembers describes the old one; look again from this
            # one's bits and the rows.
            if self._generation is not None:
                self.forget()
            self._generation = generation
        if self._history is None:
            self._history = history_of(conn)
        # A section of another history (the database failed over and no
        # client here has replaced it yet; the monitor does at once): nothing
        # is set aside, reserved or given back in it (its bits describe a
        # history the rows no longer have: a reserved slot's entry was lost
        # that way, and entries given back to it stayed held in the new one).
        if not sec.follow_history(*self._history):
            return STALE_WAIT_S
        now = self.clock()
        if now - self._scanned >= SCAN_S:
            self._scanned = now
            self._infos = queue_infos(conn)
            names = {i.id: i.name for i in self._infos.values()}
            self._listed = set()
            for qid, waited in conn.execute(_Q["offers_queues"]).fetchall():
                self._listed.add(int(qid))
                if waited and int(qid) in names:
                    self._asked.setdefault(names[int(qid)], now)
            held_sql = self._held_queues(sec)
            for qid in held_sql - set(self._mine):
                self._looked.pop(qid, None)  # held for SQL, not by this agent's listing: settle
            self._listed |= held_sql | set(self._mine)
            self._held_sql = held_sql  # a producers' pass settles any reserved among them
            self._end_overdue(conn)
            conn.execute(_Q["waiters_gone"])  # a dead waiter's row would keep its queue wanted
        wanted = {n for n, t in self._asked.items() if now - t < DEMAND_S}
        putting = self.puts.busy(now)
        if (wanted | putting) and not {i.name for i in self._infos.values()} >= wanted | putting:
            self._infos = queue_infos(conn)
        busy = starved = False
        reserved = self.puts.queues()
        for info in list(self._infos.values()):
            consumers = info.id in self._listed or info.name in wanted
            producers = info.id in reserved or info.name in putting or info.id in self._held_sql
            if not (consumers or producers):
                continue
            ring = self._ring(sec, conn, info)
            if producers:
                # First: what SQL producers put is published before it is offered.
                busy |= self.puts.pass_queue(sec, conn, ring, info, info.name in putting)
            if consumers:
                pace = self._pass_queue(sec, conn, ring, info, info.name in wanted)
                busy |= pace is not None
                starved |= pace == STARVED_WAIT_S
        self._held_sql = set()  # settled by this pass
        for name in [n for n, t in self._asked.items() if now - t >= DEMAND_S]:
            del self._asked[name]
        if starved:
            return STARVED_WAIT_S
        return SUPPLIED_WAIT_S if busy else None

    # -- one queue --------------------------------------------------------------------

    @staticmethod
    def _ring(sec: Section, conn: psycopg.Connection[Any], info: QueueInfo) -> Ring:
        """The queue's ring in the section (loaded from its rows if it is not yet)."""
        qidx = sec.find_queue(info.id)
        if qidx is None:
            qidx = load_queue(sec, conn, info)
        return Ring(sec, qidx)

    def _pass_queue(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo,
        wanted: bool,
    ) -> float | None:
        """One queue's pass for SQL consumers; returns its pace (see :meth:`run`)."""
        table = queue_table(info.name)
        mine = self._mine.get(info.id)
        now = self.clock()
        looked = self._looked.get(info.id)
        # Nothing takeable listed at the last look (none listed, or every chunk
        # taken): while the section has nothing ready either there is nothing
        # to list, take back or wake, and what was taken is settled at the
        # next look; look at the rows only now and then (a starved queue is
        # passed every STARVED_WAIT_S, at 10 us a pass where a look costs a
        # query and ~1 ms of the agent's CPU).
        if (looked is not None and (mine is None or info.id in self._dry)
                and ring.Q[ring.qb + L.Q_DEPTH_HINT] <= 0 and now - looked < QUIET_LOOK_S):
            return STARVED_WAIT_S if wanted else None
        if mine is None:  # none listed; at the first look, what the section holds for SQL
            mine = NONE if looked is not None else held(sec, ring, reserved=False)
        self._looked[info.id] = now
        rows = conn.execute(_Q["offers_look"], {"queue_id": info.id}).fetchall()
        waiters, want = next(((int(r[1]), int(r[2])) for r in rows if r[0] == 1), (0, 0))
        if waiters:
            # A waiter is an ask: only the queue's first waiter sends
            # ringq_want, so the others keep the queue wanted from here.
            self._asked[info.name] = now
        chunks, free, touched = sort_listing([r[1:] for r in rows if r[0] == 0])
        gone, mine = split_gone(mine, chunks)
        taken = self._settle_gone(sec, conn, ring, info, table, gone) if gone[0].size else 0
        unlisted: set[int] = set()
        if touched:
            unlisted = self._strike(sec, conn, ring, info, table, touched)
        if unlisted:
            chunks = [c for c in chunks if c[0] not in unlisted]
            free = [c for c in free if c[0] not in unlisted]
            keep = np.isin(mine[0], expand(chunks)[0])
            mine = (mine[0][keep], mine[1][keep])
        if taken:
            self._asked[info.name] = self.clock()
            wanted = True
        wanted = wanted or waiters > 0
        takeable = sum(n for _seq, _slot, n in free)
        target = self._target.get(info.id, OFFER_MIN)
        if taken:
            target = min(OFFER_MAX, max(target, 4 * taken))
        else:
            target = max(OFFER_MIN, target - target // 16)  # a quiet pass: keep less aside
        self._target[info.id] = target
        # Topped up to the target once a quarter of it was taken; and at once
        # what waiting consumers asked for (they are idle now), within the
        # most ever kept aside from linked consumers.
        short = max(target - takeable if takeable < target - target // 4 else 0,
                    min(want, OFFER_MAX) - takeable)
        if wanted and short > 0:
            new = self._offer(sec, conn, ring, info, short, takeable if waiters else 0)
            if new[0].size:
                mine = (np.concatenate([mine[0], new[0]]), np.concatenate([mine[1], new[1]]))
                takeable += int(new[0].size)
        elif waiters and free:
            self._wake(conn, info, takeable)
        elif not wanted and takeable > 0:
            back = self._withdraw(sec, conn, ring, info)
            if back.size:
                keep = ~np.isin(mine[0], back)
                mine = (mine[0][keep], mine[1][keep])
        if mine[0].size:
            order = np.argsort(mine[0], kind="stable")
            self._mine[info.id] = (mine[0][order], mine[1][order])
            self._listed.add(info.id)
        else:
            self._mine.pop(info.id, None)
            self._listed.discard(info.id)
        if takeable <= 0:
            self._dry.add(info.id)
        else:
            self._dry.discard(info.id)
        if wanted and takeable <= 0:
            return STARVED_WAIT_S
        return SUPPLIED_WAIT_S if wanted or mine[0].size else None

    def _settle_gone(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo,
        table: sql.Composable, gone: Entries,
    ) -> int:
        """Settle entries no longer listed by their rows: consumed (or no
        longer at that seq) finished, still queued given back; returns how
        many were taken."""
        runs = runs_of(gone[1], gone[0])
        odd = indexed(conn, sql.SQL(_Q["offers_gone"]).format(table=table), (
            runs["run_seqs"], runs["run_slots"], runs["run_ns"]))
        back = [(int(slot), int(seq), int(due or 0)) for slot, seq, state, due in odd
                if state == RowState.QUEUED]
        queued = {seq for _slot, seq, _due in back}
        done = [(int(slot), int(seq)) for seq, slot in zip(gone[0].tolist(), gone[1].tolist(),
                                                              strict=True) if seq not in queued]
        if done:
            self._finish(sec, ring, info, done)
            self.figures.taken += len(done)
        if back:
            # Not listed and not consumed: the agent died between its claim and
            # its listing, or someone deleted chunks by hand. Nobody took them.
            self.figures.given_back += self._give_back(sec, ring, info, back, counted=False)
            logger.warning("ringq: %d entries of queue %s held for SQL consumers but neither "
                           "listed nor consumed were given back", len(back), info.name)
        return len(done)

    def _strike(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo,
        table: sql.Composable, touched: Runs,
    ) -> set[int]:
        """Count the deliveries of takes that did not commit and give their
        chunks back to the section (a ``single`` queue: everything listed,
        so that the order holds); returns the chunks' seqs unlisted."""
        single = info.dequeue_mode == "single"
        with conn.transaction():
            # Durable at once, whatever the connection's setting: a strike lost
            # in a crash after its chunk was unlisted would be counted twice.
            conn.execute(_Q["agent_sync_commit"])
            if single:
                got = conn.execute(_Q["offers_quiet"], (info.id,)).fetchone()
                if not got or not got[0]:
                    return set()  # a take is under way: it stops before the touched chunk
            locked: Runs = [(int(a), int(b), int(c)) for a, b, c in conn.execute(
                _Q["offers_touched"], (info.id, [t[0] for t in touched])).fetchall()]
            if not locked:
                return set()  # all held by takes (a prepared one, say)
            seqs, slots, ns = ([r[i] for r in locked] for i in range(3))
            conn.execute(_Q["agent_index_scans"])  # for the rest of this transaction
            aborted = conn.execute(sql.SQL(_Q["offers_aborted"]).format(table=table),
                                   (seqs, slots, ns)).fetchall()
            struck: list[tuple[Any, ...]] = []
            if aborted:
                struck = conn.execute(sql.SQL(_Q["strike"]).format(table=table), {
                    "max_deliveries": info.max_deliveries,
                    "slots": [int(r[0]) for r in aborted],
                    "seqs": [int(r[1]) for r in aborted],
                    "queue_id": info.id,
                    "reason": POISON_REASON,
                }).fetchall()
            conn.execute(_Q["offers_unlist"], (info.id, seqs))
            rest: Runs = []
            if single:
                rest = [(int(a), int(b), int(c))
                        for a, b, c in conn.execute(_Q["offers_withdraw"], (info.id,)).fetchall()]
        poisoned = [(int(r[0]), int(r[1])) for r in struck if r[2] == RowState.CONSUMED]
        due = {int(r[1]): int(r[7] or 0) for r in struck if r[2] == RowState.QUEUED}
        again = [(sl, sq, due[sq]) for sq, sl in zip(*as_lists(expand(locked)), strict=True)
                 if sq in due]
        gone = {sq for _sl, sq in poisoned}
        quiet = [(sl, sq, 0) for sq, sl in zip(*as_lists(expand(locked + rest)), strict=True)
                 if sq not in due and sq not in gone]
        self.figures.struck += len(struck)
        self.figures.poisoned += len(poisoned)
        if poisoned:
            self._finish(sec, ring, info, poisoned)
        self._give_back(sec, ring, info, again, counted=True)
        self._give_back(sec, ring, info, quiet, counted=False)
        self.figures.withdrawn += len(quiet)
        return set(seqs) | {r[0] for r in rest}

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
        post(sec, ring, ready, space)

    @staticmethod
    def _role_freed(ring: Ring, exclusive: bool) -> int:
        """Linked dequeuers to wake when the SQL path let go of a ``single``
        queue's dequeuer role (it has nothing set aside any more)."""
        if not exclusive or ring.role_owner() != 0:
            return 0
        return min(1, ring.waiters(OpKind.DEQUEUE))

    def _offer(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo, n: int,
        wake: int,
    ) -> Entries:
        """List up to ``n`` ready entries for SQL consumers and wake those
        waiting, enough to take ``wake`` entries plus those listed, in one
        round trip; returns the entries listed (seqs, slots)."""
        slots, seqs = self._claim(sec, ring, info, n)
        if not slots.size:
            if wake:
                self._wake(conn, info, wake)
            return NONE
        table = queue_table(info.name)
        # at least 16 chunks when there are 16 entries: a take holds whole chunks
        runs = runs_of(slots, seqs, max(1, min(CHUNK, int(slots.size) // 16)))
        try:
            send(conn, [
                (_Q["agent_index_scans"], None),
                (sql.SQL(_Q["offers_clean_runs"]).format(table=table), runs),
                (_Q["offers_runs"], {"queue_id": info.id, **runs}),
                (_Q["offers_wake"], (info.id, info.name, wake + int(slots.size))),
            ])
        except BaseException:
            self._give_back(sec, ring, info,
                            [(sl, sq, 0) for sl, sq in zip(slots.tolist(), seqs.tolist(),
                                                           strict=True)], counted=False)
            raise
        self.figures.offered += int(slots.size)
        return seqs.astype(np.int64), slots.astype(np.int64)

    def _wake(self, conn: psycopg.Connection[Any], info: QueueInfo, n: int) -> None:
        """Wake SQL consumers waiting for the queue, enough to take ``n`` entries."""
        row = conn.execute(_Q["offers_wake"], (info.id, info.name, n)).fetchone()
        self.figures.woken += int(row[0]) if row else 0

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

    def _withdraw(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo
    ) -> np.ndarray[Any, Any]:
        """Take back untaken entries of a queue no SQL consumer asked for
        lately; returns their seqs."""
        with conn.transaction():
            if info.dequeue_mode == "single":
                got = conn.execute(_Q["offers_quiet"], (info.id,)).fetchone()
                if not got or not got[0]:
                    return NONE[0]  # a take is under way: later
                rows = conn.execute(_Q["offers_withdraw"], (info.id,)).fetchall()
            else:
                rows = conn.execute(_Q["offers_withdraw_shared"], (info.id, info.id)).fetchall()
            runs: Runs = [(int(a), int(b), int(c)) for a, b, c in rows]
        seqs, slots = expand(runs)
        self._give_back(sec, ring, info, list(zip(slots.tolist(), seqs.tolist(),
                                                  [0] * len(seqs), strict=True)), counted=False)
        self.figures.withdrawn += int(seqs.size)
        return seqs

    def _give_back(
        self, sec: Section, ring: Ring, info: QueueInfo, entries: list[tuple[int, int, int]],
        *, counted: bool,
    ) -> int:
        """Make entries (slot, seq, due time in epoch µs or 0) held for SQL
        ready for linked consumers again, or waiting if not due yet (a retry's
        backoff). ``counted``: a delivery that did not commit (a strike);
        else none took them, and the claim's and the finish's counts are
        taken back."""
        if not entries:
            return 0
        exclusive = info.dequeue_mode == "single"
        n = 0
        sec.lock_queue(ring.qidx)
        try:
            for slot, seq, due_us in entries:
                if ring.held_by(slot, L.OWNER_SQL) and ring.seq_of(slot) == seq:
                    ring.finish_dequeue(slot, consumed=False, exclusive=exclusive,
                                        due_us=due_us)
                    if not counted:
                        ring.Q[ring.qb + L.Q_N_DEQ] -= 1
                        ring.Q[ring.qb + L.Q_N_DEQ_ROLLBACK] -= 1
                    n += 1
            wake = min(n, ring.waiters(OpKind.DEQUEUE))
            wake += self._role_freed(ring, exclusive)
        finally:
            sec.unlock_queue(ring.qidx)
        if wake:
            sec.post(ring.qid, "r", wake)
        return n

    def _end_overdue(self, conn: psycopg.Connection[Any]) -> None:
        """End the backends of SQL consumers holding a listed chunk past the
        queue's lease (as the monitor ends linked sessions): their
        transaction rolls back and the entries come back counted."""
        for info in self._infos.values():
            if info.id not in self._listed or info.lease <= 0:
                continue
            for (pid,) in conn.execute(_Q["offers_overdue"], (info.id, info.lease)).fetchall():
                conn.execute(_Q["offers_end"], (pid,))
                self.figures.lease_expired += 1
                logger.warning("ringq: SQL consumer backend %s held an entry of queue %s past "
                               "its lease (%g s): ended", pid, info.name, info.lease)

    @staticmethod
    def _held_queues(sec: Section) -> set[int]:
        """The queues whose section holds entries for SQL consumers."""
        out = set()
        for qidx in sec.loaded_queues():
            ring = Ring(sec, qidx)
            if np.any(sec.owner[ring.base : ring.base + ring.cap] == L.OWNER_SQL):
                out.add(ring.qid)
        return out


