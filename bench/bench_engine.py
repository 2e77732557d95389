"""Engine benchmarks: ringq against a SKIP LOCKED queue and a one-row-update ceiling.

Prints a table and writes JSON (``bench/results/engine-<timestamp>.json`` and
``--out PATH``). It measures; it never asserts a timing. Each target is
reported as met or not met.

Everything runs in ONE process tree on ONE database: the project's embedded
PostgreSQL (``ringq.cluster.Cluster``, started under a temporary home and
removed afterwards) unless ``--dsn`` names another. The machine is noisy, so
the short measurements run in interleaved rounds (ringq, SKIP LOCKED, ceiling,
ringq SQL only, concurrent, rotating the order each round) and the table shows
the median of the rounds with their spread; ratios are taken within a round,
then the median of those. The targets of the engine-speed issue are printed as
met / NOT MET.

Run ``python bench/bench_engine.py --help``; ``bench/README.md`` says what each
figure means.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import posix_ipc
import psycopg
from _benchlib import (
    CEIL_UPDATE,
    argument_parser,
    ceiling_one_rt,
    cpu_load,
    create_ceiling,
    drop_queues,
    machine,
    run_in_database,
    server_settings,
)
from _concurrent import concurrent_ringq, concurrent_skq
from psycopg import sql
from ringq.engine import connect, metrics, queue_table
from ringq.engine.sqlfile import load
from ringq.scripting import QueueSpec, create_queue

FORK = mp.get_context("fork")
ENGINE_SQL = load(
    "ringq.engine", "queries.sql"
)  # the engine's own statements, for the SQL-only baseline

# -- the SQL of the comparison queues (named blocks; tables only via sql.Identifier) --------

SKQ_CREATE = (
    "CREATE TABLE {t} (id bigserial PRIMARY KEY, payload bytea, enq_at timestamptz DEFAULT now())"
)
SKQ_ENQUEUE = "INSERT INTO {t} (payload) VALUES (%s)"
SKQ_DEQUEUE = (
    "DELETE FROM {t} WHERE id = (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) "
    "RETURNING payload"
)
SKQ_ENQUEUE_MANY = "INSERT INTO {t} (payload) SELECT unnest(%s::bytea[])"
SKQ_DEQUEUE_MANY = (
    "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED LIMIT %s) "
    "RETURNING payload"
)
# The next BEGIN riding on COMMIT (ringq's former eager-begin protocol).
CEIL_UPDATE_EAGER = "COMMIT; BEGIN"
SIZES = """
SELECT pg_relation_size(c.oid),
       COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
       pg_indexes_size(c.oid),
       pg_total_relation_size(c.oid)
FROM pg_class c WHERE c.oid = %s::regclass
"""
TABLE_STATS = """
SELECT n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,
       autovacuum_count, vacuum_count
