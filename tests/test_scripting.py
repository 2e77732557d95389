"""Queue scripting: the psql script, ``ringq script``/``ringq queue``, the SQL enqueue function.

Everything runs against the suite's own PostgreSQL (``dsn``: a fresh database
per test). Most CLI cases call :func:`ringq.cli.main` in-process (the same code
as the command, without an interpreter start per case); the cases about the
installed command itself (pipes into psql, stdin, the environment) run it as a
subprocess.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import cli, closed_port
from psycopg import sql
from ringq.cluster import Cluster
from ringq.engine import MAX_CAPACITY, ConfigError, InvalidQueueName, QueueExists, QueueNotFound
from ringq.engine.layout import MAX_QUEUES, Q_LEASE_MS, SLOT_POOL
from ringq.scripting import (
    QueueSpec,
    create_queue,
    create_queue_script,
    create_schema,
    describe_queue,
    list_queues,
)

RINGQ = [sys.executable, "-m", "ringq.cli"]
BAD_NAMES = ["Orders", "1x", "", "a" * 49, "a-b", "a;drop"]
BAD_NUMBERS = [
    ("capacity", 0),
    ("capacity", -1),
    ("capacity", MAX_CAPACITY + 1),
    ("max_payload", 0),
    ("fillfactor", 5),
]


# Helpers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def psql(pg_cluster: Cluster) -> str:
    return shutil.which("psql") or str(pg_cluster.bindir / "psql")


def run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, **kw)


def apply_script(psql: str, dsn: str, script: str) -> subprocess.CompletedProcess[str]:
    return run([psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", dsn], input=script, stdin=None)


def spec_args(name: str, capacity: int, max_payload: int, *extra: str) -> list[str]:
    return [name, "--capacity", str(capacity), "--max-payload", str(max_payload), *extra]


def fingerprint(dsn: str) -> dict[str, Any]:
    """What a second apply must not change: relations (and their files),
    constraints, function definitions, and every table's rows and sequences'
    positions in the ringq schema."""
    with psycopg.connect(dsn) as conn:
        relations = conn.execute(
            """SELECT c.relname, c.relkind, c.relfilenode, c.reloptions::text,
                      coalesce(t.spcname, '')
               FROM pg_class c
               LEFT JOIN pg_tablespace t ON t.oid = c.reltablespace
               WHERE c.relnamespace = 'ringq'::regnamespace
               ORDER BY c.relname"""
        ).fetchall()
        fp: dict[str, Any] = {
            "relations": relations,
            "constraints": conn.execute(
                """SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
                   FROM pg_constraint WHERE connamespace = 'ringq'::regnamespace
                   ORDER BY 1, 2"""
            ).fetchall(),
            "functions": conn.execute(
                """SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
                   FROM pg_proc p WHERE p.pronamespace = 'ringq'::regnamespace
                   ORDER BY 1"""
            ).fetchall(),
            "queues": conn.execute("SELECT * FROM ringq.queues ORDER BY id").fetchall(),
        }
        for name, kind, *_ in relations:
            ident = sql.Identifier("ringq", name)
            if kind == "r":
                fp[name] = conn.execute(
                    sql.SQL(
                        "SELECT count(*), "
                        "md5(coalesce(string_agg(t::text, '|' ORDER BY t::text), ''))"
                        " FROM {} AS t"
                    ).format(ident)
                ).fetchone()
            elif kind == "S":
                fp[name] = conn.execute(
                    sql.SQL("SELECT last_value, is_called FROM {}").format(ident)
                ).fetchone()
    return fp


def ring_slots(dsn: str, name: str) -> list[tuple[int, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT slot, state FROM {} ORDER BY slot").format(
                sql.Identifier("ringq", f"q_{name}")
            )
        ).fetchall()
    return [(slot, state) for slot, state in rows]


# The psql script -------------------------------------------------------------


def test_script_applies_to_empty_database_and_again_without_change(dsn: str, psql: str) -> None:
    spec = QueueSpec(
        "orders",
        capacity=1000,
        max_payload=512,
        fillfactor=70,
        tablespace="pg_default",
        exception_queue="orders_dead",
        max_deliveries=5,
        full_policy="raise",
        full_timeout=2.5,
        dequeue_mode="shared",
    )
    script = create_queue_script(spec)
    assert 'TABLESPACE "pg_default"' in script and 'USING INDEX TABLESPACE "pg_default"' in script

    # The exception queue must exist first (and take payloads as large).
    refused = apply_script(psql, dsn, script)
    assert refused.returncode == 3
    assert 'exception queue "orders_dead" of queue "orders" does not exist' in refused.stderr
    dead = apply_script(psql, dsn, create_queue_script(QueueSpec("orders_dead", 10, 512)))
    assert dead.returncode == 0, dead.stderr

    first = apply_script(psql, dsn, script)
    assert first.returncode == 0, first.stderr
    assert first.stderr == ""  # no notices either: "already exists, skipping" is silenced
    before = fingerprint(dsn)

    second = apply_script(psql, dsn, script)
    assert second.returncode == 0, second.stderr
    assert second.stderr == ""
    assert fingerprint(dsn) == before

    # Exactly `capacity` rows, slots 0..N-1, all free; the row holds the settings.
    assert ring_slots(dsn, "orders") == [(i, 0) for i in range(1000)]
    with psycopg.connect(dsn) as conn:
        details = describe_queue(conn, "orders")
        reloptions, spc = conn.execute(
            """SELECT c.reloptions, (SELECT spcname FROM pg_tablespace WHERE oid = c.reltablespace)
               FROM pg_class c WHERE c.oid = 'ringq.q_orders'::regclass"""
        ).fetchone() or (None, None)
    assert (details.capacity, details.max_payload, details.fillfactor) == (1000, 512, 70)
    assert (details.full_policy, details.full_timeout, details.dequeue_mode) == (
        "raise",
        2.5,
        "shared",
    )
    assert (details.max_deliveries, details.exception_queue, details.tablespace) == (
        5,
        "orders_dead",
        "pg_default",
    )
    assert reloptions == ["fillfactor=70"]
    assert spc is None  # pg_default is stored as "the database's default" (reltablespace 0)


def test_script_with_other_settings_fails_and_changes_nothing(dsn: str, psql: str) -> None:
    assert (
        apply_script(psql, dsn, create_queue_script(QueueSpec("orders", 100, 64))).returncode == 0
    )
    before = fingerprint(dsn)

    clash = apply_script(psql, dsn, create_queue_script(QueueSpec("orders", 200, 64)))
    assert clash.returncode == 3  # psql: the script stopped on an error
    assert 'queue "orders" exists with different settings' in clash.stderr
    assert fingerprint(dsn) == before


def test_issue_done_when_script_piped_to_psql_twice(dsn: str, psql: str) -> None:
    # The issue's own words, as typed: `ringq script create-queue orders
    # --capacity 1000 --max-payload 512 | psql URL`, twice. bash for pipefail
    # (the producer's status counts too); plain psql exits 0 even after an
    # error, so its stderr must be empty as well.
    pipeline = (
        'set -o pipefail; "$@" script create-queue orders --capacity 1000 --max-payload 512'
        ' | psql -X -q "$URL"'
    )
    path = os.pathsep.join([str(Path(psql).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "URL": dsn, "PATH": path}
    for attempt in (1, 2):
        done = run(["bash", "-c", pipeline, "bash", *RINGQ], env=env)
        assert done.returncode == 0, (attempt, done.stderr)
        assert done.stderr == "", (attempt, done.stderr)
    assert ring_slots(dsn, "orders") == [(i, 0) for i in range(1000)]
    with psycopg.connect(dsn) as conn:
        assert [q.name for q in list_queues(conn)] == ["orders"]


def fill_section(dsn: str, capacities: list[int]) -> None:
    """Management rows of these capacities, without ring tables: only the
    section budget check of the queue script reads them."""
    with psycopg.connect(dsn) as conn:
        create_schema(conn)
        with conn.transaction():
            for i, capacity in enumerate(capacities):
                conn.execute(
                    "INSERT INTO ringq.queues (name, capacity, max_payload) VALUES (%s, %s, 1)",
                    (f"filler_{i}", capacity),
                )


def test_queue_that_does_not_fit_in_the_section_is_refused(
    dsn: str, psql: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two full-size queues but 64 slots: exactly one more 64-slot share fits.
    fill_section(dsn, [MAX_CAPACITY, SLOT_POOL - MAX_CAPACITY - 64])
    code, out, err = cli(capsys, "queue", "create", *spec_args("last", 64, 8), "--dsn", dsn)
    assert (code, err) == (0, ""), err
    before = fingerprint(dsn)

    code, out, err = cli(capsys, "queue", "create", *spec_args("one", 1, 8), "--dsn", dsn)
    assert code == 2 and out == ""
    assert err.startswith(
        "ringq: queue \"one\" does not fit in the global section: it needs 64 slots, "
        f"{SLOT_POOL} of {SLOT_POOL} are taken (0 free); drop a queue first"
    ), err
    # The reviewed script carries the same check: psql stops on it.
    refused = apply_script(psql, dsn, create_queue_script(QueueSpec("one", 1, 8)))
    assert refused.returncode == 3
    assert 'queue "one" does not fit in the global section' in refused.stderr
    assert fingerprint(dsn) == before  # nothing made by either attempt

    # A queue that is already there is not counted twice: still idempotent.
    code, out, err = cli(capsys, "queue", "create", *spec_args("last", 64, 8), "--dsn", dsn)
    assert (code, out) == (0, "queue 'last' exists (unchanged)\n"), err
    assert apply_script(psql, dsn, create_queue_script(QueueSpec("last", 64, 8))).returncode == 0


def test_queue_beyond_the_section_queue_count_is_refused(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fill_section(dsn, [1] * (MAX_QUEUES - 1))
    code, _, err = cli(capsys, "queue", "create", *spec_args("last", 1, 8), "--dsn", dsn)
    assert (code, err) == (0, "")
    code, out, err = cli(capsys, "queue", "create", *spec_args("one", 1, 8), "--dsn", dsn)
    assert code == 2 and out == ""
    assert err.startswith(
        f"ringq: queue \"one\" does not fit in the global section: {MAX_QUEUES} queues exist, "
        f"{MAX_QUEUES} at most"
    ), err


# Refused input -----------------------------------------------------------------


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidQueueName, match="invalid queue name"):
        QueueSpec(name, 10, 10)
    # The command refuses before it needs a database (none is reachable here).
    for command in (["script", "create-queue"], ["queue", "create", "--dsn", "host=/nonexistent"]):
        code, out, err = cli(capsys, *command, *spec_args(name, 10, 10))
        assert code == 2, (command, err)
        assert out == ""
        assert f"ringq: invalid queue name {name!r}" in err


@pytest.mark.parametrize(("field", "value"), BAD_NUMBERS)
def test_bad_numbers_are_refused(
    field: str, value: int, capsys: pytest.CaptureFixture[str]
) -> None:
    settings: dict[str, Any] = {"capacity": 10, "max_payload": 10, field: value}
    with pytest.raises(ConfigError, match=rf"^{field} must be an integer from"):
        QueueSpec("q", **settings)
    option = "--" + field.replace("_", "-")
    argv = [*spec_args("q", 10, 10), f"{option}={value}"]
    code, out, err = cli(capsys, "script", "create-queue", *argv)
    assert code == 2, err
    assert out == ""
    assert err.startswith(f"ringq: {field} must be an integer from ")
    assert f"not {value}" in err


def test_exception_queue_and_tablespace_are_validated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="its own exception queue"):
        QueueSpec("q", 10, 10, exception_queue="q")
    for bad in ("", "a" * 64, "é" * 32, "fast\nssd"):
        with pytest.raises(ConfigError, match=r"^invalid tablespace name"):
            QueueSpec("q", 10, 10, tablespace=bad)
    code, out, err = cli(
        capsys, "script", "create-queue", *spec_args("q", 10, 10, "--tablespace", "a" * 64)
    )
    assert (code, out) == (2, "")
    assert err.startswith(f"ringq: invalid tablespace name {'a' * 64!r}: a PostgreSQL identifier")
    code, _, err = cli(
        capsys, "script", "create-queue", *spec_args("q", 10, 10, "--full-policy", "drop")
    )
    assert code == 2 and "invalid choice" in err  # argparse's own refusal


def test_tablespace_is_any_identifier_always_quoted(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not the queue-name rule: capitals, a leading digit, 63 bytes are fine.
    for name in ("Fast_SSD", "1st", "a" * 63, "é" * 31):
        assert QueueSpec("q", 10, 10, tablespace=name).tablespace == name
    code, out, err = cli(
        capsys, "script", "create-queue", *spec_args("q", 10, 10, "--tablespace", "Fast_SSD")
    )
    assert (code, err) == (0, "")
    assert 'TABLESPACE "Fast_SSD"' in out and 'USING INDEX TABLESPACE "Fast_SSD"' in out
    # Whatever it holds, it stays one quoted identifier.
    script = create_queue_script(QueueSpec("q", 10, 10, tablespace='x"; DROP TABLE t; --'))
    assert 'TABLESPACE "x""; DROP TABLE t; --"' in script
    # One that does not exist is PostgreSQL's to refuse, by its name; nothing is made.
    code, out, err = cli(
        capsys, "queue", "create", *spec_args("q", 10, 10, "--tablespace", "Fast_SSD"), "--dsn", dsn
    )
    assert code != 0 and out == ""
    assert 'tablespace "Fast_SSD" does not exist' in err, err
    with psycopg.connect(dsn) as conn:
        assert list_queues(conn) == []


# ringq queue create|list|show|drop ----------------------------------------------


def test_queue_create_is_idempotent_and_refuses_other_settings(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(capsys, "queue", "create", *spec_args("orders", 50, 128), "--dsn", dsn)
    assert (code, err) == (0, "")
    assert out.startswith("created queue 'orders'")

    code, out, err = cli(capsys, "queue", "create", *spec_args("orders", 50, 128), "--dsn", dsn)
    assert (code, err) == (0, "")
    assert out == "queue 'orders' exists (unchanged)\n"

    for other in (
        spec_args("orders", 51, 128),
        spec_args("orders", 50, 128, "--dequeue-mode", "shared"),
    ):
        code, out, err = cli(capsys, "queue", "create", *other, "--dsn", dsn)
        assert code == 5, err
        assert err == "ringq: queue 'orders' exists with different settings\n"

    with psycopg.connect(dsn) as conn, pytest.raises(QueueExists):
        create_queue(conn, QueueSpec("orders", 50, 256))
    assert len(ring_slots(dsn, "orders")) == 50  # untouched by the refused attempts


def test_concurrent_creators_exactly_one_reports_created(dsn: str) -> None:
    spec = QueueSpec("race", 16, 16)
    results: dict[str, bool | BaseException] = {}
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        with first.transaction():
            results["first"] = create_queue(first, spec)  # holds the DDL lock until commit

            def other() -> None:
                try:
                    results["second"] = create_queue(second, spec)
                except BaseException as exc:
                    results["second"] = exc

            thread = threading.Thread(target=other)
            thread.start()
            _wait_for_advisory_waiter(dsn)
        thread.join(timeout=30)
    assert results == {"first": True, "second": False}
    assert len(ring_slots(dsn, "race")) == 16


def _wait_for_advisory_waiter(dsn: str, timeout: float = 10.0) -> None:
    """Return once some session waits on an advisory lock (the DDL lock)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ).fetchone()
            if row and row[0]:
                return
            time.sleep(0.01)  # polling a condition, not timing a race
    raise AssertionError("the second creator never waited on the DDL lock")


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "5"])
def test_bad_leases_are_refused(value: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"^lease must be a number of seconds from 0 to"):
        QueueSpec("q", 10, 10, lease=value)
    if isinstance(value, float):
        code, out, err = cli(
            capsys, "script", "create-queue", *spec_args("q", 10, 10, f"--lease={value}")
        )
        assert (code, out) == (2, "")
        assert err.startswith("ringq: lease must be a number of seconds from 0 to ")


