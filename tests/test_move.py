"""The mover: outbox in database 1 to inbox in database 2, no 2PC, nothing twice.

Two databases on the test cluster; processes killed with SIGKILL between the
two commits (deterministically, through the mover's hook) and at random
points; the test loop plays the monitor (recover_dead_clients, reclaim_all).
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import psycopg
import pytest
from conftest import drain, present, queue_in, remove_section
from psycopg import sql
from ringq.engine import connect, queue_table
from ringq.engine.recovery import reclaim_all, recover_dead_clients, repair_lock_holders
from ringq.move import (
    MoveConfig,
    MoveLockHeld,
    Mover,
    MoveWontFit,
    envelope_overhead,
    is_moved,
    move_key,
    unwrap,
    wrap,
)

FORK = mp.get_context("fork")


# The mover's queues: 256 slots unless told (either database; both sections go
# with the databases). A destination takes the source's 1,024 bytes plus the envelope.
_queue = functools.partial(queue_in, capacity=256)
_dst = functools.partial(queue_in, capacity=256, max_payload=1024 + 512)


def produce(dsn: str, queue: str, producer: str, n: int, per_tx: int = 1) -> None:
    with connect(dsn, producer=producer) as s:
        for i in range(1, n + 1):
            s.enqueue(queue, json.dumps({"p": producer, "i": i}).encode())
            if i % per_tx == 0 or i == n:
                s.commit()


def move_until_empty(mv: Mover) -> dict[str, int]:
    """Move batches until the source has nothing ready; the mover's stats then."""
    while mv.move_batch():
        pass
    return mv.get_stats()


def check_arrivals(msgs: list[Any], expected: dict[str, int]) -> None:
    """Every source entry exactly once, and per producer in order."""
    by_producer: dict[str, list[int]] = defaultdict(list)
    origins = set()
    for m in msgs:
        moved = unwrap(m)
        assert (moved.origin, moved.origin_seq) not in origins, f"arrived twice: {moved}"
        origins.add((moved.origin, moved.origin_seq))
        body = json.loads(moved.payload)
        assert body["p"] == moved.producer and body["i"] == moved.producer_seq
        by_producer[moved.producer].append(moved.producer_seq)
    assert set(by_producer) == set(expected)
    for p, seqs in by_producer.items():
        assert seqs == list(range(1, expected[p] + 1)), f"producer {p}: {seqs[:20]}..."


# -- the envelope ---------------------------------------------------------------------------------


def test_envelope_round_trip() -> None:
    from datetime import UTC, datetime, timedelta

    from ringq.engine import Message

    m = Message("outbox", 12345, b"\x00\xffbody", "host:1:2", 7, datetime.now(UTC), 1)
    data = wrap(m, "abc123", 9)
    assert is_moved(data) and not is_moved(b"plain")
    got = unwrap(data)
    assert got.payload == b"\x00\xffbody"
    assert (got.origin_instance, got.origin_queue, got.origin_queue_id, got.origin_seq) == (
        "abc123", "outbox", 9, 12345,
    )
    assert (got.producer, got.producer_seq, got.enqueued_at) == ("host:1:2", 7, m.enqueued_at)
    micros = (m.enqueued_at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)
    assert got.key == move_key("abc123", 9, 12345, m.enqueued_at) == f"mv:abc123:9:12345@{micros}"
    # the same sequence enqueued at another time (given again after a fail-over): another key
    assert move_key("abc123", 9, 12345, m.enqueued_at + timedelta(microseconds=1)) != got.key
    with pytest.raises(ValueError):
        unwrap(b"plain")


# -- moving ----------------------------------------------------------------------------------------


def test_moves_everything_once_in_order(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn), _dst(dsn2)
    for p in ("a", "b", "c"):
        produce(dsn, src, p, 40, per_tx=7)
    with Mover(dsn, src, dsn2, dst, config=MoveConfig(batch=16)) as mv:
        total = 0
        while (n := mv.move_batch()):
            total += n
        stats = mv.get_stats()
    assert total == 120 and stats["moved"] == 120 and stats["duplicates"] == 0
    msgs = drain(dsn2, dst, batch=100)
    check_arrivals(msgs, {"a": 40, "b": 40, "c": 40})
    assert drain(dsn, src, batch=100) == []


