"""Fail-over on the embedded cluster's streaming standby: kill -9 of the
primary's postmaster, promotion, clients that follow the multi-host DSN, and
the old primary brought back as a standby of the new one.

Each test makes its own pair of servers under its own home (a killed primary
cannot be shared) and stops every server it started, whatever happens.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import AsyncFace, cli, present, wait_for
from psycopg import sql
from ringq.cluster import Cluster
from ringq.engine import (
    DatabaseUnavailable,
    InDoubt,
    RingqError,
    Session,
    TransactionError,
    check_dsn,
    connect,
    queue_table,
    redact_dsn,
)
from ringq.scripting import QueueSpec, create_queue, remove_section

CAPACITY = 1024


@contextmanager
def pair(home: Path, capsys: pytest.CaptureFixture[str], mode: str) -> Iterator[Cluster]:
    """A primary and a standby (``mode``: ``--sync`` or ``--async``) under
    ``home``, made through ``ringq db``; every server stopped afterwards, and
    the database's global section removed from this host."""
    cluster = Cluster(home)
    try:
        code, _, err = cli(capsys, "db", "start", "--home", str(home))
        assert code == 0, err
        code, _, err = cli(capsys, "db", "standby", "start", mode, "--home", str(home))
        assert code == 0, err
        sb = present(cluster.standby_status())
        assert sb.running and sb.in_recovery is True and sb.streaming == "streaming"
        assert sb.sync_state == mode.lstrip("-")
        yield cluster
    finally:
        stop_all(cluster)
    assert not cluster.status().running
    left = cluster.standby_status()
    assert left is None or not left.running


def stop_all(cluster: Cluster) -> None:
    """Remove the database's section, then stop every server of the home (an
    old primary left down after a fail-over is removed). Best effort: the
    section outlives the servers, and so does the shared memory of a killed
    primary, unless it is recovered (remove does it)."""
    with suppress(Exception), psycopg.connect(cluster.url(both=True)) as conn:
        remove_section(conn)
    with suppress(Exception):
        if present(cluster.standby_status()).state == "rebuild":
            cluster.remove_standby()
    cluster.stop()


def make_queue(dsn: str) -> str:
    name = "q_" + uuid.uuid4().hex[:10]
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec(name, CAPACITY, 64))
    return name


