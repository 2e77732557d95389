"""The SQL agent's producers' side: ring slots reserved for SQL producers.

SQL cannot reserve slots in the global section, so the agent does it for SQL
producers, ahead of them: it reserves free slots at the ring's head under the
owner ``OWNER_SQL`` (as a linked producer reserves: locked, neither ENQ nor
DEQ) and lists them in ``ringq.slots`` as chunks of at most :data:`CHUNK`.
``ringq.enqueue_many`` (the queue's ``ringq.pq_<name>``) writes a batch into
the oldest chunks it can lock and deletes them, in the caller's transaction.
On each pass the agent reads the listing back:

- slots it reserved that are no longer listed were used by a put that
  committed: their rows say which hold an entry (published in the section,
  with its group and due time, as a linked commit publishes) and which were
  left void (the rest of a chunk used in part);
- a chunk whose xmax is set and that no transaction holds was touched by a
  put that did not commit: unlisted and voided;
- the pump moves a queue's inbox entries only while no slot is reserved for
  SQL producers (they would get seqs at the head, and a producer's later puts
  must land after them, not in a chunk reserved before): a put moves them
  into the oldest chunks first (``ringq.pq_<name>``); while one has waited
  :data:`INBOX_STALLED_MS` (no put came, or the library refuses one) the
  agent reserves nothing and takes the unused chunks back, for the pump;
- while SQL producers put batches (``ringq.enqueue_many`` within
  :data:`DEMAND_S`, into reserved slots or into the inbox; ``ringq.enqueue``'s
  single entries never start it) it keeps eight times what they used since
  its last pass listed;
  then it takes the unused chunks back and voids them (an unused reserved
  slot holds the ring's tail).

A slot reserved is a slot in flight: the ring's room counts it, the tail
waits at it. The rows decide: a section rebuilt from them keeps the listed
chunks reserved (``load_rows(reserved=...)``), and the agent's first look at
a queue starts from what the section holds reserved for SQL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import psycopg
from psycopg import sql

from ..driver import QUERIES as _Q
from ..driver import queue_table
from ..ring import OpKind, QueueInfo, Ring, Run, after_finish, finish_run, group_tag
from ..section import Section
from ..section import layout as L
from . import _runs as R

logger = logging.getLogger("ringq.sql")

CHUNK = 16  # slots per listed chunk at most (the rest of a chunk used in part is void)
RESERVE_MIN = 512
RESERVE_MAX = 8192
RESERVE_SHARE = 4  # at most capacity / this reserved for SQL producers at once
AHEAD = 8  # slots kept listed: this many times what was put since the last pass
# An inbox entry that waited this long with slots reserved: taken back for the pump.
INBOX_STALLED_MS = 200
# Slots stay reserved this long after the queue's last put into them: a slot
# reserved and unused holds the ring's tail (nothing after it is reclaimed).
DEMAND_S = 2.0
# A queue with slots listed is read this often at most while no put notified
# (a put notifies ringq_put at its commit): what a put touched and did not
# commit, a stalled inbox entry and the reservation's size wait that long.
LOOK_S = 0.05


@dataclass
class PutFigures:
    """What the producers' side did since the agent started."""

    reserved: int = 0
    put: int = 0  # entries SQL producers wrote into reserved slots, published
    voided: int = 0  # slots left unused: a chunk used in part, a put rolled back, taken back

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class SqlPuts:
    """Reserved slots for SQL producers: :meth:`pass_queue` is one queue's pass."""

    clock: Callable[[], float] = time.monotonic
    figures: PutFigures = field(default_factory=PutFigures)
    # Reserve slots at all (the monitor's --sql-reserve-slots; off: only what
    # an earlier run left reserved is settled, and SQL entries use the inbox).
    enabled: bool = False
    _asked: dict[str, float] = field(default_factory=dict)  # queue name -> last SQL put
    _mine: dict[int, R.Entries] = field(default_factory=dict)  # queue id -> slots listed
    _target: dict[int, int] = field(default_factory=dict)
    _looked: dict[int, float] = field(default_factory=dict)  # queue id -> its last slots read
    _fresh: set[str] = field(default_factory=set)  # queues a put notified since that read
    # queue id -> linked dequeues counted (payload cache hits + misses) at its last publish
    _linked: dict[int, int] = field(default_factory=dict)

    def forget(self) -> None:
        """Start again from what the section holds reserved (a new connection)."""
        self._mine.clear()
        self._looked.clear()

    def asked(self, queue: str) -> None:
        """An SQL producer put a batch into ``queue`` (``ringq_put``: into
        reserved slots, or into the inbox when it found none): reserve for
        it for :data:`DEMAND_S` more."""
        self._asked[queue] = self.clock()
        self._fresh.add(queue)

    def busy(self, now: float) -> set[str]:
        """The queues SQL producers put into lately."""
        for name in [n for n, t in self._asked.items() if now - t >= DEMAND_S]:
            del self._asked[name]
        return set(self._asked)

    def queues(self) -> set[int]:
        """The queues with slots listed."""
        return set(self._mine)

    def pass_queue(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo,
        wanted: bool,
    ) -> bool:
        """One queue's pass; True while it has slots listed or SQL producers put."""
        mine = self._mine.get(info.id)
        now = self.clock()
        if (mine is not None and info.name not in self._fresh
                and now - self._looked.get(info.id, float("-inf")) < LOOK_S):
            return True  # no put committed since the last look: nothing to publish
        self._fresh.discard(info.name)
        self._looked[info.id] = now
        if mine is None:  # first look: what the section holds reserved for SQL
            mine = R.held(sec, ring, reserved=True)
        rows = conn.execute(_Q["slots_look"], {"queue_id": info.id,
                                               "stalled_ms": INBOX_STALLED_MS}).fetchall()
        # an inbox entry for the queue that no put moved into chunks
        inbox = any(r[0] is None and r[4] for r in rows)
        chunks, free, touched = R.sort_listing([r for r in rows if r[0] is not None])
        gone, mine = R.split_gone(mine, chunks)
        used = self._publish(sec, conn, ring, info, gone) if gone[0].size else 0
        if touched:
            mine = R.minus(mine, self._unlist(sec, conn, ring, info, touched, withdraw=False))
        if used:
            self._asked[info.name] = self.clock()
            wanted = True
        # The pump holds the inbox's entries back while slots are reserved
        # (their seqs would come from the head, past chunks a producer's later
        # puts may fill): a put moves them into the oldest chunks first. One
        # that waited INBOX_STALLED_MS (no put came, or the pump held the
        # queue, or the library refuses one): take the unused chunks back and
        # reserve nothing until the pump has drained it.
        wanted = wanted and not inbox and self.enabled
        target = self._target.get(info.id, RESERVE_MIN)
        cap = max(CHUNK, ring.cap // RESERVE_SHARE)
        target = min(RESERVE_MAX, cap, max(target, AHEAD * used) if used else
                     max(RESERVE_MIN, target - target // 16))
        self._target[info.id] = target
        listed = sum(n for _s, _sl, n in free)
        if wanted and listed < target - target // 4:
            mine = R.plus(mine, self._reserve(sec, conn, ring, info, target - listed))
        elif not wanted and free:
            mine = R.minus(mine, self._unlist(sec, conn, ring, info, free, withdraw=True))
        if mine[0].size:
            self._mine[info.id] = mine
        else:
            self._mine.pop(info.id, None)
        return wanted or bool(mine[0].size)

    def _reserve(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo, n: int
    ) -> R.Entries:
        """Reserve up to ``n`` slots at the head for SQL producers and list
        them; returns them (seqs, slots)."""
        sec.lock_queue(ring.qidx)
        try:
            first, k = ring.reserve_many(L.OWNER_SQL, 0, n)
            ring.Q[ring.qb + L.Q_SQL_PUTS] += k
        finally:
            sec.unlock_queue(ring.qidx)
        if not k:
            return R.NONE
        seqs = np.arange(first, first + k, dtype=np.int64)
        slots = seqs % ring.cap
        runs = R.runs_of(slots, seqs, CHUNK)
        try:
            R.send(conn, [(_Q["slots_list"], {"queue_id": info.id, **runs})])
        except BaseException:
            self._finish(sec, ring, info, R.NONE, [], (seqs, slots))
            raise
        self.figures.reserved += k
        return seqs, slots

    def _publish(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo,
        gone: R.Entries,
    ) -> int:
        """Settle reserved slots no longer listed by their rows: an entry put
        there is published, a slot left unused is void; returns how many
        entries were published."""
        runs = R.runs_of(gone[1], gone[0])
        rows = R.indexed(conn, sql.SQL(_Q["slots_filled"]).format(table=queue_table(info.name)),
                         {**runs, "cache": self._for_linked(ring, info),
                          "cache_payload": int(ring.cache.cap_bytes),
                          "cache_producer": L.CACHE_PRODUCER_BYTES}, binary=True)
        plain_slots: list[int] = []
        records: Records | None = None
        others: dict[int, tuple[str | None, int]] = {}
        for slot, plain_ones, group, due, *cached in rows:
            if slot is None:
                plain_slots = plain_ones
                if cached[-1]:
                    records = cast("Records", tuple(cached))
            else:
                others[int(slot)] = (group, int(due or 0))
        seqs, slots = gone
        is_plain = np.isin(slots, np.asarray(plain_slots, dtype=np.int64))
        is_other = np.isin(slots, np.fromiter(others, dtype=np.int64, count=len(others)))
        other = [(slot, seq, *others[slot]) for seq, slot
                 in zip(seqs[is_other].tolist(), slots[is_other].tolist(), strict=True)]
        void = ~(is_plain | is_other)
        self._finish(sec, ring, info, (seqs[is_plain], slots[is_plain]), other,
                     (seqs[void], slots[void]), records)
        n_put = int(np.count_nonzero(is_plain)) + len(other)
        self.figures.put += n_put
        self.figures.voided += int(np.count_nonzero(void))
        return n_put

    def _for_linked(self, ring: Ring, info: QueueInfo) -> bool:
        """Whether to write the payload cache records of what SQL producers
        put in the queue: while linked dequeuers read it (they counted a
        cache hit or miss since the last publish, or one waits). Without a
        record a linked dequeue reads the entry's row, a round trip more per
        transaction; SQL consumers read rows anyway (no record is written
        for them)."""
        if not ring.stride:
            return False
        seen = int(ring.Q[ring.qb + L.Q_N_CACHE_HITS]) + int(ring.Q[ring.qb + L.Q_N_CACHE_MISSES])
        last = self._linked.get(info.id)
        self._linked[info.id] = seen
        return (last is not None and seen != last) or ring.waiters(OpKind.DEQUEUE) > 0

    def _unlist(
        self, sec: Section, conn: psycopg.Connection[Any], ring: Ring, info: QueueInfo,
        chunks: R.Runs, *, withdraw: bool,
    ) -> np.ndarray[Any, Any]:
        """Unlist ``chunks`` that no put holds now (touched by a put that did
        not commit, or unused: ``withdraw``) and void their slots; returns
        the seqs voided."""
        query = _Q["slots_withdraw"] if withdraw else _Q["slots_unlist_touched"]
        with conn.transaction():
            rows = conn.execute(query, {"queue_id": info.id,
                                        "seqs": [c[0] for c in chunks]}).fetchall()
        runs: R.Runs = [(int(a), int(b), int(c)) for a, b, c in rows]
        seqs, slots = R.expand(runs)
        self._finish(sec, ring, info, R.NONE, [], (seqs, slots))
        self.figures.voided += int(seqs.size)
        return seqs

    @staticmethod
    def _finish(
        sec: Section, ring: Ring, info: QueueInfo, plain: R.Entries,
        other: list[tuple[int, int, str | None, int]], void: R.Entries,
        records: Records | None = None,
    ) -> None:
        """Publish ``plain`` (seqs, slots: entries of no group due at once, a
        batch's usual, as arrays) and ``other`` (slot, seq, group, due us),
        and void ``void`` (seqs, slots), among the slots still reserved for
        SQL at that seq, as a linked commit finishes its enqueues; wake whom
        it frees. ``records``: the payload cache records of ``plain``'s
        entries (see :func:`_cache`), written before they are ready."""
        sec.lock_queue(ring.qidx)
        try:
            n_put = n_void = 0
            seqs, slots = plain
            if slots.size:
                ok = R.reserved_mask(sec, ring, slots, seqs)
                if ok.any():
                    if records is not None:
                        _cache(ring, slots[ok], seqs[ok], records)
                    run = Run(ring, info, OpKind.ENQUEUE, slots[ok], seqs[ok], 0)
                    n_put += finish_run(ring, run, L.OWNER_SQL, exclusive=False,
                                        enq_at_us=None)[0]
            if other:
                slots = np.array([e[0] for e in other], dtype=np.int64)
                seqs = np.array([e[1] for e in other], dtype=np.int64)
                kept = R.reserved_mask(sec, ring, slots, seqs).tolist()
                for (slot, _seq, group, due_us), ok in zip(other, kept, strict=True):
                    if ok:
                        if group is not None:
                            ring.set_group(slot, group_tag(group))
                        ring.finish_enqueue(slot, committed=True, due_us=due_us)
                        n_put += 1
            seqs, slots = void
            if slots.size:
                for slot in slots[R.reserved_mask(sec, ring, slots, seqs)].tolist():
                    ring.finish_enqueue(slot, committed=False)
                    n_void += 1
            q_puts = ring.qb + L.Q_SQL_PUTS
            ring.Q[q_puts] = max(0, int(ring.Q[q_puts]) - n_put - n_void)
            ready, space = after_finish(ring, n_put, n_void)
            ready = min(max(ready, 0), ring.waiters(OpKind.DEQUEUE))
        finally:
            sec.unlock_queue(ring.qidx)
        R.post(sec, ring, ready, space)


# slots_filled's cache columns for the entries of no group due at once:
# (payloads, producers, producer seqs, enq_at us, slots), in one order
Records = tuple[list[bytes], list[str], list[int], list[int], list[int]]


def _cache(ring: Ring, slots: np.ndarray[Any, Any], seqs: np.ndarray[Any, Any],
           records: Records) -> None:
    """Write the payload cache records of entries SQL producers put at
    ``slots`` (``seqs``; their rows' ``records``), as a linked commit writes
    its own (the caller holds the queue lock; the entries are not ready yet):
    a :meth:`~ringq.engine.ring.PayloadCache.put_run` per producer and
    enqueue time (per put, usually one a pass)."""
    payloads, producers, pseqs, enq_us, at = records
    index = {slot: i for i, slot in enumerate(at)}
    runs: dict[tuple[str, int], tuple[list[int], list[int], list[int]]] = {}
    for slot, seq in zip(slots.tolist(), seqs.tolist(), strict=True):
        i = index.get(slot)
        if i is None:  # carries a trace: read from its row
            continue
        run = runs.setdefault((producers[i], enq_us[i]), ([], [], []))
        run[0].append(slot)
        run[1].append(seq)
        run[2].append(i)
    for (producer, at_us), (r_slots, r_seqs, r_i) in runs.items():
        ring.cache.put_run(np.array(r_slots, dtype=np.int64), np.array(r_seqs, dtype=np.int64),
                           [payloads[i] for i in r_i], producer,
                           np.array([pseqs[i] for i in r_i], dtype=np.int64), None, at_us)


def reserved_for_sql(sec: Section, qidx: int) -> bool:
    """Whether the section holds slots of queue block ``qidx`` reserved for
    SQL producers (``Q_SQL_PUTS``; the pump then holds the queue's inbox
    entries back)."""
    return sec.q(qidx, L.Q_SQL_PUTS) > 0
