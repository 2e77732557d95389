"""The regression cycle and its Spark proof, against a real PostgreSQL and real processes.

The suite's SparkSession (conftest's ``verifier``, shared by the modules that
prove runs: Spark starts in about 10 s) and one stored run serve the whole
module: a small cycle must be proven, then each kind of fault is planted
into the stored run, caught with the right kind, and taken out again.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import fresh_database, present, remove_section
from psycopg import sql
from ringq.cli import main as cli_main
from ringq.engine import ConfigError, pid_alive
from ringq.regression import (
    MIN_PAYLOAD,
    RegressConfig,
    Report,
    RunOutcome,
    Verifier,
    load_run,
    parse_sizes,
    run,
    verify,
)
from ringq.regression import _payload as P
from ringq.regression import _queries as S

pytestmark = pytest.mark.slow

SIZES = (16, 200, 2000, 20000, 200000)
KINDS = ("lost", "not_drained", "duplicate", "out_of_order", "corrupt", "rolled_back_delivered")
# planted into the grouped queue (the run's last): they must fail the proof too
GROUP_KINDS = ("group_order_breaks", "group_in_flight_twice")
QUEUES = len(SIZES) + 1  # one per payload size, and the grouped queue


@pytest.fixture(scope="module")
def module_dsn(pg_cluster: Any) -> Iterator[str]:
    """A database for this module's stored run (the suite's ``dsn`` is per test)."""
    with fresh_database(pg_cluster, "t_regress") as url:
        yield url


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("regress_reports")


@pytest.fixture(scope="module")
def stored(module_dsn: str, verifier: Verifier, reports: Path) -> RunOutcome:
    """One small cycle, run as ``--cycles 0`` stopped after its first proof
    (with the grouped queue: 3 consumers, 20 groups)."""
    config = RegressConfig(
        payload_sizes=SIZES,
        capacity=64,
        entries_per_queue=200,
        producers=5,
        rollback_rate=0.15,  # enough rolled-back entries to plant one as delivered
        two_phase_rate=0.3,
        seed=20261122,
        grouped_consumers=3,
        groups=20,
    )
    proven: list[Report] = []
    return run(
        module_dsn,
        config,
        cycles=0,
        verifier=verifier,
        report_dir=reports,
        on_report=proven.append,
        stop_requested=lambda: bool(proven),
    )


def proven_cycle(
    dsn: str, config: RegressConfig, verifier: Any, tmp_path: Path,
    then: Callable[[Any], None] | None = None,
) -> tuple[Any, Any, Any]:
    """One cycle of ``config`` run and proven (``then(outcome)`` first, and the
    section removed whatever happens): (the run's outcome, its one result, its
    report), the result done without errors and the report ok."""
    try:
        outcome = run(dsn, config, cycles=1, verifier=verifier, report_dir=tmp_path)
        if then is not None:
            then(outcome)
    finally:
        remove_section(dsn)
    result = outcome.results[0]
    assert result.status == "done" and not result.errors, result
    report = outcome.reports[0]
    assert report.ok, report.summary()
    return outcome, result, report


def test_a_small_cycle_is_proven(module_dsn: str, stored: RunOutcome, reports: Path) -> None:
    assert stored.status == "stopped" and len(stored.results) == 1, stored
    result = stored.results[0]
    assert result.status == "done" and not result.errors, result
    report = stored.reports[0]
    assert report.ok, report.summary()
    assert set(report.violations) >= set(KINDS) and not any(report.violations.values())
    c = report.counts
    assert c["committed"] == c["delivered"] == QUEUES * 200
    assert c["received_rows"] == c["delivered"]  # consumer rollbacks left no rows behind
    tx = c["transactions"]
    assert tx["simple"] > 0 and tx["two_phase"] > 0 and tx["multi_queue"] > 0
    assert c["rolled_back"] > 0 and tx["rolled_back"] > 0
    # The workload reached both ends of every ring: each consumer stands still
    # while the producers still owe its queue more than a ring's worth, so every
    # queue is found full (entries_per_queue 200 > capacity 64), and found empty.
    assert len(report.queues) == QUEUES
    info = load_run(module_dsn, stored.run_id)
    # The grouped queue comes last, with the smallest payload size.
    assert [(q.payload_size, q.grouped) for q in info.queues] == [
        *((size, False) for size in SIZES), (min(SIZES), True)
    ]
    assert all(q["empty_hits"] > 0 for q in report.queues), report.queues
    assert all(q["full_hits"] > 0 for q in report.queues), report.queues
    assert all(q["max_depth"] > 0 for q in report.queues), report.queues
    assert stored.results[0].stats["consumers"]["stalls"] >= len(SIZES)
    assert all(q.get("leftover", 0) == 0 for q in report.queues)
    # The grouped queue: its three consumers took entries of its groups in
    # parallel, each group in order and one entry of a group at a time.
    g = report.groups
    assert g["committed"] == g["received_rows"] == 200 and g["groups"] == 20, g
    assert g["groups_seen"] == 20 and g["consumers"] == 3 and g["consumers_seen"] >= 2, g
    assert g["most_held_at_once"] >= 2, g
    assert g["order_breaks"] == g["in_flight_twice"] == 0, g
    v = report.violations
    assert v["group_order_breaks"] == v["group_in_flight_twice"] == 0
    assert re.search(r"groups +\S+_5: 200 entries in 20 of 20 groups", report.summary())
    assert "order breaks 0   in flight twice 0" in report.summary()
    assert report.path and Path(report.path).is_file()
    assert Path(report.path) == reports / stored.run_id / "cycle-1.json"
    # The run stays in the database, its queues do not.
    info = load_run(module_dsn, stored.run_id)
    assert info.status == "stopped"
    with psycopg.connect(module_dsn) as conn:
        names = [r[0] for r in conn.execute("SELECT name FROM ringq.queues").fetchall()]
        assert not any(stored.run_id in n for n in names)
        (sent,) = present(
            conn.execute(
                sql.SQL("SELECT count(*) FROM {}.sent").format(S.schema_of(stored.run_id))
            ).fetchone()
        )
        assert sent == QUEUES * 200


# -- planted faults ---------------------------------------------------------------------------


def _received(run_id: str, queue: str) -> sql.Composed:
    return sql.SQL("{}.{}").format(S.schema_of(run_id), S.received_table(queue))


@contextmanager
def planted(dsn: str, run_id: str, kind: str, at: int = 2) -> Iterator[dict[str, Any]]:
    """Plant one fault of ``kind`` into the stored run (committed, so Spark sees it)
    in its queue ``at`` (default the 2,000-byte payloads'; the group kinds go
    into the grouped queue); take it out again afterwards. Yields what was planted."""
    info = load_run(dsn, run_id)
    queue = info.queues[at]
    table = _received(run_id, queue.name)
    schema = S.schema_of(run_id)
    undo: Callable[[psycopg.Connection[Any]], None]
    with psycopg.connect(dsn, autocommit=True) as conn:
        if kind in ("lost", "not_drained"):
            # A received row deleted; not drained: its entry was also still
            # queued at the cycle's end (a cycle that ended without a workload
            # error and left it: a stall, which fails the proof too).
            row = present(
                conn.execute(
                    sql.SQL(
                        "DELETE FROM {t} WHERE ctid = "
                        "(SELECT ctid FROM {t} ORDER BY recv_order LIMIT 1 OFFSET 7) "
                        "RETURNING cycle, qseq, recv_order, deliveries, consumer, payload, deq_at"
                    ).format(t=table)
                ).fetchone()
            )

            queued = sql.SQL("{}.queued").format(schema)
            if kind == "not_drained":
                conn.execute(
                    sql.SQL("INSERT INTO {} (cycle, queue, qseq) VALUES (%s, %s, %s)").format(
                        queued
                    ),
                    (row[0], queue.idx, row[1]),
                )

            def undo(c: psycopg.Connection[Any]) -> None:
                c.execute(
                    sql.SQL(
                        "INSERT INTO {} "
                        "(cycle, qseq, recv_order, deliveries, consumer, payload, deq_at) "
                        "VALUES (%s, %s, %s, %s, %s, %s, %s)"
                    ).format(table),
                    row,
                )
                c.execute(
                    sql.SQL("DELETE FROM {} WHERE cycle = %s AND queue = %s AND qseq = %s").format(
                        queued
                    ),
                    (row[0], queue.idx, row[1]),
                )

            what = {"qseq": row[1]}
        elif kind == "duplicate":
            row = present(
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {t} (cycle, qseq, recv_order, deliveries, consumer, payload) "
                        "SELECT cycle, qseq, (SELECT max(recv_order) + 1 FROM {t}), 1, "
                        "consumer, payload FROM {t} "
                        "ORDER BY recv_order LIMIT 1 OFFSET 11 RETURNING qseq, recv_order"
                    ).format(t=table)
                ).fetchone()
            )

            def undo(c: psycopg.Connection[Any]) -> None:
                c.execute(sql.SQL("DELETE FROM {} WHERE recv_order = %s").format(table), (row[1],))

            what = {"qseq": row[0]}
        elif kind == "out_of_order":
            # Two entries of one producer, next to each other in its dequeue order: swap them.
            pair = conn.execute(
                sql.SQL(
                    "SELECT r.recv_order, s.producer, s.pseq FROM {t} r JOIN {s}.sent s "
                    "ON s.cycle = r.cycle AND s.queue = %s AND s.qseq = r.qseq "
                    "WHERE s.producer = (SELECT producer FROM {s}.sent WHERE queue = %s "
                    "GROUP BY producer "
                    "ORDER BY count(*) DESC LIMIT 1) ORDER BY r.recv_order LIMIT 2 OFFSET 3"
                ).format(t=table, s=schema),
                (queue.idx, queue.idx),
            ).fetchall()
            assert len(pair) == 2 and pair[0][2] < pair[1][2]
            (a, _, _), (b, _, _) = pair
            swap = sql.SQL(
                "UPDATE {} SET recv_order = CASE recv_order WHEN %s THEN %s ELSE %s END "
                "WHERE recv_order IN (%s, %s)").format(table)
            conn.execute(swap, (a, b, a, a, b))

            def undo(c: psycopg.Connection[Any]) -> None:
                c.execute(swap, (a, b, a, a, b))

            what = {"producer": pair[0][1], "pseq": pair[0][2]}
        elif kind == "corrupt":
            # One byte of the filler, in the middle of the payload.
            row = present(
                conn.execute(
                    sql.SQL(
                        "SELECT qseq, recv_order, payload FROM {} "
                        "ORDER BY recv_order LIMIT 1 OFFSET 5"
                    ).format(table)
                ).fetchone()
            )
            qseq, order, payload = row
            bad = bytearray(payload)
            bad[len(bad) // 2] ^= 0x01
            conn.execute(
                sql.SQL("UPDATE {} SET payload = %s WHERE recv_order = %s").format(table),
                (bytes(bad), order),
            )

            def undo(c: psycopg.Connection[Any]) -> None:
                c.execute(
                    sql.SQL("UPDATE {} SET payload = %s WHERE recv_order = %s").format(table),
                    (payload, order),
                )

            what = {"qseq": qseq}
        elif kind == "rolled_back_delivered":
            # An entry of a rolled-back transaction, delivered with a well-formed payload.
            rb = conn.execute(sql.SQL(
                "SELECT cycle, queue, qseq, producer, pseq, kind, length FROM {}.rolled_back "
                "WHERE queue = %s ORDER BY qseq LIMIT 1").format(schema), (queue.idx,)).fetchone()
            assert rb is not None, "the stored run has no rolled-back entry"
            cycle, qidx, qseq, producer, pseq, tx_kind, length = rb
            rb_table = _received(run_id, info.queues[qidx].name)
            payload = P.build(tx_kind, qidx, producer, pseq, length)
            order = conn.execute(sql.SQL(
                "INSERT INTO {t} (cycle, qseq, recv_order, deliveries, consumer, payload) "
                "VALUES (%s, %s, (SELECT coalesce(max(recv_order), 0) + 1 FROM {t}), 1, 0, %s) "
                "RETURNING recv_order").format(t=rb_table), (cycle, qseq, payload)).fetchone()
            assert order is not None

            def undo(c: psycopg.Connection[Any]) -> None:
                c.execute(
                    sql.SQL("DELETE FROM {} WHERE recv_order = %s").format(rb_table), (order[0],)
                )

            what = {"qseq": qseq}
        elif kind in GROUP_KINDS:
            what, undo = _plant_in_group(conn, info, kind)
        else:
            raise AssertionError(kind)
    try:
        yield what
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            undo(conn)


def _plant_in_group(
    conn: psycopg.Connection[Any], info: Any, kind: str
) -> tuple[dict[str, Any], Callable[[psycopg.Connection[Any]], None]]:
    """Change the recorded times of two entries of one group in the grouped
    queue's received table: ``group_in_flight_twice``, the second one dequeued
    just before the first one's commit began (their order unchanged);
    ``group_order_breaks``, two entries of one producer in one group swap
    their (dequeue, commit) times. Returns what was planted and its undo."""
    queue = info.queues[-1]
    assert queue.grouped
    table = _received(info.run_id, queue.name)
    times = sql.SQL("UPDATE {} SET deq_ns = %s, commit_ns = %s WHERE qseq = %s").format(table)
    if kind == "group_in_flight_twice":
        # Two entries in a row of the busiest group, by dequeue time.
        a, a_commit, b, b_deq, b_commit = present(conn.execute(sql.SQL(
            "SELECT qseq, commit_ns, nq, nd, nc FROM (SELECT qseq, deq_ns, commit_ns, "
            "lead(qseq) OVER w AS nq, lead(deq_ns) OVER w AS nd, lead(commit_ns) OVER w AS nc "
            "FROM {t} WHERE msg_group = (SELECT msg_group FROM {t} GROUP BY msg_group "
            "ORDER BY count(*) DESC, msg_group LIMIT 1) WINDOW w AS (ORDER BY deq_ns)) x "
            "WHERE nq IS NOT NULL ORDER BY deq_ns LIMIT 1 OFFSET 2").format(t=table)).fetchone())
        conn.execute(times, (a_commit - 1, b_commit, b))

        def undo(c: psycopg.Connection[Any]) -> None:
            c.execute(times, (b_deq, b_commit, b))

        return {"qseq": b}, undo
    # Two entries in a row of one producer in one group, by dequeue time.
    row = present(conn.execute(sql.SQL(
        "SELECT producer, qseq, pseq, deq_ns, commit_ns, nq, nd, nc FROM ("
        "SELECT s.producer, r.qseq, s.pseq, r.deq_ns, r.commit_ns, lead(r.qseq) OVER w AS nq, "
        "lead(r.deq_ns) OVER w AS nd, lead(r.commit_ns) OVER w AS nc "
        "FROM {t} r JOIN {s}.sent s ON s.cycle = r.cycle AND s.queue = %s AND s.qseq = r.qseq "
        "WINDOW w AS (PARTITION BY s.producer, s.grp ORDER BY r.deq_ns)) x "
        "WHERE nq IS NOT NULL ORDER BY deq_ns LIMIT 1 OFFSET 5"
    ).format(t=table, s=S.schema_of(info.run_id)), (queue.idx,)).fetchone())
    producer, a, a_pseq, a_deq, a_commit, b, b_deq, b_commit = row
    conn.execute(times, (b_deq, b_commit, a))
    conn.execute(times, (a_deq, a_commit, b))

    def undo_swap(c: psycopg.Connection[Any]) -> None:
        c.execute(times, (a_deq, a_commit, a))
        c.execute(times, (b_deq, b_commit, b))

    # The earlier entry now comes after the later one: it is the one out of order.
    return {"producer": producer, "pseq": a_pseq}, undo_swap


# Faults proven together, each alone in its queue (a proof takes seconds, and
# the report counts each queue's violations apart): kind -> the queue's index.
# The two group kinds both live in the grouped queue (the last), so not together.
PLANTINGS: tuple[dict[str, int], ...] = (
    {"lost": 0, "not_drained": 1, "corrupt": 2, "duplicate": 3, "out_of_order": 4},
    {"rolled_back_delivered": 0, "group_order_breaks": QUEUES - 1},
    {"group_in_flight_twice": QUEUES - 1},
)


@dataclass
class Caught:
    """One planted fault and the proof that ran with it planted."""

    report: Report
    what: dict[str, Any]  # what was planted (:func:`planted`)
    queue: int  # the index of the queue it was planted in
    together: frozenset[str]  # the kinds planted for the same proof, itself included


@pytest.fixture(scope="module")
def caught(module_dsn: str, stored: RunOutcome, verifier: Verifier) -> dict[str, Caught]:
    """Every kind of :data:`PLANTINGS` planted and proven, then taken out again."""
    out: dict[str, Caught] = {}
    for batch in PLANTINGS:
        with ExitStack() as plants:
            what = {
                kind: plants.enter_context(planted(module_dsn, stored.run_id, kind, at))
                for kind, at in batch.items()
            }
            report = verify(module_dsn, stored.run_id, verifier=verifier)
        for kind, at in batch.items():
            out[kind] = Caught(report, what[kind], at, frozenset(batch))
    return out


def test_every_kind_is_planted() -> None:
    kinds = [k for batch in PLANTINGS for k in batch]
    assert sorted(kinds) == sorted(KINDS + GROUP_KINDS)
    assert all(at == QUEUES - 1 for b in PLANTINGS for k, at in b.items() if k in GROUP_KINDS)
    for batch in PLANTINGS:  # one planted fault per queue and proof
        assert len(set(batch.values())) == len(batch)


@pytest.mark.parametrize("kind", KINDS + GROUP_KINDS)
def test_a_planted_fault_is_caught_with_its_kind(caught: dict[str, Caught], kind: str) -> None:
    c = caught[kind]
    report = c.report
    assert not report.ok
    # Caught once, with its kind; no other kind found but those planted beside it.
    others = {k: n for k, n in report.violations.items() if k not in c.together and n}
    assert report.violations[kind] == 1 and not others, report.summary()
    # And in the queue it was planted in, it is all the proof found (of the
    # kinds the report counts per queue: all but duplicates).
    here = report.queues[c.queue]["violations"]
    assert here.get(kind, 1) == 1, (kind, report.queues[c.queue])
    assert not {k: n for k, n in here.items() if k != kind and n}, (kind, here)
    example = report.examples[kind][0]
    for key, value in c.what.items():
        assert example[key] == value, (kind, example, c.what)
    assert kind in report.summary()


def test_verify_command_exits_non_zero_on_a_violation(
    module_dsn: str,
    stored: RunOutcome,
    verifier: Verifier,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["regress", "verify", stored.run_id, "--dsn", module_dsn, "--report-dir", str(tmp_path)]
    with planted(module_dsn, stored.run_id, "lost"):
        assert cli_main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "lost 1" in out
    assert len(list((tmp_path / stored.run_id).glob("verify-*.json"))) == 1
    # The fault is out again; the same command proves the run; the shared Spark session survives.
    assert cli_main(argv) == 0
    assert "PASS" in capsys.readouterr().out
    assert verifier.spark.range(1).count() == 1
    assert cli_main(["regress", "verify", "nosuchrun", "--dsn", module_dsn]) == 4


def _regress_argv(dsn: str, reports: Path, run_id: str) -> list[str]:
    return ["regress", "--dsn", dsn, "--run-id", run_id, "--cycles", "1", "--capacity", "16",
            "--entries-per-queue", "60", "--producers", "2", "--payload-sizes", "16,2000",
            "--seed", "7", "--spark-master", "local[2]", "--report-dir", str(reports)]


def test_regress_command_exits_by_its_proof(
    module_dsn: str, stored: RunOutcome, verifier: Verifier, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """``ringq regress`` itself (workload, then Spark, in one command): 0 when the
    cycle is proven, 1 when the proof finds a violation (a received row deleted
    between the workload and the proof)."""
    from ringq.regression import _runner

    clean = f"clean_{secrets.token_hex(3)}"
    assert cli_main(_regress_argv(module_dsn, tmp_path, clean)) == 0
    out = capsys.readouterr()
    assert "PASS" in out.out and "all proven" in out.err, out

    real = vars(_runner)["run_cycle"]  # the name _runner calls, patched below

    def losing_one(dsn: str, info: Any, cycle: int, **kw: Any) -> Any:
        result = real(dsn, info, cycle, **kw)
        with psycopg.connect(dsn, autocommit=True) as conn:
            gone = conn.execute(
                sql.SQL(
                    "DELETE FROM {t} WHERE ctid = "
                    "(SELECT ctid FROM {t} ORDER BY recv_order LIMIT 1 OFFSET 3) "
                    "RETURNING qseq"
                ).format(t=_received(info.run_id, info.queues[1].name))
            ).fetchone()
        assert gone is not None
        return result

    monkeypatch.setattr(_runner, "run_cycle", losing_one)
    lossy = f"lossy_{secrets.token_hex(3)}"
    assert cli_main(_regress_argv(module_dsn, tmp_path, lossy)) == 1
    out = capsys.readouterr()
    assert "FAIL" in out.out and "lost 1" in out.out and "1 failed" in out.err, out
    assert load_run(module_dsn, lossy).status == "failed"
    assert json.loads((tmp_path / lossy / "cycle-1.json").read_text())["violations"]["lost"] == 1
    assert verifier.spark.range(1).count() == 1  # the module's Spark session survived both


# -- the command: stop and abort by signal (real processes, no Spark) -----------------------------


def _start_regress(dsn: str, tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, RINGQ_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "ringq.cli", "regress", "--dsn", dsn, "--cycles", "0", "--no-verify",
         "--capacity", "32", "--entries-per-queue", "150", "--payload-sizes", "16,2000", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _wait_for(proc: subprocess.Popen[str], text: str) -> list[str]:
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"{text!r} never appeared: {''.join(seen)}")


def _signalled(
    dsn: str, tmp_path: Path, signals: list[tuple[str, signal.Signals]], timeout: float,
    *extra: str,
) -> tuple[int, str]:
    """Start the command (:func:`_start_regress`) and send each signal once
    its text appeared on stderr: the exit code and the rest of stderr, within
    ``timeout`` s (killed, whatever happened; the section removed)."""
    proc = _start_regress(dsn, tmp_path, *extra)
    try:
        for text, sig in signals:
            _wait_for(proc, text)
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    remove_section(dsn)
    return proc.returncode, err


def test_sigterm_stops_after_the_current_cycle(dsn: str, tmp_path: Path) -> None:
    code, err = _signalled(dsn, tmp_path, [("regress: cycle 1", signal.SIGTERM)], 120)
    assert code == 0, err
    assert "cycle 1: workload done" in err and "stopped after 1 cycle(s)" in err, err
    assert "cycle 2:" not in err


def test_second_signal_aborts_the_cycle(dsn: str, tmp_path: Path) -> None:
    code, err = _signalled(
        dsn, tmp_path,
        [("regress: cycle 1", signal.SIGINT), ("stopping after this cycle", signal.SIGINT)], 60,
        "--entries-per-queue", "100000",
    )
    assert code == 130, err
    assert "cycle 1: workload aborted" in err and "aborted after 1 cycle(s)" in err, err
    with psycopg.connect(dsn) as conn:
        # Nothing of the run is left in doubt or queued: the aborted workers' transactions
        # rolled back and the run's queues were dropped.
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM ringq.queues").fetchone() == (0,)


# -- small pieces -------------------------------------------------------------------------------


def test_payload_carries_header_and_checksum() -> None:
    for size in (MIN_PAYLOAD, 17, 44, 2000):
        p = P.build(P.KIND_TWO_PHASE, 3, 4, 99, size)
        assert len(p) == size and P.intact(p)
        h = P.parse(p)
        assert h == P.Header(P.KIND_TWO_PHASE, 3, 4, 99, size)
        broken = bytearray(p)
        broken[size // 2] ^= 0x80
        assert not P.intact(bytes(broken))
    with pytest.raises(ConfigError):
        RegressConfig(payload_sizes=(MIN_PAYLOAD - 1,))
    assert parse_sizes("16, 2k,200K,1m") == (16, 2000, 200000, 1000000)


def test_grouped_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="grouped_consumers"):
        RegressConfig(grouped_consumers=-1)
    with pytest.raises(ConfigError, match="groups"):
        RegressConfig(groups=0)
    cfg = RegressConfig(payload_sizes=(200, 16, 2000), grouped_consumers=4, groups=7)
    assert cfg.queues == 4 and RegressConfig.from_json(cfg.to_json()) == cfg
    assert RegressConfig(grouped_consumers=0).queues == len(SIZES)
    # A run stored before the grouped queue existed had none.
    old = {k: v for k, v in cfg.to_json().items() if k not in ("grouped_consumers", "groups")}
    assert not RegressConfig.from_json(old).grouped
    assert cli_main(["regress", "--groups", "0", "--dsn", "postgresql://nowhere.invalid/x"]) == 2
    with pytest.raises(ConfigError, match="sql_consumers"):
        RegressConfig(sql_consumers=-1)
    sqlc = RegressConfig(sql_consumers=3)
    assert sqlc.timed and not RegressConfig().timed
    assert RegressConfig.from_json(sqlc.to_json()) == sqlc
    assert RegressConfig.from_json(old).sql_consumers == 0  # runs stored before it existed
    assert (
        cli_main(["regress", "--sql-consumers", "-1", "--dsn", "postgresql://nowhere.invalid/x"])
        == 2
    )


def test_chaos_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="chaos_interval"):
        RegressConfig(chaos=True, chaos_interval=(2.0, 1.0))
    with pytest.raises(ConfigError, match="needs chaos"):
        RegressConfig(chaos_pg_restart=True)
    cfg = RegressConfig(chaos=True, chaos_interval=(0.5, 1.5), chaos_pg_restart=True)
    assert RegressConfig.from_json(cfg.to_json()) == cfg
    assert (
        cli_main(["regress", "--chaos-pg-restart", "--dsn", "postgresql://nowhere.invalid/x"]) == 2
    )


def test_a_cycle_under_chaos_is_proven(dsn: str, verifier: Verifier, tmp_path: Path) -> None:
    """kill -9 of producers, consumers and the monitor, and a PostgreSQL restart,
    during one small cycle: the workers are restarted, resume from the database,
    and the proof still passes."""
    config = RegressConfig(
        payload_sizes=SIZES,
        capacity=64,
        # Every kind of kill and the restart come in the first four chaos
        # events (0.2-0.5 s apart): 250 entries a queue keep the producers
        # at it for several seconds more.
        entries_per_queue=250,
        producers=5,
        two_phase_rate=0.4,
        seed=20261123,
        chaos=True,
        chaos_interval=(0.2, 0.5),
        chaos_pg_restart=True,
    )
    _outcome, result, report = proven_cycle(dsn, config, verifier, tmp_path)
    assert report.counts["committed"] == report.counts["delivered"] == QUEUES * 250
    assert report.groups["order_breaks"] == report.groups["in_flight_twice"] == 0
    chaos = result.stats["chaos"]
    assert chaos["producers"] > 0 and chaos["consumers"] > 0 and chaos["monitor"] > 0, chaos
    assert chaos["pg_restarts"] == 1 and not chaos["errors"], chaos
    assert chaos["resumed"] > 0 and chaos["reconnects"] > 0, chaos
    assert report.chaos["producers"] == chaos["producers"] and report.chaos["pg_restarts"] == 1
    assert re.search(
        r"chaos +producers \d+  consumers \d+  monitor \d+  pg restarts 1", report.summary()
    )
    saved = json.loads(Path(report.path or "").read_text())
    assert saved["chaos"]["monitor"] == chaos["monitor"]
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_prepared_xacts").fetchone() == (0,)


# -- SQL consumers (ringq.dequeue from plain connections) beside the linked ones ------------------


def _taken_by_worker(dsn: str, outcome: RunOutcome) -> dict[str, dict[int, int]]:
    """Received rows per queue and worker (linked consumers first, then SQL ones)."""
    info = load_run(dsn, outcome.run_id)
    out: dict[str, dict[int, int]] = {}
    with psycopg.connect(dsn) as conn:
        for ref in info.queues:
            rows = conn.execute(
                sql.SQL("SELECT worker, count(*) FROM {}.{} GROUP BY worker").format(
                    S.schema_of(outcome.run_id), S.received_table(ref.name)
                )
            ).fetchall()
            out[ref.name] = {int(w): int(n) for w, n in rows}
    return out


def test_a_cycle_with_sql_consumers_is_proven(
    dsn: str, verifier: Verifier, tmp_path: Path
) -> None:
    """Two SQL consumers (plain psycopg, ringq.dequeue), one on the grouped
    (shared) queue, one on the first single-mode queue, beside the linked
    ones: the cycle runs the monitor their agent needs, and the proof holds
    across both kinds (exactly once, order per producer and per group)."""
    sizes = (16, 200, 2000)
    config = RegressConfig(
        payload_sizes=sizes, capacity=64, entries_per_queue=300, producers=4,
        seed=20261126, grouped_consumers=2, groups=20, sql_consumers=2,
        consumer_rollback_rate=0.05,
    )
    taken: dict[str, dict[int, int]] = {}
    _outcome, result, report = proven_cycle(
        dsn, config, verifier, tmp_path, then=lambda o: taken.update(_taken_by_worker(dsn, o))
    )
    queues = len(sizes) + 1
    assert report.counts["committed"] == report.counts["delivered"] == queues * 300
    sqls = result.stats["sql_consumers"]
    assert sqls["processes"] == 2 and sqls["committed_entries"] > 0, sqls
    assert sqls["committed_tx"] > 0 and sqls["empty_takes"] > 0, sqls
    # What the SQL consumers counted is what Spark found they took, once each.
    assert report.counts["delivered_sql"] == sqls["committed_entries"]
    linked = result.stats["consumers"]["committed_entries"]
    assert linked + sqls["committed_entries"] == queues * 300
    # The SQL consumers took entries of their queues only: the grouped queue's
    # (its worker after the two linked ones) and the first queue's (after its
    # one), and the single queue's took some (turns between the kinds). On the
    # grouped queue it may get none: two linked consumers taking a batch each
    # can hold all 20 groups between them all the time (one entry of a group
    # held anywhere), which a loaded machine made happen once.
    names = [q["name"] for q in report.queues]
    assert taken[names[0]].get(1, 0) > 0, taken
    assert set(taken[names[-1]]) <= {0, 1, 2} and set(taken[names[0]]) <= {0, 1}, taken
    assert all(set(taken[n]) == {0} for n in names[1:-1]), taken
    assert report.consumers["sql"]["committed_entries"] == sqls["committed_entries"]
    assert report.consumers["linked"]["processes"] == len(sizes) + 2
    # Spark saw on the grouped queue exactly the consumers the rows say took from it.
    grouped_takers = sum(1 for n in taken[names[-1]].values() if n > 0)
    assert report.groups["sql_consumers"] == 1
    assert report.groups["consumers_seen"] == grouped_takers >= 2, (report.groups, taken)
    assert re.search(r"consumers +linked 5 x [\d,]+ entries .* sql 2 x [\d,]+ entries",
                     report.summary()), report.summary()


def test_a_cycle_with_delays_and_backoff_is_proven(
    dsn: str, verifier: Verifier, tmp_path: Path
) -> None:
    """Delayed entries (a fifth, up to 0.3 s) and a 0.05 s retry backoff on
    consumers' deliberate rollbacks, taken by linked and SQL consumers, on
    single queues and the grouped one: the proof holds (order as strict as
    ever), no delayed entry was taken before its row's due time, no
    rolled-back one again before its backoff; and an entry whose due time
    or backoff is moved past its take is caught with its kind."""
    sizes = (16, 2000)
    config = RegressConfig(
        payload_sizes=sizes, capacity=64, entries_per_queue=300, producers=3,
        seed=20261126, grouped_consumers=2, groups=10, sql_consumers=2,
        consumer_rollback_rate=0.1, delayed_share=0.2, max_delay=0.3, retry_delay=0.05,
    )
    outcome, result, report = proven_cycle(dsn, config, verifier, tmp_path)
    queues = len(sizes) + 1
    assert report.counts["committed"] == report.counts["delivered"] == queues * 300
    d, r = report.waits["delayed"], report.waits["retried"]
    # Every delayed entry's due time was read back and its one take checked.
    assert d["entries"] > 50 and d["due_read"] == d["taken"] == d["entries"], report.waits
    assert d["entries"] == result.stats["producers"]["delayed_entries"], report.waits
    assert r["entries"] > 0 and r["taken"] == r["entries"] and r["backoff_s"] == 0.05, r
    assert report.waits["delayed_after_ms"]["max"] >= 0, report.waits
    assert "taken_before_due 0" in report.summary() and "delayed " in report.summary()

    # Planted faults (an hour added to one due time, and to one backoff) are
    # caught, each with its kind, and taken out again.
    schema = sql.Identifier(S.SCHEMA_PREFIX + outcome.run_id)
    plants = {
        "taken_before_due": ("due", "not_before = not_before + interval '1 hour'",
                             "not_before = not_before - interval '1 hour'"),
        "retried_before_backoff": ("retried", "backoff = backoff + 3600",
                                   "backoff = backoff - 3600"),
    }
    planted: dict[str, tuple[Any, ...]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            for kind, (table, plant, _undo) in plants.items():
                row = conn.execute(sql.SQL(
                    "UPDATE {s}.{t} SET {plant} WHERE ctid = (SELECT min(ctid) FROM {s}.{t}) "
                    "RETURNING queue, qseq, ctid"
                ).format(s=schema, t=sql.Identifier(table), plant=sql.SQL(plant))).fetchone()
                assert row is not None
                planted[kind] = row
            caught = verify(dsn, outcome.run_id, verifier=verifier)
        finally:
            for kind, row in planted.items():
                table, _plant, undo = plants[kind]
                conn.execute(sql.SQL("UPDATE {s}.{t} SET {undo} WHERE ctid = %s").format(
                    s=schema, t=sql.Identifier(table), undo=sql.SQL(undo)), (row[2],))
    others = {k: n for k, n in caught.violations.items() if k not in plants and n}
    assert not others, caught.summary()
    for kind, row in planted.items():
        assert caught.violations[kind] == 1, caught.summary()
        example = caught.examples[kind][0]
        assert example["qseq"] == row[1] and example["after_us"] < 0, example
        assert f"{kind} 1" in caught.summary()


def test_a_cycle_with_sql_consumers_under_chaos_is_proven(
    dsn: str, verifier: Verifier, tmp_path: Path
) -> None:
    """kill -9 of SQL consumers and pg_terminate_backend of their backends (and
    of the other kinds): they resume from their rows, the takes they had open
    come back counted, and the proof still passes."""
    sizes = (16, 2000)
    config = RegressConfig(
        payload_sizes=sizes, capacity=64, entries_per_queue=400, producers=4,
        seed=20261127, grouped_consumers=2, groups=20, sql_consumers=3,
        # Kills stop when the producers are done (about a second here): the
        # first five events, one of each kind, must come before that.
        chaos=True, chaos_interval=(0.05, 0.1),
    )
    _outcome, result, report = proven_cycle(dsn, config, verifier, tmp_path)
    queues = len(sizes) + 1
    assert report.counts["committed"] == report.counts["delivered"] == queues * 400
    chaos = result.stats["chaos"]
    assert chaos["sql_consumers"] > 0 and chaos["sql_backends"] > 0, chaos
    assert not chaos["errors"], chaos
    sqls = result.stats["sql_consumers"]
    assert sqls["committed_entries"] > 0 and report.counts["delivered_sql"] > 0, sqls
    assert report.chaos["sql_backends"] == chaos["sql_backends"]
    assert re.search(r"sql consumers \d+  sql backends \d+", report.summary())


# -- chaos takes over the monitor that serves the database -----------------------------------------


def _monitor_state(data: Path) -> dict[str, Any]:
    state = json.loads((data / "monitor.json").read_text())
    assert isinstance(state, dict)
    return state


def _metrics_answer(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def test_chaos_takes_over_the_serving_monitor(
    dsn: str, verifier: Verifier, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As after ``make run``: a detached monitor serves the database (a viewer reads
    it at its port). --chaos kills that one, not a stand-in that cannot start, and
    restarts it as it was: same port and data directory, left serving afterwards."""
    from ringq.regression import ForeignMonitor
    from ringq.scripting import QueueSpec, create_queue

    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec("regress_bystander", 16, 64))  # the monitor needs the schema
    data = tmp_path / "monitor"
    env = dict(os.environ, RINGQ_HOME=str(tmp_path / "home"))
    started = subprocess.run(
        [
            sys.executable, "-m", "ringq.cli", "monitor", "--dsn", dsn, "--port", "0",
            "--data-dir", str(data), "--prepared-timeout", "2", "--log-level", "warning",
            "--detach",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert started.returncode == 0, started.stderr
    first = _monitor_state(data)
    url = first["url"]
    try:
        assert _metrics_answer(url)
        config = RegressConfig(
            payload_sizes=(16, 2000), capacity=32, entries_per_queue=300, producers=3,
            two_phase_rate=0.4, seed=20261124, chaos=True, chaos_interval=(0.2, 0.4),
        )
        # A serving monitor chaos cannot find is refused before anything is created.
        with pytest.raises(ForeignMonitor, match="--monitor-dir"):
            run(dsn, config, cycles=1, monitor_dir=tmp_path / "elsewhere")
        argv = [
            "regress", "--dsn", dsn, "--chaos", "--no-verify",
            "--monitor-dir", str(tmp_path / "elsewhere"),
        ]
        assert cli_main(argv) == 5
        assert "a monitor serves this database" in capsys.readouterr().err
        with psycopg.connect(dsn) as conn:
            assert conn.execute(
                "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'regress\\_%'"
            ).fetchone() == (0,)

        outcome = run(
            dsn, config, cycles=1, verifier=verifier, report_dir=tmp_path, monitor_dir=data
        )
        result = outcome.results[0]
        assert result.status == "done" and not result.errors, result
        assert outcome.reports[0].ok, outcome.reports[0].summary()
        chaos = result.stats["chaos"]
        assert chaos["monitor_taken_over"] and chaos["monitor"] >= 1, chaos
        assert chaos["monitor_starts"] == chaos["monitor"] and not chaos["errors"], chaos
        # The monitor serving now is a new process, at the same address, in the same directory.
        now = _monitor_state(data)
        assert now["pid"] != first["pid"] and pid_alive(now["pid"]) and not pid_alive(first["pid"])
        assert now["url"] == url == chaos["monitor_url"]
        assert _metrics_answer(url)
        with psycopg.connect(dsn, autocommit=True) as conn:
            holder = conn.execute(S.MONITOR_LOCK_HOLDER).fetchone()
        assert holder is not None and holder[1] == "ringq-monitor"
    finally:
        pid = _monitor_state(data)["pid"] if (data / "monitor.json").exists() else first["pid"]
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        remove_section(dsn)