@contextmanager
def pair_with_queue(
    home: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> Iterator[tuple[Cluster, str, str]]:
    """A :func:`pair`, its multi-host DSN (``ringq db url --both``) and a new
    queue made through it."""
    with pair(home, capsys, mode) as cluster:
        both = cluster.url(both=True)
        yield cluster, both, make_queue(both)


def kill_primary(cluster: Cluster) -> None:
    """kill -9 the primary's postmaster, and wait until it is gone."""
    pid = present(cluster.status().pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not cluster.status().running, what="the killed postmaster to be gone")


def commit_numbers(session: Session, queue: str, n: int) -> None:
    """Enqueue entries 0 to ``n`` - 1 (payload: the number), a transaction each."""
    for i in range(n):
        session.enqueue(queue, str(i).encode())
        session.commit()


def promote(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> str:
    """``ringq db promote`` of the pair's standby, which must succeed; what it printed."""
    code, out, err = cli(capsys, "db", "promote", "--home", str(cluster.home))
    assert code == 0, err
    return out


def fail_over_after(
    cluster: Cluster, capsys: pytest.CaptureFixture[str], dsn: str, queue: str, entries: int
) -> None:
    """``entries`` committed (:func:`commit_numbers`), then the primary killed
    and the standby promoted."""
    with connect(dsn) as session:
        commit_numbers(session, queue, entries)
    kill_primary(cluster)
    promote(cluster, capsys)


@dataclass
class Producer:
    """A thread committing one entry per transaction (payload: its number)
    until its first error: which commits were acknowledged, and the one in
    doubt. At each count in ``pauses`` it stops until told to go on. Its
    session is ``face``'s (``connect``, or conftest's ``AsyncFace``)."""

    dsn: str
    queue: str
    pauses: tuple[int, ...] = (100,)
    face: Callable[..., Session | AsyncFace] = connect
    acked: list[int] = field(default_factory=list)
    failed: int | None = None  # the number whose commit raised: in doubt
    error: BaseException | None = None
    closed_by_error = False  # whether the error left the session closed

    def __post_init__(self) -> None:
        self.reached = {n: threading.Event() for n in self.pauses}
        self.resume = {n: threading.Event() for n in self.pauses}
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with self.face(self.dsn) as session:
            for n in range(CAPACITY):
                if n in self.pauses:
                    self.reached[n].set()
                    self.resume[n].wait(30)
                try:
                    session.enqueue(self.queue, str(n).encode())
                    session.commit()
                except RingqError as exc:
                    self.failed, self.error = n, exc
                    self.closed_by_error = session.closed
                    return
                self.acked.append(n)
        for event in self.reached.values():
            event.set()

    def wait_for(self, n: int) -> None:
        assert self.reached[n].wait(30), f"the producer did not commit {n} entries"

    def go_on(self, n: int) -> None:
        self.resume[n].set()


def failover_under_traffic(
    cluster: Cluster, capsys: pytest.CaptureFixture[str],
    face: Callable[..., Session | AsyncFace] = connect,
) -> tuple[Producer, Session | AsyncFace, str, float]:
    """Producer committing, kill -9 of the primary, ``ringq db promote``:
    the producer, an idle session opened before the kill, the queue, and the
    seconds from the kill to the promotion's end (both sessions ``face``'s)."""
    both = cluster.url(both=True)
    check_dsn(both)
    queue = make_queue(both)
    idle = face(both)  # a client that did nothing during the fail-over
    producer = Producer(both, queue, face=face)
    producer.thread.start()
    producer.wait_for(100)
    producer.go_on(100)
    killed_at = time.monotonic()
    kill_primary(cluster)
    promoted = finish_failover(cluster, producer, capsys) - killed_at
    return producer, idle, queue, promoted


def finish_failover(
    cluster: Cluster, producer: Producer, capsys: pytest.CaptureFixture[str]
) -> float:
    """After the kill: the producer fails, ``ringq db promote`` succeeds; when it ended."""
    producer.thread.join(30)
    assert not producer.thread.is_alive()
    assert producer.failed is not None, "the producer ran out of room before the kill"
    out = promote(cluster, capsys)
    done = time.monotonic()
    new_dsn = out.strip().splitlines()[-1]
    assert (cluster.home / "dsn").read_text().strip() == new_dsn  # what ringq processes follow
    assert cluster.status().in_recovery is False
    return done


def drain_after_reattach(session: Session | AsyncFace, queue: str) -> list[int]:
    """Dequeue everything with ``session``, whose connection died with the old
    primary: its first transaction fails (connection lost: at the dequeue, or
    at the commit of an entry served from the payload cache of the old
    section), the next ones reattach. Only committed entries count."""
    got: list[int] = []
    failures = 0
    while True:
        try:
            m = session.dequeue(queue)
            session.commit()
        except (DatabaseUnavailable, TransactionError):
            failures += 1
            assert failures <= 2, "the session did not recover from the fail-over"
            continue
        if m is None:
            return got
        got.append(int(m.payload))


def test_sync_failover_keeps_every_committed_entry_once_and_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], face: Callable[..., Any]
) -> None:
    with pair(tmp_path / "home", capsys, "--sync") as cluster:
        producer, idle, queue, promoted = failover_under_traffic(cluster, capsys, face)
        got = drain_after_reattach(idle, queue)
        idle.close()
        assert len(got) == len(set(got)), "an entry was delivered twice"
        assert got == sorted(got), "the producer's order did not hold"
        acked = producer.acked
        # Synchronous: nothing acknowledged is lost; the one commit in doubt
        # when the primary died may have committed, or not.
        assert got[: len(acked)] == acked
        assert got[len(acked) :] in ([], [producer.failed])
        outcome = None
        if isinstance(producer.error, InDoubt):  # else it failed before its COMMIT went
            # The new primary's rows tell the producer what became of it.
            outcome = idle.in_doubt_outcome(producer.error)
            assert outcome is (producer.failed in got)
        print(
            f"\nsync fail-over: {len(acked)} acknowledged, {len(got)} dequeued, "
            f"in doubt: {producer.failed} ({type(producer.error).__name__}; session "
            f"{'closed' if producer.closed_by_error else 'open'}; committed, from the "
            f"rows: {outcome}), kill to promoted: {promoted:.2f} s"
        )
        # The old primary stays down: 'ringq db start' starts the new primary only.
        cluster.start()
        sb = present(cluster.standby_status())
        assert sb.state == "rebuild" and not sb.running


