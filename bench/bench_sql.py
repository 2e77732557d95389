"""SQL consumers benchmark (issue 23): ``ringq.dequeue`` against a SKIP LOCKED queue.

One database, one monitor (in this process: the agent that sets entries aside
for SQL consumers), a ringq ``shared`` queue and a SKIP LOCKED table driven the
same way from psycopg, in autocommit (one statement, one transaction):

- **single**: ``SELECT * FROM ringq.dequeue(q, 1)`` against ``DELETE FROM t
  WHERE id = (SELECT id FROM t ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1)
  RETURNING payload``, entries/s;
- **batch**: the same with 100 per statement (``DELETE ... WHERE id IN
  (SELECT ... LIMIT 100) RETURNING``), entries/s;
- **capacity**: the single-entry SQL dequeue on a 1,000-slot and on a
  100,000-slot queue (the second / the first: no table scans on the path);
- **mixed**: 4 SQL consumer processes (10 per call, LISTEN when empty) and 2
  linked ones (``dequeue_many(10)``) on one ``shared`` queue fed by 2 linked
  producers (``enqueue_many(100)``): entries/s consumed and the SQL share;
- **latency**: commit of an enqueue → the entry in a waiting consumer's hands,
  p50/p99: linked enqueue → SQL consumer waiting for its wake-up (``ringq.dequeue`` LISTENs for it);
  SQL enqueue (``ringq.enqueue``) → linked consumer waiting in ``dequeue(wait=)``,
  with the monitor in this process and again with ``ringq monitor`` as its own
  process (as deployed: not sharing this process's GIL).

Both queues are filled before each timed stretch (not timed); rounds
interleave ringq and SKIP LOCKED and the ratios are taken within a round.
Run ``python bench/bench_sql.py --help``.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from _benchlib import (
    argument_parser,
    cpu_load,
    drop_queues,
    machine,
    postgres_cpu_s,
    process_cpu_s,
    run_in_database,
)
from psycopg import sql
from ringq.engine import connect
from ringq.monitor import Monitor, MonitorConfig
from ringq.scripting import QueueSpec, create_queue

FILL_BATCH = 500
SKL_CREATE = "CREATE TABLE {t} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload bytea)"
SKL_FILL = "INSERT INTO {t} (payload) SELECT %s::bytea FROM generate_series(1, %s)"
SKL_TAKE = (
    "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED"
    " LIMIT %s) RETURNING payload"
)
RQ_TAKE = "SELECT payload FROM ringq.dequeue(%s, %s)"


@dataclass(frozen=True)
class Config:
    entries: int  # per timed stretch, one per statement
    batch_entries: int  # per timed stretch, 100 per statement (a stretch of ~1 s)
    rounds: int
    payload: int
    latency_samples: int
    mixed_seconds: float


QUEUES = ("main", "small", "large", "lat", "lat2", "mix")


def queue_name(tag: str, what: str) -> str:
    """One of the run's queues (a tag of its own, so --dsn never touches another run's)."""
    return f"bsql_{tag}_{what}"


def fill_ringq(dsn: str, queue: str, n: int, payload: bytes) -> None:
    with connect(dsn, producer="bench-fill") as s:
        for start in range(0, n, FILL_BATCH):
            s.enqueue_many(queue, [payload] * min(FILL_BATCH, n - start))
            s.commit()


def warm(conn: psycopg.Connection[Any], queue: str) -> None:
    """Ask until the agent has set entries aside (the first ask returns nothing)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if conn.execute("SELECT count(*) FROM ringq.offers o JOIN ringq.queues q"
                        " ON q.id = o.queue_id WHERE q.name = %s", (queue,)).fetchone() != (0,):
            return
        conn.execute("SELECT pg_notify('ringq_want', %s)", (queue,))
        time.sleep(0.01)
    raise RuntimeError(f"the agent set nothing aside for {queue} within 10 s")


