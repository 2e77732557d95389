"""The regression's verdict on a workload that stopped early: the entries it
left queued are "not drained", not "lost", and the workload's error is named
first; the run still fails.

The report's text and the split of undelivered entries are checked on
constructed inputs; one small cycle whose consumer raises (a trigger planted
on its received table) is run and proven end to end by ``ringq regress``.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import present, remove_section
from psycopg import sql
from ringq.cli import main as cli_main
from ringq.regression import VIOLATION_KINDS, Report, Verifier, load_run
from ringq.regression import _queries as S
from ringq.regression._checks import split_undelivered

ERROR = (
    "cycle 1: consumer 0 (pid 4242): RolledBack: commit failed and was rolled back: "
    "terminating connection due to unexpected postmaster exit"
)


def _report(**violations: int) -> Report:
    r = Report("r1", [1])
    r.violations.update(violations)
    r.counts = {"committed": 10_605, "delivered": 10_102, "received_rows": 10_102}
    return r


def _violations_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("  violations"))


# -- the report's text, on constructed reports --------------------------------------------------


def test_a_workload_stopped_early_reads_not_drained_and_its_error_first() -> None:
    r = _report(workload_error=1, not_drained=503)
    r.workload_errors = [ERROR]
    r.examples = {"not_drained": [{"cycle": 1, "queue": "q0", "qseq": 7}]}
    assert not r.ok
    text = r.summary()
    lines = text.splitlines()
    assert lines[0].endswith(": FAIL")
    # The workload's error is the first finding, before the counts and any other.
    assert lines[1] == "  workload    FAILED: 1 error", text
    assert lines[2] == f"    workload: {ERROR}", text
    assert "not drained 503 entries committed and still queued when the workload stopped " \
        "early" in text, text
    assert text.index("workload:") < text.index("not drained") < text.index("not_drained:")
    v = _violations_line(text)
    assert v.startswith("  violations  workload_error 1   lost 0   not_drained 503"), v
    assert not re.search(r"\blost [1-9]", text), text
    assert VIOLATION_KINDS[:3] == ("workload_error", "lost", "not_drained")
    assert r.to_json()["violations"]["lost"] == 0 and r.to_json()["ok"] is False


def test_not_drained_without_a_workload_error_fails_as_a_stall() -> None:
    """A workload that ended normally must have drained everything: entries
    left queued fail the run as a stall, and nothing is called lost."""
    r = _report(not_drained=3)
    assert not r.ok
    text = r.summary()
    assert text.splitlines()[0].endswith(": FAIL") and "workload    FAILED" not in text
    assert "not drained 3 entries committed and still queued when the workload ended: " \
        "not lost, but it never drained them (a stall)" in text, text
    assert "lost 0" in _violations_line(text)


def test_a_clean_report_has_neither_line() -> None:
    r = _report()
    assert r.ok
    text = r.summary()
    assert "not drained" not in text and "workload " not in text.split("violations")[0]


# -- the split, on constructed DataFrames -------------------------------------------------------


def test_undelivered_entries_split_into_lost_and_not_drained(verifier: Verifier) -> None:
    """Committed entries never received are not drained when their (cycle,
    queue, qseq) was still queued at their cycle's end, lost otherwise; an
    entry received is neither, queued or not."""
    spark = verifier.spark
    key = "cycle int, queue short, qseq long"
    sent = spark.createDataFrame(
        [(1, 0, n, 1, n, n) for n in range(1, 8)] + [(2, 1, 1, 1, 8, 8)],
        f"{key}, producer short, pseq long, tx long",
    )
    first = spark.createDataFrame([(1, 0, 1), (1, 0, 2), (1, 0, 7)], key)
    # 3, 4 queued at the end of cycle 1; 7 too, but it was received; queue 0's
    # seq 5 queued in cycle 2 is another entry; (2, 1, 1) queued at its end.
    queued = spark.createDataFrame([(1, 0, 3), (1, 0, 4), (1, 0, 7), (2, 0, 5), (2, 1, 1)], key)
    lost, undrained = split_undelivered(sent, first, queued)

    def keys(df: Any) -> set[tuple[int, int, int]]:
        return {(r["cycle"], r["queue"], r["qseq"]) for r in df.collect()}

    assert keys(lost) == {(1, 0, 5), (1, 0, 6)}
    assert keys(undrained) == {(1, 0, 3), (1, 0, 4), (2, 1, 1)}
    assert set(undrained.columns) >= {"producer", "pseq", "tx"}  # the examples' columns


# -- end to end: a consumer raises, the workload stops, the proof says what happened ------------


def _fail_first_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's next cycle gets a trigger on its first queue's received
    table: the consumer's record of its 31st entry raises (its transaction,
    the dequeue with it, rolls back; the consumer process fails)."""
    from ringq.regression import _runner

    real = vars(_runner)["run_cycle"]

    def failing_consumer(dsn_: str, info: Any, cycle: int, **kw: Any) -> Any:
        table = sql.SQL("{}.{}").format(
            S.schema_of(info.run_id), S.received_table(info.queues[0].name)
        )
        fn = sql.Identifier(S.SCHEMA_PREFIX + info.run_id, "planted_failure")
        with psycopg.connect(dsn_, autocommit=True) as conn:
            conn.execute(sql.SQL(
                "CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS "
                "$$BEGIN RAISE EXCEPTION 'planted: the consumer fails'; END$$"
            ).format(fn=fn))
            conn.execute(sql.SQL(
                "CREATE TRIGGER planted_failure BEFORE INSERT ON {t} FOR EACH ROW "
                "WHEN (NEW.recv_order > 30) EXECUTE FUNCTION {fn}()"
            ).format(t=table, fn=fn))
        return real(dsn_, info, cycle, **kw)

    monkeypatch.setattr(_runner, "run_cycle", failing_consumer)


