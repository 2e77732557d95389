"""``ringq regress``: the randomized regression cycle and its Spark proof (issue 6)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from datetime import UTC
from pathlib import Path
from types import FrameType
from typing import Any, Self

from ringq.engine import exits, ringq_home

from ._args import add_cycle_options, add_dsn, dataclass_from_args, env_option, subparser

# Exit codes of `ringq regress` (the shared values of `ringq --help`).
RET_OK = exits.OK  # every cycle proven (or stored, with --no-verify)
RET_FAILURE = exits.FAILURE  # a proof found violations, or a cycle's workload failed
# --chaos: a monitor serves the database that cannot be taken over
RET_FOREIGN_MONITOR = exits.CONFLICT
RET_INTERRUPTED = exits.INTERRUPTED  # a second signal aborted a cycle

DESCRIPTION = """\
Create a run (schema regress_<run id>, one queue per payload size), then repeat
cycles: producer processes write random numbers of entries to random queues
(several queues per transaction, simple or two-phase, ~5% rolled back on
purpose, bursts and pauses so queues run full and empty); one consumer process
per queue dequeues and records what it took in the same transaction. After each
cycle Spark reads sent / rolled back / received through JDBC and proves: every
committed entry dequeued exactly once, nothing rolled back dequeued, dequeue
order per (queue, producer) = commit order, every payload intact. A short report
is printed and written as JSON; the run stays in the database for
'ringq regress verify RUN'.

The grouped queue (--grouped-consumers N, default 3; 0: none): one more queue,
shared dequeue mode, the smallest payload size, its entries in --groups random
groups, taken by N consumer processes at once; they record each entry's group,
when it was dequeued and when its commit began. The proof adds: per
(producer, group), dequeue order = commit order ("group order breaks"), and
never an entry of a group dequeued while another of that group was held
("groups in flight twice").

SQL consumers (--sql-consumers N, default 0): N more consumer processes that
are plain psycopg connections, no ringq session: each loops
SELECT ... FROM ringq.dequeue(queue, n) in its own transaction, records what it
took in the same transaction, and waits for its wake-up when it gets nothing
(ringq.dequeue LISTENs for it). They are dealt out over the queues in turn, the
grouped queue first
(shared mode), then the single-mode queues (one dequeuer at a time, linked or
SQL). Every consumer then records when it took each entry, and the proof's
order holds across linked and SQL consumers of a queue. They need the
monitor's agent: the run uses the monitor serving the database, or starts its
own. With --chaos they are killed too (kill -9, and pg_terminate_backend of
their backends). The report counts entries and entries/s per kind.

