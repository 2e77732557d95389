"""Groups: entries of one group delivered in order, at most one held at a
time across every consumer on the host; other groups taken in parallel,
read past, never waited on. The section decides it from a per-slot group tag
and the held slots; these tests check it from the outside: in-process
sessions, forked consumers killed with kill -9, and a run of several
consumer processes whose dequeue and commit times are compared afterwards.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import drain, present, remove_section, wait_for
from psycopg import sql
from ringq.engine import InvalidArgument, InvalidArgumentType, Message, connect
from ringq.engine import layout as L
from ringq.engine.recovery import recover_dead_clients
from ringq.monitor import pump_inbox

FORK = mp.get_context("fork")


def groups_of(msgs: list[Message]) -> list[tuple[str | None, bytes]]:
    return [(m.group, m.payload) for m in msgs]


@pytest.mark.parametrize("cache_payload", [0, 64])
def test_one_entry_of_a_group_is_held_at_a_time_and_others_are_read_past(
    dsn: str, make_queue: Callable[..., str], cache_payload: int
) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared", cache_payload=cache_payload)
    with connect(dsn) as p:
        p.enqueue(q, b"a1", group="a")
        p.enqueue(q, b"a2", group="a")
        p.enqueue(q, b"b1", group="b")
        p.enqueue(q, b"free")  # no group: never waits for anyone
        p.commit()
    with connect(dsn) as c1, connect(dsn) as c2, connect(dsn) as c3:
        m1 = present(c1.dequeue(q))
        assert (m1.group, m1.payload) == ("a", b"a1")
        m2 = present(c2.dequeue(q))  # a2 is read past: group a is busy
        assert (m2.group, m2.payload) == ("b", b"b1")
        m3 = present(c3.dequeue(q))
        assert (m3.group, m3.payload) == (None, b"free")
        c3.commit()
        assert c3.dequeue(q) is None  # a and b are busy: nothing for c3
        ring = c3.ring(q)
        assert c3.section.queues[ring.qb + L.Q_N_GROUP_SKIPS] >= 1
        c1.commit()  # frees group a
        m4 = present(c3.dequeue(q))
        assert (m4.group, m4.payload) == ("a", b"a2")
        c3.commit()
        c2.commit()
    assert drain(dsn, q) == []


def test_dequeue_many_takes_at_most_one_entry_per_group(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=32, dequeue_mode="shared")
    with connect(dsn) as p:
        p.enqueue_many(q, [b"a1", b"a2", b"b1"], group=["a", "a", "b"])
        p.enqueue_many(q, [b"n1", b"n2"])
        p.enqueue_many(q, [b"c1", b"c2"], group="c")
        p.commit()
    with connect(dsn) as c:
        got = c.dequeue_many(q, 10)
        assert groups_of(got) == [("a", b"a1"), ("b", b"b1"), (None, b"n1"), (None, b"n2"),
                                  ("c", b"c1")]
        assert c.dequeue_many(q, 10) == []  # this transaction holds a and c already
        c.commit()
        assert groups_of(c.dequeue_many(q, 10)) == [("a", b"a2"), ("c", b"c2")]
        c.commit()
    assert drain(dsn, q) == []


def test_a_rolled_back_entry_returns_to_the_head_of_its_group(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared", max_deliveries=5)
    with connect(dsn) as p:
        p.enqueue_many(q, [b"a1", b"a2", b"a3"], group="a")
        p.commit()
    with connect(dsn) as c:
        assert present(c.dequeue(q)).payload == b"a1"
        c.rollback()
        again = present(c.dequeue(q))
        assert (again.payload, again.deliveries, again.group) == (b"a1", 2, "a")
        c.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"a2", b"a3"]


def test_a_poisoned_entry_leaves_its_group_which_goes_on(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared", max_deliveries=2)
    with connect(dsn) as p:
        p.enqueue_many(q, [b"poison", b"next"], group="g")
        p.commit()
    with connect(dsn) as c:
        for _ in range(2):
            assert present(c.dequeue(q)).payload == b"poison"
            c.rollback()
        m = present(c.dequeue(q))
        assert (m.payload, m.group) == (b"next", "g")
        c.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = present(conn.execute(
            "SELECT e.msg_group, e.payload FROM ringq.exceptions e JOIN ringq.queues q"
            " ON q.id = e.queue_id WHERE q.name = %s", (q,)
        ).fetchone())
    assert (row[0], bytes(row[1])) == ("g", b"poison")


def _die_holding(dsn: str, queue: str, ready: Any) -> None:
    with connect(dsn) as s:
        m = s.dequeue(queue)
        assert m is not None and m.group == "k"
        ready.set()
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_consumer_killed_holding_an_entry_frees_its_group_when_decided(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared")
    with connect(dsn) as s:
        s.enqueue_many(q, [b"k1", b"k2"], group="k")
        s.commit()
        ready = FORK.Event()
        p = FORK.Process(target=_die_holding, args=(dsn, q, ready))
        p.start()
        p.join(30)
        assert ready.is_set() and p.exitcode == -signal.SIGKILL
        ring = s.ring(q)
        assert ring.busy_groups() != set()
        # k2 is never taken while the dead holds k1: a dequeue finds nothing,
        # or (no monitor serves) recovers the dead holder itself and gets k1.
        for _ in range(100):
            m = s.dequeue(q)
            if m is not None:
                break
            s.rollback()
            recover_dead_clients(s.section, dsn)
        m = present(m)
        assert (m.payload, m.deliveries) == (b"k1", 2)  # back at the head of its group
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"k2"]


def test_groups_survive_a_reload_of_the_section_from_the_rows(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared")
    with connect(dsn) as p:
        p.enqueue_many(q, [b"x1", b"x2", b"y1"], group=["x", "x", "y"])
        p.commit()
    remove_section(dsn)  # the next session loads the queue from its rows
    with connect(dsn) as c1, connect(dsn) as c2:
        assert present(c1.dequeue(q)).payload == b"x1"
        assert present(c2.dequeue(q)).payload == b"y1"  # x2 read past: group tags reloaded
        c2.commit()
        assert c2.dequeue(q) is None
        c1.commit()
        m = present(c2.dequeue(q))
        assert (m.payload, m.group) == (b"x2", "x")
        c2.commit()


def test_two_phase_commit_holds_the_group_until_decided(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared")
    with connect(dsn) as p:
        p.enqueue_many(q, [b"t1", b"t2"], group="t")
        p.commit()
    with connect(dsn) as s, connect(dsn) as other:
        s.tpc_begin(s.xid("group-test"))
        assert present(s.dequeue(q)).payload == b"t1"
        s.tpc_prepare()
        assert other.dequeue(q) is None  # prepared, not decided: the group stays busy
        other.rollback()
        s.tpc_commit()
        assert present(other.dequeue(q)).payload == b"t2"
        other.commit()


def test_sql_enqueue_with_a_group_reaches_the_ring_in_that_group(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT ringq.enqueue(%s, %b, %s)", (q, b"s1", "sql-group"))
        conn.execute("SELECT ringq.enqueue(%s, %b, %s)", (q, b"s2", "sql-group"))
        conn.execute("SELECT ringq.enqueue(%s, %b)", (q, b"plain"))  # the old call still works
        for bad in ("", "é" * 65):  # empty; 130 bytes of UTF-8
            with pytest.raises(psycopg.errors.InvalidParameterValue):
                conn.execute("SELECT ringq.enqueue(%s, %b, %s)", (q, b"x", bad))
    assert pump_inbox(dsn) == {q: 3}
    with connect(dsn) as c:
        assert groups_of(c.dequeue_many(q, 10)) == [("sql-group", b"s1"), (None, b"plain")]
        c.commit()
    assert groups_of(drain(dsn, q)) == [("sql-group", b"s2")]


def test_idempotent_enqueue_keeps_its_group(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared")
    with connect(dsn) as p:
        first = p.enqueue(q, b"k", key="key-1", group="kg")
        assert p.enqueue(q, b"k", key="key-1", group="kg") == first
        p.enqueue(q, b"after", group="kg")
        p.commit()
    with connect(dsn) as c:
        assert groups_of(c.dequeue_many(q, 5)) == [("kg", b"k")]
        c.commit()
    assert groups_of(drain(dsn, q)) == [("kg", b"after")]


@pytest.mark.parametrize(
    ("group", "error"),
    [
        ("", InvalidArgument),
        ("x" * 129, InvalidArgument),
        ("é" * 65, InvalidArgument),  # 130 bytes in UTF-8
        ("nul\x00", InvalidArgument),
        (42, InvalidArgumentType),
        (b"bytes", InvalidArgumentType),
    ],
)
def test_bad_groups_are_refused_before_anything_is_reserved(
    dsn: str, make_queue: Callable[..., str], group: Any, error: type[Exception]
) -> None:
    q = make_queue(capacity=4)
    with connect(dsn) as s:
        with pytest.raises(error):
            s.enqueue(q, b"x", group=group)
        with pytest.raises(error):
            s.enqueue_many(q, [b"x"], group=[group])
        assert s.ring(q).head == 0
    with connect(dsn) as s, pytest.raises(InvalidArgument, match="2 groups for 3 payloads"):
        s.enqueue_many(q, [b"1", b"2", b"3"], group=["a", "b"])
    with connect(dsn) as s:
        s.enqueue(q, b"x", group="é" * 64)  # 128 bytes: the most a group may have
        s.commit()
        assert present(s.dequeue(q)).group == "é" * 64
        s.commit()


# -- several consumer processes ---------------------------------------------------------------

N_GROUPS = 20
PER_GROUP = 30


def _produce(dsn: str, queue: str, name: str) -> None:
    with connect(dsn, producer=name) as s:
        for i in range(PER_GROUP):
            for g in range(N_GROUPS // 2):
                s.enqueue(queue, f"{name}:{i}".encode(), group=f"g{g}")
            s.commit()


def _consume(dsn: str, queue: str, table: str, stop: Any) -> None:
    with connect(dsn) as s:
        conn = s.connection
        while not stop.is_set():
            m = s.dequeue(queue, wait=0.2)
            if m is None:
                s.commit()
                continue
            taken = time.monotonic_ns()
            time.sleep(0.001)  # hold it a little, so overlaps would show
            conn.execute(
                sql.SQL("INSERT INTO {} VALUES (%s, %s, %s, %s, %s, %s)").format(
                    sql.Identifier(table)),
                (m.group, m.producer, m.producer_seq, m.seq, taken, time.monotonic_ns()),
            )
            s.commit()


def test_four_consumer_processes_keep_each_group_in_order_and_never_hold_two(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """Two producers into the same ten groups; four consumers record
    each entry's dequeue time and the time just before its commit in the
    same transaction: per group, producer sequences rise and the next
    dequeue comes after the previous commit began (one held at a time)."""
    q = make_queue(capacity=256, dequeue_mode="shared")
    table = f"log_{q}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "CREATE TABLE {} (grp text, producer text, pseq bigint, seq bigint,"
            " taken bigint, committing bigint)").format(sql.Identifier(table)))
    stop = FORK.Event()
    consumers = [FORK.Process(target=_consume, args=(dsn, q, table, stop)) for _ in range(4)]
    producers = [FORK.Process(target=_produce, args=(dsn, q, f"p{i}")) for i in range(2)]
    for p in consumers + producers:
        p.start()
    total = 2 * PER_GROUP * (N_GROUPS // 2)
    try:
        for p in producers:
            p.join(120)
            assert p.exitcode == 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with psycopg.connect(dsn, autocommit=True) as conn:
                n = present(conn.execute(
                    sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
                ).fetchone())[0]
            if n >= total:
                break
            time.sleep(0.2)
    finally:
        stop.set()
        for p in consumers:
            p.join(30)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(sql.SQL(
            "SELECT grp, producer, pseq, seq, taken, committing FROM {} ORDER BY taken"
        ).format(sql.Identifier(table))).fetchall()
    assert len(rows) == total and len({r[3] for r in rows}) == total  # each exactly once
    by_group: dict[str, list[tuple[Any, ...]]] = {}
    for r in rows:
        by_group.setdefault(r[0], []).append(r)
    assert len(by_group) == N_GROUPS // 2
    for g, entries in by_group.items():
        for prod in ("p0", "p1"):
            pseqs = [e[2] for e in entries if e[1] == prod]
            assert pseqs == sorted(pseqs), f"group {g}: {prod}'s entries out of order"
        for before, after in itertools.pairwise(entries):
            assert after[4] > before[5], f"group {g}: two entries held at once"
    assert drain(dsn, q) == []


def test_group_counts_show_ready_busy_and_the_oldest_waiting_head(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16, dequeue_mode="shared")
    with connect(dsn) as p:
        p.enqueue(q, b"plain")
        p.enqueue_many(q, [b"a1", b"a2", b"b1", b"c1"], group=["a", "a", "b", "c"])
        p.commit()
        assert p.ring(q).group_counts() == {
            "ready": 3, "busy": 0, "oldest_seq": 1, "oldest_slot": 1
        }
    with connect(dsn) as c:
        assert present(c.dequeue(q)).payload == b"plain"
        assert present(c.dequeue(q)).payload == b"a1"
        counts = c.ring(q).group_counts()
        assert counts == {"ready": 2, "busy": 1, "oldest_seq": 2, "oldest_slot": 2}
        c.commit()


def test_commit_and_dequeue_never_claims_the_next_entry_of_the_group_it_holds(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """The consumer loop claims its next entry before its commit: the entry
    it holds keeps its group busy, so the claim takes another group's entry
    (or none, and the next entry is taken after the commit)."""
    q = make_queue(capacity=32, dequeue_mode="shared", cache_payload=0)
    with connect(dsn) as p:
        p.enqueue_many(q, [b"a1", b"a2", b"b1", b"a3"], group=["a", "a", "b", "a"])
        p.commit()
    with connect(dsn) as c:
        got = [present(c.dequeue(q))]
        while True:
            m = c.commit_and_dequeue(q)
            if m is None:
                break
            got.append(m)
        c.commit()
    assert [m.payload for m in got] == [b"a1", b"b1", b"a2", b"a3"]


def test_a_commit_that_frees_a_group_wakes_a_dequeuer_sleeping_on_it(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """The group's next entry is ready the moment its holder commits: the
    commit posts the queue's wake-up to a sleeping dequeuer (counted), who
    does not wait for its periodic look."""
    q = make_queue(capacity=16, dequeue_mode="shared")
    with connect(dsn) as p:
        p.enqueue_many(q, [b"a1", b"a2"], group="a")
        p.commit()
    got: list[Message | None] = []
    with connect(dsn) as holder:
        assert present(holder.dequeue(q)).payload == b"a1"
        ring = holder.ring(q)
        Q = holder.section.queues

        def sleeper() -> None:
            with connect(dsn) as c:
                got.append(c.dequeue(q, wait=30))
                c.commit()

        t = threading.Thread(target=sleeper)
        t.start()
        wait_for(lambda: Q[ring.qb + L.Q_WAIT_READY] == 1, what="the dequeuer asleep")
        before = Q[ring.qb + L.Q_N_WAKEUPS]
        holder.commit()
        assert Q[ring.qb + L.Q_N_WAKEUPS] == before + 1
        t.join(30)
    assert [m.payload for m in got if m is not None] == [b"a2"]


def test_a_requeued_poison_entry_comes_back_in_its_group(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    from ringq.scripting import list_exceptions, requeue_exception

    q = make_queue(capacity=16, dequeue_mode="shared", max_deliveries=1)
    with connect(dsn) as p:
        p.enqueue(q, b"bad", group="r")
        p.commit()
    with connect(dsn) as c:
        assert present(c.dequeue(q)).payload == b"bad"
        c.rollback()  # its one delivery: poisoned
    with psycopg.connect(dsn) as conn:
        (entry,) = list_exceptions(conn, q)
        assert entry.group == "r"
        requeue_exception(conn, q, entry.seq)
    assert pump_inbox(dsn) == {q: 1}
    assert groups_of(drain(dsn, q)) == [("r", b"bad")]


def _prepare_grouped_and_die(dsn: str, queue: str, gid: str, ready: Any) -> None:
    s = connect(dsn)
    s.tpc_begin(s.xid(gid))
    s.enqueue(queue, b"p1", group="p")
    s.tpc_prepare()
    ready.set()
    time.sleep(60)


def test_a_prepared_enqueue_found_at_a_load_joins_its_group_when_committed(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """The row of a prepared enqueue is invisible when the section loads, so
    its slot is held with no group; decided committed, it takes its row's
    group, and the group's later entry is not taken beside it."""
    q = make_queue(capacity=8, dequeue_mode="shared")
    ready = FORK.Event()
    p = FORK.Process(target=_prepare_grouped_and_die, args=(dsn, q, "group-load", ready))
    p.start()
    assert ready.wait(30)
    os.kill(present(p.pid), signal.SIGKILL)
    p.join(10)
    with connect(dsn) as s:
        s.enqueue(q, b"p2", group="p")
        s.commit()
    with psycopg.connect(dsn, autocommit=True) as c:
        [gid] = [r[0] for r in c.execute("SELECT gid FROM pg_prepared_xacts").fetchall()]
    remove_section(dsn)  # loaded again: p1's slot held, p2 ready
    with connect(dsn) as c1, connect(dsn) as c2:
        ring = c1.ring(q)
        assert ring.locked_slots() == [(0, L.OWNER_HELD, 0)]
        assert int(c1.section.group[ring.base]) == 0  # no group known for it yet
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
        recover_dead_clients(c1.section, dsn)
        m = present(c1.dequeue(q))
        assert (m.payload, m.group) == (b"p1", "p")
        assert c2.dequeue(q) is None  # p2 waits: its group is busy
        c1.commit()
        assert present(c2.dequeue(q)).payload == b"p2"
        c2.commit()


