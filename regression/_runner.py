"""Cycles of a run: workload, then proof, then again; the run stays in the database."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ringq.engine import redact_dsn

from . import _failover, _store
from ._config import RegressConfig
from ._cycle import CycleResult, Progress, run_cycle
from ._monitors import serving_monitor
from ._report import Report
from ._store import RunInfo
from ._verify import Verifier

if TYPE_CHECKING:
    from ringq.report import RunPages


@dataclass
class RunOutcome:
    """How a run of cycles ended: ``done`` (all cycles ran), ``stopped`` (asked to
    stop between cycles), ``aborted`` (stopped inside a cycle) or ``failed``
    (a cycle's proof found violations, or its workload failed)."""

    run_id: str
    status: str
    results: list[CycleResult] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    dsn: str = ""  # the DSN the run used (fail-over: the multi-host one)
    page: str | None = None  # the run's page (run.html), when it was written

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports) and all(
            r.ok or r.status == "aborted" for r in self.results
        )


def report_path(report_dir: Path, run_id: str, name: str) -> Path:
    return report_dir / run_id / f"{name}.json"


def run(
    dsn: str,
    config: RegressConfig,
    *,
    cycles: int = 1,
    verifier: Verifier | None = None,
    report_dir: Path | None = None,
    run_id: str | None = None,
    keep_going: bool = False,
    keep_queues: bool = False,
    progress: Callable[[Progress], None] | None = None,
    notify: Callable[[str], None] | None = None,
    on_report: Callable[[Report], None] | None = None,
    stop_requested: Callable[[], bool] | None = None,
    abort_requested: Callable[[], bool] | None = None,
    monitor_dir: Path | None = None,
) -> RunOutcome:
    """Create a run and repeat cycles (``cycles=0``: until ``stop_requested()``).

    Each cycle's workload is followed by its proof with ``verifier`` (none: the
    cycle is only stored, to be verified later). Stops at the first failing
    cycle unless ``keep_going``. The run's queues are dropped at the end unless
    ``keep_queues``; its evidence stays in schema ``regress_<run id>``.

    With ``report_dir``, the run's directory there gets each cycle's page of
    charts (``cycle-N.html``, beside its proof's ``cycle-N.json``) and the
    run's (``run.html``, ``RunOutcome.page``): :mod:`ringq.report`.

    With ``config.chaos``, a monitor already serving the database is taken over
    (killed and restarted as it was) if its state file is in ``monitor_dir``.

    With ``config.chaos_failover``, ``dsn`` must name the embedded cluster's
    primary: it gets a standby of that kind if it has none, and the whole run
    (workers, monitor, store, proof) uses the multi-host DSN that follows the
    primary (``RunOutcome.dsn``). Each cycle kills the primary, promotes the
    standby and rebuilds the old primary as the new one's standby.

    :raises ForeignMonitor: (chaos) a monitor serves the database that cannot
        be taken over; checked before the run is created.
    :raises ConfigError: (fail-over) ``dsn`` is not the embedded cluster's primary.
    :raises ClusterError: (fail-over) the standby could not be made or started.
    """
    say = notify or (lambda _msg: None)
    dsn, monitor_dsns = _prepare(dsn, config, monitor_dir, say)
    info = _store.create_run(dsn, config, run_id)
    pages = _pages(report_dir, info, monitor_dir)
    say(f"run {info.run_id}: {len(info.queues)} queues x {config.capacity:,} slots, "
        f"{config.entries_per_queue:,} entries per queue per cycle, {config.producers} producers")
    outcome = RunOutcome(info.run_id, "done", dsn=dsn)
    n = 0
    try:
        while cycles == 0 or n < cycles:
            if stop_requested is not None and stop_requested():
                outcome.status = "stopped"
                break
            n += 1
            cycle = _store.start_cycle(dsn, info.run_id)
            rec = pages.recorder(cycle) if pages is not None else None
            result = run_cycle(dsn, info, cycle, progress=rec.chain(progress) if rec else progress,
                               abort_requested=abort_requested,
                               monitor_dir=monitor_dir, monitor_dsns=monitor_dsns)
            _store.end_cycle(
                dsn,
                info.run_id,
                cycle,
                status=result.status,
                workload_s=result.workload_s,
                stats=result.stats,
                errors=result.errors,
            )
            outcome.results.append(result)
            say(f"cycle {cycle}: workload {result.status} in {result.workload_s:.1f} s"
                + (f" ({len(result.errors)} errors)" if result.errors else ""))
            report = None
            if result.status == "aborted":
                outcome.status = "aborted"
            elif verifier is not None:
                say(f"cycle {cycle}: proving with Spark ({verifier.master})")
                report = verifier.verify(dsn, info.run_id, [cycle])
                if report_dir is not None:
                    report.write(report_path(report_dir, info.run_id, f"cycle-{cycle}"))
                _store.record_verified(dsn, info.run_id, [cycle], report.ok, report.to_json())
                outcome.reports.append(report)
                if on_report is not None:
                    on_report(report)
                if not report.ok and not keep_going:
                    outcome.status = "failed"
            elif not result.ok and not keep_going:
                outcome.status = "failed"
            if pages is not None and rec is not None:
                _page(say, f"cycle {cycle}", partial(pages.cycle_page, rec, result, report))
            if outcome.status != "done":
                break
    finally:
        final = outcome.status if outcome.ok or outcome.status != "done" else "failed"
        _store.finish_run(dsn, info, final, drop_queues=not keep_queues)
        if pages is not None:
            outcome.page = _page(say, "run", partial(pages.run_page, final))
    return outcome


