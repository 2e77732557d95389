"""Entries that wait (issue 24) on the SQL path: ``ringq.enqueue(queue,
payload, msg_group, not_before)`` keeps the due time in ``ringq.inbox``, and
the monitor's pump carries it into the ring: an entry is due in the ring when
it was due in the inbox, and no consumer receives it before (its row's
``deq_at``, the database's time of the consuming write, is never earlier).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import psycopg
import pytest
from conftest import present
from psycopg import sql
from ringq.engine import connect, queue_table
from ringq.monitor import pump_inbox


def _ring_rows(dsn: str, queue: str) -> list[tuple[bytes, datetime | None, datetime | None]]:
    """(payload, not_before, deq_at) of the queue's entries, by sequence."""
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            sql.SQL(
                "SELECT payload, not_before, deq_at FROM {} WHERE seq >= 0 ORDER BY seq"
            ).format(queue_table(queue))
        ).fetchall()
    return [(bytes(p), nb, deq) for p, nb, deq in rows]


def test_sql_enqueue_with_a_due_time_waits_in_the_ring(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(dequeue_mode="shared")
    with psycopg.connect(dsn, autocommit=True) as c:
        def enq(payload: bytes, due: str | None) -> datetime | None:
            at = None if due is None else present(
                c.execute(f"SELECT now() + interval '{due}'").fetchone()
            )[0]
            c.execute("SELECT ringq.enqueue(%s, %s, NULL, %s)", (q, payload, at))
            return at

        soon = enq(b"soon", "1.5 s")
        enq(b"now", None)
        enq(b"past", "-1 hour")  # a time already past: at once
        later = enq(b"later", "1 hour")
        c.execute("SELECT ringq.enqueue(%s, %s)", (q, b"two-args"))  # existing calls unchanged
        c.execute("SELECT ringq.enqueue(%s, %s, %s)", (q, b"three-args", "g"))
        inbox = c.execute(
            "SELECT count(*) FILTER (WHERE not_before IS NOT NULL) FROM ringq.inbox i "
            "JOIN ringq.queues q ON q.id = i.queue_id WHERE q.name = %s", (q,)
        ).fetchone()
        assert inbox == (3,)
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="finite"):
            c.execute("SELECT ringq.enqueue(%s, %s, NULL, 'infinity')", (q, b"never"))
    # One producer, four due times: the pump splits its runs by due time, in inbox order.
    assert pump_inbox(dsn) == {q: 6}
    rows = _ring_rows(dsn, q)
    assert [(p, nb) for p, nb, _ in rows] == [
        (b"soon", soon), (b"now", None), (b"past", None), (b"later", later),
        (b"two-args", None), (b"three-args", None),
    ]
    with connect(dsn) as s:
        got = s.dequeue_many(q, 10)  # shared: reads past the two that wait
        assert [m.payload for m in got] == [b"now", b"past", b"two-args", b"three-args"]
        pseqs = [m.producer_seq for m in got]
        assert pseqs == sorted(set(pseqs))  # the runs' sequences still rise with the inbox ids
        s.commit()
        m = present(s.dequeue(q, wait=10))  # woken when it falls due, not before
        assert m.payload == b"soon"
        s.commit()
        assert s.dequeue(q) is None  # "later" waits its hour
    consumed = {p: (nb, deq) for p, nb, deq in _ring_rows(dsn, q)}
    nb, deq = consumed[b"soon"]
    assert nb is not None and deq is not None and deq >= nb, (deq, nb)
    assert consumed[b"later"][1] is None
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT ringq.depth(%s)", (q,)).fetchone() == (1,)  # it counts