def test_inbox_rows_the_library_refuses_go_to_the_exceptions_not_in_the_way(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """Rows put into ringq.inbox by hand, around ringq.enqueue(), with a payload
    or a group the library refuses, are moved to ringq.exceptions (under the
    negative of their inbox id, with the reason); the rows behind them move on."""
    q = make_queue(capacity=8, max_payload=16, dequeue_mode="shared")
    with psycopg.connect(dsn, autocommit=True) as conn:
        qid = present(conn.execute("SELECT id FROM ringq.queues WHERE name = %s", (q,)).fetchone())
        for payload, group in ((b"ok1", "g"), (b"x" * 17, None), (b"bad", ""), (b"ok2", "g")):
            conn.execute(
                "INSERT INTO ringq.inbox (queue_id, payload, msg_group) VALUES (%s, %b, %s)",
                (qid[0], payload, group),
            )
    assert pump_inbox(dsn) == {q: 2}
    assert groups_of(drain(dsn, q)) == [("g", b"ok1"), ("g", b"ok2")]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT seq < 0, octet_length(payload), reason FROM ringq.exceptions"
            " WHERE queue_id = %s ORDER BY seq DESC", qid
        ).fetchall()
        assert conn.execute("SELECT count(*) FROM ringq.inbox").fetchone() == (0,)
    assert [(neg, size) for neg, size, _ in rows] == [(True, 17), (True, 3)]
    assert "exceeds max_payload 16" in rows[0][2] and "must not be empty" in rows[1][2]
