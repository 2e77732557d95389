"""The engine's promises, against a real PostgreSQL and real processes."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg
import pytest
from conftest import (
    activity_of,
    decided_gids,
    drain,
    enqueue_committed,
    make_stale,
    prepared_gids,
    present,
    terminate_backend,
)
from ringq.engine import (
    DatabaseUnavailable,
    InDoubt,
    InvalidQueueName,
    PayloadTooLarge,
    QueueFull,
    QueueNotFound,
    SchemaMissing,
    Section,
    SectionIncompatible,
    Session,
    SessionClosed,
    StaleSection,
    TransactionError,
    connect,
)
from ringq.engine import layout as L
from ringq.engine.ring import OpKind
from ringq.scripting import QueueSpec, create_queue

FORK = mp.get_context("fork")


def test_entry_is_invisible_until_commit(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q = make_queue()
    with face(dsn) as producer, face(dsn) as consumer:
        seq = producer.enqueue(q, b"one")
        assert consumer.dequeue(q) is None
        consumer.commit()
        producer.commit()
        m = consumer.dequeue(q)
        assert m is not None and m.seq == seq and m.payload == b"one" and m.deliveries == 1
        consumer.commit()
        assert consumer.dequeue(q) is None


def test_rolled_back_enqueue_is_never_delivered_and_its_slot_reclaimed(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q = make_queue(capacity=4)
    with face(dsn) as s:
        for _ in range(10):  # more than the capacity: slots must come back
            s.enqueue(q, b"void")
            s.rollback()
        s.enqueue(q, b"real")
        s.commit()
        ring = s.ring(q)
        assert ring.head == 11  # 11 reservations went through 4 slots
    got = drain(dsn, q)
    assert [m.payload for m in got] == [b"real"]


def test_rolled_back_dequeue_is_redelivered_with_a_higher_count(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q = make_queue()
    with face(dsn) as s:
        s.enqueue(q, b"x")
        s.commit()
        first = s.dequeue(q)
        assert first is not None and first.deliveries == 1
        s.rollback()
        again = s.dequeue(q)
        assert (
            again is not None
            and again.seq == first.seq
            and again.deliveries == 2
            and again.redelivered
        )
        s.commit()
        assert s.dequeue(q) is None


def test_poison_entry_moves_to_exceptions_after_max_deliveries(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q = make_queue(max_deliveries=3)
    with face(dsn) as s:
        seq = s.enqueue(q, b"poison")
        s.commit()
        for n in range(1, 4):
            m = s.dequeue(q)
            assert m is not None and m.deliveries == n
            s.rollback()
        assert s.dequeue(q) is None
        s.commit()
        row = s.connection.execute(
            "SELECT e.seq, e.deliveries, e.reason FROM ringq.exceptions e JOIN ringq.queues q "
            "ON q.id = e.queue_id WHERE q.name = %s",
            (q,),
        ).fetchone()
        s.rollback()
    assert row == (seq, 3, "max deliveries reached")


def test_chaining_is_atomic(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    a, b = make_queue(), make_queue()
    with face(dsn) as s:
        s.enqueue(a, b"step1")
        s.commit()
        first = present(s.dequeue(a))
        s.enqueue(b, first.payload + b"->step2")
        s.rollback()  # neither happened
        assert drain(dsn, b) == []
        m = s.dequeue(a)
        assert m is not None and m.payload == b"step1"
        s.enqueue(b, m.payload + b"->step2")
        s.commit()  # both happened
    assert drain(dsn, a) == []
    assert [m.payload for m in drain(dsn, b)] == [b"step1->step2"]


def test_user_sql_joins_the_transaction(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()
    with connect(dsn) as s:
        s.connection.execute("CREATE TABLE ledger (v int)")
        s.commit()
        with pytest.raises(RuntimeError), s.transaction():
            s.connection.execute("INSERT INTO ledger VALUES (1)")
            s.enqueue(q, b"with ledger row")
            raise RuntimeError("boom")
        assert s.connection.execute("SELECT count(*) FROM ledger").fetchone() == (0,)
        s.rollback()
        with s.transaction():
            s.connection.execute("INSERT INTO ledger VALUES (2)")
            s.enqueue(q, b"with ledger row")
        assert s.connection.execute("SELECT count(*) FROM ledger").fetchone() == (1,)
        s.rollback()
    assert len(drain(dsn, q)) == 1


def _producer(dsn: str, queue: str, n: int, pid_tag: int, seed: int) -> None:
    import random

    rnd = random.Random(seed)
    with connect(dsn, producer=f"p{pid_tag}") as s:
        i = 0
        while i < n:
            batch = min(rnd.randint(1, 3), n - i)
            try:
                for k in range(batch):
                    s.enqueue(queue, f"{pid_tag}:{i + k}".encode(), timeout=60)
            except QueueFull:
                s.rollback()  # our own reservation blocks the ring: give way
                continue
            i += batch
            if rnd.random() < 0.2:
                s.rollback()
                i -= batch
            else:
                s.commit()


def test_producers_and_one_consumer_exactly_once_fifo_over_many_wraps(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16)
    producers, per = 4, 120  # 480 entries through 16 slots: 30 wrap-arounds
    procs = [FORK.Process(target=_producer, args=(dsn, q, per, p, p)) for p in range(producers)]
    for p in procs:
        p.start()
    got: list[Any] = []
    with connect(dsn) as s:
        deadline = time.monotonic() + 120
        while len(got) < producers * per and time.monotonic() < deadline:
            m = s.dequeue(q, wait=1.0)
            if m is None:
                continue
            got.append(m)
            s.commit()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert drain(dsn, q) == []
    seen = defaultdict(list)
    for m in got:
        tag, i = m.payload.decode().split(":")
        seen[tag].append(int(i))
        assert m.producer == f"p{tag}"
    assert sorted(seen) == [str(p) for p in range(producers)]
    for tag, idx in seen.items():
        assert idx == list(range(per)), f"producer {tag} out of order or incomplete"
    assert len({m.seq for m in got}) == len(got)
    assert max(m.seq for m in got) >= 20 * 16  # wrapped at least 20 times


def test_shared_mode_consumers_read_past_each_other(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q = make_queue(dequeue_mode="shared")
    with face(dsn) as p:
        p.enqueue_many(q, [b"a", b"b", b"c"])
        p.commit()
    with face(dsn) as c1, face(dsn) as c2:
        m1 = present(c1.dequeue(q))
        t0 = time.monotonic()
        m2 = present(c2.dequeue(q))  # must not wait for c1's lock
        assert time.monotonic() - t0 < 1.0
        assert m1.payload == b"a" and m2.payload == b"b"
        c1.rollback()
        m3 = present(c2.dequeue(q))
        assert m3.payload == b"a" and m3.deliveries == 2
        c2.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"c"]


def test_single_mode_second_dequeuer_gets_nothing_while_first_holds(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as p:
        p.enqueue_many(q, [b"a", b"b"])
        p.commit()
    with connect(dsn) as c1, connect(dsn) as c2:
        assert present(c1.dequeue(q)).payload == b"a"
        assert c2.dequeue(q) is None  # single dequeuer: FIFO is strict
        c1.commit()
        assert present(c2.dequeue(q)).payload == b"b"
        c2.commit()


def test_full_queue_raises_or_blocks_until_space(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q_raise = make_queue(capacity=2, full_policy="raise")
    with face(dsn) as s:
        s.enqueue_many(q_raise, [b"1", b"2"])
        s.commit()
        with pytest.raises(QueueFull):
            s.enqueue(q_raise, b"3")
        s.rollback()
    assert [m.payload for m in drain(dsn, q_raise)] == [b"1", b"2"]

    q_block = make_queue(capacity=2, full_policy="block", full_timeout=0.2)
    with face(dsn) as s:
        s.enqueue_many(q_block, [b"1", b"2"])
        s.commit()
        t0 = time.monotonic()
        with pytest.raises(QueueFull):
            s.enqueue(q_block, b"3")
        assert time.monotonic() - t0 >= 0.2
        s.rollback()
        # A consumer that frees a slot wakes the blocked producer.
        done = threading.Event()

        def consume() -> None:
            done.wait(5)
            with face(dsn) as c:
                c.dequeue(q_block)
                c.commit()

        t = threading.Thread(target=consume)
        t.start()
        done.set()
        s.enqueue(q_block, b"3", timeout=10)
        s.commit()
        t.join()
    assert [m.payload for m in drain(dsn, q_block)] == [b"2", b"3"]


def test_own_uncommitted_entry_at_the_oldest_slot_is_queue_full_at_once(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=4, full_policy="block", full_timeout=30)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"1", b"2", b"3", b"4"])  # uncommitted: this transaction holds the tail
        t0 = time.monotonic()
        with pytest.raises(QueueFull, match="held by this transaction"):
            s.enqueue(q, b"5", timeout=30)
        assert time.monotonic() - t0 < 5  # not the 30 s timeout: waiting could only wait on itself
        with pytest.raises(QueueFull, match="held by this transaction"):
            s.enqueue_many(q, [b"5"], timeout=30)
        s.commit()  # the four still commit
        ring = s.ring(q)
        assert ring.counts()["locked"] == 0 and ring.counts()["ready"] == 4
    assert [m.payload for m in drain(dsn, q)] == [b"1", b"2", b"3", b"4"]


def test_foreign_section_is_refused_with_section_incompatible(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    import mmap

    import posix_ipc
    from ringq.engine import section_name

    make_queue()  # the schema and its instance id
    with psycopg.connect(dsn) as c:
        instance = present(
            c.execute("SELECT value FROM ringq.meta WHERE key = 'instance_id'").fetchone()
        )[0]
    for word, value in ((L.H_LAYOUT, L.LAYOUT_VERSION + 1), (L.H_MAGIC, 0x0BAD_F00D)):
        Section.unlink(instance)
        shm = posix_ipc.SharedMemory(
            section_name(instance), posix_ipc.O_CREX, mode=0o600, size=L.SECTION_SIZE
        )
        mm = mmap.mmap(shm.fd, L.SECTION_SIZE)
        header = memoryview(mm)[: L.HEADER_WORDS * 8].cast("q")
        header[L.H_MAGIC], header[L.H_LAYOUT], header[L.H_READY] = L.MAGIC, L.LAYOUT_VERSION, 1
        header[word] = value  # another ringq's layout, or not a ringq section at all
        header.release()
        mm.close()
        shm.close_fd()
        with pytest.raises(SectionIncompatible, match="layout"):
            connect(dsn)
    Section.unlink(instance)
    with connect(dsn) as s:  # once removed, a fresh section is made
        assert s.section is not None


def test_database_without_ringq_schema_is_schema_missing(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    with pytest.raises(SchemaMissing, match="create a queue first"):
        connect(dsn)  # a fresh database: no ringq schema at all
    make_queue()
    with psycopg.connect(dsn) as c:
        c.execute("UPDATE ringq.meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(SchemaMissing, match="not supported"):
        connect(dsn)


def test_waiting_dequeuer_is_woken_by_commit(
    dsn: str,
    make_queue: Callable[..., str],
    face: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ringq.engine.session import _claim

    # No safety-net recheck within the test: only the commit's post can wake it
    # (both faces read the setting through _claim at each wait).
    monkeypatch.setattr(_claim, "CLAIM_RECHECK_S", 60.0)
    q = make_queue()
    result: dict[str, Any] = {}

    def consumer() -> None:
        with face(dsn) as c:
            m = c.dequeue(q, wait=30)
            result["woken_at"] = time.monotonic()
            result["msg"] = m
            c.commit()

    with face(dsn) as p:
        ring = p.ring(q)
        wakeups = p.section.queues[ring.qb + L.Q_N_WAKEUPS]
        t = threading.Thread(target=consumer)
        t.start()
        # An explicit signal: the consumer registered itself as a waiter.
        deadline = time.monotonic() + 10
        while p.section.queues[ring.qb + L.Q_WAIT_READY] < 1:
            assert time.monotonic() < deadline, "the consumer never went to sleep"
            time.sleep(0.001)
        p.enqueue(q, b"wake")
        p.commit()
        committed_at = time.monotonic()
        t.join(30)
        assert p.section.queues[ring.qb + L.Q_N_WAKEUPS] == wakeups + 1  # one post, by the commit
    assert result["msg"].payload == b"wake"
    assert result["woken_at"] - committed_at < 5  # far below the 30 s wait and the 60 s recheck


def test_idempotent_enqueue_with_key(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q = make_queue()
    with face(dsn) as s:
        a = s.enqueue(q, b"x", key="order-1")
        b = s.enqueue(q, b"x", key="order-1")
        assert a == b
        s.commit()
        assert s.enqueue(q, b"x", key="order-1") == a
        s.commit()
        s.enqueue(q, b"y", key="order-2")
        s.rollback()  # a rolled-back key can be used again
        c = s.enqueue(q, b"y", key="order-2")
        s.commit()
        assert c != a
    assert [m.payload for m in drain(dsn, q)] == [b"x", b"y"]


@pytest.mark.parametrize("first_commits", [True, False])
def test_same_key_from_two_sessions_at_once_yields_one_entry(
    dsn: str, make_queue: Callable[..., str], first_commits: bool
) -> None:
    q = make_queue()
    with connect(dsn) as a, connect(dsn) as b, psycopg.connect(dsn, autocommit=True) as admin:
        ring = a.ring(q)
        b.ring(q)
        resyncs = a.section.queues[ring.qb + L.Q_N_RESYNC]
        seq_a = a.enqueue(q, b"from a", key="retry-1")  # a holds the key, uncommitted
        got: dict[str, object] = {}

        def b_enqueues() -> None:
            try:
                got["seq"] = b.enqueue(q, b"from b", key="retry-1")
            except BaseException as exc:
                got["error"] = exc

        t = threading.Thread(target=b_enqueues)
        t.start()
        # Step by step: b is waiting on a's key (a row lock), then a ends.
        deadline = time.monotonic() + 10
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'"
        )
        while present(admin.execute(waiting, (b.backend_pid,)).fetchone())[0] == 0:
            assert t.is_alive() and time.monotonic() < deadline, got
            time.sleep(0.001)
        if first_commits:
            a.commit()
        else:
            a.rollback()
        t.join(10)
        assert "error" not in got, got
        if first_commits:
            assert got["seq"] == seq_a  # the retry found the first entry
        else:
            assert got["seq"] != seq_a  # the first never happened: b's entry is the one
        b.commit()
        # not mistaken for a stale section
        assert a.section.queues[ring.qb + L.Q_N_RESYNC] == resyncs
    assert [m.payload for m in drain(dsn, q)] == [b"from a" if first_commits else b"from b"]


def test_typed_errors(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(max_payload=8)
    with connect(dsn) as s:
        with pytest.raises(QueueNotFound):
            s.enqueue("no_such_queue", b"x")
        with pytest.raises(InvalidQueueName):
            s.enqueue("Bad-Name", b"x")
        with pytest.raises(PayloadTooLarge):
            s.enqueue(q, b"123456789")
        with pytest.raises(TypeError):
            s.enqueue(q, "text")  # type: ignore[arg-type]
    with pytest.raises(SessionClosed):
        s.enqueue(q, b"x")
    s.close()  # twice is harmless
    with pytest.raises(DatabaseUnavailable) as err:
        connect("postgresql://u:secret@127.0.0.1:1/x", connect_timeout=1)
    assert "secret" not in str(err.value)


@contextmanager
def _no_new_connections(dsn: str) -> Iterator[None]:
    """The database refuses new connections (existing ones keep working)."""
    name = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
    with psycopg.connect(
        psycopg.conninfo.make_conninfo(dsn, dbname="postgres"), autocommit=True
    ) as admin:
        admin.execute(
            psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
                psycopg.sql.Identifier(name)
            )
        )
        try:
            yield
        finally:
            admin.execute(
                psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
                    psycopg.sql.Identifier(name)
                )
            )


def test_backend_terminated_before_first_enqueue_raises_database_unavailable(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as s:
        terminate_backend(dsn, s.backend_pid)
        with pytest.raises(DatabaseUnavailable):
            s.enqueue(q, b"x")
        s.enqueue(q, b"after")  # the session reconnected
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"after"]


def test_psycopg_errors_of_side_connections_are_converted(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.queue_info(q)  # cached: the next enqueue only loads the ring
        with _no_new_connections(dsn), pytest.raises(DatabaseUnavailable):
            s.enqueue(q, b"x")  # loading the queue into the section
        s.enqueue_many(q, [b"a", b"b"])
        s.commit()
        make_stale(s, q)  # the next commit must resync
        s.enqueue(q, b"c")  # its row write goes with the commit
        with _no_new_connections(dsn), pytest.raises(DatabaseUnavailable):
            s.commit()  # rolled back (stale), then the resync of the section fails
        s.rollback()
        s.enqueue(q, b"c")
        with pytest.raises(StaleSection):
            s.commit()  # still stale: rolled back and resynced this time
        s.enqueue(q, b"c")
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"a", b"b", b"c"]


def test_connection_lost_after_a_commit_around_the_library_is_converted(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as s:
        conn = s.connection
        s.enqueue(q, b"committed around")
        s.flush()  # the row write goes now (else it waits for the session's own commit)
        conn.commit()  # not through the session: the next call learns it from the rows
        terminate_backend(dsn, s.backend_pid)
        with pytest.raises(DatabaseUnavailable):
            s.dequeue(q)
        m = s.dequeue(q)
        assert m is not None and m.payload == b"committed around"
        s.commit()


def test_every_public_method_of_a_closed_session_raises_session_closed(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    s = connect(dsn)
    s.queue_info(q)  # cached, and the queue loaded: nothing left that needs the database
    s.ring(q)
    # white-box (Session._link.cidx): the index of the session's client entry, to read
    # that entry in the section after close; no public name gives it.
    cidx = s._link.cidx
    s.close()
    entry = s.section.clients[cidx * L.CLIENT_WORDS : (cidx + 1) * L.CLIENT_WORDS].tolist()
    calls: dict[str, Callable[[], object]] = {
        "queue_info": lambda: s.queue_info(q),
        "stats": lambda: s.stats(q),
        "ring": lambda: s.ring(q),
        "enqueue": lambda: s.enqueue(q, b"x"),
        "enqueue_many": lambda: s.enqueue_many(q, [b"x"]),
        "dequeue": lambda: s.dequeue(q),
        "dequeue_many": lambda: s.dequeue_many(q, 2),
        "commit": s.commit,
        "rollback": s.rollback,
        "transaction": lambda: s.transaction().__enter__(),
        "connection": lambda: s.connection,
        "xid": lambda: s.xid("g"),
        "tpc_begin": lambda: s.tpc_begin("g"),
        "tpc_prepare": s.tpc_prepare,
        "tpc_decide": s.tpc_decide,
        "tpc_commit": s.tpc_commit,
        "tpc_rollback": s.tpc_rollback,
        "subscribe": lambda: s.subscribe("queue.*"),
        "publish": lambda: s.publish("x.y"),
    }
    for name, call in calls.items():
        with pytest.raises(SessionClosed):
            call()
            pytest.fail(f"{name} worked on a closed session")
    # Nothing was written into the freed client entry (no backend pid, no reopening).
    assert s.section.clients[cidx * L.CLIENT_WORDS : (cidx + 1) * L.CLIENT_WORDS].tolist() == entry
    assert entry[L.C_PID] == 0
    s.close()  # twice is harmless
    assert s.closed


def test_corrupted_section_neither_duplicates_nor_loses(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=32)
    with connect(dsn) as s:
        s.enqueue_many(q, [str(i).encode() for i in range(20)])
        s.commit()
        for _ in range(5):
            s.dequeue(q)
        s.commit()  # 0..4 consumed, 5..19 ready
        ring = s.ring(q)
        sec = s.section
        # Corrupt: mark every slot ready (consumed and free ones too) and move
        # the tail back, as a stale or damaged section would.
        w0, nw = ring.w0, 1
        sec.enq[w0 : w0 + nw] = (1 << 32) - 1
        sec.deq[w0 : w0 + nw] = 0
        sec.queues[ring.qb + L.Q_TAIL] = 0
        sec.queues[ring.qb + L.Q_HEAD] = 32
    got = drain(dsn, q)
    payloads = [int(m.payload) for m in got]
    assert payloads == list(range(5, 20))
    with connect(dsn) as s:
        # The head was moved too: enqueue must not overwrite, and must still work.
        s.enqueue(q, b"after")
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"after"]


def test_head_behind_rows_is_repaired_without_overwrite(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"a", b"b", b"c"])
        s.commit()
        make_stale(s, q)  # stale head: seq 0..2 are taken
        s.enqueue(q, b"d")  # reserves seq 0 again: its row write is refused at commit
        with pytest.raises(StaleSection):
            s.commit()
        s.enqueue(q, b"d")  # the retry, on the resynced section
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"a", b"b", b"c", b"d"]


def test_enqueue_many_on_a_partly_stale_section_keeps_the_batch_in_order(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"a", b"b", b"c"])  # seq 0..2 in slots 0..2
        s.commit()
        ring = s.ring(q)
        # Stale head: the batch's first two slots (1, 2) hold queued entries,
        # its last two (3, 4) are free, so only part of the batch could be
        # written: the whole transaction is refused at commit.
        s.section.queues[ring.qb + L.Q_HEAD] = 1
        resyncs = s.section.queues[ring.qb + L.Q_N_RESYNC]
        s.enqueue_many(q, [b"w", b"x", b"y", b"z"])
        with pytest.raises(StaleSection):
            s.commit()
        assert s.section.queues[ring.qb + L.Q_N_RESYNC] == resyncs + 1
        assert ring.counts()["locked"] == 0
        seqs = s.enqueue_many(q, [b"w", b"x", b"y", b"z"])  # the batch redone, in order
        assert seqs == sorted(seqs) and min(seqs) > 2
        s.commit()
        assert ring.counts()["locked"] == 0
    got = drain(dsn, q)
    assert [m.payload for m in got] == [b"a", b"b", b"c", b"w", b"x", b"y", b"z"]
    assert [m.seq for m in got][3:] == seqs
    assert [m.producer_seq for m in got][3:] == sorted(m.producer_seq for m in got[3:])
    with connect(dsn) as s:
        s.enqueue(q, b"after")  # the withdrawn rows are free slots again
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"after"]


def test_section_lost_is_rebuilt_from_the_tables(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"a", b"b", b"c"])
        s.commit()
        s.dequeue(q)
        s.commit()
        instance = s.instance
    Section.unlink(instance)  # as after a host reboot
    assert [m.payload for m in drain(dsn, q)] == [b"b", b"c"]


def _child_uses_inherited_session(s: Any, queue: str, conn_q: Any) -> None:
    try:
        s.enqueue(queue, b"from child")
        s.commit()
        conn_q.put("ok")
    except Exception as exc:
        conn_q.put(repr(exc))


def test_session_is_fork_safe(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()
    with connect(dsn) as s:
        s.enqueue(q, b"parent")
        out = FORK.Queue()
        p = FORK.Process(target=_child_uses_inherited_session, args=(s, q, out))
        p.start()
        assert out.get(timeout=30) == "ok"
        p.join(10)
        # The parent's connection and open transaction are untouched by the child.
        s.commit()
    assert sorted(m.payload for m in drain(dsn, q)) == [b"from child", b"parent"]


def _child_enqueues(dsn: str, queue: str, out: Any) -> None:
    try:
        with connect(dsn) as s:
            s.enqueue(queue, b"from child")
            s.commit()
        out.put("ok")
    except Exception as exc:
        out.put(repr(exc))


def test_a_fork_while_another_thread_holds_the_attachment_lock_does_not_hang_the_child(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A monitor's or a pool's recovery thread takes the per-process attachment
    lock every 100 ms; a fork at that moment must not leave the child waiting
    for a lock whose holder does not exist there."""
    from ringq.engine.section._process import _Process

    q = make_queue()
    with connect(dsn):  # the parent is attached, as a monitor would be
        pass
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _Process.lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    try:
        out = FORK.Queue()
        p = FORK.Process(target=_child_enqueues, args=(dsn, q, out), daemon=True)
        p.start()
        try:
            assert out.get(timeout=30) == "ok"
        finally:
            p.kill()
            p.join(10)
    finally:
        release.set()
        holder.join(10)
    assert [m.payload for m in drain(dsn, q)] == [b"from child"]