def test_lease_is_a_queue_setting_read_by_sessions_and_shown(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringq.engine import DEFAULT_LEASE, connect

    code, _, err = cli(
        capsys, "queue", "create", *spec_args("leased", 8, 64, "--lease", "2.5"), "--dsn", dsn
    )
    assert code == 0, err
    code, out, _ = cli(capsys, "queue", "show", "leased", "--dsn", dsn)
    shown = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    assert shown["lease"] == "2.5 s"
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec("plain", 8, 64))
        create_queue(conn, QueueSpec("unleased", 8, 64, lease=0))
        assert describe_queue(conn, "unleased").lease == 0
    with connect(dsn) as s:
        assert s.queue_info("leased").lease == 2.5
        assert s.queue_info("plain").lease == DEFAULT_LEASE == 300.0
        ring = s.ring("leased")
        assert s.section.q(ring.qidx, Q_LEASE_MS) == 2500  # the monitor reads it there
    # A different lease is a different queue: refused, as any other setting.
    with psycopg.connect(dsn) as conn, pytest.raises(QueueExists):
        create_queue(conn, QueueSpec("leased", 8, 64, lease=3.0))


def test_a_schema_made_before_the_lease_column_still_works_and_gets_it(dsn: str) -> None:
    from ringq.engine import connect

    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec("old", 8, 64))
        conn.execute("ALTER TABLE ringq.queues DROP COLUMN lease")  # as made by older code
        conn.commit()
    with connect(dsn) as s:
        assert s.queue_info("old").lease == 300.0  # the default, read without the column
        s.enqueue("old", b"x")
        s.commit()
        msg = s.dequeue("old")
        assert msg is not None and msg.payload == b"x"
        s.commit()
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec("old", 8, 64))  # the schema block adds the column back
        assert describe_queue(conn, "old").lease == 300.0


