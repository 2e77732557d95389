"""SQL consumers: ``ringq.dequeue(queue, n)`` from a plain connection, beside
linked sessions, with the monitor as the section's agent.

The step tests script two sessions as pgmq's isolation specs do (``c1`` and
``c2`` are SQL connections, ``s`` a linked session); the agent's moves are
waited for on what it writes (``ringq.offers``, the row's ``deliveries``).
Failure tests kill real processes and backends, restart the database, the
monitor, and remove the global section under it."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import (
    drain,
    enqueue_committed,
    own_server_queue,
    present,
    remove_section,
    terminate_backend,
    wait_for,
)
from psycopg import errors, sql
from ringq.engine import connect, queue_table
from ringq.engine.sqlpath import DEMAND_S
from ringq.monitor import Monitor, MonitorConfig

FAST = 0.2

Row = tuple[int, bytes, str, int, int, str | None, Any]


def take(conn: psycopg.Connection[Any], queue: str, n: int = 1) -> list[Row]:
    """One ``ringq.dequeue`` call in the connection's current transaction."""
    rows = conn.execute("SELECT * FROM ringq.dequeue(%s, %s)", (queue, n)).fetchall()
    return [tuple(r) for r in rows]


def got(rows: list[Row]) -> list[tuple[bytes, int]]:
    """(payload, deliveries) of each row taken."""
    return [(r[1], r[4]) for r in rows]


def offers(dsn: str, queue: str) -> list[int]:
    """The seqs of the queue's entries set aside for SQL consumers (listed)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return [int(r[0]) for r in c.execute(
            "SELECT o.seq + g FROM ringq.offers o JOIN ringq.queues q ON q.id = o.queue_id,"
            " generate_series(0, o.n - 1) AS g WHERE q.name = %s ORDER BY 1", (queue,))]


def set_aside(dsn: str, queue: str, n: int) -> list[int]:
    """Ask the agent for entries of ``queue`` as ``ringq.dequeue`` does when it
    finds nothing (NOTIFY ringq_want), and wait until ``n`` are listed. Asks
    again while waiting, as a consumer's loop does: an ask sent before the
    agent's connection LISTENs (a monitor just started) is lost."""
    with psycopg.connect(dsn, autocommit=True) as c:
        def listed() -> list[int] | None:
            o = offers(dsn, queue)
            if len(o) == n:
                return o
            c.execute("SELECT pg_notify('ringq_want', %s)", (queue,))
            return None

        out: list[int] = wait_for(listed, what=f"{n} entries set aside")
    return out


def strikes(dsn: str, queue: str, seq: int) -> int | None:
    """The row's count of deliveries that did not commit, once the entry is
    ready to be taken again (None: not queued at ``seq``, or a take's xid still
    in its ``xmax``: held, or not yet struck)."""
    query = sql.SQL(
        "SELECT deliveries FROM {} WHERE seq = %s AND state = 1 AND xmax = '0'::xid"
    ).format(queue_table(queue))
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(query, (seq,)).fetchone()
    return None if row is None else int(row[0])


def collect(dsn: str, queue: str, count: int, n: int = 10, timeout: float = 15.0) -> list[Row]:
    """Take entries of ``queue`` on an autocommit connection (each call
    commits) until ``count`` came; then check that no more come."""
    out: list[Row] = []
    with psycopg.connect(dsn, autocommit=True) as c:
        def more() -> bool:
            out.extend(take(c, queue, n))
            return len(out) >= count

        wait_for(more, timeout, f"{count} entries taken", every=0.005)
        assert nothing_for(c, queue) and len(out) == count, got(out)
    return out


def nothing_for(conn: psycopg.Connection[Any], queue: str, seconds: float = 0.3) -> bool:
    """True if ``ringq.dequeue`` returns nothing for ``seconds`` (each empty
    call's ask delivered: the agent had its chance to set entries aside).
    ``conn`` holds nothing taken (an empty call commits when it is not autocommit)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if take(conn, queue, 10):
            return False
        if not conn.autocommit:
            conn.commit()
        time.sleep(0.01)  # polling for an absence over a span, not synchronizing
    return True


def sql_take(conn: psycopg.Connection[Any], queue: str, n: int = 1,
             timeout: float = 10.0) -> list[Row]:
    """Call ringq.dequeue until it returns entries (the agent sets them aside
    on the first ask), in the connection's current transaction."""
    deadline = time.monotonic() + timeout
    while True:
        rows = conn.execute("SELECT * FROM ringq.dequeue(%s, %s)", (queue, n)).fetchall()
        if rows or time.monotonic() > deadline:
            return [tuple(r) for r in rows]
        if not conn.autocommit:
            conn.commit()  # the ask (NOTIFY) goes out at commit
        time.sleep(0.005)


