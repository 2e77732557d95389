"""Many consumers in one process: threads vs coroutines vs a batch consumer (issue 35).

One process consumes ``--entries`` (20,000) entries of 256 B that were
committed before the clock starts (so the producer is never the limit, and
its CPU is not counted), each consumer taking up to ``--take`` (8) entries
per transaction, recording them by one INSERT into a log table in the same
transaction, and committing; ``--work-ms`` of sleep per entry stands for
the work (0 by default).

- **threads**: ``--consumers`` (32) threads, each with its own ringq Session
  (``dequeue_many(take, wait=0.2)``, ``Session.execute(..., prepare=True,
  defer=True)`` of the INSERT, sent with the ``commit``: one round trip per
  transaction; ``--no-defer``: the INSERT in its own);
- **coroutines**: as many coroutines in one event loop, each with its own
  AsyncSession (``await`` the same calls): ``ringq worker --concurrency``'s shape;
- **batch**: a batch consumer over a SKIP LOCKED table (PgQ's shape driven
  from Python: ``--batch-consumers`` (1) thread(s) taking ``--batch`` (512)
  rows per transaction by ``DELETE ... FOR UPDATE SKIP LOCKED ... RETURNING``,
  the INSERT of their ids, COMMIT);
- **pgq**: PgQ itself (the C extension, Debian's ``postgresql-15-pgq3``;
  left out, with a note, where the server does not have it): the fill inserts
  ``--batch`` events per transaction and ticks after each (``pgq.ticker``,
  ``ticker_max_lag`` 0: what ``pgqd`` does with ``ticker_max_count`` =
  ``--batch``), so batches hold 512 events; one consumer (a PgQ consumer
  reads every event; batches are taken one after another) loops
  ``pgq.next_batch``, ``pgq.get_batch_events``, the entries one by one, the
  INSERT of their ids, ``pgq.finish_batch``, COMMIT;
- **floor**: no queue, the transactions alone: as many coroutines, each
  committing the INSERT of ``--take`` ids (from a counter) in autocommit, one
  round trip each, until ``--entries`` ids are recorded: what any consumer
  that commits every ``--take`` entries cannot beat on this machine.

Per run: entries/s (completed over the wall time until the last commit),
the client's CPU per entry (this process: ``time.process_time``, user +
system), the server's CPU per entry (every ``postgres`` process of this host,
from /proc: the embedded cluster's backends, WAL writer, checkpointer...),
and the latency of a take (the ``dequeue_many`` or ``DELETE`` call) p50/p99.
Kinds run in interleaved rounds (``--rounds`` 3); medians are printed.
``--profile KIND`` runs cProfile (CPU time) over one more run of KIND and
prints where the client's time goes. Prints a table and writes JSON
(``bench/results/async-<UTC>.json`` and ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import psycopg
from _benchlib import RunNames, argument_parser, machine, postgres_cpu_s, run_in_database
from psycopg import sql
from ringq.engine import connect, connect_async
from ringq.scripting import QueueSpec, create_queue

KINDS = ("threads", "coroutines", "batch", "pgq", "floor")
PAYLOAD = 256
FILL_BATCH = 1000


@dataclass(frozen=True)
class Config:
    entries: int = 20_000
    consumers: int = 32
    take: int = 8
    batch: int = 512
    batch_consumers: int = 1
    work_ms: float = 0.0
    rounds: int = 3
    profile: str | None = None
    defer: bool = True


def _q(template: str, *tables: str) -> sql.Composed:
    return sql.SQL(template).format(*[sql.Identifier(t) for t in tables])


def setup(dsn: str, n: RunNames, cfg: Config) -> tuple[str, ...]:
    """Create the queues and tables; the kinds this server can run (PgQ only
    where its extension is installed)."""
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec(n.queue, max(4 * cfg.entries, 50_000), 512,
                                     dequeue_mode="shared"))
        conn.execute(_q("CREATE TABLE {} (id bigserial PRIMARY KEY, payload bytea)", n.table))
        conn.execute(_q("CREATE TABLE {} (id bigint)", n.done))
        if conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'pgq'").fetchone():
            conn.execute("CREATE EXTENSION IF NOT EXISTS pgq")
            conn.execute("SELECT pgq.create_queue(%s)", (n.queue,))
            # pgq.ticker(queue) then ticks whenever events arrived since the last tick
            conn.execute("SELECT pgq.set_queue_config(%s, 'ticker_max_lag', '0')", (n.queue,))
            conn.execute("SELECT pgq.register_consumer(%s, 'bench')", (n.queue,))
            return KINDS
    print("bench_async: PgQ is not installed on this server (Debian: apt-get install "
          "postgresql-15-pgq3); the 'pgq' kind is left out", file=sys.stderr)
    return tuple(k for k in KINDS if k != "pgq")


def fill(dsn: str, n: RunNames, kind: str, entries: int, batch: int) -> None:
    payload = b"x" * PAYLOAD
    if kind == "floor":  # nothing to take: the ids come from a counter
        return
    if kind == "pgq":  # ev_data is text; a tick after each transaction of `batch` events
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(0, entries, batch):
                k = min(batch, entries - i)
                with conn.transaction():
                    conn.execute("SELECT pgq.insert_event(%s, 'job', d) FROM unnest(%s::text[]) d",
                                 (n.queue, [payload.decode()] * k))
                conn.execute("SELECT pgq.ticker(%s)", (n.queue,))
        return
    if kind == "batch":
        with psycopg.connect(dsn) as conn:
            for i in range(0, entries, FILL_BATCH):
                k = min(FILL_BATCH, entries - i)
                conn.execute(_q("INSERT INTO {} (payload) SELECT unnest(%s::bytea[])", n.table),
                             ([payload] * k,))
                conn.commit()
        return
    with connect(dsn) as s:
        for i in range(0, entries, FILL_BATCH):
            s.enqueue_many(n.queue, [payload] * min(FILL_BATCH, entries - i))
            s.commit()


def _threads(dsn: str, n: RunNames, cfg: Config, lat: list[int]) -> int:
    insert = _q("INSERT INTO {} SELECT unnest(%s::bigint[])", n.done).as_string(None)
    sessions = [connect(dsn) for _ in range(cfg.consumers)]
    done = [0] * cfg.consumers
    start = threading.Barrier(cfg.consumers + 1)

    def consume(i: int) -> None:
        s = sessions[i]
        start.wait()
        while True:
            t0 = time.perf_counter_ns()
            ms = s.dequeue_many(n.queue, cfg.take, wait=0.2)
            if not ms:  # the queue is drained (the last, empty take is not a claim)
                return
            lat.append(time.perf_counter_ns() - t0)
            if cfg.work_ms:
                time.sleep(cfg.work_ms * len(ms) / 1000)
            s.execute(insert, ([m.seq for m in ms],), prepare=True, defer=cfg.defer)
            s.commit()
            done[i] += len(ms)

    _consume_in_threads(consume, start, sessions)
    return sum(done)


def _coroutines(dsn: str, n: RunNames, cfg: Config, lat: list[int]) -> int:
    insert = _q("INSERT INTO {} SELECT unnest(%s::bigint[])", n.done).as_string(None)

    async def main() -> int:
        sessions = [await connect_async(dsn) for _ in range(cfg.consumers)]
        for s in sessions:
            await s.queue_info(n.queue)

        async def consume(s: Any) -> int:
            done = 0
            while True:
                t0 = time.perf_counter_ns()
                ms = await s.dequeue_many(n.queue, cfg.take, wait=0.2)
                if not ms:  # the queue is drained
                    return done
                lat.append(time.perf_counter_ns() - t0)
                if cfg.work_ms:
                    await asyncio.sleep(cfg.work_ms * len(ms) / 1000)
                await s.execute(insert, ([m.seq for m in ms],), prepare=True, defer=cfg.defer)
                await s.commit()
                done += len(ms)

        _mark_start()
        counts = await asyncio.gather(*[consume(s) for s in sessions])
        for s in sessions:
            await s.close()
        return sum(counts)

    return asyncio.run(main())


def _batch(dsn: str, n: RunNames, cfg: Config, lat: list[int]) -> int:
    take = _q("DELETE FROM {0} WHERE id IN (SELECT id FROM {0} ORDER BY id "
              "FOR UPDATE SKIP LOCKED LIMIT %s) RETURNING id, payload", n.table)
    insert = _q("INSERT INTO {} SELECT unnest(%s::bigint[])", n.done)
    conns = [psycopg.connect(dsn) for _ in range(cfg.batch_consumers)]
    done = [0] * len(conns)
    start = threading.Barrier(len(conns) + 1)

    def consume(i: int) -> None:
        conn = conns[i]
        start.wait()
        while True:
            t0 = time.perf_counter_ns()
            rows = conn.execute(take, (cfg.batch,)).fetchall()
            if not rows:
                conn.commit()
                return
            lat.append(time.perf_counter_ns() - t0)
            for _row in rows:  # the batch's entries, one by one (as a PgQ consumer does)
                if cfg.work_ms:
                    time.sleep(cfg.work_ms / 1000)
            conn.execute(insert, ([r[0] for r in rows],))
            conn.commit()
            done[i] += len(rows)

    _consume_in_threads(consume, start, conns)
    return sum(done)


def _pgq(dsn: str, n: RunNames, cfg: Config, lat: list[int]) -> int:
    insert = _q("INSERT INTO {} SELECT unnest(%s::bigint[])", n.done)
    conn = psycopg.connect(dsn)
    done = [0]
    start = threading.Barrier(2)

    def consume(_i: int) -> None:
        start.wait()
        while True:
            t0 = time.perf_counter_ns()
            row = conn.execute("SELECT pgq.next_batch(%s, 'bench')", (n.queue,)).fetchone()
            batch_id = row[0] if row else None
            if batch_id is None:  # no tick left: drained
                conn.commit()
                return
            rows = conn.execute("SELECT ev_id, ev_data FROM pgq.get_batch_events(%s)",
                                (batch_id,)).fetchall()
            lat.append(time.perf_counter_ns() - t0)
            for _row in rows:
                if cfg.work_ms:
                    time.sleep(cfg.work_ms / 1000)
            conn.execute(insert, ([r[0] for r in rows],))
            conn.execute("SELECT pgq.finish_batch(%s)", (batch_id,))
            conn.commit()
            done[0] += len(rows)

    _consume_in_threads(consume, start, [conn])
    return done[0]


def _floor(dsn: str, n: RunNames, cfg: Config, lat: list[int]) -> int:
    insert = _q("INSERT INTO {} SELECT unnest(%s::bigint[])", n.done).as_string(None)

    async def main() -> int:
        conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True)
                 for _ in range(cfg.consumers)]
        next_id = 0

        async def consume(conn: psycopg.AsyncConnection[Any]) -> int:
            nonlocal next_id
            done = 0
            while next_id < cfg.entries:
                ids = list(range(next_id, min(next_id + cfg.take, cfg.entries)))
                next_id += len(ids)
                lat.append(0)  # nothing is taken: no take to time
                await conn.execute(insert, (ids,), prepare=True)
                done += len(ids)
            return done

        _mark_start()
        counts = await asyncio.gather(*[consume(c) for c in conns])
        for c in conns:
            await c.close()
        return sum(counts)

    return asyncio.run(main())


class _Closable(Protocol):
    def close(self) -> None: ...


def _consume_in_threads(
    consume: Callable[[int], None], start: threading.Barrier, clients: Sequence[_Closable]
) -> None:
    """``consume(i)`` in a thread for each of ``clients`` (its session or
    connection); the clock starts once every thread waits at ``start``. The
    clients are closed once every thread ended."""
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    _mark_start()
    start.wait()
    for t in threads:
        t.join()
    for c in clients:
        c.close()


_started: list[tuple[float, float, float]] = []


def _mark_start() -> None:
    """The clock starts once every consumer is connected (connecting is not measured)."""
    _started.append((time.perf_counter(), time.process_time(), postgres_cpu_s()))


RUNNERS = {"threads": _threads, "coroutines": _coroutines, "batch": _batch, "pgq": _pgq,
           "floor": _floor}


def one_run(dsn: str, n: RunNames, cfg: Config, kind: str,
            profile: cProfile.Profile | None = None) -> dict[str, Any]:
    fill(dsn, n, kind, cfg.entries, cfg.batch)
    lat: list[int] = []
    _started.clear()
    if profile is not None:
        profile.enable()
    completed = RUNNERS[kind](dsn, n, cfg, lat)
    if profile is not None:
        profile.disable()
    wall1, cpu1, srv1 = time.perf_counter(), time.process_time(), postgres_cpu_s()
    wall0, cpu0, srv0 = _started[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(_q("SELECT count(*), count(DISTINCT id) FROM {}", n.done)).fetchone()
        conn.execute(_q("TRUNCATE {}", n.done))
    assert row is not None
    wall = wall1 - wall0
    a = np.array(lat, dtype=np.int64) / 1e6
    return {
        "kind": kind,
        "completed": completed,
        "recorded": row[0],
        "duplicates": row[0] - row[1],
        "entries_per_s": completed / wall,
        "client_us_per_entry": (cpu1 - cpu0) / completed * 1e6,
        "server_us_per_entry": (srv1 - srv0) / completed * 1e6,
        # a take that returned entries (the drained queue's last, empty ones left out)
        "take_ms_p50": float(np.percentile(a, 50)),
        "take_ms_p99": float(np.percentile(a, 99)),
        "wall_s": wall,
    }


def run(dsn: str, cfg: Config, names: RunNames) -> dict[str, Any]:
    kinds = setup(dsn, names, cfg)
    one_run(dsn, names, Config(entries=2000, consumers=4), "threads")  # warm-up (untimed)
    rounds: list[list[dict[str, Any]]] = []
    for r in range(cfg.rounds):
        order = kinds if r % 2 == 0 else tuple(reversed(kinds))
        rounds.append([one_run(dsn, names, cfg, k) for k in order])
    out: dict[str, Any] = {"rounds": rounds, "machine": machine()}
    if cfg.profile:
        prof = cProfile.Profile(time.process_time)  # CPU time: 2 cores, the wall hides it
        one_run(dsn, names, cfg, cfg.profile, prof)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        out["profile"] = buf.getvalue()
    return out


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for rnd in raw["rounds"]:
        for res in rnd:
            by[res["kind"]].append(res)
    keys = ("entries_per_s", "client_us_per_entry", "server_us_per_entry", "take_ms_p50",
            "take_ms_p99")
    med = {k: {key: statistics.median(r[key] for r in rs) for key in keys}
           for k, rs in by.items() if rs}
    def over(kind: str) -> list[float]:
        """coroutines' entries/s over ``kind``'s, in each round that ran both."""
        out = []
        for rnd in raw["rounds"]:
            rate = {r["kind"]: r["entries_per_s"] for r in rnd}
            if kind in rate:
                out.append(rate["coroutines"] / rate[kind])
        return out

    ratios = {k: over(k) for k in ("batch", "pgq", "floor")}
    return {"median": med,
            "coroutines_over": {k: statistics.median(v) for k, v in ratios.items() if v},
            "ratios": ratios,
            "duplicates": sum(r["duplicates"] for rnd in raw["rounds"] for r in rnd)}


def render(raw: dict[str, Any], summary: dict[str, Any], cfg: Config, seconds: float) -> str:
    lines = [
        f"bench_async: {cfg.entries:,} entries of {PAYLOAD} B, {cfg.consumers} consumers "
        f"taking {cfg.take} (batch: {cfg.batch_consumers} x {cfg.batch}), work "
        f"{cfg.work_ms} ms/entry, {cfg.rounds} rounds, medians ({seconds:.0f} s)",
        f"{'kind':<12}{'entries/s':>11}{'client us/e':>13}{'server us/e':>13}"
        f"{'take p50 ms':>13}{'take p99 ms':>13}",
    ]
    for k, m in summary["median"].items():
        lines.append(f"{k:<12}{m['entries_per_s']:>11,.0f}{m['client_us_per_entry']:>13.1f}"
                     f"{m['server_us_per_entry']:>13.1f}{m['take_ms_p50']:>13.2f}"
                     f"{m['take_ms_p99']:>13.2f}")
    for k, med in summary["coroutines_over"].items():
        lines.append(f"coroutines / {k} entries/s: {med:.2f} (per round: "
                     f"{', '.join(f'{r:.2f}' for r in summary['ratios'][k])})")
    lines.append(f"duplicates: {summary['duplicates']}")
    if "profile" in raw:
        lines += ["", f"cProfile of one '{cfg.profile}' run (by own time):", raw["profile"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argument_parser(__doc__.split("\n", 1)[0])
    d = Config()
    p.add_argument("--entries", type=int, default=d.entries)
    p.add_argument("--consumers", type=int, default=d.consumers)
    p.add_argument("--take", type=int, default=d.take)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--batch-consumers", type=int, default=d.batch_consumers)
    p.add_argument("--work-ms", type=float, default=d.work_ms)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--profile", choices=KINDS, default=None)
    p.add_argument("--defer", action=argparse.BooleanOptionalAction, default=d.defer,
                   help="ringq consumers send their INSERT with the commit "
                        "(Session.execute(defer=True): one round trip per transaction); "
                        "--no-defer: the INSERT in a round trip of its own")
    args = p.parse_args(argv)
    cfg = Config(args.entries, args.consumers, args.take, args.batch, args.batch_consumers,
                 args.work_ms, args.rounds, args.profile, args.defer)
    names = RunNames.fresh("ba_q_{}", "ba_skq_{}", "ba_done_{}")

    def cleanup(dsn: str, embedded: bool) -> None:
        if embedded:
            return
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(_q("DROP TABLE IF EXISTS {}, {}", names.table, names.done))

    return run_in_database(
        "async", args, cfg,
        lambda dsn: run(dsn, cfg, names), cleanup, summarize,
        lambda raw, s, secs: render(raw, s, cfg, secs),
    )


if __name__ == "__main__":
    raise SystemExit(main())