def wait_for_standby(
    standby: psycopg.Connection[Any], stage: str, lsn: str, what: str
) -> None:
    """Wait until ``standby`` has done ``stage`` ("receive" or "replay") up to the WAL
    position ``lsn``."""
    query = {
        "receive": "SELECT pg_last_wal_receive_lsn() >= %s::pg_lsn",
        "replay": "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn",
    }[stage]

    def reached() -> bool:
        row = standby.execute(query, (lsn,)).fetchone()
        return bool(row and row[0])

    wait_for(reached, what=what)


@contextmanager
def replication_gap(cluster: Cluster) -> Iterator[None]:
    """Wait until the standby has received all the primary's WAL, stop the
    primary's walsender (SIGSTOP), run the block (what it commits stays on the
    primary: the replication gap), then kill -9 the primary, walsender included."""
    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        lsn = present(conn.execute("SELECT pg_current_wal_lsn()").fetchone())[0]
        with psycopg.connect(present(present(cluster.standby_status()).dsn)) as standby:

            wait_for_standby(standby, "receive", lsn, "the standby to receive the primary's WAL")
        walsender = present(conn.execute("SELECT pid FROM pg_stat_replication").fetchone())[0]
    os.kill(walsender, signal.SIGSTOP)
    try:
        yield
        kill_primary(cluster)
    finally:
        os.kill(walsender, signal.SIGKILL)  # the rest of the old primary


def dequeues_lost_in_the_gap(
    cluster: Cluster, capsys: pytest.CaptureFixture[str], session: Session, queue: str, n: int
) -> None:
    """Dequeue and commit ``n`` entries in a :func:`replication_gap` (on the
    old primary alone), then ``ringq db promote``: those dequeues are lost."""
    with replication_gap(cluster):
        for _ in range(n):
            present(session.dequeue(queue))
            session.commit()
    promote(cluster, capsys)


def queued_in_table(dsn: str, queue: str) -> list[int]:
    """The payloads of the queue's queued rows, by seq: the database's truth."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT payload FROM {} WHERE state = 1 ORDER BY seq").format(
                queue_table(queue)
            )
        ).fetchall()
    return [int(bytes(r[0])) for r in rows]


def test_async_failover_loses_the_replication_gap_and_delivers_nothing_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], face: Callable[..., Any]
) -> None:
    with pair_with_queue(tmp_path / "home", capsys, "--async") as (cluster, both, queue):
        idle = face(both)
        producer = Producer(both, queue, pauses=(100, 150), face=face)
        producer.thread.start()
        producer.wait_for(100)
        # Entries 0-99 reach the standby, 100-149 commit on the primary alone.
        with replication_gap(cluster):
            producer.go_on(100)
            producer.wait_for(150)
            killed_at = time.monotonic()
        producer.go_on(150)
        promoted = finish_failover(cluster, producer, capsys) - killed_at

        in_table = queued_in_table(both, queue)
        # A backend of the killed postmaster may still commit a few before it
        # notices: acknowledged, and lost with the rest of the gap.
        acked = producer.acked
        assert acked == list(range(len(acked))) and len(acked) >= 150
        assert in_table == list(range(100)), "the loss is not exactly the replication gap"
        got = drain_after_reattach(idle, queue)
        assert got == in_table, "the engine did not deliver exactly what the new primary holds"
        if isinstance(producer.error, InDoubt):
            assert idle.in_doubt_outcome(producer.error) is False  # in the gap: lost
        print(f"\nasync fail-over: the producer's last commit raised {producer.error!r}")
        # The section had the lost entries as ready: the dequeues repaired
        # them from the rows. New entries go through.
        for n in (1000, 1001):
            idle.enqueue(queue, str(n).encode())
            idle.commit()
        assert drain_after_reattach(idle, queue) == [1000, 1001]
        idle.close()
        print(
            f"\nasync fail-over: {len(acked)} acknowledged, {len(in_table)} on the new "
            f"primary, {len(acked) - len(in_table)} lost (the gap: all acknowledged after "
            f"entry 99), kill to promoted: {promoted:.2f} s"
        )


def test_async_failover_delivers_entries_whose_dequeue_was_lost_in_the_gap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pair_with_queue(tmp_path / "home", capsys, "--async") as (cluster, both, queue):
        with connect(both) as session:
            commit_numbers(session, queue, 20)
            dequeues_lost_in_the_gap(cluster, capsys, session, queue, 5)
            assert queued_in_table(both, queue) == list(range(20))  # the dequeues were lost
            got = drain_after_reattach(session, queue)
        assert got == list(range(20))


def test_the_old_primary_is_rewound_after_the_new_one_recycled_wal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by the fail-over hunt (async, 1 run of 4): checkpoints on the new
    primary between the promotion and the rebuild recycled the segment of the
    fork, so the rewound old primary could not stream ("requested WAL segment
    ... has already been removed") and the rebuild failed after a minute. The
    promotion makes the old primary's slot at once, so the WAL is kept, and a
    rewound server that still cannot stream is copied anew."""
    home = tmp_path / "home"
    with pair_with_queue(home, capsys, "--async") as (cluster, both, queue):
        fail_over_after(cluster, capsys, both, queue, 20)
        with psycopg.connect(both, autocommit=True) as conn:
            conn.execute("CREATE TABLE churn (x int)")
            for _ in range(4):  # the fork's segment is no longer the newest ones
                conn.execute("INSERT INTO churn SELECT generate_series(1, 1000)")
                conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
        code, out, err = cli(capsys, "db", "standby", "rebuild", "--home", str(home))
        assert code == 0, err
        assert "pg_rewind" in out, out  # rewound, not copied anew
        sb = present(cluster.standby_status())
        assert sb.in_recovery is True and sb.streaming == "streaming"