def test_sql_dequeue_takes_entries_in_order_and_commit_consumes(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, b"a", b"b", b"c")
    monitor()
    with psycopg.connect(dsn) as c:
        rows = sql_take(c, q, 2)
        assert [r[1] for r in rows] == [b"a", b"b"]
        assert all(r[4] == 1 for r in rows)  # first delivery
        c.commit()
        rows = sql_take(c, q, 5)
        assert [r[1] for r in rows] == [b"c"]
        c.commit()
        assert c.execute("SELECT ringq.depth(%s)", (q,)).fetchone() == (0,)


def test_sql_rollback_gives_the_entry_back_counted(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, b"x")
    monitor()
    with psycopg.connect(dsn) as c:
        rows = sql_take(c, q)
        assert [r[1] for r in rows] == [b"x"]
        c.rollback()
        rows = sql_take(c, q)
        assert [(r[1], r[4]) for r in rows] == [(b"x", 2)]
        c.commit()
        assert sql_take(c, q, timeout=0.3) == []


def test_a_row_another_transaction_touched_is_set_aside_and_taken_without_a_false_delivery(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    """Takers pass a row with a non-zero xmax (a take that did not commit) and
    the agent counts it as a delivery. A row that another transaction locked
    or wrote and rolled back (an operator's SELECT ... FOR UPDATE, a linked
    write whose commit failed) carries one too: the agent writes such rows
    again before it sets them aside, so the entry is taken at once and
    counted as its first delivery."""
    q = make_queue(capacity=256, dequeue_mode="shared")
    enqueue_committed(dsn, q, *[b"%d" % i for i in range(100)])
    table = queue_table(q)
    with psycopg.connect(dsn) as c:
        c.execute(sql.SQL("SELECT 1 FROM {} WHERE state = 1 AND seq % 2 = 0 FOR UPDATE")
                  .format(table))
        c.commit()
        c.execute(sql.SQL("UPDATE {} SET deliveries = deliveries WHERE state = 1 AND seq % 2 = 1")
                  .format(table))
        c.rollback()
        assert c.execute(sql.SQL("SELECT count(*) FROM {} WHERE state = 1 AND xmax <> '0'::xid")
                         .format(table)).fetchone() == (100,)
    monitor()
    rows = collect(dsn, q, 100, n=100)
    assert sorted(got(rows)) == sorted((b"%d" % i, 1) for i in range(100))


@pytest.mark.parametrize("mode", ["shared", "single"])
def test_a_sql_take_rolled_back_comes_back_only_after_the_retry_delay(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor], mode: str
) -> None:
    q = make_queue(capacity=64, dequeue_mode=mode, retry_delay=1.0)
    enqueue_committed(dsn, q, b"x", b"y")
    monitor()
    with psycopg.connect(dsn) as c:
        assert [r[1] for r in sql_take(c, q)] == [b"x"]
        c.rollback()
        rolled_back = time.monotonic()
        rows = sql_take(c, q)
        if mode == "shared":  # read past the entry that waits for its retry
            assert got(rows) == [(b"y", 1)]
            c.commit()
            rows = sql_take(c, q)
        # single: the head waits, and the entries behind it with it
        assert got(rows) == [(b"x", 2)]
        assert time.monotonic() - rolled_back >= 0.9
        c.commit()
        if mode == "single":
            assert got(sql_take(c, q)) == [(b"y", 1)]
            c.commit()
        row = c.execute(f"SELECT deq_at >= not_before FROM ringq.q_{q} WHERE seq = 0").fetchone()
        assert row == (True,)  # by the database's clock too


def test_single_a_busy_linked_consumer_and_a_sql_consumer_take_turns_in_order(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=1024, dequeue_mode="single")
    enqueue_committed(dsn, q, *[str(n).encode() for n in range(400)])
    monitor()
    stop = threading.Event()
    linked: list[int] = []
    sql_got: list[int] = []

    def busy_linked() -> None:  # never pauses: dequeue, commit, again
        with connect(dsn) as s:
            while not stop.is_set():
                got_ = s.dequeue_many(q, 5, wait=0.05)
                s.commit()
                linked.extend(int(m.payload) for m in got_)

    t = threading.Thread(target=busy_linked, daemon=True)
    t.start()
    try:
        with psycopg.connect(dsn) as c:
            def sql_turn() -> bool:
                sql_got.extend(int(r[1]) for r in take(c, q, 5))
                c.commit()
                return len(linked) + len(sql_got) >= 400
            wait_for(sql_turn, timeout=60, what="every entry taken", every=0.005)
    finally:
        stop.set()
        t.join(30)
    assert sql_got, "the SQL consumer never got the role from a busy linked consumer"
    assert linked, "the linked consumer never got the role back"
    assert sorted(linked + sql_got) == list(range(400))  # each once
    assert sql_got == sorted(sql_got) and linked == sorted(linked)


