"""The payload cache: dequeues of cached entries served from the global
section, their consuming writes sent with the commit. The row stays the
truth: a record is trusted only for its own entry's first delivery, and
anything else costs a row read or a retryable commit error, never a wrong
payload, a loss or a duplicate. Kill -9 tests fork real processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import drain, present, queue_in
from psycopg import sql
from ringq.engine import ConfigError, StaleSection, connect
from ringq.engine import layout as L
from ringq.engine.recovery import recover_dead_clients
from ringq.scripting import QueueSpec, create_queue, drop_queue

FORK = mp.get_context("fork")


def hits_misses(s: Any, queue: str) -> tuple[int, int]:
    ring = s.ring(queue)
    return (
        s.section.queues[ring.qb + L.Q_N_CACHE_HITS],
        s.section.queues[ring.qb + L.Q_N_CACHE_MISSES],
    )


def cache_payload_of(dsn: str, queue: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = present(c.execute(
            "SELECT cache_payload FROM ringq.queues WHERE name = %s", (queue,)
        ).fetchone())
    return int(row[0])


def test_a_cached_message_is_the_rows_message(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """Served from shared memory or read from the row, a message is the same:
    payload, producer and its sequence, enqueue time (the row's), deliveries."""
    q = make_queue(capacity=8)
    with connect(dsn, producer="prod-1") as p:
        p.enqueue(q, b"\x00binary\xff")
        p.commit()
    with connect(dsn) as c:
        cached = present(c.dequeue(q))
        assert hits_misses(c, q) == (1, 0)
        c.rollback(count_delivery=False)  # no strike: the row still shows no delivery
        from_row = present(c.dequeue(q))
        assert hits_misses(c, q) == (1, 1)  # a record serves one first delivery
        c.commit()
    assert cached == from_row
    assert cached.enqueued_at.tzinfo is not None and cached.deliveries == 1


def test_entries_beyond_the_cache_and_queues_without_one_read_their_row(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8, cache_payload=16)
    off = make_queue(capacity=8, cache_payload=0)
    assert cache_payload_of(dsn, q) == 16 and cache_payload_of(dsn, off) == 0
    with connect(dsn) as s:
        s.enqueue_many(q, [b"small", b"x" * 100, b"y" * 16])
        s.enqueue(off, b"plain")
        s.commit()
        got = s.dequeue_many(q, 3)  # two from the cache, one from its row: one batch
        assert [m.payload for m in got] == [b"small", b"x" * 100, b"y" * 16]
        assert hits_misses(s, q) == (2, 1)
        assert present(s.dequeue(off)).payload == b"plain"
        assert hits_misses(s, off) == (0, 0)
        s.commit()
    assert drain(dsn, q) == [] and drain(dsn, off) == []


def test_default_cache_and_limits_at_create(dsn: str) -> None:
    assert cache_payload_of(dsn, queue_in(dsn, max_payload=100)) == 100
    assert cache_payload_of(dsn, queue_in(dsn, max_payload=4096)) == 512
    with pytest.raises(ConfigError, match="cache_payload must be an integer from 0 to 100"):
        QueueSpec("toolarge", 8, 100, cache_payload=101)
    with pytest.raises(ConfigError, match="cache_payload"):
        QueueSpec("negative", 8, 100, cache_payload=-1)
    # Beyond the section's cache pool: refused when asked for, before anything is made.
    with psycopg.connect(dsn) as conn:
        with pytest.raises(ConfigError, match="payload cache"):
            create_queue(conn, QueueSpec("huge_cache", 1 << 20, 1 << 16, cache_payload=1 << 16))
        row = conn.execute("SELECT count(*) FROM ringq.queues WHERE name = 'huge_cache'").fetchone()
        assert present(row)[0] == 0


def consume_around_ringq(dsn: str, queue: str, seq: int) -> None:
    """Consume entry ``seq``'s row behind the section's back (the section
    still says it is ready)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("UPDATE {} SET state = 2 WHERE seq = %s").format(
            sql.Identifier("ringq", "q_" + queue)), (seq,))


def test_a_stale_record_fails_at_commit_and_commits_nothing(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    """The section says ready, the record matches, but the row was consumed
    behind its back: the deferred consuming write fails its guard, the
    transaction (the caller's own write too) rolls back, StaleSection."""
    q = make_queue(capacity=8)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE cache_app (v int)")
    with face(dsn) as s:
        s.enqueue_many(q, [b"a", b"b"])
        s.commit()
        consume_around_ringq(dsn, q, 0)
        m = present(s.dequeue(q))
        assert m.payload == b"a"  # from the cache: the section does not know yet
        s.connection.execute("INSERT INTO cache_app VALUES (1)")
        with pytest.raises(StaleSection):
            s.commit()
        assert present(s.dequeue(q)).payload == b"b"  # resynced: the queue moves on
        s.commit()
    with psycopg.connect(dsn, autocommit=True) as c:
        assert present(c.execute("SELECT count(*) FROM cache_app").fetchone())[0] == 0
    assert drain(dsn, q) == []


def test_a_cached_batch_with_one_stale_row_fails_at_commit_and_commits_nothing(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    """A batch served from the cache in one stretch (its consuming write one
    range of slots) of which one row was consumed behind the section's back:
    the write's guard fails, nothing of the batch or the caller's own write
    commits, StaleSection; the others are delivered again, none twice."""
    q = make_queue(capacity=64)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE cache_batch_app (v int)")
    with face(dsn) as s:
        seqs = s.enqueue_many(q, [b"p%d" % i for i in range(20)])
        s.commit()
        consume_around_ringq(dsn, q, seqs[7])
        taken = s.dequeue_many(q, 20)
        assert [m.seq for m in taken] == seqs  # from the cache: the section does not know
        s.connection.execute("INSERT INTO cache_batch_app VALUES (1)")
        with pytest.raises(StaleSection):
            s.commit()
    with psycopg.connect(dsn, autocommit=True) as c:
        assert present(c.execute("SELECT count(*) FROM cache_batch_app").fetchone())[0] == 0
    again = drain(dsn, q, batch=50)
    assert [m.seq for m in again] == seqs[:7] + seqs[8:]


def test_a_batch_read_from_rows_skips_a_stale_row_and_takes_the_rest(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    """A batch read from its rows (no payload cache) in one stretch of slots
    (one range of the primary key) of which one row was consumed behind the
    section's back: that slot is repaired, the other entries are taken,
    committed, and none is delivered twice."""
    q = make_queue(capacity=64, cache_payload=0)
    with face(dsn) as s:
        seqs = s.enqueue_many(q, [b"r%d" % i for i in range(20)])
        s.commit()
        consume_around_ringq(dsn, q, seqs[7])
        taken = s.dequeue_many(q, 20)
        assert [m.seq for m in taken] == seqs[:7] + seqs[8:]
        assert [m.payload for m in taken][7] == b"r8"
        s.commit()
    assert drain(dsn, q, batch=50) == []


def _die_holding(dsn: str, queue: str, ready: Any) -> None:
    with connect(dsn) as s:
        assert s.dequeue(queue) is not None  # from the cache: nothing sent
        ready.set()
        os.kill(os.getpid(), signal.SIGKILL)


def test_kill9_holding_a_cached_entry_redelivers_it_from_the_row(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue(q, b"held")
        s.commit()
        ring = s.ring(q)
        ready = FORK.Event()
        p = FORK.Process(target=_die_holding, args=(dsn, q, ready))
        p.start()
        p.join(30)
        assert ready.is_set() and p.exitcode == -signal.SIGKILL
        assert ring.counts()["locked"] == 1
        for _ in range(100):
            recover_dead_clients(s.section, dsn)
            if ring.counts()["locked"] == 0:
                break
        m = present(s.dequeue(q))
        assert (m.payload, m.deliveries) == (b"held", 2)  # counted, and read from the row
        s.commit()
    assert drain(dsn, q) == []


def _die_in_consume_commit(dsn: str, queue: str, when: str, ready: Any) -> None:
    with connect(dsn) as s:
        conn = s.connection

        class DyingLock:
            """The connection's lock, held for each whole exchange (psycopg's
            and the engine's own): the commit's one statement, the consuming
            write in autocommit, is the first exchange after the dequeue."""

            def __enter__(self) -> None:
                if when == "before":  # nothing sent yet
                    os.kill(os.getpid(), signal.SIGKILL)

            def __exit__(self, *exc: object) -> None:
                os.kill(os.getpid(), signal.SIGKILL)  # committed; the section never learns it

        m = present(s.dequeue(queue))
        ready.send(m.seq)
        conn.lock = DyingLock()  # type: ignore[assignment]
        s.commit()


@pytest.mark.parametrize("when", ["before", "after"])
def test_kill9_around_the_consuming_commit_delivers_once(
    dsn: str, make_queue: Callable[..., str], when: str
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"first", b"second"])
        s.commit()
        ring = s.ring(q)
        recv, send = FORK.Pipe(duplex=False)
        p = FORK.Process(target=_die_in_consume_commit, args=(dsn, q, when, send))
        p.start()
        p.join(30)
        assert p.exitcode == -signal.SIGKILL and recv.recv() == 0
        for _ in range(100):
            recover_dead_clients(s.section, dsn)
            if ring.counts()["locked"] == 0:
                break
        assert ring.counts()["locked"] == 0
    got = [m.payload for m in drain(dsn, q)]
    assert got == ([b"first", b"second"] if when == "before" else [b"second"])


def test_a_reused_block_never_serves_a_dropped_queues_records(dsn: str) -> None:
    """A queue dropped and another made in its place gets its block and cache
    space: the old records carry the same sequences, never trusted."""
    old = queue_in(dsn, capacity=64)
    with connect(dsn) as s:
        s.enqueue_many(old, [b"old %d" % i for i in range(4)])
        s.commit()
        old_ring = s.ring(old)
    with psycopg.connect(dsn) as conn:
        drop_queue(conn, old)
    new = queue_in(dsn, capacity=64)
    with connect(dsn) as s:
        # Keyed enqueues write their rows at once and fill no record.
        for i in range(4):
            s.enqueue(new, b"new %d" % i, key=f"k{i}")
        s.commit()
        ring = s.ring(new)
        assert (ring.qidx, ring.cbase) == (old_ring.qidx, old_ring.cbase)
        got = [m.payload for m in s.dequeue_many(new, 4)]
        s.commit()
    assert got == [b"new %d" % i for i in range(4)]


def test_two_phase_commit_of_a_cached_dequeue(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"2pc", b"next"])
        s.commit()
        s.tpc_begin(s.xid("cache-test"))
        assert present(s.dequeue(q)).payload == b"2pc"
        s.tpc_prepare()  # the consuming write goes before PREPARE
        s.tpc_commit()
    assert [m.payload for m in drain(dsn, q)] == [b"next"]


def test_each_entry_keeps_the_producer_it_was_enqueued_under(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """The SQL inbox's pump changes a session's producer between the enqueues
    of one transaction: each row and each record keeps its own."""
    q = make_queue(capacity=8)
    with connect(dsn, producer="a") as s:
        s.enqueue(q, b"from a")
        s.producer = 'b "quoted", {braced} \\ NULL'  # what an array literal must escape
        s.enqueue_many(q, [b"from b", b"from b too"])
        s.commit()
        cached = s.dequeue_many(q, 3)
        s.rollback(count_delivery=False)
        from_rows = s.dequeue_many(q, 3)
        s.commit()
    assert [m.producer for m in cached] == ["a"] + ['b "quoted", {braced} \\ NULL'] * 2
    assert cached == from_rows


def test_a_queue_whose_cache_the_shm_filesystem_cannot_hold_runs_without_it(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's small /dev/shm: writing records it has no pages for would
    kill the writer (SIGBUS). The queue is loaded without its cache instead."""
    import ringq.engine.section._section as section_module

    q = make_queue(capacity=64)
    monkeypatch.setattr(section_module, "shm_free_bytes", lambda: 1024)
    with connect(dsn) as s:
        s.enqueue(q, b"no cache")
        s.commit()
        ring = s.ring(q)
        assert s.section.queues[ring.qb + L.Q_CACHE_PAYLOAD] == 0 and ring.stride == 0
        assert present(s.dequeue(q)).payload == b"no cache"
        assert hits_misses(s, q) == (0, 0)
        s.commit()


def test_producer_seq_carries_on_another_producers_numbering(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn, producer="p") as s:
        s.enqueue(q, b"one")
        assert s.producer_seq == 1
        s.producer, s.producer_seq = "elsewhere", 41
        s.enqueue(q, b"two")
        s.commit()
        with pytest.raises(ConfigError, match="producer_seq"):
            s.producer_seq = -1
        got = [(m.producer, m.producer_seq) for m in s.dequeue_many(q, 2)]
        s.commit()
    assert got == [("p", 1), ("elsewhere", 42)]