def test_groups_survive_a_move_in_order(dsn: str, dsn2: str) -> None:
    """Entries of three groups, interleaved, plus some of none: each arrives in
    the source entry's group, and each group in its order (a source batch
    takes one entry per group, so a batch's arrivals never reorder a group)."""
    src, dst = _queue(dsn), _dst(dsn2, dequeue_mode="shared")
    sent: dict[str | None, list[int]] = defaultdict(list)
    with connect(dsn, producer="a") as s:
        for i in range(1, 46):
            group = None if i % 4 == 0 else f"g{i % 3}"
            s.enqueue(src, json.dumps({"p": "a", "i": i, "g": group}).encode(), group=group)
            sent[group].append(i)
            if i % 5 == 0:
                s.commit()
        s.commit()
    with Mover(dsn, src, dsn2, dst, config=MoveConfig(batch=16)) as mv:
        assert move_until_empty(mv)["moved"] == 45
    msgs = drain(dsn2, dst, batch=100)
    arrived: dict[str | None, list[int]] = defaultdict(list)
    for m in msgs:
        body = json.loads(unwrap(m).payload)
        assert m.group == body["g"]  # Message.group at the destination is the source's
        arrived[m.group].append(body["i"])
    assert arrived == sent and set(sent) == {"g0", "g1", "g2", None}
    assert drain(dsn, src, batch=100) == []


def _not_before(dsn: str, queue: str) -> list[tuple[bytes, Any]]:
    """(payload, not_before) of the queue's entries, by sequence."""
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            sql.SQL("SELECT payload, not_before FROM {} WHERE seq >= 0 ORDER BY seq").format(
                queue_table(queue)
            )
        ).fetchall()
    return [(bytes(p), nb) for p, nb in rows]


def test_a_moved_entry_keeps_its_due_time(dsn: str, dsn2: str) -> None:
    """Issue 24: an entry is due in the destination when it was due in the
    source (its row's not_before, a delay's or a retry's backoff, goes with
    it); entries without one arrive without one. The source is single: its
    head waits, so the mover takes the delayed entry only once it is due."""
    src, dst = _queue(dsn, max_deliveries=10, retry_delay=0.2), _dst(dsn2, dequeue_mode="shared")
    with connect(dsn, producer="a") as s:
        s.enqueue(src, b"first")
        s.enqueue(src, b"delayed", delay=0.5)
        s.enqueue(src, b"after")
        s.commit()
        m = present(s.dequeue(src))
        assert m.payload == b"first"
        s.rollback()  # a strike: back after retry_delay, with that due time in its row
    due = dict(_not_before(dsn, src))
    assert due[b"first"] is not None and due[b"delayed"] is not None and due[b"after"] is None
    with Mover(dsn, src, dsn2, dst, config=MoveConfig(batch=16, envelope=False)) as mv:
        moved = 0
        deadline = time.monotonic() + 10
        while moved < 3 and time.monotonic() < deadline:
            moved += mv.move_batch(wait=1.0)  # single: the head waits for its time
        assert moved == 3
    assert _not_before(dsn2, dst) == [
        (b"first", due[b"first"]), (b"delayed", due[b"delayed"]), (b"after", None)
    ]
    assert [m.payload for m in drain(dsn2, dst, batch=10)] == [b"first", b"delayed", b"after"]


def test_redelivered_after_destination_commit_is_skipped_by_key(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn, max_deliveries=10), _dst(dsn2)
    produce(dsn, src, "a", 10)

    class Crash(Exception):
        pass

    fail = {"left": 1}

    def between(msgs: Sequence[Any]) -> None:
        if fail["left"]:
            fail["left"] -= 1
            raise Crash  # database 2 committed, database 1 not: as if we died here

    with Mover(dsn, src, dsn2, dst, config=MoveConfig(batch=4), between_commits=between) as mv:
        with pytest.raises(Crash):
            mv.move_batch()
        stats = move_until_empty(mv)
    assert stats["redelivered"] == 4 and stats["duplicates"] == 4
    check_arrivals(drain(dsn2, dst, batch=100), {"a": 10})


