"""Deferred row writes: an enqueue keeps its row write in the session until
commit (or flush), and a transaction costs one round trip.

Round trips are counted from libpq's own protocol trace (one ReadyForQuery
per exchange); what the server sees is read from another connection and from
``pg_stat_activity``. Kill -9 tests fork real processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Callable
from types import FrameType
from typing import Any

import psycopg
import pytest
from conftest import activity_of, drain, make_stale, present, round_trips, wire_trace
from psycopg import pq, sql
from ringq.engine import Session, StaleSection, StatementRejected, TransactionError, connect
from ringq.engine.recovery import (
    end_holders,
    overdue_holders,
    recover_dead_clients,
    recover_lost_backends,
    repair_lock_holders,
)

FORK = mp.get_context("fork")


# -- helpers ----------------------------------------------------------------------------------



def sent(lines: list[str], statement: str) -> bool:
    """Whether the trace shows ``statement`` (BEGIN, COMMIT, ROLLBACK) sent as a
    statement of its own."""
    text = "\n".join(lines)
    return f'"{statement}"' in text or f'"{statement} ' in text or f"Query\t \"{statement}" in text


def row(dsn: str, queue: str, slot: int) -> tuple[int, int, bytes | None]:
    """(state, seq, payload) of a queue row, as another connection sees it (committed only)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        r = c.execute(
            sql.SQL("SELECT state, seq, payload FROM {} WHERE slot = %s").format(
                sql.Identifier("ringq", "q_" + queue)
            ),
            (slot,),
        ).fetchone()
    assert r is not None
    return r[0], r[1], None if r[2] is None else bytes(r[2])


def backend(dsn: str, pid: int) -> tuple[str, bool]:
    """(state, whether a transaction is open) of a backend, from pg_stat_activity."""
    state, in_transaction = activity_of(dsn, pid, "state, xact_start IS NOT NULL")
    return state, in_transaction


def warm(s: Session, *queues: str) -> None:
    """Queue info cached and blocks loaded, statements prepared: the steady state."""
    for q in queues:
        s.queue_info(q)
        s.ring(q)
    s.commit()


