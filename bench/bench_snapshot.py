"""What a held snapshot costs a ring, and what the monitor's vacuum after it gives back.

One queue (``--capacity`` slots, shared mode), one session (idle outside any
transaction between them, so the backend flushes its table statistics), steady
traffic: one-entry pairs (enqueue + commit, dequeue + commit) as fast as it
goes, in three phases:

1. **baseline** (``--baseline`` s): no snapshot held;
2. **held** (``--held`` s): another connection holds a REPEATABLE READ snapshot
   (``BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT ...``, then idle), so
   pruning stops and every update leaves a dead row version;
3. **after** (``--after`` s): that transaction has committed.

After one lap of the ring and ``--warmup`` s of unmeasured traffic; twice, on a
fresh queue each time: with the monitor running (in this process,
``xmin_warn_s`` = ``--warn`` s: it warns during the hold and vacuums the ring
after the release), and with the same monitor told never to vacuum
(``vacuum_dead_rows`` out of reach): what autovacuum alone does (the embedded
cluster runs it with ``autovacuum_naptime = 10s``).

Every second a separate autocommit connection reads the ring table's size
(``pg_total_relation_size``) and dead rows (``pg_stat_user_tables.n_dead_tup``).
Per phase the table shows entries/s (pairs per second), the table size at the
phase's end, the most dead rows seen, and the vacuums (manual, auto) done in
it. Runs on a private embedded PostgreSQL unless ``--dsn`` names another.
Prints the table and writes JSON to ``bench/results/snapshot-<UTC>.json``.
The default run takes about 85 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import secrets
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from _benchlib import argument_parser, database
from psycopg import sql
from ringq.engine import Section, connect, queue_table
from ringq.monitor import Monitor, MonitorConfig
from ringq.scripting import QueueSpec, create_queue, drop_queue

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PHASES = ("baseline", "held", "after")
STORAGE = """
SELECT pg_total_relation_size(c.oid), coalesce(s.n_dead_tup, 0),
       coalesce(s.vacuum_count, 0), coalesce(s.autovacuum_count, 0)
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = to_regclass(%s)
"""


def storage(conn: psycopg.Connection[Any], queue: str) -> tuple[int, int, int, int]:
    row = conn.execute(STORAGE, (f"ringq.q_{queue}",)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2]), int(row[3])


def scenario(dsn: str, queue: str, args: argparse.Namespace, *, vacuum: bool) -> dict[str, Any]:
    """One run of the three phases on a fresh queue; returns per-phase figures."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        create_queue(admin, QueueSpec(queue, args.capacity, 256, dequeue_mode="shared"))
    config = MonitorConfig(dsn, http=False, interval=1.0, xmin_warn_s=args.warn,
                           vacuum_dead_rows=1000 if vacuum else 10**15)
    payload = b"p" * args.payload
    phases: dict[str, dict[str, Any]] = {}
    with Monitor(config) as mon, connect(dsn) as s, \
            psycopg.connect(dsn, autocommit=True) as probe:
        s.enqueue_many(queue, [payload] * args.capacity)  # one lap: every row at its working width
        s.commit()
        s.dequeue_many(queue, args.capacity)
        s.commit()
        # not measured: a fresh server and queue warm up first
        warm = time.monotonic() + args.warmup
        while time.monotonic() < warm:
            s.enqueue(queue, payload)
            s.commit()
            s.dequeue(queue)
            s.commit()
        report: psycopg.Connection[Any] | None = None
        floor = 1000
        for phase, seconds in zip(PHASES, (args.baseline, args.held, args.after), strict=True):
            if phase == "held":
                report = psycopg.connect(dsn, application_name="bench report")
                report.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                count = sql.SQL("SELECT count(*) FROM {}").format(queue_table(queue))
                report.execute(count).fetchone()
            elif phase == "after" and report is not None:
                report.commit()
                report.close()
            size0, _dead0, vac0, auto0 = storage(probe, queue)
            pairs, max_dead, samples = 0, 0, []
            t0 = time.monotonic()
            next_probe = t0 + 1.0
            while (now := time.monotonic()) - t0 < seconds:
                s.enqueue(queue, payload)
                s.commit()
                s.dequeue(queue)
                s.commit()
                pairs += 1
                if now >= next_probe:
                    next_probe += 1.0
                    size, dead, _v, _a = storage(probe, queue)
                    max_dead = max(max_dead, dead)
                    samples.append({"t": round(now - t0, 2), "bytes": size, "dead_rows": dead})
            elapsed = time.monotonic() - t0
            size, dead, vac, auto = storage(probe, queue)
            samples.append({"t": round(elapsed, 2), "bytes": size, "dead_rows": dead})
            # How long after the release the dead rows took to fall back to the baseline's level.
            settled = (
                next((x["t"] for x in samples if x["dead_rows"] <= floor), None)
                if phase == "after"
                else None
            )
            phases[phase] = {
                "seconds": round(elapsed, 2),
                "entries_per_s": round(pairs / elapsed, 1),
                "bytes_start": size0,
                "bytes_end": size,
                "dead_rows_max": max(max_dead, dead),
                "dead_rows_end": dead,
                "vacuums": vac - vac0,
                "autovacuums": auto - auto0,
                "dead_rows_settled_after_s": settled,
                "samples": samples,
            }
            if phase == "baseline":
                floor = max(1000, phases[phase]["dead_rows_max"])
            print(f"  {'vacuum' if vacuum else 'no vacuum'} {phase}: "
                  f"{phases[phase]['entries_per_s']} entries/s, "
                  f"{size / 1024:.0f} kB, dead rows max {phases[phase]['dead_rows_max']}",
                  file=sys.stderr, flush=True)
        status = mon.status()
    return {"monitor_vacuum": vacuum, "phases": phases, "monitor_vacuums": status["vacuums"]}