def test_queue_list_show_and_drop(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "queue", "list", "--dsn", dsn)
    assert (code, out) == (0, "no queues\n")  # not even a schema yet
    code, out, _ = cli(capsys, "queue", "list", "--json", "--dsn", dsn)
    assert json.loads(out) == []

    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec("alpha", 8, 100, dequeue_mode="shared", full_policy="raise"))
        create_queue(conn, QueueSpec("beta", 1200, 4096, tablespace="pg_default"))
        with conn.transaction():
            conn.execute("SELECT ringq.enqueue('alpha', 'one'::bytea)")
            conn.execute("SELECT ringq.enqueue('alpha', 'two'::bytea)")

    code, out, _ = cli(capsys, "queue", "list", "--dsn", dsn)
    assert code == 0
    assert out.splitlines() == [
        "NAME   CAPACITY  DEPTH  MAX PAYLOAD  MODE    POLICY",
        "alpha         8      2          100  shared  raise",
        "beta       1200      0         4096  single  block",
    ]
    code, out, _ = cli(capsys, "queue", "list", "--json", "--dsn", dsn)
    assert json.loads(out) == [
        {
            "name": "alpha",
            "capacity": 8,
            "depth": 2,
            "max_payload": 100,
            "dequeue_mode": "shared",
            "full_policy": "raise",
        },
        {
            "name": "beta",
            "capacity": 1200,
            "depth": 0,
            "max_payload": 4096,
            "dequeue_mode": "single",
            "full_policy": "block",
        },
    ]

    code, out, _ = cli(capsys, "queue", "show", "alpha", "--dsn", dsn)
    assert code == 0
    shown = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    assert shown["capacity"] == "8 slots"
    assert shown["max payload"] == "100 bytes"
    assert shown["depth"] == "2 (ring 0 + inbox 2)"
    assert shown["inbox"] == "2"
    assert shown["exceptions"] == "0"
    assert shown["slots"] == "8 free, 0 queued, 0 consumed"
    assert shown["full policy"] == "raise" and shown["dequeue mode"] == "shared"
    code, out, _ = cli(capsys, "queue", "show", "beta", "--json", "--dsn", dsn)
    details = json.loads(out)
    assert (details["capacity"], details["free"], details["tablespace"]) == (
        1200,
        1200,
        "pg_default",
    )
    assert details["table_bytes"] > 0

    # drop: not on a terminal without --yes; an interactive "no" keeps it.
    refused = run([*RINGQ, "queue", "drop", "alpha", "--dsn", dsn])
    assert refused.returncode == 2
    assert "without --yes" in refused.stderr
    code, out, _ = cli_with_stdin(capsys, "n\n", "queue", "drop", "alpha", "--dsn", dsn)
    assert code == 1 and out.endswith("not dropped\n")
    assert "with 2 waiting entries" in out

    code, out, _ = cli_with_stdin(capsys, "y\n", "queue", "drop", "alpha", "--dsn", dsn)
    assert code == 0 and out.endswith("dropped queue 'alpha'\n")
    code, out, _ = cli(capsys, "queue", "drop", "beta", "--yes", "--dsn", dsn)
    assert (code, out) == (0, "dropped queue 'beta'\n")
    with psycopg.connect(dsn) as conn:
        assert list_queues(conn) == []
        left = conn.execute(
            """SELECT (SELECT count(*) FROM ringq.inbox),
                      (SELECT count(*) FROM pg_class WHERE relname IN ('q_alpha', 'q_beta'))"""
        ).fetchone()
    assert left == (0, 0)


