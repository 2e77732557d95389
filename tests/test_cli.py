"""The ``ringq`` command itself: ``--help`` everywhere, ``RINGQ_*`` variables
(listed, honoured after the command line, refused clearly when malformed).

Database-free where it can be: these tests parse and print, they do not need
the embedded cluster.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ringq.cli import main
from ringq.cli._main import build_parser, parse_args
from ringq.engine import ConfigError
from ringq.engine._move import MoveConfig

RINGQ = [sys.executable, "-m", "ringq.cli"]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``ringq ARGV`` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own --help and usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RINGQ_* variable from the caller's environment leaks into a test."""
    for name in list(os.environ):
        if name.startswith("RINGQ_"):
            monkeypatch.delenv(name)


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
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
        ("monitor",): ["RINGQ_DSN", "RINGQ_MONITOR_PORT", "RINGQ_MONITOR_TOKEN", "RINGQ_MONITOR_INTERVAL"],
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
        "ringq: environment variable RINGQ_MONITOR_PORT='http' (for --port): not a valid int value\n"
    )