FROM pg_stat_user_tables WHERE relid = %s::regclass
"""


# -- figures -------------------------------------------------------------------------------


def latency_summary(samples_ns: list[int]) -> dict[str, float]:
    """p50/p90/p99/max/mean of call latencies, in microseconds."""
    a = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    if a.size == 0:
        return {"n": 0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "n": int(a.size),
        "p50_us": float(p50),
        "p90_us": float(p90),
        "p99_us": float(p99),
        "max_us": float(a.max()),
        "mean_us": float(a.mean()),
    }


@dataclass(frozen=True)
class Names:
    """The objects one run creates (unique, so ``--dsn`` never touches anyone else's)."""

    tag: str

    @property
    def ring(self) -> str:  # rounds
        return f"bench_{self.tag}"

    @property
    def ring_wake(self) -> str:
        return f"bench_{self.tag}_w"

    @property
    def ring_volume(self) -> str:
        return f"bench_{self.tag}_v"

    @property
    def ring_sql(self) -> str:  # the SQL-only baseline: the engine never touches it
        return f"bench_{self.tag}_s"

    @property
    def ring_concurrent(self) -> str:  # shared mode: the consumers dequeue side by side
        return f"bench_{self.tag}_c"

    @property
    def skq(self) -> str:
        return f"skq_{self.tag}"

    @property
    def skq_concurrent(self) -> str:
        return f"skq_{self.tag}_c"

    @property
    def skq_volume(self) -> str:
        return f"skq_{self.tag}_v"

    @property
    def ceiling(self) -> str:
        return f"ceil_{self.tag}"


def q(template: str, table: str) -> sql.Composed:
    return sql.SQL(template).format(t=sql.Identifier(table))


def ring_table(queue: str) -> str:
    return f"ringq.q_{queue}"


# -- ringq ---------------------------------------------------------------------------------


def bench_ringq(
    dsn: str, queue: str, payload: bytes, n_single: int, n_batches: int, batch: int
) -> dict[str, Any]:
    """Call latency each way, single-entry tx/s each way, batched entries/s each way."""
    with connect(dsn) as prod, connect(dsn) as cons:
        # Warm-up: queue info cached, section block loaded, statements prepared.
        for _ in range(10):
            prod.enqueue(queue, payload)
            prod.commit()
        for _ in range(10):
            assert cons.dequeue(queue) is not None
            cons.commit()

        lat: list[int] = []
        pc = time.perf_counter_ns
        start = pc()
        for _ in range(n_single):
            t0 = pc()
            prod.enqueue(queue, payload)
            lat.append(pc() - t0)
            prod.commit()
        enq_elapsed = pc() - start
        enq = latency_summary(lat)

        lat = []
        start = pc()
        for _ in range(n_single):
            t0 = pc()
            m = cons.dequeue(queue)
            lat.append(pc() - t0)
            cons.commit()
            if m is None:
                raise RuntimeError(f"ringq: queue {queue} ran dry after {len(lat)} dequeues")
        deq_elapsed = pc() - start
        deq = latency_summary(lat)

        batch_payloads = [payload] * batch
        start = pc()
        for _ in range(n_batches):
            prod.enqueue_many(queue, batch_payloads)
            prod.commit()
        enq_many_elapsed = pc() - start
        got = 0
        start = pc()
        for _ in range(n_batches):
            got += len(cons.dequeue_many(queue, batch))
            cons.commit()
        deq_many_elapsed = pc() - start
        if got != n_batches * batch:
            raise RuntimeError(f"ringq: dequeued {got} of {n_batches * batch} batched entries")
    return {
        "enqueue_latency": enq,
        "dequeue_latency": deq,
        "enqueue_tx_per_s": n_single / (enq_elapsed / 1e9),
        "dequeue_tx_per_s": n_single / (deq_elapsed / 1e9),
        "enqueue_many_entries_per_s": n_batches * batch / (enq_many_elapsed / 1e9),
        "dequeue_many_entries_per_s": n_batches * batch / (deq_many_elapsed / 1e9),
    }


def _wake_consumer(dsn: str, queue: str, n: int, pipe: Connection) -> None:
    """Child process: block in dequeue(wait=...) n times; send back (seq, monotonic ns at
    return)."""
    out: list[tuple[int, int]] = []
    try:
        with connect(dsn) as s:
            s.queue_info(queue)
            for _ in range(n):
                pipe.send(("ready", None))
                m = s.dequeue(queue, wait=10.0)
                t = time.monotonic_ns()
                s.commit()
                if m is None:
                    raise RuntimeError("wake-up: no entry within 10 s")
                out.append((m.seq, t))
        pipe.send(("done", out))
    except BaseException as exc:  # report to the parent instead of hanging it
        pipe.send(("error", repr(exc)))
        raise


def bench_wakeup(dsn: str, queue: str, payload: bytes, n: int) -> dict[str, Any]:
    """Commit-to-dequeue latency: producer's clock after commit() returns, consumer's after
    dequeue() returns.

    Both read CLOCK_MONOTONIC (time.monotonic_ns), which is shared by the
    processes of one host. Before each enqueue the producer waits until the
    section shows the consumer registered as a sleeping dequeuer, then 1 ms more
    so that it is inside the semaphore wait, not between registering and sleeping.
    """
    parent, child = FORK.Pipe()
    proc = FORK.Process(target=_wake_consumer, args=(dsn, queue, n, child), daemon=True)
    proc.start()
    sent: dict[int, int] = {}
    confirmed = 0
    try:
        with connect(dsn) as prod:
            prod.queue_info(queue)
            for _ in range(n):
                what, detail = parent.recv()
                if what != "ready":
                    raise RuntimeError(f"wake-up consumer: {detail}")
                deadline = time.monotonic() + 2.0
                while prod.stats(queue)[metrics.WAIT_READY] == 0 and time.monotonic() < deadline:
                    time.sleep(0.0002)
                confirmed += prod.stats(queue)[metrics.WAIT_READY] > 0
                time.sleep(0.001)
                seq = prod.enqueue(queue, payload)
                prod.commit()
                sent[seq] = time.monotonic_ns()
        what, got = parent.recv()
        if what != "done":
            raise RuntimeError(f"wake-up consumer: {got}")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    diffs = [t - sent[seq] for seq, t in got if seq in sent]
    out = latency_summary(diffs)
    out["consumer_confirmed_asleep"] = confirmed
    out["negative"] = sum(
        d < 0 for d in diffs
    )  # consumer returned before the producer's commit() did
    return out


class RingSQL:
    """The engine's own statements (engine/queries.sql) issued straight through psycopg on a
    queue table the engine never loads: what ringq would cost with a free section and no
    Python around the SQL. Same protocol as a session: an enqueue transaction is its guarded
    row write alone, in autocommit (one round trip); a dequeue is BEGIN + the consuming
    UPDATE in one pipeline, then COMMIT (two). A dequeue's engine time = ringq - this."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.next_seq = 0  # next sequence to enqueue (the table's rows start at seq -1)
        self.next_deq = 0  # oldest sequence not yet dequeued

    def stmt(self, name: str) -> str:
        return (
            sql.SQL(ENGINE_SQL[name])
            .format(table=queue_table(self.queue), queue=sql.Literal(self.queue))
            .as_string(None)
        )


def _begin_with(conn: psycopg.Connection[Any], query: str, params: Any) -> psycopg.Cursor[Any]:
    """BEGIN and ``query`` in one round trip (``conn`` is in autocommit), as a session's dequeue."""
    cur = conn.cursor()
    with conn.pipeline():
        conn.execute("BEGIN", prepare=False)
        cur.execute(query, params, binary=True)
    return cur


def bench_ring_sql(
    dsn: str, st: RingSQL, capacity: int, payload: bytes, n_single: int, n_batches: int, batch: int
) -> dict[str, Any]:
    enq_sql, deq_sql = st.stmt("enqueue"), st.stmt("dequeue")
    enq_many_sql, deq_many_sql = st.stmt("enqueue_many"), st.stmt("dequeue_many")
    pc = time.perf_counter_ns

    def enqueue(conn: psycopg.Connection[Any]) -> None:
        s = st.next_seq
        # raises if the guard fails
        conn.execute(enq_sql, (s, payload, "bench", s, None, s % capacity, s))  # no group
        st.next_seq += 1

    def dequeue(conn: psycopg.Connection[Any]) -> None:
        s = st.next_deq
        if _begin_with(conn, deq_sql, (s % capacity, s)).fetchone() is None:
            raise RuntimeError(f"ringq SQL baseline: dequeue of seq {s} matched no row")
        st.next_deq += 1

    def end(kind: str, conn: psycopg.Connection[Any]) -> None:
        if kind == "dequeue":  # an enqueue committed by itself (autocommit)
            conn.execute("COMMIT")

    with (
        psycopg.connect(dsn, autocommit=True) as prod,
        psycopg.connect(dsn, autocommit=True) as cons,
    ):
        for _ in range(10):
            enqueue(prod)
        for _ in range(10):
            dequeue(cons)
            end("dequeue", cons)
        out: dict[str, Any] = {}
        for kind, conn, fn in (("enqueue", prod, enqueue), ("dequeue", cons, dequeue)):
            lat: list[int] = []
            start = pc()
            for _ in range(n_single):
                t0 = pc()
                fn(conn)
                lat.append(pc() - t0)
                end(kind, conn)
            out[f"{kind}_tx_per_s"] = n_single / ((pc() - start) / 1e9)
            out[f"{kind}_latency"] = latency_summary(lat)

        items = [payload] * batch
        start = pc()
        for _ in range(n_batches):
            seqs = list(range(st.next_seq, st.next_seq + batch))
            prod.execute(
                enq_many_sql,
                ([x % capacity for x in seqs], seqs, items, ["bench"] * batch, seqs,
                 [None] * batch, batch),
            )
            st.next_seq += batch  # committed by itself (autocommit); a guard that fails raises
        out["enqueue_many_entries_per_s"] = n_batches * batch / ((pc() - start) / 1e9)
        start = pc()
        for _ in range(n_batches):
            seqs = list(range(st.next_deq, st.next_deq + batch))
            rows = _begin_with(cons, deq_many_sql, ([x % capacity for x in seqs], seqs)).fetchall()
            if len(rows) != batch:
                raise RuntimeError("ringq SQL baseline: a batched dequeue matched fewer rows")
            st.next_deq += batch
            cons.execute("COMMIT")
        out["dequeue_many_entries_per_s"] = n_batches * batch / ((pc() - start) / 1e9)
    return out


def _sem_waiter(name: str, n: int, pipe: Connection) -> None:
    sem = posix_ipc.Semaphore(name)
    out: list[int] = []
    try:
        for _ in range(n):
            pipe.send("ready")
            sem.acquire(10.0)
            out.append(time.monotonic_ns())
        pipe.send(out)
    finally:
        sem.close()


def bench_sem_wakeup(n: int) -> dict[str, Any]:
    """The floor under the wake-up figure: a bare posix-ipc semaphore post waking a sleeping
    process (the kind of wake-up the engine uses), timed the same way, with no database."""
    name = f"/ringq-bench-{os.getpid()}-{secrets.token_hex(4)}"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=0)
    parent, child = FORK.Pipe()
    proc = FORK.Process(target=_sem_waiter, args=(name, n, child), daemon=True)
    proc.start()
    sent: list[int] = []
    try:
        for _ in range(n):
            parent.recv()
            time.sleep(0.001)
            sem.release()
            sent.append(time.monotonic_ns())
        got = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        sem.unlink()
        sem.close()
    return latency_summary([g - s for g, s in zip(got, sent, strict=True)])