class _TtyInput(io.StringIO):
    def isatty(self) -> bool:
        return True


def cli_with_stdin(
    capsys: pytest.CaptureFixture[str], answer: str, *argv: str
) -> tuple[int, str, str]:
    saved = sys.stdin
    sys.stdin = _TtyInput(answer)
    try:
        return cli(capsys, *argv)
    finally:
        sys.stdin = saved


def test_unknown_queue_show_and_drop_exit_4(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    for _ in ("no schema", "schema, other queue"):
        for argv in (["show", "nosuch"], ["drop", "nosuch", "--yes"], ["drop", "nosuch"]):
            code, out, err = cli(capsys, "queue", *argv, "--dsn", dsn)
            assert code == 4, (argv, err)
            assert out == ""
            assert "ringq: queue 'nosuch' does not exist" in err
        with psycopg.connect(dsn) as conn:
            create_queue(conn, QueueSpec("other", 4, 4))
    with psycopg.connect(dsn) as conn, pytest.raises(QueueNotFound):
        describe_queue(conn, "nosuch")


def test_unreachable_dsn_exits_3_naming_it_without_password(tmp_path: Path) -> None:
    port = closed_port()
    url = f"postgresql://ringq:s3cretpw@127.0.0.1:{port}/ringq"
    keyword = f"host=127.0.0.1 port={port} user=ringq password=s3cretpw dbname=ringq"
    env = {**os.environ, "RINGQ_HOME": str(tmp_path)}
    env.pop("RINGQ_DSN", None)
    cases = [
        (["queue", "list", "--dsn", url], env, f"postgresql://ringq:***@127.0.0.1:{port}/ringq"),
        (["queue", "show", "q", "--dsn", keyword], env, keyword.replace("s3cretpw", "***")),
        (["queue", "create", *spec_args("q", 10, 10)], {**env, "RINGQ_DSN": url}, ":***@"),
    ]
    for argv, case_env, shown in cases:
        done = run([*RINGQ, *argv], env=case_env)
        assert done.returncode == 3, done.stderr
        assert done.stdout == ""
        assert done.stderr.startswith("ringq: database unavailable at ")
        assert shown in done.stderr
        assert "s3cretpw" not in done.stderr


def test_no_dsn_anywhere_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RINGQ_DSN", raising=False)
    monkeypatch.setenv("RINGQ_HOME", str(tmp_path))
    code, _, err = cli(capsys, "queue", "list")
    assert code == 3
    assert "ringq db start" in err


def test_unparsable_dsn_is_a_usage_error_and_not_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "queue", "list", "--dsn", "host=localhost password s3cretpw")
    assert code == 2
    assert err.startswith("ringq: invalid DSN")
    assert "s3cretpw" not in err


