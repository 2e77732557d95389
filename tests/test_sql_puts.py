"""SQL producers write into ring slots the monitor reserved for them (issue 34;
the monitor's ``sql_reserve_slots``, on by default).

``ringq.enqueue_many`` puts a batch into the chunks of slots the monitor's
agent lists in ``ringq.slots`` (the rest, and everything while the inbox
holds entries for the queue, into the inbox as before); the agent publishes
what was put, from the rows. These tests check that the way in changes no
guarantee: order per producer, groups and due times, a put rolled back or
cut off by kill -9, a monitor restarted between a put's commit and its
publication, a section rebuilt with slots reserved, a full queue.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import (
    drain,
    own_server_queue,
    present,
    remove_section,
    terminate_backend,
    wait_for,
)
from psycopg import sql
from ringq.engine import connect
from ringq.engine import layout as L
from ringq.monitor import Monitor, MonitorConfig
from test_sql_chunks import killed_9


def reserved(dsn: str, queue: str) -> int:
    """Slots listed for SQL producers of ``queue``."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return int(present(c.execute(
            "SELECT coalesce(sum(s.n), 0) FROM ringq.slots s JOIN ringq.queues q"
            " ON q.id = s.queue_id WHERE q.name = %s", (queue,)).fetchone())[0])


def inbox(dsn: str, queue: str, conn: psycopg.Connection[Any] | None = None) -> int:
    """Entries in the inbox for ``queue`` (as ``conn``'s transaction sees them)."""
    query = ("SELECT count(*) FROM ringq.inbox i JOIN ringq.queues q ON q.id = i.queue_id"
             " WHERE q.name = %s")
    if conn is not None:
        return int(present(conn.execute(query, (queue,)).fetchone())[0])
    with psycopg.connect(dsn, autocommit=True) as c:
        return int(present(c.execute(query, (queue,)).fetchone())[0])


def put(conn: psycopg.Connection[Any], queue: str, payloads: list[bytes], *more: Any) -> list[int]:
    args = ", ".join(["%s"] * (2 + len(more)))
    return list(present(conn.execute(f"SELECT ringq.enqueue_many({args})",
                                     (queue, payloads, *more)).fetchone())[0])


def warmed(dsn: str, queue: str) -> None:
    """One batch through the inbox (it asks the agent for slots), then wait
    until slots are reserved and the inbox is empty: the next batch is put
    (within the agent's 2 s: unused, the slots are taken back)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        put(c, queue, [b"warm"])
    wait_for(lambda: reserved(dsn, queue) > 0 and inbox(dsn, queue) == 0, 20,
             "slots reserved for SQL producers")
    assert [m.payload for m in drain(dsn, queue, wait=0.5)] == [b"warm"]


def rebuilt(dsn: str, m: Monitor) -> None:
    """Remove the database's section and wait until the monitor has made a new one."""
    gen = m.read_section(lambda sec: sec.generation)
    remove_section(dsn)
    wait_for(lambda: m.read_section(lambda sec: sec.generation) not in (None, gen),
             what="a new section")


def test_a_batch_goes_into_reserved_slots_in_order_and_linked_consumers_get_it_once(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=512, dequeue_mode="shared")
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    sent: list[bytes] = []
    ids: list[int] = []
    with psycopg.connect(dsn) as c:
        for b in range(6):
            batch = [b"b%d-%02d" % (b, i) for i in range(37)]
            # (the agent tops the listing up after each put's commit)
            wait_for(lambda: reserved(dsn, q) >= 48, 20, "three chunks listed")
            ids += put(c, q, batch)
            # Written into ring rows in this transaction, not into the inbox.
            assert inbox(dsn, q, c) == 0
            assert present(c.execute(
                f"SELECT count(*) FROM ringq.q_{q} WHERE state = 1 AND payload = ANY(%s)",
                (batch,)).fetchone())[0] == len(batch)
            c.commit()
            sent += batch
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    got = drain(dsn, q, wait=2.0, batch=16)
    assert [m.payload for m in got] == sent                  # each once, in order
    assert [m.producer_seq for m in got] == ids
    assert inbox(dsn, q) == 0


