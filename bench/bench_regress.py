"""Regression-cycle benchmark (issue 6): how long one full cycle takes, split
into the workload and Spark's proof, and the entries per second it sustained.

It runs the real command, ``python -m ringq.cli regress``, once, with the
scale given here (default: the original system's, 5 queues x 50,000 slots x
500,000 committed entries each, payloads 16 B .. 200 KB), against a private
embedded PostgreSQL (``ringq.cluster.Cluster``, removed at the end) unless
``--dsn`` names another, and reads back the cycle's JSON report. Nothing is
timed here that the report does not time itself: the workload's wall time
(from the first producer's start to the last consumer's drain), Spark's
analysis time, entries/s and MB/s; this script adds the command's whole wall
time and the database's size after the cycle.

Prints a table and writes JSON to ``bench/results/regress-<UTC timestamp>.json``
(and ``--out``). It measures; it never asserts a timing. A cycle whose proof
fails is reported as such, and the exit code is the command's.

Payload bodies default to ``--filler pattern`` (compressible): at the original
scale the 200 KB queue alone moves 100 GB, which random bodies would write to
disk uncompressed in the queue, the received table and the WAL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from _benchlib import argument_parser, cpu_load, database, machine, write_results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argument_parser(
        "ringq regression-cycle benchmark: one cycle of `ringq regress`, timed "
        "(workload and Spark proof), at the original system's scale by default."
    )
    p.add_argument("--home", help="home of the private embedded cluster (default: a temp dir)")
    p.add_argument("--capacity", type=int, default=50_000, help="slots per queue")
    p.add_argument(
        "--entries-per-queue", type=int, default=500_000, help="committed entries per queue"
    )
    p.add_argument("--payload-sizes", default="16,200,2000,20000,200000", help="one queue per size")
    p.add_argument("--producers", type=int, default=5, help="producer processes")
    p.add_argument(
        "--filler", choices=("random", "pattern"), default="pattern", help="payload bodies"
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the workload's random choices")
    p.add_argument("--spark-driver-memory", default="2g", help="Spark driver memory")
    a = p.parse_args(argv)
    if a.capacity < 1 or a.entries_per_queue < 1 or a.producers < 1:
        p.error("--capacity, --entries-per-queue and --producers must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(UTC)
    env: dict[str, Any] = {**machine(), **cpu_load("start")}
    reports = Path(tempfile.mkdtemp(prefix="ringq-bench-regress-reports-"))
    run_id = "bench_" + started.strftime("%Y%m%dT%H%M%S").lower()
    try:
        with database(args.dsn, args.home, "ringq-bench-regress-") as (dsn, _home):
            cmd = [
                sys.executable, "-m", "ringq.cli", "regress",
                "--dsn", dsn,
                "--cycles", "1",
                "--capacity", str(args.capacity),
                "--entries-per-queue", str(args.entries_per_queue),
                "--payload-sizes", args.payload_sizes,
                "--producers", str(args.producers),
                "--filler", args.filler,
                "--seed", str(args.seed),
                "--run-id", run_id,
                "--spark-driver-memory", args.spark_driver_memory,
                "--report-dir", str(reports),
            ]  # fmt: skip
            print("running: " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            rc = subprocess.call(cmd, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
            wall = time.perf_counter() - t0
            with psycopg.connect(dsn, autocommit=True) as admin:
                db_bytes = admin.execute("SELECT pg_database_size(current_database())").fetchone()[
                    0
                ]  # type: ignore[index]
                server = admin.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            with contextlib.suppress(Exception):
                subprocess.call(
                    [sys.executable, "-m", "ringq.cli", "regress", "--dsn", dsn, "drop", run_id],
                    stdout=subprocess.DEVNULL,
                )
        # the cycle's report (not its charts' series, cycle-N.series.json)
        found = sorted(p for p in reports.glob("*/cycle-*.json") if p.suffixes == [".json"])
        report: dict[str, Any] = json.loads(found[-1].read_text()) if found else {}
    finally:
        shutil.rmtree(reports, ignore_errors=True)
    env.update(cpu_load("end"))
    env["server_version"] = server
    t = report.get("throughput", {})
    counts = report.get("counts", {})
    doc: dict[str, Any] = {
        "benchmark": "regress",
        "started_at": started.isoformat(),
        "command": [sys.executable, *sys.argv],
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "dsn", "home")},
        "environment": env,
        "exit_code": rc,
        "ok": report.get("ok"),
        "wall_s": wall,
        "workload_s": t.get("workload_s"),
        "spark_s": report.get("spark", {}).get("analysis_s"),
        "entries_per_s": t.get("entries_per_s"),
        "mb_per_s": t.get("mb_per_s"),
        "committed": counts.get("committed"),
        "delivered": counts.get("delivered"),
        "rolled_back": counts.get("rolled_back"),
        "violations": report.get("violations"),
        "latency_ms": report.get("latency_ms"),
        "database_bytes_after": db_bytes,
        "report": report,
    }
    lines = [
        (
            f"ringq regress, one cycle: {len(args.payload_sizes.split(','))} queues x "
            f"{args.capacity:,} slots x {args.entries_per_queue:,} entries, payloads "
            f"{args.payload_sizes} B ({args.filler}), {args.producers} producers"
        ),
        (
            f"  proof          {'PASS' if report.get('ok') else 'FAIL'} (exit {rc})   "
            f"committed {counts.get('committed', 0):,}   dequeued {counts.get('delivered', 0):,}   "
            f"rolled back {counts.get('rolled_back', 0):,}"
        ),
        (
            f"  workload       {t.get('workload_s', 0):,.1f} s   "
            f"{t.get('entries_per_s', 0):,.0f} entries/s   {t.get('mb_per_s', 0):,.1f} MB/s"
        ),
        f"  spark proof    {doc['spark_s'] or 0:,.1f} s",
        f"  whole command  {wall:,.1f} s (set-up, workload, proof, report)",
        f"  database       {db_bytes / 2**30:,.2f} GiB after the cycle",
        (
            f"  load average   {env['loadavg_at_start'][0]:.2f} at start, "
            f"{env['loadavg_at_end'][0]:.2f} at end"
        ),
    ]
    doc["table"] = "\n".join(lines)
    print(doc["table"])
    write_results("regress", started, doc, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