def test_key_is_unique_across_wraps(dsn: str, dsn2: str) -> None:
    """Slots are reused every `capacity` entries; the sequence (and the key) is not."""
    src, dst = _queue(dsn, capacity=4), _dst(dsn2)
    with connect(dsn, producer="a") as prod:
        sec = prod.section
        with Mover(dsn, src, dsn2, dst, config=MoveConfig(batch=3, prune_every=2)) as mv:
            for i in range(1, 31):
                prod.enqueue(src, json.dumps({"p": "a", "i": i}).encode())
                if i % 3 == 0:
                    prod.commit()
                    move_until_empty(mv)
                    reclaim_all(sec)  # the monitor's reclaim: slots come round again
            stats = mv.get_stats()
    assert stats["moved"] == 30 and stats["duplicates"] == 0
    assert stats["pruned_keys"] > 0  # spent keys do not pile up in database 2
    check_arrivals(drain(dsn2, dst, batch=100), {"a": 30})


def test_a_sequence_given_again_after_a_fail_over_is_moved_too(dsn: str, dsn2: str) -> None:
    """After an asynchronous fail-over of the source, the sequences of
    entries lost in the replication gap are given again, to new entries. The
    source here forgets a moved entry as such a fail-over does (its row put
    back as the standby had it, the section loaded again from the rows):
    the next entry gets the same sequence and must be moved, not skipped by
    the lost one's key. (With the sequence alone in the key, it was skipped.)"""
    src, dst = _queue(dsn), _dst(dsn2)
    table = sql.Identifier("ringq", f"q_{src}")
    with connect(dsn) as s:
        s.enqueue(src, b"kept")
        s.commit()
        with Mover(dsn, src, dsn2, dst) as mv:
            assert mv.move_batch() == 1
        with psycopg.connect(dsn, autocommit=True) as c:
            slot = (present(c.execute(
                sql.SQL("SELECT max(seq) FROM {}").format(table)).fetchone())[0] + 1) % 256
            before = present(c.execute(
                sql.SQL("SELECT * FROM {} WHERE slot = %s").format(table), (slot,)).fetchone())
        lost = s.enqueue(src, b"lost in the gap")
        s.commit()
        with Mover(dsn, src, dsn2, dst) as mv:
            assert mv.move_batch() == 1
    with psycopg.connect(dsn, autocommit=True) as c:  # the standby never had it
        c.execute(sql.SQL("DELETE FROM {} WHERE slot = %s").format(table), (slot,))
        c.execute(
            sql.SQL("INSERT INTO {} VALUES ({})").format(
                table, sql.SQL(", ").join(sql.Placeholder() * len(before))
            ),
            before,
        )
    remove_section(dsn)
    with connect(dsn) as s:
        assert s.enqueue(src, b"new on the promoted primary") == lost  # given again
        s.commit()
    with Mover(dsn, src, dsn2, dst) as mv:
        assert mv.move_batch() == 1
        assert mv.get_stats()["duplicates"] == 0
    got = [unwrap(m) for m in drain(dsn2, dst, batch=100)]
    assert [m.payload for m in got] == [b"kept", b"lost in the gap", b"new on the promoted primary"]
    assert got[1].origin_seq == got[2].origin_seq and got[1].key != got[2].key


def test_destination_too_small_for_the_envelope_is_refused_at_start(dsn: str, dsn2: str) -> None:
    """A destination that cannot take the source's largest entry with its
    envelope is refused before anything moves (each such entry would
    otherwise fail its deliveries and become poison)."""
    src = _queue(dsn, max_payload=4096)
    with connect(dsn, producer="a") as s:
        s.enqueue(src, b"x" * 4096)  # fits the source, not the destination
        s.commit()
        overhead = envelope_overhead(s.instance, src, s.queue_info(src).id)
    assert 100 < overhead < 400
    for dst_size, envelope in ((4096, True), (4096 + overhead - 1, True), (4095, False)):
        dst = queue_in(dsn2, max_payload=dst_size)
        with pytest.raises(MoveWontFit, match=f"at least {4096 + (overhead if envelope else 0):,}"):
            Mover(dsn, src, dsn2, dst, config=MoveConfig(envelope=envelope)).open()
        assert drain(dsn2, dst) == []
    # Nothing was taken from the source, nothing counted against its entry.
    with psycopg.connect(dsn) as conn:
        row = present(conn.execute(
            sql.SQL("SELECT count(*), max(deliveries) FROM {} WHERE state = 1").format(
                sql.Identifier("ringq", "q_" + src))).fetchone())
    assert row == (1, 0)
    # Just enough room: the entry moves, envelope and all.
    for dst_size, envelope in ((4096 + overhead, True), (4096, False)):
        dst = queue_in(dsn2, max_payload=dst_size)
        with connect(dsn, producer="a") as s:
            s.enqueue(src, b"y" * 4096)
            s.commit()
        with Mover(dsn, src, dsn2, dst, config=MoveConfig(envelope=envelope)) as mv:
            move_until_empty(mv)
        got = drain(dsn2, dst)
        assert len(got) >= 1 and len(got[-1].payload) <= dst_size