def drain_rate(conn: psycopg.Connection[Any], stmt: Any, args: tuple[Any, ...], n: int,
               per: int) -> tuple[float, int, float]:
    """entries/s taking ``n`` entries ``per`` statement; the empty answers and
    the share of the time they took (ringq: waiting for the agent to set
    entries aside)."""
    got = empty = 0
    t_empty = 0.0
    t0 = time.perf_counter()
    while got < n:
        t1 = time.perf_counter()
        rows = conn.execute(stmt, args).fetchall()
        if not rows:
            t_empty += time.perf_counter() - t1
            empty += 1
            if empty > 200_000:
                raise RuntimeError("the queue stopped giving entries")
            continue
        got += len(rows)
    seconds = time.perf_counter() - t0
    return got / seconds, empty, t_empty / seconds


def one_round(dsn: str, tag: str, cfg: Config, per: int, payload: bytes) -> dict[str, Any]:
    q = queue_name(tag, "main")
    n = cfg.entries if per == 1 else cfg.batch_entries
    fill_ringq(dsn, q, n, payload)
    skl = sql.Identifier(f"bsql_{tag}_skl")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL(SKL_FILL).format(t=skl), (payload, n))
        c.execute(sql.SQL("VACUUM ANALYZE {t}").format(t=skl))
        warm(c, q)
        cpu0 = _cpu(c)
        rq, rq_empty, rq_empty_share = drain_rate(c, RQ_TAKE, (q, per), n, per)
        cpu1 = _cpu(c)
        sk, _, _ = drain_rate(c, sql.SQL(SKL_TAKE).format(t=skl), (per,), n, per)
        cpu2 = _cpu(c)
    return {"ringq": rq, "skip_locked": sk, "ratio": rq / sk, "ringq_empty_answers": rq_empty,
            "ringq_empty_share": rq_empty_share,
            "cpu_us_per_entry": {"ringq": _per_entry(cpu0, cpu1, n),
                                 "skip_locked": _per_entry(cpu1, cpu2, n)}}


def _cpu(conn: psycopg.Connection[Any]) -> tuple[float | None, float, float]:
    """CPU seconds so far: the consumer's backend (None: the server is not
    on this host), every postgres process of this host, and this process
    (the consumer and, for ringq, the monitor's agent thread)."""
    return (process_cpu_s(conn.info.backend_pid), postgres_cpu_s(),
            time.process_time())


def _per_entry(a: tuple[float | None, float, float], b: tuple[float | None, float, float],
               n: int) -> dict[str, float] | None:
    """µs of CPU per entry between two :func:`_cpu` readings: the consumer's
    backend, the rest of the server (for ringq mostly the agent's backend),
    this process."""
    if a[0] is None or b[0] is None:
        return None
    backend = b[0] - a[0]
    return {"consumer_backend": backend / n * 1e6,
            "other_postgres": (b[1] - a[1] - backend) / n * 1e6,
            "this_process": (b[2] - a[2]) / n * 1e6}


def capacity_round(dsn: str, tag: str, cfg: Config, payload: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n = min(cfg.entries, 900)
    with psycopg.connect(dsn, autocommit=True) as c:
        for what in ("small", "large"):
            q = queue_name(tag, what)
            fill_ringq(dsn, q, n, payload)
            warm(c, q)
            out[what], _, _ = drain_rate(c, RQ_TAKE, (q, 1), n, 1)
    out["large_over_small"] = out["large"] / out["small"]
    return out


def latency(dsn: str, tag: str, cfg: Config, payload: bytes) -> dict[str, Any]:
    """Commit → in a waiting consumer's hands, both ways (ms)."""
    q = queue_name(tag, "lat")  # SQL consumers only: linked consumers never wait on it
    to_sql: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as c, connect(dsn) as s:
        # an empty ringq.dequeue LISTENs on the backend's own channel for it
        for _ in range(cfg.latency_samples):
            s.enqueue(q, payload)
            s.commit()
            t0 = time.perf_counter()
            while not c.execute(RQ_TAKE, (q, 1)).fetchall():
                for _n in c.notifies(timeout=1.0, stop_after=1):
                    pass
            to_sql.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.005)
    to_linked = sql_to_linked(dsn, queue_name(tag, "lat2"), cfg.latency_samples, payload)
    return {
        "linked_enqueue_to_sql_ms": _pcts(to_sql),
        "sql_enqueue_to_linked_ms": _pcts(to_linked),
    }


