"""Workers: one transaction per message, against a real PostgreSQL and real processes.

In-process tests drive a :class:`Worker` in the test's main thread (its time
limits need it); process tests run ``ringq worker`` and kill or signal the
real processes. Nothing is synchronized by sleeping: tests wait on
conditions (rows, files, log lines) with deadlines.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue as queue_mod
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import drain, enqueue_committed, handle_one, wait_for, worker_of
from ringq.engine import ConfigError, Message, Session, connect
from ringq.worker import Actions, ActionTimeout, AsyncWorker, Decline, Worker, WorkerExit

# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture
def effects(dsn: str) -> str:
    """A table where actions record what they did (no key: duplicates would show)."""
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE effects (seq bigint, deliveries int, pid int, note text)")
    return "effects"


def record_effect(session: Session, msg: Message, note: str) -> None:
    """What an action did, a row of ``effects`` written in the message's transaction."""
    session.connection.execute(
        "INSERT INTO effects VALUES (%s, %s, %s, %s)",
        (msg.seq, msg.deliveries, os.getpid(), note),
    )


def rows(dsn: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def exceptions_of(dsn: str, queue: str) -> list[tuple[int, int, str]]:
    return [
        (r[0], r[1], r[2])
        for r in rows(
            dsn,
            "SELECT e.seq, e.deliveries, e.reason FROM ringq.exceptions e "
            "JOIN ringq.queues q ON q.id = e.queue_id WHERE q.name = %s ORDER BY e.seq",
            queue,
        )
    ]


# -- in-process: outcomes of one message ----------------------------------------------------


def test_action_commits_its_writes_and_chained_messages_together(
    dsn: str, make_queue: Callable[..., str], effects: str
) -> None:
    a, b = make_queue(), make_queue()
    app = Actions()

    @app.action(a)
    def step1(msg: Message, session: Session) -> None:
        record_effect(session, msg, "step1")
        session.enqueue(b, msg.payload + b"->step2")

    (seq,) = enqueue_committed(dsn, a, b"order-1")
    with Worker(app, dsn) as w:
        assert w.queues == [a]  # by default a worker serves every queue of its actions
        assert w.run_one(wait=5)
        assert w.stats()["handled"] == 1
    assert rows(dsn, "SELECT seq, deliveries, note FROM effects") == [(seq, 1, "step1")]
    assert [m.payload for m in drain(dsn, b)] == [b"order-1->step2"]
    assert drain(dsn, a) == []


def test_chaining_across_two_queues_is_atomic_when_the_action_fails(
    dsn: str, make_queue: Callable[..., str], effects: str
) -> None:
    a, b = make_queue(), make_queue()
    app = Actions()
    fail = {"yes": True}

    @app.action(a)
    def step1(msg: Message, session: Session) -> None:
        record_effect(session, msg, "step1")
        session.enqueue(b, b"chained")
        if fail["yes"]:
            raise RuntimeError("the next step could not be prepared")

    (seq,) = enqueue_committed(dsn, a, b"x")
    with Worker(app, dsn) as w:
        assert w.run_one(wait=5)  # fails: nothing of it stays
        assert w.stats()["failed"] == 1
        assert rows(dsn, "SELECT count(*) FROM effects") == [(0,)]
        with connect(dsn) as s:  # nothing was chained
            assert s.dequeue(b) is None
            s.commit()
        fail["yes"] = False
        assert w.run_one(wait=5)  # delivered again, and now all of it commits
        assert w.stats()["handled"] == 1
    assert rows(dsn, "SELECT seq, deliveries FROM effects") == [(seq, 2)]
    assert [m.payload for m in drain(dsn, b)] == [b"chained"]
    assert drain(dsn, a) == []


def test_always_raising_action_ends_in_the_exception_queue_after_max_deliveries(
    dsn: str, make_queue: Callable[..., str], effects: str, caplog: pytest.LogCaptureFixture
) -> None:
    q = make_queue(max_deliveries=3)
    app = Actions()
    seen: list[int] = []

    @app.action(q)
    def broken(msg: Message, session: Session) -> None:
        seen.append(msg.deliveries)
        record_effect(session, msg, "broken")
        raise ValueError("always")

    (seq,) = enqueue_committed(dsn, q, b"poison")
    caplog.set_level(logging.WARNING, logger="ringq.worker")
    with Worker(app, dsn) as w:
        while w.run_one(wait=0):
            pass
        st = w.stats()
    assert seen == [1, 2, 3]
    assert st["failed"] == 3 and st["poisoned"] == 1 and st["handled"] == 0
    # Each failure is logged with its queue, seq and delivery count.
    failures = [r.getMessage() for r in caplog.records if "ValueError: always" in r.getMessage()]
    assert [
        f"queue {q} seq {seq} delivery {n}/3" in m for n, m in zip((1, 2, 3), failures, strict=True)
    ] == [True] * 3
    assert failures[-1].endswith("moved to ringq.exceptions")
    assert failures[0].endswith("it will be delivered again")
    assert exceptions_of(dsn, q) == [(seq, 3, "max deliveries reached")]
    assert rows(dsn, "SELECT count(*) FROM effects") == [(0,)]
    assert drain(dsn, q) == []


def test_a_decline_commits_and_enqueues_its_reply(
    dsn: str, make_queue: Callable[..., str], effects: str
) -> None:
    q, replies = make_queue(), make_queue()
    app = Actions()

    @app.action(q)
    def pay(msg: Message, session: Session) -> Decline:
        # The action records the refusal (an audit row) and declines: both commit.
        record_effect(session, msg, "refused")
        return Decline("insufficient funds", reply_to=replies, reply=b"refused:" + msg.payload)

    (seq,) = enqueue_committed(dsn, q, b"pay 100")
    with Worker(app, dsn) as w:
        assert w.run_one(wait=5)
        st = w.stats()
    assert st["handled"] == 1 and st["declined"] == 1 and st["failed"] == 0
    assert rows(dsn, "SELECT seq, note FROM effects") == [(seq, "refused")]
    assert [m.payload for m in drain(dsn, replies)] == [b"refused:pay 100"]
    assert drain(dsn, q) == []  # consumed: a decline is not a failure
    assert exceptions_of(dsn, q) == []


def test_decline_needs_a_queue_for_its_reply() -> None:
    with pytest.raises(ConfigError):
        Decline("no", reply=b"x")


def test_registry_rejects_a_second_action_for_a_queue_and_bad_timeouts() -> None:
    app = Actions()
    app.add("orders", lambda m, s: None)
    with pytest.raises(ConfigError):
        app.add("orders", lambda m, s: None)
    with pytest.raises(ConfigError):
        app.add("other", lambda m, s: None, timeout=0)
    with pytest.raises(ConfigError):
        Actions(timeout=-1)


# -- in-process: time limits ----------------------------------------------------------------


def _timed_app(q: str, body: Callable[[Message, Session], None], timeout: float) -> Actions:
    app = Actions()

    @app.action(q, timeout=timeout)
    def act(msg: Message, session: Session) -> None:
        record_effect(session, msg, "timed")
        if msg.deliveries == 1:
            body(msg, session)

    return app


def _timed_out_delivery(w: Worker | AsyncWorker) -> float:
    """Run one delivery, which the time limit strikes: its seconds."""
    t0 = time.monotonic()
    assert handle_one(w)
    elapsed = time.monotonic() - t0
    assert w.stats()["timeouts"] == 1
    return elapsed


def test_time_limit_aborts_a_python_loop_and_rolls_back(
    dsn: str, make_queue: Callable[..., str], effects: str
) -> None:
    q = make_queue()

    def spin(msg: Message, session: Session) -> None:
        try:
            while True:
                pass
        except Exception:
            pytest.fail("ActionTimeout was caught as an Exception")

    (seq,) = enqueue_committed(dsn, q, b"slow")
    with Worker(_timed_app(q, spin, 0.3), dsn) as w:
        elapsed = _timed_out_delivery(w)
        assert rows(dsn, "SELECT count(*) FROM effects") == [(0,)]  # its write is gone
        assert w.run_one(wait=5)  # delivered again (the body only spins the first time)
        assert w.stats()["handled"] == 1
    assert 0.3 <= elapsed < 3.0
    assert rows(dsn, "SELECT seq, deliveries FROM effects") == [(seq, 2)]


@pytest.mark.parametrize("concurrency", [0, 8])
def test_time_limit_cancels_sql_in_progress_and_the_session_goes_on(
    dsn: str, make_queue: Callable[..., str], effects: str, concurrency: int
) -> None:
    """The same with ``--concurrency`` (the sync action in a thread, its
    statement cancelled at the limit)."""
    q = make_queue()

    def sleep_in_sql(msg: Message, session: Session) -> None:
        session.connection.execute("SELECT pg_sleep(30)")

    (seq,) = enqueue_committed(dsn, q, b"slow sql")
    with closing(worker_of(_timed_app(q, sleep_in_sql, 0.3), dsn, concurrency)) as w:
        elapsed = _timed_out_delivery(w)
        assert handle_one(w)
        assert w.stats()["handled"] == 1
        # No statement of the action is still running on the server.
        sleeping = rows(dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                             "current_database() AND state = 'active' "
                             "AND query = 'SELECT pg_sleep(30)'")  # fmt: skip
        assert sleeping == [(0,)]
    assert elapsed < 3.0
    assert rows(dsn, "SELECT seq, deliveries FROM effects") == [(seq, 2)]


def test_time_limit_does_not_leak_slots_when_it_strikes_inside_engine_calls(
    dsn: str, make_queue: Callable[..., str], effects: str
) -> None:
    q, big = make_queue(), make_queue(capacity=100_000, dequeue_mode="shared")

    def flood(msg: Message, session: Session) -> None:
        while True:  # most of the time is spent inside session.enqueue
            session.enqueue(big, b"x" * 16)

    seqs = enqueue_committed(dsn, q, b"1", b"2", b"3")
    app = Actions()

    @app.action(q, timeout=0.2)
    def act(msg: Message, session: Session) -> None:
        flood(msg, session)

    with Worker(app, dsn) as w:
        for _ in seqs:  # three deliveries of the first message, three time-outs
            assert w.run_one(wait=5)
        assert w.stats()["timeouts"] == 3
        ring = w.session.ring(big)
        counts = ring.counts()
    assert counts["locked"] == 0, counts  # no reservation was left behind
    assert drain(dsn, big) == []


def test_action_timeout_is_not_an_exception() -> None:
    assert not issubclass(ActionTimeout, Exception)


# -- processes: ringq worker ----------------------------------------------------------------

ACTIONS_TEMPLATE = """
import os, signal, time
from pathlib import Path
from ringq.worker import Actions, Decline

DIR = Path({dir!r})
app = Actions()

@app.action({queue!r})
def act(msg, session):
    session.connection.execute(
        "INSERT INTO effects VALUES (%s, %s, %s, %s)",
        (msg.seq, msg.deliveries, os.getpid(), msg.payload.decode()),
    )
    if msg.payload == b"block-noalarm":  # an action no interrupt can reach
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})
    if msg.payload.startswith(b"block") and msg.deliveries == 1:
        (DIR / f"ready-{{msg.seq}}").write_text(str(os.getpid()))
        go = DIR / f"go-{{msg.seq}}"
        while not go.exists():  # blocks until the test releases it (or kills us)
            time.sleep(0.005)
"""


# An action that records each message's group, its sequence in the group (the
# payload "<group>:<n>"), and the monotonic times the action began and ended (just
# before the worker commits), so that order and overlaps can be checked afterwards.
GROUPED_ACTIONS_TEMPLATE = """
import os, time
from ringq.worker import Actions

app = Actions()

@app.action({queue!r})
def act(msg, session):
    began = time.monotonic_ns()
    grp, n = msg.payload.decode().split(":")
    time.sleep(0.001)  # hold it a little, so two of a group in flight would show
    session.connection.execute(
        "INSERT INTO grouped_effects VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (msg.seq, msg.group, grp, int(n), os.getpid(), began, time.monotonic_ns()),
    )
"""


class WorkerProcess:
    """``ringq worker`` in a subprocess, its stderr collected line by line; its
    actions module is ``template`` formatted with ``dir`` and ``queue``."""

    def __init__(
        self, tmp: Path, dsn: str, queue: str, *extra: str, template: str = ACTIONS_TEMPLATE
    ) -> None:
        mod = "wact_" + uuid.uuid4().hex[:8]
        (tmp / f"{mod}.py").write_text(
            textwrap.dedent(template.format(dir=str(tmp), queue=queue))
        )
        self.tmp = tmp
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])
        )
        env.pop("RINGQ_DSN", None)
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "ringq.cli", "worker", f"{mod}:app", "--dsn", dsn,
                "--log-level", "INFO", *extra,
            ],
            cwd=tmp,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue_mod.Queue[str] = queue_mod.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_line(self, pattern: str, timeout: float = 30.0) -> str:
        rx = re.compile(pattern)
        line: str = wait_for(
            lambda: next((ln for ln in self.lines if rx.search(ln)), None),
            timeout,
            f"log line /{pattern}/",
        )
        return line

    def ready_pid(self, seq: int, timeout: float = 30.0) -> int:
        f = self.tmp / f"ready-{seq}"
        wait_for(lambda: f.exists() and f.read_text(), timeout, f"message {seq} in its action")
        return int(f.read_text())

    def release(self, seq: int) -> None:
        (self.tmp / f"go-{seq}").write_text("go")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                "ringq worker did not exit:\n" + "".join(self.lines[-40:])
            ) from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def worker_process(tmp_path: Path, dsn: str) -> Iterator[Callable[..., WorkerProcess]]:
    made: list[WorkerProcess] = []

    def start(queue: str, *extra: str, template: str = ACTIONS_TEMPLATE) -> WorkerProcess:
        wp = WorkerProcess(tmp_path, dsn, queue, *extra, template=template)
        made.append(wp)
        return wp

    yield start
    for wp in made:
        wp.close()