def test_the_old_primary_comes_back_as_a_standby_of_the_new_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    with pair_with_queue(home, capsys, "--sync") as (cluster, both, queue):
        old_datadir, old_port = cluster.datadir, cluster.status().port
        fail_over_after(cluster, capsys, both, queue, 50)
        # Written on the new primary alone: what the old one must catch up on.
        with psycopg.connect(both, autocommit=True) as conn:
            conn.execute("CREATE TABLE after_promotion (x int)")
            conn.execute("INSERT INTO after_promotion SELECT generate_series(1, 1000)")

        began = time.monotonic()
        code, out, err = cli(capsys, "db", "standby", "rebuild", "--home", str(home))
        assert code == 0, err
        rebuilt = time.monotonic() - began
        assert "pg_rewind" in out or "nothing to rewind" in out, out
        sb = present(cluster.standby_status())
        assert sb.datadir == old_datadir and sb.port == old_port  # same port: `both` still holds
        assert sb.in_recovery is True and sb.streaming == "streaming" and sb.sync_state == "sync"

        # A synchronous commit on the new primary returns: the rebuilt standby
        # has it on disk; once replayed, it reads what the new primary has.
        with connect(both) as session:
            session.enqueue(queue, b"50")
            session.commit()
        with psycopg.connect(both, autocommit=True) as conn:
            lsn = present(conn.execute("SELECT pg_current_wal_lsn()").fetchone())[0]
        with psycopg.connect(present(sb.dsn), autocommit=True) as standby:

            what = "the rebuilt standby to replay the new primary's WAL"
            wait_for_standby(standby, "replay", lsn, what)
            assert standby.execute("SELECT count(*) FROM after_promotion").fetchone() == (1000,)
            count = sql.SQL("SELECT count(*) FROM {} WHERE state = 1").format(queue_table(queue))
            rows = standby.execute(count).fetchone()  # state 1: queued
            assert rows == (51,)

        code, out, err = cli(capsys, "db", "status", "--home", str(home))
        assert code == 0, err
        roles = [" ".join(line.split()) for line in out.splitlines() if "role" in line]
        assert roles == [
            "role primary (pg_is_in_recovery: false)",
            "role standby (pg_is_in_recovery: true)",
        ]
        print(f"\nrebuild of the old primary: {rebuilt:.2f} s")

        # Removed, then made anew: the new standby goes where the old primary was.
        code, _, err = cli(capsys, "db", "standby", "remove", "--home", str(home))
        assert code == 0, err
        assert not old_datadir.exists() and cluster.standby_status() is None
        assert cluster.start_standby(sync=False) != cluster.url()
        sb = present(cluster.standby_status())
        assert sb.datadir == old_datadir and sb.in_recovery is True and sb.mode == "async"


