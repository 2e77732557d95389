"""A worker pool and a mover through a fail-over: started with the pair's
multi-host DSN, they carry on by themselves after the primary's postmaster is
killed with kill -9 and, ``GAP`` seconds later (no primary meanwhile), the
synchronous standby promoted.

A producer commits entries before the kill, through the fail-over (its
commits fail while there is no primary; the one whose answer was lost is in
doubt) and after the promotion. Every acknowledged entry must be handled (or
moved) exactly once, and nothing stays on the source queue. Each test makes
its own pair of servers (see :func:`test_failover.pair`). The last one moves
out of an asynchronous pair, through a replication gap, into another server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from conftest import drain, queue_in, wait_for
from ringq.cluster import Cluster
from ringq.engine import InDoubt, RingqError, Session, connect
from ringq.move import MoveConfig, Mover, unwrap
from ringq.scripting import QueueSpec, create_queue
from ringq.worker import WorkerExit
from test_failover import kill_primary, pair, queued_in_table, replication_gap
from test_worker import WorkerProcess

BEFORE = 300  # entries committed before the kill (the clients are busy with them at the kill)
AFTER = 100  # entries committed after the promotion
GAP = 2.0  # seconds without a primary between the kill and the promotion
RECONNECT = 30.0  # seconds the producer may go without a primary


@dataclass
class Producer:
    """A thread committing one entry per transaction (payload: its number),
    ``BEFORE`` of them, then, once :meth:`go_on` is called, ``AFTER`` more. A
    failed enqueue or commit puts its number in ``doubtful`` (a lost commit
    may have committed) and the next number goes on a session reopened with
    the multi-host DSN, for at most ``RECONNECT`` seconds without a primary."""

    dsn: str
    queue: str
    acked: list[int] = field(default_factory=list)
    doubtful: list[int] = field(default_factory=list)
    error: BaseException | None = None  # what ended the thread early

    def __post_init__(self) -> None:
        self.promoted = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def go_on(self) -> None:
        self.promoted.set()

    def join(self) -> None:
        self.thread.join(RECONNECT + 30)
        assert not self.thread.is_alive(), "the producer did not finish"
        assert self.error is None, f"the producer gave up: {self.error!r}"

    def _run(self) -> None:
        session: Session | None = None
        try:
            for n in range(BEFORE + AFTER):
                if n == BEFORE:
                    assert self.promoted.wait(60), "never told the promotion was done"
                session = self._one(session, n)
        except BaseException as exc:
            self.error = exc
        finally:
            if session is not None:
                session.close()

    def _one(self, session: Session | None, n: int) -> Session:
        deadline = time.monotonic() + RECONNECT
        while session is None or session.closed:
            try:
                session = connect(self.dsn)
            except RingqError:
                if time.monotonic() > deadline:
                    raise
                self.promoted.wait(0.05)  # no primary yet: try again soon
        try:
            session.enqueue(self.queue, str(n).encode())
            session.commit()
        except RingqError:
            self.doubtful.append(n)
            if not session.closed:
                try:
                    session.rollback()
                except RingqError:
                    session.close()
        else:
            self.acked.append(n)
        return session


def make_queues(dsn: str, *specs: QueueSpec) -> None:
    with psycopg.connect(dsn) as conn:
        for spec in specs:
            create_queue(conn, spec)


def fresh_name() -> str:
    return "q_" + uuid.uuid4().hex[:10]


def failover(cluster: Cluster, producer: Producer, busy: Callable[[], object]) -> Failover:
    """Once ``busy()`` holds (the client is working through the producer's
    entries), kill -9 the primary and, ``GAP`` seconds later, promote the
    standby with the scripting API; then let the producer commit the rest."""
    wait_for(busy, 30, "the client to be busy before the kill")
    killed_at = time.time()
    kill_primary(cluster)
    threading.Event().wait(GAP)  # no primary: what a fail-over tool takes to decide
    cluster.promote()
    promoted_at = time.time()
    assert cluster.status().in_recovery is False
    producer.go_on()
    return Failover(killed_at, promoted_at)


@dataclass(frozen=True)
class Failover:
    """When the primary was killed and when the standby's promotion ended (wall clock, s)."""

    killed_at: float
    promoted_at: float

    def figures(self, handled_at: list[datetime]) -> str:
        """Seconds from the kill to the promotion's end, and to the first of
        ``handled_at`` on the new primary (after the promotion)."""
        first = min(t.timestamp() for t in handled_at if t.timestamp() >= self.promoted_at)
        return (
            f"promoted {self.promoted_at - self.killed_at:.2f} s after the kill, "
            f"first handled on the new primary {first - self.killed_at:.2f} s after the kill"
        )