def test_kill9_mid_action_rolls_its_writes_back_and_the_message_is_handled_again(
    dsn: str,
    make_queue: Callable[..., str],
    effects: str,
    worker_process: Callable[..., WorkerProcess],
) -> None:
    q = make_queue()
    seqs = enqueue_committed(dsn, q, b"first", b"block", b"third", b"fourth")
    blocked = seqs[1]
    wp = worker_process(q, "--processes", "1")
    victim = wp.ready_pid(blocked)
    # The action wrote its row but has not committed: invisible to others.
    assert rows(dsn, "SELECT seq FROM effects WHERE seq = %s", blocked) == []
    os.kill(victim, signal.SIGKILL)
    # The pool gives the slot back at once and restarts the worker, which
    # handles the message again (deliveries 2) and the rest after it.
    wait_for(
        lambda: rows(dsn, "SELECT count(DISTINCT seq) FROM effects")[0][0] == 4,
        60,
        "all four handled",
    )
    got = rows(dsn, "SELECT seq, deliveries, pid FROM effects ORDER BY seq")
    assert [r[0] for r in got] == seqs  # exactly one effect per message: the killed one left none
    by_seq = {r[0]: r for r in got}
    assert by_seq[blocked][1] == 2 and by_seq[blocked][2] != victim
    assert by_seq[seqs[0]][1] == 1 and by_seq[seqs[2]][1] == 1
    wp.wait_line(rf"worker 0 \(pid {victim}\) was killed by SIGKILL")
    wp.signal(signal.SIGTERM)
    assert wp.wait() == WorkerExit.OK
    assert drain(dsn, q) == []
    assert exceptions_of(dsn, q) == []


