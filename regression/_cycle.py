"""One regression cycle, the parent's side: start the workers, drive, stop, report.

:func:`run_cycle` sets up the shared counters and the workers' arguments,
starts one consumer process per queue (``grouped_consumers`` on the grouped
queue), ``config.producers`` producer processes and ``config.sql_consumers``
SQL consumer processes (:mod:`._consumer`, :mod:`._producer`,
:mod:`._sql_consumer`; with SQL consumers it runs a monitor, their agent, if
none serves the database), then drives the cycle: it restarts the workers chaos
killed (:mod:`._chaos`), kills the primary once for a fail-over cycle
(:mod:`._failover`), samples the queues' depths, reports progress and watches
for an abort or a stall. When every worker has exited it stops chaos and the
fail-over, checks how each worker exited and returns the cycle's figures
(:class:`CycleResult`; the proof comes later, from Spark).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringq.engine import Session, connect
from ringq.engine import metrics as M

from . import _store
from . import _worker as W
from ._chaos import Chaos
from ._consumer import consumer_main
from ._failover import Failover
from ._producer import producer_main
from ._sql_consumer import sql_consumer_main
from ._store import RunInfo, sql_taking
from ._worker import WorkerArgs

STATS_KEYS = (
    M.FULL_HITS,
    M.EMPTY_HITS,
    M.ENQ_ROLLBACKS,
    M.DEQ_ROLLBACKS,
    M.POISONED,
    M.REPAIRS,
    M.RESYNCS,
    M.WAKEUPS,
)

JOIN_S = 10.0  # grace for workers after an abort before they are terminated


@dataclass
class Progress:
    """A snapshot for the progress display (all counts since the cycle began)."""

    cycle: int
    elapsed_s: float
    expected: int  # committed entries the cycle will make
    committed: int
    received: int
    rolled_back_tx: int
    full_tx: int
    depth: list[int]
    capacity: int
    # each queue's section counters now (ringq.engine.metrics.queue_stats; the
    # cycle's pages draw rates from them), as ``depth`` the last read
    stats: list[dict[str, int]] = field(default_factory=list)


@dataclass
class CycleResult:
    """What the workload of one cycle did (the proof comes later, from Spark)."""

    cycle: int
    status: str  # done | aborted | stalled | failed
    workload_s: float
    stats: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "done" and not self.errors


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        # A fork server that imported only the workers' modules: workers start fast
        # and inherit no connection, section mapping, thread or JVM from the parent.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([
            "ringq.regression._producer", "ringq.regression._consumer",
            "ringq.regression._sql_consumer",
        ])
        _CTX = ctx
    return _CTX


def quotas(entries_per_queue: int, producers: int, queues: int) -> list[tuple[int, ...]]:
    """Split each queue's entries among producers (as evenly as integers allow)."""
    base, extra = divmod(entries_per_queue, producers)
    return [tuple(base + (1 if p < extra else 0) for _ in range(queues)) for p in range(producers)]


def run_cycle(
    dsn: str,
    run: RunInfo,
    cycle: int,
    *,
    progress: Callable[[Progress], None] | None = None,
    abort_requested: Callable[[], bool] | None = None,
    monitor_dir: Path | None = None,
    monitor_dsns: tuple[str, ...] = (),
) -> CycleResult:
    """Run one cycle's workload to its end and return what it did.

    With chaos, the monitor killed is the cycle's own, or, if one already
    serves the database, that one, found by its state file in ``monitor_dir``
    and restarted as it was (see :mod:`ringq.regression._monitors`).

    With ``chaos_failover`` (``dsn`` is then the multi-host DSN of
    :func:`ringq.regression._failover.prepare`), the primary is killed and
    its standby promoted once the cycle has committed 30-60% of its entries,
    and the old primary is rebuilt as a standby when the workload ends. A
    monitor already serving the database (on ``dsn`` or one of
    ``monitor_dsns``) is restarted at once on ``dsn``, so that it follows.

    The cycle ends when every producer has committed its share and every
    consumer has found its queue empty after that. ``abort_requested`` is polled
    (every 0.2 s); when it returns True the workers are stopped and the cycle
    is marked aborted. A cycle without any progress for ``stall_timeout``
    seconds is aborted as stalled. A worker that fails (exits non-zero
    without chaos having killed it) stops the others at once: the cycle is
    failed, and the proof tells what it left queued (not drained) from what
    was lost.
    """
    c = _Cycle(dsn, run, cycle, monitor_dir, monitor_dsns)  # set-up
    try:
        c.start()
        c.drive(progress, abort_requested)
        c.stop()
    finally:
        c.close()
    c.check_exits()
    return c.result()