def cleanup(dsn: str, queues: list[str], *, embedded: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute("SELECT value FROM ringq.meta WHERE key = 'instance_id'").fetchone()
        for name in queues:
            with contextlib.suppress(Exception):
                drop_queue(admin, name)
    if row and embedded:
        Section.unlink(row[0])


def table(runs: list[dict[str, Any]]) -> str:
    head = (
        f"{'run':<12} {'phase':<9} {'entries/s':>10} {'vs base':>8} {'size kB':>9} "
        f"{'dead max':>9} {'dead end':>9} {'vac':>4} {'auto':>5} {'settled':>8}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        name = "vacuum" if run["monitor_vacuum"] else "no vacuum"
        base = run["phases"]["baseline"]["entries_per_s"] or 1.0
        for phase in PHASES:
            p = run["phases"][phase]
            settled = p["dead_rows_settled_after_s"]
            lines.append(
                f"{name:<12} {phase:<9} {p['entries_per_s']:>10.0f} "
                f"{p['entries_per_s'] / base:>7.0%} "
                f"{p['bytes_end'] / 1024:>9.0f} {p['dead_rows_max']:>9} {p['dead_rows_end']:>9} "
                f"{p['vacuums']:>4} {p['autovacuums']:>5} "
                + (f"{settled:>7.0f}s" if settled is not None
                   else f"{'-' if phase != 'after' else 'never':>8}")
            )
    lines.append("size kB: the ring table at the phase's end; dead max/end: n_dead_tup, most seen")
    lines.append("and at the end; vac/auto: VACUUMs (the monitor's) and autovacuums in the phase;")
    lines.append("settled: seconds after the release until the dead rows were back to the")
    lines.append("baseline's level (max(1000, baseline max)).")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argument_parser(
        "What a held snapshot costs a ring, with and without the monitor's vacuum after it."
    )
    p.add_argument("--capacity", type=int, default=1000, help="slots of the ring")
    p.add_argument("--payload", type=int, default=100, help="payload bytes")
    p.add_argument("--baseline", type=float, default=5.0,
                   help="seconds of traffic before the snapshot")
    p.add_argument("--held", type=float, default=20.0,
                   help="seconds the snapshot is held under traffic")
    p.add_argument("--after", type=float, default=12.0, help="seconds of traffic after its release")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="seconds of unmeasured traffic before the phases")
    p.add_argument("--warn", type=float, default=5.0, help="the monitor's xmin_warn_s")
    a = p.parse_args(argv)
    if (
        min(a.capacity, a.payload) < 1
        or min(a.baseline, a.held, a.after) <= 0
        or min(a.warn, a.warmup) < 0
    ):
        p.error("--capacity, --payload >= 1; phase seconds > 0; --warn, --warmup >= 0")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    tag = secrets.token_hex(4)
    queues = [f"snap_{tag}_v", f"snap_{tag}_n"]
    env = {"python": platform.python_version(), "psycopg": psycopg.__version__,
           "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}
    with database(args.dsn) as (dsn, home):
        embedded = home is not None
        try:
            runs = [
                scenario(dsn, queues[0], args, vacuum=True),
                scenario(dsn, queues[1], args, vacuum=False),
            ]
            with psycopg.connect(dsn, autocommit=True) as conn:
                env["server"] = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
                env["autovacuum_naptime"] = conn.execute("SHOW autovacuum_naptime").fetchone()[0]  # type: ignore[index]
        finally:
            cleanup(dsn, queues, embedded=embedded)
    env["loadavg_at_end"] = os.getloadavg()
    text = table(runs)
    doc = {"benchmark": "snapshot", "started_at": started.isoformat(),
           "seconds": round(time.perf_counter() - t0, 1),
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "environment": env, "runs": runs, "table": text}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"snapshot-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    for out in (path, args.out):
        if out is not None:
            out.write_text(json.dumps(doc, indent=2))
    print(text)
    print(f"\n{doc['seconds']} s; JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