def test_two_processes_on_a_shared_queue_handle_each_message_once(
    dsn: str,
    make_queue: Callable[..., str],
    effects: str,
    worker_process: Callable[..., WorkerProcess],
) -> None:
    q = make_queue(capacity=512, dequeue_mode="shared")
    seqs = enqueue_committed(dsn, q, *[f"m{i}".encode() for i in range(300)])
    wp = worker_process(q, "--processes", "2")
    wait_for(lambda: rows(dsn, "SELECT count(*) FROM effects")[0][0] >= 300, 60, "300 effects")
    wp.signal(signal.SIGTERM)
    assert wp.wait() == WorkerExit.OK
    got = rows(dsn, "SELECT seq, count(*) FROM effects GROUP BY seq ORDER BY seq")
    assert [r[0] for r in got] == seqs and all(r[1] == 1 for r in got)
    pids = rows(dsn, "SELECT count(DISTINCT pid) FROM effects")[0][0]
    assert pids in (1, 2)  # both may take part; correctness does not depend on it
    assert wp.wait_line(r"stopped: handled=300 ")


def test_three_processes_on_a_grouped_queue_keep_each_groups_order(
    dsn: str, make_queue: Callable[..., str], worker_process: Callable[..., WorkerProcess]
) -> None:
    """Ten groups, entries enqueued round-robin over them; three worker
    processes: each message handled once, and per group the actions ran in
    the group's order, one at a time (the next began after the previous
    one's action ended, before its commit)."""
    n_groups, per_group = 10, 15
    q = make_queue(capacity=256, dequeue_mode="shared")
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE grouped_effects (seq bigint, grp text, payload_grp text, n int,"
            " pid int, began bigint, ended bigint)"
        )
    with connect(dsn) as s:
        for n in range(per_group):
            names = [f"g{g}" for g in range(n_groups)]
            s.enqueue_many(q, [f"{g}:{n}".encode() for g in names], group=names)
        s.commit()
    total = n_groups * per_group
    wp = worker_process(q, "--processes", "3", template=GROUPED_ACTIONS_TEMPLATE)
    wait_for(
        lambda: rows(dsn, "SELECT count(*) FROM grouped_effects")[0][0] >= total, 60,
        f"{total} effects",
    )
    wp.signal(signal.SIGTERM)
    assert wp.wait() == WorkerExit.OK
    got = rows(dsn, "SELECT seq, grp, payload_grp, n, pid, began, ended FROM grouped_effects"
                    " ORDER BY grp, began")  # fmt: skip
    assert len(got) == total and len({r[0] for r in got}) == total  # each once
    assert all(r[1] == r[2] for r in got)  # Message.group is the group it was enqueued in
    for g in range(n_groups):
        entries = [r for r in got if r[1] == f"g{g}"]
        assert [r[3] for r in entries] == list(range(per_group)), f"group g{g} out of order"
        for before, after in itertools.pairwise(entries):
            assert after[5] > before[6], f"group g{g}: two entries held at once"
    assert wp.wait_line(rf"stopped: handled={total} ")
    assert drain(dsn, q) == []


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_sigterm_drains_the_message_in_flight_and_exits_0(
    dsn: str,
    make_queue: Callable[..., str],
    effects: str,
    worker_process: Callable[..., WorkerProcess],
    start_method: str,
) -> None:
    q = make_queue()
    blocked, later = enqueue_committed(dsn, q, b"block", b"later")
    wp = worker_process(q, "--start-method", start_method)
    child = wp.ready_pid(blocked)
    wp.signal(signal.SIGTERM)
    # The child heard it (and keeps going with its message) before we release the action.
    wp.wait_line(
        rf"{child} INFO ringq.worker: ringq worker: SIGTERM: finishing the message in flight"
    )
    wp.release(blocked)
    assert wp.wait() == WorkerExit.OK
    assert rows(dsn, "SELECT seq, deliveries FROM effects") == [(blocked, 1)]  # it committed
    left = drain(dsn, q)  # the next message was not started
    assert [(m.seq, m.deliveries) for m in left] == [(later, 1)]


