"""SQL consumers take whole chunks of the listing, and wait as waiters (issue 34).

What the chunked take adds to ``test_sql_consumers.py``'s guarantees: a take
that finds nothing waits on a channel of its backend's own and is woken by
the listing (no NOTIFY to every listener), a waiter killed -9 does not keep
the others waiting, concurrent takes of one listing never take an entry
twice and a rolled-back one strikes only what it took, and an agent that
lost its memory (a new monitor) settles what was taken or unlisted from the
rows. The agent is driven pass by pass where the test needs its steps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import psycopg
from conftest import drain, enqueue_committed, present, wait_for
from ringq.engine import connect
from ringq.engine.sqlpath import SqlAgent
from ringq.monitor import Monitor
from test_sql_consumers import collect, got, offers, set_aside, take


def killed_9(statement: str, *args: str, before: Callable[[str], object] = lambda _: None) -> str:
    """Run ``statement`` (``%s``: ``args``) in a process of its own, outside
    autocommit when it says BEGIN, then kill -9 it while it holds what the
    statement did; ``before(line)`` runs first with its backend's pid.
    Returns that pid."""
    script = ("import sys, time, psycopg\n"
              "c = psycopg.connect(sys.argv[1], autocommit=sys.argv[2] != 'BEGIN')\n"
              "c.execute(sys.argv[3], sys.argv[4:])\n"
              "print(c.info.backend_pid, flush=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, *args[:1], *args[1:2], statement,
                             *args[2:]], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        before(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    return line


def listening(conn: psycopg.Connection[Any]) -> list[str]:
    """The channels ``conn``'s backend listens on (read outside any transaction:
    a notification waits for the transaction it arrives in to end)."""
    out = [str(r[0]) for r in conn.execute("SELECT pg_listening_channels()").fetchall()]
    if not conn.autocommit:
        conn.commit()
    return out


def waiters(dsn: str, queue: str) -> list[int]:
    """The pids waiting for ``queue`` (ringq.waiters)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return [int(r[0]) for r in c.execute(
            "SELECT w.pid FROM ringq.waiters w JOIN ringq.queues q ON q.id = w.queue_id"
            " WHERE q.name = %s ORDER BY w.since", (queue,))]