def test_two_phase_commit_and_rollback(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    a, b = make_queue(), make_queue()
    with face(dsn) as s1, face(dsn) as s2:
        gid = uuid.uuid4().hex
        s1.tpc_begin(s1.xid(gid + "-1"))
        s2.tpc_begin(s2.xid(gid + "-2"))
        s1.enqueue(a, b"2pc-a")
        s2.enqueue(b, b"2pc-b")
        s1.tpc_prepare()
        s2.tpc_prepare()
        assert drain(dsn, a) == []
        s1.tpc_commit()
        s2.tpc_commit()
        s1.tpc_begin(s1.xid(gid + "-3"))
        s1.enqueue(a, b"never")
        s1.tpc_prepare()
        s1.tpc_rollback()
    assert [m.payload for m in drain(dsn, a)] == [b"2pc-a"]
    assert [m.payload for m in drain(dsn, b)] == [b"2pc-b"]


def test_tpc_decide_records_the_decision_until_commit_or_rollback(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as s:
        s.tpc_begin(s.xid(uuid.uuid4().hex))
        s.enqueue(q, b"decided")
        with pytest.raises(TransactionError):
            s.tpc_decide()  # not prepared yet: nothing to decide
        s.tpc_prepare()
        s.tpc_decide()
        with psycopg.connect(dsn, autocommit=True) as c:
            prepared = [r[0] for r in c.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]
        assert decided_gids(dsn) == prepared  # durable before COMMIT PREPARED, same gid
        s.tpc_commit()
        assert decided_gids(dsn) == []
        s.tpc_begin(s.xid(uuid.uuid4().hex))
        s.enqueue(q, b"undecided")
        s.tpc_prepare()
        s.tpc_rollback()  # no decision yet: the participant may still vote no
        assert decided_gids(dsn) == []
    assert [m.payload for m in drain(dsn, q)] == [b"decided"]


def test_a_decided_transaction_refuses_rollback(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()
    with connect(dsn) as s:
        s.tpc_begin(s.xid(uuid.uuid4().hex))
        s.enqueue(q, b"decided")
        s.tpc_prepare()
        s.tpc_decide()
        gid = prepared_gids(dsn)
        for undo in (s.tpc_rollback, s.rollback):
            with pytest.raises(TransactionError, match="decided to commit"):
                undo()
        # Nothing was withdrawn or rolled back: commit still finishes it.
        assert prepared_gids(dsn) == gid and decided_gids(dsn) == gid
        s.tpc_commit()
        assert prepared_gids(dsn) == [] and decided_gids(dsn) == []
    assert [m.payload for m in drain(dsn, q)] == [b"decided"]


class _Boom(Exception):
    pass


@pytest.mark.parametrize("exit", ["close", "with", "transaction"])
def test_a_decided_transaction_left_at_close_is_committed_by_recovery(
    dsn: str, make_queue: Callable[..., str], exit: str
) -> None:
    from ringq.engine.recovery import resolve_prepared

    q = make_queue()
    s = connect(dsn)
    sec, ring = s.section, s.ring(q)

    def prepare_and_decide() -> None:
        s.tpc_begin(s.xid(uuid.uuid4().hex))
        s.enqueue(q, b"decided")
        s.tpc_prepare()
        s.tpc_decide()

    if exit == "close":
        prepare_and_decide()
        s.close()
    elif exit == "with":
        with pytest.raises(_Boom), s:
            prepare_and_decide()
            raise _Boom
    else:
        with (
            pytest.raises(_Boom),
            s.transaction(),
        ):  # the caller's exception, not a TransactionError
            prepare_and_decide()
            raise _Boom
        assert len(prepared_gids(dsn)) == 1  # not rolled back; the session still owns it
        s.close()
    assert s.closed
    # Left prepared, decision kept, its slot held for recovery (not voided).
    gids = prepared_gids(dsn)
    assert len(gids) == 1 and decided_gids(dsn) == gids
    assert ring.counts()["locked"] == 1
    assert sec.owner_w[ring.base + ring.tail % ring.cap] == L.OWNER_HELD
    assert drain(dsn, q) == []
    done = resolve_prepared(sec, dsn, timeout_s=3600)
    assert done == [(gids[0], "commit")]
    assert ring.counts()["locked"] == 0
    assert prepared_gids(dsn) == [] and decided_gids(dsn) == []
    assert [m.payload for m in drain(dsn, q)] == [b"decided"]  # exactly once
    assert drain(dsn, q) == []
    assert resolve_prepared(sec, dsn, timeout_s=0) == []


def test_tpc_commit_clears_the_decision_even_if_what_follows_fails(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ringq.engine.recovery import recover_dead_clients

    q = make_queue()
    with connect(dsn) as s:
        s.tpc_begin(s.xid(uuid.uuid4().hex))
        s.enqueue(q, b"committed")
        s.tpc_prepare()
        s.tpc_decide()

        def finish_fails(*args: object, **kwargs: object) -> None:
            raise DatabaseUnavailable("failed after COMMIT PREPARED")

        # white-box (Session._txn.finish): the step after COMMIT PREPARED fails; no public
        # hook can make it fail while the COMMIT PREPARED itself went through.
        monkeypatch.setattr(s._txn, "finish", finish_fails)
        with pytest.raises(DatabaseUnavailable):
            s.tpc_commit()
        assert prepared_gids(dsn) == [] and decided_gids(dsn) == []
        monkeypatch.undo()
        sec, ring = s.section, s.ring(q)
    # The slot the session could not finish went to recovery at close.
    deadline = time.monotonic() + 5
    while ring.counts()["locked"] and time.monotonic() < deadline:
        recover_dead_clients(sec, dsn)
    assert [m.payload for m in drain(dsn, q)] == [b"committed"]


@pytest.mark.parametrize("decide", [True, False])
def test_tpc_commit_in_doubt_is_resolved_by_the_decision(
    dsn: str, make_queue: Callable[..., str], decide: bool
) -> None:
    from ringq.engine.recovery import resolve_prepared

    q = make_queue()
    with connect(dsn) as s:
        s.tpc_begin(s.xid(uuid.uuid4().hex))
        s.enqueue(q, b"in doubt")
        s.tpc_prepare()
        if decide:
            s.tpc_decide()
        terminate_backend(dsn, s.backend_pid)
        with pytest.raises(InDoubt):
            s.tpc_commit()
        assert s.ring(q).counts()["locked"] == 1  # held for recovery, not guessed
        done = resolve_prepared(s.section, dsn, timeout_s=3600 if decide else 0)
        assert [v for _, v in done] == ["commit" if decide else "rollback"]
        assert s.ring(q).counts()["locked"] == 0
        assert decided_gids(dsn) == []
    assert [m.payload for m in drain(dsn, q)] == ([b"in doubt"] if decide else [])


def test_connection_lost_mid_transaction_frees_slots(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q = make_queue()
    with face(dsn) as s:
        s.enqueue(q, b"keep")
        s.commit()
        m = s.dequeue(q)
        assert m is not None
        terminate_backend(dsn, s.backend_pid)
        with pytest.raises(TransactionError):
            s.commit()
        # The session recovered: the entry is ready again (not lost, not consumed).
        again = s.dequeue(q)
        assert again is not None and again.payload == b"keep"
        s.commit()
    assert drain(dsn, q) == []


def test_subscribe_receives_named_events_by_wildcard(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as s, s.subscribe(f"queue.{q}.*") as sub:
        with connect(dsn) as other:
            other.publish("queue.other.full", depth=1)
            other.publish(f"queue.{q}.full", depth=64)
            other.commit()
        event = sub.get(timeout=10)
        assert event is not None and event.name == f"queue.{q}.full" and event.data["depth"] == 64
        assert sub.get(timeout=0.2) is None


def test_rollback_without_counting_a_delivery(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    q = make_queue(max_deliveries=2)
    with face(dsn) as s:
        s.enqueue(q, b"x")
        s.commit()
        for _ in range(3):  # more than max_deliveries: never poisoned
            assert s.dequeue(q) is not None
            s.rollback(count_delivery=False)
        m = s.dequeue(q)
        assert m is not None and m.deliveries == 1
        s.commit()


def test_interrupted_wait_leaves_no_waiter_behind(dsn: str, make_queue: Callable[..., str]) -> None:
    import signal as sig

    q = make_queue()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = sig.signal(sig.SIGALRM, interrupt)
    try:
        with connect(dsn) as s:
            sig.setitimer(sig.ITIMER_REAL, 0.2)
            with pytest.raises(KeyboardInterrupt):
                s.dequeue(q, wait=5)
            ring = s.ring(q)
            assert s.section.queues[ring.qb + L.Q_WAIT_READY] == 0
            s.rollback()
    finally:
        sig.setitimer(sig.ITIMER_REAL, 0)
        sig.signal(sig.SIGALRM, old)


def test_dropped_queues_give_their_section_blocks_back(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    from ringq.scripting import drop_queue

    for i in range(L.MAX_QUEUES + 10):  # more queues over time than the section has blocks
        name = f"churn_{i}"
        with psycopg.connect(dsn) as conn:
            create_queue(conn, QueueSpec(name, 64, 100))
        with connect(dsn) as s:
            s.enqueue(name, b"x")
            s.commit()
            assert present(s.dequeue(name)).payload == b"x"
            s.commit()
        with psycopg.connect(dsn, autocommit=True) as conn:
            drop_queue(conn, name)


def test_client_entry_records_the_errors_it_hits_not_the_callers_sql(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    from ringq.engine import RingqError
    from ringq.engine import metrics as M

    q = make_queue(capacity=8, max_payload=4)
    with connect(dsn) as s:
        # white-box (Session._link.cidx): the client entry whose counters the test reads
        # in the section; no public name gives its index.
        cidx, sec = s._link.cidx, s.section
        qid = s.queue_info(q).id
        s.enqueue(q, b"a")
        s.commit()
        assert s.dequeue(q) is not None
        s.commit()
        assert sec.client_error(cidx) == (0, 0, 0, 0, 0)  # the fast path records nothing
        with pytest.raises(PayloadTooLarge):
            s.enqueue(q, b"12345")
        n, code, eq, seq, ns = present(sec.client_error(cidx))
        assert (n, M.error_kind(code), eq, seq) == (1, "payload_too_large", qid, -1)
        assert abs(ns / 1e9 - time.time()) < 60
        # The caller's own SQL failing, and a queue statement refused because of it: not ours.
        with pytest.raises(psycopg.Error):
            s.connection.execute("SELECT 1/0")
        with pytest.raises(RingqError):
            s.enqueue(q, b"b")
        s.rollback()
        assert present(sec.client_error(cidx))[0] == 1
        # A stale section: the guarded row update does not match; repaired, recorded.
        s.enqueue_many(q, [b"c", b"d"])
        s.commit()
        ring = s.ring(q)
        make_stale(s, q)
        s.enqueue(q, b"e")
        with pytest.raises(StaleSection):
            s.commit()  # nothing committed; resynced: the retry goes through
        s.enqueue(q, b"e")
        s.commit()
        n, code, eq, seq, _ns = present(sec.client_error(cidx))
        assert n == 2 and M.error_kind(code) == "row_mismatch" and eq == qid and seq == 0
        assert sec.client_queues(cidx) == [ring.qidx]
        assert M.client_stats(sec, cidx)[M.ERRORS] == 2


@pytest.mark.parametrize("holding", [False, True])
def test_close_after_the_server_ended_the_connection_is_quiet(
    dsn: str, make_queue: Callable[..., str], caplog: pytest.LogCaptureFixture, holding: bool
) -> None:
    """Issue point 11: no ROLLBACK tried on a dead connection, no traceback at
    WARNING; at most one INFO line. A held entry goes to recovery."""
    import logging

    from ringq.engine.recovery import recover_dead_clients

    q = make_queue()
    with connect(dsn) as p:
        p.enqueue(q, b"x")
        p.commit()
    s = connect(dsn)
    sec, ring = s.section, s.ring(q)
    if holding:
        assert s.dequeue(q) is not None
    terminate_backend(dsn, s.backend_pid)
    with caplog.at_level(logging.INFO, logger="ringq"):
        s.close()
    ours = [r for r in caplog.records if r.name.startswith("ringq")]
    assert len(ours) <= 1 and all(r.levelno == logging.INFO and not r.exc_info for r in ours)
    assert s.closed
    deadline = time.monotonic() + 5
    while ring.counts()["locked"] and time.monotonic() < deadline:
        recover_dead_clients(sec, dsn)
    assert ring.counts()["locked"] == 0
    with connect(dsn) as c:
        m = c.dequeue(q)
        assert m is not None and m.deliveries == (2 if holding else 1)
        c.commit()


# -- no session idles in a transaction (issue point 3) ------------------------------------------


def _activity(dsn: str, pid: int) -> tuple[str, object]:
    state, xmin = activity_of(dsn, pid, "state, backend_xmin")
    return state, xmin


def test_a_session_is_idle_outside_any_transaction_between_transactions(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as s:
        assert _activity(dsn, s.backend_pid) == ("idle", None)  # after connecting
        s.queue_info(q)
        assert _activity(dsn, s.backend_pid) == ("idle", None)  # a queue lookup leaves nothing open
        s.enqueue(q, b"a")
        # the row write waits in the session for the commit: nothing open yet
        assert _activity(dsn, s.backend_pid) == ("idle", None)
        s.flush()  # sent now: inside the caller's transaction
        assert _activity(dsn, s.backend_pid)[0] == "idle in transaction"
        s.commit()
        assert _activity(dsn, s.backend_pid) == ("idle", None)
        s.stats(q)
        assert s.dequeue(q) is not None
        s.rollback()  # with a strike (its own statement)
        assert _activity(dsn, s.backend_pid) == ("idle", None)
        assert present(s.dequeue(q)).deliveries == 2
        s.commit()
        assert s.dequeue(q) is None
        s.commit()
        assert _activity(dsn, s.backend_pid) == ("idle", None)


def test_idle_in_transaction_timeout_does_not_end_an_idle_session(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with psycopg.connect(dsn, autocommit=True) as admin:
        db = admin.info.dbname
        admin.execute(f'ALTER DATABASE "{db}" SET idle_in_transaction_session_timeout = \'1s\'')
    with connect(dsn) as s:
        s.enqueue(q, b"a")
        s.commit()
        backend = s.backend_pid
        time.sleep(2)  # idle longer than the timeout: the point of the test
        s.enqueue(q, b"b")
        s.commit()
        assert s.backend_pid == backend  # the same connection: never ended
        assert [present(s.dequeue(q)).payload, present(s.dequeue(q)).payload] == [b"a", b"b"]
        s.commit()


def test_table_statistics_reach_postgresql_while_the_session_stays_open(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as s:
        for i in range(20):
            s.enqueue(q, b"%d" % i)
            s.commit()
        deadline = time.monotonic() + 15
        with psycopg.connect(dsn, autocommit=True) as admin:
            while True:
                row = admin.execute(
                    "SELECT n_tup_upd FROM pg_stat_user_tables"
                    " WHERE schemaname = 'ringq' AND relname = %s",
                    ("q_" + q,),
                ).fetchone()
                if row and row[0] >= 20:
                    break
                assert time.monotonic() < deadline, f"statistics not flushed: {row}"
                time.sleep(0.1)
        assert not s.closed


# -- arguments are checked up front, inside the RingqError tree (issue point 8) -----------------

_NAIVE = datetime(2030, 1, 1)  # no time zone: refused


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s, q: s.enqueue(q, b"x", key=5), "type"),
        (lambda s, q: s.enqueue(q, b"x", key="k" * 1001), "value"),
        (lambda s, q: s.enqueue(q, b"x", key="a\x00b"), "value"),
        (lambda s, q: s.enqueue(q, "text"), "type"),
        (lambda s, q: s.enqueue(q, 5), "type"),
        (lambda s, q: s.enqueue(q, None), "type"),
        (lambda s, q: s.enqueue(q, b"x", timeout=-1), "value"),
        (lambda s, q: s.enqueue(q, b"x", timeout=float("nan")), "value"),
        (lambda s, q: s.enqueue(q, b"x", timeout="1"), "type"),
        (lambda s, q: s.enqueue(q, b"x", group=""), "value"),
        (lambda s, q: s.enqueue(q, b"x", group=5), "type"),
        (lambda s, q: s.enqueue(q, b"x", delay=-1), "value"),
        (lambda s, q: s.enqueue(q, b"x", delay=float("inf")), "value"),
        (lambda s, q: s.enqueue(q, b"x", delay="1"), "type"),
        (lambda s, q: s.enqueue(q, b"x", not_before=_NAIVE), "value"),
        (lambda s, q: s.enqueue(q, b"x", not_before="2030-01-01"), "type"),
        (lambda s, q: s.enqueue(q, b"x", delay=1, not_before=_NAIVE), "value"),
        (lambda s, q: s.enqueue(q, b"x", trace=5), "type"),
        (lambda s, q: s.enqueue(q, b"x", trace="\n"), "value"),
        (lambda s, q: s.enqueue_many(q, b"abc"), "type"),
        (lambda s, q: s.enqueue_many(q, ["a", "b"]), "type"),
        (lambda s, q: s.enqueue_many(q, 5), "type"),
        (lambda s, q: s.enqueue_many(q, (p for p in [b"a", "b"])), "type"),
        (lambda s, q: s.enqueue_many(q, [b"a", b"b"], group=["g"]), "value"),
        (lambda s, q: s.enqueue_many(q, [b"a", b"b"], group=(g for g in ["g"])), "value"),
        (lambda s, q: s.enqueue_many(q, [b"a"], group=b"g"), "type"),
        (lambda s, q: s.enqueue_many(q, [b"a"], timeout=-1), "value"),
        (lambda s, q: s.enqueue_many(q, [b"a"], delay=-1), "value"),
        (lambda s, q: s.dequeue_many(q, 0), "value"),
        (lambda s, q: s.dequeue_many(q, -3), "value"),
        (lambda s, q: s.dequeue_many(q, 2.5), "type"),
        (lambda s, q: s.dequeue_many(q, True), "type"),
        (lambda s, q: s.dequeue_many(q, 2, wait=-1), "value"),
        (lambda s, q: s.dequeue_many(q, 2, wait=float("inf")), "value"),
        (lambda s, q: s.dequeue_many(q, 2, wait="1"), "type"),
        (lambda s, q: s.dequeue(q, wait=-0.5), "value"),
        (lambda s, q: s.dequeue(q, wait=float("nan")), "value"),
        (lambda s, q: s.dequeue(q, wait=float("inf")), "value"),
        (lambda s, q: s.dequeue(q, wait="1"), "type"),
    ],
)
@pytest.mark.timeout(60)  # a wait=inf that is not refused would wait for ever
def test_bad_arguments_raise_ringq_errors_before_anything_is_done(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any],
    call: Callable[[Any, str], object], error: str,
) -> None:
    """Each face (sync, asyncio) refuses each bad argument with the same
    InvalidArgument, before it reserves, claims or sends anything."""
    from ringq.engine import InvalidArgument, InvalidArgumentType, RingqError

    q = make_queue()
    with face(dsn) as s:
        with pytest.raises(InvalidArgument) as info:
            call(s, q)
        assert isinstance(info.value, RingqError)
        assert isinstance(info.value, TypeError if error == "type" else ValueError)
        assert isinstance(info.value, InvalidArgumentType) == (error == "type")
        assert "UPDATE" not in str(info.value) and "SELECT" not in str(info.value)
        assert s.ring(q).counts()["locked"] == 0  # nothing reserved
        assert s.ring(q).waiters(OpKind.DEQUEUE) == 0  # nor waited for
        s.enqueue(q, b"ok", key="k" * 1000)  # the session goes on
        s.commit()
        assert present(s.dequeue(q)).payload == b"ok"
        s.commit()


# -- a batch held as one run ----------------------------------------------------------------------


def test_batches_and_single_entries_of_two_queues_commit_together_in_order(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """enqueue_many (held as one run) beside single enqueues on two queues, a
    flush in the middle: one commit makes them all, each queue in order,
    with their producer sequences; a rollback of the same shape makes none."""
    q1, q2 = make_queue(capacity=256), make_queue(capacity=256)

    def put_all(s: Session) -> list[int]:
        first = s.enqueue_many(q1, [b"a%d" % i for i in range(20)])
        s.enqueue(q2, b"single")
        s.flush()
        s.enqueue_many(q2, [b"b%d" % i for i in range(12)])
        s.enqueue(q1, b"last")
        return first

    with connect(dsn, producer="mixed") as s:
        put_all(s)
        s.rollback()
        assert drain(dsn, q1) == [] and drain(dsn, q2) == []
        first = put_all(s)
        s.commit()
    got1, got2 = drain(dsn, q1, batch=50), drain(dsn, q2, batch=50)
    assert [m.payload for m in got1] == [b"a%d" % i for i in range(20)] + [b"last"]
    assert [m.payload for m in got2] == [b"single"] + [b"b%d" % i for i in range(12)]
    assert [m.seq for m in got1[:20]] == first
    pseqs = [m.producer_seq for m in sorted(got1 + got2, key=lambda m: m.producer_seq)]
    assert pseqs == list(range(pseqs[0], pseqs[0] + 34))
    assert {m.producer for m in got1 + got2} == {"mixed"}


def test_a_cached_batch_rolled_back_is_redelivered_and_one_committed_is_gone(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A dequeue_many served from the payload cache (one run): rolled back,
    every entry comes back with its delivery counted (read from the rows);
    a cached batch committed leaves nothing, and the counters say so."""
    q = make_queue(capacity=256)
    enqueue_committed(dsn, q, *[b"p%d" % i for i in range(40)])
    with connect(dsn) as s:
        taken = s.dequeue_many(q, 20)
        assert len(taken) == 20 and all(m.deliveries == 1 for m in taken)
        s.rollback()
        assert s.stats(q)["deq_rollbacks"] == 20
        again = s.dequeue_many(q, 20)
        assert [m.seq for m in again] == [m.seq for m in taken]
        assert all(m.deliveries == 2 for m in again)
        s.commit()
        rest = s.dequeue_many(q, 40)
        assert [m.payload for m in rest] == [b"p%d" % i for i in range(20, 40)]
        assert all(m.deliveries == 1 for m in rest)
        s.commit()
        assert s.dequeue_many(q, 40) == []
        stats = s.stats(q)
        assert stats["depth"] == 0 and stats["deq_commits"] == 40, stats
    assert drain(dsn, q) == []


def test_pg_notifies_returns_what_came_and_waits_at_most_its_timeout(dsn: str) -> None:
    from ringq.engine import pg

    with psycopg.connect(dsn, autocommit=True) as c, psycopg.connect(dsn, autocommit=True) as o:
        c.execute("LISTEN t_notifies")
        began = time.monotonic()
        assert pg.notifies(c, 0.2) == []
        assert 0.15 < time.monotonic() - began < 5
        o.execute("NOTIFY t_notifies, 'a'")
        assert [n.payload for n in pg.notifies(c, 5)] == ["a"]
        # One that a statement's results brought (psycopg keeps it aside):
        # returned at once, not after a wait on a socket with nothing to read.
        o.execute("NOTIFY t_notifies, 'b'")
        time.sleep(0.2)
        c.execute("SELECT 1")
        began = time.monotonic()
        assert [n.payload for n in pg.notifies(c, 5)] == ["b"]
        assert time.monotonic() - began < 2.5