def _second_sigterm_mid_action(
    dsn: str,
    make_queue: Callable[..., str],
    worker_process: Callable[..., WorkerProcess],
    payload: bytes,
    *extra: str,
) -> tuple[WorkerProcess, str, int, int]:
    """A worker (``ringq worker`` with ``extra``) handling ``payload``'s
    message gets SIGTERM, says it finishes the message, then gets a second
    SIGTERM: (worker, queue, seq, child pid)."""
    q = make_queue()
    (blocked,) = enqueue_committed(dsn, q, payload)
    wp = worker_process(q, *extra)
    child = wp.ready_pid(blocked)
    wp.signal(signal.SIGTERM)
    wp.wait_line(rf"{child} INFO .*finishing the message in flight")
    wp.signal(signal.SIGTERM)
    return wp, q, blocked, child


def _rolled_back_and_back_on_the_queue(dsn: str, q: str, seq: int) -> None:
    assert rows(dsn, "SELECT count(*) FROM effects") == [(0,)]
    back = drain(dsn, q)
    assert [m.seq for m in back] == [seq] and back[0].deliveries == 2


def test_second_sigterm_aborts_the_message_in_flight(
    dsn: str,
    make_queue: Callable[..., str],
    effects: str,
    worker_process: Callable[..., WorkerProcess],
) -> None:
    wp, q, blocked, _ = _second_sigterm_mid_action(dsn, make_queue, worker_process, b"block")
    assert wp.wait() == WorkerExit.ABORTED
    assert wp.wait_line(r"aborted \(rolled back\)")
    _rolled_back_and_back_on_the_queue(dsn, q, blocked)


