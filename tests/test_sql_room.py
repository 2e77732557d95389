"""SQL producers and the queue's room (issue 34): a full queue is full for
``ringq.enqueue()`` too (SQLSTATE RQ002, QueueFull through the engine), the
depth every reader sees counts what SQL producers put on, and
``ringq.enqueue_many()`` enqueues a batch in one statement, all or nothing."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import sql_enqueue, wait_for
from psycopg import sql
from ringq.engine import QueueFull, StatementRejected, connect
from ringq.engine.pg import FULL_SQLSTATE, from_psycopg
from ringq.monitor import pump_inbox

FAST = 0.2  # the monitor's sample interval (s)


def _inbox(dsn: str, queue: str) -> list[bytes]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT i.payload FROM ringq.inbox i JOIN ringq.queues q ON q.id = i.queue_id"
            " WHERE q.name = %s ORDER BY i.id", (queue,)).fetchall()
    return [bytes(r[0]) for r in rows]


def _depth(dsn: str, queue: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(conn.execute("SELECT ringq.depth(%s)", (queue,)).fetchone()[0])  # type: ignore[index]


def _refused(dsn: str, queue: str, payload: bytes = b"x") -> psycopg.Error:
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(psycopg.Error) as got:
        conn.execute("SELECT ringq.enqueue(%s, %s)", (queue, payload))
    return got.value


def _take(dsn: str, queue: str, n: int) -> list[bytes]:
    with connect(dsn) as s:
        got = [m.payload for m in s.dequeue_many(queue, n)]
        s.commit()
    return got


def test_a_full_queue_refuses_sql_producers_until_consumers_free_room(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    sql_enqueue(dsn, [(q, b"e%d" % i) for i in range(8)])  # the ring's rows say 8 free
    exc = _refused(dsn, q)
    assert exc.sqlstate == FULL_SQLSTATE == "RQ002"
    assert f'queue "{q}" is full' in (exc.diag.message_primary or "")
    assert exc.diag.message_hint and "retry" in exc.diag.message_hint
    converted = from_psycopg(exc)
    assert isinstance(converted, QueueFull) and converted.queue == q
    assert len(_inbox(dsn, q)) == 8  # nothing accepted beyond the room
    # Linked code calling the SQL gets the typed error.
    with connect(dsn) as s, pytest.raises(QueueFull) as typed:
        s.execute("SELECT ringq.enqueue(%s, %s)", (q, b"y"))
    assert typed.value.queue == q

    assert pump_inbox(dsn) == {q: 8}  # the ring is full now, and the room published: 0
    assert _refused(dsn, q).sqlstate == "RQ002"
    assert _take(dsn, q, 3) == [b"e0", b"e1", b"e2"]
    assert _refused(dsn, q).sqlstate == "RQ002"  # not published yet
    assert pump_inbox(dsn) == {}  # nothing to move, the room published again
    sql_enqueue(dsn, [(q, b"f%d" % i) for i in range(3)])
    assert _refused(dsn, q).sqlstate == "RQ002"
    assert pump_inbox(dsn) == {q: 3}
    assert _take(dsn, q, 8) == [b"e%d" % i for i in range(3, 8)] + [b"f0", b"f1", b"f2"]


def test_depth_counts_what_sql_producers_put_on(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Any]
) -> None:
    q = make_queue(capacity=8)
    sql_enqueue(dsn, [(q, b"s%d" % i) for i in range(6)])  # in the inbox, not moved
    with connect(dsn) as s:  # a linked producer fills the ring meanwhile
        s.enqueue_many(q, [b"l%d" % i for i in range(8)], timeout=0)
        s.commit()
        assert pump_inbox(dsn) == {}  # no room: the SQL entries wait, counted
        stats = s.stats(q)
        assert stats["inbox"] == 6
        assert stats["depth"] == 8 + 6
    assert _depth(dsn, q) == 8 + 6
    assert _refused(dsn, q).sqlstate == "RQ002"  # free 0 published
    m = monitor(interval=FAST)

    def api_depth() -> int | None:
        with urllib.request.urlopen(m.url + "/api/queues", timeout=5) as resp:
            doc = json.loads(resp.read())
        got = next((x for x in doc["queues"] if x["name"] == q), None)
        return got["depth"] if got is not None and got["depth"] == 14 else None

    assert wait_for(api_depth, what="the API's depth with the inbox") == 14
    assert _take(dsn, q, 8) == [b"l%d" % i for i in range(8)]
    # The monitor's pump moves the SQL entries once there is room; the inbox
    # word goes back to 0 and the depth is the ring's.
    wait_for(lambda: not _inbox(dsn, q), what="the inbox moved")
    with connect(dsn) as s:
        wait_for(lambda: s.stats(q)["inbox"] == 0, what="the inbox word cleared")
        assert s.stats(q)["depth"] == 6
    assert _take(dsn, q, 8) == [b"s%d" % i for i in range(6)]


def test_enqueue_many_is_one_statement_in_order_all_or_nothing(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8, max_payload=16)
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = conn.execute("SELECT ringq.enqueue_many(%s, %s)",
                           (q, [b"a", b"b", b"c"])).fetchone()[0]  # type: ignore[index]
        assert len(ids) == 3 and ids == sorted(ids)
        assert conn.execute("SELECT ringq.enqueue_many(%s, %s::bytea[])",
                            (q, [])).fetchone()[0] == []  # type: ignore[index]
        # The checks of one entry, per payload; nothing of a refused batch stays.
        for payloads, group, state in (
            ([b"d", b"x" * 17], None, "22001"),  # over max_payload
            ([b"d", None], None, "22004"),  # NULL payload
            ([b"d"], "", "22023"),  # an empty group
            ([b"d", b"e", b"f", b"g", b"h", b"i"], "g", "RQ002"),  # 5 left, 6 asked
        ):
            with pytest.raises(psycopg.Error) as got:
                conn.execute("SELECT ringq.enqueue_many(%s, %s, %s)", (q, payloads, group))
            assert got.value.sqlstate == state, payloads
        assert _inbox(dsn, q) == [b"a", b"b", b"c"]
        ids2 = conn.execute("SELECT ringq.enqueue_many(%s, %s, %s, now())",
                            (q, [b"d", b"e", b"f", b"g", b"h"], "g")).fetchone()[0]  # type: ignore[index]
        assert min(ids2) > max(ids)
        assert _refused(dsn, q).sqlstate == "RQ002"
    assert pump_inbox(dsn) == {q: 8}
    with connect(dsn) as s:
        taken: list[Any] = []
        while len(taken) < 8:
            batch = s.dequeue_many(q, 8)
            assert batch
            taken += batch
            s.commit()
        assert [m.payload for m in taken] == [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]
        assert [m.group for m in taken] == [None] * 3 + ["g"] * 5


def test_single_entry_calls_with_untyped_literals_still_resolve(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stmt in ("SELECT ringq.enqueue({}, '\\x01')",
                     "SELECT ringq.enqueue({}, '\\x02', 'g')",
                     "SELECT ringq.enqueue({}, '\\x03', NULL, NULL)"):
            conn.execute(sql.SQL(stmt).format(sql.Literal(q)))
    assert _inbox(dsn, q) == [b"\x01", b"\x02", b"\x03"]
    assert _depth(dsn, q) == 3


def test_statement_rejected_is_not_queue_full(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(capacity=8, max_payload=4)
    with connect(dsn) as s, pytest.raises(StatementRejected):
        s.execute("SELECT ringq.enqueue(%s, %s)", (q, b"too long"))