def test_an_empty_take_waits_on_its_own_channel_and_the_listing_wakes_it(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    monitor()
    with psycopg.connect(dsn) as c, psycopg.connect(dsn) as idle:
        pid = present(c.execute("SELECT pg_backend_pid()").fetchone())[0]
        assert take(c, q, 10) == []
        c.commit()  # the wait (LISTEN), the waiter row and the ask take effect now
        assert listening(c) == [f"ringq_ready_{pid}"]
        assert waiters(dsn, q) == [pid]
        enqueue_committed(dsn, q, b"one")
        note = next(c.notifies(timeout=10, stop_after=1))
        assert (note.channel, note.payload) == (f"ringq_ready_{pid}", q)
        assert got(take(c, q, 10)) == [(b"one", 1)]
        c.commit()
        # Got something: it no longer listens, nor is it a waiter.
        assert listening(c) == [] and waiters(dsn, q) == []
        # A connection that never took nothing never listened: no wake-up for it.
        assert listening(idle) == [] and list(idle.notifies(timeout=0.3)) == []


def test_only_the_first_waiter_asks_the_agent_and_a_wake_counts_what_waiters_want(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    with psycopg.connect(dsn, autocommit=True) as agent, psycopg.connect(dsn) as c1, \
            psycopg.connect(dsn) as c2, psycopg.connect(dsn) as c3:
        agent.execute("LISTEN ringq_want")
        asks = []
        for c in (c1, c2, c3, c1):  # c1 again: still a waiter
            assert take(c, q, 10) == []
            c.commit()
            asks.append(len(list(agent.notifies(timeout=0.3))))
        # Each NOTIFY costs every listening backend a transaction: only the
        # first waiter wakes the agent; it reads the others on its passes.
        assert asks == [1, 0, 0, 0]
        assert len(waiters(dsn, q)) == 3
        qid = present(agent.execute("SELECT id FROM ringq.queues WHERE name = %s",
                                    (q,)).fetchone())[0]
        # Enough waiters for the entries listed, oldest first: each asked for 10.
        assert present(agent.execute("SELECT ringq.wake(%s, %s, 6)", (qid, q)).fetchone()) == (1,)
        assert [n.channel for n in c1.notifies(timeout=5, stop_after=1)] == [
            f"ringq_ready_{c1.info.backend_pid}"]
        assert present(agent.execute("SELECT ringq.wake(%s, %s, 11)", (qid, q)).fetchone()) == (2,)
        assert waiters(dsn, q) == []


def test_what_waiting_consumers_asked_for_is_listed_in_one_pass(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=1024, dequeue_mode="shared")
    with connect(dsn) as s, psycopg.connect(dsn, autocommit=True) as agent_conn, \
            psycopg.connect(dsn) as c:
        SqlAgent.prepare(agent_conn)
        assert take(c, q, 300) == []  # a waiter that asked for 300
        c.commit()
        enqueue_committed(dsn, q, *[b"x%03d" % i for i in range(400)])
        s.queue_info(q)
        agent = SqlAgent()
        agent.asked(q)
        agent.run(s.section, agent_conn)
        # Not only the agent's first target (64): an idle consumer's ask, at once.
        assert len(offers(dsn, q)) >= 300
        assert len(got(take(c, q, 300))) == 300
        c.commit()


def test_a_waiter_killed_9_does_not_keep_the_others_waiting(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    monitor()
    # A consumer in another process takes nothing (a waiter, first in line), then dies.
    dead_pid = int(killed_9(
        "SELECT * FROM ringq.dequeue(%s, 5)", dsn, "autocommit", q,
        before=lambda pid: wait_for(lambda: waiters(dsn, q) == [int(pid)],
                                    what="the first waiter")))
    with psycopg.connect(dsn, autocommit=True) as c:
        pid = c.info.backend_pid
        assert take(c, q, 5) == []
        assert waiters(dsn, q) == [dead_pid, pid]
        enqueue_committed(dsn, q, b"x")
        # The listing's one chunk wakes the oldest waiter (gone); the agent's
        # next pass wakes the next while a chunk is takeable.
        note = next(c.notifies(timeout=10, stop_after=1))
        assert note.payload == q
        assert got(take(c, q, 5)) == [(b"x", 1)]
    assert waiters(dsn, q) == []


def test_the_agent_deletes_the_waiter_rows_of_backends_that_ended(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=64, dequeue_mode="shared")
    # Only the queue's first waiter wakes the agent, so a dead waiter's row
    # would keep the next one from asking (and its queue wanted for ever).
    dead_pid = int(killed_9("SELECT * FROM ringq.dequeue(%s, 5)", dsn, "autocommit", q,
                            before=lambda pid: wait_for(lambda: waiters(dsn, q) == [int(pid)],
                                                        what="the waiter")))
    with connect(dsn) as s, psycopg.connect(dsn, autocommit=True) as agent_conn:
        wait_for(lambda: not agent_conn.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (dead_pid,)).fetchall(),
            what="the killed backend gone")
        SqlAgent.prepare(agent_conn)
        SqlAgent().run(s.section, agent_conn)  # a new agent scans at once
    assert waiters(dsn, q) == []


def test_concurrent_takes_share_the_listing_and_a_rollback_strikes_only_its_own(
    dsn: str, make_queue: Callable[..., str], monitor: Callable[..., Monitor]
) -> None:
    q = make_queue(capacity=256, dequeue_mode="shared")
    payloads = [b"e%03d" % i for i in range(60)]
    enqueue_committed(dsn, q, *payloads)
    monitor()
    set_aside(dsn, q, 60)
    with psycopg.connect(dsn) as c1, psycopg.connect(dsn) as c2, psycopg.connect(dsn) as c3:
        a = take(c1, q, 7)   # whole chunks, the last in part
        b = take(c2, q, 7)   # reads past c1's chunks, never waits on them
        c = take(c3, q, 7)
        seqs = [r[0] for r in a + b + c]
        assert len(a) == len(b) == len(c) == 7 and len(set(seqs)) == 21
        c2.rollback()
        c1.commit()
        c3.commit()
    rest = collect(dsn, q, 60 - 14, n=20)
    # Only what c2 took comes again, counted once; nothing else twice.
    again = {r[1]: r[4] for r in rest if r[4] > 1}
    assert again == {r[1]: 2 for r in b}
    assert sorted(r[1] for r in a + c + rest) == payloads


def test_an_agent_that_lost_its_memory_settles_from_the_rows(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=128, dequeue_mode="shared")
    payloads = [b"p%02d" % i for i in range(40)]
    enqueue_committed(dsn, q, *payloads)
    with connect(dsn) as s, psycopg.connect(dsn, autocommit=True) as agent_conn, \
            psycopg.connect(dsn) as c1, psycopg.connect(dsn) as c2, \
            psycopg.connect(dsn, autocommit=True) as admin:
        SqlAgent.prepare(agent_conn)
        s.queue_info(q)  # the queue loaded in this process's section
        first = SqlAgent()
        first.asked(q)
        first.run(s.section, agent_conn)
        listed = offers(dsn, q)
        assert len(listed) == 40
        taken = take(c1, q, 10)
        c1.commit()                           # consumed; no agent saw it
        held = take(c2, q, 5)                 # under way
        # Chunks deleted by hand (not taken): their entries are still queued.
        gone = present(admin.execute(
            "DELETE FROM ringq.offers o USING ringq.queues q WHERE q.id = o.queue_id"
            " AND q.name = %s AND o.seq = (SELECT max(seq) FROM ringq.offers) RETURNING o.n",
            (q,)).fetchone())[0]
        # A new agent (a monitor restarted): its first look settles by the rows.
        second = SqlAgent()
        second.run(s.section, agent_conn)
        assert second.figures.taken == 10 and second.figures.given_back == gone
        c2.commit()
        second.run(s.section, agent_conn)
        assert second.figures.taken == 15
        # What is still listed is taken by SQL consumers (no agent needed for
        # that; the agent listed what it gave back again: SQL consumers take
        # here); the rest by linked ones: each once, nothing taken comes again.
        left = take(c1, q, 100)
        c1.commit()
    rest = [m.payload for m in drain(dsn, q, batch=8)]
    assert len(left) + len(rest) == 40 - 15 and gone > 0
    assert sorted([r[1] for r in taken + held + left] + rest) == payloads
