"""No text of a DSN that could be a password shows in any message, including
libpq's own (issue 32).

libpq's messages quote what it read of a DSN: where a password holds an "@",
"/", "?", "#" or ":" that its writer did not escape, libpq reads part of it as
the host, the port, the database or a query, and its message quotes that part
("failed to resolve host 'word@127.0.0.1'" for the password "Pa55@word").
:func:`ringq.engine.redact_dsn` hides the DSN, not these pieces: the engine
scrubs every message, and every exception of a traceback's chain, of every
fragment that could be a password (:func:`ringq.engine.scrub`).

Every test here but the guards (passwords libpq reads whole) failed before:
the pieces showed in the error, its ``__cause__`` and the CLI's output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from urllib.parse import unquote

import pytest
import ringq.engine
from conftest import cli, closed_port
from ringq.engine import (
    DatabaseUnavailable,
    RingqError,
    check_dsn,
    password_fragments,
    scrub,
    scrub_exception,
)

RINGQ = [sys.executable, "-m", "ringq.cli"]
REPO = Path(__file__).resolve().parent.parent


def issue_dsn(port: int) -> str:
    """The issue's example: libpq reads password "Pa55", host "word@127.0.0.1"."""
    return f"postgresql://postgres:Pa55@word@127.0.0.1:{port}/ringq"


def pieces(password: str) -> list[str]:
    """The password, raw and URL-decoded, and its pieces between the characters
    libpq splits a DSN at."""
    forms = {password, unquote(password)}
    return [*forms, *(p for f in forms for p in re.split(r"[@/?#:]", f) if p)]


