"""Exactly-once effects: ringq.applied, and the transfer example under crashes.

The example runs as real processes (``python examples/transfer.py work``),
killed with SIGKILL at random points and by themselves between bank B's
commit and the dequeue's (``--chaos``); the test loop plays the monitor.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import present, queue_in
from ringq.engine import connect
from ringq.engine.recovery import reclaim_all, recover_dead_clients, repair_lock_holders
from ringq.move import already_applied, create_applied_table

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "transfer.py"


# -- the helper ------------------------------------------------------------------------------------


def test_redelivered_entry_is_recognized_in_another_database(dsn: str, dsn2: str) -> None:
    """Peek, apply in another database's transaction, then remove: a crash
    between the two commits redelivers, and the record says "applied"."""
    q = queue_in(dsn, max_deliveries=10)
    with connect(dsn) as s:
        s.enqueue(q, b"credit 10")
        s.commit()
    with psycopg.connect(dsn2) as bank, connect(dsn) as s:
        bank.execute("CREATE TABLE acct (n int)")
        bank.execute("INSERT INTO acct VALUES (0)")
        bank.commit()
        for attempt in (1, 2):
            msg = s.dequeue(q)
            assert msg is not None and msg.deliveries == attempt
            with bank.transaction():
                if not already_applied(bank, "acct", msg):
                    bank.execute("UPDATE acct SET n = n + 10")
            if attempt == 1:
                s.rollback()  # "crashed" before the dequeue committed: delivered again
            else:
                s.commit()
        assert present(bank.execute("SELECT n FROM acct").fetchone())[0] == 10
        rows = bank.execute("SELECT consumer, queue, seq FROM ringq.applied").fetchall()
        assert rows == [("acct", q, present(msg).seq)]


def test_effect_rolled_back_is_not_recorded(dsn: str) -> None:
    q = queue_in(dsn)
    with connect(dsn) as s:
        s.enqueue(q, b"x")
        s.commit()
        msg = present(s.dequeue(q))
        assert not already_applied(s, "c", msg)
        assert already_applied(s, "c", msg)  # same transaction: seen
        assert not already_applied(s, "other", msg)  # per consumer
        s.rollback()  # the effect and its record go together
        msg = present(s.dequeue(q))
        assert not already_applied(s, "c", msg)
        s.commit()


def test_a_sequence_given_again_is_another_entry(dsn: str) -> None:
    """After an asynchronous fail-over of the source, the sequences of
    entries lost in the replication gap are given again: a record of the same
    queue and sequence with another enqueue time is another entry's, whose
    effect must be applied, not skipped."""
    from datetime import UTC, datetime, timedelta

    from ringq.engine import Message

    q = queue_in(dsn)
    t = datetime.now(UTC)
    lost = Message(q, 7, b"lost in the gap", "host:1:1", 1, t, 1)
    new = Message(q, 7, b"new on the promoted primary", "host:2:1", 1, t + timedelta(seconds=1), 1)
    with connect(dsn) as s:
        assert not already_applied(s, "c", lost)
        s.commit()
        assert already_applied(s, "c", lost)  # a redelivery of the same entry
        s.rollback()
        assert not already_applied(s, "c", new)
        s.commit()
        assert already_applied(s, "c", new)
        s.rollback()
        rows = s.connection.execute("SELECT seq, enqueued_at FROM ringq.applied").fetchall()
        assert rows == [(7, new.enqueued_at)]
        s.commit()


def test_records_made_before_enqueue_times_were_kept_still_count(dsn: str) -> None:
    """A table made by an earlier version (no enqueued_at) gets the column on
    first use; its records, with no enqueue time, count as applied."""
    from datetime import UTC, datetime

    from ringq.engine import Message

    q = queue_in(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP TABLE IF EXISTS ringq.applied")
        c.execute(
            "CREATE TABLE ringq.applied (consumer text NOT NULL, queue text NOT NULL, "
            "seq bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(), "
            "PRIMARY KEY (consumer, queue, seq))"
        )
        c.execute("INSERT INTO ringq.applied (consumer, queue, seq) VALUES ('c', %s, 3)", (q,))
    # another spelling of the DSN: this process has not seen the table there yet
    with connect(dsn + "?application_name=upgraded") as s:
        old = Message(q, 3, b"old", "p", 1, datetime.now(UTC), 2)
        assert already_applied(s, "c", old)
        assert not already_applied(s, "c", Message(q, 4, b"next", "p", 2, datetime.now(UTC), 1))
        s.commit()


def test_moved_entry_is_recorded_by_its_origin(dsn: str, dsn2: str) -> None:
    """The same source entry arriving twice by two roads (moved, then moved
    again after being re-sent) is one entry for the applied table."""
    from ringq.move import wrap

    q = queue_in(dsn2, max_payload=2048)
    queue_in(dsn)  # database 1's schema, for its instance id
    with connect(dsn) as src:
        instance = src.instance
    with connect(dsn2) as s:
        from datetime import UTC, datetime

        from ringq.engine import Message

        original = Message("outbox", 41, b"pay", "p", 1, datetime.now(UTC), 1)
        s.enqueue(q, wrap(original, instance, 3))
        s.enqueue(q, wrap(original, instance, 3))  # a second copy (not deduplicated on purpose)
        s.commit()
        a, b = present(s.dequeue(q)), present(s.dequeue(q))
        assert a.seq != b.seq
        assert not already_applied(s, "pay", a)
        assert already_applied(s, "pay", b)
        s.commit()
        row = s.connection.execute("SELECT queue, seq FROM ringq.applied").fetchone()
        assert row == (f"{instance}:outbox", 41)
        s.commit()


def test_create_is_idempotent_and_concurrent(dsn: str) -> None:
    import threading

    errors: list[BaseException] = []

    def create() -> None:
        try:
            create_applied_table(dsn)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    create_applied_table(dsn)


# -- the example -----------------------------------------------------------------------------------


def _example(*args: str, **kw: Any) -> subprocess.Popen[Any]:
    return subprocess.Popen([sys.executable, str(EXAMPLE), *args], **kw)


def test_demo_runs(dsn: str) -> None:
    p = _example("--dsn", dsn, "demo", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "-ok: done" in out
    assert "-declined: declined" in out
    assert "-compensated: refunded" in out
    assert "money conserved: True" in out


@pytest.mark.slow
def test_transfers_under_load_with_crashes(dsn: str, dsn2: str, tmp_path: Path) -> None:
    """3 workers, random kill -9 and self-kills between the commits: money is
    conserved and no transfer is applied twice."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rnd = random.Random(seed)
    N, WORKERS, KILLS = 300, 3, 12
    common = ("--dsn", dsn, "--bank-b", dsn2)
    assert _example(*common, "setup").wait(60) == 0
    assert _example(*common, "submit", "--count", str(N), "--seed", str(seed)).wait(60) == 0
    with connect(dsn) as s:
        for q in ("transfer_requests", "transfer_deposits", "transfer_refunds", "transfer_replies"):
            s.ring(q)
        sec = s.section

    workers: dict[int, subprocess.Popen[Any]] = {}
    logs: list[Path] = []
    logs_of: dict[int, Path] = {}

    def start() -> None:
        log = tmp_path / f"worker{len(logs)}.log"
        logs.append(log)
        with open(log, "w") as f:
            p = _example(*common, "work", "--chaos", "0.2", stdout=f, stderr=subprocess.STDOUT)
        workers[p.pid] = p
        logs_of[p.pid] = log

    def monitor() -> None:
        repair_lock_holders(sec, dsn)
        recover_dead_clients(sec, dsn)
        reclaim_all(sec)

    def reap() -> int:
        dead = [pid for pid, p in workers.items() if p.poll() is not None]
        for pid in dead:
            assert workers.pop(pid).returncode == -signal.SIGKILL  # only kills end a worker
        return len(dead)

    replies: list[dict[str, Any]] = []
    kills = self_kills = 0
    deadline = time.monotonic() + 240
    try:
        while len(replies) < N:
            assert time.monotonic() < deadline, f"{len(replies)} of {N} replies"
            self_kills += reap()
            while len(workers) < WORKERS:
                start()
            # Kills spread over the run by progress (the k-th once k/(KILLS+1)
            # of the replies are in), at a random point of a random worker.
            if kills < KILLS and len(replies) >= (kills + 1) * N // (KILLS + 1):
                time.sleep(rnd.uniform(0, 0.05))
                victim = rnd.choice(list(workers))
                os.kill(victim, signal.SIGKILL)
                workers[victim].wait(10)
                workers.pop(victim)
                kills += 1
            monitor()
            with connect(dsn) as c:
                msgs = c.dequeue_many("transfer_replies", 5, wait=0.1)
                replies.extend(json.loads(m.payload) for m in msgs)
                c.commit()
        for pid, p in workers.items():
            # Its SIGTERM handler is in place once it said "ready".
            while "ready" not in logs_of[pid].read_text():
                assert p.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            p.send_signal(signal.SIGTERM)
        for pid, p in list(workers.items()):
            assert p.wait(30) == 0
            workers.pop(pid)
    finally:
        for p in workers.values():
            p.kill()
            p.wait()
    monitor()
    out = "\n".join(log.read_text() for log in logs)
    skipped = out.count("already applied")
    print(f"kills {kills}, self-kills {self_kills}, redelivered notes skipped {skipped}")

    # Exactly one final reply per transfer.
    ids = [r["id"] for r in replies]
    assert len(ids) == len(set(ids)) == N
    rep = json.loads(
        subprocess.run(
            [sys.executable, str(EXAMPLE), *common, "report"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
    )
    assert rep["conserved"] and rep["in_flight"] == 0, rep
    assert rep["applied_twice"] == [], rep
    # Replies agree with the ledgers.
    statuses = {r["id"]: r["status"] for r in replies}
    kinds: dict[str, set[str]] = {}
    for where in (dsn, dsn2):
        with psycopg.connect(where) as conn:
            for t, k in conn.execute("SELECT transfer, kind FROM transfer_ledger").fetchall():
                kinds.setdefault(t, set()).add(k)
    for t, status in statuses.items():
        expect = {
            "declined": set(),
            "done": {"withdraw", "deposit"},
            "refunded": {"withdraw", "returned", "refund"},
        }[status]
        assert kinds.get(t, set()) == expect, (t, status, kinds.get(t))
    assert {"declined", "done", "refunded"} <= set(statuses.values())
    with psycopg.connect(dsn) as conn:
        assert present(conn.execute("SELECT count(*) FROM ringq.exceptions").fetchone())[0] == 0
    assert kills == KILLS
    assert self_kills > 0 and skipped > 0  # the applied table did its work
