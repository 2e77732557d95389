"""Recovery of dead clients (kill -9 at many points), decided from the rows."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
import uuid
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import psycopg
import pytest
from conftest import (
    decided_gids,
    drain,
    inbox_insert,
    prepared_gids,
    present,
    remove_section,
    sql_enqueue,
    terminate_backend,
)
from ringq.engine import Ring, Section, connect
from ringq.engine import layout as L
from ringq.engine.recovery import (
    rebuild,
    reclaim_all,
    recover_dead_clients,
    repair_lock_holders,
    resolve_prepared,
)
from ringq.monitor import prune_keys, pump_inbox

FORK = mp.get_context("fork")


def _hold_and_wait(dsn: str, queue: str, kind: str, ready: Any, stage: Any) -> None:
    s = connect(dsn)
    if kind == "deq":
        m = s.dequeue(queue)
        assert m is not None
    elif kind == "enq":
        s.enqueue(queue, b"dying producer")
    elif kind == "lock":
        # Die inside the queue's critical section, half-way through a reserve.
        ring = s.ring(queue)
        s.section.lock_queue(ring.qidx)
        head = ring.head
        slot = head % ring.cap
        s.section.owner_w[ring.base + slot] = s.owner
        w, bit = ring._bit(slot)
        s.section.lck_w[w] |= bit
    ready.set()
    stage.wait(60)


def _kill_holding(dsn: str, queue: str, kind: str) -> BaseProcess:
    ready, stage = FORK.Event(), FORK.Event()
    p = FORK.Process(target=_hold_and_wait, args=(dsn, queue, kind, ready, stage))
    p.start()
    assert ready.wait(30)
    os.kill(present(p.pid), signal.SIGKILL)
    p.join(10)
    return p


def _recover_until(
    sec: Section, dsn: str, predicate: Callable[[], bool], timeout: float = 5.0
) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        recover_dead_clients(sec, dsn)
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError("recovery did not happen in time")


def test_killed_consumer_entry_is_delivered_again(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()
    with connect(dsn) as s:
        s.enqueue(q, b"precious")
        s.commit()
        sec = s.section
        ring = s.ring(q)
        _kill_holding(dsn, q, "deq")
        assert ring.counts()["locked"] == 1
        elapsed = _recover_until(sec, dsn, lambda: ring.counts()["locked"] == 0)
        assert elapsed < 1.0
        m = s.dequeue(q)
        assert m is not None and m.payload == b"precious" and m.deliveries == 2
        s.commit()
    assert drain(dsn, q) == []


def test_killed_producer_reservation_is_voided(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue(capacity=4)
    with connect(dsn) as s:
        sec = s.section
        ring = s.ring(q)
        _kill_holding(dsn, q, "enq")
        _recover_until(sec, dsn, lambda: ring.counts()["locked"] == 0)
        for i in range(8):  # the slot is usable again
            s.enqueue(q, str(i).encode())
            s.commit()
            assert present(s.dequeue(q)).payload == str(i).encode()
            s.commit()
    assert drain(dsn, q) == []


def test_holder_killed_inside_critical_section_is_repaired(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"a", b"b"])
        s.commit()
        sec = s.section
        ring = s.ring(q)
        _kill_holding(dsn, q, "lock")
        assert sec.q(ring.qidx, L.Q_LOCK_HOLDER) != 0
        assert repair_lock_holders(sec, dsn) == [q]
        recover_dead_clients(sec, dsn)
        assert sec.q(ring.qidx, L.Q_LOCK_HOLDER) == 0
    assert [m.payload for m in drain(dsn, q)] == [b"a", b"b"]
    with connect(dsn) as s:
        s.enqueue(q, b"c")
        s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"c"]


def _worker_loop(dsn: str, queue: str, role: str, seed: int) -> None:
    rnd = random.Random(seed)
    with connect(dsn, producer=f"w{seed}") as s:
        i = 0
        while True:
            if role == "p":
                n = rnd.randint(1, 3)
                try:
                    for _ in range(n):
                        i += 1
                        payload = f"{seed}:{i}".encode()
                        s.enqueue(queue, payload, timeout=5)
                        # Ground truth, in the same transaction as the enqueue.
                        s.connection.execute("INSERT INTO sent (payload) VALUES (%s)", (payload,))
                except Exception:
                    s.rollback()
                    continue
                s.commit()
            else:
                m = s.dequeue(queue, wait=0.2)
                if m is None:
                    s.commit()
                    continue
                s.connection.execute(
                    "INSERT INTO got (payload, seq) VALUES (%s, %s)", (m.payload, m.seq)
                )
                s.commit()


def test_kill9_producers_and_consumers_at_random_points_loses_and_doubles_nothing(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=32, dequeue_mode="shared")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE got (payload bytea, seq bigint)")
        c.execute("CREATE TABLE sent (payload bytea)")
    rounds = 12
    rnd = random.Random(7)
    with connect(dsn) as s:
        sec = s.section
        for r in range(rounds):
            procs = [
                FORK.Process(target=_worker_loop, args=(dsn, q, "p", 100 + r * 10 + k))
                for k in range(2)
            ]
            procs += [
                FORK.Process(target=_worker_loop, args=(dsn, q, "c", 900 + r * 10 + k))
                for k in range(2)
            ]
            for p in procs:
                p.start()
            time.sleep(rnd.uniform(0.2, 0.6))
            for p in procs:
                os.kill(present(p.pid), signal.SIGKILL)
            for p in procs:
                p.join(10)
            recover_dead_clients(sec, dsn)
            repair_lock_holders(sec, dsn)
            reclaim_all(sec)
        ring = s.ring(q)
        _recover_until(sec, dsn, lambda: ring.counts()["locked"] == 0)
    rest = drain(dsn, q)
    with psycopg.connect(dsn, autocommit=True) as c:
        got = [bytes(r[0]) for r in c.execute("SELECT payload FROM got").fetchall()]
        sent = [bytes(r[0]) for r in c.execute("SELECT payload FROM sent").fetchall()]
    delivered = got + [m.payload for m in rest]
    assert len(sent) > 50, "the workload did too little to prove anything"
    assert len(delivered) == len(set(delivered)), "an entry was delivered twice"
    assert set(delivered) == set(sent), (
        f"lost {len(set(sent) - set(delivered))}, phantom {len(set(delivered) - set(sent))}"
    )


def test_rebuild_after_section_loss_restores_queues(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue_many(q, [b"1", b"2", b"3"])
        s.commit()
        assert present(s.dequeue(q)).payload == b"1"
        s.commit()
        instance = s.instance
    Section.unlink(instance)
    sec = rebuild(dsn)
    qidx = present(sec.find_queue(_qid(dsn, q)))
    ring = Ring(sec, qidx)
    assert ring.counts()["ready"] == 2
    assert [m.payload for m in drain(dsn, q)] == [b"2", b"3"]


def _qid(dsn: str, q: str) -> int:
    with psycopg.connect(dsn) as c:
        qid: int = present(
            c.execute("SELECT id FROM ringq.queues WHERE name = %s", (q,)).fetchone()
        )[0]
    return qid


def test_sql_enqueue_reaches_the_ring_in_order(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()
    sql_enqueue(dsn, [(q, f"sql{i}".encode()) for i in range(5)])
    moved = pump_inbox(dsn)
    assert moved == {q: 5}
    sql_enqueue(dsn, [(q, b"sql5")])  # a second pass, by a new pump session
    assert pump_inbox(dsn) == {q: 1}
    got = drain(dsn, q)
    assert [m.payload for m in got] == [f"sql{i}".encode() for i in range(6)]
    assert {m.producer for m in got} == {got[0].producer} and got[0].producer.startswith("sql:")
    # One producer's sequence keeps rising across pump passes (it follows the inbox ids).
    pseqs = [m.producer_seq for m in got]
    assert pseqs == sorted(set(pseqs))


def test_pump_never_waits_on_a_full_queue_and_keeps_its_rows(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    # 'block' policy with a 30 s full_timeout: the pump must not wait it out.
    full = make_queue(capacity=3)
    other = make_queue()
    with connect(dsn) as s:
        for i in range(2):
            s.enqueue(full, f"ring{i}".encode())
        s.commit()
    # past the room ringq.enqueue would allow (RQ002): the pump's full-queue path
    inbox_insert(dsn, [*((full, f"sql{i}".encode()) for i in range(4)), (other, b"other")])
    reported: dict[str, int] = {}
    t0 = time.monotonic()
    moved = pump_inbox(dsn, full=reported)
    assert time.monotonic() - t0 < 5
    # The one free slot took the first SQL entry; the rest wait; the other queue went on.
    assert moved == {full: 1, other: 1}
    assert reported == {full: _qid(dsn, full)}
    assert pump_inbox(dsn, skip=[full]) == {}
    reported.clear()
    assert pump_inbox(dsn, full=reported) == {} and reported == {full: _qid(dsn, full)}
    got = [m.payload for m in drain(dsn, full)]
    assert got == [b"ring0", b"ring1", b"sql0"]
    reported.clear()
    assert pump_inbox(dsn, full=reported) == {full: 3} and reported == {}
    assert [m.payload for m in drain(dsn, full)] == [b"sql1", b"sql2", b"sql3"]
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT count(*) FROM ringq.inbox").fetchone() == (0,)


def _prepare_and_die(dsn: str, queue: str, gid: str, decide: bool, ready: Any) -> None:
    s = connect(dsn)
    s.tpc_begin(s.xid(gid))
    s.enqueue(queue, b"2pc")
    s.tpc_prepare()
    if decide:
        s.tpc_decide()  # the coordinator's durable decision, committed on its own
    ready.set()
    time.sleep(60)


def _prepared_by_a_dead_coordinator(dsn: str, queue: str, *, decide: bool = False) -> None:
    """A child enqueues on ``queue`` in a two-phase transaction, prepares it
    (and records the decision if ``decide``), and is killed with kill -9."""
    ready = FORK.Event()
    p = FORK.Process(target=_prepare_and_die, args=(dsn, queue, uuid.uuid4().hex, decide, ready))
    p.start()
    assert ready.wait(30)
    os.kill(present(p.pid), signal.SIGKILL)
    p.join(10)


@pytest.mark.parametrize("decide", [True, False])
def test_prepared_transaction_of_dead_coordinator_is_resolved(
    dsn: str, make_queue: Callable[..., str], decide: bool
) -> None:
    q = make_queue()
    with connect(dsn) as s:
        sec = s.section
        ring = s.ring(q)
        _prepared_by_a_dead_coordinator(dsn, q, decide=decide)
        recs: list[Any] = []
        t0 = time.monotonic()
        while not recs and time.monotonic() - t0 < 5:
            recs = recover_dead_clients(sec, dsn)
        assert recs and recs[0].held == 1
        assert ring.counts()["locked"] == 1  # in doubt: held, not guessed
        done = resolve_prepared(sec, dsn, timeout_s=0 if not decide else 3600)
        assert [v for _, v in done] == ["commit" if decide else "rollback"]
        assert ring.counts()["locked"] == 0
    assert [m.payload for m in drain(dsn, q)] == ([b"2pc"] if decide else [])


def _prepare_elsewhere(dsn: str, gtrid: str, bqual: str | None = None) -> str:
    """PREPARE an empty transaction on a plain connection, then drop the
    connection (as a dead process would); returns the gid."""
    c = psycopg.connect(dsn)
    try:
        xid = c.xid(0, gtrid, bqual) if bqual is not None else gtrid
        c.tpc_begin(xid)
        c.tpc_prepare()
        return xid if isinstance(xid, str) else xid._as_tid()
    finally:
        c.close()  # not through `with`: that would commit


def test_decided_prepared_transaction_without_queue_operations_is_committed(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    make_queue()  # the ringq schema
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE app_orders (id int)")
    s = connect(dsn)
    sec = s.section
    s.tpc_begin(s.xid(uuid.uuid4().hex))
    s.connection.execute("INSERT INTO app_orders VALUES (1)")  # only the caller's SQL: no tpc_log
    s.tpc_prepare()
    s.tpc_decide()
    s.close()  # decided: left prepared for recovery
    gids = prepared_gids(dsn)
    assert len(gids) == 1 and decided_gids(dsn) == gids
    # No slots tell whether its session is alive: the decision gets a grace period.
    assert resolve_prepared(sec, dsn, timeout_s=0) == []
    assert resolve_prepared(sec, dsn, timeout_s=0, decided_grace_s=0) == [(gids[0], "commit")]
    assert prepared_gids(dsn) == [] and decided_gids(dsn) == []
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT id FROM app_orders").fetchall() == [(1,)]


def test_only_ringq_prepared_transactions_are_rolled_back(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    make_queue()
    with connect(dsn) as s:
        sec = s.section
    ours = uuid.uuid4().hex
    # a dead session's op-less branch, as Session.xid names it
    ringq_gid = _prepare_elsewhere(dsn, ours, "ringq")
    # The user's own, outside ringq: another branch qualifier, a plain name.
    foreign = sorted(
        [_prepare_elsewhere(dsn, ours, "app"), _prepare_elsewhere(dsn, "plain-" + ours)]
    )
    assert prepared_gids(dsn) == sorted([ringq_gid, *foreign])
    assert resolve_prepared(sec, dsn, timeout_s=3600) == []  # not old enough yet
    assert resolve_prepared(sec, dsn, timeout_s=0) == [(ringq_gid, "rollback")]
    assert prepared_gids(dsn) == foreign  # never touched, however old


def test_stale_decisions_are_dropped_after_the_timeout(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    make_queue()
    with connect(dsn) as s:
        sec = s.section
        # white-box (Session._link.conn): the Xid built as Session.xid() builds it, with the
        # format (0) and branch ("ringq") that recovery looks for spelled out here.
        gid = s._link.conn.xid(0, uuid.uuid4().hex, "ringq")  # the link holds the connection
    with psycopg.connect(dsn, autocommit=True) as c:
        # A session died between COMMIT PREPARED and clearing its decision.
        c.execute(
            "INSERT INTO ringq.tpc_decisions (gid, decided_at) "
            "VALUES (%s, now() - interval '2 hours')",
            (gid._as_tid(),),
        )
        c.execute("INSERT INTO ringq.tpc_decisions (gid) VALUES ('recent')")
    assert resolve_prepared(sec, dsn, timeout_s=3600) == []
    assert decided_gids(dsn) == ["recent"]  # within the grace: its commit may still be on the way
    # The gid reused later: no decision left to commit it by mistake.
    assert _prepare_elsewhere(dsn, gid.gtrid, "ringq") == gid._as_tid()
    assert resolve_prepared(sec, dsn, timeout_s=3600) == []
    assert prepared_gids(dsn) == [gid._as_tid()]
    assert resolve_prepared(sec, dsn, timeout_s=0) == [(gid._as_tid(), "rollback")]
    assert decided_gids(dsn) == []  # 'recent' too, once older than the timeout


def _logged_gids(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as c:
        return [r[0] for r in c.execute("SELECT DISTINCT gid FROM ringq.tpc_log ORDER BY 1")]


def test_slot_logs_of_transactions_no_longer_prepared_are_deleted(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """A prepared transaction resolved by someone else after its session
    died (an administrator, the session's coordinator on a new connection)
    leaves its slot log behind; left, a later transaction reusing the gid
    would look like ringq's and be told the old slots. A log whose slots a
    live session owns (between its log and its PREPARE) stays."""
    q = make_queue(capacity=8)
    _prepared_by_a_dead_coordinator(dsn, q)
    [gid] = prepared_gids(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f"COMMIT PREPARED '{gid}'")
        [qid] = c.execute("SELECT id FROM ringq.queues WHERE name = %s", (q,)).fetchone() or ()
    with connect(dsn) as s:
        assert recover_dead_clients(s.section, dsn)  # its slot decided from the row
        assert _logged_gids(dsn) == [gid]
        # A log naming every slot of the queue, while this session owns one of them.
        s.enqueue(q, b"held")
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(
                "INSERT INTO ringq.tpc_log (gid, queue_id, slot, seq, kind) "
                "SELECT 'live', %s, g, g, 'e' FROM generate_series(0, 7) g",
                (qid,),
            )
        assert resolve_prepared(s.section, dsn, timeout_s=0) == []
        assert _logged_gids(dsn) == ["live"]
        s.commit()  # the slot is no longer owned: its log goes at the next pass
        resolve_prepared(s.section, dsn, timeout_s=0)
        assert _logged_gids(dsn) == []
    assert [m.payload for m in drain(dsn, q)] == [b"2pc", b"held"]


def test_session_dropped_without_close_is_recovered(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    import gc

    q = make_queue()
    with connect(dsn) as s:
        s.enqueue(q, b"keep")
        s.commit()
        sec, ring = s.section, s.ring(q)
        leaked = connect(dsn)
        assert leaked.dequeue(q) is not None
        # white-box (Session._link.conn): the connection goes without Session.close(), as
        # garbage collection would take it; the client entry stays behind.
        leaked._link.conn.close()  # as garbage collection would
        del leaked
        gc.collect()
        _recover_until(sec, dsn, lambda: ring.counts()["locked"] == 0)
        m = s.dequeue(q)
        assert m is not None and m.payload == b"keep"
        s.commit()


def test_spent_idempotency_keys_are_pruned_after_the_retention(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        consumed = s.enqueue(q, b"consumed", key="k-consumed")
        queued = s.enqueue(q, b"queued", key="k-queued")
        s.commit()
        assert present(s.dequeue(q)).seq == consumed
        s.commit()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("UPDATE ringq.keys SET created_at = now() - interval '2 days'")
        qid = present(c.execute("SELECT id FROM ringq.queues WHERE name = %s", (q,)).fetchone())[0]
        c.execute(
            "INSERT INTO ringq.keys (queue_id, key, seq) VALUES (%s, 'k-dropped', 0)", (qid + 1000,)
        )
    with connect(dsn) as s:
        recent = s.enqueue(q, b"recent", key="k-recent")  # within the retention
        s.commit()
    # Only the old key whose entry is gone goes (and the dropped queue's).
    assert prune_keys(dsn, retention_s=86_400) == {q: 1, "": 1}
    with psycopg.connect(dsn) as c:
        keys = sorted(r[0] for r in c.execute("SELECT key FROM ringq.keys").fetchall())
    assert keys == ["k-queued", "k-recent"]
    assert prune_keys(dsn, retention_s=86_400) == {}
    with connect(dsn) as s:
        assert s.enqueue(q, b"queued", key="k-queued") == queued  # still deduplicated
        assert s.enqueue(q, b"again", key="k-consumed") > recent  # spent: a new entry
        s.commit()


def test_key_pruning_runs_along_the_created_at_index(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    from ringq.engine import queue_table
    from ringq.engine.sqlfile import load

    _Q = load("ringq.monitor", "queries.sql")  # the monitor's key-pruning queries

    q = make_queue(capacity=8)
    with psycopg.connect(dsn, autocommit=True) as c:
        qid = present(c.execute("SELECT id FROM ringq.queues WHERE name = %s", (q,)).fetchone())[0]
        idx = c.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = 'ringq' AND indexname = "
            "'keys_queue_id_created_at'"
        ).fetchone()
        assert idx is not None and "(queue_id, created_at)" in idx[0]
        # Keys of a dropped queue, more than one batch of them.
        c.execute(
            "INSERT INTO ringq.keys (queue_id, key, seq, created_at) "
            "SELECT %s, 'd' || g, g, now() - interval '2 days' FROM generate_series(1, 5) g",
            (qid + 1000,),
        )
        c.execute("ANALYZE ringq.keys")
        # The index can serve every pruning query (the planner would pick a
        # sequential scan of so small a table, so that one is ruled out).
        c.execute("SET enable_seqscan = off")
        for query, args in [
            (psycopg.sql.SQL(_Q["keys_queues"]), (86_400,)),
            (psycopg.sql.SQL(_Q["keys_prune"]).format(table=queue_table(q)), (qid, 86_400, 8, 10)),
        ]:
            plan = "\n".join(
                r[0] for r in c.execute(psycopg.sql.SQL("EXPLAIN ") + query, args).fetchall()
            )
            assert "keys_queue_id_created_at" in plan, plan
            assert "Seq Scan on keys" not in plan, plan
        plan = "\n".join(
            r[0] for r in c.execute("EXPLAIN " + _Q["keys_prune_dropped"], (10,)).fetchall()
        )
        assert "Seq Scan on keys" not in plan, plan
    assert prune_keys(dsn, retention_s=86_400, batch=3) == {"": 3}
    assert prune_keys(dsn, retention_s=86_400, batch=3) == {"": 2}
    assert prune_keys(dsn, retention_s=86_400, batch=3) == {}


def test_key_pruning_errors_are_ringq_errors(dsn: str, make_queue: Callable[..., str]) -> None:
    from ringq.engine import RingqError

    make_queue()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ALTER TABLE ringq.keys RENAME TO keys_gone")
    try:
        with pytest.raises(RingqError) as info:
            prune_keys(dsn)
        assert isinstance(info.value.__cause__, psycopg.Error)
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("ALTER TABLE ringq.keys_gone RENAME TO keys")


# -- owner tokens: slots are decided by the identity of the connection that held them -------------


def test_session_that_cannot_decide_its_lost_slots_hands_them_over(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's point 0: a session loses its connection while holding an
    entry and deciding it fails too; the entry must not stay locked under a
    client entry that a later session of the same process takes over."""
    from ringq.engine import DatabaseUnavailable, InDoubt

    q = make_queue()
    with connect(dsn) as p:
        p.enqueue(q, b"held")
        p.commit()
    s = connect(dsn)
    # white-box (Session._link.cidx): the client entry, to read its state in the section
    # after the session has gone on under a fresh identity.
    old_token, cidx = s.owner, s._link.cidx
    assert s.dequeue(q) is not None

    def fails(*args: object) -> None:
        raise DatabaseUnavailable("the new connection was terminated too")

    # white-box (_link.decide_lost): deciding the lost transaction fails too;
    # no public hook reaches that step.
    monkeypatch.setattr("ringq.engine.session._link.decide_lost", fails)
    terminate_backend(dsn, s.backend_pid)
    with pytest.raises(InDoubt):
        s.commit()
    monkeypatch.undo()
    sec, ring = s.section, s.ring(q)
    assert sec.c(cidx, L.C_STATE) == L.CS_IN_DOUBT and sec.c(cidx, L.C_TOKEN) == old_token
    assert s.owner != old_token  # the session goes on under a fresh identity
    s.close()
    with connect(dsn) as later:  # a later session of this process
        assert later.owner != old_token
        assert ring.counts()["locked"] == 1
        _recover_until(sec, dsn, lambda: ring.counts()["locked"] == 0)
        m = later.dequeue(q)
        assert m is not None and m.payload == b"held" and m.deliveries == 2
        later.commit()


@pytest.mark.parametrize("answer", ["never sent", "lost after the commit"])
def test_a_commit_in_doubt_is_told_from_the_rows(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    """InDoubt names the transaction's queue operations, and
    ``in_doubt_outcome`` reads from the rows whether it committed: the
    connection lost before the COMMIT went (False), or after it ran and
    before its answer came back (True); the same once recovery has decided
    the slots, and from another session."""
    from ringq.engine import DatabaseUnavailable, InDoubt, InFlight

    q = make_queue()
    s = connect(dsn)
    with connect(dsn) as p:
        p.enqueue(q, b"before")
        p.commit()
    taken = present(s.dequeue(q))
    s.commit()
    seq = s.enqueue(q, b"in doubt")
    slot = seq % s.ring(q).cap
    def fails(*args: object) -> None:
        raise DatabaseUnavailable("deciding failed too")

    # white-box (_link.decide_lost, Session._txn.send_writes): deciding fails, so that
    # the caller gets InDoubt, and the COMMIT's answer is lost after it ran; only
    # these private steps lie between the COMMIT and its answer.
    monkeypatch.setattr("ringq.engine.session._link.decide_lost", fails)
    if answer == "never sent":
        terminate_backend(dsn, s.backend_pid)
    else:
        # the row writes go through the session's transaction object
        send = s._txn.send_writes

        def send_then_lose(writes: Any, *, commit: bool) -> None:
            send(writes, commit=commit)  # the COMMIT runs...
            s.connection.close()  # ...and its answer is lost
            raise DatabaseUnavailable("the connection was lost")

        monkeypatch.setattr(s._txn, "send_writes", send_then_lose)
    with pytest.raises(InDoubt) as caught:
        s.commit()
    monkeypatch.undo()
    exc = caught.value
    assert exc.entries == (InFlight(q, seq, "enqueue", slot, s.producer, 1),)
    committed = answer == "lost after the commit"
    assert s.in_doubt_outcome(exc) is committed
    _recover_until(s.section, dsn, lambda: s.ring(q).counts()["locked"] == 0)
    with connect(dsn) as other:
        assert other.in_doubt_outcome(exc) is committed
    s.close()
    assert [m.payload for m in drain(dsn, q)] == ([b"in doubt"] if committed else [])
    assert taken.payload == b"before"


def test_a_commit_in_doubt_is_false_for_an_entry_whose_sequence_was_given_again(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """After an asynchronous fail-over the ring goes on from the rows the
    standby had, so a sequence the old primary gave (its entry lost in the
    replication gap) is given again: the row holding it is another
    producer's, and says the transaction in doubt did not commit."""
    from ringq.engine import InDoubt, InFlight

    q = make_queue()
    with connect(dsn) as s:
        seq = s.enqueue(q, b"new history")
        s.commit()
        slot = seq % s.ring(q).cap
        mine = InFlight(q, seq, "enqueue", slot, "host:1:lost", 7)
        exc = InDoubt("commit outcome unknown", entries=(mine,))
        assert s.in_doubt_outcome(exc) is False
        theirs = InFlight(q, seq, "enqueue", slot, s.producer, 1)
        assert s.in_doubt_outcome(InDoubt("x", entries=(theirs,))) is True
        # a dequeue of an entry that is still queued did not commit; a consumed one tells nothing
        dequeue = InDoubt("x", entries=(InFlight(q, seq, "dequeue", slot),))
        assert s.in_doubt_outcome(dequeue) is False
        present(s.dequeue(q))
        s.commit()
        assert s.in_doubt_outcome(dequeue) is None
        assert s.in_doubt_outcome(InDoubt("two-phase: no entries")) is None


@pytest.mark.parametrize("mode", ["shared", "single"])
def test_orphaned_slot_is_decided_once_its_holder_backend_is_gone(
    dsn: str, make_queue: Callable[..., str], mode: str
) -> None:
    """A slot whose token no entry carries any more (here: the session's token
    renewed behind its back) is decided by recovery once the backend recorded
    with it has ended, though the entry it came from is live and in use.
    (Without the payload cache, so the dequeue opens a transaction: a cached
    one leaves the backend idle, and recovery decides the orphan at once.)"""
    q = make_queue(dequeue_mode=mode, cache_payload=0)
    with connect(dsn) as p:
        p.enqueue_many(q, [b"first", b"second"])
        p.commit()
    with connect(dsn) as s, connect(dsn) as other:
        sec, ring = s.section, s.ring(q)
        assert present(s.dequeue(q)).payload == b"first"
        held_by = s.backend_pid
        slot = ring.tail % ring.cap
        assert ring.holder(slot) == held_by and ring.bits(slot)[3] == s.owner
        # white-box (Session._link.owner, .cidx, .ops): orphan the token while its backend
        # lives, as a process that lost track of its session would; no public call does.
        s._link.owner = sec.renew_client(s._link.cidx, held_by)
        s._link.ops = []
        assert recover_dead_clients(sec, dsn) == []  # its transaction is open: it may still commit
        assert ring.counts()["locked"] == 1
        if mode == "single":
            assert other.dequeue(q) is None  # the orphaned token holds the dequeuer role
        terminate_backend(dsn, held_by)
        [rec] = recover_dead_clients(sec, dsn)
        assert (rec.slots, rec.rolled_back, rec.backend_pid) == (1, 1, held_by)
        assert sec.c(s._link.cidx, L.C_STATE) == L.CS_ACTIVE  # the entry is not touched
        m = other.dequeue(q)
        assert m is not None and m.payload == b"first" and m.deliveries == 2
        other.commit()


def test_close_never_frees_an_entry_with_slots_locked_under_it(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as p:
        p.enqueue(q, b"leaked")
        p.commit()
    s = connect(dsn)
    # white-box (Session._link.cidx, Session._link.ops): the client entry, read after close, and
    # the session made to forget what it holds; no public name gives either.
    sec, ring, cidx = s.section, s.ring(q), s._link.cidx
    assert s.dequeue(q) is not None
    s._link.ops = []  # the session lost track of it (as an interrupted call could)
    s.close()
    assert sec.c(cidx, L.C_STATE) == L.CS_IN_DOUBT
    _recover_until(sec, dsn, lambda: ring.counts()["locked"] == 0)
    assert sec.c(cidx, L.C_STATE) == L.CS_FREE
    assert [m.payload for m in drain(dsn, q)] == [b"leaked"]


# -- recovery does not need a monitor (issue point 1) ----------------------------------------------


@pytest.mark.parametrize("mode", ["single", "shared"])
def test_killed_consumer_entry_is_taken_by_another_consumer_without_a_monitor(
    dsn: str, make_queue: Callable[..., str], mode: str
) -> None:
    """No monitor runs: a consumer that finds nothing ready while a dead
    client holds the queue's entry (and, in single mode, its dequeuer role)
    decides it itself, within a few seconds."""
    q = make_queue(dequeue_mode=mode)
    with connect(dsn) as p:
        p.enqueue(q, b"held by the dead")
        p.commit()
    _kill_holding(dsn, q, "deq")
    with connect(dsn) as s:
        t0 = time.monotonic()
        m = s.dequeue(q, wait=10)
        assert m is not None and m.payload == b"held by the dead" and m.deliveries == 2
        assert time.monotonic() - t0 < 5
        s.commit()
        assert s.ring(q).counts()["locked"] == 0


def test_a_full_queue_blocked_by_a_dead_producer_is_recovered_by_the_next_enqueue(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=4)
    with connect(dsn) as p:
        for i in range(3):
            p.enqueue(q, b"%d" % i)
            p.commit()
        assert [p.dequeue(q) is not None for _ in range(3)] == [True] * 3
        p.commit()
    _kill_holding(dsn, q, "enq")  # reserves the 4th slot, then dies: the tail cannot pass it
    with connect(dsn) as s:
        for i in range(4):
            s.enqueue(q, b"after %d" % i, timeout=10)
            s.commit()
    assert [m.payload for m in drain(dsn, q)] == [b"after %d" % i for i in range(4)]


def test_recover_dead_holders_waits_until_the_queue_is_clear(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue()
    with connect(dsn) as p:
        p.enqueue(q, b"x")
        p.commit()
    _kill_holding(dsn, q, "enq")
    _kill_holding(dsn, q, "deq")
    with connect(dsn) as s:
        assert s.ring(q).counts()["locked"] == 2
        s.recover_dead_holders(q, timeout=10)
        assert s.ring(q).counts()["locked"] == 0
        assert present(s.dequeue(q)).deliveries == 2
        s.commit()


@pytest.mark.parametrize("resolver", ["elsewhere", "monitor"])
def test_a_prepared_transaction_found_at_a_load_is_held_then_decided(
    dsn: str, make_queue: Callable[..., str], resolver: str
) -> None:
    """A queue loaded (after a fail-over, a rebuild) while a transaction is
    prepared keeps its slot locked with owner HELD. Once the transaction is
    resolved, by ringq's resolve_prepared or by anyone else (its own
    session on a new connection, an administrator), recovery decides the
    slot from the row. It used to keep owner 0, which no recovery looked at:
    the slot stayed locked and the ring stopped once it wrapped to it."""
    q = make_queue(capacity=4)
    _prepared_by_a_dead_coordinator(dsn, q)
    [gid] = prepared_gids(dsn)
    remove_section(dsn)  # the next session loads the queue from its rows
    with connect(dsn) as s:
        ring = s.ring(q)
        [(_slot, owner, _holder)] = ring.locked_slots()
        assert owner == L.OWNER_HELD
        if resolver == "elsewhere":
            with psycopg.connect(dsn, autocommit=True) as c:
                c.execute(f"COMMIT PREPARED '{gid}'")
            recover_dead_clients(s.section, dsn)
        else:
            assert resolve_prepared(s.section, dsn, timeout_s=0) == [(gid, "rollback")]
        assert ring.locked_slots() == []
        got = []
        for i in range(8):  # twice round the ring: nothing in the way
            s.enqueue(q, b"%d" % i)
            s.commit()
            got.append(present(s.dequeue(q)).payload)
            s.commit()
    got += [m.payload for m in drain(dsn, q)]
    committed = [b"2pc"] if resolver == "elsewhere" else []
    assert got == committed + [b"%d" % i for i in range(8)]