def test_linked_consumers_read_what_sql_producers_put_from_the_payload_cache(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    """Once linked dequeuers read the queue, the agent writes the payload
    cache records of the entries it publishes for SQL producers: a linked
    dequeue takes them without reading their rows, and gets what a row read
    gives (the redelivery after a rollback reads the rows)."""
    q = make_queue(capacity=512, dequeue_mode="shared")
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)  # its drain is a linked dequeue of the queue
    with psycopg.connect(dsn, autocommit=True) as c:
        wait_for(lambda: reserved(dsn, q) >= 16, 20, "a chunk listed")
        first = put(c, q, [b"one-%d" % i for i in range(5)])
    assert [m.producer_seq for m in drain(dsn, q, wait=0.5, batch=8)] == first
    with psycopg.connect(dsn, autocommit=True) as c:
        wait_for(lambda: reserved(dsn, q) >= 16, 20, "a chunk listed")
        ids = put(c, q, [b"two-%d" % i for i in range(5)])
    with connect(dsn) as s:
        qb = s.ring(q).qb
        counts = s.section.queues[qb + L.Q_N_CACHE_HITS : qb + L.Q_N_CACHE_MISSES + 1]
        hits, misses = (int(x) for x in counts)
        got = s.dequeue_many(q, 10, wait=5.0)
        assert [m.producer_seq for m in got] == ids
        assert [int(x) for x in counts] == [hits + 5, misses]  # served from the cache
        s.rollback()
        again = s.dequeue_many(q, 10, wait=5.0)
        assert [int(x) for x in counts] == [hits + 5, misses + 5]  # read from the rows
        s.commit()

    def seen(m: Any) -> tuple[Any, ...]:
        return (m.seq, m.payload, m.producer, m.producer_seq, m.enqueued_at, m.group)

    assert [seen(m) for m in again] == [seen(m) for m in got]
    assert [m.payload for m in got] == [b"two-%d" % i for i in range(5)]
    assert [(m.deliveries, again[i].deliveries) for i, m in enumerate(got)] == [(1, 2)] * 5


