"""The caller's statements sent with the commit: ``Session.execute(defer=True)``.

A consumer that records its work by a statement whose rows it does not need
(an INSERT) defers it: the statement goes in the commit's round trip, with
the consuming writes, and the transaction costs one round trip. Both faces
(the ``face`` fixture). Round trips are counted from libpq's trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from conftest import drain, round_trips, wire_trace
from ringq.engine import RingqError

INSERT = "INSERT INTO {t} (n) VALUES (%s)"


@pytest.fixture
def done_table(dsn: str, make_queue: Callable[..., str]) -> Iterator[tuple[str, str]]:
    """A queue holding 0..9 and a table ``n int PRIMARY KEY`` to record them in."""
    q = make_queue(capacity=64)
    table = "done_" + q
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE {table} (n int PRIMARY KEY)")
    with psycopg.connect(dsn) as c:
        c.execute("SELECT ringq.enqueue_many(%s, %s)", (q, [b"%d" % i for i in range(10)]))
    yield q, table
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"DROP TABLE {table}")


def recorded(dsn: str, table: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return [int(r[0]) for r in c.execute(f"SELECT n FROM {table} ORDER BY n")]


def take(s: Any, q: str, n: int) -> list[int]:
    got = s.dequeue_many(q, n, wait=5.0)
    assert len(got) == n
    return [int(m.payload) for m in got]


def test_a_deferred_statement_goes_with_the_commit_in_one_round_trip(
    dsn: str, done_table: tuple[str, str], face: Callable[..., Any], monitor: Callable[..., Any]
) -> None:
    q, table = done_table
    monitor()  # the SQL inbox's pump moves the entries into the ring
    with face(dsn) as s:
        for _ in range(3):  # past psycopg's prepare threshold
            for n in take(s, q, 2):
                assert s.execute(INSERT.format(t=table), (n,), prepare=True, defer=True) is None
            s.commit()
        got = take(s, q, 2)
        with wire_trace(s.connection) as wire:
            for n in got:
                s.execute(INSERT.format(t=table), (n,), prepare=True, defer=True)
            s.commit()
        assert round_trips(wire) == 1  # the INSERTs, the consuming write, the COMMIT
    assert recorded(dsn, table) == list(range(8))
    assert [int(m.payload) for m in drain(dsn, q)] == [8, 9]


def test_a_deferred_statement_that_fails_fails_the_commit_and_the_entries_come_back(
    dsn: str, done_table: tuple[str, str], face: Callable[..., Any], monitor: Callable[..., Any]
) -> None:
    q, table = done_table
    monitor()
    with face(dsn) as s:
        first = take(s, q, 2)
        s.execute(INSERT.format(t=table), (first[0],), defer=True)
        s.execute(INSERT.format(t=table), (first[0],), defer=True)  # the key again: it fails
        with pytest.raises(RingqError) as failed:
            s.commit()
        assert isinstance(failed.value.__cause__, psycopg.errors.UniqueViolation)
        again = take(s, q, 2)  # the transaction was rolled back: they come back
        assert again == first
        s.commit()
    assert recorded(dsn, table) == []  # nothing of the failed transaction stood
    assert len(drain(dsn, q)) == 8


def test_a_rollback_drops_deferred_statements_and_a_plain_one_runs_after_them(
    dsn: str, done_table: tuple[str, str], face: Callable[..., Any], monitor: Callable[..., Any]
) -> None:
    q, table = done_table
    monitor()
    with face(dsn) as s:
        n = take(s, q, 1)[0]
        s.execute(INSERT.format(t=table), (n,), defer=True)
        s.rollback()  # never sent
        assert take(s, q, 1) == [n]
        s.execute(INSERT.format(t=table), (n,), defer=True)
        # A statement that is not deferred runs after the deferred ones: it sees n.
        s.execute(f"INSERT INTO {table} SELECT n + 100 FROM {table}")
        s.commit()
    assert recorded(dsn, table) == [n, n + 100]