Entries that wait (--delayed-share S, --max-delay SECONDS, --retry-delay
SECONDS; default 0: none): producers enqueue a share S of their entries with a
delay (random up to --max-delay) and record the due time the database gave each
(its row's not_before, read back after the commit); the run's queues get a
retry backoff of --retry-delay, and consumers log each deliberate rollback with
the database's time just before it. Every take is recorded with the database's
time (clock_timestamp() in the consumer's transaction). The proof adds: no
delayed entry taken before its due time ("taken before due") and no rolled-back
entry taken again before its backoff ("retried before backoff"), both with no
tolerance; the order checks stay as strict (a single queue's head waits for its
time, and a group waits for its head).

--chaos: every --chaos-interval seconds while producers work, kill -9 a random
producer, consumer or the monitor, and restart it; --chaos-pg-restart also
restarts the embedded PostgreSQL once per cycle (workers reconnect). Restarted
workers wait until the monitor recovered the dead clients, then resume from
what the database recorded. The report counts the kills per kind. The monitor
killed is the one serving the database (for example the one 'ringq run' left
running): found by its state file in --monitor-dir, killed and started again
detached with its own options, data directory and port, so its viewer keeps
reading it; it is left serving after the run. With no monitor serving, the
run starts its own (a subprocess, stopped after each cycle). A monitor that
serves the database but is not found in --monitor-dir is refused (exit 5).

--chaos-failover (--sync, the default, or --async): on the embedded cluster
(ringq db start) only. Before the run its primary gets a streaming standby of
that kind (made if it has none; brought back if an earlier fail-over left the
old primary down), and every process of the run (producers, consumers, the
monitor, the proof) uses the multi-host DSN that follows the primary
(ringq db url --both). When 30-60% of a cycle's entries are committed the
primary's postmaster is killed with SIGKILL and the standby promoted
(ringq db promote: $RINGQ_HOME/dsn names it); workers and the monitor carry
on. After the workload the old primary is rebuilt as the new one's standby
(ringq db standby rebuild), so the next cycle, or 'ringq run', finds a primary
with its standby. Producers log, outside the database, every entry whose
commit returned; the proof compares that with what the new primary holds.
--sync: nothing acknowledged may be lost. --async: the primary's walsender is
paused 0.5 s before the kill (a standby falling behind), and the entries
acknowledged in that replication gap are lost: counted and reported, not a
failure, unless an entry outside the gap is lost. Never a duplicate, and
per-producer order holds, either way. Alone it kills nothing else; with
--chaos it adds the random kills.

SIGINT/SIGTERM: stop after the current cycle; a second one aborts the cycle.
Spark needs Java 17 and the PostgreSQL JDBC driver
(apt-get install -y libpostgresql-jdbc-java)."""

CHAOS_HELP = (
    "fault injection: every --chaos-interval seconds kill -9 a random producer, consumer, SQL "
    "consumer (or end its backend) or the monitor serving the database (the run's own if none "
    "serves) and restart it; restarted workers "
    "resume from what the database recorded; the proof must still pass"
)


def register(sub: Any) -> None:
    p = subparser(
        sub, "regress", "run the randomized regression cycle, proven by Spark", DESCRIPTION
    )
    p.set_defaults(func=_run, _parser=p)
    add_cycle_options(p, "RINGQ_REGRESS_", entries=10000, capacity=2000)
    env_option(
        p,
        "--producers",
        env="RINGQ_REGRESS_PRODUCERS",
        default=5,
        type=int,
        help="producer processes",
    )
    env_option(p, "--sql-consumers", env="RINGQ_REGRESS_SQL_CONSUMERS", default=0, type=int,
               help="consumer processes calling ringq.dequeue from plain psycopg connections, "
                    "beside the linked ones (dealt over the queues, the grouped one first)")
    env_option(p, "--rollback-rate", env="RINGQ_REGRESS_ROLLBACK_RATE", default=0.05, type=float,
               help="share of producer transactions rolled back on purpose")
    env_option(p, "--two-phase-rate", env="RINGQ_REGRESS_TWO_PHASE_RATE", default=0.3, type=float,
               help="share of producer transactions run as two-phase commits")
    env_option(p, "--delayed-share", env="RINGQ_REGRESS_DELAYED_SHARE", default=0.0,
               type=float,
               help="share of entries enqueued with a delay (random up to --max-delay); the "
                    "proof checks none was taken before its due time (default 0: none)")
    env_option(p, "--max-delay", env="RINGQ_REGRESS_MAX_DELAY", default=0.5, type=float,
               help="the longest delay of a delayed entry, in seconds")
    env_option(p, "--retry-delay", env="RINGQ_REGRESS_RETRY_DELAY", default=0.0, type=float,
               help="retry backoff of the run's queues, in seconds: an entry a consumer rolls "
                    "back comes back that much later, and the proof checks it was not taken "
                    "again before (default 0: at once)")
    env_option(
        p,
        "--filler",
        env="RINGQ_REGRESS_FILLER",
        default="random",
        choices=("random", "pattern"),
        help="payload bodies: random (incompressible) or a pattern (TOAST compresses it)",
    )
    env_option(p, "--seed", env="RINGQ_REGRESS_SEED", default=None, type=int,
               help="seed of the random choices (default: a fresh one, recorded in the run)")
    p.add_argument(
        "--run-id", default=None, help="name the run (default: UTC time and 4 hex digits)"
    )
    p.add_argument("--no-verify", action="store_true",
                   help="only store the cycles; prove them later with 'ringq regress verify RUN'")
    p.add_argument(
        "--keep-going", action="store_true", help="continue after a cycle that fails its proof"
    )
    p.add_argument("--keep-queues", action="store_true", help="keep the run's queues when it ends")
    p.add_argument("--chaos", action="store_true", help=CHAOS_HELP)
    env_option(p, "--chaos-interval", env="RINGQ_REGRESS_CHAOS_INTERVAL", default="2,6",
               help="with --chaos: seconds between kills, MIN,MAX (uniformly random) or one number")
    p.add_argument(
        "--chaos-pg-restart",
        action="store_true",
        help="with --chaos: also restart the embedded PostgreSQL once per cycle "
             "(pg_ctl restart -m fast)",
    )
    p.add_argument(
        "--chaos-failover",
        action="store_true",
        help="kill -9 the embedded cluster's primary in the middle of each cycle and promote "
             "its standby (made if need be); the old primary is rebuilt as a standby after "
             "the cycle",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--sync", dest="failover_mode", action="store_const", const="sync", default=None,
        help="with --chaos-failover (the default): a synchronous standby; nothing acknowledged "
             "may be lost",
    )
    mode.add_argument(
        "--async", dest="failover_mode", action="store_const", const="async",
        help="with --chaos-failover: an asynchronous standby, its walsender paused 0.5 s before "
             "the kill; the entries acknowledged in that gap are lost, counted and reported",
    )
    env_option(p, "--monitor-dir", env="RINGQ_MONITOR_DIR", default=None,
               help="with --chaos (or --chaos-failover): data directory of the monitor serving the "
                    "database, taken over "
                    "(default $RINGQ_HOME/monitor, where 'ringq run' keeps it)")
    _common(p)

    actions = p.add_subparsers(dest="regress_command", metavar="ACTION")
    v = subparser(actions, "verify", "prove a stored run again (all its complete cycles)",
                  "Re-run the Spark analysis on a stored run; exit 1 if it finds any violation.")
    v.add_argument("run", metavar="RUN", help="run id (see 'ringq regress list')")
    v.add_argument("--cycle", type=int, action="append", default=None,
                   help="only this cycle (repeatable); default: every complete cycle")
    _common(v, suppress=True)
    v.set_defaults(func=_verify)

    ls = subparser(actions, "list", "list the runs stored in the database")
    _common(ls, suppress=True, spark=False)
    ls.set_defaults(func=_list)

    d = subparser(actions, "drop", "drop a stored run (its schema and any queues left)")
    d.add_argument("run", metavar="RUN")
    _common(d, suppress=True, spark=False)
    d.set_defaults(func=_drop)


def _common(p: argparse.ArgumentParser, *, suppress: bool = False, spark: bool = True) -> None:
    """Options of ``regress`` that its actions take too. On an action they default
    to SUPPRESS, so a value given before the action (or from the environment) stays."""
    if not suppress:
        add_dsn(p)
        env_option(
            p,
            "--spark-master",
            env="RINGQ_SPARK_MASTER",
            default="local[*]",
            help="Spark master URL for the proof "
                 "(a cluster must reach the database through the DSN)",
        )
        env_option(p, "--jdbc-jar", env="RINGQ_JDBC_JAR", default="/usr/share/java/postgresql.jar",
                   help="the PostgreSQL JDBC driver jar")
        env_option(p, "--spark-driver-memory", env="RINGQ_SPARK_DRIVER_MEMORY", default="1g",
                   help="Spark driver memory")
        env_option(
            p,
            "--report-dir",
            env="RINGQ_REGRESS_REPORTS",
            default=None,
            help="where JSON reports go (default: $RINGQ_HOME/regress); <dir>/<run>/cycle-N.json",
        )
        return
    s = argparse.SUPPRESS
    p.add_argument("--dsn", default=s, help="as for 'ringq regress' [env: RINGQ_DSN]")
    if spark:
        p.add_argument(
            "--spark-master", default=s, help="as for 'ringq regress' [env: RINGQ_SPARK_MASTER]"
        )
        p.add_argument("--jdbc-jar", default=s, help="as for 'ringq regress' [env: RINGQ_JDBC_JAR]")
        p.add_argument("--spark-driver-memory", default=s, help="as for 'ringq regress'")
        p.add_argument(
            "--report-dir", default=s, help="as for 'ringq regress' [env: RINGQ_REGRESS_REPORTS]"
        )


# -- signals -------------------------------------------------------------------------------


class _Stopper:
    """First SIGINT/SIGTERM: stop after this cycle; second: abort the cycle. Handlers only set
    flags."""

    def __init__(self) -> None:
        self.signals = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Self:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1

    def stop(self) -> bool:
        return self.signals >= 1

    def abort(self) -> bool:
        return self.signals >= 2


# -- progress ------------------------------------------------------------------------------


class _Display:
    """A progress bar on a terminal (rich), else a plain line every 10 s; on stderr."""

    def __init__(self, cycles: int, stopper: _Stopper) -> None:
        self.cycles = cycles
        self.stopper = stopper
        self.tty = sys.stderr.isatty()
        self._live: Any = None
        self._task: Any = None
        self._cycle = 0
        self._last_line = 0.0
        self._told_stop = False
        self._finished_cycle = 0

    def note(self, msg: str) -> None:
        self.end()
        print(f"regress: {msg}", file=sys.stderr, flush=True)

    def update(self, p: Any) -> None:
        from ringq.regression import Progress as CycleProgress

        assert isinstance(p, CycleProgress)
        if self.stopper.stop() and not self._told_stop:
            self._told_stop = True
            self.note("stopping after this cycle (signal again to abort it now)")
        of = f"/{self.cycles}" if self.cycles else ""
        rate = p.committed / p.elapsed_s if p.elapsed_s > 0 else 0.0
        depth = " ".join(f"{d * 100 // max(1, p.capacity)}%" for d in p.depth)
        info = (
            f"enq {p.committed:,} deq {p.received:,} of {p.expected:,}  {rate:,.0f}/s  "
            f"rb {p.rolled_back_tx:,} full {p.full_tx:,}  depth {depth}"
        )
        done = min(p.committed, p.received)
        if not self.tty:
            now = time.monotonic()
            finished = done >= p.expected
            if finished and self._finished_cycle == p.cycle:
                return
            if now - self._last_line >= 10.0 or finished:
                self._last_line = now
                self._finished_cycle = p.cycle if finished else self._finished_cycle
                print(f"regress: cycle {p.cycle}{of} {done * 100 // max(1, p.expected)}% {info}",
                      file=sys.stderr, flush=True)
            return
        if self._live is None or self._cycle != p.cycle:
            self.end()
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._live = Progress(
                TextColumn(f"cycle {p.cycle}{of}"), BarColumn(bar_width=20), TaskProgressColumn(),
                TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                console=Console(stderr=True), transient=False,
            )
            self._live.start()
            self._task = self._live.add_task("cycle", total=p.expected, info="")
            self._cycle = p.cycle
        self._live.update(self._task, completed=done, info=info)

    def end(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


# -- commands ------------------------------------------------------------------------------


def _report_dir(args: argparse.Namespace) -> Path:
    return Path(args.report_dir) if args.report_dir else ringq_home() / "regress"


def _verifier(args: argparse.Namespace) -> Any:
    from ringq.regression import Verifier

    return Verifier(
        args.spark_master, jdbc_jar=args.jdbc_jar, driver_memory=args.spark_driver_memory
    )


def _run(args: argparse.Namespace) -> int:
    from ringq.engine import ConfigError, resolve_dsn
    from ringq.regression import ForeignMonitor, RegressConfig, parse_sizes, run, serving_monitor

    if args.chaos_pg_restart and not args.chaos:
        raise ConfigError("--chaos-pg-restart needs --chaos")
    if args.failover_mode is not None and not args.chaos_failover:
        raise ConfigError(f"--{args.failover_mode} needs --chaos-failover")
    if args.cycles < 0:
        raise ConfigError("--cycles must be 0 (until stopped) or more")
    config = dataclass_from_args(
        RegressConfig,
        args,
        payload_sizes=parse_sizes(args.payload_sizes),
        chaos_interval=_interval(args.chaos_interval),
        chaos_failover=(args.failover_mode or "sync") if args.chaos_failover else None,
    )
    dsn = resolve_dsn(args.dsn)
    monitor_dir = Path(args.monitor_dir) if args.monitor_dir else ringq_home() / "monitor"
    if config.chaos and config.chaos_failover is None:  # fail-over: checked on its DSN, by run()
        try:
            serving_monitor(dsn, monitor_dir)  # before Spark starts: a refusal comes at once
        except ForeignMonitor as exc:
            print(f"ringq regress: {exc}", file=sys.stderr)
            return RET_FOREIGN_MONITOR
    verifier = None if args.no_verify else _verifier(args)
    if verifier is not None:
        verifier.check()  # fail now, not after the first cycle's workload
    with _Stopper() as stopper:
        display = _Display(args.cycles, stopper)

        def on_report(report: Any) -> None:
            display.end()
            print(report.summary(), flush=True)

        try:
            outcome = run(
                dsn,
                config,
                cycles=args.cycles,
                verifier=verifier,
                report_dir=_report_dir(args),
                run_id=args.run_id,
                keep_going=args.keep_going,
                keep_queues=args.keep_queues,
                progress=display.update,
                notify=display.note,
                on_report=on_report,
                stop_requested=stopper.stop,
                abort_requested=stopper.abort,
                monitor_dir=monitor_dir,
            )
        except ForeignMonitor as exc:
            display.end()
            print(f"ringq regress: {exc}", file=sys.stderr)
            return RET_FOREIGN_MONITOR
        finally:
            display.end()
            if verifier is not None:
                verifier.close()
    cycles = len(outcome.results)
    failed = sum(1 for r in outcome.reports if not r.ok) + sum(
        1 for r in outcome.results if not r.ok and r.status != "aborted"
    )
    if failed:
        verdict = f"{failed} failed"
    elif outcome.reports:
        verdict = "all proven"
    else:
        verdict = "stored, not verified"
    print(f"regress: run {outcome.run_id} {outcome.status} after {cycles} cycle(s); {verdict}; "
          f"verify: ringq regress verify {outcome.run_id}", file=sys.stderr)
    if outcome.page:
        print(f"regress: charts: {outcome.page}", file=sys.stderr)
    if outcome.status == "aborted":
        return RET_INTERRUPTED
    return RET_OK if outcome.ok else RET_FAILURE


def _interval(text: str) -> tuple[float, float]:
    from ringq.engine import ConfigError

    try:
        parts = [float(x) for x in str(text).split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2:
        raise ConfigError(f"--chaos-interval must be MIN,MAX seconds or one number, not {text!r}")
    return parts[0], parts[1]


def _verify(args: argparse.Namespace) -> int:
    from ringq.engine import resolve_dsn
    from ringq.regression import RunNotFound, load_run, verify

    dsn = resolve_dsn(args.dsn)
    try:
        load_run(dsn, args.run)  # before Spark starts: an unknown run fails in a moment
    except RunNotFound as exc:
        print(f"ringq: {exc}", file=sys.stderr)
        return exits.NOT_FOUND
    with _verifier(args) as verifier:
        report = verify(
            dsn, args.run, verifier=verifier, cycles=args.cycle, report_dir=_report_dir(args)
        )
    print(report.summary(), flush=True)
    return exits.OK if report.ok else exits.FAILURE


def _list(args: argparse.Namespace) -> int:
    from ringq.engine import resolve_dsn
    from ringq.regression import cycles, list_runs

    dsn = resolve_dsn(args.dsn)
    runs = list_runs(dsn)
    if not runs:
        print("no regression runs in this database")
        return exits.OK
    print(
        f"{'run':<22} {'created (UTC)':<20} {'status':<9} {'cycles':>6} {'proven':>7} "
        f"{'failed':>7}  queues"
    )
    for r in runs:
        cs = cycles(dsn, r.run_id)
        proven = sum(1 for c in cs if c.ok)
        failed = sum(1 for c in cs if c.ok is False)
        sizes = ",".join(str(q.payload_size) for q in r.queues)
        print(
            f"{r.run_id:<22} {r.created_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}  {r.status:<9} "
            f"{len(cs):>6} {proven:>7} "
            f"{failed:>7}  {len(r.queues)} x {r.config.capacity:,} slots ({sizes} B)"
        )
    return exits.OK


def _drop(args: argparse.Namespace) -> int:
    from ringq.engine import resolve_dsn
    from ringq.regression import RunNotFound, drop_run

    try:
        drop_run(resolve_dsn(args.dsn), args.run)
    except RunNotFound as exc:
        print(f"ringq: {exc}", file=sys.stderr)
        return exits.NOT_FOUND
    print(f"dropped run {args.run}")
    return exits.OK
