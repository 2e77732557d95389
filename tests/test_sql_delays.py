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
from ringq.engine.sqlpath import DEMAND_S, SqlAgent
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


class _Killed(Exception):
    """Stands for the monitor's death at a point of the agent's pass."""


def test_entries_the_agent_took_back_keep_their_backoff_after_it_died(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent takes back entries no SQL consumer asked for lately: it
    commits their removal from the listing, then gives them back in the
    section. Killed between the two, the next agent (a restarted monitor)
    finds them locked for SQL and listed nowhere, and settles them by their
    rows: one a SQL consumer's rollback struck with the queue's backoff
    waits for it (it was given back ready, and a linked consumer took it at
    once), the other is ready."""
    q = make_queue(dequeue_mode="shared", retry_delay=60.0)
    now = [1000.0]
    with connect(dsn) as s, psycopg.connect(dsn, autocommit=True) as aconn:
        s.enqueue_many(q, [b"struck", b"plain"])
        s.commit()
        SqlAgent.prepare(aconn)
        agent = SqlAgent(clock=lambda: now[0])
        agent.asked(q)
        agent.run(s.section, aconn)  # both set aside for SQL consumers
        with psycopg.connect(dsn) as c:
            [(payload,)] = c.execute("SELECT payload FROM ringq.dequeue(%s, 1)", (q,)).fetchall()
            assert bytes(payload) == b"struck"
            c.rollback()  # a delivery that did not commit: due again in 60 s
        now[0] += 0.01
        agent.run(s.section, aconn)  # the strike writes the backoff into the row
        now[0] += DEMAND_S + 1  # nobody asked since: the next pass takes both back

        def killed(*args: object, **kw: object) -> int:
            raise _Killed

        # white-box (SqlAgent._give_back): the death point, after the listing's commit
        monkeypatch.setattr(agent, "_give_back", killed)
        with pytest.raises(_Killed):
            agent.run(s.section, aconn)
        SqlAgent().run(s.section, aconn)  # the restarted monitor's agent
        got = s.dequeue_many(q, 10)
        s.commit()
        assert [(m.payload, m.deliveries) for m in got] == [(b"plain", 1)]
        assert s.ring(q).counts()["locked"] == 0