class _Cycle:
    """The parent's state of one cycle, and its steps in the order
    :func:`run_cycle` takes them: set-up (``__init__``), :meth:`start`,
    :meth:`drive`, :meth:`stop`, :meth:`check_exits`, :meth:`result`."""

    def __init__(
        self,
        dsn: str,
        run: RunInfo,
        cycle: int,
        monitor_dir: Path | None,
        monitor_dsns: tuple[str, ...],
    ) -> None:
        self.dsn, self.run, self.cycle = dsn, run, cycle
        self.cfg = cfg = run.config
        self.ctx = _context()
        self.nq, self.np = len(run.queues), cfg.producers
        # (queue, worker) of each consumer: one per queue, grouped_consumers for the grouped one
        taking = [
            (q, w)
            for q, ref in enumerate(run.queues)
            for w in range(cfg.grouped_consumers if ref.grouped else 1)
        ]
        self.nc = len(taking)
        # (queue, worker) of each SQL consumer: dealt out over the queues in turn,
        # the grouped queue first; numbered after the queue's linked consumers
        self.sql_taking = sql_taking(run.queues, cfg)
        self.ns = len(self.sql_taking)
        # a block per worker, then the W.PROMOTED word
        self.counters = self.ctx.Array(
            "q", (self.np + self.nc + self.ns) * W.WORDS + 1, lock=False
        )
        self.producers_done = self.ctx.Event()
        self.abort = self.ctx.Event()
        self.errors_q = self.ctx.Queue()
        self.base_seed = cfg.seed if cfg.seed is not None else random.SystemRandom().getrandbits(48)
        self.seeds = random.Random(f"{self.base_seed}:{cycle}")
        self.expected = cfg.entries_per_queue * self.nq
        self.failover = (
            Failover(
                dsn,
                cfg.chaos_failover,
                random.Random(f"{self.base_seed}:{cycle}:failover"),
                self.expected,
            )
            if cfg.chaos_failover is not None
            else None
        )
        self.ack_dir = (
            tempfile.mkdtemp(prefix="ringq-regress-acks-") if self.failover is not None else ""
        )
        self.specs = self._specs(taking)
        # The grouped queue's consumers stand still at first, until it is full
        # (its SQL consumers with them): set before any of them starts.
        for c, (q, _w) in enumerate(taking):
            if run.queues[q].grouped:
                self.counters[(self.np + c) * W.WORDS + W.C_PAUSED] = 1
        self.workers = [self.ctx.Process(target=t, args=a, name=n) for t, a, n in self.specs]
        self.chaos = (
            Chaos(
                dsn,
                cfg,
                random.Random(f"{self.base_seed}:{cycle}:chaos"),
                monitor_dir,
                monitor_dsns,
            )
            if cfg.resilient or self.ns
            else None
        )
        self.status = "done"
        self.errors: list[str] = []
        self.max_depth = [0] * self.nq
        self.depths = [0] * self.nq
        self.stats_now: list[dict[str, int]] = []
        self.watcher: Session | None = None  # the parent's stats session
        self.before: list[dict[str, Any]] = []
        self.after: list[dict[str, Any]] = []
        self.t0 = 0.0
        self.workload_s = 0.0
        self.last_beat, self.last_change = -1, 0.0

    def _args(
        self,
        index: int,
        slot: int,
        quota: tuple[int, ...] = (),
        worker: int = 0,
        first_slot: int = 0,
    ) -> WorkerArgs:
        run = self.run
        return WorkerArgs(
            self.dsn, run.run_id, self.cycle, self.cfg, run.queues, index, slot,
            self.seeds.getrandbits(63), quota, self.ack_dir if quota else "", worker, first_slot,
        )

    def _specs(self, taking: list[tuple[int, int]]) -> list[tuple[Any, tuple[Any, ...], str]]:
        """(target, args, name) of each worker, consumers first, then producers,
        then SQL consumers: a killed one is started again from it."""
        np_, nc, queues = self.np, self.nc, self.run.queues
        shared = (self.counters, self.producers_done, self.abort, self.errors_q)
        first: dict[int, int] = {}  # queue -> the block of its first linked consumer
        for c, (q, _w) in enumerate(taking):
            first.setdefault(q, np_ + c)
        return [
            (
                consumer_main,
                (self._args(q, np_ + c, worker=w, first_slot=np_ + c - w), *shared),
                f"regress-consumer-{q}.{w}" if queues[q].grouped else f"regress-consumer-{q}",
            )
            for c, (q, w) in enumerate(taking)
        ] + [
            (
                producer_main,
                (self._args(p, p, quota), self.counters, self.abort, self.errors_q),
                f"regress-producer-{p}",
            )
            for p, quota in enumerate(quotas(self.cfg.entries_per_queue, np_, self.nq))
        ] + [
            (
                sql_consumer_main,
                (self._args(q, np_ + nc + k, worker=w, first_slot=first[q]), *shared),
                f"regress-sql_consumer-{q}.{w}",
            )
            for k, (q, w) in enumerate(self.sql_taking)
        ]

    @property
    def consumers(self) -> list[Any]:
        return self.workers[: self.nc]

    @property
    def producers(self) -> list[Any]:
        return self.workers[self.nc : self.nc + self.np]

    @property
    def sql_consumers(self) -> list[Any]:
        return self.workers[self.nc + self.np :]

    def _sum(self, slots: Sequence[int], word: int) -> int:
        return int(sum(self.counters[i * W.WORDS + word] for i in slots))

    @property
    def producer_slots(self) -> range:
        return range(self.np)

    @property
    def consumer_slots(self) -> range:
        return range(self.np, self.np + self.nc)

    @property
    def sql_slots(self) -> range:
        return range(self.np + self.nc, self.np + self.nc + self.ns)

    @property
    def all_slots(self) -> range:
        return range(self.np + self.nc + self.ns)

    # -- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Read the queues' counters, start chaos (and its monitor), then the workers."""
        self.watcher = connect(self.dsn, application_name="ringq-regress")
        self.before = [self.watcher.stats(ref.name) for ref in self.run.queues]
        self.watcher.commit()  # the queue lookups above opened a transaction; stats need none
        self.t0 = time.monotonic()
        if self.chaos is not None:
            self.chaos.start(self.t0)
        for proc in self.workers:
            proc.start()
        self.last_change = time.monotonic()

    # -- drive ----------------------------------------------------------------------------

    def drive(
        self,
        progress: Callable[[Progress], None] | None,
        abort_requested: Callable[[], bool] | None,
    ) -> None:
        """Turn the parent's loop until every worker has exited."""
        try:
            while self._turn(progress, abort_requested):
                pass
        except BaseException:
            self.abort.set()
            _stop(self.workers)
            if self.chaos is not None:
                self.chaos.stop()
            raise

    def _turn(
        self,
        progress: Callable[[Progress], None] | None,
        abort_requested: Callable[[], bool] | None,
    ) -> bool:
        """One turn of the loop (about _worker.POLL_S); False once every worker has exited."""
        if self.chaos is not None and self.status == "done":
            self._restart_killed()
        elif self.status == "done" and any(p.exitcode for p in self.workers):
            # A worker failed (nothing is killed on purpose without chaos): its
            # share would never come, and the producers, retrying a full
            # queue, beat on forever, so the stall watch would never end it.
            self._abandon("failed")
        alive = [p for p in self.workers if p.exitcode is None]
        if (
            not self.producers_done.is_set()
            and all(p.exitcode is not None for p in self.producers)
            and (self.chaos is None or all(p.exitcode == 0 for p in self.producers))
        ):
            self.producers_done.set()
        if not alive:
            return False
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=W.POLL_S)
        now = time.monotonic()
        if self.chaos is not None and self.status == "done":
            self.chaos.tick(
                now, self.producers, self.consumers, self.producers_done.is_set(),
                self.sql_consumers,
            )
        committed = self._sum(self.producer_slots, W.P_ENTRIES)
        failover = self.failover
        if failover is not None and self.status == "done" and failover.due(committed):
            failover.strike()  # kill -9 of the primary, promotion: about a second
            self.counters[W.PROMOTED] = int(failover.promoted_at * 1e6) or 1
            now = time.monotonic()
        self._sample_depths()
        beat = self._sum(self.all_slots, W.HEARTBEAT)
        if beat != self.last_beat:
            self.last_beat, self.last_change = beat, now
        if progress is not None:
            progress(self._progress(now, committed))
        self._watch(now, alive, abort_requested)
        return True

    def _restart_killed(self) -> None:
        """Start again each worker chaos killed; any other worker that failed fails the cycle."""
        assert self.chaos is not None
        failed = False
        for i, proc in enumerate(self.workers):
            # Read once: exitcode polls, and a worker chaos just
            # killed may die between two reads.
            code = proc.exitcode
            if code is None or code == 0:
                continue
            if self.chaos.was_killed(proc):
                t, a, n = self.specs[i]
                self.workers[i] = self.ctx.Process(target=t, args=a, name=n)
                self.workers[i].start()
            else:
                # Not killed by chaos: failed. Its share would
                # never come, so the others would wait for it forever.
                failed = True
        if failed:
            self._abandon("failed")

    def _sample_depths(self) -> None:
        """Each queue's depth now (the last one read while PostgreSQL restarts)."""
        try:
            assert self.watcher is not None
            self.stats_now = [self.watcher.stats(ref.name) for ref in self.run.queues]
            self.depths = [s[M.DEPTH] for s in self.stats_now]
        except W.LOST_SESSION:
            if self.chaos is None:
                raise
            self._reconnect()
        self.max_depth = [max(a, b) for a, b in zip(self.max_depth, self.depths, strict=True)]

    def _progress(self, now: float, committed: int) -> Progress:
        return Progress(
            cycle=self.cycle,
            elapsed_s=now - self.t0,
            expected=self.expected,
            committed=committed,
            received=self._sum(self.consumer_slots, W.C_ENTRIES)
            + self._sum(self.sql_slots, W.C_ENTRIES),
            rolled_back_tx=self._sum(self.producer_slots, W.P_RB_TX),
            full_tx=self._sum(self.producer_slots, W.P_FULL_TX),
            depth=self.depths,
            capacity=self.cfg.capacity,
            stats=self.stats_now,
        )

    def _watch(
        self, now: float, alive: list[Any], abort_requested: Callable[[], bool] | None
    ) -> None:
        """Abort the cycle when asked to, or as stalled after ``stall_timeout``
        seconds without any worker's heartbeat."""
        if self.status != "done":
            return
        if abort_requested is not None and abort_requested():
            self._abandon("aborted")
        elif now - self.last_change > self.cfg.stall_timeout:
            self.errors.append(
                f"no progress for {self.cfg.stall_timeout:g}s: the cycle was aborted "
                f"(depths {self.depths}, workers alive: {[p.name for p in alive]})"
            )
            self._abandon("stalled")

    def _abandon(self, status: str) -> None:
        self.status = status
        self.abort.set()
        _stop(self.workers)

    def _reconnect(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.watcher = _reconnect_watcher(self.dsn)

    # -- stop -----------------------------------------------------------------------------

    def stop(self) -> None:
        """The workers are done: stop chaos, finish the fail-over, read the counters again."""
        self.workload_s = time.monotonic() - self.t0
        if self.chaos is not None:
            self.chaos.stop()
        if self.failover is not None:
            self.failover.finish()  # the old primary back as a standby of the new one
        assert self.watcher is not None
        try:
            self.after = [self.watcher.stats(ref.name) for ref in self.run.queues]
        except W.LOST_SESSION:
            self._reconnect()
            self.after = [self.watcher.stats(ref.name) for ref in self.run.queues]

    def close(self) -> None:
        """Close the parent's stats session (a second call does nothing)."""
        if self.watcher is not None:
            self.watcher.close()

    # -- verify ---------------------------------------------------------------------------

    def check_exits(self) -> None:
        """Collect the workers' reported errors; a worker that did not exit 0
        (and was not stopped by an abort) fails the cycle."""
        while not self.errors_q.empty():
            self.errors.append(self.errors_q.get_nowait())
        if self.status != "aborted":
            for proc in self.workers:
                if proc.exitcode == 0:
                    continue
                if self.status == "done":
                    self.status = "failed"
                _, role, index = proc.name.split("-")
                if not any(e.startswith(f"{role} {index} ") for e in self.errors):
                    self.errors.append(f"{role} {index} exited with code {proc.exitcode}")
        self.errors_q.close()

    # -- report ---------------------------------------------------------------------------

    def result(self) -> CycleResult:
        """The cycle's figures: workers' counters, chaos, fail-over, per-queue statistics."""
        prod, cons, sqls = self.producer_slots, self.consumer_slots, self.sql_slots
        secs = self.workload_s or 1e-9
        stats: dict[str, Any] = {
            "seed": self.base_seed,
            "producers": {
                "committed_entries": self._sum(prod, W.P_ENTRIES),
                "committed_tx": self._sum(prod, W.P_TX),
                "two_phase_tx": self._sum(prod, W.P_TX_2PC),
                "multi_queue_tx": self._sum(prod, W.P_MULTI_TX),
                "rolled_back_tx": self._sum(prod, W.P_RB_TX),
                "full_rolled_back_tx": self._sum(prod, W.P_FULL_TX),
                "rolled_back_entries": self._sum(prod, W.P_RB_ENTRIES),
                "delayed_entries": self._sum(prod, W.P_DELAYED),
            },
            "consumers": {
                "committed_entries": self._sum(cons, W.C_ENTRIES),
                "committed_tx": self._sum(cons, W.C_TX),
                "rolled_back_tx": self._sum(cons, W.C_RB_TX),
                "stalls": self._sum(cons, W.C_STALLS),
                "redelivered": self._sum(cons, W.C_REDELIVERED),
                "processes": self.nc,
                "entries_per_s": round(self._sum(cons, W.C_ENTRIES) / secs, 1),
            },
            # the SQL path (ringq.dequeue from plain connections), beside the linked ones
            "sql_consumers": {
                "committed_entries": self._sum(sqls, W.C_ENTRIES),
                "committed_tx": self._sum(sqls, W.C_TX),
                "rolled_back_tx": self._sum(sqls, W.C_RB_TX),
                "redelivered": self._sum(sqls, W.C_REDELIVERED),
                "empty_takes": self._sum(sqls, W.S_EMPTY),
                "processes": self.ns,
                "queues": sorted({self.run.queues[q].name for q, _w in self.sql_taking}),
                "entries_per_s": round(self._sum(sqls, W.C_ENTRIES) / secs, 1),
            },
            "chaos": (
                self.chaos.report(self.counters, self.all_slots)
                if self.chaos is not None and self.cfg.resilient
                else None
            ),
            "failover": None,
            "queues": {
                ref.name: {
                    "payload_size": ref.payload_size,
                    "max_depth": self.max_depth[i],
                    **{k: int(self.after[i][k] - self.before[i][k]) for k in STATS_KEYS},
                }
                for i, ref in enumerate(self.run.queues)
            },
        }
        if self.status != "aborted":
            # Kept for the proof: an entry still queued now was not drained, not lost.
            left = _store.record_queued(self.dsn, self.run, self.cycle)
            for name, count in left.items():
                stats["queues"][name]["leftover"] = count
        if self.failover is not None:
            stats["failover"] = self._failover_report()
        return CycleResult(self.cycle, self.status, self.workload_s, stats, self.errors)

    def _failover_report(self) -> dict[str, Any]:
        """The fail-over's figures, with the acknowledged entries stored for the proof."""
        failover = self.failover
        assert failover is not None
        firsts = [self.counters[i * W.WORDS + W.C_FIRST_AFTER] for i in self.consumer_slots]
        first = min((t for t in firsts if t), default=0)
        report = failover.report(first / 1e6 if first else None)
        try:
            report["acknowledged"] = failover.store_acks(
                self.dsn, self.run.run_id, self.cycle, Path(self.ack_dir)
            )
        finally:
            shutil.rmtree(self.ack_dir, ignore_errors=True)
        self.errors.extend(failover.errors)
        if self.status == "done" and not failover.promoted_at and not failover.errors:
            self.errors.append(
                f"fail-over: the cycle ended before {failover.at:,} entries were committed: "
                "no primary was killed"
            )
        return report


def _stop(procs: Sequence[Any]) -> None:
    """Give workers JOIN_S to notice the abort, then terminate, then kill."""
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.exitcode is None:
            p.kill()
            p.join()


def _reconnect_watcher(dsn: str) -> Session:
    """The parent's stats session, opened again after PostgreSQL restarted."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            w = connect(dsn, application_name="ringq-regress")
            w.commit()
            return w
        except W.LOST_SESSION:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