def test_the_pair_restarts_on_its_ports_and_a_stopped_standby_is_not_waited_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    with pair(home, capsys, "--sync") as cluster:
        both = cluster.url(both=True)
        code, _, err = cli(capsys, "db", "stop", "--home", str(home))
        assert code == 0, err
        code, out, err = cli(capsys, "db", "start", "--home", str(home))
        assert code == 0, err
        assert "standby running (sync" in out
        assert cluster.url(both=True) == both  # both servers kept their ports

        def waits_for() -> str:
            with psycopg.connect(cluster.url("postgres")) as conn:
                return str(present(conn.execute("SHOW synchronous_standby_names").fetchone())[0])

        sb = present(cluster.standby_status())
        assert waits_for() == "ringq_standby" and sb.sync_state == "sync"
        code, _, err = cli(capsys, "db", "standby", "stop", "--home", str(home))
        assert code == 0, err
        assert waits_for() == ""  # commits no longer wait for it
        code, out, err = cli(capsys, "db", "status", "--home", str(home))
        assert "stopped by 'ringq db standby stop'" in out
        code, _, err = cli(capsys, "db", "start", "--home", str(home))
        assert code == 0 and not present(cluster.standby_status()).running  # stays stopped
        code, _, err = cli(capsys, "db", "standby", "start", "--home", str(home))
        assert code == 0, err
        sb = present(cluster.standby_status())
        assert waits_for() == "ringq_standby" and sb.sync_state == "sync"  # its mode kept


def test_the_multi_host_dsn_is_taken_where_a_dsn_is(tmp_path: Path) -> None:
    url = "postgresql://postgres@127.0.0.1:5001,127.0.0.1:5002/ringq?target_session_attrs=read-write"
    params = check_dsn(url)
    assert params["port"] == "5001,5002" and params["target_session_attrs"] == "read-write"
    keywords = (
        "host=127.0.0.1,127.0.0.1 port=5001,5002 dbname=ringq password=secret "
        "target_session_attrs=read-write"
    )
    assert check_dsn(keywords)["host"] == "127.0.0.1,127.0.0.1"
    assert "secret" not in redact_dsn(keywords)
    assert "secret" not in redact_dsn(url.replace("postgres@", "postgres:secret@"))


def test_the_monitor_names_the_promoted_standby_as_the_primary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringq.monitor import Monitor, MonitorConfig

    with pair(tmp_path / "home", capsys, "--async") as cluster:
        both = cluster.url(both=True)
        old_port = present(cluster.status().port)
        new_port = present(present(cluster.standby_status()).port)
        make_queue(both)  # the monitor needs the schema
        with Monitor(MonitorConfig(both, port=0, interval=0.2, recovery_interval=0.05)) as mon:
            url = present(mon.url)

            def server() -> dict[str, Any] | None:
                doc = mon.documents.queues_doc()["server"]
                return doc if doc and doc["port"] in (old_port, new_port) else None

            before = wait_for(server, what="the monitor's first reading of its server")
            assert before["port"] == old_port and before["primary"] is True
            assert before["timeline"] == 1 and before["section_follows"] is True

            kill_primary(cluster)
            began = time.monotonic()
            promote(cluster, capsys)
            after = wait_for(
                lambda: (s := server()) and s["port"] == new_port and s["section_follows"] and s,
                timeout=20,
                what="the monitor on the promoted standby",
            )
            followed = time.monotonic() - began
            assert after["primary"] is True and after["timeline"] == 2
            assert after["system_identifier"] == before["system_identifier"]
            assert after["section_history"] == {
                "system_identifier": before["system_identifier"], "timeline": 2,
            }
            code, out, err = cli(capsys, "status", "--monitor", url)
            assert code == 0, err
            line = f"server {after['address']} primary, timeline 2 (section: timeline 2)"
            assert line in out.splitlines(), out
            print(f"\nmonitor on the promoted standby {followed:.2f} s after the kill: {line}")