def _pages(report_dir: Path | None, info: RunInfo, monitor_dir: Path | None) -> RunPages | None:
    """The run's pages beside its JSON reports (none without a report directory)."""
    if report_dir is None:
        return None
    from ringq.report import RunPages

    return RunPages(report_dir / info.run_id, info.run_id, [q.name for q in info.queues],
                    info.config.capacity, info.config.to_json(),
                    [monitor_dir] if monitor_dir is not None else [])


def _page(say: Callable[[str], None], what: str, write: Callable[[], Path]) -> str | None:
    """Write a page; a page that cannot be drawn is reported, never fails the run."""
    try:
        path = write()
    except Exception as exc:
        say(f"{what}: page not written: {type(exc).__name__}: {exc}")
        return None
    say(f"{what}: page {path}")
    return str(path)


def _prepare(
    dsn: str, config: RegressConfig, monitor_dir: Path | None, say: Callable[[str], None]
) -> tuple[str, tuple[str, ...]]:
    """Before the run: the fail-over's standby, and a check of the monitor chaos
    will take over. Returns the DSN every process uses and the other DSNs a
    serving monitor may be found on."""
    monitor_dsns: tuple[str, ...] = ()
    if config.chaos_failover is not None:
        monitor_dsns = (dsn,)
        dsn = _failover.prepare(dsn, config.chaos_failover, say)
        say(f"fail-over ({config.chaos_failover}): every process uses {redact_dsn(dsn)}")
    if config.resilient:
        serving = serving_monitor(dsn, monitor_dir, also=monitor_dsns)
        if serving is not None:
            say(
                f"chaos: the monitor serving the database (pid {serving.pid}, "
                f"{serving.url or 'no HTTP'}) "
                "is killed and restarted as it was; it stays up after the run"
            )
    return dsn, monitor_dsns


def verify(
    dsn: str,
    run_id: str,
    *,
    verifier: Verifier,
    cycles: list[int] | None = None,
    report_dir: Path | None = None,
) -> Report:
    """Prove a stored run again (default: every complete cycle) and store the report.

    :raises RunNotFound: no such run.
    """
    report = verifier.verify(dsn, run_id, cycles)
    if report_dir is not None:
        stamp = time.strftime("%Y%m%d_%H%M%S", time.gmtime())
        report.write(report_path(report_dir, run_id, f"verify-{stamp}"))
    if report.cycles:
        _store.record_verified(dsn, run_id, report.cycles, report.ok, report.to_json())
    return report
