"""Entries that wait (issue 24): delayed enqueues and retry backoff.

Due times come from the database's clock and live in the rows; the section
keeps them for the entries that wait. These tests check from the outside
that no entry is received before its row's ``not_before`` (the row's
``deq_at``, the database's time of the consuming write, is never earlier),
in shared, single and grouped queues, across a rollback with backoff, a
consumer killed with kill -9 and a section removed while entries wait.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import closing
from datetime import UTC, datetime, timedelta
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import cli, handle_one, own_server_queue, present, remove_section, worker_of
from psycopg import sql
from ringq.engine import (
    ConfigError,
    DatabaseUnavailable,
    InvalidArgument,
    InvalidArgumentType,
    Message,
    Session,
    StaleSection,
    connect,
    queue_table,
)
from ringq.engine import layout as L
from ringq.engine import metrics as M
from ringq.engine.recovery import recover_dead_clients, repair_lock_holders, resolve_prepared
from ringq.scripting import alter_retry, list_exceptions
from ringq.worker import Actions, Retry

RECHECK_S = 1.0  # a sleeping dequeuer's recheck (the engine's CLAIM_RECHECK_S)

FORK = mp.get_context("fork")


def row_times(dsn: str, queue: str, seq: int) -> tuple[datetime | None, datetime | None]:
    """(not_before, deq_at) of the row holding ``seq``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT not_before, deq_at FROM {} WHERE seq = %s").format(
                queue_table(queue)
            ),
            (seq,),
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def lateness(dsn: str, queue: str, seq: int) -> float:
    """Seconds from the row's due time to the database's clock now."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT extract(epoch FROM clock_timestamp() - not_before)::float8 "
                "FROM {} WHERE seq = %s"
            ).format(queue_table(queue)),
            (seq,),
        ).fetchone()
    assert row is not None and row[0] is not None
    return float(row[0])


def waits_then_arrives(
    s: Session, dsn: str, queue: str, seq: int, deliveries: int, *, wait: float = 3.0
) -> None:
    """Entry ``seq`` is not received now; it is received within ``wait``
    seconds, with ``deliveries``, and not before its row's due time."""
    assert s.dequeue(queue) is None
    s.commit()
    m = present(s.dequeue(queue, wait=wait))
    assert (m.seq, m.deliveries) == (seq, deliveries)
    s.commit()
    assert_not_early(dsn, queue, seq)


def assert_not_early(dsn: str, queue: str, seq: int) -> None:
    """The consumed row's dequeue time is not before its due time."""
    not_before, deq_at = row_times(dsn, queue, seq)
    assert not_before is not None and deq_at is not None
    assert deq_at >= not_before, (deq_at, not_before)


def test_bad_due_arguments_are_refused(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()
    with connect(dsn) as s:
        for bad in (-1, math.nan, math.inf):
            with pytest.raises(InvalidArgument):
                s.enqueue(q, b"x", delay=bad)
        with pytest.raises(InvalidArgumentType):
            s.enqueue(q, b"x", delay="1")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentType):
            s.enqueue(q, b"x", delay=True)
        with pytest.raises(InvalidArgument):
            s.enqueue(q, b"x", not_before=datetime(2030, 1, 1))  # naive
        with pytest.raises(InvalidArgument):
            s.enqueue(q, b"x", delay=1, not_before=datetime.now(UTC))
        with pytest.raises(InvalidArgument):
            s.enqueue_many(q, [b"x"], delay=-0.5)
        with pytest.raises(InvalidArgument):
            s.rollback(retry_after=-1)
        s.commit()
        assert s.dequeue(q) is None  # nothing was enqueued
        s.commit()