def _pcts(xs: list[float]) -> dict[str, float]:
    def pct(p: float) -> float:
        s = sorted(xs)
        return s[min(len(s) - 1, int(p * len(s)))] if s else float("nan")

    return {"p50": pct(0.5), "p99": pct(0.99), "n": len(xs)}


def sql_to_linked(dsn: str, q2: str, samples: int, payload: bytes) -> list[float]:
    """Commit of a SQL ``ringq.enqueue`` on ``q2`` (linked consumers only: the
    agent never sets its entries aside) → the entry in a waiting linked
    consumer's hands (ms), ``samples`` times."""
    to_linked: list[float] = []
    sent = threading.Event()
    t_sent = [0.0]

    def consume() -> None:
        with connect(dsn) as s2:
            for _ in range(samples):
                m = s2.dequeue(q2, wait=10)
                t = time.perf_counter()
                s2.commit()
                if m is not None:
                    to_linked.append((t - t_sent[0]) * 1000)
                sent.clear()

    th = threading.Thread(target=consume)
    th.start()
    with psycopg.connect(dsn, autocommit=True) as c:
        for _ in range(samples):
            time.sleep(0.02)  # the consumer is waiting again
            c.execute("SELECT ringq.enqueue(%s, %s)", (q2, payload))
            t_sent[0] = time.perf_counter()  # committed (autocommit): from here
    th.join(60)
    return to_linked


