"""Worker benchmark (issue 8): messages/s through a no-op action.

Contenders, all on ONE database (a private embedded PostgreSQL under a
temporary home, the same server settings as ``ringq db start``, unless
``--dsn`` names another):

- **ringq p=1 / p=2**: a :class:`ringq.worker.WorkerPool` with 1 or 2 worker
  processes ("fork") on a shared-mode queue; each message is one transaction
  (BEGIN with the dequeue UPDATE, then COMMIT: two round trips).
- **ringq p=1 +limit**: p=1 with a 30 s time limit on the action (an
  ``ITIMER_REAL`` armed and disarmed per message; ``statement_timeout`` is set
  once per session), to show what the limit costs.
- **engine loop (no worker)**: the same one-message transactions in a bare
  ``dequeue(); commit()`` loop in the benchmark's own process: the floor under
  a worker, so ``p=1`` against it is the worker's own cost.
- **procrastinate c=1**: procrastinate's worker, concurrency 1, on a no-op
  *sync* task (and an async one), default settings (jobs kept, LISTEN/NOTIFY
  on), ``wait=False`` so it returns once the queue is empty; the jobs are
  deferred with ``batch_defer`` beforehand. Measured only when procrastinate
  is importable (``pip install procrastinate``: not a ringq dependency).

How ringq is timed: the pool is started first and the clock starts only when
every worker sleeps on the queue (the section shows them waiting); then ONE
producer transaction commits ``--messages`` entries and the clock stops when
the section counts that many consumed. Worker start-up is excluded.
procrastinate's clock runs around ``run_worker_async(wait=False)`` and so
includes its worker start (milliseconds against seconds).

Rounds are interleaved (the order rotates each round); the table shows the
median of the rounds [min-max]. Prints a table and writes JSON to
``bench/results/worker-<UTC timestamp>.json`` (and ``--out``). It never asserts
a timing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
from _benchlib import (
    argument_parser,
    ceiling_one_rt,
    cpu_load,
    create_ceiling,
    database,
    drop_queues,
    machine,
    server_settings,
    sigterm_tears_down,
    write_results,
)
from psycopg import sql
from ringq.engine import Message, Session, connect, metrics
from ringq.scripting import QueueSpec, create_queue
from ringq.worker import Actions, PoolConfig, WorkerConfig, WorkerPool

ISSUE_PROCRASTINATE = "350-420 jobs/s (issue 8, concurrency 1, measured earlier on this machine)"


def noop(msg: Message, session: Session) -> None:
    return None


# -- ringq ------------------------------------------------------------------------------------


def ringq_round(
    dsn: str, queue: str, n: int, processes: int, timeout: float | None
) -> dict[str, Any]:
    app = Actions()
    app.add(queue, noop, timeout=timeout)
    pool = WorkerPool(
        app,
        dsn,
        config=PoolConfig(
            processes=processes, start_method="fork", worker=WorkerConfig(queues=(queue,))
        ),
    )
    pool.start()
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(pool.run()), name="pool", daemon=True)
    runner.start()
    try:
        with connect(dsn) as s:
            _wait(
                lambda: s.stats(queue)[metrics.WAIT_READY] >= processes,
                60,
                "workers asleep on the queue",
            )
            base = s.stats(queue)[metrics.DEQ_COMMITS]
            s.enqueue_many(queue, [b"x" * 16] * n)
            s.commit()
            t0 = time.perf_counter()
            _wait(
                lambda: s.stats(queue)[metrics.DEQ_COMMITS] - base >= n,
                600,
                f"{n} messages handled",
                0.001,
            )
            elapsed = time.perf_counter() - t0
    finally:
        pool.request_stop()
        runner.join(60)
        pool.close()
    st = pool.stats()
    return {
        "messages": n,
        "seconds": elapsed,
        "per_s": n / elapsed,
        "handled": st["handled"],
        "failed": st["failed"],
        "exit_code": codes[0] if codes else None,
    }


def engine_loop_round(dsn: str, queue: str, n: int) -> dict[str, Any]:
    """The floor under a worker: the same transactions in a bare loop, in this process."""
    with connect(dsn) as s:
        s.enqueue_many(queue, [b"x" * 16] * n)
        s.commit()
        t0 = time.perf_counter()
        got = 0
        while got < n:
            if s.dequeue(queue, wait=1.0) is not None:
                got += 1
            s.commit()
        elapsed = time.perf_counter() - t0
    return {"messages": n, "seconds": elapsed, "per_s": n / elapsed}


def ceiling_round(dsn: str, n: int) -> dict[str, Any]:
    """The one-round-trip ceiling: ``n`` one-row UPDATE transactions in
    autocommit (one round trip and one WAL flush each), the least a durable
    transaction costs from here; a worker's message is one such transaction
    at best (its entry's consuming write, sent with the commit)."""
    table = f"bench_worker_ceiling_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_ceiling(conn, table)
        try:
            per_s = ceiling_one_rt(conn, table, n)
        finally:
            conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    return {"messages": n, "seconds": n / per_s, "per_s": per_s}


def _wait(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(every)


# -- procrastinate ------------------------------------------------------------------------------


def procrastinate_available() -> str | None:
    try:
        from importlib.metadata import version

        import procrastinate  # noqa: F401

        return version("procrastinate")
    except ImportError:
        return None


def procrastinate_setup(dsn: str) -> None:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.SyncPsycopgConnector(conninfo=dsn))
    with app.open():
        app.schema_manager.apply_schema()


def procrastinate_round(dsn: str, queue: str, n: int, kind: str) -> dict[str, Any]:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    def noop_sync() -> None:
        return None

    async def noop_async() -> None:
        return None

    # app.task(...) is the decorator, applied by hand: procrastinate is typed as Any here
    # (an optional dependency: pyproject's mypy section), so decorator syntax would be untyped.
    task = app.task(queue=queue, name=f"bench_noop_{kind}")(
        noop_sync if kind == "sync" else noop_async
    )

    async def go() -> dict[str, Any]:
        async with app.open_async():
            for i in range(0, n, 1000):
                await task.batch_defer_async(*([{}] * min(1000, n - i)))
            t0 = time.perf_counter()
            await app.run_worker_async(
                queues=[queue], concurrency=1, wait=False, install_signal_handlers=False
            )
            elapsed = time.perf_counter() - t0
            async with app.connector.pool.connection() as conn, conn.cursor() as cur:
                await cur.execute(
                    "SELECT status, count(*) FROM procrastinate_jobs "
                    "WHERE queue_name = %s GROUP BY status",
                    (queue,),
                )
                statuses = dict(await cur.fetchall())
        return {"messages": n, "seconds": elapsed, "per_s": n / elapsed, "statuses": statuses}

    return asyncio.run(go())


# -- driver -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argument_parser(
        "ringq worker benchmark: messages/s through a no-op action (1 and 2 processes), "
        "against procrastinate's worker (concurrency 1) on the same database."
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (medians are reported)"
    )
    p.add_argument("--messages", type=int, default=10_000, help="messages per ringq run")
    p.add_argument("--jobs", type=int, default=3_000, help="jobs per procrastinate run")
    p.add_argument("--no-procrastinate", action="store_true", help="skip procrastinate")
    args = p.parse_args(argv)
    # procrastinate warns that its App lives in __main__ (harmless here).
    logging.getLogger("procrastinate").setLevel(logging.ERROR)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("ringq.worker").setLevel(logging.ERROR)  # no drain messages per run
    sigterm_tears_down()
    started = datetime.now(UTC)
    t_all = time.perf_counter()
    tag = secrets.token_hex(3)
    queue = f"bw_{tag}"
    pc_version = None if args.no_procrastinate else procrastinate_available()
    contenders: dict[str, Callable[[str], dict[str, Any]]] = {
        "engine loop (no worker)": lambda dsn: engine_loop_round(dsn, queue, args.messages),
        "ringq p=1": lambda dsn: ringq_round(dsn, queue, args.messages, 1, None),
        "ringq p=2": lambda dsn: ringq_round(dsn, queue, args.messages, 2, None),
        "ringq p=1 +limit": lambda dsn: ringq_round(dsn, queue, args.messages, 1, 30.0),
        "ceiling (1 round trip)": lambda dsn: ceiling_round(dsn, args.messages),
    }
    if pc_version:
        contenders["procrastinate c=1 sync"] = lambda dsn: procrastinate_round(
            dsn, f"pc_{tag}", args.jobs, "sync"
        )
        contenders["procrastinate c=1 async"] = lambda dsn: procrastinate_round(
            dsn, f"pc_{tag}", args.jobs, "async"
        )
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in contenders}
    env: dict[str, Any] = {**machine(), **cpu_load("start"), "procrastinate": pc_version}
    with database(args.dsn, prefix="ringq-bench-worker-") as (dsn, home):
        embedded = home is not None
        with psycopg.connect(dsn, autocommit=True) as conn:
            env["server"] = server_settings(conn)
        with psycopg.connect(dsn) as conn:
            create_queue(
                conn, QueueSpec(queue, max(args.messages, 1024) + 64, 64, dequeue_mode="shared")
            )
        try:
            if pc_version:
                procrastinate_setup(dsn)
            names = list(contenders)
            for r in range(args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    got = contenders[name](dsn)
                    raw[name].append(got)
                    print(
                        f"round {r + 1}: {name:26s} {got['per_s']:9,.0f} msg/s",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            if pc_version and not embedded:
                with psycopg.connect(dsn, autocommit=True) as admin:
                    admin.execute(
                        "DELETE FROM procrastinate_jobs WHERE queue_name = %s", (f"pc_{tag}",)
                    )
            drop_queues(dsn, [queue], embedded=embedded)
    env.update(cpu_load("end"))
    summary = {
        name: {
            "median_per_s": statistics.median(x["per_s"] for x in runs),
            "min_per_s": min(x["per_s"] for x in runs),
            "max_per_s": max(x["per_s"] for x in runs),
        }
        for name, runs in raw.items()
        if runs
    }
    lines = [
        (
            f"ringq worker benchmark: no-op action, {args.rounds} rounds, "
            f"{args.messages:,} messages per ringq run, {args.jobs:,} jobs per procrastinate run"
        ),
        (
            f"server {env['server']['server_version']}, fsync={env['server']['fsync']}, "
            f"synchronous_commit={env['server']['synchronous_commit']}; {env['cpus']} CPUs; "
            f"load {env['loadavg_at_start'][0]:.2f} -> {env['loadavg_at_end'][0]:.2f}"
        ),
        "",
        f"{'contender':28s} {'msg/s median':>13s}  [min-max]",
    ]
    for name, s in summary.items():
        lines.append(
            f"{name:28s} {s['median_per_s']:13,.0f}  [{s['min_per_s']:,.0f}-{s['max_per_s']:,.0f}]"
        )
    if not pc_version:
        lines.append(
            f"{'procrastinate c=1':28s} {'not measured':>13s}  reference: {ISSUE_PROCRASTINATE}"
        )
    if "ringq p=1" in summary and "ceiling (1 round trip)" in summary:
        ratio = summary["ringq p=1"]["median_per_s"] / summary["ceiling (1 round trip)"][
            "median_per_s"]
        verdict = "met" if ratio >= 0.9 else "NOT MET"
        lines.append(f"target: ringq p=1 / ceiling {ratio:.2f} >= 0.9  {verdict}")
    if pc_version and "ringq p=1" in summary:
        base = summary["ringq p=1"]["median_per_s"]
        for name in ("procrastinate c=1 sync", "procrastinate c=1 async"):
            if name in summary:
                lines.append(f"ringq p=1 / {name}: {base / summary[name]['median_per_s']:.1f}x")
    table = "\n".join(lines)
    print(table)
    doc = {
        "benchmark": "worker",
        "started_at": started.isoformat(),
        "seconds": time.perf_counter() - t_all,
        "command": [sys.executable, *sys.argv],
        "database": "embedded" if args.dsn is None else "given (--dsn)",
        "config": {"rounds": args.rounds, "messages": args.messages, "jobs": args.jobs},
        "environment": env,
        "raw": raw,
        "summary": summary,
        "reference": None if pc_version else ISSUE_PROCRASTINATE,
        "table": table,
    }
    write_results("worker", started, doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
