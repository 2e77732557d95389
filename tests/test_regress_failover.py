"""``ringq regress --chaos-failover``: a regression cycle whose primary is killed
with SIGKILL in its middle, its standby promoted, the old primary rebuilt as the
new one's standby afterwards, and the Spark proof telling the synchronous
promise (nothing acknowledged lost) from the asynchronous one (only the
replication gap lost, counted).

Each test runs its own embedded cluster under its own home (a killed primary
cannot be the suite's shared one) and stops every server it started.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from conftest import present
from psycopg import sql
from ringq.cli import main as cli_main
from ringq.cluster import Cluster
from ringq.engine import ConfigError
from ringq.regression import RegressConfig, Report, RunOutcome, Verifier, run
from test_failover import stop_all

pytestmark = pytest.mark.slow


@contextmanager
def embedded(home: Path) -> Iterator[Cluster]:
    """An embedded cluster under ``home``; afterwards its section removed and
    every server of the home stopped (an old primary left down is removed)."""
    cluster = Cluster(home)
    try:
        cluster.start()
        yield cluster
    finally:
        stop_all(cluster)


QUEUES = 3  # two payload sizes, and the grouped queue


def failover_cycle(
    cluster: Cluster, mode: str, verifier: Verifier, reports: Path, seed: int, cycles: int = 1
) -> tuple[RunOutcome, Report]:
    """Run ``cycles`` fail-over cycles; every one must finish; the last report."""
    config = RegressConfig(
        payload_sizes=(16, 2000),
        capacity=64,
        entries_per_queue=400,
        producers=3,
        two_phase_rate=0.3,
        seed=seed,
        chaos_failover=mode,
    )
    outcome = run(cluster.url(), config, cycles=cycles, verifier=verifier, report_dir=reports)
    assert len(outcome.results) == len(outcome.reports) == cycles
    for result, report in zip(outcome.results, outcome.reports, strict=True):
        assert result.status == "done" and not result.errors, result
        print("\n" + report.summary())
        assert report.ok, report.summary()
    return outcome, outcome.reports[-1]


def assert_cluster_is_whole_again(cluster: Cluster, home: Path, *, failovers: int = 1) -> None:
    """The new primary runs with the old one as its streaming standby, and
    ``$RINGQ_HOME/dsn`` names the live primary (what 'ringq run' reads);
    after an even number of fail-overs the first data directory is the
    primary again."""
    first, second = home / "pgdata", home / "standby" / "pgdata"
    if failovers % 2 == 0:
        first, second = second, first
    primary = cluster.status()
    assert primary.running and primary.in_recovery is False
    assert primary.datadir == second
    sb = present(cluster.standby_status())
    assert sb.state == "running" and sb.running and sb.in_recovery is True
    assert sb.datadir == first
    assert (home / "dsn").read_text().strip() == cluster.url()


def test_two_sync_failover_cycles_lose_nothing_acknowledged(
    tmp_path: Path, verifier: Verifier
) -> None:
    """Two cycles: the second fails back to the first data directory (its
    sessions, its section and Spark's JDBC follow the primary twice)."""
    home = tmp_path / "home"
    with embedded(home) as cluster:
        outcome, report = failover_cycle(cluster, "sync", verifier, tmp_path, 20261201, 2)
        assert report.ok, report.summary()
        v = report.violations
        assert v["lost"] == v["duplicate"] == v["out_of_order"] == 0
        assert report.counts["committed"] == report.counts["delivered"] == QUEUES * 400
        f = report.failover
        assert f["mode"] == "sync" and f["promotions"] == 1, f
        assert f["acknowledged"] > 0 and f["lost_acknowledged"] == 0, f
        assert f["kill_to_promoted_s"] > 0 and f["kill_to_first_dequeue_s"] > 0, f
        assert f["rebuilt"] in (["rewound"], ["unchanged"], ["copied"]), f
        assert "fail-over   sync standby: promotions 1" in report.summary()
        assert "(synchronous: none may be)" in report.summary()
        stats = outcome.results[-1].stats
        assert stats["failover"]["old_port"] != stats["failover"]["new_port"]
        assert stats["chaos"]["reconnects"] > 0  # the workers lived through it
        assert "?target_session_attrs=read-write" in outcome.dsn
        assert_cluster_is_whole_again(cluster, home, failovers=2)


def test_an_async_failover_cycle_loses_only_the_replication_gap(
    tmp_path: Path, verifier: Verifier
) -> None:
    home = tmp_path / "home"
    with embedded(home) as cluster:
        outcome, report = failover_cycle(cluster, "async", verifier, tmp_path, 20261202)
        assert report.ok, report.summary()  # a loss in the gap is allowed, and reported
        v = report.violations
        assert v["duplicate"] == v["out_of_order"] == v["lost"] == 0
        # What the new primary holds is delivered exactly once: the producers
        # made up for the entries lost, so every queue still got its share.
        assert report.counts["committed"] == report.counts["delivered"] == QUEUES * 400
        f = report.failover
        assert f["mode"] == "async" and f["promotions"] == 1 and f["walsender_paused_s"] > 0, f
        assert f["lost_outside_gap"] == 0 and f["lost_in_gap"] == f["lost_acknowledged"], f
        schema = sql.Identifier(f"regress_{outcome.run_id}")
        with psycopg.connect(outcome.dsn) as conn:
            row = conn.execute(
                sql.SQL(
                    "SELECT count(*) FROM {s}.acked a WHERE NOT EXISTS (SELECT FROM {s}.sent s "
                    "WHERE s.cycle = a.cycle AND s.producer = a.producer AND s.pseq = a.pseq)"
                ).format(s=schema)
            ).fetchone()
        assert row == (f["lost_acknowledged"],)  # the loss is what the report says
        assert f"{f['lost_in_gap']:,} in the replication gap" in report.summary()
        assert_cluster_is_whole_again(cluster, home)


def test_failover_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="chaos_failover"):
        RegressConfig(chaos_failover="maybe")
    cfg = RegressConfig(chaos_failover="async")
    assert cfg.resilient and not cfg.chaos
    assert RegressConfig.from_json(cfg.to_json()) == cfg
    assert cli_main(["regress", "--async", "--dsn", "postgresql://nowhere.invalid/x"]) == 2
