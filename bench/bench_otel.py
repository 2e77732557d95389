"""What the ``otel`` extra costs: engine time per call, tracing off and on.

Four modes, interleaved round by round (the machine is noisy): ``absent``
(a child process of this script in which ``import opentelemetry`` fails, as
without the extra), and in this process ``no-provider`` (the API installed,
no tracer provider set: the usual "installed but unused"), ``on`` (an SDK
provider with no exporter: the spans' own cost) and ``on-exporter`` (a
SimpleSpanProcessor into the SDK's in-memory exporter). Per mode: the engine
time of one ``enqueue`` call (no I/O: a transaction of ``--calls``
enqueues, rolled back), of enqueue + commit, and of dequeue + commit (one
round trip each when the entry is cached; a traced entry is not, so its
dequeue reads the row). Medians of the rounds; it measures, it never asserts.

Run ``python bench/bench_otel.py --help``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any

if __name__ == "__main__" and "--absent-round" in sys.argv:
    sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # as if not installed

import psycopg
from _benchlib import argument_parser, database, drop_queues, machine, write_results
from ringq.engine import Session, connect
from ringq.scripting import QueueSpec, create_queue

MODES = ("absent", "no-provider", "on", "on-exporter")


def _round(s: Session, q: str, calls: int, txns: int) -> tuple[float, float, float]:
    """(us per enqueue call, per enqueue + commit, per dequeue + commit)."""
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        s.enqueue(q, b"x" * 100)
    enq = (time.perf_counter_ns() - t0) / calls / 1000
    s.rollback()
    t0 = time.perf_counter_ns()
    for _ in range(txns):
        s.enqueue(q, b"x" * 100)
        s.commit()
    enq_commit = (time.perf_counter_ns() - t0) / txns / 1000
    t0 = time.perf_counter_ns()
    for _ in range(txns):
        s.dequeue(q)
        s.commit()
    deq_commit = (time.perf_counter_ns() - t0) / txns / 1000
    return enq, enq_commit, deq_commit


def _absent_round(dsn: str, q: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """One round in a child process without the API (``--absent-round``)."""
    out = subprocess.run(
        [sys.executable, __file__, "--absent-round", "--dsn", dsn, "--queue", q,
         "--calls", str(args.calls), "--txns", str(args.txns)],
        check=True, capture_output=True, text=True,
    ).stdout
    a, b, c = json.loads(out)
    return float(a), float(b), float(c)


def run(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    # the API's global provider, patched per mode (set_tracer_provider takes one)
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    with_exporter = TracerProvider()
    with_exporter.add_span_processor(SimpleSpanProcessor(exporter))
    providers: dict[str, Any] = {"on": TracerProvider(), "on-exporter": with_exporter}
    saved = otel_trace._TRACER_PROVIDER
    q = "bench_otel_" + uuid.uuid4().hex[:8]
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec(q, max(args.calls * 2, 4096), 1024))
    rounds: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    try:
        with connect(dsn) as s:
            for r in range(args.rounds):
                for m in MODES[r % len(MODES):] + MODES[: r % len(MODES)]:
                    if m == "absent":
                        rounds[m].append(_absent_round(dsn, q, args))
                        continue
                    otel_trace._TRACER_PROVIDER = providers.get(m)
                    exporter.clear()
                    rounds[m].append(_round(s, q, args.calls, args.txns))
    finally:
        otel_trace._TRACER_PROVIDER = saved
        drop_queues(dsn, [q], embedded=args.dsn is None)
    medians = {
        m: [statistics.median(r[i] for r in rounds[m]) for i in range(3)] for m in MODES
    }
    return {"rounds": rounds, "medians_us": medians}


def render(raw: dict[str, Any]) -> str:
    lines = [f"{'mode':<12} {'enqueue call':>13} {'enqueue+commit':>15} {'dequeue+commit':>15}"]
    for m, (a, b, c) in raw["medians_us"].items():
        lines.append(f"{m:<12} {a:>10.2f} us {b:>12.1f} us {c:>12.1f} us")
    return "\n".join(lines)


def main() -> int:
    p = argument_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12, help="rounds of each mode, interleaved")
    p.add_argument("--calls", type=int, default=2000, help="enqueue calls per round (no I/O)")
    p.add_argument("--txns", type=int, default=200, help="transactions per round and kind")
    p.add_argument("--absent-round", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--queue", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.absent_round:  # the child of one "absent" round: its figures as JSON
        with connect(args.dsn) as s:
            print(json.dumps(_round(s, args.queue, args.calls, args.txns)))
        return 0
    started = datetime.now(UTC)
    with database(args.dsn) as (dsn, _home):
        raw = run(dsn, args)
    table = render(raw)
    print(table)
    write_results("otel", started, {
        "benchmark": "otel", "started_at": started.isoformat(), "command": sys.argv,
        "machine": machine(), "config": {k: v for k, v in vars(args).items() if k != "out"},
        **raw, "table": table,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