# The SQL API ---------------------------------------------------------------------


def test_sql_enqueue_inserts_to_inbox_and_rejects_bad_input(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_queue(conn, QueueSpec("q", 4, 8))
        qid = conn.execute("SELECT id FROM ringq.queues WHERE name = 'q'").fetchone()
        first = conn.execute("SELECT ringq.enqueue('q', %b)", (b"12345678",)).fetchone()
        second = conn.execute("SELECT ringq.enqueue('q', %b)", (b"\x00",)).fetchone()
        assert first and second and second[0] > first[0]
        rows = conn.execute(
            "SELECT id, queue_id, payload, producer FROM ringq.inbox ORDER BY id"
        ).fetchall()
        assert [(r[0], r[1], bytes(r[2])) for r in rows] == [
            (first[0], qid[0] if qid else None, b"12345678"),
            (second[0], qid[0] if qid else None, b"\x00"),
        ]
        assert all(r[3].startswith("sql:") for r in rows)
        assert conn.execute("SELECT ringq.depth('q')").fetchone() == (2,)
        assert ring_slots(dsn, "q") == [(i, 0) for i in range(4)]  # the ring is not touched

        with pytest.raises(
            psycopg.errors.StringDataRightTruncation, match='exceeds queue "q" max_payload 8'
        ):
            conn.execute("SELECT ringq.enqueue('q', %b)", (b"123456789",))
        with pytest.raises(psycopg.errors.UndefinedObject, match='queue "nope" does not exist'):
            conn.execute("SELECT ringq.enqueue('nope', 'x'::bytea)")
        with pytest.raises(psycopg.errors.NullValueNotAllowed, match="must not be NULL"):
            conn.execute("SELECT ringq.enqueue('q', NULL)")
        with pytest.raises(psycopg.errors.UndefinedObject):
            conn.execute("SELECT ringq.depth('nope')")

        # Transactional: a rolled-back enqueue leaves nothing behind.
        with pytest.raises(_Rollback), conn.transaction():
            conn.execute("SELECT ringq.enqueue('q', 'gone'::bytea)")
            raise _Rollback
        assert conn.execute("SELECT count(*) FROM ringq.inbox").fetchone() == (2,)


class _Rollback(Exception):
    pass
