"""Failures under traffic, with the real ``ringq monitor`` process running.

Producers and consumers are real processes (forked) that record what they
sent and what they took in the same transaction as the enqueue or dequeue
(tables ``sent`` and ``got``), so the database itself is the ground truth.
They are killed with SIGKILL at random points, some of them from inside the
queue's critical section; the monitor is killed and restarted; PostgreSQL is
restarted (``pg_ctl restart`` of the suite's cluster); the global section is
unlinked. Afterwards every committed entry is delivered exactly once and the
live section equals one rebuilt from the tables into a separate segment.

Every wait is on a condition (commit counters the workers publish, the
section, the monitor's state file) with a deadline; never a bare sleep.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import random
import secrets
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
import pytest
from conftest import MonitorProcess, present, remove_section, wait_for
from psycopg import sql
from ringq.cluster import Cluster
from ringq.engine import RingqError, Section, Session, connect
from ringq.engine import layout as L
from ringq.engine.recovery import rebuild_into, section_differences
from ringq.scripting import QueueSpec, create_queue

FORK = mp.get_context("fork")


# -- helpers ----------------------------------------------------------------------------------


@pytest.fixture
def queues(dsn: str) -> Iterator[list[str]]:
    """Two queues (shared and single dequeue mode) and the ground-truth tables."""
    names = []
    with psycopg.connect(dsn) as conn:
        for mode in ("shared", "single"):
            name = "q_" + uuid.uuid4().hex[:10]
            create_queue(conn, QueueSpec(name, 32, 256, dequeue_mode=mode, full_timeout=2.0))
            names.append(name)
        conn.execute("CREATE TABLE sent (payload bytea PRIMARY KEY)")
        conn.execute("CREATE TABLE got (payload bytea, queue text, seq bigint)")
    yield names
    remove_section(dsn)


@pytest.fixture
def monitor(dsn: str, tmp_path: Path) -> Iterator[Callable[[], MonitorProcess]]:
    made: list[MonitorProcess] = []

    def start() -> MonitorProcess:
        m = MonitorProcess(dsn, tmp_path / "monitor")
        made.append(m)
        return m

    yield start
    for m in made:
        m.kill()


# -- the workers --------------------------------------------------------------------------------


_LOCKED_FILES = tuple(
    f"engine{sep}ring{sep}{name}"
    for sep in ("/", "\\")
    for name in ("_ring.py", "_finish.py", "_cache.py")
)


def _die_inside_the_lock(after: int, deaths: Any, seed: int) -> None:
    """Trace this process and SIGKILL it at the ``after``-th line executed in
    the ring operations (``_ring.py``, and a batch's finish and payload-cache
    work in ``_finish.py`` and ``_cache.py``: all run under the queue's lock)
    or in ``lock_queue``/``unlock_queue``: a death at a random instruction of
    the critical section. ``deaths[seed]`` is set if it held a queue lock."""
    left = [after]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            left[0] -= 1
            if left[0] <= 0:
                this = frame.f_locals.get("self", frame.f_locals.get("ring"))
                sec = getattr(this, "sec", this)  # a Ring's (or cache's) section, or the Section
                if isinstance(sec, Section) and any(
                    sec.q(i, L.Q_LOCK_HOLDER) == os.getpid() for i in sec.loaded_queues()
                ):
                    deaths[seed] = 1
                os.kill(os.getpid(), signal.SIGKILL)
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code.co_filename.endswith(_LOCKED_FILES) or code.co_name in (
            "lock_queue", "unlock_queue"
        ):
            return local
        return None

    sys.settrace(on_call)


def _take_into_got(s: Session, queue: str, *, wait: float, many: int = 0) -> bool:
    """Dequeue one entry of ``queue`` (with ``many``, up to that many in one
    batch) and record them in the table ``got`` in the same transaction, left
    open for the caller to commit; False, with the transaction committed,
    when no entry came within ``wait`` seconds."""
    ms = s.dequeue_many(queue, many, wait=wait) if many else [s.dequeue(queue, wait=wait)]
    taken = [m for m in ms if m is not None]
    if not taken:
        s.commit()
        return False
    s.connection.execute(
        "INSERT INTO got SELECT unnest(%s::bytea[]), %s, unnest(%s::bigint[])",
        ([m.payload for m in taken], queue, [m.seq for m in taken]),
    )
    return True


def _worker(dsn: str, queues: list[str], role: str, seed: int, commits: Any, stop: Any,
            die_after: int, deaths: Any, face: Callable[..., Any]) -> None:
    """Produce or consume until stopped or killed, reconnecting after any
    failure, with ``face``'s session (``connect``, or conftest's ``AsyncFace``:
    its event loop made in this process, after the fork).

    ``commits[seed]`` counts this worker's committed transactions (written by
    it alone, with no lock: a worker killed while holding a shared lock
    would stop every other one). For the same reason ``stop`` is a bare
    flag (a multiprocessing Event's is_set() takes a lock, and a worker
    killed inside it left every later worker blocked there) and ``deaths`` a
    flag per worker. A producer puts 1-3 entries on random queues per
    transaction, or (three times in ten) a batch of 1-10 on one queue; a
    consumer takes one, or (a third of the time) a batch of up to 10.
    """
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks when stuck
    rnd = random.Random(seed)
    if die_after:
        _die_inside_the_lock(die_after, deaths, seed)
    i = 0
    while not stop.value:
        try:
            with face(dsn, producer=f"{role}{seed}") as s:
                while not stop.value:
                    if role == "p" and rnd.random() < 0.3:  # a batch (held as one run)
                        batch = [f"{seed}:{i + k}".encode() for k in range(1, rnd.randint(2, 12))]
                        i += len(batch)
                        s.enqueue_many(rnd.choice(queues), batch, timeout=1.0)
                        s.connection.execute("INSERT INTO sent SELECT unnest(%s::bytea[])",
                                             (batch,))
                    elif role == "p":
                        for _ in range(rnd.randint(1, 3)):
                            i += 1
                            payload = f"{seed}:{i}".encode()
                            s.enqueue(rnd.choice(queues), payload, timeout=1.0)
                            s.connection.execute("INSERT INTO sent VALUES (%s)", (payload,))
                    elif not _take_into_got(s, rnd.choice(queues), wait=0.05,
                                            many=rnd.choice([0, 0, rnd.randint(2, 10)])):
                        continue
                    s.commit()
                    commits[seed] += 1
        except (RingqError, psycopg.Error):
            time.sleep(0.05)  # the database or the section went away: come back


class Traffic:
    """Producer and consumer processes, with counters to wait on."""

    def __init__(self, dsn: str, queues: list[str], face: Callable[..., Any] = connect) -> None:
        self.dsn, self.queues, self.face = dsn, queues, face
        self.commits = FORK.RawArray("q", 1024)  # by worker seed
        self.deaths = FORK.RawArray("b", 1024)  # by worker seed: SIGKILLed inside a queue lock
        self.stop = FORK.RawValue("b", 0)  # no lock (see _worker)
        self.procs: list[Any] = []
        self.roles: list[str] = []
        self._seed = 0

    def start(
        self, producers: int = 2, consumers: int = 2, die_after: Callable[[], int] = lambda: 0
    ) -> None:
        for role in "p" * producers + "c" * consumers:
            self._seed += 1
            p = FORK.Process(
                target=_worker,
                args=(
                    self.dsn,
                    self.queues,
                    role,
                    self._seed,
                    self.commits,
                    self.stop,
                    die_after(),
                    self.deaths,
                    self.face,
                ),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
            self.roles.append(role)

    def count(self) -> int:
        return int(sum(self.commits))

    def both_roles_alive(self) -> bool:
        alive = {role for p, role in zip(self.procs, self.roles, strict=True) if p.is_alive()}
        return alive == {"p", "c"}

    def wait_commits(self, n: int, timeout: float = 20.0, what: str = "traffic") -> None:
        """Wait until ``n`` more transactions committed, or (when workers kill
        themselves) no producer or no consumer is left to make progress."""
        target = self.count() + n
        try:
            wait_for(lambda: self.count() >= target or not self.both_roles_alive(),
                     timeout, f"{n} commits: {what}")
        except AssertionError as exc:
            alive = [p.pid for p in self.procs if p.is_alive()]
            for pid in alive:
                os.kill(pid, signal.SIGUSR1)  # their stacks, on stderr
            time.sleep(0.5)  # let them write before the report
            raise AssertionError(
                f"{exc}; {self.count()} of {target} commits; workers alive: {alive}"
            ) from None

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(10)
        self.procs, self.roles = [], []

    def finish(self) -> None:
        """Stop gracefully (kill what does not stop within 10 s)."""
        self.stop.value = 1
        for p in self.procs:
            p.join(10)
        self.kill()
        self.stop.value = 0


# -- what must be true afterwards ------------------------------------------------------------------


def _quiet(dsn: str, own_pid: int) -> None:
    """Wait until the monitor has recovered every dead client: no client but
    ours and the monitor's own (its inbox pump's session), no slot locked, no
    queue lock holder."""
    with connect(dsn) as s:

        def done() -> bool:
            s.commit()  # re-attaches if the section was replaced
            sec = s.section
            return (
                all(sec.c(c, L.C_PID) == own_pid or sec.c(c, L.C_ROLE) == L.CR_MONITOR
                    for c in sec.active_clients())
                and not any(sec.q(i, L.Q_LOCK_HOLDER) for i in sec.loaded_queues())
                and not sec.lck.any()
            )

        wait_for(done, 20, "the monitor to recover every dead client")


def _qids(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn) as c:
        return {n: int(i) for i, n in c.execute("SELECT id, name FROM ringq.queues").fetchall()}


def assert_section_equals_rebuild(dsn: str) -> None:
    """The live section (after the monitor's reclaim) equals a fresh rebuild from the tables."""
    instance = "verify" + secrets.token_hex(8)
    fresh = rebuild_into(dsn, instance)
    try:
        with connect(dsn) as s:
            s.commit()
            qids = _qids(dsn)

            def diffs() -> dict[str, list[str]]:
                out = {n: section_differences(s.section, fresh, qid) for n, qid in qids.items()}
                return {n: d for n, d in out.items() if d}

            deadline = time.monotonic() + 5  # the monitor's reclaim, every pass
            while (d := diffs()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not d, (
                f"the live section differs from a rebuild: {d}; queued rows: "
                f"{_queued_rows(dsn, list(d))}"
            )
    finally:
        fresh.close()
        Section.unlink(instance)


def _queued_rows(dsn: str, queues: list[str]) -> dict[str, list[Any]]:
    """Rows in state queued, with whether ``got`` has their payload (a report on failure)."""
    out = {}
    with psycopg.connect(dsn) as c:
        for q in queues:
            table = sql.Identifier("ringq", "q_" + q)
            out[q] = c.execute(
                sql.SQL("SELECT r.*, EXISTS (SELECT 1 FROM got g WHERE g.payload = r.payload) "
                        "FROM {} r WHERE state = 1 ORDER BY seq").format(table)
            ).fetchall()
    return out


def assert_exactly_once(dsn: str, queues: list[str], min_sent: int) -> None:
    """Drain every queue; every committed entry was delivered exactly once."""
    drained: list[bytes] = []
    with connect(dsn) as s:
        for q in queues:
            while (m := s.dequeue(q)) is not None:
                drained.append(m.payload)
                s.commit()
        s.commit()
    with psycopg.connect(dsn) as c:
        got = [bytes(r[0]) for r in c.execute("SELECT payload FROM got").fetchall()]
        sent = {bytes(r[0]) for r in c.execute("SELECT payload FROM sent").fetchall()}
    delivered = got + drained
    dup = {p for p in delivered if delivered.count(p) > 1}
    assert not dup, f"delivered twice: {sorted(dup)[:10]}"
    assert len(sent) >= min_sent, (
        f"the workload did too little to prove anything ({len(sent)} sent)"
    )
    lost, phantom = sent - set(delivered), set(delivered) - sent
    assert not lost and not phantom, f"lost {sorted(lost)[:10]}, phantom {sorted(phantom)[:10]}"


def _check_all(dsn: str, queues: list[str], min_sent: int) -> None:
    _quiet(dsn, os.getpid())
    assert_section_equals_rebuild(dsn)  # with entries still queued
    assert_exactly_once(dsn, queues, min_sent)
    _quiet(dsn, os.getpid())
    assert_section_equals_rebuild(dsn)  # drained


# -- the tests -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kill9_at_random_points_inside_and_outside_the_lock_under_the_monitor(
    dsn: str, queues: list[str], monitor: Callable[[], MonitorProcess],
    face: Callable[..., Any],
) -> None:
    """Consumers and producers of ``face`` (the async face's ring operations
    run on its loop's thread, the one traced) die by kill -9 at random points."""
    monitor()
    rnd = random.Random(int(os.environ.get("RINGQ_TEST_SEED", "4")))
    traffic = Traffic(dsn, queues, face)
    rounds = 10
    for _ in range(rounds):
        # Half the workers die by themselves at a random line of a ring
        # operation (inside the queue's lock); the rest are killed from here
        # at whatever they are doing once the round has committed enough.
        traffic.start(die_after=lambda: rnd.choice([0, rnd.randint(1, 400)]))
        traffic.wait_commits(rnd.randint(1, 25), what="a round")
        traffic.kill()
    deaths = sum(traffic.deaths)
    assert deaths >= 3, f"only {deaths} deaths inside a queue lock"
    _check_all(dsn, queues, min_sent=100)


@pytest.mark.slow
def test_monitor_restart_and_postgres_restart_in_the_middle_of_traffic(
    dsn: str, queues: list[str], monitor: Callable[[], MonitorProcess], pg_cluster: Cluster,
    face: Callable[..., Any],
) -> None:
    mon = monitor()
    traffic = Traffic(dsn, queues, face)
    traffic.start()
    try:
        traffic.wait_commits(30, what="before the monitor restart")
        mon.kill()  # kill -9, then a new one
        traffic.wait_commits(10, what="without a monitor")
        monitor()
        traffic.wait_commits(30, what="under the new monitor")
        log = pg_cluster.datadir / "log" / "startup.log"
        pg_cluster.restart(timeout=60, log=log)  # raises ClusterError with pg_ctl's output
        traffic.wait_commits(30, 30, what="after the database restart")
        # every worker rode the restart out (each caught only the documented errors)
        assert all(p.is_alive() for p in traffic.procs), "a worker died of the restart"
    finally:
        traffic.finish()
    _check_all(dsn, queues, min_sent=100)


@pytest.mark.slow
def test_section_unlinked_while_clients_run(
    dsn: str, queues: list[str], monitor: Callable[[], MonitorProcess],
    face: Callable[..., Any],
) -> None:
    monitor()
    traffic = Traffic(dsn, queues, face)
    traffic.start()
    try:
        with psycopg.connect(dsn) as c:
            row = c.execute("SELECT value FROM ringq.meta WHERE key = 'instance_id'").fetchone()
        assert row is not None
        for _ in range(3):
            traffic.wait_commits(20, what="before the section is removed")
            assert Section.unlink(row[0])
            traffic.wait_commits(20, what="after the section was removed")
    finally:
        traffic.finish()
    _check_all(dsn, queues, min_sent=100)


# -- backends terminated under load (the point 0) ------------------------------------------


def _reconnecting_consumers(dsn: str, queue: str, threads: int, stop: Any, commits: Any,
                            face: Callable[..., Any]) -> None:
    """``threads`` consumer sessions of ``face`` in one process (an async
    face's each on its own loop), each reopening its session after any error
    (a terminated backend), as an application would."""
    import threading

    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def consume() -> None:
        while not stop.is_set():
            try:
                with face(dsn, application_name="ringq-test") as s:
                    while not stop.is_set():
                        if not _take_into_got(s, queue, wait=0.2):
                            continue
                        s.commit()
                        with commits.get_lock():
                            commits.value += 1
            except (RingqError, psycopg.Error):
                stop.wait(0.02)

    ts = [threading.Thread(target=consume) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _reconnecting_producer(dsn: str, queue: str, stop: Any, commits: Any,
                           face: Callable[..., Any]) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    i = 0
    while not stop.is_set():
        try:
            with face(dsn, producer="p", application_name="ringq-test") as s:
                while not stop.is_set():
                    for _ in range(random.randint(1, 3)):
                        i += 1
                        payload = f"p:{i}".encode()
                        s.enqueue(queue, payload, timeout=0.5)
                        s.connection.execute("INSERT INTO sent VALUES (%s)", (payload,))
                    s.commit()
                    with commits.get_lock():
                        commits.value += 1
        except (RingqError, psycopg.Error):
            stop.wait(0.02)


def _terminate_busy_backends(conn: psycopg.Connection[Any]) -> int:
    """End every backend of the test's database that is active or idle in a
    transaction (the clients' and the monitor's), as an operator's kill script does."""
    rows = conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
        "AND state IN ('active', 'idle in transaction')"
    ).fetchall()
    return len(rows)


def _locked_slots_report(dsn: str, queue: str) -> str:
    """The ring's counts and who holds its locked slots (a report on failure)."""
    with connect(dsn) as s:
        ring = s.ring(queue)
        sec = s.section
        held = []
        for seq in range(ring.tail, ring.head):
            enq, deq, lck, owner = ring.bits(seq % ring.cap)
            if lck:
                cidx = (owner - 1) % L.MAX_CLIENTS if owner > 0 else -1
                entry = (
                    [sec.c(cidx, w) for w in (L.C_PID, L.C_STATE, L.C_BACKEND_PID)]
                    if cidx >= 0
                    else None
                )
                held.append((seq, enq, deq, owner, entry))
        return (
            f"ring {ring.counts()}; locked (seq, ENQ, DEQ, owner, [pid, state, backend]):"
            f" {held[:10]}"
        )


@pytest.mark.slow
def test_backends_terminated_under_load_leave_no_slot_stuck(
    dsn: str, monitor: Callable[[], MonitorProcess], face: Callable[..., Any]
) -> None:
    """Backends (not processes) are terminated twice a second under load while
    the clients reopen their sessions; afterwards the queue drains completely
    while the same processes keep running, keeps moving, and delivered every
    committed entry exactly once."""
    queue = "q_" + uuid.uuid4().hex[:10]
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec(queue, 300, 256, dequeue_mode="shared", full_timeout=0.5))
        conn.execute("CREATE TABLE sent (payload bytea PRIMARY KEY)")
        conn.execute("CREATE TABLE got (payload bytea, queue text, seq bigint)")
    monitor()
    stop_p, stop_c = FORK.Event(), FORK.Event()
    produced, consumed = FORK.Value("q", 0), FORK.Value("q", 0)
    procs = [
        FORK.Process(
            target=_reconnecting_producer, args=(dsn, queue, stop_p, produced, face),
            daemon=True,
        )
    ]
    procs += [
        FORK.Process(
            target=_reconnecting_consumers, args=(dsn, queue, 8, stop_c, consumed, face),
            daemon=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        p.start()

    def sent_and_got() -> tuple[set[bytes], set[bytes]]:
        with psycopg.connect(dsn) as c:
            sent = {bytes(r[0]) for r in c.execute("SELECT payload FROM sent").fetchall()}
            got = {bytes(r[0]) for r in c.execute("SELECT payload FROM got").fetchall()}
        return sent, got

    def drained() -> bool:
        sent, got = sent_and_got()
        return sent <= got

    def locked() -> int:
        with connect(dsn) as s:
            return s.ring(queue).counts()["locked"]

    try:
        wait_for(lambda: consumed.value >= 20, 20, "traffic to start")
        killed = 0
        with psycopg.connect(dsn, autocommit=True) as killer:
            rnd = random.Random(int(os.environ.get("RINGQ_TEST_SEED", "7")))
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and killed < 40:  # (the check wants 30)
                killed += _terminate_busy_backends(killer)
                # Twice a second on average, at random moments: some land
                # while sessions are recovering from the previous round.
                time.sleep(rnd.choice([0.02, 0.05, 0.5, 0.9]))
        assert killed >= 30, f"only {killed} backends terminated"
        stop_p.set()
        procs[0].join(10)
        # The consumers keep running: they (and the monitor) must drain the
        # queue, every committed entry, while the processes stay alive.
        try:
            wait_for(lambda: drained() and not locked(), 30,
                     "the queue to drain while its clients live")
        except AssertionError:
            sent, got = sent_and_got()
            raise AssertionError(
                f"{len(sent - got)} committed entries never delivered;"
                f" {_locked_slots_report(dsn, queue)}"
            ) from None
        # And it keeps moving: new entries are delivered.
        with connect(dsn) as s:
            fresh = [f"after:{i}".encode() for i in range(50)]
            for payload in fresh:
                s.enqueue(queue, payload, timeout=5.0)
                s.connection.execute("INSERT INTO sent VALUES (%s)", (payload,))
            s.commit()
        wait_for(lambda: set(fresh) <= sent_and_got()[1], 20, "new entries to be delivered")
    finally:
        stop_p.set()
        stop_c.set()
        for p in procs:
            p.join(15)
            if p.is_alive():
                os.kill(present(p.pid), signal.SIGKILL)
                p.join(5)
    assert_exactly_once(dsn, [queue], min_sent=200)
    _quiet(dsn, os.getpid())