def check_exactly_once(got: list[int], producer: Producer) -> None:
    """Every acknowledged entry once; nothing twice; nothing that was not sent."""
    twice = sorted(n for n, k in Counter(got).items() if k > 1)
    assert not twice, f"handled twice: {twice[:20]}"
    missing = sorted(set(producer.acked) - set(got))
    assert not missing, f"acknowledged and lost: {missing[:20]}"
    extra = set(got) - set(producer.acked) - set(producer.doubtful)
    assert not extra, f"never sent: {sorted(extra)[:20]}"


def stderr_excerpt(lines: list[str], limit: int = 25) -> str:
    """The client's stderr around the fail-over, for the record (``pytest -s``)."""
    shown = [ln.rstrip("\n") for ln in lines if "started (pid" not in ln]
    return "\n".join(shown[:limit])


# -- the worker pool ---------------------------------------------------------------------------


def handled(dsn: str) -> list[tuple[int, datetime]]:
    """(payload, when the action ran) of every committed effect."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT note, at FROM effects ORDER BY at").fetchall()
    return [(int(r[0]), r[1]) for r in rows]


def test_a_worker_pool_carries_on_after_a_promotion_and_handles_each_entry_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pair(tmp_path / "home", capsys, "--sync") as cluster:
        both = cluster.url(both=True)
        queue = fresh_name()
        make_queues(both, QueueSpec(queue, 1024, 64, dequeue_mode="shared"))
        with psycopg.connect(both) as conn:  # what test_worker's actions write, and when
            conn.execute(
                "CREATE TABLE effects (seq bigint, deliveries int, pid int, note text, "
                "at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        (tmp_path / "pool").mkdir()
        pool = WorkerProcess(tmp_path / "pool", both, queue, "--processes", "2")
        producer = Producer(both, queue)
        try:
            producer.start()
            times = failover(cluster, producer, lambda: len(handled(both)) >= 50)
            producer.join()
            wait_for(
                lambda: set(producer.acked) <= {n for n, _ in handled(both)},
                30, "the pool to handle every acknowledged entry",
            )
            assert pool.proc.poll() is None, "the pool exited:\n" + "".join(pool.lines[-40:])
            done = handled(both)
            check_exactly_once([n for n, _ in done], producer)
            after = [at for n, at in done if n >= BEFORE]
            assert len(after) >= AFTER - len(producer.doubtful), "few entries after the promotion"
            # Its workers could not reach the database during the gap; the pool
            # restarted them as soon as it could, not after their backoff.
            pool.wait_line(r"ringq worker pool: the database answers again")
            pool.signal(signal.SIGTERM)
            assert pool.wait() == WorkerExit.OK
        finally:
            pool.close()
            (tmp_path / "pool.stderr").write_text("".join(pool.lines))
        assert queued_in_table(both, queue) == [] and drain(both, queue) == []
        print(
            f"\nworker pool: {len(producer.acked)} acknowledged, doubtful {producer.doubtful}, "
            f"{times.figures([at for _, at in done])}\n"
            f"{stderr_excerpt(pool.lines)}"
        )


# -- the mover ---------------------------------------------------------------------------------


class Arrivals:
    """A consumer of the mover's destination: the payloads that arrived, and
    when each was moved. A call that fails (no primary) counts nothing; the
    next one goes on a session reopened with the multi-host DSN."""

    def __init__(self, dsn: str, queue: str) -> None:
        self.dsn, self.queue = dsn, queue
        self.got: list[tuple[int, datetime]] = []
        self._session: Session | None = None

    def take(self) -> int:
        """Take what arrived since the last call; how many arrived in all."""
        try:
            if self._session is None or self._session.closed:
                self._session = connect(self.dsn)
            msgs = self._session.dequeue_many(self.queue, 100)
            self._session.commit()
        except RingqError:
            return len(self.got)
        self.got.extend((int(unwrap(m).payload), m.enqueued_at) for m in msgs)
        return len(self.got)

    def payloads(self) -> list[int]:
        return [n for n, _ in self.got]

    def close(self) -> None:
        if self._session is not None:
            self._session.close()


def test_a_mover_carries_on_after_a_promotion_and_moves_each_entry_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pair(tmp_path / "home", capsys, "--sync") as cluster:
        both = cluster.url(both=True)
        src, dst = fresh_name(), fresh_name()
        make_queues(both, QueueSpec(src, 1024, 64), QueueSpec(dst, 1024, 512))
        log = tmp_path / "move.stderr"
        with log.open("w") as err:
            mover = subprocess.Popen(
                [sys.executable, "-m", "ringq.cli", "move", "--dsn", both, "--from", src,
                 "--to", dst, "--batch", "10", "--standby-poll", "0.1"],
                stdout=subprocess.DEVNULL, stderr=err, text=True,
                env={k: v for k, v in os.environ.items() if k != "RINGQ_DSN"},
            )
        producer = Producer(both, src)
        arrivals = Arrivals(both, dst)
        try:
            producer.start()
            times = failover(cluster, producer, lambda: arrivals.take() >= 50)
            producer.join()
            wait_for(
                lambda: arrivals.take() and set(producer.acked) <= set(arrivals.payloads()),
                30, "the mover to move every acknowledged entry",
            )
            assert mover.poll() is None, "the mover exited:\n" + log.read_text()
            check_exactly_once(arrivals.payloads(), producer)
            mover.send_signal(signal.SIGTERM)
            assert mover.wait(30) == 0, log.read_text()
        finally:
            arrivals.close()
            if mover.poll() is None:
                mover.kill()
                mover.wait(10)
        assert queued_in_table(both, src) == [] and drain(both, src) == []
        print(
            f"\nmover: {len(producer.acked)} acknowledged, doubtful {producer.doubtful}, "
            f"{times.figures([at for _, at in arrivals.got])}\n"
            f"{stderr_excerpt(log.read_text().splitlines())}"
        )


def test_a_mover_out_of_an_async_pair_moves_the_entries_that_reuse_lost_sequences(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dsn: str
) -> None:
    """The source is an asynchronous pair, the destination another server.
    Entries committed and moved during a replication gap are lost from the
    source with the old primary, and the new primary gives their sequences
    again to the next entries: those must arrive too, not be taken for the
    lost ones by their keys (with the sequence alone in the key, all 40 were
    skipped), and nothing arrives twice."""
    with pair(tmp_path / "home", capsys, "--async") as cluster:
        both = cluster.url(both=True)
        src = fresh_name()
        make_queues(both, QueueSpec(src, 1024, 64))
        dst = queue_in(dsn, capacity=1024, max_payload=512)
        stop = threading.Event()

        def move() -> None:
            with Mover(both, src, dsn, dst, config=MoveConfig(batch=10, standby_poll=0.1)) as mv:
                mv.run(stop)

        mover = threading.Thread(target=move, daemon=True)
        mover.start()
        arrivals = Arrivals(dsn, dst)
        producer = connect(both)
        try:
            def send(numbers: range) -> None:
                for n in numbers:
                    for attempt in range(3):  # a first call may find the connection dead
                        try:
                            producer.enqueue(src, str(n).encode())
                            producer.commit()
                            break
                        except InDoubt as exc:
                            if producer.in_doubt_outcome(exc):
                                break
                        except RingqError:
                            assert attempt < 2

            send(range(40))
            wait_for(lambda: arrivals.take() >= 40, 30, "the first entries to be moved")
            with replication_gap(cluster):  # committed and moved on the old primary alone
                send(range(40, 80))
                wait_for(lambda: arrivals.take() >= 80, 30, "the gap's entries to be moved")
            cluster.promote()
            queued = queued_in_table(both, src)  # the gap's entries are not there
            send(range(100, 140))
            wait_for(lambda: arrivals.take() >= 120, 30, "the new primary's entries to be moved")
        finally:
            stop.set()
            mover.join(30)
            producer.close()
        time.sleep(0.5)
        arrivals.take()
        arrivals.close()
        got = arrivals.payloads()
        assert queued == []
        assert sorted(got) == [*range(80), *range(100, 140)], "lost or moved twice"
        print(f"\nasync mover: {len(got)} arrived, in order: {got == sorted(got)}")