# -- SKIP LOCKED textbook queue -----------------------------------------------------------------


def create_skq(admin: psycopg.Connection[Any], table: str) -> None:
    admin.execute(q(SKQ_CREATE, table))


def bench_skq(
    dsn: str, table: str, payload: bytes, n_single: int, n_batches: int, batch: int
) -> dict[str, Any]:
    """The same figures for INSERT / DELETE ... FOR UPDATE SKIP LOCKED, on a default psycopg
    connection."""
    enq_sql, deq_sql = q(SKQ_ENQUEUE, table), q(SKQ_DEQUEUE, table)
    enq_many_sql, deq_many_sql = q(SKQ_ENQUEUE_MANY, table), q(SKQ_DEQUEUE_MANY, table)
    with psycopg.connect(dsn) as prod, psycopg.connect(dsn) as cons:
        for _ in range(10):
            prod.execute(enq_sql, (payload,))
            prod.commit()
        for _ in range(10):
            assert cons.execute(deq_sql).fetchone() is not None
            cons.commit()

        pc = time.perf_counter_ns
        lat: list[int] = []
        start = pc()
        for _ in range(n_single):
            t0 = pc()
            prod.execute(enq_sql, (payload,))
            lat.append(pc() - t0)
            prod.commit()
        enq_elapsed = pc() - start
        enq = latency_summary(lat)

        lat = []
        start = pc()
        for _ in range(n_single):
            t0 = pc()
            row = cons.execute(deq_sql).fetchone()
            lat.append(pc() - t0)
            cons.commit()
            if row is None:
                raise RuntimeError(f"skq: table {table} ran dry after {len(lat)} dequeues")
        deq_elapsed = pc() - start
        deq = latency_summary(lat)

        batch_payloads = [payload] * batch
        start = pc()
        for _ in range(n_batches):
            prod.execute(enq_many_sql, (batch_payloads,))
            prod.commit()
        enq_many_elapsed = pc() - start
        got = 0
        start = pc()
        for _ in range(n_batches):
            got += len(cons.execute(deq_many_sql, (batch,)).fetchall())
            cons.commit()
        deq_many_elapsed = pc() - start
        if got != n_batches * batch:
            raise RuntimeError(f"skq: dequeued {got} of {n_batches * batch} batched entries")
    return {
        "enqueue_latency": enq,
        "dequeue_latency": deq,
        "enqueue_tx_per_s": n_single / (enq_elapsed / 1e9),
        "dequeue_tx_per_s": n_single / (deq_elapsed / 1e9),
        "enqueue_many_entries_per_s": n_batches * batch / (enq_many_elapsed / 1e9),
        "dequeue_many_entries_per_s": n_batches * batch / (deq_many_elapsed / 1e9),
    }


# -- ceiling -------------------------------------------------------------------------------------


def bench_ceiling(dsn: str, table: str, n: int) -> dict[str, float]:
    """One-row UPDATE + COMMIT transactions/s, three ways.

    ``one_rt``: autocommit, the UPDATE is its own transaction: one round trip,
    one WAL flush, the least a durable one-row transaction costs from here (the
    targets use this one). ``eager_2rt``: UPDATE, then ``COMMIT; BEGIN`` in one
    message: two round trips, as many as ringq's own protocol. ``psycopg_3rt``: a default
    psycopg connection, BEGIN + UPDATE + COMMIT (three round trips).
    """
    upd = q(CEIL_UPDATE, table)
    out: dict[str, float] = {}
    pc = time.perf_counter_ns
    with psycopg.connect(dsn, autocommit=True) as conn:
        out["one_rt_tx_per_s"] = ceiling_one_rt(conn, table, n)

        conn.execute("BEGIN")
        for _ in range(10):
            conn.execute(upd)
            conn.execute(CEIL_UPDATE_EAGER)
        start = pc()
        for _ in range(n):
            conn.execute(upd)
            conn.execute(CEIL_UPDATE_EAGER)
        out["eager_2rt_tx_per_s"] = n / ((pc() - start) / 1e9)
        conn.execute("ROLLBACK")
    with psycopg.connect(dsn) as conn:
        for _ in range(10):
            conn.execute(upd)
            conn.commit()
        start = pc()
        for _ in range(n):
            conn.execute(upd)
            conn.commit()
        out["psycopg_3rt_tx_per_s"] = n / ((pc() - start) / 1e9)
    return out