def test_the_agent_reads_no_payload_a_cache_record_cannot_hold(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Payloads larger than the queue's cache records are left in their rows
    (a pass of up to 8,192 entries of up to 1 GB each would exceed what one
    array can hold): the agent's read returns none of them, and the linked
    dequeue reads them from the rows."""
    from ringq.engine.sqlagent import _runs

    q = make_queue(capacity=512, max_payload=100_000, cache_payload=64, dequeue_mode="shared")
    shipped: list[int] = []
    read = _runs.indexed

    def spy(*args: Any, **kwargs: Any) -> list[Any]:
        rows = read(*args, **kwargs)
        shipped.extend(len(p) for r in rows if r[0] is None and len(r) > 4 and r[4]
                       for p in r[4])
        return rows

    monkeypatch.setattr(_runs, "indexed", spy)
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    with psycopg.connect(dsn, autocommit=True) as c:
        wait_for(lambda: reserved(dsn, q) >= 16, 20, "a chunk listed")
        put(c, q, [b"s%d" % i for i in range(5)])
    assert len(drain(dsn, q, wait=0.5, batch=8)) == 5  # linked dequeues: records written
    with psycopg.connect(dsn, autocommit=True) as c:
        wait_for(lambda: reserved(dsn, q) >= 16, 20, "a chunk listed")
        put(c, q, [b"small-%d" % i for i in range(3)]
                  + [b"big-%d" % i + bytes(50_000) for i in range(3)])
    got = drain(dsn, q, wait=0.5, batch=8)
    assert [m.payload[:7] for m in got] == [b"small-%d" % i for i in range(3)] + [
        b"big-%d" % i + bytes(2) for i in range(3)]
    assert [len(m.payload) for m in got] == [7] * 3 + [50_005] * 3
    assert sorted(shipped)[-3:] == [7] * 3, shipped  # the small ones only


def test_groups_and_due_times_hold_for_entries_put_in_reserved_slots(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=256, dequeue_mode="shared")
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    with psycopg.connect(dsn, autocommit=True) as c:
        due = present(c.execute("SELECT now() + interval '1.5 s'").fetchone())[0]
        put(c, q, [b"later"], None, due)
        put(c, q, [b"g1", b"g2"], "g")
    with connect(dsn) as s1, connect(dsn) as s2:
        first = s1.dequeue(q, wait=5.0)
        assert first is not None and first.payload == b"g1"
        assert s2.dequeue(q, wait=0.3) is None  # g2 waits for g1 (its group); later not due
        s1.commit()
        nxt = s2.dequeue(q, wait=5.0)
        assert nxt is not None and nxt.payload == b"g2"
        s2.commit()
        late = s1.dequeue(q, wait=5.0)
        assert late is not None and late.payload == b"later"
        assert datetime.now(due.tzinfo) >= due - timedelta(milliseconds=50)
        s1.commit()


def test_a_put_rolled_back_killed_9_or_terminated_leaves_nothing_and_the_queue_moves_on(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=256, dequeue_mode="shared")
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    with psycopg.connect(dsn) as c:
        put(c, q, [b"rolled-back-%d" % i for i in range(20)])
        c.rollback()
    # A producer killed -9 while its put is under way (its transaction open).
    killed_9("SELECT ringq.enqueue_many(%s, %s::bytea[])", dsn, "BEGIN", q, "{killed,killed}")
    # A producer whose backend is terminated (pg_terminate_backend) mid-transaction.
    c = psycopg.connect(dsn)
    put(c, q, [b"terminated-%d" % i for i in range(20)])
    terminate_backend(dsn, c.info.backend_pid)
    with pytest.raises(psycopg.OperationalError):
        c.commit()
    c.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        put(c, q, [b"after-%d" % i for i in range(30)])
    got = [m.payload for m in drain(dsn, q, wait=2.0, batch=8)]
    assert got == [b"after-%d" % i for i in range(30)]


def test_a_put_committed_while_no_monitor_runs_is_published_by_the_next(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=256, dequeue_mode="shared")
    m = monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    with psycopg.connect(dsn) as c:
        put(c, q, [b"x%d" % i for i in range(10)])
        m.stop()          # the agent goes between the put and its commit
        c.commit()
    with connect(dsn) as s:
        assert s.dequeue(q) is None   # put, but not published in the section yet
        s.rollback()
    monitor(sql_reserve_slots=True)  # a new agent: its first look publishes it from the rows
    assert [x.payload for x in drain(dsn, q, wait=3.0, batch=4)] == [b"x%d" % i for i in range(10)]


def test_a_section_rebuilt_keeps_the_reserved_slots_and_a_put_under_way_lands(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=256, dequeue_mode="shared")
    m = monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    with psycopg.connect(dsn) as c:
        put(c, q, [b"in-flight-%d" % i for i in range(12)])
        rebuilt(dsn, m)
        with connect(dsn) as s:  # linked producers reserve past the listed slots
            s.enqueue(q, b"linked")
            s.commit()
        c.commit()
    got = [x.payload for x in drain(dsn, q, wait=3.0)]
    assert sorted(got) == sorted([b"in-flight-%d" % i for i in range(12)] + [b"linked"])


def test_a_full_queue_refuses_sql_producers_with_rq002_and_reserves_a_quarter_at_most(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=128, dequeue_mode="shared")
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    assert reserved(dsn, q) <= 128 // 4
    n = 0
    with psycopg.connect(dsn, autocommit=True) as c, pytest.raises(psycopg.Error) as refused:
        for _ in range(100):
            put(c, q, [b"f"] * 8)
            n += 8
    assert refused.value.sqlstate == "RQ002"
    # Refused before the ring's 128 can be overrun: the reserved slots, then
    # what the inbox's room check lets in (the pump holds it back while slots
    # are reserved, so the room may read short: refused early, never late).
    assert 32 <= n <= 160
    got = drain(dsn, q, wait=2.0, batch=16)
    assert len(got) == n


def test_a_database_restart_under_a_put_loses_and_doubles_nothing(tmp_path: Path) -> None:
    with own_server_queue(tmp_path / "pg", dequeue_mode="shared") as (cluster, dsn, q), \
            Monitor(MonitorConfig(dsn, port=0, interval=0.2, data_dir=tmp_path / "m",
                                  sql_reserve_slots=True)):
        warmed(dsn, q)
        with psycopg.connect(dsn, autocommit=True) as c:
            put(c, q, [b"before-%d" % i for i in range(20)])
        cut = psycopg.connect(dsn)
        put(cut, q, [b"cut-%d" % i for i in range(20)])  # in flight across the restart
        cluster.stop()
        cut.close()
        assert cluster.start() == dsn
        with psycopg.connect(dsn, autocommit=True) as c:
            def again() -> bool:
                try:
                    put(c, q, [b"after"])
                except psycopg.Error:
                    return False
                return True

            wait_for(again, 30, "a put after the restart")
        got = [m.payload for m in drain(dsn, q, wait=3.0, batch=8)]
    assert got == [b"before-%d" % i for i in range(20)] + [b"after"]


def test_a_put_committing_between_a_loads_reads_is_neither_lost_nor_stranded(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A section is loaded from the queue's rows, then from ringq.slots: a put
    # that commits between the two reads must be seen by both or by neither
    # (seen by the second only, its entries were neither queued nor reserved
    # in the new section, and no consumer ever got them).
    from ringq.engine.rows import _decide

    q = make_queue(capacity=256, dequeue_mode="shared")
    m = monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    c = psycopg.connect(dsn)
    put(c, q, [b"between-%d" % i for i in range(12)])
    held_slots = _decide.held_slots

    def commit_first(conn: psycopg.Connection[Any], qid: int) -> list[tuple[int, int]]:
        if not c.closed:  # once: the put commits after the load read the rows
            c.commit()
            c.close()
        return held_slots(conn, qid)

    monkeypatch.setattr(_decide, "held_slots", commit_first)
    rebuilt(dsn, m)
    assert c.closed  # the load did read between the two
    got = [x.payload for x in drain(dsn, q, wait=3.0, batch=4)]
    assert got == [b"between-%d" % i for i in range(12)]


def test_the_pump_reserves_nothing_while_slots_are_reserved_for_sql_producers(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    # The pump's session (behind_sql_puts) checks under the queue's lock, where
    # the agent reserves: an inbox entry moved past a chunk reserved since the
    # pump's pass began would come before a producer's later puts into it.
    from ringq.engine.sqlpath import BehindSqlPuts

    q = make_queue(capacity=256, dequeue_mode="shared")
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    with connect(dsn) as s:
        s.behind_sql_puts = True
        with pytest.raises(BehindSqlPuts):
            s.enqueue_many(q, [b"moved-1", b"moved-2"], timeout=0)
        s.rollback()
        assert s.stats(q)["depth"] == 0  # nothing reserved, nothing left behind
        s.behind_sql_puts = False
        s.enqueue(q, b"linked")  # a linked producer is not held back
        s.commit()
    assert [x.payload for x in drain(dsn, q, wait=2.0)] == [b"linked"]


def test_a_role_without_insert_on_the_inbox_cannot_put_into_reserved_slots(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor], stranger: str
) -> None:
    # ringq.pq_<name> runs as its owner (it writes the ring's rows): it checks
    # first that the caller may INSERT into ringq.inbox, what an SQL enqueue needs.
    q = make_queue(capacity=256, dequeue_mode="shared")
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    listed = reserved(dsn, q)
    role = sql.Identifier(stranger)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("GRANT USAGE ON SCHEMA ringq TO {}").format(role))
        admin.execute(sql.SQL("GRANT SELECT ON ringq.queues, ringq.room TO {}").format(role))
    with psycopg.connect(dsn, user=stranger, autocommit=True) as c:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            put(c, q, [b"refused"])
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(f"SELECT ringq.pq_{q}(%s, NULL, NULL)", ([b"refused"],))
    assert reserved(dsn, q) == listed  # no slot was used
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("GRANT INSERT ON ringq.inbox TO {}").format(role))
        admin.execute(sql.SQL("GRANT USAGE ON SEQUENCE ringq.inbox_id_seq TO {}").format(role))
    with psycopg.connect(dsn, user=stranger, autocommit=True) as c:
        put(c, q, [b"granted-1", b"granted-2"])
    got = drain(dsn, q, wait=3.0)
    assert [(m.payload, m.producer) for m in got] == [
        (b"granted-1", f"sql:{stranger}"), (b"granted-2", f"sql:{stranger}")]


def test_a_put_moves_the_inbox_entries_into_reserved_slots_first_in_their_order(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    # Single entries (ringq.enqueue) wait in the inbox while slots are
    # reserved (the pump holds them back); the next batch's put moves them
    # into the oldest chunks first, with their own ids and groups, then its own.
    q = make_queue(capacity=512, dequeue_mode="shared")
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    wait_for(lambda: reserved(dsn, q) >= 64, 20, "four chunks listed")
    with psycopg.connect(dsn, autocommit=True) as c:
        singles = [present(c.execute("SELECT ringq.enqueue(%s, %s, %s)",
                                     (q, b"single-%d" % i, "g" if i == 1 else None)).fetchone())[0]
                   for i in range(3)]
    with psycopg.connect(dsn) as c:
        ids = put(c, q, [b"batch-%d" % i for i in range(5)])
        assert inbox(dsn, q, c) == 0  # moved into the ring's rows in this transaction
        c.commit()
    got = drain(dsn, q, wait=3.0, batch=8)
    assert [m.payload for m in got] == [b"single-0", b"single-1", b"single-2"] + [
        b"batch-%d" % i for i in range(5)]
    assert [m.producer_seq for m in got] == singles + ids  # the inbox's ids kept
    assert [m.group for m in got][:3] == [None, "g", None]


def test_an_inbox_entry_the_library_refuses_is_not_moved_by_a_put_and_nothing_stalls(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    # A row put into ringq.inbox by hand that the library refuses stops a put
    # from moving the inbox (its batch goes to the inbox behind it); the agent
    # takes its slots back once the entry has waited, and the pump moves the
    # refused row to ringq.exceptions and the rest into the ring, in order.
    q = make_queue(capacity=256, dequeue_mode="shared", max_payload=64)
    monitor(sql_reserve_slots=True)
    warmed(dsn, q)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO ringq.inbox (queue_id, payload) SELECT id, %s FROM ringq.queues"
                  " WHERE name = %s", (b"x" * 100, q))
        put(c, q, [b"after-%d" % i for i in range(4)])
    got = drain(dsn, q, wait=5.0, batch=8)
    assert [m.payload for m in got] == [b"after-%d" % i for i in range(4)]
    with psycopg.connect(dsn, autocommit=True) as c:
        refused = c.execute("SELECT count(*) FROM ringq.exceptions e JOIN ringq.queues q"
                            " ON q.id = e.queue_id WHERE q.name = %s", (q,)).fetchone()
    assert refused == (1,)
    assert inbox(dsn, q) == 0