def test_destination_full_waits_instead_of_rolling_back(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn), _dst(dsn2, capacity=8)
    produce(dsn, src, "a", 20, per_tx=20)
    with connect(dsn2) as consumer:
        sec2 = consumer.section
        got: list[Any] = []

        def consume() -> None:
            deadline = time.monotonic() + 30
            with connect(dsn2) as c:
                while len(got) < 20 and time.monotonic() < deadline:
                    got.extend(c.dequeue_many(dst, 4, wait=0.05))
                    c.commit()
                    reclaim_all(sec2)  # the monitor's reclaim frees the slots

        with Mover(dsn, src, dsn2, dst, config=MoveConfig(batch=20, full_wait=0.05)) as mv:
            t = threading.Thread(target=consume)
            t.start()
            assert mv.move_batch() == 20  # one batch, bigger than the destination
            stats = mv.get_stats()
            t.join(30)
    assert stats["dst_full_waits"] > 0 and stats["failures"] == 0
    check_arrivals(got, {"a": 20})
    with psycopg.connect(dsn) as conn:
        row = present(conn.execute(
            sql.SQL("SELECT max(deliveries) FROM {}").format(sql.Identifier("ringq", "q_" + src))
        ).fetchone())
    assert row[0] == 0  # no strike: a full destination is not a failed delivery


# -- one active mover ------------------------------------------------------------------------------


def _hold_lock(src: str, sq: str, dst: str, dq: str, ready: Any) -> None:
    mv = Mover(src, sq, dst, dq).open()
    assert mv.try_acquire()
    ready.set()
    threading.Event().wait(120)


def test_one_active_mover_and_standby_takes_over(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn), _dst(dsn2)
    ready = FORK.Event()
    p = FORK.Process(target=_hold_lock, args=(dsn, src, dsn2, dst, ready))
    p.start()
    try:
        assert ready.wait(30)
        with Mover(dsn, src, dsn2, dst) as standby:
            assert not standby.try_acquire()
            with pytest.raises(MoveLockHeld):
                standby.move_batch()
            os.kill(present(p.pid), signal.SIGKILL)
            p.join(10)
            deadline = time.monotonic() + 10
            while not standby.try_acquire():
                assert time.monotonic() < deadline, "the standby never took over"
                threading.Event().wait(0.01)
            assert standby.active
    finally:
        if p.is_alive():
            p.kill()
        p.join()


def test_lost_lock_connection_is_noticed_and_the_lock_taken_again(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn), _dst(dsn2)
    produce(dsn, src, "a", 6)
    cfg = MoveConfig(batch=2, lock_check=0, prune_every=1)
    with Mover(dsn, src, dsn2, dst, config=cfg) as mv:
        assert mv.move_batch() == 2
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'ringq-move-lock'"
            )
        stats = move_until_empty(mv)
    assert stats["takeovers"] == 2 and stats["moved"] == 6
    check_arrivals(drain(dsn2, dst, batch=100), {"a": 6})


def test_run_stops_on_event(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn), _dst(dsn2)
    produce(dsn, src, "a", 25)
    stop = threading.Event()
    mv = Mover(dsn, src, dsn2, dst, config=MoveConfig(batch=10, wait=0.05))
    t = threading.Thread(target=mv.run, args=(stop,))
    t.start()
    got: list[Any] = []
    with connect(dsn2) as c:
        while len(got) < 25:
            got.extend(c.dequeue_many(dst, 25, wait=5))
            c.commit()
    stop.set()
    t.join(10)
    assert not t.is_alive() and not mv.active
    check_arrivals(got, {"a": 25})


# -- kill -9 between the two commits, many times ---------------------------------------------------