def test_linked_consumers_read_past_entries_set_aside_and_get_them_back_when_sql_goes(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, b"1", b"2")
    monitor()
    with psycopg.connect(dsn, autocommit=True) as c:
        assert [r[1] for r in sql_take(c, q, 1)] == [b"1"]
    # b"2" is set aside for SQL consumers: a linked dequeuer reads past it ...
    with connect(dsn) as s:
        assert s.dequeue(q) is None
        s.rollback()
        # ... until no SQL consumer has asked for DEMAND_S: then it is given back.
        m = present(wait_for(lambda: s.dequeue(q), timeout=DEMAND_S + 10, what="entry given back"))
        assert m.payload == b"2" and m.deliveries == 1
        s.commit()


# -- two sessions, step by step (pgmq's isolation specs), SQL and linked mixed -----------------


def test_shared_steps_sql_and_linked_read_past_and_a_rollback_comes_back_counted(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, b"a", b"b", b"c", b"d")
    monitor()
    with psycopg.connect(dsn) as c1, psycopg.connect(dsn) as c2, connect(dsn) as s:
        # s (linked) takes a before any SQL consumer asked; the agent sets the rest aside.
        assert present(s.dequeue(q)).payload == b"a"
        seq_a = min(set_aside(dsn, q, 3)) - 1
        assert got(take(c1, q)) == [(b"b", 1)]           # c1 dequeue
        assert got(take(c2, q)) == [(b"c", 1)]           # c2 dequeue: reads past b
        s.rollback()                                      # a back at the head, counted
        wait_for(lambda: seq_a in offers(dsn, q), what="a set aside after the linked rollback")
        c1.rollback()                                     # b given back, counted by the agent
        c2.commit()                                       # c consumed
        wait_for(lambda: strikes(dsn, q, seq_a + 1) == 1, what="b struck")
        assert got(take(c2, q, 5)) == [(b"a", 2), (b"b", 2), (b"d", 1)]
        assert s.dequeue(q) is None                       # all held by c2: s reads past
        s.rollback()
        c2.commit()
        assert nothing_for(c1, q) and s.dequeue(q) is None
        s.commit()
    wait_for(lambda: not offers(dsn, q), what="the offers emptied")
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT ringq.depth(%s)", (q,)).fetchone() == (0,)


def test_single_steps_one_sql_dequeuer_at_a_time_in_order_then_the_role_goes_to_linked(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="single")
    enqueue_committed(dsn, q, b"a", b"b", b"c")
    monitor()
    set_aside(dsn, q, 3)
    with psycopg.connect(dsn) as c1, psycopg.connect(dsn) as c2, connect(dsn) as s:
        assert got(take(c1, q)) == [(b"a", 1)]            # c1 dequeue
        assert take(c2, q, 3) == []                       # c2: one SQL dequeuer at a time
        c2.commit()
        assert s.dequeue(q) is None                       # linked: the SQL path holds the role
        s.rollback()
        c1.rollback()
        # The order holds across the rollback: whatever c2 gets first starts with a.
        rows = sql_take(c2, q, 3)
        assert got(rows) == [(b"a", 2), (b"b", 1), (b"c", 1)]
        assert take(c1, q) == []                          # c2 still holds the SQL dequeuer lock
        c1.commit()
        c2.commit()
        # SQL consumers are done and go quiet: what is set aside afterwards goes
        # back to the linked dequeuer once nobody asked for DEMAND_S.
        enqueue_committed(dsn, q, b"d", b"e")
        m = present(s.dequeue(q, wait=DEMAND_S + 10))
        assert (m.payload, m.deliveries) == (b"d", 1)
        # ... and while it holds the role, SQL consumers get nothing.
        assert nothing_for(c1, q)
        s.commit()
        m = present(s.dequeue(q, wait=10.0))  # at once, or when the agent gives it back
        assert (m.payload, m.deliveries) == (b"e", 1)
        s.commit()
    wait_for(lambda: not offers(dsn, q), what="the offers emptied")