@pytest.fixture
def app_table(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE app (v int)")
    return "app"


def app_rows(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return [r[0] for r in c.execute("SELECT v FROM app ORDER BY v").fetchall()]


# -- nothing goes before commit; one round trip --------------------------------------------------


def test_enqueue_sends_nothing_until_commit(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        warm(s, q)
        with wire_trace(s.connection) as wire:
            seq = s.enqueue(q, b"later")
            seqs = s.enqueue_many(q, [b"b1", b"b2"])
        assert wire == [], "an enqueue went to the server"
        assert seqs == [seq + 1, seq + 2]
        assert row(dsn, q, seq % 8)[:2] == (0, -1)  # another connection sees no write
        assert backend(dsn, s.backend_pid) == ("idle", False)  # and no transaction is open
        with wire_trace(s.connection) as wire:
            s.commit()
        assert round_trips(wire) == 1
        assert not sent(wire, "BEGIN") and not sent(wire, "COMMIT")  # autocommit: the writes alone
        assert row(dsn, q, seq % 8) == (1, seq, b"later")
        assert backend(dsn, s.backend_pid) == ("idle", False)
    assert [m.payload for m in drain(dsn, q)] == [b"later", b"b1", b"b2"]


@pytest.mark.parametrize("cached", [True, False])
def test_each_transaction_is_one_round_trip(
    dsn: str, make_queue: Callable[..., str], app_table: str, cached: bool
) -> None:
    """One round trip per transaction; with the payload cache a dequeue
    sends nothing at all, its consuming write going with the commit."""
    cache = {} if cached else {"cache_payload": 0}
    q, other = make_queue(**cache), make_queue(dequeue_mode="shared", **cache)
    with connect(dsn) as s, connect(dsn) as c:
        warm(s, q, other)
        warm(c, q, other)
        for i in range(6):  # past psycopg's prepare threshold: the steady state
            s.enqueue(q, b"x%d" % i)
            s.commit()
            assert c.dequeue(q) is not None
            c.commit()
        with wire_trace(s.connection) as wire:
            s.enqueue(q, b"one")
            s.enqueue(other, b"two")  # two queues: still one message
            s.commit()
        assert round_trips(wire) == 1
        with wire_trace(c.connection) as wire:
            m = c.dequeue(q)  # cached: nothing sent; else its BEGIN travels with it
        assert m is not None and m.payload == b"one" and m.deliveries == 1
        assert round_trips(wire) == (0 if cached else 1)
        with wire_trace(c.connection) as wire:
            c.commit()
        assert round_trips(wire) == 1
        with wire_trace(c.connection) as wire:
            m = c.dequeue(other)
            c.rollback()  # the strike travels with the ROLLBACK (none open if cached)
        assert m is not None and round_trips(wire) == (1 if cached else 2)
        assert sent(wire, "ROLLBACK") is not cached
        with wire_trace(c.connection) as wire:
            again = c.dequeue(other)  # a redelivery reads its row (deliveries counted there)
        assert again is not None and again.seq == m.seq and again.deliveries == 2
        assert round_trips(wire) == 1
        c.rollback(count_delivery=False)
        with wire_trace(s.connection) as wire:
            s.connection.execute("INSERT INTO app VALUES (1)")  # the caller opens the transaction
            s.enqueue(q, b"three")
            s.commit()
        assert round_trips(wire) == 3  # psycopg's BEGIN, the INSERT, then writes + COMMIT
        with wire_trace(s.connection) as wire:
            s.enqueue(q, b"keyed", key="k1")  # synchronous, its BEGIN with it
        assert round_trips(wire) == 1
        s.commit()
        assert backend(dsn, s.backend_pid) == ("idle", False)
    assert [m.payload for m in drain(dsn, q)] == [b"three", b"keyed"]  # c took "one"
    assert [m.payload for m in drain(dsn, other)] == [b"two"]
    assert app_rows(dsn) == [1]


def test_commits_survive_deallocate_all_and_go_without_prepared_statements_when_asked(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A commit's row writes go as ringq's own prepared statements: when the
    caller deallocates them (DEALLOCATE ALL) they are prepared again and the
    entry is written once; with psycopg's ``prepare_threshold = None`` (a
    transaction-mode pooler) the commit prepares nothing on the server."""
    q = make_queue(dequeue_mode="shared")
    with connect(dsn) as s:
        s.enqueue(q, b"a")
        s.commit()
        s.connection.execute("DEALLOCATE ALL")
        s.connection.commit()
        s.enqueue_many(q, [b"b", b"c"])  # enqueue_many: prepared for the first time
        s.commit()
        s.enqueue(q, b"d")  # gone after DEALLOCATE ALL: prepared again, sent once
        s.commit()
        s.connection.prepare_threshold = None
        s.connection.execute("DEALLOCATE ALL")
        s.connection.commit()
        for p in (b"e", b"f"):
            s.enqueue(q, p)
            s.commit()
        prepared = s.connection.execute("SELECT count(*) FROM pg_prepared_statements")
        assert prepared.fetchone() == (0,)
        s.connection.commit()
        m = present(s.dequeue(q))
        s.commit()
        assert m.payload == b"a"
    assert [m.payload for m in drain(dsn, q)] == [b"b", b"c", b"d", b"e", b"f"]


def test_psycopgs_deallocate_all_after_a_rollback_does_not_fail_the_next_commit(
    dsn: str, make_queue: Callable[..., str], app_table: str
) -> None:
    """psycopg sends DEALLOCATE ALL after a ROLLBACK once it has prepared a
    statement of its own on the connection: the engine's prepared statements
    go with it, and its next commit inside a transaction the caller's
    statement opened (where nothing can be sent again) prepares them anew."""
    q = make_queue()
    with connect(dsn) as s:
        for i in range(8):  # past psycopg's prepare threshold: psycopg prepares it
            s.connection.execute("INSERT INTO app VALUES (%s)", (i,))
            s.enqueue(q, b"x%d" % i)
            s.commit()
        for rollback in (s.rollback, s.connection.rollback):
            s.connection.execute("INSERT INTO app VALUES (%s)", (100,))
            s.enqueue(q, b"gone")
            rollback()  # psycopg: ROLLBACK, then DEALLOCATE ALL
            s.connection.execute("INSERT INTO app VALUES (%s)", (200,))  # opens the transaction
            s.enqueue(q, b"kept")
            s.commit()  # the writes then COMMIT: one message, nothing to retry
        # A dequeue given back: the ROLLBACK goes in psycopg's pipeline with the
        # strike, and psycopg sends its DEALLOCATE ALL only with its next
        # statement, here the caller's own, after the engine prepared again.
        s.connection.execute("INSERT INTO app VALUES (%s)", (300,))
        m = present(s.dequeue(q))
        s.rollback()
        again = present(s.dequeue(q))  # read from its row (a redelivery)
        assert (again.seq, again.deliveries) == (m.seq, 2)
        s.connection.execute("INSERT INTO app VALUES (%s)", (400,))
        s.commit()
    assert app_rows(dsn) == [*range(8), 200, 200, 400]
    # (a rollback around the session leaves its pending write for its next commit)
    assert [m.payload for m in drain(dsn, q)] == [
        *(b"x%d" % i for i in range(1, 8)), b"kept", b"gone", b"kept"]


def test_session_execute_carries_its_begin_and_converts_errors(
    dsn: str, make_queue: Callable[..., str], app_table: str
) -> None:
    """Session.execute: the caller's statement that opens the transaction
    goes with its BEGIN in one round trip (connection.execute takes two),
    joins the queue work of that transaction, and its error is a ringq error."""
    q = make_queue()
    with connect(dsn) as s:
        with wire_trace(s.connection) as wire:
            rows = s.execute("INSERT INTO app VALUES (%s) RETURNING v", (7,)).fetchall()
        assert rows == [(7,)] and round_trips(wire) == 1
        assert backend(dsn, s.backend_pid)[1] is True  # a transaction is open
        s.enqueue(q, b"with it")
        s.rollback()
        assert app_rows(dsn) == [] and drain(dsn, q) == []
        s.execute("INSERT INTO app VALUES (%s)", (8,))
        s.enqueue(q, b"with it")
        s.commit()
        for v in (9, 10):  # prepared: planned once, still one round trip with its BEGIN
            with wire_trace(s.connection) as wire:
                got = s.execute("INSERT INTO app VALUES (%(v)s) RETURNING v, %(v)s::text",
                                {"v": v}, prepare=True).fetchall()
            assert got == [(v, str(v))] and round_trips(wire) == 1
            s.commit()
        for vs in ([11, 12], [13]):  # a list of ints: an array parameter, prepared too
            with wire_trace(s.connection) as wire:
                got = s.execute("INSERT INTO app SELECT unnest(%s::bigint[]) RETURNING v",
                                (vs,), prepare=True).fetchall()
            assert got == [(v,) for v in vs] and round_trips(wire) == 1
            s.commit()
        named = s.connection.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'ringq%%'"
            " AND statement LIKE 'INSERT INTO app%%'").fetchone()
        assert named == (2,)
        s.connection.commit()
        with pytest.raises(StatementRejected) as err:
            s.execute("SELECT * FROM no_such_table")
        assert isinstance(err.value.__cause__, psycopg.errors.UndefinedTable)
        s.rollback()
    assert app_rows(dsn) == [8, 9, 10, 11, 12, 13]
    assert [m.payload for m in drain(dsn, q)] == [b"with it"]


# -- a stale section: refused at commit, nothing half-committed -----------------------------------


@pytest.mark.parametrize("own_sql", [True, False])
def test_stale_section_raises_at_commit_and_commits_nothing(
    dsn: str, make_queue: Callable[..., str], app_table: str, own_sql: bool,
    face: Callable[..., Any],
) -> None:
    q = make_queue(capacity=8)
    with face(dsn) as s:
        s.enqueue_many(q, [b"a", b"b", b"c"])
        s.commit()
        ring = s.ring(q)
        make_stale(s, q)
        if own_sql:
            s.connection.execute("INSERT INTO app VALUES (1)")
        seq = s.enqueue(q, b"d")
        assert seq == 0  # what the stale section gives: slot 0 holds entry 0 already
        with pytest.raises(StaleSection) as err:
            s.commit()
        assert err.value.queue == q and isinstance(err.value, TransactionError)
        assert app_rows(dsn) == []  # the transaction's own work did not commit
        assert row(dsn, q, 0) == (1, 0, b"a")  # nor was anything overwritten
        assert ring.head == 3 and ring.counts()["locked"] == 0  # resynced, reservation voided
        assert backend(dsn, s.backend_pid) == ("idle", False)
        if own_sql:
            s.connection.execute("INSERT INTO app VALUES (1)")
        assert s.enqueue(q, b"d") == 3  # the retry
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"a", b"b", b"c", b"d"]
    assert app_rows(dsn) == ([1] if own_sql else [])


def test_stale_section_in_one_queue_commits_no_write_of_another(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    good, stale = make_queue(), make_queue(capacity=8)
    with face(dsn) as s:
        s.enqueue_many(stale, [b"a", b"b"])
        s.commit()
        warm(s, good)
        make_stale(s, stale)
        s.enqueue(good, b"good")  # both writes go in one implicit transaction
        s.enqueue(stale, b"x")
        with pytest.raises(StaleSection) as err:
            s.commit()
        assert err.value.queue == stale
        assert [m.payload for m in drain(dsn, good)] == []
        s.enqueue(good, b"good")
        s.enqueue(stale, b"x")
        s.commit()
    assert [m.payload for m in drain(dsn, good)] == [b"good"]
    assert [m.payload for m in drain(dsn, stale)] == [b"a", b"b", b"x"]


def test_a_cached_dequeue_whose_row_was_consumed_around_ringq_commits_nothing(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    """A cached dequeue committed alone (its consuming write the whole
    transaction) whose row no longer holds the entry ready: StaleSection,
    nothing written, and the entry is not delivered again."""
    q = make_queue(dequeue_mode="shared")
    with face(dsn) as s:
        s.enqueue_many(q, [b"a", b"b"])
        s.commit()
        m = present(s.dequeue(q))
        assert m.payload == b"a" and backend(dsn, s.backend_pid) == ("idle", False)  # cached
        with psycopg.connect(dsn, autocommit=True) as other:  # the table written around ringq
            other.execute(
                sql.SQL("UPDATE {} SET state = 2, deq_user = 'other' WHERE seq = %s").format(
                    sql.Identifier("ringq", "q_" + q)
                ),
                (m.seq,),
            )
        with pytest.raises(StaleSection) as err:
            s.commit()
        assert err.value.queue == q
        with psycopg.connect(dsn, autocommit=True) as other:
            got = other.execute(
                sql.SQL("SELECT deq_user FROM {} WHERE seq = %s").format(
                    sql.Identifier("ringq", "q_" + q)
                ),
                (m.seq,),
            ).fetchone()
        assert got == ("other",)  # our consuming write wrote nothing
        again = present(s.dequeue(q))  # resynced: "a" is consumed, "b" is next
        assert again.payload == b"b"
        s.commit()
    assert drain(dsn, q) == []


def test_stale_section_gives_dequeued_entries_back_without_a_strike(
    dsn: str, make_queue: Callable[..., str], face: Callable[..., Any]
) -> None:
    src, dst = make_queue(max_deliveries=1), make_queue(capacity=8)
    with face(dsn) as s:
        s.enqueue(src, b"work")
        s.enqueue_many(dst, [b"a"])
        s.commit()
        make_stale(s, dst)
        m = s.dequeue(src)
        assert m is not None
        s.enqueue(dst, b"result")
        with pytest.raises(StaleSection):
            s.commit()
        m = s.dequeue(src)  # back, and not poisoned (max_deliveries=1)
        assert m is not None and m.payload == b"work" and m.deliveries == 1
        s.enqueue(dst, b"result")
        s.commit()
    assert [m.payload for m in drain(dsn, src)] == []
    assert [m.payload for m in drain(dsn, dst)] == [b"a", b"result"]


# -- flush, rollback, two-phase commit ------------------------------------------------------------


def test_flush_makes_pending_writes_visible_to_the_transaction(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    table = sql.Identifier("ringq", "q_" + q)
    with connect(dsn) as s:
        warm(s, q)
        seq = s.enqueue(q, b"mine")
        read = sql.SQL("SELECT state, seq FROM {} WHERE slot = %s").format(table)
        assert s.connection.execute(read, (seq % 8,)).fetchone() == (0, -1)  # not sent yet
        with wire_trace(s.connection) as wire:
            s.flush()
        assert round_trips(wire) == 1
        assert s.connection.execute(read, (seq % 8,)).fetchone() == (1, seq)
        assert row(dsn, q, seq % 8)[:2] == (0, -1)  # not committed
        with wire_trace(s.connection) as wire:
            s.flush()
        assert wire == []  # nothing left: nothing sent
        s.commit()
        assert row(dsn, q, seq % 8)[:2] == (1, seq)
        seq = s.enqueue(q, b"again")
        with wire_trace(s.connection) as wire:
            s.flush()  # on an idle connection: the BEGIN travels with the writes
        assert round_trips(wire) == 1 and sent(wire, "BEGIN")
        assert backend(dsn, s.backend_pid)[1]  # the transaction is open
        assert row(dsn, q, seq % 8)[:2] != (1, seq)
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"mine", b"again"]


def test_flush_of_a_stale_write_rolls_the_transaction_back(
    dsn: str, make_queue: Callable[..., str], app_table: str, face: Callable[..., Any]
) -> None:
    q = make_queue(capacity=8)
    with face(dsn) as s:
        s.enqueue(q, b"a")
        s.commit()
        make_stale(s, q)
        s.connection.execute("INSERT INTO app VALUES (1)")
        s.enqueue(q, b"b")
        with pytest.raises(StaleSection):
            s.flush()
        assert s.connection.info.transaction_status == pq.TransactionStatus.IDLE
        s.commit()  # nothing left to commit
        assert app_rows(dsn) == []
        s.enqueue(q, b"b")
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"a", b"b"]


def test_rollback_with_pending_writes_sends_nothing_and_frees_the_slots(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=4, full_policy="raise")
    with connect(dsn) as s:
        warm(s, q)
        ring = s.ring(q)
        s.enqueue_many(q, [b"1", b"2", b"3", b"4"])  # the ring is full
        assert ring.counts()["locked"] == 4
        with wire_trace(s.connection) as wire:
            s.rollback()
        assert wire == []
        assert ring.counts()["locked"] == 0
        assert [m.payload for m in drain(dsn, q)] == []
        s.enqueue_many(q, [b"5", b"6", b"7", b"8"])  # every slot is free again
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"5", b"6", b"7", b"8"]


def test_tpc_prepare_flushes_the_pending_writes(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()
    with connect(dsn) as s:
        s.tpc_begin(s.xid(uuid.uuid4().hex))
        seq = s.enqueue(q, b"prepared")
        s.tpc_prepare()
        with psycopg.connect(dsn, autocommit=True) as c:
            logged = c.execute("SELECT seq, kind FROM ringq.tpc_log").fetchall()
        assert logged == [(seq, "e")]
        s.tpc_commit()
        s.tpc_begin(s.xid(uuid.uuid4().hex))
        s.enqueue(q, b"one phase")
        s.tpc_commit()  # not prepared: a one-phase commit, the write goes first
    assert [m.payload for m in drain(dsn, q)] == [b"prepared", b"one phase"]


def test_commit_around_the_library_leaves_pending_writes_to_the_session(
    dsn: str, make_queue: Callable[..., str], app_table: str
) -> None:
    q = make_queue()
    with connect(dsn) as s:
        warm(s, q)
        s.connection.execute("INSERT INTO app VALUES (1)")
        s.enqueue(q, b"pending")
        s.connection.commit()  # not through the session: the write was never sent
        assert [m.payload for m in drain(dsn, q)] == []
        s.commit()  # the session's own commit sends it
    assert [m.payload for m in drain(dsn, q)] == [b"pending"]


# -- kill -9 -------------------------------------------------------------------------------------


def _die_after_enqueue(dsn: str, queue: str, ready: Any, flush: bool) -> None:
    with connect(dsn) as s:
        s.enqueue(queue, b"committed")
        s.commit()
        s.enqueue_many(queue, [b"never 1", b"never 2"])
        if flush:
            s.flush()  # the rows are written, in a transaction that never commits
        ready.set()
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("flush", [False, True])
def test_kill9_between_reserve_and_commit_loses_and_doubles_nothing(
    dsn: str, make_queue: Callable[..., str], flush: bool
) -> None:
    q = make_queue(capacity=4)
    with connect(dsn) as s:
        warm(s, q)
        ring = s.ring(q)
        ready = FORK.Event()
        p = FORK.Process(target=_die_after_enqueue, args=(dsn, q, ready, flush))
        p.start()
        p.join(30)
        assert ready.is_set() and p.exitcode == -signal.SIGKILL
        assert ring.counts()["locked"] == 2  # the dead client's reservations
        for _ in range(100):
            recover_dead_clients(s.section, dsn)
            if ring.counts()["locked"] == 0:
                break
        assert ring.counts()["locked"] == 0
        got = []
        for i in range(8):  # every slot is usable again, twice round the ring
            s.enqueue(q, b"after %d" % i)
            s.commit()
            got.append(present(s.dequeue(q)).payload)
            s.commit()
    got += [m.payload for m in drain(dsn, q)]
    assert got == [b"committed"] + [b"after %d" % i for i in range(8)]


_COMMIT_PATH = (  # Session.commit, then Transaction.commit, send_writes, finish
    "commit", "send_writes", "finish", "send", "_no_implicit_begin", "finish_batch",
    "finish_enqueue",
)


def test_recovery_passes_leave_the_pending_writes_of_a_live_session_alone(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A live session holding reservations whose row writes are still pending
    shows an idle backend with no transaction open. No recovery pass (dead
    clients, orphaned tokens, lost backends, leases) may decide those slots:
    its commit then writes them, each entry delivered once."""
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        warm(s, q)
        sec, ring = s.section, s.ring(q)
        s.enqueue(q, b"pending")
        s.enqueue_many(q, [b"pending 2", b"pending 3"])
        assert backend(dsn, s.backend_pid) == ("idle", False)
        # A dead client beside it, so that the dead-client pass has work to do.
        ready = FORK.Event()
        p = FORK.Process(target=_die_after_enqueue, args=(dsn, q, ready, False))
        p.start()
        p.join(30)
        assert ready.is_set() and p.exitcode == -signal.SIGKILL
        assert ring.counts()["locked"] == 5
        for _ in range(200):
            recover_dead_clients(sec, dsn)
            if ring.counts()["locked"] == 3:
                break
            time.sleep(0.01)
        assert ring.counts()["locked"] == 3  # the dead client's two, not our three
        assert recover_dead_clients(sec, dsn) == []
        with psycopg.connect(dsn, autocommit=True) as c:
            assert recover_lost_backends(sec, c) == []
        assert end_holders(sec, dsn, overdue_holders(sec)) == []
        assert ring.counts()["locked"] == 3
        assert backend(dsn, s.backend_pid) == ("idle", False)
        s.commit()
    assert sorted(m.payload for m in drain(dsn, q)) == [
        b"committed", b"pending", b"pending 2", b"pending 3"
    ]


def _die_during_commit(after: int) -> None:
    """SIGKILL this process at the ``after``-th line run in the commit path:
    before, during and after the COMMIT, before and while the section learns it."""
    left = [after]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            left[0] -= 1
            if left[0] <= 0:
                os.kill(os.getpid(), signal.SIGKILL)
        return local

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_name in _COMMIT_PATH else None

    sys.settrace(on_call)


def _producer(dsn: str, queue: str, seed: int, die_after: int, log: Any) -> None:
    rnd = random.Random(seed)
    with connect(dsn, producer=f"p{seed}") as s:
        warm(s, queue)
        _die_during_commit(die_after)
        for i in range(1_000_000):
            payloads = [f"{seed}:{i}:{k}".encode() for k in range(rnd.randint(1, 3))]
            for p in payloads:
                s.enqueue(queue, p)
            log.send(("trying", payloads))
            s.commit()
            log.send(("committed", payloads))


def test_kill9_during_commit_loses_and_doubles_nothing(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=16)
    rnd = random.Random(11)
    trying: set[bytes] = set()
    committed: set[bytes] = set()
    delivered: set[bytes] = set()
    with connect(dsn) as s:
        warm(s, q)
        ring = s.ring(q)
        for r in range(12):
            recv, send = FORK.Pipe(duplex=False)
            p = FORK.Process(target=_producer, args=(dsn, q, r, rnd.randint(20, 400), send))
            p.start()
            send.close()
            p.join(60)
            assert p.exitcode == -signal.SIGKILL, "the producer was meant to die in a commit"
            while recv.poll():
                try:
                    what, payloads = recv.recv()
                except EOFError:
                    break
                (committed if what == "committed" else trying).update(payloads)
            for _ in range(200):
                recover_dead_clients(s.section, dsn)
                repair_lock_holders(s.section, dsn)
                if ring.counts()["locked"] == 0:
                    break
            assert ring.counts()["locked"] == 0
            got = [m.payload for m in drain(dsn, q)]
            twice = len(got) != len(set(got)) or delivered & set(got)
            assert not twice, "an entry was delivered twice"
            delivered.update(got)
            assert committed <= delivered, f"lost {sorted(committed - delivered)[:5]}"
            assert delivered <= trying, "an entry that no transaction tried was delivered"
    assert len(committed) > 20, "the workload did too little to prove anything"
