"""Consumption recorded in the last row of a stretch, at the SQL level (issue 22, decision 1).

Today every consumed entry is a guarded UPDATE of its ring row (``state =
2``; ``engine/queries.sql`` ``consume``, ``consume_many``). The candidate: a
consume of a contiguous stretch q1..qk writes ONE row, qk's (``state = 2,
cons_from = q1``, a new bigint column), and only reads rows q1..qk-1 (each
must still hold its seq with state 1); a forward probe (no row among the next
M slots of the same lap with state 2 and ``cons_from <= qk``) catches a
stretch inside an older one whose record lies after qk. Stretches are capped
at M slots. An entry is consumed iff its row has state 2, or a later row of
the same lap with state 2 has ``cons_from <= seq``, or ``seq < max(seq) + 1 -
capacity``.

Variants (each on its own ring, ``ringq.q_<name>`` made by ``create_queue``
plus ``cons_from``; 100 B payloads; no section, no engine: SQL only):

- ``today``: the engine's own ``consume`` / ``consume_many`` statements;
- ``read M``: the candidate as briefed, one statement (write, reads, probe);
- ``lock M``: the candidate made safe against two stale consumers racing:
  the reads take ``FOR SHARE`` row locks and the probe is a second statement
  of the same transaction (a fresh snapshot after any lock wait), one round
  trip (see ``race``: ``read M`` lets two overlapping stretches both commit);
- ``skiplocked``: ``DELETE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED
  LIMIT k) RETURNING`` on an ``id bigserial`` table.

Each round (``--rounds``, interleaved) runs every (variant, batch) cell twice:
free, then with another connection holding a REPEATABLE READ snapshot. Per
transaction: end-to-end wall time, the backend's CPU (``/proc/<pid>/schedstat``;
only when the server runs on this machine) and WAL bytes. Refills are
100-entry guarded enqueues (the candidate's guard reads the records), timed
too. Then: the rings' size after N consumes under a held snapshot, and the
depth count (today's ``count(*) WHERE state = 1`` against the candidate's).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from _benchlib import (
    argument_parser,
    config_from_options,
    cpu_load,
    drop_queues,
    machine,
    run_in_database,
    server_settings,
)
from psycopg import sql
from ringq.engine import queue_table
from ringq.engine.sqlfile import load
from ringq.scripting import QueueSpec, create_queue

ENGINE_SQL = load("ringq.engine", "queries.sql")
RQ001 = "RQ001"

ADD_COLUMN = "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS cons_from bigint"

# The candidate's consume: the last row of each stretch written, the other
# rows of the batch read (q1..qk-1 of each stretch: seq in range, state 1,
# not a last), and (in `read`) the probe. Slot ranges come in two parts
# (a wrap-around); an empty second part is (0, -1).
CAND_CONSUME = """
WITH u AS (
    UPDATE {table} AS t
    SET state = 2, cons_from = (%(firsts)s::bigint[])[array_position(%(lasts)s::bigint[], t.seq)],
        deq_at = now(), deq_user = current_user
    WHERE t.slot = ANY(%(last_slots)s::integer[]) AND t.seq = ANY(%(lasts)s::bigint[])
      AND t.state = 1
    RETURNING 1
), r AS (
    SELECT 1 FROM {table} AS t
    WHERE (t.slot BETWEEN %(r1)s::integer AND %(r2)s::integer
           OR t.slot BETWEEN %(r3)s::integer AND %(r4)s::integer)
      AND t.seq BETWEEN %(first)s::bigint AND %(last)s::bigint AND t.state = 1
      AND t.seq <> ALL(%(lasts)s::bigint[])
    {lock}
){probe_cte}
SELECT ringq.expect_rows({got}, %(k)s::integer, {queue})
"""
PROBE_WHERE = """
    SELECT 1 FROM {table} AS t
    WHERE (t.slot BETWEEN %(p1)s::integer AND %(p2)s::integer
           OR t.slot BETWEEN %(p3)s::integer AND %(p4)s::integer)
      AND t.state = 2 AND t.seq > %(last)s::bigint AND t.seq <= %(last)s::bigint + %(m)s::integer
      AND t.cons_from <= %(last)s::bigint