def test_groups_one_entry_held_across_sql_and_linked_and_in_order(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    with connect(dsn) as p:
        for payload, group in [(b"g1", "g"), (b"g2", "g"), (b"h1", "h"), (b"g3", "g"),
                               (b"h2", "h")]:
            p.enqueue(q, payload, group=group)
        p.commit()
    monitor()
    with psycopg.connect(dsn) as c1, psycopg.connect(dsn) as c2, connect(dsn) as s:
        g1 = present(s.dequeue(q))                        # s holds g1: group g is busy
        assert g1.payload == b"g1"
        set_aside(dsn, q, 1)                              # h1 only: g2 waits behind g1
        assert got(take(c1, q, 5)) == [(b"h1", 1)]        # c1 holds h1: group h busy too
        assert take(c2, q, 5) == []
        c2.commit()
        s.rollback()                                      # g1 back at the head of g
        rows = sql_take(c2, q, 5)                         # g1 again, g2 not with it
        assert [(r[1], r[4], r[5]) for r in rows] == [(b"g1", 2, "g")]
        assert s.dequeue(q) is None                       # both groups held by SQL
        s.rollback()
        c1.rollback()                                     # h1 back, counted
        c2.commit()                                       # g1 consumed: g2 next
        order: list[tuple[bytes, int]] = []
        with psycopg.connect(dsn, autocommit=True) as c3:
            def step() -> bool:
                rows = take(c3, q, 5)
                # At most one entry of a group per take (each take commits at once).
                assert len({r[5] for r in rows}) == len(rows), got(rows)
                order.extend(got(rows))
                return len(order) >= 4
            wait_for(step, what="the rest of both groups", every=0.005)
            assert nothing_for(c3, q)
        assert [x for x in order if x[0][:1] == b"g"] == [(b"g2", 1), (b"g3", 1)]
        assert [x for x in order if x[0][:1] == b"h"] == [(b"h1", 2), (b"h2", 1)]
        assert s.dequeue(q) is None
        s.commit()


def test_a_sql_take_rolled_back_max_deliveries_times_is_poison(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="single", max_deliveries=2)
    enqueue_committed(dsn, q, b"bad", b"good")
    monitor()
    with psycopg.connect(dsn) as c:
        for n in (1, 2):
            rows = sql_take(c, q)
            assert got(rows) == [(b"bad", n)]
            c.rollback()
        rows = sql_take(c, q, 5)                          # bad moved aside: good is next
        assert got(rows) == [(b"good", 1)]
        c.commit()
        assert nothing_for(c, q)
        ex = c.execute(
            "SELECT e.payload, e.deliveries FROM ringq.exceptions e"
            " JOIN ringq.queues q ON q.id = e.queue_id WHERE q.name = %s", (q,)).fetchall()
        assert ex == [(b"bad", 2)]
        assert c.execute("SELECT ringq.depth(%s)", (q,)).fetchone() == (0,)
    assert drain(dsn, q) == []


# -- failures: kill -9, terminated backends, monitor and database restarts, lost section --------

# A SQL consumer in a process of its own: takes up to argv[3] entries of queue
# argv[2] in one transaction, prints its backend pid and the seqs, then holds
# them (the transaction open) until killed.
HOLDER = r"""
import sys, time, psycopg
c = psycopg.connect(sys.argv[1])
end = time.monotonic() + 20
rows = []
while not rows and time.monotonic() < end:
    rows = c.execute("SELECT seq FROM ringq.dequeue(%s, %s)",
                     (sys.argv[2], int(sys.argv[3]))).fetchall()
    if not rows:
        c.commit()
        time.sleep(0.005)
print(c.info.backend_pid, *[r[0] for r in rows], flush=True)
sys.stdin.read()
"""


def test_entries_of_a_sql_consumer_killed_9_or_terminated_come_back_counted_once(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, b"k1", b"k2", b"k3", b"k4")
    monitor()
    with subprocess.Popen([sys.executable, "-c", HOLDER, dsn, q, "2"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        try:
            line = present(holder.stdout).readline().split()
            assert len(line) == 3, line               # its backend pid and two seqs
        finally:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(10)
    rows = collect(dsn, q, 4)
    assert sorted(got(rows)) == [(b"k1", 2), (b"k2", 2), (b"k3", 1), (b"k4", 1)]

    # pg_terminate_backend of a SQL consumer's backend: the same.
    enqueue_committed(dsn, q, b"t1", b"t2")
    c = psycopg.connect(dsn)
    try:
        assert got(sql_take(c, q, 1)) == [(b"t1", 1)]
        terminate_backend(dsn, c.info.backend_pid)
        with pytest.raises(psycopg.OperationalError):
            c.execute("SELECT 1")
    finally:
        c.close()
    rows = collect(dsn, q, 2)
    assert sorted(got(rows)) == [(b"t1", 2), (b"t2", 1)]
    assert drain(dsn, q) == []


def test_a_monitor_stopped_and_restarted_with_entries_set_aside_loses_and_doubles_nothing(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, *(b"e%d" % i for i in range(6)))
    m = monitor()
    set_aside(dsn, q, 6)
    with psycopg.connect(dsn) as c1, psycopg.connect(dsn) as c2, connect(dsn) as s:
        assert got(take(c1, q, 2)) == [(b"e0", 1), (b"e1", 1)]
        m.stop()
        # With the agent away, listed entries can still be taken and committed
        # or rolled back; the linked session still reads past them.
        c1.commit()
        assert got(take(c2, q)) == [(b"e2", 1)]
        c2.rollback()
        assert got(take(c2, q)) == [(b"e3", 1)]           # e2's take not struck yet: passed
        c2.commit()
        assert s.dequeue(q) is None
        s.rollback()
        monitor()
        rows = collect(dsn, q, 3)
        assert sorted(got(rows)) == [(b"e2", 2), (b"e4", 1), (b"e5", 1)]
        # The SQL consumer carries on with what comes next.
        enqueue_committed(dsn, q, b"n1")
        assert got(collect(dsn, q, 1)) == [(b"n1", 1)]
        assert s.dequeue(q) is None
        s.commit()
    wait_for(lambda: not offers(dsn, q), what="the offers emptied")


def test_a_section_removed_with_entries_set_aside_is_rebuilt_with_them_locked_for_sql(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, b"r0", b"r1", b"r2", b"r3")
    m = monitor()
    set_aside(dsn, q, 4)
    with psycopg.connect(dsn) as c1:
        assert got(take(c1, q)) == [(b"r0", 1)]
        gen = m.read_section(lambda sec: sec.generation)
        remove_section(dsn)
        wait_for(lambda: m.read_section(lambda sec: sec.generation) not in (None, gen),
                 what="a new section")
        with connect(dsn) as s:
            assert s.dequeue(q) is None                   # still locked for SQL consumers
            s.rollback()
            c1.commit()
            rows = collect(dsn, q, 3)
            assert got(rows) == [(b"r1", 1), (b"r2", 1), (b"r3", 1)]
            assert s.dequeue(q) is None
            s.commit()
    wait_for(lambda: not offers(dsn, q), what="the offers emptied")
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT ringq.depth(%s)", (q,)).fetchone() == (0,)


def test_a_database_restart_under_sql_consumers_loses_and_doubles_nothing(tmp_path: Path) -> None:
    with own_server_queue(tmp_path / "pg", dequeue_mode="shared") as (cluster, dsn, q):
        enqueue_committed(dsn, q, *(b"d%d" % i for i in range(5)))
        with Monitor(MonitorConfig(dsn, port=0, interval=FAST, data_dir=tmp_path / "m")) as m:
            set_aside(dsn, q, 5)
            c = psycopg.connect(dsn)
            assert got(take(c, q, 2)) == [(b"d0", 1), (b"d1", 1)]  # held across the restart
            cluster.stop()
            c.close()
            assert cluster.start() == dsn
            wait_for(lambda: m.status()["database"], 20, "the monitor reconnected")
            rows = collect(dsn, q, 5, timeout=30)
            assert sorted(got(rows)) == [(b"d0", 2), (b"d1", 2), (b"d2", 1), (b"d3", 1),
                                         (b"d4", 1)]
            enqueue_committed(dsn, q, b"after")
            assert got(collect(dsn, q, 1)) == [(b"after", 1)]
            assert drain(dsn, q) == []


# -- linked and SQL consumers on one queue at once -----------------------------------------------


def test_linked_and_sql_consumers_on_one_shared_queue_take_every_entry_once_in_producer_order(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    producers, per_producer = 2, 150
    total = producers * per_producer
    q = make_queue(capacity=128, dequeue_mode="shared")
    monitor()
    taken: dict[str, list[bytes]] = {}  # consumer -> payloads, in the order it took them
    lock = threading.Lock()
    done = threading.Event()
    failures: list[BaseException] = []

    def record(name: str, payloads: list[bytes]) -> None:
        with lock:
            taken[name].extend(payloads)
            if sum(len(v) for v in taken.values()) >= total:
                done.set()

    def produce(k: str) -> None:
        with connect(dsn) as s:
            for i in range(per_producer):
                s.enqueue(q, b"p%s:%04d" % (k.encode(), i))
                s.commit()

    def linked(name: str) -> None:
        with connect(dsn) as s:
            while not done.is_set():
                got_ = s.dequeue_many(q, 5, wait=0.05)
                s.commit()
                record(name, [m.payload for m in got_])

    def by_sql(name: str) -> None:
        with psycopg.connect(dsn) as c:
            while not done.is_set():
                rows = take(c, q, 5)
                c.commit()
                record(name, [r[1] for r in rows])
                if not rows:
                    time.sleep(0.005)  # an idle consumer's poll interval

    def guarded(fn: Callable[[str], None], name: str) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(name)
            except BaseException as exc:
                failures.append(exc)
                done.set()
        return run

    consumers = [(linked, "linked0"), (linked, "linked1"), (by_sql, "sql0"), (by_sql, "sql1")]
    taken.update({name: [] for _fn, name in consumers})
    threads = [threading.Thread(target=guarded(fn, name)) for fn, name in consumers]
    threads += [threading.Thread(target=guarded(produce, str(k))) for k in range(producers)]
    for t in threads:
        t.start()
    done.wait(60)
    done.set()
    for t in threads:
        t.join(30)
    assert not failures, failures
    every = collections.Counter(p for v in taken.values() for p in v)
    assert len(every) == total and set(every.values()) == {1}, every.most_common(3)
    for name, payloads in taken.items():
        for k in range(producers):
            mine = [p for p in payloads if p.startswith(b"p%d:" % k)]
            assert mine == sorted(mine), f"{name} took producer {k}'s entries out of order"
    shares = {name: len(v) for name, v in taken.items()}
    print(f"\nentries taken per consumer: {shares}")
    assert shares["sql0"] + shares["sql1"] > 0 and shares["linked0"] + shares["linked1"] > 0
    assert drain(dsn, q) == []


# -- no monitor, security -------------------------------------------------------------------------


def test_without_a_monitor_sql_dequeue_returns_nothing_and_linked_consumers_get_everything(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, b"a", b"b", b"c")
    with psycopg.connect(dsn, autocommit=True) as c:
        assert nothing_for(c, q)
    assert offers(dsn, q) == []
    assert [(m.payload, m.deliveries) for m in drain(dsn, q)] == [(b"a", 1), (b"b", 1), (b"c", 1)]


def test_a_role_without_the_grant_cannot_take_and_hostile_arguments_are_refused(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor], stranger: str
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    other = make_queue(capacity=64, dequeue_mode="shared")
    enqueue_committed(dsn, q, b"secret")
    monitor()
    set_aside(dsn, q, 1)
    role = sql.Identifier(stranger)
    with psycopg.connect(dsn, autocommit=True) as admin:
        # What a role granted another queue has: the schema and its catalog.
        admin.execute(sql.SQL("GRANT USAGE ON SCHEMA ringq TO {}").format(role))
        admin.execute(sql.SQL("GRANT SELECT ON ringq.queues, ringq.offers TO {}").format(role))
        admin.execute(sql.SQL("GRANT SELECT, UPDATE ON {} TO {}").format(
            queue_table(other), role))
    with psycopg.connect(dsn, user=stranger, autocommit=True) as c:
        assert take(c, other) == []                       # the grant it has works
        with pytest.raises(errors.InsufficientPrivilege):
            take(c, q)
        # Hostile names: refused before any table is named.
        for name in ['x"; DROP TABLE ringq.queues; --', "q'; SELECT 1; --", "queues",
                     "pg_catalog.pg_authid", "../" + q, q + " ", q.upper(), ""]:
            with pytest.raises(errors.UndefinedObject):
                take(c, name)
    with psycopg.connect(dsn, autocommit=True) as c:
        for n in (0, -1, 10001, None):
            with pytest.raises(errors.InvalidParameterValue):
                c.execute("SELECT * FROM ringq.dequeue(%s, %s)", (q, n))
        assert c.execute("SELECT count(*) FROM ringq.queues").fetchone() == (2,)
        # Nothing changed: the entry is still there for a consumer with the grant.
        assert got(take(c, q)) == [(b"secret", 1)]