# -- volume: table size after many entries -----------------------------------------------------


def table_sizes(conn: psycopg.Connection[Any], table: str) -> dict[str, int]:
    row = conn.execute(SIZES, (table,)).fetchone()
    assert row is not None
    heap, toast, indexes, total = row
    st = conn.execute(TABLE_STATS, (table,)).fetchone()
    keys = ("n_live_tup", "n_dead_tup", "n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del",
            "autovacuum_count", "vacuum_count")  # fmt: skip
    stats = dict(zip(keys, st, strict=True)) if st else {}
    return {"heap": heap, "toast": toast, "indexes": indexes, "total": total, **stats}


class Progress:
    """One status line on a terminal (rewritten), a line every 10% otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.last_tenth = -1
        self.last_draw = 0.0

    def update(self, done: int) -> None:
        now = time.perf_counter()
        rate = done / max(now - self.start, 1e-9)
        text = (
            f"  {self.label}: {done:,}/{self.total:,} ({100 * done / self.total:3.0f}%) "
            f"{rate:,.0f} entries/s"
        )
        if self.tty:
            if now - self.last_draw > 0.25 or done == self.total:
                sys.stderr.write("\r" + text + "   ")
                sys.stderr.flush()
                self.last_draw = now
        else:
            tenth = 10 * done // self.total
            if tenth != self.last_tenth:
                self.last_tenth = tenth
                print(text, file=sys.stderr, flush=True)

    def done(self) -> float:
        if self.tty:
            sys.stderr.write("\n")
        return time.perf_counter() - self.start


def settled_sizes(
    conn: psycopg.Connection[Any], table: str, before: dict[str, int]
) -> dict[str, int]:
    """Sizes and statistics once the closed sessions' backends have flushed their counters
    (they do at exit; until then pg_stat_user_tables lags): counters steady for 0.5 s, at most
    10 s."""
    deadline = time.monotonic() + 10.0
    last = table_sizes(conn, table)
    steady_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = table_sizes(conn, table)
        if now != last:
            last, steady_since = now, time.monotonic()
        elif time.monotonic() - steady_since >= 0.5 and now.get("n_tup_ins", 0) + now.get(
            "n_tup_upd", 0
        ) > before.get("n_tup_ins", 0) + before.get("n_tup_upd", 0):
            break
    return last


def volume_ringq(
    dsn: str, queue: str, payload: bytes, volume: int, batch: int, wrap_at: int
) -> dict[str, Any]:
    """``volume`` entries through the queue, ``batch`` per transaction each way; sizes before,
    after ``wrap_at`` entries (the ring's first wrap: every row has held a payload) and after."""
    table = ring_table(queue)
    with psycopg.connect(dsn, autocommit=True) as admin:
        before = table_sizes(admin, table)
        wrap: dict[str, int] | None = None
        with connect(dsn) as prod, connect(dsn) as cons:
            items = [payload] * batch
            prog = Progress("ringq volume", volume)
            done = 0
            while done < volume:
                n = min(batch, volume - done)
                prod.enqueue_many(queue, items[:n])
                prod.commit()
                got = len(cons.dequeue_many(queue, n))
                cons.commit()
                if got != n:
                    raise RuntimeError(f"ringq volume: dequeued {got} of {n}")
                if done < wrap_at <= done + n:
                    wrap = table_sizes(admin, table)
                done += n
                prog.update(done)
            elapsed = prog.done()
        after = settled_sizes(admin, table, before)
    return _volume_result(before, wrap, after, volume, elapsed)


def volume_skq(
    dsn: str, table: str, payload: bytes, volume: int, batch: int, wrap_at: int
) -> dict[str, Any]:
    enq_many_sql, deq_many_sql = q(SKQ_ENQUEUE_MANY, table), q(SKQ_DEQUEUE_MANY, table)
    with psycopg.connect(dsn, autocommit=True) as admin:
        before = table_sizes(admin, table)
        wrap: dict[str, int] | None = None
        with psycopg.connect(dsn) as prod, psycopg.connect(dsn) as cons:
            items = [payload] * batch
            prog = Progress("skip-locked volume", volume)
            done = 0
            while done < volume:
                n = min(batch, volume - done)
                prod.execute(enq_many_sql, (items[:n],))
                prod.commit()
                got = len(cons.execute(deq_many_sql, (n,)).fetchall())
                cons.commit()
                if got != n:
                    raise RuntimeError(f"skq volume: dequeued {got} of {n}")
                if done < wrap_at <= done + n:
                    wrap = table_sizes(admin, table)
                done += n
                prog.update(done)
            elapsed = prog.done()
        after = settled_sizes(admin, table, before)
    return _volume_result(before, wrap, after, volume, elapsed)


def _volume_result(
    before: dict[str, int],
    wrap: dict[str, int] | None,
    after: dict[str, int],
    volume: int,
    elapsed: float,
) -> dict[str, Any]:
    def growth(a: dict[str, int] | None, b: dict[str, int]) -> float | None:
        return (b["total"] - a["total"]) / a["total"] if a and a["total"] else None

    return {
        "entries": volume,
        "seconds": elapsed,
        "entries_per_s_each_way": volume / elapsed,
        "before": before,
        "after_first_wrap": wrap,
        "after": after,
        "growth": growth(before, after),
        "growth_after_first_wrap": growth(wrap, after),
    }


# -- the run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    rounds: int
    single: int
    batches: int
    batch: int
    wakeups: int
    volume: int
    volume_capacity: int
    payload: int
    capacity: int
    concurrent_seconds: float
    producers: int
    consumers: int


def run(dsn: str, cfg: Config, names: Names) -> dict[str, Any]:
    payload = secrets.token_bytes(cfg.payload)
    with psycopg.connect(dsn, autocommit=True) as admin:
        for name, cap in (
            (names.ring, cfg.capacity),
            (names.ring_sql, cfg.capacity),
            (names.ring_wake, 1024),
            (names.ring_volume, cfg.volume_capacity),
        ):
            create_queue(admin, QueueSpec(name, cap, max(cfg.payload, 1)))
        create_queue(
            admin,
            QueueSpec(names.ring_concurrent, cfg.capacity, cfg.payload, dequeue_mode="shared"),
        )
        create_skq(admin, names.skq)
        create_skq(admin, names.skq_volume)
        create_skq(admin, names.skq_concurrent)
        create_ceiling(admin, names.ceiling)
        env = environment(admin)

    ring_sql = RingSQL(names.ring_sql)
    # Steady state first: every ring row has held a payload once (the first wrap widens
    # the pre-populated rows, see the volume part), and the SKIP LOCKED table has had the
    # same traffic. The rounds then measure a queue in use, not a fresh one.
    print(f"warm-up: {cfg.capacity:,} entries through each queue ...", file=sys.stderr, flush=True)
    warm_up(dsn, names, ring_sql, cfg, payload)

    rounds: list[dict[str, Any]] = []
    # Each takes the round's index (0, 1, ...).
    kinds: list[tuple[str, Callable[[int], Any]]] = [
        (
            "ringq",
            lambda r: bench_ringq(dsn, names.ring, payload, cfg.single, cfg.batches, cfg.batch),
        ),
        (
            "skip_locked",
            lambda r: bench_skq(dsn, names.skq, payload, cfg.single, cfg.batches, cfg.batch),
        ),
        ("ceiling", lambda r: bench_ceiling(dsn, names.ceiling, cfg.single)),
        (
            "ringq_sql",
            lambda r: bench_ring_sql(
                dsn, ring_sql, cfg.capacity, payload, cfg.single, cfg.batches, cfg.batch
            ),
        ),
    ]
    if cfg.concurrent_seconds:
        kinds.append(("concurrent", lambda r: bench_concurrent(dsn, names, cfg, payload, r)))
    for r in range(cfg.rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        res: dict[str, Any] = {"round": r + 1, "order": [k for k, _ in order]}
        for kind, fn in order:
            print(f"round {r + 1}/{cfg.rounds}: {kind} ...", file=sys.stderr, flush=True)
            res[kind] = fn(r)
            if kind == "ringq" and cfg.wakeups:
                res["ringq"]["wakeup"] = bench_wakeup(dsn, names.ring_wake, payload, cfg.wakeups)
                res["ringq"]["semaphore_wakeup"] = bench_sem_wakeup(cfg.wakeups)
        rounds.append(res)

    volume: dict[str, Any] = {}
    if cfg.volume:
        print(f"volume: {cfg.volume:,} entries through a {cfg.volume_capacity:,}-slot ringq queue, "
              f"then through the SKIP LOCKED table, {cfg.batch} per transaction",
              file=sys.stderr, flush=True)  # fmt: skip
        volume["ringq"] = volume_ringq(
            dsn, names.ring_volume, payload, cfg.volume, cfg.batch, cfg.volume_capacity
        )
        volume["skip_locked"] = volume_skq(
            dsn, names.skq_volume, payload, cfg.volume, cfg.batch, cfg.volume_capacity
        )
    env.update(cpu_load("end"))
    return {"environment": env, "rounds": rounds, "volume": volume}


def bench_concurrent(
    dsn: str, names: Names, cfg: Config, payload: bytes, round_index: int
) -> dict[str, Any]:
    """Both sides of the concurrent figure, one after the other; which goes first alternates
    with the round."""
    skq_statements = [q(t, names.skq_concurrent) for t in (SKQ_ENQUEUE, SKQ_DEQUEUE,
                                                           SKQ_DEQUEUE_MANY)]  # fmt: skip
    sides: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("ringq", lambda: concurrent_ringq(
            dsn, names.ring_concurrent, payload, cfg.producers, cfg.consumers,
            cfg.concurrent_seconds)),
        ("skip_locked", lambda: concurrent_skq(
            dsn, skq_statements, payload, cfg.producers, cfg.consumers, cfg.concurrent_seconds)),
    ]  # fmt: skip
    if round_index % 2:
        sides.reverse()
    out: dict[str, Any] = {"order": [side for side, _ in sides]}
    for side, fn in sides:
        out[side] = fn()
    return out


def warm_up(dsn: str, names: Names, ring_sql: RingSQL, cfg: Config, payload: bytes) -> None:
    """Pass ``cfg.capacity`` entries through each contender, ``cfg.batch`` per transaction."""
    items = [payload] * cfg.batch
    passes = -(-cfg.capacity // cfg.batch)
    with connect(dsn) as prod, connect(dsn) as cons:
        for ring in (names.ring, names.ring_concurrent):
            for _ in range(passes):
                prod.enqueue_many(ring, items)
                prod.commit()
                cons.dequeue_many(ring, cfg.batch)
                cons.commit()
    enq_many_sql, deq_many_sql = ring_sql.stmt("enqueue_many"), ring_sql.stmt("dequeue_many")
    cap = cfg.capacity
    with psycopg.connect(dsn) as conn:
        for _ in range(passes):
            seqs = list(range(ring_sql.next_seq, ring_sql.next_seq + cfg.batch))
            slots = [x % cap for x in seqs]
            conn.execute(
                enq_many_sql,
                (slots, seqs, items, ["bench"] * cfg.batch, seqs, [None] * cfg.batch, cfg.batch),
            )
            conn.commit()
            conn.execute(deq_many_sql, (slots, seqs), binary=True)
            conn.commit()
            ring_sql.next_seq += cfg.batch
            ring_sql.next_deq += cfg.batch
        for table in (names.skq, names.skq_concurrent):
            for _ in range(passes):
                conn.execute(q(SKQ_ENQUEUE_MANY, table), (items,))
                conn.commit()
                conn.execute(q(SKQ_DEQUEUE_MANY, table), (cfg.batch,))
                conn.commit()


def environment(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    return {
        "server": server_settings(conn),
        **machine(),
        "psycopg_impl": psycopg.pq.__impl__,
        "numpy": np.__version__,
        **cpu_load("start"),
    }


# -- summary: medians, ratios, targets -------------------------------------------------------------

# (key in the summary, path into a round's result)
FIGURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("enqueue call p50 (us)", "enq_p50", ("enqueue_latency", "p50_us")),
    ("enqueue call p99 (us)", "enq_p99", ("enqueue_latency", "p99_us")),
    ("dequeue call p50 (us)", "deq_p50", ("dequeue_latency", "p50_us")),
    ("dequeue call p99 (us)", "deq_p99", ("dequeue_latency", "p99_us")),
    ("enqueue+commit tx/s", "enq_tps", ("enqueue_tx_per_s",)),
    ("dequeue+commit tx/s", "deq_tps", ("dequeue_tx_per_s",)),
    ("batched enqueue entries/s", "enq_many", ("enqueue_many_entries_per_s",)),
    ("batched dequeue entries/s", "deq_many", ("dequeue_many_entries_per_s",)),
]


def _get(d: dict[str, Any], path: tuple[str, ...]) -> float:
    for p in path:
        d = d[p]
    return float(d)  # type: ignore[arg-type]


def _med(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(raw: dict[str, Any], cfg: Config) -> dict[str, Any]:
    rounds = raw["rounds"]
    fig: dict[str, dict[str, Any]] = {}
    for _label, key, path in FIGURES:
        fig[key] = {
            kind: _med([_get(r[kind], path) for r in rounds])
            for kind in ("ringq", "ringq_sql", "skip_locked")
        }
    for key in ("one_rt_tx_per_s", "eager_2rt_tx_per_s", "psycopg_3rt_tx_per_s"):
        fig["ceiling_" + key] = {"ceiling": _med([r["ceiling"][key] for r in rounds])}
    if "wakeup" in rounds[0]["ringq"]:
        for p in ("p50_us", "p99_us"):
            fig["wakeup_" + p] = {"ringq": _med([r["ringq"]["wakeup"][p] for r in rounds])}
            fig["sem_wakeup_" + p] = {
                "ringq": _med([r["ringq"]["semaphore_wakeup"][p] for r in rounds])
            }

    def ratio(fn: Callable[[dict[str, Any]], float]) -> dict[str, float]:
        return _med([fn(r) for r in rounds])

    R = "ringq"
    S = "skip_locked"
    ratios: dict[str, dict[str, float]] = {}
    for _label, key, path in FIGURES:
        for other, suffix in ((S, "skq"), ("ringq_sql", "sql")):
            per_round = [_get(r[R], path) / _get(r[other], path) for r in rounds]
            ratios[f"{key}_ringq_over_{suffix}"] = _med(per_round)
    ratios |= {
        "enq_tps_ringq_over_ceiling": ratio(
            lambda r: r[R]["enqueue_tx_per_s"] / r["ceiling"]["one_rt_tx_per_s"]
        ),
        "deq_tps_ringq_over_ceiling": ratio(
            lambda r: r[R]["dequeue_tx_per_s"] / r["ceiling"]["one_rt_tx_per_s"]
        ),
        "enq_tps_ringq_over_ceiling_2rt": ratio(
            lambda r: r[R]["enqueue_tx_per_s"] / r["ceiling"]["eager_2rt_tx_per_s"]
        ),
        "deq_tps_ringq_over_ceiling_2rt": ratio(
            lambda r: r[R]["dequeue_tx_per_s"] / r["ceiling"]["eager_2rt_tx_per_s"]
        ),
        "enq_tps_skq_over_ceiling": ratio(
            lambda r: r[S]["enqueue_tx_per_s"] / r["ceiling"]["one_rt_tx_per_s"]
        ),
        "deq_tps_skq_over_ceiling": ratio(
            lambda r: r[S]["dequeue_tx_per_s"] / r["ceiling"]["one_rt_tx_per_s"]
        ),
    }

    if "concurrent" in rounds[0]:
        for key, field in (
            ("concurrent", "committed_entries_per_s"),
            ("concurrent_enqueued", "enqueued_entries_per_s"),
        ):
            fig[key] = {
                kind: _med([r["concurrent"][kind][field] for r in rounds]) for kind in (R, S)
            }
            ratios[f"{key}_ringq_over_skq"] = _med(
                [r["concurrent"][R][field] / r["concurrent"][S][field] for r in rounds]
            )

    # Engine time per call outside the database, median of rounds. An enqueue sends nothing
    # at call time (its write goes with the commit), so the call is the engine's time alone;
    # a dequeue sends its UPDATE, so the engine's time is the call minus the same SQL sent
    # straight through psycopg.
    engine_us = {
        "enqueue_call_p50": fig["enq_p50"]["ringq"],
        "enqueue_call_p99": fig["enq_p99"]["ringq"],
    }
    for p in ("p50", "p99"):
        deq = [_get(r[R], ("dequeue_latency", f"{p}_us")) for r in rounds]
        sql_only = [_get(r["ringq_sql"], ("dequeue_latency", f"{p}_us")) for r in rounds]
        engine_us[f"dequeue_call_{p}_minus_sql"] = _med(
            [a - b for a, b in zip(deq, sql_only, strict=True)]
        )

    targets: list[dict[str, Any]] = []

    def target(name: str, value: float | None, op: str, bound: float) -> None:
        met = (
            None
            if value is None
            else (value <= bound if op == "<=" else value < bound if op == "<" else value >= bound)
        )
        targets.append({"name": name, "value": value, "target": f"{op} {bound:,g}", "met": met})

    def median(table: dict[str, Any], key: str, *path: str) -> float | None:
        if key not in table:
            return None  # the part was skipped (--wakeups 0, --concurrent-seconds 0)
        d = table[key]
        for p in path:
            d = d[p]
        return float(d["median"])

    conc = f"{cfg.producers}+{cfg.consumers}"
    for name, value, op, bound in (
        ("enqueue call p50, ringq/skip-locked", median(ratios, "enq_p50_ringq_over_skq"),
         "<=", 0.1),
        ("dequeue call p50, ringq/skip-locked", median(ratios, "deq_p50_ringq_over_skq"),
         "<=", 0.2),
        ("enqueue+commit tx/s, ringq/1-rt ceiling", median(ratios, "enq_tps_ringq_over_ceiling"),
         ">=", 0.9),
        ("enqueue+commit tx/s, ringq/skip-locked", median(ratios, "enq_tps_ringq_over_skq"),
         ">=", 1.3),
        ("dequeue+commit tx/s, ringq/1-rt ceiling", median(ratios, "deq_tps_ringq_over_ceiling"),
         ">=", 0.9),
        ("dequeue+commit tx/s, ringq/skip-locked", median(ratios, "deq_tps_ringq_over_skq"),
         ">=", 1.3),
        ("batched enqueue, ringq entries/s", median(fig, "enq_many", "ringq"), ">=", 60_000),
        ("batched dequeue, ringq entries/s", median(fig, "deq_many", "ringq"), ">=", 100_000),
        ("wake-up p50, ringq (us)", median(fig, "wakeup_p50_us", "ringq"), "<", 200),
        (f"concurrent {conc} entries/s, ringq/skip-locked",
         median(ratios, "concurrent_ringq_over_skq"), ">=", 1.5),
        ("engine time per enqueue call, p50 (us)", median(engine_us, "enqueue_call_p50"),
         "<=", 20),
    ):  # fmt: skip
        target(name, value, op, bound)
    targets.append({
        "name": "engine time per dequeue call, p50 (us): ringq - ringq SQL only",
        "value": median(engine_us, "dequeue_call_p50_minus_sql"), "target": "info", "met": None,
    })  # fmt: skip
    return {"figures": fig, "ratios": ratios, "engine_us": engine_us, "targets": targets}


def _fmt(v: float, unit: str = "") -> str:
    if unit == "B":
        for u in ("B", "kB", "MB", "GB"):
            if abs(v) < 1024 or u == "GB":
                return f"{v:,.0f} {u}" if u == "B" else f"{v:,.1f} {u}"
            v /= 1024
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def render(raw: dict[str, Any], summary: dict[str, Any], cfg: Config, seconds: float) -> str:
    fig, ratios = summary["figures"], summary["ratios"]
    lines: list[str] = []
    env = raw["environment"]["server"]
    lines.append(
        f"ringq engine benchmark: PostgreSQL {env['server_version']}, "
        f"synchronous_commit={env['synchronous_commit']}, "
        f"fsync={env['fsync']}, {raw['environment']['cpus']} CPUs, payload {cfg.payload} B"
    )
    lines.append(
        f"{cfg.rounds} interleaved rounds of {cfg.single:,} single-entry tx each way, "
        f"{cfg.batches} x {cfg.batch} batched, "
        f"{cfg.wakeups} wake-ups; median of rounds [min-max]; run took {seconds:.0f} s"
    )
    if cfg.concurrent_seconds:
        lines.append(
            f"concurrent: {cfg.producers} producer + {cfg.consumers} consumer processes, "
            f"{cfg.concurrent_seconds:g} s per side per round, one-entry transactions "
            "(ringq queue in shared dequeue mode)"
        )
    e = raw["environment"]
    lines.append(
        f"load average at start {e['loadavg_at_start'][0]:.2f}, "
        f"at end {e['loadavg_at_end'][0]:.2f} "
        "(anything else running on the machine inflates the figures)"
    )
    lines.append("")
    w = 28
    lines.append(
        f"{'figure':<{w}} {'ringq':>24} {'ringq SQL only':>24} {'skip-locked':>24} "
        f"{'ringq/skq':>10}"
    )
    lines.append("-" * (w + 86))

    def cell(d: dict[str, float]) -> str:
        return f"{_fmt(d['median'])} [{_fmt(d['min'])}-{_fmt(d['max'])}]"

    for label, key, _path in FIGURES:
        f = fig[key]
        rat = ratios[f"{key}_ringq_over_skq"]["median"]
        lines.append(
            f"{label:<{w}} {cell(f['ringq']):>24} {cell(f['ringq_sql']):>24} "
            f"{cell(f['skip_locked']):>24} {rat:>10.2f}"
        )
    if "concurrent" in fig:
        conc = f"{cfg.producers}+{cfg.consumers}"
        for label, key in (
            (f"concurrent {conc} entries/s", "concurrent"),
            ("  producers' commits/s", "concurrent_enqueued"),
        ):
            f = fig[key]
            rat = ratios[f"{key}_ringq_over_skq"]["median"]
            lines.append(
                f"{label:<{w}} {cell(f['ringq']):>24} {'-':>24} "
                f"{cell(f['skip_locked']):>24} {rat:>10.2f}"
            )
    for label, key in (
        ("ceiling tx/s, 1 round trip", "ceiling_one_rt_tx_per_s"),
        ("ceiling tx/s, 2 round trips", "ceiling_eager_2rt_tx_per_s"),
        ("ceiling tx/s, 3 (psycopg)", "ceiling_psycopg_3rt_tx_per_s"),
    ):
        lines.append(f"{label:<{w}} {cell(fig[key]['ceiling']):>24}")
    if "wakeup_p50_us" in fig:
        lines.append(f"{'wake-up p50 (us)':<{w}} {cell(fig['wakeup_p50_us']['ringq']):>24}")
        lines.append(f"{'wake-up p99 (us)':<{w}} {cell(fig['wakeup_p99_us']['ringq']):>24}")
        lines.append(
            f"{'  bare semaphore p50 (us)':<{w}} {cell(fig['sem_wakeup_p50_us']['ringq']):>24}"
        )
        lines.append(
            f"{'  bare semaphore p99 (us)':<{w}} {cell(fig['sem_wakeup_p99_us']['ringq']):>24}"
        )
    lost = {
        side: sum(r["concurrent"][side]["lost"] for r in raw["rounds"])
        for side in ("ringq", "skip_locked")
        if "concurrent" in raw["rounds"][0]
    }
    if any(lost.values()):
        lines.append(f"LOST in the concurrent runs (committed enqueues never seen again): {lost}")
    eng = summary["engine_us"]
    lines.append("")
    lines.append(
        "engine time per call outside the database, us: enqueue call (it sends no SQL) "
        f"p50 {eng['enqueue_call_p50']['median']:.1f}, "
        f"p99 {eng['enqueue_call_p99']['median']:.1f}; "
        "dequeue call - ringq SQL only "
        f"p50 {eng['dequeue_call_p50_minus_sql']['median']:+.1f}, "
        f"p99 {eng['dequeue_call_p99_minus_sql']['median']:+.1f}"
    )
    lines.append(
        "single-entry tx/s over the 1-round-trip ceiling: "
        f"ringq enq {ratios['enq_tps_ringq_over_ceiling']['median']:.2f}, "
        f"deq {ratios['deq_tps_ringq_over_ceiling']['median']:.2f}; "
        f"skip-locked enq {ratios['enq_tps_skq_over_ceiling']['median']:.2f}, "
        f"deq {ratios['deq_tps_skq_over_ceiling']['median']:.2f}; "
        "ringq over the 2-round-trip ceiling: enq "
        f"{ratios['enq_tps_ringq_over_ceiling_2rt']['median']:.2f}, "
        f"deq {ratios['deq_tps_ringq_over_ceiling_2rt']['median']:.2f}"
    )
    vol = raw["volume"]
    if vol:
        lines.append("")
        lines.append(
            f"volume: {cfg.volume:,} entries, {cfg.batch}/tx, ringq queue of "
            f"{cfg.volume_capacity:,} slots "
            "(table size = pg_total_relation_size: heap + toast + indexes)"
        )
        lines.append(f"{'':<{w}} {'ringq':>24} {'skip-locked':>24}")
        lines.append("-" * (w + 50))
        rq, sk = vol["ringq"], vol["skip_locked"]
        for label, f in (
            ("total before", lambda v: _fmt(v["before"]["total"], "B")),
            (
                "total after 1st wrap",
                lambda v: (
                    _fmt(v["after_first_wrap"]["total"], "B") if v["after_first_wrap"] else "-"
                ),
            ),
            ("total after", lambda v: _fmt(v["after"]["total"], "B")),
            ("  heap after", lambda v: _fmt(v["after"]["heap"], "B")),
            ("  toast after", lambda v: _fmt(v["after"]["toast"], "B")),
            ("  indexes before", lambda v: _fmt(v["before"]["indexes"], "B")),
            ("  indexes after", lambda v: _fmt(v["after"]["indexes"], "B")),
            ("growth", lambda v: _pct(v["growth"])),
            ("growth since 1st wrap", lambda v: _pct(v["growth_after_first_wrap"])),
            ("dead tuples after", lambda v: f"{v['after'].get('n_dead_tup') or 0:,}"),
            ("HOT updates / updates", lambda v: _hot(v)),
            (
                "autovacuums during",
                lambda v: str(
                    (v["after"].get("autovacuum_count") or 0)
                    - (v["before"].get("autovacuum_count") or 0)
                ),
            ),
            ("entries/s each way", lambda v: _fmt(v["entries_per_s_each_way"])),
        ):
            lines.append(f"{label:<{w}} {f(rq):>24} {f(sk):>24}")
    lines.append("")
    lines.append("targets (engine speed)")
    for t in summary["targets"]:
        if t["target"] == "info":
            verdict = "(info)"
        else:
            verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT MET")
        val = "n/a" if t["value"] is None else f"{t['value']:,.2f}"
        lines.append(f"  {t['name']:<62} {val:>12} {t['target']:<10} {verdict}")
    return "\n".join(lines)


def _pct(g: float | None) -> str:
    return "n/a (was empty)" if g is None else f"{100 * g:+.1f}%"


def _hot(v: dict[str, Any]) -> str:
    a, b = v["after"], v["before"]
    upd = (a.get("n_tup_upd") or 0) - (b.get("n_tup_upd") or 0)
    hot = (a.get("n_tup_hot_upd") or 0) - (b.get("n_tup_hot_upd") or 0)
    return f"{hot:,}/{upd:,}" if upd else "-"


# -- set-up and tear-down ----------------------------------------------------------------------


def cleanup(dsn: str, names: Names, *, embedded: bool) -> None:
    drop_queues(
        dsn,
        [names.ring, names.ring_sql, names.ring_wake, names.ring_volume, names.ring_concurrent],
        embedded=embedded,
        tables=[names.skq, names.skq_volume, names.skq_concurrent, names.ceiling],
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argument_parser(
        "ringq engine benchmarks: ringq vs a SKIP LOCKED queue vs a one-row-update ceiling."
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (medians are reported)"
    )
    p.add_argument(
        "--single", type=int, default=2000, help="single-entry transactions each way, per round"
    )
    p.add_argument(
        "--batches", type=int, default=100, help="batched transactions each way, per round"
    )
    p.add_argument("--batch", type=int, default=100, help="entries per batched transaction")
    p.add_argument(
        "--wakeups", type=int, default=200, help="commit-to-dequeue wake-ups per round (0: skip)"
    )
    p.add_argument(
        "--volume", type=int, default=1_000_000, help="entries for the table-size test (0: skip)"
    )
    p.add_argument(
        "--volume-capacity",
        type=int,
        default=50_000,
        help="slots of the ringq queue in the table-size test",
    )
    p.add_argument("--payload", type=int, default=100, help="payload bytes")
    p.add_argument(
        "--concurrent-seconds",
        type=float,
        default=5.0,
        help="seconds each side of the concurrent figure runs, per round (0: skip)",
    )
    p.add_argument(
        "--producers", type=int, default=4, help="producer processes of the concurrent figure"
    )
    p.add_argument(
        "--consumers", type=int, default=2, help="consumer processes of the concurrent figure"
    )
    a = p.parse_args(argv)
    for name in ("rounds", "single", "batches", "batch", "volume_capacity", "payload",
                 "producers", "consumers"):  # fmt: skip
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.wakeups < 0 or a.volume < 0 or not a.concurrent_seconds >= 0:
        p.error("--wakeups, --volume and --concurrent-seconds must be >= 0")
    if a.batch > a.volume_capacity:
        p.error("--batch must not exceed --volume-capacity")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(
        rounds=args.rounds,
        single=args.single,
        batches=args.batches,
        batch=args.batch,
        wakeups=args.wakeups,
        volume=args.volume,
        volume_capacity=args.volume_capacity,
        payload=args.payload,
        concurrent_seconds=args.concurrent_seconds,
        producers=args.producers,
        consumers=args.consumers,
        # Entries of one round sit in the queue between its enqueue and dequeue passes.
        capacity=max(args.single, args.batches * args.batch) + 64,
    )
    names = Names(secrets.token_hex(4))
    return run_in_database(
        "engine",
        args,
        cfg,
        run=lambda dsn: run(dsn, cfg, names),
        cleanup=lambda dsn, embedded: cleanup(dsn, names, embedded=embedded),
        summarize=lambda raw: summarize(raw, cfg),
        render=lambda raw, summary, seconds: render(raw, summary, cfg, seconds),
    )


if __name__ == "__main__":
    sys.exit(main())