def shown(text: str, piece: str) -> bool:
    """``piece`` shows in ``text``, not inside a longer word ("wo" is not shown
    by "known", nor "word" by "password")."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(piece)}(?![A-Za-z0-9])", text) is not None


def assert_hidden(text: str, password: str) -> None:
    for piece in pieces(password):
        assert not shown(text, piece), f"{piece!r} of the password shows in {text!r}"


def chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception chained to it, as a traceback walks them."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
    return out


def everything_shown(exc: BaseException) -> str:
    """All that ``str``, ``repr`` and a printed traceback show of ``exc`` and its chain."""
    parts = ["".join(traceback.format_exception(exc))]
    for e in chain(exc):
        parts += [str(e), repr(e), *(getattr(e, "__notes__", None) or [])]
    return "\n".join(parts)


def connect_error(dsn: str) -> RingqError:
    with pytest.raises(RingqError) as info:
        ringq.engine.connect(dsn, connect_timeout=5)
    return info.value


# The engine: ringq.engine.connect(dsn) ------------------------------------------------


def test_the_issue_example_through_connect_shows_no_piece_of_the_password() -> None:
    exc = connect_error(issue_dsn(closed_port()))
    assert isinstance(exc, DatabaseUnavailable)
    text = everything_shown(exc)
    assert "Pa55" not in text and "word" not in text, text
    # the message still says what failed, and where
    assert str(exc).startswith("database unavailable at 'postgresql://postgres:***@127.0.0.1:")
    assert "failed to resolve host '***@127.0.0.1'" in str(exc)
    # the psycopg error is still the cause, scrubbed, not cut off
    assert type(exc.__cause__).__module__.startswith("psycopg")
    assert "***@127.0.0.1" in str(exc.__cause__)


# (password, libpq's reading) with an unescaped "/", "?", "#" or ":"
PASSWORDS = [
    ("Pa55/word", "host 'postgres', port 'Pa55': the port is refused"),
    ("Pa55@wo/rd", "host 'wo', dbname 'rd@127.0.0.1:PORT/ringq'"),
    ("Pa55@wo?rd", "a query 'rd@127.0.0.1:PORT/ringq' with no '='"),
    ("Pa55@wo#rd", "host 'wo#rd@127.0.0.1'"),
    ("Pa55@wo:rd", "host 'wo', port 'rd@127.0.0.1:PORT'"),
]
# guards: libpq reads these whole as the password; nothing quotes them
WHOLE = ["Pa55?word", "Pa55#word", "Pa55:word", "Pa55%40wo%2Frd"]


@pytest.mark.parametrize(("password", "reading"), PASSWORDS, ids=[p for p, _ in PASSWORDS])
def test_a_password_libpq_splits_shows_in_no_error(password: str, reading: str) -> None:
    port = closed_port()
    exc = connect_error(f"postgresql://postgres:{password}@127.0.0.1:{port}/ringq")
    assert_hidden(everything_shown(exc), password)


@pytest.mark.parametrize("password", WHOLE)
def test_a_password_libpq_reads_whole_shows_in_no_error(password: str) -> None:
    port = closed_port()
    exc = connect_error(f"postgresql://postgres:{password}@127.0.0.1:{port}/ringq")
    assert isinstance(exc, DatabaseUnavailable)
    assert_hidden(everything_shown(exc), password)
    assert f"port {port} failed" in str(exc)  # the rest stays readable


@pytest.mark.parametrize(
    ("dsn", "password"),
    [
        # libpq ends an unquoted value at the blank, then wants "word=..."
        ("host=127.0.0.1 port={port} user=postgres password=Pa55 word dbname=ringq", "Pa55 word"),
        # guards: read whole
        ("host=127.0.0.1 port={port} password=Pa55@wo\\ rd dbname=ringq", "Pa55@wo rd"),
        ("host=127.0.0.1 port={port} password='Pa55 word' dbname=ringq", "Pa55 word"),
        ("host=127.0.0.1 port={port} password=Pa55@word dbname=ringq", "Pa55@word"),
    ],
)
def test_a_keyword_dsn_shows_its_password_in_no_error(dsn: str, password: str) -> None:
    exc = connect_error(dsn.format(port=closed_port()))
    text = everything_shown(exc)
    for piece in [password, *password.split()]:
        assert not shown(text, piece), text


def test_check_dsn_names_no_port_that_is_a_piece_of_the_password() -> None:
    with pytest.raises(RingqError) as info:
        check_dsn("postgresql://postgres:Pa55/word@127.0.0.1/ringq", where="--dsn")
    assert str(info.value) == "invalid --dsn: port '***' is not a number from 1 to 65535"


# The CLI ------------------------------------------------------------------------------


def test_the_issue_example_through_the_installed_command() -> None:
    dsn = issue_dsn(closed_port())
    done = subprocess.run(
        [*RINGQ, "queue", "list", "--dsn", dsn],
        capture_output=True, text=True, timeout=60, check=False,
    )
    both = done.stdout + done.stderr
    assert done.returncode == 3, both  # database unavailable
    assert "Pa55" not in both and "word" not in both, both
    assert "database unavailable at 'postgresql://postgres:***@127.0.0.1:" in done.stderr
    assert "Traceback" not in both


@pytest.mark.parametrize("password", [p for p, _ in PASSWORDS] + ["Pa55@word"])
def test_the_cli_prints_no_piece_of_the_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, password: str
) -> None:
    dsn = f"postgresql://postgres:{password}@127.0.0.1:{closed_port()}/ringq"
    for name in [n for n in list(os.environ) if n.startswith("RINGQ_")]:
        monkeypatch.delenv(name)
    code, out, err = cli(capsys, "queue", "list", "--dsn", dsn)
    assert code in (2, 3), err
    assert_hidden(out + err, password)
    # from RINGQ_DSN, the same
    monkeypatch.setenv("RINGQ_DSN", dsn)
    code, out, err = cli(capsys, "queue", "list")
    assert code in (2, 3), err
    assert_hidden(out + err, password)


def test_move_names_a_bad_target_without_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(
        capsys, "move", "--from", "postgresql://u:Pa55@word@h/db:Not-A-Queue", "--to", "q"
    )
    assert code == 2
    assert "expected DSN:queue" in err
    assert "Pa55" not in out + err and "word" not in out + err, err


@pytest.mark.parametrize("command", ["monitor", "worker"])
def test_monitor_and_worker_log_no_piece_of_the_password(tmp_path: Path, command: str) -> None:
    (tmp_path / "acts.py").write_text(
        "from ringq.worker import Actions\napp = Actions()\n"
        "@app.action('q')\ndef act(msg, session):\n    return None\n"
    )
    dsn = issue_dsn(closed_port())
    argv = {
        "monitor": ["monitor", "--dsn", dsn, "--port", "0", "--data-dir", str(tmp_path / "m")],
        "worker": ["worker", "acts", "--dsn", dsn, "--processes", "1", "--log-level", "DEBUG"],
    }[command]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGQ_")}
    done = subprocess.run(
        [*RINGQ, *argv], capture_output=True, text=True, timeout=60, check=False,
        cwd=tmp_path, env=env,
    )
    both = done.stdout + done.stderr
    assert done.returncode != 0, both
    assert "database unavailable" in both
    assert "Pa55" not in both and "word" not in both, both


# The rule -----------------------------------------------------------------------------


def test_fragments_cover_every_reading() -> None:
    # the writer's (to the last "@"), libpq's (to the first), and their pieces
    assert set(password_fragments("postgresql://u:Pa55@word@h:5432/db")) == {
        "Pa55@word", "Pa55", "word",
    }
    # URL-decoded too
    assert {"Pa55@word", "Pa55", "word"} <= set(
        password_fragments("postgresql://u:Pa55%40word@h/db")
    )
    # no "@": libpq reads "u:Pa55/word@h" as host "u", port "Pa55"
    assert {"Pa55", "word"} <= set(password_fragments("postgresql://u:Pa55/word@h/db"))
    # a query's password ends at "&"; key=value runs to the next "key="
    assert set(password_fragments("postgresql://h/db?password=Pa55&sslmode=require")) == {"Pa55"}
    assert {"Pa55 word", "Pa55", "word"} <= set(
        password_fragments("host=h password=Pa55 word port=5")
    )
    assert set(password_fragments("host=h password='it\\'s' port=5")) >= {"it's"}
    # no password: nothing to hide
    for dsn in ["postgresql://u@h/db", "postgresql://h:5432/db", "host=h port=5", "", None]:
        assert password_fragments(dsn) == ()


def test_a_short_fragment_is_hidden_only_where_it_stands_alone() -> None:
    # a password "a" or "1" does not blank every "a" of a word, nor a host
    dsn = "postgresql://u:a@1@127.0.0.1:5432/db"
    text = 'connection to server at "127.0.0.1", port 5432 failed: database a is 1'
    assert scrub(text, dsn) == (
        'connection to server at "127.0.0.1", port 5432 failed: database *** is ***'
    )
    assert scrub("failed to resolve host 'a@127.0.0.1'", dsn) == (
        "failed to resolve host '***@127.0.0.1'"
    )
    assert scrub('missing "=" after "a" in connection info string', dsn) == (
        'missing "=" after "***" in connection info string'
    )
    # four characters or more: hidden also next to "." or "-", never inside a
    # word ("pass***" would say the password)
    dsn = "postgresql://u:Pa55@word@h/db"
    assert scrub("could not translate host name word.", dsn) == (
        "could not translate host name ***."
    )
    assert scrub("password authentication failed for word-x", dsn) == (
        "password authentication failed for ***-x"
    )


def test_scrub_exception_scrubs_the_whole_chain_in_place() -> None:
    dsn = issue_dsn(5432)
    # (the texts are not in the raising lines: a traceback quotes its source)
    first, then = "failed to resolve host 'word@127.0.0.1'", "while connecting to Pa55"
    try:
        try:
            raise OSError(first)
        except OSError as inner:
            raise RuntimeError(then) from inner
    except RuntimeError as exc:
        scrub_exception(exc, dsn)
        text = everything_shown(exc)
    assert "Pa55" not in text and "word" not in text, text
    assert "failed to resolve host '***@127.0.0.1'" in text