def _mover_proc(src: str, sq: str, dst: str, dq: str, pause_at: int, paused_fd: int) -> None:
    """A mover that (if pause_at) stops for good between the commits of its
    pause_at-th batch and writes its pid to the pipe, waiting to be killed.

    SIGTERM stops it after the batch in hand. (No multiprocessing Queue or
    Event: a process killed at a random point can leave their locks and
    counters held; a raw pipe with one small write is atomic.)"""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rnd = random.Random(os.getpid())
    count = 0

    def between(msgs: Sequence[Any]) -> None:
        nonlocal count
        count += 1
        if pause_at and count == pause_at:
            os.write(paused_fd, os.getpid().to_bytes(8, "little"))
            threading.Event().wait(600)

    cfg = MoveConfig(batch=rnd.randint(1, 5), wait=0.05, standby_poll=0.02, prune_every=3)
    Mover(src, sq, dst, dq, config=cfg, between_commits=between).run(stop)


def _producer_proc(dsn: str, queue: str, producer: str, n: int) -> None:
    rnd = random.Random(producer)
    with connect(dsn, producer=producer) as s:
        i = 0
        while i < n:
            k = min(n - i, rnd.randint(1, 4))
            for _ in range(k):
                i += 1
                s.enqueue(queue, json.dumps({"p": producer, "i": i}).encode(), timeout=60)
            s.commit()


@pytest.mark.slow
def test_mover_killed_between_commits_many_times(dsn: str, dsn2: str) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rnd = random.Random(seed)
    PRODUCERS, PER, KILLS = ("p1", "p2", "p3"), 200, 20
    # Strikes from killed movers must not poison entries: a roomy max_deliveries.
    src = _queue(dsn, capacity=64, max_deliveries=1000)
    dst = _dst(dsn2, capacity=128)
    with connect(dsn) as s1, connect(dsn2) as s2:
        s1.ring(src), s2.ring(dst)  # load both queues into their sections
        sec1, sec2 = s1.section, s2.section
    producers = [FORK.Process(target=_producer_proc, args=(dsn, src, p, PER)) for p in PRODUCERS]
    for p in producers:
        p.start()
    paused_r, paused_w = os.pipe()
    movers: dict[int, BaseProcess] = {}
    consumed: list[Any] = []

    def monitor() -> None:
        """What the monitor does for both databases; plus a consumer of the inbox."""
        for sec, where in ((sec1, dsn), (sec2, dsn2)):
            repair_lock_holders(sec, where)  # a mover killed inside a critical section
            recover_dead_clients(sec, where)
        reclaim_all(sec1)
        reclaim_all(sec2)
        with connect(dsn2) as c:
            consumed.extend(c.dequeue_many(dst, 100))
            c.commit()
        reclaim_all(sec2)

    def start_mover(pause_at: int) -> None:
        p = FORK.Process(target=_mover_proc, args=(dsn, src, dsn2, dst, pause_at, paused_w))
        p.start()
        movers[present(p.pid)] = p

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        movers.pop(pid).join(10)

    deterministic = random_kills = 0
    try:
        while deterministic < KILLS:
            while len(movers) < 2:  # one active, one standby
                start_mover(pause_at=rnd.randint(1, 3))
            # Wait for the active one to stop between its commits, playing the
            # monitor meanwhile (a predecessor's entries are locked until then).
            while not select.select([paused_r], [], [], 0.05)[0]:
                monitor()
            pid = int.from_bytes(os.read(paused_r, 8), "little")
            if pid not in movers:
                # A mover killed at random below had paused (and written its
                # pid) just before: that pid is stale, wait for the next one.
                continue
            kill(pid)
            deterministic += 1
            if rnd.random() < 0.5:
                # And one at a random point (maybe the standby just taking over,
                # maybe mid-batch): a random wait on an event that never fires.
                threading.Event().wait(rnd.uniform(0, 0.05))
                victim = rnd.choice(list(movers))
                kill(victim)
                random_kills += 1
            monitor()
        # Let the last movers (unarmed) finish the work.
        for pid in list(movers):
            kill(pid)
        start_mover(pause_at=0)
        start_mover(pause_at=0)
        deadline = time.monotonic() + 120
        total = len(PRODUCERS) * PER
        while len(consumed) < total:
            assert time.monotonic() < deadline, f"only {len(consumed)} of {total} arrived"
            monitor()
        for p in producers:
            p.join(30)
            assert p.exitcode == 0
        for pid, mover in list(movers.items()):
            os.kill(pid, signal.SIGTERM)  # graceful: the batch in hand is finished
            mover.join(10)
            assert mover.exitcode == 0
    finally:
        for pid, mover in list(movers.items()):
            if mover.is_alive():
                os.kill(pid, signal.SIGKILL)
                mover.join()
        for p in producers:
            if p.is_alive():
                p.kill()
                p.join()
        os.close(paused_r)
        os.close(paused_w)
    monitor()
    assert deterministic == KILLS
    print(f"kills: {deterministic} between commits, {random_kills} at random points")
    check_arrivals(consumed, {p: PER for p in PRODUCERS})
    with psycopg.connect(dsn) as conn:
        assert present(conn.execute("SELECT count(*) FROM ringq.exceptions").fetchone())[0] == 0
    with psycopg.connect(dsn2) as conn:
        left = present(conn.execute("SELECT count(*) FROM ringq.keys").fetchone())[0]
    assert left < total  # spent keys are pruned as the movers go


