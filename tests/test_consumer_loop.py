"""A consumer's commit carries its next claim: Session.commit_and_dequeue.

Entries read from their rows (no payload cache) cost one round trip per
message in a loop: COMMIT, BEGIN and the next dequeue go in one message.
Round trips are counted from libpq's trace (conftest's wire_trace).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import drain, present, round_trips, terminate_backend, wire_trace
from ringq.engine import RingqError, TransactionError, connect


@pytest.mark.parametrize("cached", [False, True])
def test_a_consumer_loop_is_one_round_trip_per_message(
    dsn: str, make_queue: Callable[..., str], cached: bool
) -> None:
    q = make_queue(capacity=16, **({} if cached else {"cache_payload": 0}))
    with connect(dsn) as p:
        p.enqueue_many(q, [b"%d" % i for i in range(12)])
        p.commit()
    got = []
    with connect(dsn) as c:
        m = c.dequeue(q)
        for _ in range(11):  # past psycopg's prepare threshold (it prepares in a round trip)
            got.append(present(m).payload)
            m = c.commit_and_dequeue(q)
        with wire_trace(c.connection) as wire:
            got.append(present(m).payload)
            m = c.commit_and_dequeue(q)  # the last commit; nothing more is ready
        assert m is None and round_trips(wire) == 1
        c.commit()
    assert got == [b"%d" % i for i in range(12)]
    assert drain(dsn, q) == []


def test_steady_state_round_trips_of_uncached_entries(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=32, cache_payload=0)
    with connect(dsn) as p:
        p.enqueue_many(q, [b"%d" % i for i in range(20)])
        p.commit()
    with connect(dsn) as c:
        m = c.dequeue(q)
        for _ in range(8):
            m = c.commit_and_dequeue(q)
        with wire_trace(c.connection) as wire:
            for _ in range(5):
                m = c.commit_and_dequeue(q)
                assert m is not None and m.deliveries == 1
        assert round_trips(wire) == 5  # COMMIT + BEGIN + the next dequeue: one each
        c.commit()
    assert len(drain(dsn, q)) == 20 - 14


@pytest.mark.parametrize("mode", ["single", "shared"])
def test_a_refused_commit_takes_nothing_and_keeps_the_order(
    dsn: str, make_queue: Callable[..., str], mode: str
) -> None:
    """The COMMIT fails (a deferred constraint): the entry in hand comes back
    counted, the next one was claimed but is given back untouched, and a
    single-mode queue still delivers them in order."""
    q = make_queue(capacity=16, cache_payload=0, dequeue_mode=mode)
    with psycopg.connect(dsn, autocommit=True) as a:
        a.execute("DROP TABLE IF EXISTS loop_child, loop_parent")
        a.execute("CREATE TABLE loop_parent (id int PRIMARY KEY)")
        a.execute("CREATE TABLE loop_child (id int REFERENCES loop_parent "
                  "DEFERRABLE INITIALLY DEFERRED)")
    with connect(dsn) as p:
        p.enqueue_many(q, [b"first", b"second"])
        p.commit()
    with connect(dsn) as c:
        m = present(c.dequeue(q))
        assert m.payload == b"first"
        c.connection.execute("INSERT INTO loop_child VALUES (42)")  # fails at COMMIT
        with pytest.raises(RingqError):
            c.commit_and_dequeue(q)
        again = [c.dequeue(q), c.dequeue(q)]
        c.commit()
    assert [(x.payload, x.deliveries) for x in again if x] == [(b"first", 2), (b"second", 1)]


def test_a_lost_connection_takes_nothing_and_loses_nothing(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16, cache_payload=0)
    with connect(dsn) as p:
        p.enqueue_many(q, [b"first", b"second"])
        p.commit()
    with connect(dsn) as c:
        assert present(c.dequeue(q)).payload == b"first"
        terminate_backend(dsn, c.backend_pid)
        with pytest.raises((TransactionError, RingqError)):
            c.commit_and_dequeue(q)
        got = [(m.payload, m.deliveries) for m in c.dequeue_many(q, 5)]
        c.commit()
    # decided from the rows, as after any lost commit: the claimed one untouched
    assert [p for p, _d in got] == [b"first", b"second"] and got[1][1] == 1


def test_a_worker_handles_uncached_messages_in_one_round_trip_each(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """Each commit carries the next claim; the one taken when the loop ends
    goes back untouched."""
    from ringq.worker import Actions, Worker

    q = make_queue(capacity=64, cache_payload=0)
    seen: list[bytes] = []
    app = Actions()

    @app.action(q)
    def handle(msg: Any, session: Any) -> None:
        seen.append(msg.payload)

    with connect(dsn) as p:
        p.enqueue_many(q, [b"%d" % i for i in range(30)])
        p.commit()
    with Worker(app, dsn) as w:
        assert w.run(max_messages=10) == 10  # warm: statements prepared
        with wire_trace(w.session.connection) as wire:
            assert w.run(max_messages=10) == 10
        assert round_trips(wire) == 11  # the first dequeue, 9 commits carrying a claim, 1 commit
    assert seen == [b"%d" % i for i in range(20)]
    rest = drain(dsn, q)
    assert [m.payload for m in rest] == [b"%d" % i for i in range(20, 30)]
    assert all(m.deliveries == 1 for m in rest)  # nothing given back was counted
