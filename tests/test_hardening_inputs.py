"""Input hardening: settings the section cannot hold, bad HTTP parameters,
secrets in logs, CLI errors without tracebacks, SQLSTATE mapping, DSN
redaction and parsing, shared memory left behind.

Each test here failed before the change it guards.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import MonitorProcess, cli, present
from ringq.cli import main
from ringq.cluster import Cluster
from ringq.engine import (
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    InvalidArgument,
    InvalidArgumentType,
    RingqError,
    Section,
    StatementRejected,
    TransactionConflict,
    TransactionError,
    connect,
    exits,
    from_psycopg,
    redact_dsn,
    section_name,
)
from ringq.monitor import Monitor, MonitorConfig
from ringq.rtv import Viewer, ViewerConfig
from ringq.scripting._ddl import (
    MAX_FULL_TIMEOUT,
    MAX_PAYLOAD,
    QueueSpec,
    create_queue,
    create_queue_script,
    drop_queue,
    schema_sql,
)

_SCRIPT = Path(sys.executable).with_name("ringq")
RINGQ = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ringq.cli"]


def ringq(
    *args: str, env: dict[str, str] | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RINGQ_")}
    return subprocess.run(
        [*RINGQ, *args], env={**base, **(env or {})}, capture_output=True, text=True, timeout=60,
        check=False, **kw,
    )


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(err.splitlines()) == 1, proc.stderr
    return err


def unchecked_spec(**bad: Any) -> QueueSpec:
    """A spec holding values QueueSpec refuses: what a script edited by hand says."""
    spec = QueueSpec("q_bad", 8, 64)
    for key, value in bad.items():
        object.__setattr__(spec, key, value)
    return spec


# -- 6: settings the section cannot hold ------------------------------------------------------


BAD_TIMEOUTS = [1e300, math.inf, -math.inf, math.nan, -1.0, MAX_FULL_TIMEOUT * 2]


@pytest.mark.parametrize("value", BAD_TIMEOUTS)
def test_full_timeout_beyond_the_section_is_refused_by_the_api(value: float) -> None:
    with pytest.raises(ConfigError, match="full_timeout must be a number of seconds from 0 to"):
        QueueSpec("q", 8, 64, full_timeout=value)
    # What the section stores: milliseconds in an int64 word.
    assert int(MAX_FULL_TIMEOUT * 1000) < 2**63
    assert QueueSpec("q", 8, 64, full_timeout=MAX_FULL_TIMEOUT).full_timeout == MAX_FULL_TIMEOUT


def test_full_timeout_beyond_the_section_is_a_usage_error_of_the_command(dsn: str) -> None:
    proc = ringq("queue", "create", "big_wait", "--capacity", "8", "--max-payload", "64",
                 "--full-timeout", "1e300", "--dsn", dsn)
    assert proc.returncode == 2
    assert one_line_error(proc).startswith(
        "ringq: full_timeout must be a number of seconds from 0 to"
    )
    with psycopg.connect(dsn) as conn:  # nothing made
        assert conn.execute("SELECT to_regclass('ringq.queues')").fetchone() == (None,)


@pytest.mark.parametrize(
    "bad",
    [
        {"full_timeout": 1e300},
        {"full_timeout": math.nan},
        {"full_timeout": math.inf},
        {"capacity": 1 << 23},
        {"max_payload": MAX_PAYLOAD + 1},
        {"max_deliveries": 2**40},
    ],
    ids=lambda b: "-".join(f"{k}={v}" for k, v in b.items()),
)
def test_the_generated_sql_refuses_what_the_section_cannot_hold(
    dsn: str, bad: dict[str, Any]
) -> None:
    spec = unchecked_spec(**bad)
    field = next(iter(bad))
    psql = shutil.which("psql")
    assert psql
    refused = subprocess.run(
        [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", dsn], input=create_queue_script(spec),
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert refused.returncode == 3 and f"ringq: {field} must be" in refused.stderr, refused.stderr
    with psycopg.connect(dsn) as conn:
        with pytest.raises(ConfigError, match=f"^{field} must be"):
            create_queue(conn, spec)
        # nothing made
        assert conn.execute("SELECT to_regclass('ringq.queues')").fetchone() == (None,)


def test_the_management_table_refuses_rows_the_section_cannot_hold(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(schema_sql())
        for timeout in ("NaN", "Infinity", "1e300"):
            with pytest.raises(psycopg.errors.CheckViolation, match="queues_fit_section"):
                conn.execute(
                    "INSERT INTO ringq.queues (name, capacity, max_payload, full_timeout) "
                    "VALUES ('by_hand', 8, 8, %s::double precision)",
                    (timeout,),
                )
        conn.execute(schema_sql())  # applying the schema again stays harmless


# -- 7: HTTP -------------------------------------------------------------------------------------


def _get(url: str, origin: str | None = None) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(url)
    if origin:
        req.add_header("Origin", origin)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="ringq")
    return caplog


def test_bad_history_parameters_are_400_and_the_token_is_never_logged(
    dsn: str, make_queue: Callable[..., str], tmp_path: Path, debug_logs: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q = make_queue()
    token = "tok-" + secrets.token_hex(8)
    config = MonitorConfig(dsn, port=0, interval=0.2, token=token, data_dir=tmp_path / "m")
    with Monitor(config) as m:
        base = f"{m.url}/api/history?queue={q}&token={token}"
        for bad in ("since=inf", "since=1e400", "since=-inf", "until=nan", "limit=inf",
                    "limit=1e400", "max_points=1e400", "max_points=inf", "step=inf", "since=abc"):
            assert _get(f"{base}&{bad}")[0] == 400, bad
        deadline = time.monotonic() + 10
        while _get(f"{base}&since=0")[0] != 200:  # 404 until the first sample
            assert time.monotonic() < deadline, "no sample within 10 s"
            time.sleep(0.05)
        # A bug's 500 is logged with its traceback, and the URL without its token.
        def broken(*args: Any, **kw: Any) -> None:
            raise RuntimeError("a bug")

        monkeypatch.setattr(m.documents, "history_points", broken)
        assert _get(f"{base}&since=0")[0] == 500
    assert "/api/history" in debug_logs.text and "token=***" in debug_logs.text
    assert token not in debug_logs.text


def test_cross_origin_reads_only_when_configured(
    dsn: str, make_queue: Callable[..., str], tmp_path: Path
) -> None:
    make_queue()
    with Monitor(MonitorConfig(dsn, port=0, interval=0.2, data_dir=tmp_path / "m")) as m:
        status, headers = _get(present(m.url) + "/api/queues", origin="http://evil.example")
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
    origin = "http://127.0.0.1:7481"
    config = MonitorConfig(
        dsn, port=0, interval=0.2, data_dir=tmp_path / "m2", cors_origin=origin
    )
    with Monitor(config) as m:
        status, headers = _get(present(m.url) + "/api/queues", origin=origin)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
    for bad in ("http://h/path", "ftp://h", "http://h:abc", "yes"):
        with pytest.raises(ConfigError, match="cors_origin"):
            MonitorConfig(dsn, cors_origin=bad)


def test_monitor_command_takes_the_cors_origin_from_its_option_or_variable(
    dsn: str, make_queue: Callable[..., str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, "monitor", "--help")
    flat = " ".join(out.split())  # argparse wraps lines
    assert code == 0 and "--cors-origin" in flat and "[env: RINGQ_MONITOR_CORS_ORIGIN]" in flat
    code, _, err = cli(capsys, "monitor", "--dsn", dsn, "--cors-origin", "http://h/path")
    assert code == exits.USAGE and "cors_origin" in err
    make_queue()
    origin = "http://127.0.0.1:7481"
    env = {k: v for k, v in os.environ.items() if k != "RINGQ_MONITOR_CORS_ORIGIN"}
    for name, extra, env_origin, sent in (
        ("without", (), None, None),
        ("option", ("--cors-origin", origin), None, origin),
        ("variable", (), origin, origin),
    ):
        mon = MonitorProcess(
            dsn, tmp_path / name, *extra,
            env=env if env_origin is None else {**env, "RINGQ_MONITOR_CORS_ORIGIN": env_origin},
        )
        try:
            status, headers = _get(mon.url + "/api/queues", origin=origin)
        finally:
            assert mon.stop() == exits.OK
        assert status == 200 and headers.get("Access-Control-Allow-Origin") == sent, name


def test_monitor_beyond_loopback_without_a_token_warns_and_queues_connections(
    dsn: str, make_queue: Callable[..., str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ringq.monitor import _http

    make_queue()
    caplog.set_level(logging.WARNING, logger="ringq")
    with Monitor(MonitorConfig(dsn, host="0.0.0.0", port=0, interval=0.2, data_dir=tmp_path / "m")):
        pass
    assert "beyond loopback, without a token" in caplog.text
    caplog.clear()
    with Monitor(MonitorConfig(dsn, port=0, interval=0.2, data_dir=tmp_path / "m")):
        pass
    assert "without a token" not in caplog.text
    assert _http._Server.request_queue_size >= 128


def test_viewer_logs_a_malformed_request_without_its_token(
    debug_logs: pytest.LogCaptureFixture,
) -> None:
    from ringq.rtv import _server

    assert _server._Server.request_queue_size >= 128
    token = "tok-" + secrets.token_hex(8)
    with Viewer(ViewerConfig(monitor_url="http://127.0.0.1:9", token=token, port=0)) as v, \
            socket.create_connection(("127.0.0.1", v.port), timeout=5) as s:
        # Four words: "Bad request syntax ('<the request line>')", logged by the server.
        s.sendall(f"GET /?token={token} extra HTTP/1.1\r\n\r\n".encode())
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    assert "token=***" in debug_logs.text and token not in debug_logs.text


# -- 8: CLI errors and the SQLSTATE mapping ----------------------------------------------------


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad_url = "http://127.0.0.1:abc"
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (("status", "--monitor", bad_url), {}),
        (("status",), {"RINGQ_MONITOR_URL": bad_url}),
        (("rtv", "--port", "0", "--monitor", bad_url), {}),
        (("rtv", "--port", "0"), {"RINGQ_MONITOR_URL": bad_url}),
        (("rtv", "--tui"), {"RINGQ_MONITOR_URL": bad_url}),
        (("status", "--timeout", "-1"), {}),
        (("status", "--timeout", "nan"), {}),
        (("db", "start"), {"RINGQ_HOME": str(a_file / "sub")}),
        (("queue", "list", "--dsn", "postgresql://u:pw@127.0.0.1:notaport/db"), {}),
        (("queue", "list"), {"RINGQ_DSN": "postgresql://u@127.0.0.1:99999/db"}),
    ]
    for args, env in cases:
        proc = ringq(*args, env={"RINGQ_HOME": str(tmp_path / "home"), **env})
        assert proc.returncode == 2, (args, env, proc.stderr)
        err = one_line_error(proc)
        assert err.startswith("ringq: ") and "pw" not in err, err


def test_a_closed_stdout_ends_the_command_quietly(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*RINGQ, "db", "status", "--home", str(tmp_path / "none")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the first line (`| head -0`)
    with proc.stderr:
        err = proc.stderr.read()
    assert proc.wait(60) == 141
    assert err == ""


def test_sqlstates_map_to_what_a_caller_can_act_on() -> None:
    E = psycopg.errors
    cases: list[tuple[BaseException, type[RingqError]]] = [
        (psycopg.OperationalError("connection refused"), DatabaseUnavailable),
        (E.AdminShutdown("terminating connection"), DatabaseUnavailable),
        (E.CannotConnectNow("the database system is starting up"), DatabaseUnavailable),
        (E.ConnectionFailure("connection failure"), DatabaseUnavailable),
        (E.TooManyConnections("too many clients"), DatabaseUnavailable),
        (E.SerializationFailure("could not serialize"), TransactionConflict),
        (E.DeadlockDetected("deadlock detected"), TransactionConflict),
        (E.LockNotAvailable("could not obtain lock"), TransactionConflict),
        (E.ProgramLimitExceeded("index row size exceeds"), StatementRejected),
        (E.UniqueViolation("duplicate key"), StatementRejected),
        (E.NumericValueOutOfRange("out of range"), StatementRejected),
        (E.InsufficientPrivilege("permission denied"), StatementRejected),
        (E.QueryCanceled("canceling statement due to statement timeout"), DatabaseError),
    ]
    for exc, kind in cases:
        got = from_psycopg(exc)
        assert type(got) is kind, (exc, got)
    assert issubclass(TransactionConflict, TransactionError)
    assert issubclass(StatementRejected, DatabaseError)


def test_an_idempotency_key_too_long_for_its_index_is_rejected_not_unavailable(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    key = secrets.token_hex(6000)  # 12 kB, incompressible: over the btree's row limit
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.ProgramLimitExceeded) as raw:
        conn.execute("INSERT INTO ringq.keys (queue_id, key, seq) VALUES (1, %s, 0)", (key,))
    err = from_psycopg(raw.value)
    assert isinstance(err, StatementRejected) and err.sqlstate == "54000"
    assert "SQLSTATE 54000" in str(err) and "INSERT" not in str(err) and key not in str(err)
    with connect(dsn) as s:  # through the session: refused, never "unavailable" (exit 3, retried)
        with pytest.raises(RingqError) as got:
            s.enqueue(q, b"x", key=key)
            s.commit()
        assert not isinstance(got.value, DatabaseUnavailable)
        s.rollback()
        s.enqueue(q, b"y", key="short")  # the session goes on
        s.commit()


# -- 9: DSNs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "shown"),
    [
        ("postgres://postgres:p@ss@word@127.0.0.1/db", "postgres://postgres:***@127.0.0.1/db"),
        ("postgresql://u:pa/ss@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgresql://u:pw@h1:1,h2:2/db?sslmode=require", "postgresql://u:***@h1:1,h2:2/db?sslmode=require"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("host=h user=u password=p@ss@word dbname=d", "host=h user=u password=*** dbname=d"),
        ("host=h password = 'p@ss word' user=u", "host=h password = *** user=u"),
        ("postgresql://h/db?password=p@ss", "postgresql://h/db?password=***"),
        (
            "GET /api/queues?queue=a&token=s3cret HTTP/1.1",
            "GET /api/queues?queue=a&token=*** HTTP/1.1",
        ),
    ],
)
def test_redact_dsn_hides_the_whole_password(dsn: str, shown: str) -> None:
    assert redact_dsn(dsn) == shown


def test_a_malformed_dsn_is_a_config_error_before_connecting() -> None:
    for bad in ("postgresql://u:pw@127.0.0.1:notaport/db", "host=h port=0", "host=a,b port=1,2,3",
                "host=h bogus=1", "postgresql://[::1/db"):
        with pytest.raises(ConfigError, match="invalid DSN") as err:
            connect(bad)
        assert "pw" not in str(err.value)


# -- 12: shared memory left behind ------------------------------------------------------------


def _semaphores(instance: str) -> list[str]:
    prefix = "sem." + section_name(instance).lstrip("/") + "."
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(prefix))


def _instance(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT value FROM ringq.meta WHERE key = 'instance_id'").fetchone()
    assert row
    return str(row[0])


def test_queue_drop_removes_its_semaphores(
    dsn: str, make_queue: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    kept, by_api, by_cli = make_queue(), make_queue(), make_queue()
    with connect(dsn) as s:
        for q in (kept, by_api, by_cli):
            s.enqueue(q, b"x")
            s.commit()
            assert s.dequeue(q) is not None
            s.commit()
            for kind in "rs":  # as a waiting dequeuer and a blocked enqueuer make them
                s.section.semaphore(s.queue_info(q).id, kind)
        ids = {q: s.queue_info(q).id for q in (kept, by_api, by_cli)}
    instance = _instance(dsn)
    assert len(_semaphores(instance)) == 6
    with psycopg.connect(dsn, autocommit=True) as conn:
        drop_queue(conn, by_api)
    assert main(["queue", "drop", by_cli, "--yes", "--dsn", dsn]) == 0
    name = section_name(instance).lstrip("/")
    assert _semaphores(instance) == [f"sem.{name}.{ids[kept]}r", f"sem.{name}.{ids[kept]}s"]


def test_run_stop_removes_the_section_and_semaphores_of_its_database(tmp_path: Path) -> None:
    home = tmp_path / "home"
    cluster = Cluster(home)
    instance = None
    try:
        dsn = cluster.start()
        with psycopg.connect(dsn) as conn:
            create_queue(conn, QueueSpec("gone", 8, 8))
            create_queue(conn, QueueSpec("kept", 8, 8))
        with connect(dsn) as s:
            for q in ("gone", "kept"):
                s.enqueue(q, b"x")
                s.commit()
                for kind in "rs":
                    s.section.semaphore(s.queue_info(q).id, kind)
        instance = _instance(dsn)
        with psycopg.connect(dsn) as conn:  # dropped behind ringq's back: its semaphores stay
            conn.execute("DELETE FROM ringq.queues WHERE name = 'gone'")
        assert len(_semaphores(instance)) == 4
        assert os.path.exists(f"/dev/shm/{section_name(instance)[1:]}")
        proc = ringq("run", "--stop", "--home", str(home))
        assert proc.returncode == 0, proc.stderr
        assert "global section" in proc.stdout
        assert _semaphores(instance) == []
        assert not os.path.exists(f"/dev/shm/{section_name(instance)[1:]}")
        assert not cluster.status().running
    finally:
        cluster.stop()
        if instance:
            Section.unlink(instance)
            Section.unlink_semaphores(instance, [1, 2])


def test_every_numeric_queue_setting_is_bounded() -> None:
    # A new numeric setting must get its bound here, in ddl.sql's DO block and constraint.
    numeric = {f.name for f in dataclasses.fields(QueueSpec) if f.type in ("int", "float")}
    assert numeric == {
        "capacity", "max_payload", "full_timeout", "max_deliveries", "fillfactor", "lease",
        "retry_delay", "retry_factor", "retry_max",
    }
    for field in sorted(numeric):
        with pytest.raises(ConfigError, match=field):
            settings: dict[str, Any] = {"capacity": 8, "max_payload": 8, field: 2**63}
            QueueSpec("q", **settings)


@pytest.mark.parametrize(
    ("producer", "error"),
    [("a\x00b", InvalidArgument), ("\udc80", InvalidArgument), (5, InvalidArgumentType)],
)
def test_a_producer_name_postgresql_cannot_store_is_refused_before_connecting(
    producer: object, error: type[Exception]
) -> None:
    """connect(producer=) is checked before any I/O (a NUL would be cut by
    libpq or refused by psycopg at the first commit, after the slots were
    reserved); the DSN is never reached."""
    with pytest.raises(error):
        connect("postgresql://nobody@127.0.0.1:1/none", producer=producer)  # type: ignore[arg-type]
