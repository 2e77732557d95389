"""The SQL inbox pump's one-statement batches: a queue another pumper holds
is passed (never waited on, never moved twice), batches keep inbox order, and
a queue without room is reported full with its entries kept."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
from conftest import sql_enqueue
from ringq.engine import connect
from ringq.monitor import pump_inbox


def _queue_id(dsn: str, name: str) -> int:
    with psycopg.connect(dsn) as c:
        row = c.execute("SELECT id FROM ringq.queues WHERE name = %s", (name,)).fetchone()
    assert row is not None
    return int(row[0])


def test_the_pump_passes_a_queue_another_pumper_holds_and_moves_it_once_free(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    first = make_queue(dequeue_mode="shared")
    second = make_queue(dequeue_mode="shared")
    sql_enqueue(dsn, [(q, p) for q in (first, second) for p in (b"a", b"b", b"c")])
    with psycopg.connect(dsn) as holder:
        # Another pumper of the first queue, in the middle of its transaction.
        got = holder.execute("SELECT pg_try_advisory_xact_lock(hashtext('ringq.inbox'), %s)",
                             (_queue_id(dsn, first),)).fetchone()
        assert got == (True,)
        assert pump_inbox(dsn) == {second: 3}
        holder.rollback()
    assert pump_inbox(dsn) == {first: 3}
    assert pump_inbox(dsn) == {}
    with connect(dsn) as s:
        for q in (first, second):
            assert [m.payload for m in s.dequeue_many(q, 10)] == [b"a", b"b", b"c"]
        s.commit()


def test_the_pump_moves_batches_in_inbox_order_and_reports_a_full_queue(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    small = make_queue(capacity=4, dequeue_mode="shared")
    sql_enqueue(dsn, [(small, bytes([i])) for i in range(4)])
    # More than the room: ringq.enqueue() refuses them now (RQ002), but
    # producers racing for the last slots can overshoot (tests/test_sql_room.py).
    with psycopg.connect(dsn) as conn:
        for i in range(4, 7):
            conn.execute("INSERT INTO ringq.inbox (queue_id, payload) VALUES (%s, %s)",
                         (_queue_id(dsn, small), bytes([i])))
    full: dict[str, int] = {}
    assert pump_inbox(dsn, batch=3, full=full) == {small: 4}
    assert full == {small: _queue_id(dsn, small)}
    with connect(dsn) as s:
        assert [m.payload for m in s.dequeue_many(small, 10)] == [bytes([i]) for i in range(4)]
        s.commit()
    assert pump_inbox(dsn, batch=3) == {small: 3}
    with connect(dsn) as s:
        assert [m.payload for m in s.dequeue_many(small, 10)] == [bytes([i]) for i in range(4, 7)]
        s.commit()