@pytest.mark.parametrize("concurrency", [0, 8])
def test_third_sigterm_kills_an_action_that_cannot_be_interrupted(
    dsn: str,
    make_queue: Callable[..., str],
    effects: str,
    worker_process: Callable[..., WorkerProcess],
    concurrency: int,
) -> None:
    """With ``--concurrency`` the sync action runs in a thread, which no
    abort can interrupt either: the second SIGTERM waits for it, the third kills."""
    wp, q, blocked, child = _second_sigterm_mid_action(
        dsn, make_queue, worker_process, b"block-noalarm", "--concurrency", str(concurrency)
    )
    wp.wait_line(rf"{child} WARNING .*second SIGTERM")
    wp.signal(signal.SIGTERM)
    assert wp.wait() == WorkerExit.ABORTED
    assert wp.wait_line(rf"worker 0 \(pid {child}\) killed")
    # the pool recovered the dead child's slot before exiting
    _rolled_back_and_back_on_the_queue(dsn, q, blocked)


def test_bad_target_and_missing_queue_exit_with_named_codes(
    dsn: str, make_queue: Callable[..., str], tmp_path: Path
) -> None:
    def worker(target: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ringq.cli", "worker", target, "--dsn", dsn],
            cwd=tmp_path,
            env=dict(os.environ, PYTHONPATH=str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    r = worker("no_such_module_here")
    assert r.returncode == WorkerExit.USAGE, r.stderr
    assert "cannot import" in r.stderr
    make_queue()  # the schema exists, the queue below does not
    (tmp_path / "wact_missing.py").write_text(
        "from ringq.worker import Actions\napp = Actions()\n"
        "app.add('q_not_there', lambda m, s: None)\n"
    )
    r = worker("wact_missing")
    assert r.returncode == WorkerExit.NOT_FOUND, r.stderr