"""
GOT = "((SELECT count(*) FROM u) + (SELECT count(*) FROM r))::integer"
READ_GOT = f"CASE WHEN EXISTS (SELECT 1 FROM p) THEN -1 ELSE {GOT} END"
# `lock`'s second statement: the probe, after the first one's lock waits.
LOCK_PROBE = (
    "SELECT ringq.expect_rows(CASE WHEN EXISTS ("
    + PROBE_WHERE
    + ") THEN -1 ELSE 0 END, 0, {queue})"
)

# The candidate's enqueue guard: a row still state 1 may be overwritten when a
# record of the same lap covers it (or it is a lap behind). The records of the
# window (the batch's slots and M after them) are read once (MATERIALIZED: an
# inlined CTE would be one probe per row).
CAND_ENQUEUE = """
WITH rec AS MATERIALIZED (
    SELECT t.seq, t.cons_from FROM {table} AS t
    WHERE (t.slot BETWEEN %(w1)s::integer AND %(w2)s::integer
           OR t.slot BETWEEN %(w3)s::integer AND %(w4)s::integer)
      AND t.state = 2 AND t.cons_from < t.seq
), u AS (
    UPDATE {table} AS t
    SET state = 1, seq = v.seq, payload = v.payload, producer = v.producer, producer_seq = v.pseq,
        msg_group = v.grp, deliveries = 0, enq_at = now(), enq_user = current_user, deq_at = NULL,
        deq_user = NULL, cons_from = NULL
    FROM unnest(%(slots)s::integer[], %(seqs)s::bigint[], %(payloads)b::bytea[],
                %(producers)s::text[], %(pseqs)s::bigint[], %(groups)s::text[])
        AS v(slot, seq, payload, producer, pseq, grp)
    WHERE t.slot = v.slot AND t.slot = ANY(%(slots)s::integer[]) AND t.seq < v.seq
      AND (t.state <> 1 OR t.seq < v.seq - %(capacity)s::integer
           OR EXISTS (SELECT 1 FROM rec WHERE rec.cons_from <= t.seq AND rec.seq > t.seq
                      AND rec.seq < t.seq + %(m)s::integer))
    RETURNING 1
)
SELECT ringq.expect_rows((SELECT count(*) FROM u)::integer, %(n)s::integer, {queue}),
       (extract(epoch FROM now()) * 1000000)::bigint
"""

DEPTH_TODAY = "SELECT count(*) FROM {table} WHERE state = 1"
# Unconsumed = state 1 in the window [lo, head) minus what the records cover
# there: a record at seq r from f covers f..r-1, still in the window from
# max(f, lo) (its rows are overwritten only after it, so they still hold those seqs).
DEPTH_CAND = """
WITH h AS (SELECT max(seq) + 1 - %(capacity)s::integer AS lo FROM {table})
SELECT count(*) FILTER (WHERE t.state = 1 AND t.seq >= h.lo)
       - coalesce(sum(greatest(0, t.seq - greatest(t.cons_from, h.lo)))
                  FILTER (WHERE t.state = 2 AND t.cons_from < t.seq), 0)