@pytest.mark.timeout(120)
def test_a_consumer_that_raises_stops_a_cycle_without_chaos(
    dsn: str, ringq_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without chaos (nothing killed on purpose) a failed consumer stops the
    cycle at once, as failed; before, the producers went on retrying its full
    queue, each retry a heartbeat, and the cycle never ended."""
    from ringq.regression import RegressConfig, run

    _fail_first_consumer(monkeypatch)
    config = RegressConfig(
        payload_sizes=(16, 2000), capacity=16, entries_per_queue=150, producers=2,
        grouped_consumers=0, seed=32, stall_timeout=30.0,
    )
    t0 = time.monotonic()
    try:
        outcome = run(dsn, config, cycles=1)
    finally:
        remove_section(dsn)
    result = outcome.results[0]
    assert result.status == "failed" and not outcome.ok, result
    assert any("consumer 0" in e and "planted: the consumer fails" in e for e in result.errors)
    assert time.monotonic() - t0 < 30.0  # stopped by the failure, not by the stall watch
    # What it left queued is kept for the proof.
    info = load_run(dsn, outcome.run_id)
    with psycopg.connect(dsn) as conn:
        (kept,) = present(conn.execute(
            sql.SQL("SELECT count(*) FROM {}.queued WHERE cycle = 1 AND queue = %s").format(
                S.schema_of(info.run_id)), (info.queues[0].idx,)).fetchone())
    assert kept == result.stats["queues"][info.queues[0].name]["leftover"] > 0


@pytest.mark.slow
def test_a_consumer_that_raises_stops_the_run_with_entries_not_drained_none_lost(
    dsn: str,
    ringq_env: dict[str, str],
    verifier: Verifier,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``ringq regress --chaos`` (no kill due within the cycle: workers that
    fail are watched as under fail-over) whose first queue's consumer raises
    after 30 entries: the cycle stops, ``ringq regress`` exits 1, and the
    verdict names the consumer's error first and counts every committed entry
    not dequeued as not drained, none lost."""
    _fail_first_consumer(monkeypatch)
    run_id = f"undrained_{secrets.token_hex(3)}"
    argv = [
        "regress", "--dsn", dsn, "--run-id", run_id, "--cycles", "1", "--capacity", "16",
        "--entries-per-queue", "150", "--producers", "2", "--payload-sizes", "16,2000",
        "--grouped-consumers", "0", "--seed", "32", "--chaos", "--chaos-interval", "3600",
        "--spark-master", "local[2]", "--report-dir", str(tmp_path),
    ]
    try:
        rc = cli_main(argv)
    finally:
        remove_section(dsn)
    out = capsys.readouterr()
    assert rc == 1, out
    assert re.search(r"after 1 cycle\(s\); \d+ failed", out.err), out.err
    assert load_run(dsn, run_id).status == "failed"
    saved = json.loads((tmp_path / run_id / "cycle-1.json").read_text())
    v, c = saved["violations"], saved["counts"]
    assert saved["ok"] is False
    assert v["workload_error"] >= 1 and any(
        "consumer 0" in e and "planted: the consumer fails" in e for e in saved["workload_errors"]
    ), saved["workload_errors"]
    # Every entry committed and not dequeued was still queued: not drained, none lost.
    assert v["lost"] == 0, v
    assert v["not_drained"] == c["committed"] - c["delivered"] > 0, (v, c)
    others = {k: n for k, n in v.items() if n and k not in ("workload_error", "not_drained")}
    assert not others, v
    first_queue = saved["queues"][0]
    assert first_queue["violations"]["not_drained"] > 0 and first_queue["violations"]["lost"] == 0
    text = out.out
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("ringq regress: run "))
    assert lines[head].endswith(": FAIL"), text
    assert lines[head + 1].startswith("  workload    FAILED"), text
    assert "planted: the consumer fails" in lines[head + 2], text
    assert f"not drained {v['not_drained']:,} entries" in text, text
    assert not re.search(r"\blost [1-9]", text), text