# -- no monitor: a mover taking over decides its dead predecessor's slots (issue point 1) ---------


def _mover_dies_publishing(src: str, sq: str, dst: str, dq: str, paused_fd: int) -> None:
    """A mover that dies after its destination COMMIT was answered and before
    the section learnt it: its destination entries are committed, but their
    slots stay locked under a dead holder until someone decides them."""
    from ringq.engine.session._transaction import Transaction  # where a session tells the section

    publish = Transaction.finish

    def finish(
        self: Transaction,
        items: Sequence[Any],
        *,
        committed: bool,
        count_delivery: bool = True,
        poisoned: set[tuple[int, int]] | None = None,
    ) -> None:
        if committed and self.link.dsn == dst and items:
            os.write(paused_fd, os.getpid().to_bytes(8, "little"))
            threading.Event().wait(600)  # killed here
        publish(self, items, committed=committed, count_delivery=count_delivery,
                poisoned=poisoned)

    Transaction.finish = finish  # type: ignore[method-assign]
    Mover(src, sq, dst, dq, config=MoveConfig(batch=5, wait=0.05)).move_batch()


def test_a_mover_taking_over_decides_the_dead_movers_destination_slots_first(
    dsn: str, dsn2: str
) -> None:
    """No monitor on either database: the destination entries a killed mover
    committed but never published arrive before anything the next mover
    moves (per-producer order holds), and nothing arrives twice."""
    src = _queue(dsn, dequeue_mode="single")
    dst = _dst(dsn2)
    produce(dsn, src, "a", 20)
    paused_r, paused_w = os.pipe()
    p = FORK.Process(target=_mover_dies_publishing, args=(dsn, src, dsn2, dst, paused_w))
    p.start()
    try:
        assert select.select([paused_r], [], [], 30)[0], "the first mover never reached its commit"
        os.kill(present(p.pid), signal.SIGKILL)
        p.join(10)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        os.close(paused_r)
        os.close(paused_w)
    with connect(dsn2) as c:
        assert c.ring(dst).counts()["locked"] == 5  # committed, unpublished, held by the dead
    with Mover(dsn, src, dsn2, dst, config=MoveConfig(batch=5, wait=0.05)) as mv:
        taken = 0
        deadline = time.monotonic() + 30
        while taken < 20:  # the 5 the dead mover took come back, and are skipped by key
            assert time.monotonic() < deadline, f"only {taken} taken"
            taken += mv.move_batch(wait=0.5)
        assert mv.get_stats()["duplicates"] == 5
    check_arrivals(drain(dsn2, dst), {"a": 20})


# -- the command -----------------------------------------------------------------------------------


def _ringq(*args: str, **kw: Any) -> subprocess.Popen[Any]:
    return subprocess.Popen([sys.executable, "-m", "ringq.cli", *args], **kw)


