"""A SQL consumer that holds an entry past its queue's lease is ended by the
agent, as a linked session is by the monitor; the entry comes back counted."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
from conftest import drain, wait_for
from ringq.monitor import Monitor


def test_sql_consumer_past_the_lease_is_ended_and_the_entry_comes_back(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    from ringq.engine import connect

    q = make_queue(capacity=64, dequeue_mode="shared", lease=1.0)
    with connect(dsn) as s:
        s.enqueue(q, b"held")
        s.commit()
    mon = monitor(http=False)
    holder = psycopg.connect(dsn)  # a transaction left open after the take
    rows: list[Any] = []

    def take() -> bool:
        rows.extend(holder.execute("SELECT payload FROM ringq.dequeue(%s)", (q,)).fetchall())
        if not rows:
            holder.commit()  # the ask goes out at commit
        return bool(rows)

    wait_for(take, timeout=10, what="the SQL take")
    assert rows == [(b"held",)]
    t0 = time.monotonic()
    wait_for(lambda: holder.broken or _ended(holder), timeout=15, what="the holder ended")
    assert time.monotonic() - t0 >= 0.5  # not before the lease (1 s from the take)
    holder.close()
    got = wait_for(lambda: drain(dsn, q, wait=0.2) or None, timeout=10,
                   what="the entry back for a linked consumer")
    assert [(m.payload, m.deliveries) for m in got] == [(b"held", 2)]
    assert mon._sql.figures.lease_expired == 1


def _ended(conn: psycopg.Connection[Any]) -> bool:
    try:
        conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return True
    return False
