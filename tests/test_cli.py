"""The ``ringq`` command itself: ``--help`` everywhere, ``RINGQ_*`` variables
(listed, honoured after the command line, refused clearly when malformed).

Database-free where it can be: these tests parse and print, they do not need
the embedded cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg
import pytest
from conftest import cli, closed_port
from ringq.cli import build_parser, parse_args
from ringq.cluster import Cluster
from ringq.engine import ConfigError, resolve_dsn
from ringq.move import MoveConfig
from ringq.scripting import QueueSpec, create_queue

RINGQ = [sys.executable, "-m", "ringq.cli"]
REPO = Path(__file__).resolve().parent.parent


def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RINGQ_* variable from the caller's environment leaks into a test."""
    for name in list(os.environ):
        if name.startswith("RINGQ_"):
            monkeypatch.delenv(name)


def commands(
    parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    """Every command and subcommand path of ``parser``, e.g. ("queue", "create")."""
    found: list[tuple[str, ...]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((*prefix, name))
                found.extend(commands(sub, (*prefix, name)))
    return found


# --help ------------------------------------------------------------------------------


def test_every_subcommand_help_exits_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clean_env(monkeypatch)
    paths = commands(build_parser())
    # The registered commands, and the nested actions of a few: a command that
    # failed to register would be missing here rather than failing its --help.
    for expected in (("db", "start"), ("script", "create-queue"), ("queue", "create"), ("monitor",),
                     ("status",), ("rtv",), ("worker",), ("move",), ("regress",), ("run",)):
        assert expected in paths
    for path in [(), *paths]:
        code, out, err = cli(capsys, *path, "--help")
        assert (code, err) == (0, ""), path
        assert out.startswith("usage: ringq"), path


def test_help_lists_the_environment_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clean_env(monkeypatch)
    cases = {
        ("db", "start"): ["RINGQ_HOME"],
        ("queue", "list"): ["RINGQ_DSN"],
        ("monitor",): [
            "RINGQ_DSN",
            "RINGQ_MONITOR_PORT",
            "RINGQ_MONITOR_TOKEN",
            "RINGQ_MONITOR_INTERVAL",
        ],
        ("move",): ["RINGQ_DSN", "RINGQ_MOVE_BATCH", "RINGQ_MOVE_FROM"],
        ("rtv",): ["RINGQ_RTV_PORT", "RINGQ_RTV_TOKEN"],
    }
    for path, names in cases.items():
        code, out, _ = cli(capsys, *path, "--help")
        assert code == 0
        flat = " ".join(out.split())  # argparse wraps lines
        for name in names:
            assert f"[env: {name}]" in flat, (path, name)
    _, out, _ = cli(capsys, "--help")
    assert "RINGQ_DSN" in out and "RINGQ_HOME" in out and "[env: RINGQ_...]" in out


def test_help_shows_a_variable_default_without_its_secret(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clean_env(monkeypatch)
    monkeypatch.setenv("RINGQ_MOVE_BATCH", "7")
    monkeypatch.setenv("RINGQ_DSN", "postgresql://u:s3cretpw@db.example/ringq")
    monkeypatch.setenv("RINGQ_MONITOR_TOKEN", "t0psecret")
    _, out, _ = cli(capsys, "move", "--help")
    assert "(default: 7, from RINGQ_MOVE_BATCH)" in " ".join(out.split())
    assert "postgresql://u:***@db.example/ringq" in out
    _, out, _ = cli(capsys, "monitor", "--help")
    assert "t0psecret" not in out and "s3cretpw" not in out


# RINGQ_* variables: --flag > RINGQ_* > default -----------------------------------------


def test_flag_beats_variable_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    clean_env(monkeypatch)
    assert parse_args(["move"]).batch == MoveConfig.batch
    monkeypatch.setenv("RINGQ_MOVE_BATCH", "7")
    assert parse_args(["move"]).batch == 7  # converted to the option's type
    assert parse_args(["move", "--batch", "9"]).batch == 9
    monkeypatch.setenv("RINGQ_MOVE_BATCH", "")  # empty counts as unset
    assert parse_args(["move"]).batch == MoveConfig.batch


def test_variable_is_honoured_by_a_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clean_env(monkeypatch)
    monkeypatch.chdir(tmp_path)

    def datadir(*argv: str) -> str:
        code, out, err = cli(capsys, "db", "status", *argv)
        assert code == 1 and err == ""  # nothing runs in these homes
        line = next(x for x in out.splitlines() if x.startswith("datadir"))
        return line.split(None, 1)[1]

    assert datadir() == str(tmp_path / ".ringq" / "pgdata")
    monkeypatch.setenv("RINGQ_HOME", str(tmp_path / "from_env"))
    assert datadir() == str(tmp_path / "from_env" / "pgdata")
    assert datadir("--home", str(tmp_path / "from_flag")) == str(tmp_path / "from_flag" / "pgdata")
    assert not (tmp_path / ".ringq").exists() and not (tmp_path / "from_env").exists()


# Malformed variables -------------------------------------------------------------------


def test_malformed_variable_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clean_env(monkeypatch)
    monkeypatch.setenv("RINGQ_MOVE_BATCH", "abc")
    code, out, err = cli(capsys, "move", "--from", "a", "--to", "b")
    assert (code, out) == (2, "")
    assert err == (
        "ringq: environment variable RINGQ_MOVE_BATCH='abc' (for --batch): not a valid int value\n"
    )
    # A command without that option does not care.
    code, _, err = cli(capsys, "db", "status", "--home", str(tmp_path))
    assert (code, err) == (1, "")
    # Nor does one where the flag overrides it: the variable is never read.
    assert parse_args(["move", "--batch", "5"]).batch == 5

    monkeypatch.setenv("RINGQ_REGRESS_FILLER", "zigzag")  # checked against the choices too
    with pytest.raises(ConfigError) as caught:
        parse_args(["regress"])
    assert str(caught.value) == (
        "environment variable RINGQ_REGRESS_FILLER='zigzag' (for --filler): "
        "must be one of 'random', 'pattern'"
    )


def test_malformed_variable_no_traceback_from_the_installed_command(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGQ_")}
    env["RINGQ_MOVE_BATCH"] = "abc"
    done = subprocess.run(
        [*RINGQ, "db", "status", "--home", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert (done.returncode, done.stderr) == (1, "")  # not running; nothing about the variable
    env["RINGQ_MONITOR_PORT"] = "http"
    done = subprocess.run(
        [*RINGQ, "monitor"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert done.stderr == (
        "ringq: environment variable RINGQ_MONITOR_PORT='http' (for --port): "
        "not a valid int value\n"
    )


# Where the database is: --dsn > RINGQ_DSN > $RINGQ_HOME's embedded cluster ---------------


def closed_port_dsn() -> str:
    """A DSN nothing answers at (a local port bound, then closed)."""
    return f"postgresql://nobody@127.0.0.1:{closed_port()}/nowhere?connect_timeout=5"


def test_dsn_order_flag_then_variable_then_embedded_cluster(
    pg_cluster: Cluster, dsn: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    clean_env(monkeypatch)
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec("in_test_db", 4, 4))
    dead = closed_port_dsn()

    def listed(*argv: str) -> tuple[int, str, str]:
        return cli(capsys, "queue", "list", *argv)

    # --dsn wins over a RINGQ_DSN and a RINGQ_HOME that lead nowhere.
    monkeypatch.setenv("RINGQ_DSN", dead)
    monkeypatch.setenv("RINGQ_HOME", str(tmp_path / "no_cluster"))
    code, out, err = listed("--dsn", dsn)
    assert (code, err) == (0, "") and "in_test_db" in out
    # RINGQ_DSN is used without --dsn (here: it leads nowhere, and says so) ...
    code, out, err = listed()
    assert code == 3 and "127.0.0.1" in err and "nowhere" in err
    # ... and wins over the embedded cluster of RINGQ_HOME.
    monkeypatch.setenv("RINGQ_DSN", dsn)
    monkeypatch.setenv("RINGQ_HOME", str(pg_cluster.home))
    code, out, err = listed()
    assert (code, err) == (0, "") and "in_test_db" in out
    # Without either, the running embedded cluster under RINGQ_HOME (its own
    # database 'ringq', which has no such queue).
    monkeypatch.delenv("RINGQ_DSN")
    code, out, err = listed()
    assert (code, err) == (0, "") and "in_test_db" not in out
    assert resolve_dsn() == pg_cluster.url()
    # And none at all: exit 3, saying how to get one.
    monkeypatch.setenv("RINGQ_HOME", str(tmp_path / "no_cluster"))
    code, out, err = listed()
    assert code == 3 and "ringq db start" in err


# Packaging -----------------------------------------------------------------------------

_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".ringq", "build", "dist", "*.egg-info", "__pycache__", "*.pyc",
    ".pytest_cache", ".mypy_cache", ".ruff_cache", "runs", "results",
)


def test_wheel_holds_the_subpackages_and_their_data_and_no_top_level_engine(
    tmp_path: Path,
) -> None:
    # A copy, so that building leaves nothing (build/, egg-info) in the working
    # tree; setuptools' own PEP 517 hook, offline (what pip wheel calls, without pip).
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCE)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys; from setuptools import build_meta; "
                "print(build_meta.build_wheel(sys.argv[1]))"
            ),
            str(tmp_path / "dist"),
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = tmp_path / "dist" / done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt")))

    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"ringq", "ringq-0.1.0.dist-info"}, tops  # no bare engine/, cli/ ...
    for package in ("engine", "monitor", "scripting", "rtv", "regression", "cli"):
        assert f"ringq/{package}/__init__.py" in names
        for py in (REPO / package).glob("*.py"):
            assert f"ringq/{package}/{py.name}" in names
    assert {"ringq/__init__.py", "ringq/py.typed"} <= names
    sql_files = {f"ringq/{p.relative_to(REPO)}" for p in REPO.glob("*/*.sql")
                 if p.parts[-2] not in ("tests", "bench", "examples")}
    assert {"ringq/engine/queries.sql", "ringq/scripting/ddl.sql"} <= sql_files <= names
    static = {
        f"ringq/{p.relative_to(REPO)}" for p in (REPO / "rtv" / "static").rglob("*") if p.is_file()
    }
    assert "ringq/rtv/static/index.html" in static and static <= names
    assert b"ringq = ringq.cli:main" in entry_points


def test_status_prints_a_line_under_a_queue_whose_entries_wait(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 24: ``ringq status`` prints, under a queue's row, how many of its
    entries wait for their due time and when the next falls due (after its
    groups' line); nothing for a queue with none, or from a monitor that does
    not say. (A stand-in monitor serves the document.)"""
    base = {"capacity": 64, "depth": 5}
    doc = {"t": time.time(), "monitor": {"beat": time.time()}, "queues": [
        {**base, "name": "grouped", "waiting_entries": 4, "next_due_s": 75.0,
         "groups_ready": 1, "groups_busy": 0, "group_oldest_age_s": 2.0, "group_skips": 0},
        {**base, "name": "none", "waiting_entries": 0, "next_due_s": 0.0},
        {**base, "name": "older"},  # a monitor before issue 24
        {**base, "name": "ripe", "waiting_entries": 1, "next_due_s": 0.0},
    ]}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(doc if self.path == "/api/queues" else {"clients": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        code, out, err = cli(capsys, "status", "--monitor", f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0, err
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("grouped "))
    assert lines[at + 1].startswith("  groups: 1 ready")
    assert lines[at + 2] == "  waiting: 4 entries, next due in 1 min 15 s"
    assert lines[at + 3].startswith("none ") and lines[at + 4].startswith("older ")
    assert lines[at + 5].startswith("ripe ") and lines[at + 6] == "  waiting: 1 entry, next due now"
    assert sum("waiting:" in line for line in lines) == 2
