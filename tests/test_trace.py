"""The trace of queue operations (``ringq.trace``): one line per call, or nothing.

Round trips in the trace are checked against libpq's own protocol trace
(one ReadyForQuery per exchange); the switch by environment runs in a
subprocess that configures no logging; a recovery decision is traced after
a real child holding an entry is killed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import cli, present, round_trips, wire_trace
from ringq.engine import QueueNotFound, connect

FORK = mp.get_context("fork")
TRACE = "ringq.trace"
LINE = re.compile(r"^(?P<call>\w+) session=(?P<session>\d+) pid=(?P<pid>\d+) (?P<ops>.*) "
                  r"rt=(?P<rt>\d+) us=(?P<us>\d+)(?: error=(?P<error>\w+))?$")



def trace_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == TRACE]


def parsed(message: str) -> dict[str, str]:
    m = LINE.match(message)
    assert m is not None, message
    return {k: v for k, v in m.groupdict().items() if v is not None}


@pytest.mark.parametrize("cached", [True, False])
def test_a_cycle_gives_one_line_per_call(
    dsn: str, make_queue: Callable[..., str], caplog: pytest.LogCaptureFixture, cached: bool
) -> None:
    """enqueue, commit, dequeue, commit: four lines, with the session's
    token and backend, the queue, slot and seq, the cache, and as many round
    trips as libpq counted on the wire."""
    q = make_queue(capacity=8, **({} if cached else {"cache_payload": 0}))
    caplog.set_level(logging.DEBUG, logger=TRACE)
    with connect(dsn) as s:
        s.queue_info(q)
        s.ring(q)
        for i in range(6):  # past psycopg's prepare threshold; slots 0..5 used
            s.enqueue(q, b"warm %d" % i)
            s.commit()
            assert s.dequeue(q) is not None
            s.commit()
        caplog.clear()
        wire: list[int] = []
        for step in ("enqueue", "commit", "dequeue", "commit"):
            with wire_trace(s.connection) as lines:
                if step == "enqueue":
                    seq = s.enqueue(q, b"traced")
                elif step == "dequeue":
                    m = present(s.dequeue(q))
                    assert m.seq == seq
                else:
                    s.commit()
            wire.append(round_trips(lines))
        got = [parsed(line) for line in trace_lines(caplog)]
    assert [g["call"] for g in got] == ["enqueue", "commit", "dequeue", "commit"]
    assert [int(g["rt"]) for g in got] == wire == [0, 1, 0 if cached else 1, 1]
    slot = seq % 8
    where = f"queue={q} n=1 slots={slot} seqs={seq}"
    assert got[0]["ops"] == where
    assert got[1]["ops"] == f"{where} enq=1 deq=0"
    assert got[2]["ops"] == f"{where} cache={1 if cached else 0}/1"
    assert got[3]["ops"] == f"{where} enq=0 deq=1"
    for g in got:
        assert int(g["session"]) == s.owner and int(g["pid"]) == s.backend_pid
        assert "error" not in g
    assert int(got[1]["us"]) > 0  # a commit is a round trip: never under a microsecond


def test_batches_flush_rollback_and_errors_are_traced(
    dsn: str, make_queue: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    q = make_queue(capacity=16)
    caplog.set_level(logging.DEBUG, logger=TRACE)
    with connect(dsn) as s:
        seqs = s.enqueue_many(q, [b"a", b"b", b"c"])
        s.flush()
        s.rollback()
        with pytest.raises(QueueNotFound):
            s.enqueue("no_such_queue", b"x")
        s.enqueue(q, b"d")
        s.commit()
        got = [parsed(line) for line in trace_lines(caplog)]
    runs = f"slots={seqs[0]}..{seqs[-1]} seqs={seqs[0]}..{seqs[-1]}"
    assert [g["call"] for g in got] == [
        "enqueue_many", "flush", "rollback", "enqueue", "enqueue", "commit"
    ]
    assert got[0]["ops"] == f"queue={q} n=3 {runs}"
    assert got[1]["ops"] == f"queue={q} n=3 {runs}" and got[1]["rt"] == "1"
    assert got[2]["ops"] == f"queue={q} n=3 {runs} enq=3 deq=0"
    assert got[3]["ops"] == "queue=no_such_queue n=0" and got[3]["error"] == "QueueNotFound"
    assert got[5]["ops"] == f"queue={q} n=1 slots=3 seqs=3 enq=1 deq=0"


def test_trace_off_writes_nothing_and_leaves_the_calls_untouched(
    dsn: str, make_queue: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """Off, a session's calls are the class's own; a logger enabled after
    the session opened does not trace it (the switch is read at open)."""
    q = make_queue(capacity=8)
    caplog.set_level(logging.DEBUG)  # everything else captured, the trace's logger not
    caplog.set_level(logging.INFO, logger=TRACE)
    with connect(dsn) as s:
        assert "commit" not in vars(s) and "enqueue" not in vars(s)
        assert type(s).enqueue.__get__(s) == s.enqueue
        caplog.set_level(logging.DEBUG, logger=TRACE)  # too late for this session
        s.enqueue(q, b"x")
        s.commit()
        assert present(s.dequeue(q)).payload == b"x"
        s.commit()
    assert trace_lines(caplog) == []
    assert not any(r.name == TRACE for r in caplog.records)


_SCRIPT = """
import logging, sys
from ringq.engine import connect
if sys.argv[3] == "configured":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="APP %(name)s %(message)s")
with connect(sys.argv[1]) as s:
    s.enqueue(sys.argv[2], b"x")
    s.commit()