FROM {table} AS t, h
"""

SKQ_CREATE = (
    "CREATE TABLE {t} (id bigserial PRIMARY KEY, payload bytea, enq_at timestamptz DEFAULT now())"
)
SKQ_FILL = "INSERT INTO {t} (payload) SELECT unnest(%s::bytea[])"
SKQ_DEQUEUE = (
    "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED LIMIT %s) "
    "RETURNING payload"
)
SIZE = "SELECT pg_relation_size(%s::regclass)"
WAL_NOW = "SELECT pg_current_wal_insert_lsn()"
WAL_SINCE = "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)::bigint"


@dataclass(frozen=True)
class Config:
    capacity: int = 50_000
    payload: int = 100
    rounds: int = 3
    tx_single: int = 300  # transactions per cell at batch 1
    tx_batch: int = 60  # transactions per cell at batch 32 and 100
    growth: int = 20_000  # consumes (batch 100) under a held snapshot, for the ring size
    growth_single: int = 2_000  # and at batch 1
    depth_queued: int = 10_000  # entries left queued for the depth count
    depth_reps: int = 15
    ms: tuple[int, ...] = (32, 128)
    batches: tuple[int, ...] = (1, 32, 100)
    refill_batch: int = 100


@dataclass
class Ring:
    """One ring table and where its entries are (seqs [tail, head) queued)."""

    name: str  # the queue's name
    kind: str  # today, read, lock
    m: int  # stretch cap and probe length (0: today)
    head: int = 0
    tail: int = 0
    enq: dict[str, list[float]] = field(default_factory=dict)  # phase -> [wall s, cpu s, wal B, tx]

    @property
    def label(self) -> str:
        return self.kind if self.kind == "today" else f"{self.kind} {self.m}"


def ranges(first_seq: int, n: int, capacity: int) -> tuple[int, int, int, int]:
    """The slots of seqs first_seq .. first_seq+n-1 as two ranges (a wrap)."""
    if n <= 0:
        return 0, -1, 0, -1
    s = first_seq % capacity
    e = s + n - 1
    return (s, e, 0, -1) if e < capacity else (s, capacity - 1, 0, e - capacity)


def int_array(values: range | list[int]) -> str:
    return "{" + ",".join(map(str, values)) + "}"


def backend_cpu_ns(pid: int) -> int | None:
    """The backend's CPU time so far (ns), when the server runs on this machine."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Bench:
    def __init__(self, dsn: str, cfg: Config, tag: str) -> None:
        self.dsn, self.cfg, self.tag = dsn, cfg, tag
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.admin = psycopg.connect(dsn, autocommit=True)
        row = self.conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        self.pid = int(row[0])
        self.payload = b"p" * cfg.payload
        self.rings = [Ring(f"rec_{tag}_today", "today", 0)]
        for kind in ("read", "lock"):
            self.rings += [Ring(f"rec_{tag}_{kind}{m}", kind, m) for m in cfg.ms]
        self.skq = f"rec_{tag}_skq"
        self.skq_head = self.skq_tail = 0
        self._stmts: dict[tuple[str, str], sql.Composed] = {}

    # -- set-up ----------------------------------------------------------------------------------

    def create(self) -> None:
        for ring in self.rings:
            create_queue(
                self.admin, QueueSpec(ring.name, self.cfg.capacity, 256, dequeue_mode="shared")
            )
            self.admin.execute(sql.SQL(ADD_COLUMN).format(table=queue_table(ring.name)))
        self.admin.execute(sql.SQL(SKQ_CREATE).format(t=sql.Identifier(self.skq)))

    def stmt(self, ring: Ring, key: str) -> sql.Composed:
        """The statement ``key`` for ``ring``, composed once."""
        if (ring.name, key) not in self._stmts:
            table, queue = queue_table(ring.name), sql.Literal(ring.name)
            if key in ENGINE_SQL:
                text = ENGINE_SQL[key]
            elif key == "cand_consume":
                probe = ", p AS (" + PROBE_WHERE + "    LIMIT 1\n)" if ring.kind == "read" else ""
                text = (
                    CAND_CONSUME.replace("{probe_cte}", probe)
                    .replace("{lock}", "FOR SHARE" if ring.kind == "lock" else "")
                    .replace("{got}", READ_GOT if ring.kind == "read" else GOT)
                )
            else:
                text = {
                    "lock_probe": LOCK_PROBE,
                    "cand_enqueue": CAND_ENQUEUE,
                    "depth_today": DEPTH_TODAY,
                    "depth_cand": DEPTH_CAND,
                }[key]
            self._stmts[ring.name, key] = sql.SQL(text).format(table=table, queue=queue)
        return self._stmts[ring.name, key]

    # -- the transactions ------------------------------------------------------------------------

    def enqueue(self, ring: Ring, n: int) -> None:
        """n entries at the head, one transaction: today's guarded enqueue or the candidate's."""
        first = ring.head
        seqs = range(first, first + n)
        slots = [s % self.cfg.capacity for s in seqs]
        producers, groups = "{" + ",".join(["bench"] * n) + "}", "{" + ",".join(["NULL"] * n) + "}"
        if ring.kind == "today":
            params: Any = (
                int_array(slots),
                int_array(seqs),
                [self.payload] * n,
                producers,
                int_array(seqs),
                groups,
                n,
            )
            self.conn.execute(self.stmt(ring, "enqueue_many"), params).fetchall()
        else:
            w1, w2, w3, w4 = ranges(first - self.cfg.capacity, n + ring.m, self.cfg.capacity)
            self.conn.execute(
                self.stmt(ring, "cand_enqueue"),
                {
                    "w1": w1,
                    "w2": w2,
                    "w3": w3,
                    "w4": w4,
                    "slots": int_array(slots),
                    "seqs": int_array(seqs),
                    "payloads": [self.payload] * n,
                    "producers": producers,
                    "pseqs": int_array(seqs),
                    "groups": groups,
                    "capacity": self.cfg.capacity,
                    "m": ring.m,
                    "n": n,
                },
            ).fetchall()
        ring.head += n

    def consume(
        self,
        ring: Ring,
        k: int,
        conn: psycopg.Connection[Any] | None = None,
        first: int | None = None,
    ) -> None:
        """Consume seqs [first, first+k) (default: the tail) in one transaction, one round trip."""
        conn = conn or self.conn
        first = ring.tail if first is None else first
        cap = self.cfg.capacity
        if ring.kind == "today":
            if k == 1:
                conn.execute(self.stmt(ring, "consume"), (first % cap, first)).fetchall()
            else:
                seqs = range(first, first + k)
                conn.execute(
                    self.stmt(ring, "consume_many"),
                    (int_array([s % cap for s in seqs]), int_array(seqs), k),
                ).fetchall()
        else:
            lasts = [min(s + ring.m, first + k) - 1 for s in range(first, first + k, ring.m)]
            firsts = [s for s in range(first, first + k, ring.m)]
            last = first + k - 1
            r1, r2, r3, r4 = ranges(first, k, cap)
            p1, p2, p3, p4 = ranges(last + 1, ring.m, cap)
            params = {
                "firsts": int_array(firsts),
                "lasts": int_array(lasts),
                "last_slots": int_array([s % cap for s in lasts]),
                "r1": r1,
                "r2": r2,
                "r3": r3,
                "r4": r4,
                "first": first,
                "last": last,
                "k": k,
                "m": ring.m,
                "p1": p1,
                "p2": p2,
                "p3": p3,
                "p4": p4,
            }
            if ring.kind == "read":
                conn.execute(self.stmt(ring, "cand_consume"), params).fetchall()
            else:
                # One implicit transaction up to the pipeline's Sync (autocommit), as the engine's.
                with conn.pipeline():
                    conn.execute(self.stmt(ring, "cand_consume"), params)
                    conn.execute(self.stmt(ring, "lock_probe"), params)
        if first == ring.tail:
            ring.tail += k

    def skq_fill(self, n: int) -> None:
        q = sql.SQL(SKQ_FILL).format(t=sql.Identifier(self.skq))
        self.conn.execute(q, ([self.payload] * n,), binary=True)
        self.skq_head += n

    def skq_consume(self, k: int) -> None:
        q = sql.SQL(SKQ_DEQUEUE).format(t=sql.Identifier(self.skq))
        got = self.conn.execute(q, (k,)).fetchall()
        assert len(got) == k, (len(got), k)
        self.skq_tail += k

    # -- measuring -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def measured(self, out: list[float]) -> Iterator[None]:
        """Add [wall s, backend cpu s, WAL bytes] of the block to ``out``."""
        lsn = self.admin.execute(WAL_NOW).fetchone()
        assert lsn is not None
        cpu0 = backend_cpu_ns(self.pid)
        t0 = time.perf_counter()
        yield
        wall = time.perf_counter() - t0
        cpu1 = backend_cpu_ns(self.pid)
        wal = self.admin.execute(WAL_SINCE, (lsn[0],)).fetchone()
        assert wal is not None
        cpu = (cpu1 - cpu0) / 1e9 if cpu0 is not None and cpu1 is not None else float("nan")
        out += [wall, cpu, float(wal[0])]

    def refill(self, ring: Ring, need: int, phase: str) -> None:
        """Enqueue (timed, as the enqueue figure) until ``need`` entries are queued."""
        acc = ring.enq.setdefault(phase, [0.0, 0.0, 0.0, 0.0])
        while ring.head - ring.tail < need:
            n = self.cfg.refill_batch
            assert ring.head + n - ring.tail <= self.cfg.capacity
            got: list[float] = []
            with self.measured(got):
                self.enqueue(ring, n)
            for i in range(3):
                acc[i] += got[i]
            acc[3] += 1

    def cell(self, who: str, k: int, phase: str) -> dict[str, Any]:
        """One (variant, batch) cell: its transactions timed one by one."""
        ntx = self.cfg.tx_single if k == 1 else self.cfg.tx_batch
        ring = next((r for r in self.rings if r.label == who), None)
        one: Callable[[], None]
        if ring is not None:
            self.refill(ring, (ntx + 3) * k, phase)
            one = functools.partial(self.consume, ring, k)
        else:
            self.skq_fill((ntx + 3) * k)
            one = functools.partial(self.skq_consume, k)
        for _ in range(3):  # prepared plans (psycopg prepares from the 5th) and a warm cache
            one()
        per_tx: list[float] = []
        totals: list[float] = []
        with self.measured(totals):
            for _ in range(ntx):
                t0 = time.perf_counter()
                one()
                per_tx.append(time.perf_counter() - t0)
        wall, cpu, wal = totals
        return {
            "who": who,
            "k": k,
            "phase": phase,
            "tx": ntx,
            "wall_us": wall / ntx * 1e6,
            "p50_us": statistics.median(per_tx) * 1e6,
            "cpu_us": cpu / ntx * 1e6,
            "wal_b": wal / ntx,
        }

    def cells(self) -> list[tuple[str, int]]:
        out = [("today", k) for k in self.cfg.batches]
        out += [(r.label, k) for r in self.rings if r.kind != "today" for k in self.cfg.batches]
        return out + [("skiplocked", k) for k in self.cfg.batches]

    @contextlib.contextmanager
    def held_snapshot(self) -> Iterator[None]:
        """Another connection holds a REPEATABLE READ snapshot for the block."""
        with psycopg.connect(self.dsn, application_name="bench held snapshot") as holder:
            holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            holder.execute("SELECT count(*) FROM ringq.queues").fetchone()
            try:
                yield
            finally:
                holder.rollback()

    def rounds(self) -> list[dict[str, Any]]:
        results = []
        for rnd in range(self.cfg.rounds):
            for phase in ("free", "held"):
                with self.held_snapshot() if phase == "held" else contextlib.nullcontext():
                    order = self.cells() if rnd % 2 == 0 else self.cells()[::-1]
                    for who, k in order:
                        res = self.cell(who, k, phase)
                        res["round"] = rnd
                        results.append(res)
                        print(
                            f"  round {rnd} {phase:<4} {who:<10} k={k:<3} "
                            f"{res['wall_us']:8.0f} us/tx "
                            f"cpu {res['cpu_us']:6.0f} us  wal {res['wal_b']:7.0f} B",
                            file=sys.stderr,
                            flush=True,
                        )
            # what the monitor's vacuum after a released snapshot gives back
            for ring in self.rings:
                self.admin.execute(sql.SQL("VACUUM {}").format(queue_table(ring.name)))
            self.admin.execute(sql.SQL("VACUUM {}").format(sql.Identifier(self.skq)))
        return results

    def size(self, ring: Ring) -> int:
        row = self.admin.execute(SIZE, (f"ringq.q_{ring.name}",)).fetchone()
        assert row is not None
        return int(row[0])

    def growth(self) -> list[dict[str, Any]]:
        """Ring size under a held snapshot: enqueue, then consume at batch 1, then at batch 100."""
        out = []
        for ring in self.rings:
            self.admin.execute(sql.SQL("VACUUM {}").format(queue_table(ring.name)))
        with self.held_snapshot():
            for ring in self.rings:
                size0 = self.size(ring)
                while ring.head - ring.tail < self.cfg.growth + self.cfg.growth_single:
                    self.enqueue(ring, self.cfg.refill_batch)
                size1 = self.size(ring)
                for _ in range(self.cfg.growth_single):
                    self.consume(ring, 1)
                size2 = self.size(ring)
                for _ in range(self.cfg.growth // 100):
                    self.consume(ring, 100)
                size3 = self.size(ring)
                out.append(
                    {
                        "who": ring.label,
                        "bytes_start": size0,
                        "bytes_after_enqueue": size1,
                        "bytes_after_consume_1": size2,
                        "bytes_after_consume_100": size3,
                        "grew_consume_1": size2 - size1,
                        "grew_consume_100": size3 - size2,
                    }
                )
                print(f"  growth {ring.label:<10} {out[-1]}", file=sys.stderr, flush=True)
        return out

    def depth(self) -> list[dict[str, Any]]:
        """The depth count, today's and the candidate's, on rings with entries
        queued and records in the window; checked against the true depth."""
        out = []
        for ring in self.rings:
            self.admin.execute(sql.SQL("VACUUM ANALYZE {}").format(queue_table(ring.name)))
            while ring.head - ring.tail < min(self.cfg.depth_queued, self.cfg.capacity // 5):
                self.enqueue(ring, self.cfg.refill_batch)
            truth = ring.head - ring.tail
            for key in ("depth_today", "depth_cand"):
                if key == "depth_cand" and ring.kind == "today":
                    continue
                q = self.stmt(ring, key)
                params = {"capacity": self.cfg.capacity} if key == "depth_cand" else None
                times = []
                for _ in range(self.cfg.depth_reps):
                    t0 = time.perf_counter()
                    row = self.conn.execute(q, params).fetchone()
                    times.append(time.perf_counter() - t0)
                assert row is not None
                n = int(row[0])
                if key == "depth_cand" or ring.kind == "today":
                    assert n == truth, f"{ring.label} {key}: {n} != {truth}"
                out.append(
                    {
                        "who": ring.label,
                        "query": key,
                        "result": n,
                        "truth": truth,
                        "ms_median": statistics.median(times) * 1e3,
                    }
                )
        return out

    # -- correctness of the guards ---------------------------------------------------------------

    def expect_rq001(self, what: str, fn: Callable[[], None]) -> str:
        try:
            fn()
        except psycopg.Error as exc:
            if exc.sqlstate == RQ001:
                return f"{what}: RQ001"
            raise
        raise AssertionError(f"{what}: the stale consume committed")

    def guard_checks(self) -> list[str]:
        """A stale consume is refused: inside an older stretch (the probe),
        across an older record (the reads), twice (the write)."""
        notes = []
        for ring in self.rings:
            if ring.kind == "today":
                continue
            t = ring.tail
            self.refill(ring, 2 * ring.m, "setup")
            self.consume(ring, ring.m)  # t .. t+m-1, record at t+m-1
            for what, k, first in (
                ("inside", 3, t + 2),
                ("across", 4, t + ring.m - 2),
                ("twice", 1, t + ring.m - 1),
            ):
                stale = functools.partial(self.consume, ring, k, first=first)
                notes.append(self.expect_rq001(f"{ring.label} {what}", stale))
            self.consume(ring, ring.m)
        return notes

    def race(self, ring: Ring, inner_first: bool) -> str:
        """Two stale consumers at once: A takes an inner stretch, B one around
        it (both in flight), in either order. Today's engine refuses one by
        the row lock on a shared row; says what happens here."""
        self.refill(ring, 20, "setup")
        t = ring.tail
        a = psycopg.connect(self.dsn, autocommit=False)
        b = psycopg.connect(self.dsn, autocommit=False)
        try:
            a.execute("SET lock_timeout = '3s'")
            b.execute("SET lock_timeout = '3s'")
            a.commit()
            b.commit()
            inner = (a, t + 5, 5)
            outer = (b, t, 20)
            first_, second = (inner, outer) if inner_first else (outer, inner)
            self.consume(ring, first_[2], conn=first_[0], first=first_[1])  # in flight
            outcome: list[str] = []

            def run_second() -> None:
                try:
                    self.consume(ring, second[2], conn=second[0], first=second[1])
                    second[0].commit()
                    outcome.append("committed")
                except psycopg.Error as exc:
                    second[0].rollback()
                    outcome.append(str(exc.sqlstate))

            th = threading.Thread(target=run_second)
            th.start()
            th.join(0.5)
            waited = th.is_alive()
            first_[0].commit()
            th.join()
            if inner_first and outcome[0] != "committed":  # the rest of the outer stretch
                self.consume(ring, 5, first=t)
                self.consume(ring, 10, first=t + 10)
            ring.tail = t + 20
            return (
                f"{ring.label}, {'inner' if inner_first else 'outer'} first: first committed, "
                f"second {'waited then ' if waited else ''}{outcome[0]}"
                + (" (DOUBLE CONSUMPTION)" if outcome[0] == "committed" else "")
            )
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self.conn.close()
        self.admin.close()


def run(dsn: str, cfg: Config, tag: str) -> dict[str, Any]:
    bench = Bench(dsn, cfg, tag)
    try:
        env = {
            **machine(),
            **cpu_load("start"),
            **server_settings(bench.admin),
            "backend_cpu_readable": backend_cpu_ns(bench.pid) is not None,
        }
        bench.create()
        checks = bench.guard_checks()
        for ring in bench.rings:
            if ring.kind != "today" and ring.m == min(cfg.ms):
                checks += [bench.race(ring, True), bench.race(ring, False)]
        for line in checks:
            print("  " + line, file=sys.stderr, flush=True)
        cells = bench.rounds()
        growth = bench.growth()
        depth = bench.depth()
        enq = {r.label: {ph: v for ph, v in r.enq.items() if ph != "setup"} for r in bench.rings}
        return {
            "environment": {**env, **cpu_load("end")},
            "guards": checks,
            "cells": cells,
            "enqueue": enq,
            "growth": growth,
            "depth": depth,
        }
    finally:
        bench.close()


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds per (who, k, phase); ratios to today and to SKIP LOCKED."""
    med: dict[str, dict[str, float]] = {}
    for key in {(c["who"], c["k"], c["phase"]) for c in raw["cells"]}:
        rows = [c for c in raw["cells"] if (c["who"], c["k"], c["phase"]) == key]
        med[f"{key[0]}|{key[1]}|{key[2]}"] = {
            m: statistics.median(c[m] for c in rows)
            for m in ("wall_us", "p50_us", "cpu_us", "wal_b")
        }
    ratios: dict[str, dict[str, float | None]] = {}
    for name, v in med.items():
        who, k, phase = name.split("|")
        if who in ("today", "skiplocked"):
            continue
        today = med.get(f"today|{k}|{phase}")
        skq = med.get(f"skiplocked|{k}|{phase}")
        ratios[name] = {
            "wall_vs_today": v["wall_us"] / today["wall_us"] if today else None,
            "cpu_vs_today": v["cpu_us"] / today["cpu_us"] if today and today["cpu_us"] else None,
            "wal_vs_today": v["wal_b"] / today["wal_b"] if today and today["wal_b"] else None,
            "wall_vs_skiplocked": v["wall_us"] / skq["wall_us"] if skq else None,
            "cpu_vs_skiplocked": v["cpu_us"] / skq["cpu_us"] if skq and skq["cpu_us"] else None,
        }
    return {"median": med, "ratios": ratios}


def render(raw: dict[str, Any], summary: dict[str, Any], seconds: float) -> str:
    med, ratios = summary["median"], summary["ratios"]
    lines = [
        "consume transactions (medians over rounds): per transaction, us of wall (end to end),",
        "backend CPU us, WAL bytes; x: candidate / today and / SKIP LOCKED (wall, CPU)",
        "",
    ]
    head = (
        f"{'variant':<11}{'k':>4} {'phase':<5}{'wall us':>9}{'cpu us':>8}{'WAL B':>8}"
        f"{'wall/td':>8}{'cpu/td':>7}{'WAL/td':>7}{'wall/SL':>8}{'cpu/SL':>7}"
    )
    lines += [head, "-" * len(head)]

    def fmt(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "-"

    order = {"today": 0, "skiplocked": 9}
    for name in sorted(
        med, key=lambda n: (n.split("|")[2], int(n.split("|")[1]), order.get(n.split("|")[0], 5), n)
    ):
        who, k, phase = name.split("|")
        v, r = med[name], ratios.get(name, {})
        lines.append(
            f"{who:<11}{k:>4} {phase:<5}{v['wall_us']:>9.0f}{v['cpu_us']:>8.0f}{v['wal_b']:>8.0f}"
            f"{fmt(r.get('wall_vs_today')):>8}{fmt(r.get('cpu_vs_today')):>7}"
            f"{fmt(r.get('wal_vs_today')):>7}{fmt(r.get('wall_vs_skiplocked')):>8}"
            f"{fmt(r.get('cpu_vs_skiplocked')):>7}"
        )
    lines += ["", "enqueue of 100 (the refills; per transaction, mean over the run):"]
    for who, phases in raw["enqueue"].items():
        for ph, (wall, cpu, wal, n) in sorted(phases.items()):
            if n:
                lines.append(
                    f"  {who:<10} {ph:<5} {wall / n * 1e6:8.0f} us  cpu {cpu / n * 1e6:6.0f} us"
                    f"  WAL {wal / n:7.0f} B  ({n:.0f} tx)"
                )
    lines += ["", "ring size under a held snapshot (bytes grown by the consumes):"]
    for g in raw["growth"]:
        lines.append(
            f"  {g['who']:<10} enqueue +{g['bytes_after_enqueue'] - g['bytes_start']:>10,}"
            f"  consume-1 +{g['grew_consume_1']:>10,}  consume-100 +{g['grew_consume_100']:>10,}"
        )
    lines += ["", "depth count (ms, median):"]
    for d in raw["depth"]:
        lines.append(
            f"  {d['who']:<10} {d['query']:<12} {d['ms_median']:7.2f} ms  = {d['result']}"
            f" (true {d['truth']})"
        )
    lines += ["", "guards and races:"] + ["  " + g for g in raw["guards"]]
    lines.append(f"\n{seconds:.0f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    p = argument_parser(
        "Consumption recorded in the last row of a stretch against today's row "
        "per entry and a SKIP LOCKED table, at the SQL level."
    )
    d = Config()
    p.add_argument("--capacity", type=int, default=d.capacity, help="slots of each ring")
    p.add_argument("--rounds", type=int, default=d.rounds, help="interleaved rounds")
    p.add_argument(
        "--tx-single", type=int, default=d.tx_single, help="transactions per cell at batch 1"
    )
    p.add_argument(
        "--tx-batch", type=int, default=d.tx_batch, help="transactions per cell at batch > 1"
    )
    p.add_argument(
        "--growth",
        type=int,
        default=d.growth,
        help="consumes at batch 100 under a held snapshot (ring size)",
    )
    p.add_argument(
        "--growth-single",
        type=int,
        default=d.growth_single,
        help="consumes at batch 1 under a held snapshot (ring size)",
    )
    a = p.parse_args(argv)
    if a.rounds < 1 or a.growth % 100 or a.capacity < 2 * (a.growth + a.growth_single):
        p.error(
            "--rounds >= 1; --growth a multiple of 100; "
            "--capacity >= 2 x (--growth + --growth-single)"
        )
    cfg = config_from_options(Config, a)
    if max(cfg.tx_single, cfg.tx_batch * 100) > cfg.capacity // 2:
        p.error("a cell's entries must fit in half the ring")
    return a, cfg


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    tag = secrets.token_hex(3)
    names = [f"rec_{tag}_today"] + [f"rec_{tag}_{k}{m}" for k in ("read", "lock") for m in cfg.ms]

    def cleanup(dsn: str, embedded: bool) -> None:
        drop_queues(dsn, names, embedded=embedded, tables=[f"rec_{tag}_skq"])

    return run_in_database(
        "consume_record",
        args,
        cfg,
        lambda dsn: run(dsn, cfg, tag),
        cleanup,
        summarize,
        lambda raw, summary, seconds: render(raw, summary, seconds),
    )


if __name__ == "__main__":
    sys.exit(main())