@pytest.mark.parametrize("cache_payload", [0, 64])
def test_shared_consumers_read_past_an_entry_not_due(
    dsn: str, make_queue: Callable[..., str], cache_payload: int
) -> None:
    q = make_queue(dequeue_mode="shared", cache_payload=cache_payload)
    with connect(dsn) as s:
        late = s.enqueue(q, b"late", delay=0.4)
        s.enqueue(q, b"now")
        s.commit()
        ring = s.ring(q)
        assert ring.Q[ring.qb + L.Q_N_WAITING] == 1
        assert ring.Q[ring.qb + L.Q_DEPTH_HINT] == 2  # depth counts the waiting entry
        assert present(s.dequeue(q)).payload == b"now"
        s.commit()
        assert s.dequeue(q) is None
        s.commit()
        m = present(s.dequeue(q, wait=2.0))
        assert m.payload == b"late" and m.seq == late
        s.commit()
        assert s.dequeue(q) is None
        s.commit()
    assert_not_early(dsn, q, late)


def test_single_mode_head_waits(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(dequeue_mode="single")
    with connect(dsn) as s:
        s.enqueue(q, b"first", delay=0.3)
        s.enqueue(q, b"second")
        s.commit()
        assert s.dequeue(q) is None  # order is the promise: the head waits
        s.commit()
        got = [present(s.dequeue(q, wait=2.0)).payload]
        got.append(present(s.dequeue(q)).payload)
        s.commit()
        assert got == [b"first", b"second"]


def test_a_group_waits_for_its_head_others_go_on(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(dequeue_mode="shared")
    with connect(dsn) as s:
        s.enqueue(q, b"g1", group="g", delay=0.3)
        s.enqueue(q, b"g2", group="g")
        s.enqueue(q, b"h1", group="h")
        s.commit()
        assert [m.payload for m in s.dequeue_many(q, 10)] == [b"h1"]
        s.commit()
        assert s.dequeue_many(q, 10) == []
        s.commit()
        first = present(s.dequeue(q, wait=2.0))
        assert first.payload == b"g1"
        assert s.dequeue(q) is None  # one entry of a group held at a time
        s.commit()
        assert present(s.dequeue(q)).payload == b"g2"
        s.commit()


def test_a_host_clock_an_hour_ahead_releases_nothing_early(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Due times are the database's clock, compared with the host's estimate
    of it (monotonic time plus the offset answers stamp): the host's wall
    clock jumping an hour ahead (here: in this process) releases nothing."""
    q = make_queue(dequeue_mode="shared")
    wall, wall_ns = time.time, time.time_ns
    monkeypatch.setattr(time, "time", lambda: wall() + 3600)
    monkeypatch.setattr(time, "time_ns", lambda: wall_ns() + 3600 * 10**9)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"in a second", delay=1.0)
        s.commit()
        assert s.dequeue(q) is None
        s.commit()
        assert present(s.dequeue(q, wait=3.0)).seq == seq
        s.commit()
    assert_not_early(dsn, q, seq)


def test_not_before_and_enqueue_many(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(dequeue_mode="shared")
    with psycopg.connect(dsn, autocommit=True) as conn:
        db_now = present(conn.execute("SELECT clock_timestamp()").fetchone())[0]
    with connect(dsn) as s:
        seqs = s.enqueue_many(q, [b"a", b"b"], not_before=db_now + timedelta(seconds=0.3))
        later = s.enqueue_many(q, [b"c"], delay=60)
        s.commit()
        assert s.dequeue_many(q, 10) == []
        s.commit()
        got = present(s.dequeue(q, wait=2.0))
        got2 = present(s.dequeue(q))
        s.commit()
        assert [got.payload, got2.payload] == [b"a", b"b"]
        assert s.dequeue(q) is None  # c is due in a minute
        s.commit()
        assert s.ring(q).Q[s.ring(q).qb + L.Q_N_WAITING] == 1
    for seq in seqs:
        assert_not_early(dsn, q, seq)
    not_before, _ = row_times(dsn, q, later[0])
    assert not_before is not None and not_before > db_now + timedelta(seconds=59)


def test_a_delay_counts_from_the_commit_not_the_enqueue_call(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared")
    with connect(dsn) as s, connect(dsn) as consumer:
        seq = s.enqueue(q, b"half a second after the commit", delay=0.5)
        time.sleep(0.8)  # longer than the delay, before the commit
        s.commit()
        assert consumer.dequeue(q) is None  # due 0.5 s after the commit, not before it
        consumer.commit()
        assert present(consumer.dequeue(q, wait=3.0)).seq == seq
        consumer.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        [(after_write,)] = conn.execute(
            sql.SQL("SELECT extract(epoch FROM not_before - enq_at)::float8 FROM {} "
                    "WHERE seq = %s").format(queue_table(q)), (seq,)
        ).fetchall()
    assert 0.5 <= after_write < 0.7  # from the commit's row write (its transaction's start)


def test_a_waiting_dequeuer_is_woken_at_the_entrys_time_not_by_its_recheck(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A dequeuer sleeping on the queue wakes when the entry falls due (it
    sleeps until the due time), not at its 1 s recheck. The bound is half the
    recheck, not a speed figure (bench/bench_delays.py measures the lateness:
    a few ms): on a loaded 2-core machine a 50 ms bound failed for load alone."""
    q = make_queue(dequeue_mode="shared")
    worst = 0.0
    with connect(dsn) as producer, connect(dsn) as consumer:
        for _ in range(5):
            seq = producer.enqueue(q, b"timed", delay=0.25)
            producer.commit()
            m = present(consumer.dequeue(q, wait=3.0))
            late = lateness(dsn, q, seq)
            assert m.seq == seq
            assert late >= 0.0  # never before its time
            worst = max(worst, late)
            consumer.commit()
    assert worst < RECHECK_S / 2, worst


def test_retry_backoff_is_constant_then_exponential(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared", max_deliveries=10, retry_delay=0.2)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"flaky")
        s.commit()
        assert present(s.dequeue(q)).deliveries == 1
        s.rollback()
        assert s.dequeue(q) is None  # not back before its backoff
        s.commit()
        not_before, _ = row_times(dsn, q, seq)
        assert not_before is not None
        m = present(s.dequeue(q, wait=2.0))
        assert m.deliveries == 2
        s.commit()
        assert_not_early(dsn, q, seq)
    # exponential: 0.1, 0.2, 0.4 ... capped at 0.3
    with psycopg.connect(dsn) as conn:
        alter_retry(conn, q, retry_delay=0.1, retry_factor=2.0, retry_max=0.3)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"again")
        s.commit()
        gaps = []
        for _ in range(4):
            present(s.dequeue(q, wait=3.0))
            with psycopg.connect(dsn, autocommit=True) as conn:
                t0 = present(conn.execute("SELECT clock_timestamp()").fetchone())[0]
            s.rollback()
            not_before, _ = row_times(dsn, q, seq)
            assert not_before is not None
            gaps.append((not_before - t0).total_seconds())
        assert present(s.dequeue(q, wait=3.0)).deliveries == 5
        s.commit()
    expect = [0.1, 0.2, 0.3, 0.3]
    for gap, want in zip(gaps, expect, strict=True):
        assert want - 0.01 <= gap <= want + 0.1, (gaps, expect)


@pytest.mark.parametrize("backoff", [0.0, 30.0])
def test_rollback_with_retry_after_wins_over_the_backoff(
    dsn: str, make_queue: Callable[..., str], backoff: float
) -> None:
    """``retry_after`` sets this rollback's delay, shorter or longer than the
    queue's own backoff (30 s here: the entry comes back within 2 s)."""
    q = make_queue(dequeue_mode="single", retry_delay=backoff)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"later")
        s.commit()
        present(s.dequeue(q))
        s.rollback(retry_after=0.3)
        waits_then_arrives(s, dsn, q, seq, 2, wait=2.0)


def test_an_entry_with_a_backoff_is_still_poisoned_at_max_deliveries(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared", max_deliveries=2, retry_delay=0.2)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"bad")
        s.commit()
        present(s.dequeue(q))
        s.rollback()
        assert s.dequeue(q) is None  # waits for its backoff
        s.commit()
        assert present(s.dequeue(q, wait=2.0)).deliveries == 2
        s.rollback()  # the last delivery: poisoned, not made to wait
        assert s.dequeue(q, wait=0.5) is None
        s.commit()
        ring = s.ring(q)
        assert M.due_figures(s.section, ring.qidx)[M.WAITING_ENTRIES] == 0
    with psycopg.connect(dsn) as conn:
        assert [(e.seq, e.deliveries) for e in list_exceptions(conn, q)] == [(seq, 2)]


def test_a_prepared_dequeue_rolled_back_waits_for_its_backoff(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared", retry_delay=0.3)
    gid = "delays-" + os.urandom(4).hex()
    with connect(dsn) as s, connect(dsn) as other:
        seq = s.enqueue(q, b"prepared")
        s.commit()
        s.tpc_begin(s.xid(gid))
        assert present(s.dequeue(q)).seq == seq
        s.tpc_prepare()
        s.tpc_rollback()  # ROLLBACK PREPARED: a delivery that did not commit
        waits_then_arrives(other, dsn, q, seq, 2, wait=2.0)  # after its backoff


def test_a_group_waits_for_its_retried_head_across_the_rings_end(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A grouped entry given back with a backoff holds its group's later
    entries; other groups go on. The window wraps around the ring's end
    (capacity 8, the tail moved to slot 6 first), so the claim's look at the
    waiting entries reads both ends of the ring."""
    q = make_queue(capacity=8, dequeue_mode="shared", retry_delay=0.4)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"x"] * 6)
        s.commit()
        assert len(s.dequeue_many(q, 6)) == 6
        s.commit()
        s.enqueue_many(q, [b"g1", b"g2", b"h1", b"g3"], group=["g", "g", "h", "g"])
        s.commit()
        assert present(s.dequeue(q)).payload == b"g1"
        s.rollback()  # g1 waits 0.4 s; g2 and g3 wait behind it
        assert [m.payload for m in s.dequeue_many(q, 10)] == [b"h1"]
        s.commit()
        assert s.dequeue_many(q, 10) == []
        s.commit()
        got = present(s.dequeue(q, wait=3.0))
        assert (got.payload, got.deliveries) == (b"g1", 2)
        s.commit()
        assert [present(s.dequeue(q)).payload for _ in range(1)] == [b"g2"]
        s.commit()
        assert present(s.dequeue(q)).payload == b"g3"
        s.commit()


def _hold(dsn: str, queue: str, ready: Event) -> None:
    s = connect(dsn)
    assert s.dequeue(queue, wait=5.0) is not None
    ready.set()
    time.sleep(60)  # held until killed


def test_kill9_of_a_consumer_holding_a_delayed_entry(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared", retry_delay=0.3)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"precious", delay=0.1)
        s.commit()
        ready = FORK.Event()
        p = FORK.Process(target=_hold, args=(dsn, q, ready))
        p.start()
        assert ready.wait(30)
        os.kill(present(p.pid), signal.SIGKILL)
        p.join(10)
        ring = s.ring(q)
        deadline = time.monotonic() + 10
        while ring.counts()["locked"] and time.monotonic() < deadline:
            recover_dead_clients(s.section, dsn)
        assert ring.counts()["locked"] == 0
        assert s.dequeue(q) is None  # struck with a backoff: it waits
        s.commit()
        m = present(s.dequeue(q, wait=3.0))
        assert m.payload == b"precious" and m.deliveries == 2
        s.commit()
    assert_not_early(dsn, q, seq)


def test_section_removed_while_entries_wait_is_rebuilt_with_due_times(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared")
    with connect(dsn) as s:
        seq = s.enqueue(q, b"patient", delay=0.5)
        s.enqueue(q, b"eager")
        s.commit()
    remove_section(dsn)
    with connect(dsn) as s:
        assert present(s.dequeue(q)).payload == b"eager"
        s.commit()
        ring = s.ring(q)
        assert ring.Q[ring.qb + L.Q_N_WAITING] == 1
        assert s.dequeue(q) is None
        s.commit()
        assert present(s.dequeue(q, wait=3.0)).payload == b"patient"
        s.commit()
    assert_not_early(dsn, q, seq)


@pytest.mark.parametrize("concurrency", [0, 8])
def test_a_worker_action_raising_retry_is_due_after_its_delay(
    dsn: str, make_queue: Callable[..., str], concurrency: int
) -> None:
    """The same with ``--concurrency`` (the sync action in a thread)."""
    q = make_queue(dequeue_mode="shared", max_deliveries=5)
    app = Actions()
    seen: list[int] = []

    @app.action(q)
    def flaky(msg: Message, session: Session) -> None:
        seen.append(msg.deliveries)
        if msg.deliveries == 1:
            raise Retry(after=0.3)

    with connect(dsn) as s:
        seq = s.enqueue(q, b"job")
        s.commit()
    with closing(worker_of(app, dsn, concurrency)) as w:
        assert handle_one(w)  # the action asked to be retried later
        with connect(dsn) as s:
            assert s.dequeue(q) is None  # not due yet
        assert handle_one(w)  # once due
        assert w.stats()["failed"] == 1 and w.stats()["handled"] == 1
    assert seen == [1, 2]
    assert_not_early(dsn, q, seq)
    with pytest.raises(ConfigError):
        Retry(after=-1)


def _roll_back_killed_at_line(dsn: str, queue: str, k: int) -> None:
    """Dequeue and roll back (the queue's backoff), SIGKILLed at the ``k``-th
    line ``Ring.finish_dequeue`` runs: between two of its writes, inside the
    queue lock. Exits 0 if the function has fewer lines than ``k``."""
    s = connect(dsn)
    assert s.dequeue(queue, wait=5.0) is not None
    code = type(s.ring(queue)).finish_dequeue.__code__
    lines = 0

    def in_finish(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
            if lines == k:
                os.kill(os.getpid(), signal.SIGKILL)
        return in_finish

    sys.settrace(lambda frame, event, arg: in_finish if frame.f_code is code else None)
    s.rollback()
    sys.settrace(None)
    os._exit(0)


def test_a_consumer_killed_at_any_write_of_its_backoff_give_back_loses_nothing(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A rollback with a backoff finishes its slot in the section with several
    writes (the due time and counters, DEQ, ENQ, LCK). Killed between any two
    (the lock released by the kernel), the monitor's repair and recovery
    decide the slot from its row: the entry comes back after its backoff,
    once. (With ENQ cleared before DEQ, recovery read the slot as a reserved
    enqueue and voided it: the entry was never delivered again.)"""
    q = make_queue(dequeue_mode="shared", retry_delay=0.2, max_deliveries=100)
    kills = 0
    with connect(dsn) as s:
        ring = s.ring(q)
        for k in range(1, 60):
            seq = s.enqueue(q, f"killed at line {k}".encode())
            s.commit()
            p = FORK.Process(target=_roll_back_killed_at_line, args=(dsn, q, k))
            p.start()
            p.join(30)
            if p.exitcode == 0:
                break  # past finish_dequeue's last line: nothing left to kill at
            assert p.exitcode == -signal.SIGKILL
            kills += 1
            repair_lock_holders(s.section, dsn)
            deadline = time.monotonic() + 20
            while ring.counts()["locked"]:
                recover_dead_clients(s.section, dsn)
                assert time.monotonic() < deadline, f"line {k}: the slot stays locked"
                time.sleep(0.05)
            m = s.dequeue(q, wait=3.0)
            assert m is not None and m.seq == seq, f"line {k}: the entry was lost"
            s.commit()
            assert_not_early(dsn, q, seq)
        else:
            pytest.fail("finish_dequeue never ran to its end")
        assert s.dequeue(q) is None  # each once
        s.commit()
    assert kills >= 5, kills


def _dequeue_prepare_and_die(dsn: str, queue: str, gid: str, ready: Event) -> None:
    s = connect(dsn)
    s.tpc_begin(s.xid(gid))
    assert s.dequeue(queue, wait=5.0) is not None
    s.tpc_prepare()
    ready.set()
    time.sleep(60)  # held until killed, prepared and undecided


def test_a_prepared_dequeue_recovery_rolls_back_waits_for_its_backoff(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A prepared dequeue whose coordinator died undecided is rolled back by
    recovery (``resolve_prepared``): a delivery that did not commit, so the
    entry is counted and comes back after the queue's backoff, as any other."""
    q = make_queue(dequeue_mode="shared", retry_delay=0.5)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"prepared, then orphaned")
        s.commit()
        ready = FORK.Event()
        p = FORK.Process(target=_dequeue_prepare_and_die,
                         args=(dsn, q, "delays-" + os.urandom(4).hex(), ready))
        p.start()
        assert ready.wait(30)
        os.kill(present(p.pid), signal.SIGKILL)
        p.join(10)
        deadline = time.monotonic() + 10
        while not recover_dead_clients(s.section, dsn):  # its slot: held, not guessed
            assert time.monotonic() < deadline
        assert [v for _gid, v in resolve_prepared(s.section, dsn, timeout_s=0)] == ["rollback"]
        waits_then_arrives(s, dsn, q, seq, 2)  # counted, and waiting for its backoff


@pytest.mark.parametrize("cache_payload", [0, 64])
def test_an_entry_ready_in_the_section_while_its_row_waits_is_not_taken(
    dsn: str, make_queue: Callable[..., str], cache_payload: int
) -> None:
    """The row decides. Two deciders of a dead delivery can leave an entry
    ready in the section while its row holds a backoff (one decided from
    the row before the other's strike wrote it). Made here by hand: the
    dequeue refuses the row (read from it: the slot waits; served from the
    payload cache: the commit fails with StaleSection and the queue is
    re-read), and the entry is received once, after its due time."""
    q = make_queue(dequeue_mode="shared", cache_payload=cache_payload)
    with connect(dsn) as s:
        seq = s.enqueue(q, b"its row says wait")
        s.commit()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("UPDATE {} SET not_before = clock_timestamp() + interval '0.5 s' "
                        "WHERE seq = %s").format(queue_table(q)), (seq,)
            )
        if cache_payload:
            assert present(s.dequeue(q)).seq == seq  # from the cache: consumed at commit
            with pytest.raises(StaleSection):
                s.commit()
        else:
            assert s.dequeue(q) is None
            s.commit()
        waits_then_arrives(s, dsn, q, seq, 1)  # it waits for its row's time now


def test_a_delayed_enqueue_in_a_two_phase_transaction_waits_after_its_commit(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared")
    gid = "delays-" + os.urandom(4).hex()
    with connect(dsn) as s, connect(dsn) as consumer:
        s.tpc_begin(s.xid(gid))
        seq = s.enqueue(q, b"prepared", delay=0.3)
        s.tpc_prepare()
        assert consumer.dequeue(q) is None  # prepared: not on the queue yet
        consumer.commit()
        s.tpc_commit()
        assert consumer.dequeue(q) is None  # committed, not due yet
        consumer.commit()
        m = present(consumer.dequeue(q, wait=3.0))
        assert m.seq == seq
        consumer.commit()
    assert_not_early(dsn, q, seq)


def test_a_dequeuer_waiting_on_a_single_queue_another_holds_sleeps_past_a_due_time(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A ``single`` queue whose role another session holds has nothing for a
    second dequeuer; when a waiting entry falls due meanwhile, that dequeuer's
    look releases it (the queue's next due time moves on) and it sleeps again,
    rather than looking again at once until its wait ends (it did: some
    100,000 empty looks in a second, a CPU's worth)."""
    q = make_queue(dequeue_mode="single")
    with connect(dsn) as holder, connect(dsn) as other:
        holder.enqueue(q, b"first")
        holder.enqueue(q, b"due soon", delay=0.2)
        holder.commit()
        assert present(holder.dequeue(q)).payload == b"first"  # holds the role
        looks = other.stats(q)[M.EMPTY_HITS]
        assert other.dequeue(q, wait=1.0) is None  # the role is the holder's
        other.commit()
        assert other.stats(q)[M.EMPTY_HITS] - looks < 100
        holder.commit()
        assert present(holder.dequeue(q)).payload == b"due soon"
        holder.commit()
        assert M.due_figures(holder.section, holder.ring(q).qidx)[M.WAITING_ENTRIES] == 0


def test_in_a_two_phase_transaction_a_delay_counts_from_the_prepare(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """The row write, and so the due time, goes with ``tpc_prepare()`` (the
    README says so): a delay shorter than the time to COMMIT PREPARED has
    passed by then, and the entry is ready at once."""
    q = make_queue(dequeue_mode="shared")
    with connect(dsn) as s, connect(dsn) as consumer:
        s.tpc_begin(s.xid("delays-" + os.urandom(4).hex()))
        seq = s.enqueue(q, b"due at prepare + 0.3 s", delay=0.3)
        s.tpc_prepare()
        time.sleep(0.6)
        s.tpc_commit()
        assert present(consumer.dequeue(q)).seq == seq
        consumer.commit()
    assert_not_early(dsn, q, seq)


def test_a_retried_entry_of_a_single_queue_holds_back_the_entries_behind_it(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="single", retry_delay=0.3)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"a", b"b"])
        s.commit()
        assert present(s.dequeue(q)).payload == b"a"
        s.rollback()
        assert s.dequeue(q) is None  # the head waits for its backoff; b stays behind it
        s.commit()
        got = [m.payload for m in s.dequeue_many(q, 10, wait=3.0)]
        got += [m.payload for m in s.dequeue_many(q, 10)]
        s.commit()
        assert got == [b"a", b"b"]


def retry_settings(dsn: str, queue: str) -> tuple[float, float, float]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT retry_delay, retry_factor, retry_max FROM ringq.queues WHERE name = %s",
            (queue,),
        ).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def test_queue_create_and_alter_set_the_retry_backoff(
    dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "rq_" + os.urandom(4).hex()
    code, _out, err = cli(capsys, "queue", "create", name, "--capacity", "64", "--max-payload",
                          "64", "--retry-delay", "0.5", "--retry-factor", "2", "--dsn", dsn)
    assert code == 0, err
    assert retry_settings(dsn, name) == (0.5, 2.0, 0.0)
    code, _out, err = cli(capsys, "queue", "alter", name, "--retry-max", "30", "--dsn", dsn)
    assert code == 0, err
    assert retry_settings(dsn, name) == (0.5, 2.0, 30.0)  # the others kept
    code, _out, err = cli(capsys, "queue", "alter", name, "--retry-factor", "0.5", "--dsn", dsn)
    assert code == 2 and "retry_factor" in err
    code, _out, err = cli(capsys, "queue", "alter", "no_such_queue", "--retry-delay", "1",
                          "--dsn", dsn)
    assert code == 4, err
    assert retry_settings(dsn, name) == (0.5, 2.0, 30.0)
    remove_section(dsn)


def test_entries_waiting_across_a_database_restart_keep_their_due_times(
    tmp_path: Path, face: Callable[..., Any]
) -> None:
    """The server stops and starts again while entries wait (the section stays
    on the host): none is received before its time, each once, the delayed
    one and a retried one alike (either face)."""
    with own_server_queue(tmp_path / "pg", dequeue_mode="shared", retry_delay=2.0) as (
        cluster, dsn, q,
    ):
        with face(dsn) as s:
            s.enqueue(q, b"late", delay=2.0)
            s.enqueue(q, b"retried")
            s.commit()
            assert present(s.dequeue(q)).payload == b"retried"
            s.rollback()  # due again 2 s from now (the queue's backoff)
        t_due = time.monotonic() + 2.0
        cluster.stop()
        assert cluster.start() == dsn
        got: list[tuple[bytes, int]] = []
        with face(dsn) as s:
            while len(got) < 2:
                try:
                    m = s.dequeue(q, wait=0.2)
                    s.commit()
                except DatabaseUnavailable:
                    continue  # the first call after the restart finds its connection gone
                if m is not None:
                    assert time.monotonic() >= t_due - 0.3, "received before its due time"
                    got.append((m.payload, m.deliveries))
                assert time.monotonic() < t_due + 30, "the waiting entries never came"
        assert sorted(got) == [(b"late", 1), (b"retried", 2)]
        with psycopg.connect(dsn) as conn:
            early = conn.execute(sql.SQL(
                "SELECT count(*) FROM {} WHERE state = 2 AND deq_at < not_before"
            ).format(sql.Identifier("ringq", "q_" + q))).fetchone()
            assert early == (0,)  # by the database's clock too