"""


@pytest.mark.parametrize("output", ["stderr", "file", "configured"])
def test_ringq_trace_alone_writes_somewhere(
    dsn: str, make_queue: Callable[..., str], tmp_path: Path, output: str
) -> None:
    """RINGQ_TRACE=1 in a program that configures no logging: the lines go
    to stderr, or only to RINGQ_TRACE_FILE; a program that configures
    logging gets them once, through its own handler."""
    q = make_queue(capacity=8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGQ_TRACE")}
    env["RINGQ_TRACE"] = "1"
    path = tmp_path / "trace.log"
    if output == "file":
        env["RINGQ_TRACE_FILE"] = str(path)
    r = subprocess.run([sys.executable, "-c", _SCRIPT, dsn, q, output], env=env,
                       capture_output=True, text=True, timeout=60, check=True)
    want = ["ringq.trace: enqueue session=", "ringq.trace: commit session="]
    if output == "stderr":
        assert all(w in r.stderr for w in want) and r.stdout == ""
        assert f"queue={q} n=1 slots=0 seqs=0 enq=1 deq=0 rt=1" in r.stderr
    elif output == "file":
        text = path.read_text()
        assert all(w in text for w in want)
        assert "ringq.trace" not in r.stderr + r.stdout
    else:
        assert "ringq.trace" not in r.stderr
        assert r.stdout.count("APP ringq.trace enqueue session=") == 1
        assert r.stdout.count("APP ringq.trace commit session=") == 1


def _hold_and_die(dsn: str, queue: str, owner: Any, ready: Any) -> None:
    with connect(dsn) as s:
        assert s.dequeue(queue) is not None
        owner.value = s.owner
        ready.set()
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_recovery_decision_is_traced(
    dsn: str, make_queue: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"held by the dead")
        s.commit()
        ready, owner = FORK.Event(), FORK.Value("q", 0)
        p = FORK.Process(target=_hold_and_die, args=(dsn, q, owner, ready))
        p.start()
        p.join(30)
        assert ready.is_set() and p.exitcode == -signal.SIGKILL
        caplog.set_level(logging.DEBUG, logger=TRACE)
        s.recover_dead_holders(q)
        decided = [line for line in trace_lines(caplog) if line.startswith("decide ")]
        assert decided == [
            f"decide why=dead-client:{p.pid} queue={q} owner={owner.value} committed=0 "
            f"slots= seqs= rolled_back=1 slots={seq % 8} seqs={seq}"
        ]
        assert present(s.dequeue(q)).deliveries == 2  # given back, with a strike
        s.commit()


def test_trace_option_of_the_commands_that_run_sessions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("worker", "move", "monitor", "regress", "run"):
        code, out, _err = cli(capsys, command, "--help")
        assert code == 0 and "--trace" in out and "RINGQ_TRACE" in out, command
    code, out, _err = cli(capsys, "status", "--help")
    assert code == 0 and "--trace" not in out