def latency_monitor_process(dsn: str, tag: str, cfg: Config, payload: bytes) -> dict[str, Any]:
    """SQL enqueue → linked consumer with the monitor as its own process, as
    deployed (``ringq monitor``), not sharing this process and its GIL."""
    with tempfile.TemporaryDirectory(prefix="bench-sql-mon-") as tmp:
        mon = subprocess.Popen(
            [sys.executable, "-m", "ringq.cli", "monitor", "--dsn", dsn, "--port", "0",
             "--data-dir", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(3.0)  # attached, listening
            if mon.poll() is not None:
                raise RuntimeError(f"ringq monitor exited with {mon.returncode}")
            ms = sql_to_linked(dsn, queue_name(tag, "lat2"), cfg.latency_samples, payload)
        finally:
            mon.terminate()
            mon.wait(30)
    return {"sql_enqueue_to_linked_ms": _pcts(ms)}


def _mixed_worker(dsn: str, queue: str, kind: str, until: float, out: Any) -> None:
    """One process of the mixed run: a linked producer, a linked consumer or a
    SQL consumer, working until ``until`` (monotonic); puts (kind, entries)."""
    n = 0
    payload = b"m" * 100
    if kind == "producer":
        with connect(dsn, producer=f"mix-{os.getpid()}") as s:
            while time.monotonic() < until:
                s.enqueue_many(queue, [payload] * 100, timeout=1.0)
                s.commit()
                n += 100
    elif kind == "linked":
        with connect(dsn) as s:
            while time.monotonic() < until:
                n += len(s.dequeue_many(queue, 10, wait=0.05))
                s.commit()
    else:
        with psycopg.connect(dsn, autocommit=True) as c:
            while time.monotonic() < until:
                got = len(c.execute(RQ_TAKE, (queue, 10)).fetchall())
                n += got
                if not got:
                    for _n in c.notifies(timeout=0.05, stop_after=1):
                        pass
    out.put((kind, n))


def mixed(dsn: str, tag: str, seconds: float) -> dict[str, Any]:
    """4 SQL and 2 linked consumer processes on one shared queue, 2 linked
    producers: entries/s in all and each kind's share."""
    q = queue_name(tag, "mix")
    ctx = mp.get_context("fork")
    out: Any = ctx.Queue()
    until = time.monotonic() + 1.0 + seconds
    kinds = ["producer"] * 2 + ["linked"] * 2 + ["sql"] * 4
    procs = [ctx.Process(target=_mixed_worker, args=(dsn, q, k, until, out)) for k in kinds]
    for p in procs:
        p.start()
    got = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(30)
    taken = {k: sum(n for kk, n in got if kk == k) for k in ("producer", "linked", "sql")}
    consumed = taken["linked"] + taken["sql"]
    return {"seconds": seconds, "enqueued": taken["producer"], "linked": taken["linked"],
            "sql": taken["sql"], "consumed_per_s": consumed / seconds,
            "sql_share": taken["sql"] / consumed if consumed else 0.0}


def run(dsn: str, cfg: Config, tag: str) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        sizes = {"main": max(2 * cfg.entries, cfg.batch_entries + 1000), "large": 100_000,
                 "mix": 10_000}
        for what in QUEUES:
            create_queue(conn, QueueSpec(queue_name(tag, what), sizes.get(what, 1000), 1024,
                                         dequeue_mode="shared"))
        conn.execute(sql.SQL(SKL_CREATE).format(t=sql.Identifier(f"bsql_{tag}_skl")))
        conn.commit()
    payload = b"x" * cfg.payload
    raw: dict[str, Any] = {"machine": machine(), "load_start": cpu_load("start"), "rounds": []}
    with tempfile.TemporaryDirectory(prefix="bench-sql-") as tmp:
        mon = Monitor(MonitorConfig(dsn, port=0, http=False, data_dir=Path(tmp)))
        mon.start()
        try:
            for rnd in range(cfg.rounds):
                r = {"single": one_round(dsn, tag, cfg, 1, payload),
                     "batch": one_round(dsn, tag, cfg, 100, payload),
                     "capacity": capacity_round(dsn, tag, cfg, payload)}
                print(f"round {rnd + 1}: single {r['single']['ratio']:.2f}x, batch "
                      f"{r['batch']['ratio']:.2f}x, capacity "
                      f"{r['capacity']['large_over_small']:.2f}", file=sys.stderr, flush=True)
                raw["rounds"].append(r)
            raw["latency"] = latency(dsn, tag, cfg, payload)
            raw["mixed"] = mixed(dsn, tag, cfg.mixed_seconds)
            raw["agent"] = mon._sql.figures.as_dict()
        finally:
            mon.stop()
    raw["latency_monitor_process"] = latency_monitor_process(dsn, tag, cfg, payload)
    raw["load_end"] = cpu_load("end")
    return raw


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    def med(path: tuple[str, str]) -> float:
        return float(statistics.median(r[path[0]][path[1]] for r in raw["rounds"]))

    return {"summary": {
        "single": {k: med(("single", k)) for k in ("ringq", "skip_locked", "ratio")},
        "batch": {k: med(("batch", k))
                  for k in ("ringq", "skip_locked", "ratio", "ringq_empty_share")},
        "batch_cpu_us_per_entry": _cpu_medians(raw),
        "capacity_large_over_small": med(("capacity", "large_over_small")),
        "latency": raw["latency"],
        "latency_monitor_process": raw["latency_monitor_process"],
        "mixed": raw["mixed"],
    }}


def _cpu_medians(raw: dict[str, Any]) -> dict[str, dict[str, float]] | None:
    """The 100-per-statement rounds' CPU per entry, medians by contender and part."""
    cpus = [r["batch"]["cpu_us_per_entry"] for r in raw["rounds"]]
    if any(c["ringq"] is None for c in cpus):
        return None
    return {who: {part: float(statistics.median(c[who][part] for c in cpus))
                  for part in cpus[0][who]}
            for who in ("ringq", "skip_locked")}


def render(raw: dict[str, Any], summary: dict[str, Any], cfg: Config, seconds: float) -> str:
    s = summary["summary"]
    lat = s["latency"]
    mp = s["latency_monitor_process"]["sql_enqueue_to_linked_ms"]
    lines = [
        f"SQL consumers (ringq.dequeue) against SKIP LOCKED, {cfg.rounds} rounds of "
        f"{cfg.entries} entries (one per statement) and {cfg.batch_entries} (100 per "
        f"statement), {cfg.payload} B payloads, medians ({seconds:.0f} s)",
        f"{'':28} {'ringq/s':>10} {'SKIP LOCKED/s':>14} {'ratio':>7}",
        f"{'1 per transaction':28} {s['single']['ringq']:>10.0f} "
        f"{s['single']['skip_locked']:>14.0f} {s['single']['ratio']:>6.2f}x",
        f"{'100 per transaction':28} {s['batch']['ringq']:>10.0f} "
        f"{s['batch']['skip_locked']:>14.0f} {s['batch']['ratio']:>6.2f}x",
        f"  ringq's time in empty answers (waiting for the agent), 100 per transaction: "
        f"{s['batch']['ringq_empty_share']:.0%}",
        *_cpu_lines(s["batch_cpu_us_per_entry"]),
        f"capacity 100,000 / 1,000 slots (1 per transaction): "
        f"{s['capacity_large_over_small']:.2f}x",
        f"linked enqueue -> SQL consumer: p50 {lat['linked_enqueue_to_sql_ms']['p50']:.2f} ms, "
        f"p99 {lat['linked_enqueue_to_sql_ms']['p99']:.2f} ms",
        f"SQL enqueue -> linked consumer: p50 {lat['sql_enqueue_to_linked_ms']['p50']:.2f} ms, "
        f"p99 {lat['sql_enqueue_to_linked_ms']['p99']:.2f} ms",
        f"SQL enqueue -> linked consumer, the monitor as its own process: p50 "
        f"{mp['p50']:.2f} ms, p99 {mp['p99']:.2f} ms",
        f"4 SQL + 2 linked consumers, 2 linked producers ({s['mixed']['seconds']:g} s): "
        f"{s['mixed']['consumed_per_s']:.0f} entries/s, SQL share "
        f"{s['mixed']['sql_share']:.0%} ({s['mixed']['sql']} SQL, {s['mixed']['linked']} linked)",
        f"agent: {raw['agent']}",
        f"load: start {raw['load_start']}, end {raw['load_end']}",
    ]
    return "\n".join(lines)


def _cpu_lines(cpu: dict[str, dict[str, float]] | None) -> list[str]:
    if cpu is None:
        return ["  CPU per entry: not measured (the server is not on this host)"]
    return [f"  CPU per entry, 100 per transaction, {who}: consumer's backend "
            f"{c['consumer_backend']:.1f} us, rest of the server {c['other_postgres']:.1f} us, "
            f"this process {c['this_process']:.1f} us"
            for who, c in (("ringq", cpu["ringq"]), ("SKIP LOCKED", cpu["skip_locked"]))]


def cleanup(dsn: str, tag: str, *, embedded: bool) -> None:
    queues = [queue_name(tag, w) for w in QUEUES]
    drop_queues(dsn, queues, embedded=embedded, tables=[f"bsql_{tag}_skl"])


def parse_args(argv: list[str] | None) -> Any:
    p = argument_parser(__doc__.split("\n")[0])
    p.add_argument("--entries", type=int, default=5000,
                   help="entries per timed stretch, one per statement")
    p.add_argument("--batch-entries", type=int, default=50_000,
                   help="entries per timed stretch, 100 per statement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--payload", type=int, default=100, help="payload bytes")
    p.add_argument("--latency-samples", type=int, default=200)
    p.add_argument("--mixed-seconds", type=float, default=5.0,
                   help="how long 4 SQL + 2 linked consumers and 2 producers run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(args.entries, args.batch_entries, args.rounds, args.payload,
                 args.latency_samples, args.mixed_seconds)
    tag = secrets.token_hex(4)

    def tidy(dsn: str, embedded: bool) -> None:
        cleanup(dsn, tag, embedded=embedded)

    def table(raw: dict[str, Any], summary: dict[str, Any], seconds: float) -> str:
        return render(raw, summary, cfg, seconds)

    return run_in_database("sql", args, cfg, functools.partial(run, cfg=cfg, tag=tag), tidy,
                           summarize, table)


if __name__ == "__main__":
    sys.exit(main())
