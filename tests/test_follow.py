"""The section follows the database's history: a server of another history
(a promoted standby, a restore on a new timeline) never serves a bit or a
cached payload of the old one. The promotion itself is in test_failover.py;
here the history a section describes is changed under it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import present, terminate_backend, wait_for
from ringq.engine import connect
from ringq.engine import layout as L
from ringq.engine.recovery import history_of
from ringq.engine.sqlfile import load

_Q = load("ringq.engine", "queries.sql")


def test_a_section_of_another_history_is_replaced_before_use(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue(q, b"committed here")
        s.commit()
        sec, ring = s.section, s.ring(q)
        with psycopg.connect(dsn, autocommit=True) as c:
            sysid, timeline = history_of(c)
        assert sec.history() == (sysid, timeline) and timeline >= 1
        # The section as the old primary left it: an entry the new one never
        # received is ready, its payload cached.
        sec.lock_queue(ring.qidx)
        try:
            slot, seq = present(ring.reserve(s.owner, s.backend_pid))
            assert ring.cache.put(slot, seq, b"phantom", b"p", 1, 0)
            ring.finish_enqueue(slot, committed=True)
        finally:
            sec.unlock_queue(ring.qidx)
        sec.header[L.H_DB_TIMELINE] = timeline - 1  # it describes the history before
        with connect(dsn) as c:
            assert c.section is not sec and c.section.history() == (sysid, timeline)
            assert sec.unlinked()
            got = c.dequeue_many(q, 10)
            c.commit()
        assert [m.payload for m in got] == [b"committed here"]
        # The session that used the old section moves over at its next call.
        s.enqueue(q, b"after")
        s.commit()
        assert s.section is not sec
    with connect(dsn) as c:
        assert present(c.dequeue(q)).payload == b"after"
        c.commit()


def test_a_backend_that_started_after_the_client_is_never_taken_for_its_own(dsn: str) -> None:
    """After a restart or a fail-over a pid comes back as another backend:
    waiting for a lost backend must not end that one."""
    from ringq.engine.rows._decide import wait_backend_gone

    before = time.time_ns() - 5_000_000_000
    with psycopg.connect(dsn, autocommit=True) as other, psycopg.connect(
        dsn, autocommit=True
    ) as conn:
        pid = other.info.backend_pid
        wait_backend_gone(conn, pid, timeout=2, not_after_ns=before)
        assert other.execute("SELECT 1").fetchone() == (1,)  # still alive
        row = conn.execute(_Q["backend_alive"], (pid,)).fetchone()
        assert row is not None and row[0] is not None


def test_a_session_with_no_server_to_reconnect_to_stays_open_and_reconnects_later(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fail-over's gap: the connection dies mid-transaction and no server
    takes a new one yet. The transaction's entry goes to recovery, the
    session stays open, and its next call connects again."""
    from ringq.engine import DatabaseUnavailable, RingqError
    from ringq.engine.recovery import recover_dead_clients

    q = make_queue(capacity=8)
    with connect(dsn) as p:
        p.enqueue_many(q, [b"held", b"next"])
        p.commit()
    s = connect(dsn)
    try:
        assert present(s.dequeue(q)).payload == b"held"

        def no_server() -> psycopg.Connection[Any]:
            raise DatabaseUnavailable("no server is primary yet")

        # white-box (Session._link.open_connection): no server to reconnect to, as in the
        # middle of a fail-over; the reconnect path has no public hook.
        monkeypatch.setattr(s._link, "open_connection", no_server)
        terminate_backend(dsn, s.backend_pid)
        with pytest.raises(RingqError):
            s.commit()
        assert not s.closed
        with pytest.raises(DatabaseUnavailable):
            s.dequeue(q)  # still no server
        monkeypatch.undo()
        sec, ring = s.section, s.ring(q)
        wait_for(lambda: not recover_dead_clients(sec, dsn) and ring.counts()["locked"] == 0,
                 10, "recovery of the handed-over entry")
        got = [(m.payload, m.deliveries) for m in s.dequeue_many(q, 5)]
        s.commit()
        assert [p for p, _d in got] == [b"held", b"next"]
    finally:
        s.close()
