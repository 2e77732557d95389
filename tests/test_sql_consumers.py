"""SQL consumers: ``ringq.dequeue(queue, n)`` from a plain connection, beside
linked sessions, with the monitor as the section's agent."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import present, wait_for
from ringq.engine import connect
from ringq.monitor import Monitor, MonitorConfig

FAST = 0.2

Row = tuple[int, bytes, str, int, int, str | None, Any]


@pytest.fixture
def monitor(dsn: str, tmp_path: Path) -> Iterator[Callable[..., Monitor]]:
    made: list[Monitor] = []

    def start(**kw: Any) -> Monitor:
        kw.setdefault("port", 0)
        kw.setdefault("interval", FAST)
        kw.setdefault("data_dir", tmp_path / "monitor")
        m = Monitor(MonitorConfig(dsn, **kw))
        m.start()
        made.append(m)
        return m

    yield start
    for m in made:
        m.stop()


def enqueue(dsn: str, queue: str, payloads: list[bytes], **kw: Any) -> None:
    with connect(dsn) as s:
        for p in payloads:
            s.enqueue(queue, p, **kw)
        s.commit()


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
    enqueue(dsn, q, [b"a", b"b", b"c"])
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
    enqueue(dsn, q, [b"x"])
    monitor()
    with psycopg.connect(dsn) as c:
        rows = sql_take(c, q)
        assert [r[1] for r in rows] == [b"x"]
        c.rollback()
        rows = sql_take(c, q)
        assert [(r[1], r[4]) for r in rows] == [(b"x", 2)]
        c.commit()
        assert sql_take(c, q, timeout=0.3) == []


def test_linked_consumers_read_past_entries_set_aside_and_get_them_back_when_sql_goes(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ringq.engine import _offers

    monkeypatch.setattr(_offers, "DEMAND_S", 0.5)
    q = make_queue(capacity=64, dequeue_mode="shared")
    enqueue(dsn, q, [b"1", b"2"])
    monitor()
    with psycopg.connect(dsn, autocommit=True) as c:
        assert [r[1] for r in sql_take(c, q, 1)] == [b"1"]
    # b"2" is set aside for SQL consumers: a linked dequeuer reads past it ...
    with connect(dsn) as s:
        assert s.dequeue(q) is None
        s.rollback()
        # ... until no SQL consumer has asked for DEMAND_S: then it is given back.
        m = present(wait_for(lambda: s.dequeue(q), timeout=10, what="entry given back"))
        assert m.payload == b"2" and m.deliveries == 1
        s.commit()