def test_cli_move_once(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn), _dst(dsn2)
    produce(dsn, src, "a", 30, per_tx=5)
    p = _ringq("move", "--from", f"{dsn}:{src}", "--to", f"{dsn2}:{dst}", "--batch", "7", "--once",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "moved 30" in out
    check_arrivals(drain(dsn2, dst, batch=100), {"a": 30})


def test_cli_rejects_a_dsn_without_queue(dsn: str) -> None:
    p = _ringq("move", "--from", "postgresql://h:5432/db", "--to", "inbox", "--once",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "DSN:queue" in err


def test_a_queue_moved_into_itself_is_refused_at_start(dsn: str) -> None:
    """Same database, same queue: refused before anything moves (it would move
    its own entries round and round until killed), exit 2, one line."""
    from ringq.move import MoveIntoItself

    q = _queue(dsn)
    produce(dsn, q, "a", 3)
    with pytest.raises(MoveIntoItself), Mover(dsn, q, dsn, q):
        pass
    p = _ringq("move", "--from", f"{dsn}:{q}", "--to", f"{dsn}:{q}", "--once",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    assert "into itself" in err and "Traceback" not in err
    assert len(drain(dsn, q)) == 3  # nothing was taken


def test_cli_refuses_a_destination_too_small_with_exit_5(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn), queue_in(dsn2, max_payload=1024)  # equal: no room for the envelope
    produce(dsn, src, "a", 2)
    p = _ringq("move", "--from", f"{dsn}:{src}", "--to", f"{dsn2}:{dst}", "--once",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 5, err
    assert "max_payload of at least" in err and "Traceback" not in err
    # --bare needs no envelope: the same queues are fine, and everything moves.
    p = _ringq("move", "--from", f"{dsn}:{src}", "--to", f"{dsn2}:{dst}", "--once", "--bare",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert len(drain(dsn2, dst)) == 2


def test_cli_sigterm_drains(dsn: str, dsn2: str) -> None:
    src, dst = _queue(dsn, capacity=2048), _dst(dsn2, capacity=2048)
    produce(dsn, src, "a", 1000, per_tx=50)
    p = _ringq("move", "--from", f"{dsn}:{src}", "--to", f"{dsn2}:{dst}", "--batch", "5",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        got: list[Any] = []
        with connect(dsn2) as c:
            while len(got) < 20:  # it is moving
                got.extend(c.dequeue_many(dst, 100, wait=10))
                c.commit()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert "ringq move: batches" in out
    # Graceful: whatever left database 1 is in database 2, once; the rest is still there.
    got.extend(drain(dsn2, dst, batch=100))
    rest = drain(dsn, src, batch=100)
    assert 20 <= len(got) < 1000 and len(got) + len(rest) == 1000
    seqs = [unwrap(m).producer_seq for m in got] + [json.loads(m.payload)["i"] for m in rest]
    assert seqs == list(range(1, 1001))


def test_outbox_example_runs(dsn: str, dsn2: str) -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "outbox.py"
    for _run in range(2):  # and again: it keeps working on its own leftovers
        p = subprocess.run([sys.executable, str(example), "--dsn", dsn, "--to-dsn", dsn2],
                           check=False, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "killed before database 1 commits" in p.stdout
        assert "(skipped by key) 2" in p.stdout
        assert "arrived once, in order: True" in p.stdout


def test_a_shared_mode_source_is_refused(dsn: str, dsn2: str) -> None:
    """A mover needs one dequeuer at a time: with a shared source, a standby taking
    over would read past a dead mover's entries and could prune their keys."""
    from ringq.engine import ConfigError
    from ringq.move import MoveSourceShared

    src, dst = _queue(dsn, dequeue_mode="shared"), _dst(dsn2)
    produce(dsn, src, "a", 3)
    mv = Mover(dsn, src, dsn2, dst)
    with pytest.raises(MoveSourceShared, match="'shared' dequeue mode") as info:
        mv.open()
    assert isinstance(info.value, ConfigError)
    mv.close()
    mv.close()
    # run() refuses too, at once, instead of retrying a setting forever.
    with pytest.raises(MoveSourceShared):
        Mover(dsn, src, dsn2, dst).run(threading.Event())
    p = _ringq("move", "--from", f"{dsn}:{src}", "--to", f"{dsn2}:{dst}", "--once",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 5, err
    assert (
        "'shared' dequeue mode" in err and "--dequeue-mode single" in err and "Traceback" not in err
    )
    # Nothing was taken: the entries are all still in the source.
    assert len(drain(dsn, src, batch=100)) == 3 and drain(dsn2, dst, batch=100) == []
