"""Poison entries: the exception table, the exception queue, and
``ringq queue exceptions|requeue|discard``, against a real PostgreSQL.

The monitor's inbox step is :func:`ringq.monitor.pump_inbox`; the
tests call it directly where a running monitor would, so they wait on no timer.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from conftest import cli, drain
from ringq.engine import ConfigError, EntryNotFound, QueueNotFound, Session, connect
from ringq.engine.recovery import recover_dead_clients
from ringq.monitor import pump_inbox
from ringq.scripting import (
    QueueSpec,
    create_queue,
    discard_exception,
    drop_queue,
    list_exceptions,
    requeue_exception,
)

FORK = mp.get_context("fork")


def poison(s: Session, queue: str, times: int) -> int:
    """Dequeue the next entry of ``queue`` and roll it back ``times`` times; its seq."""
    seq = -1
    for n in range(1, times + 1):
        m = s.dequeue(queue)
        assert m is not None and m.deliveries == n
        seq = m.seq
        s.rollback()
    return seq


def inbox(dsn: str) -> list[tuple[str, bytes]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT q.name, i.payload FROM ringq.inbox i JOIN ringq.queues q ON q.id = i.queue_id "
            "ORDER BY i.id"
        ).fetchall()
    return [(name, bytes(p)) for name, p in rows]


def test_poison_entry_is_listed_requeued_exactly_once_and_discarded(
    dsn: str, make_queue: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    q = make_queue(max_deliveries=2)
    with connect(dsn) as s:
        s.enqueue(q, b"first poison")
        s.enqueue(q, b"second, longer poison")
        s.commit()
        a = poison(s, q, 2)
        b = poison(s, q, 2)
        assert s.dequeue(q) is None  # both moved aside
        s.commit()

    code, out, err = cli(capsys, "queue", "exceptions", q, "--dsn", dsn)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["SEQ", "DELIVERIES", "MOVED", "SIZE", "GROUP", "REASON"]
    assert [line.split()[0:2] + line.split()[4:6] for line in lines[1:]] == [
        [str(a), "2", str(len(b"first poison")), "-"],  # no group
        [str(b), "2", str(len(b"second, longer poison")), "-"],
    ]
    assert all(line.endswith("max deliveries reached") for line in lines[1:])
    code, out, _ = cli(capsys, "queue", "exceptions", q, "--json", "--dsn", dsn)
    listed = json.loads(out)
    assert [(e["seq"], e["deliveries"], e["size"], e["reason"]) for e in listed] == [
        (a, 2, 12, "max deliveries reached"),
        (b, 2, 21, "max deliveries reached"),
    ]

    # Requeue: out of the exception table and into the inbox, in one step.
    code, out, err = cli(capsys, "queue", "requeue", q, str(a), "--dsn", dsn)
    assert (code, err) == (0, "")
    assert out.startswith(f"requeued entry {a} on queue {q!r}")
    assert inbox(dsn) == [(q, b"first poison")]
    code, _, err = cli(capsys, "queue", "requeue", q, str(a), "--dsn", dsn)
    assert code == 4 and f"queue {q!r} has no exception entry {a}" in err  # not twice
    assert inbox(dsn) == [(q, b"first poison")]

    # The monitor's inbox step puts it on the ring: delivered once, as new.
    assert pump_inbox(dsn) == {q: 1}
    got = drain(dsn, q)
    assert [(m.payload, m.deliveries) for m in got] == [(b"first poison", 1)]
    assert got[0].seq > b  # a new entry, after everything before it
    assert pump_inbox(dsn) == {} and drain(dsn, q) == []

    code, out, err = cli(capsys, "queue", "discard", q, str(b), "--dsn", dsn)
    assert (code, out, err) == (0, f"discarded exception entry {b} of queue {q!r}\n", "")
    code, _, err = cli(capsys, "queue", "discard", q, str(b), "--dsn", dsn)
    assert code == 4 and f"queue {q!r} has no exception entry {b}" in err
    code, out, _ = cli(capsys, "queue", "exceptions", q, "--dsn", dsn)
    assert (code, out) == (0, f"queue {q!r} has no exception entries\n")
    assert inbox(dsn) == [] and drain(dsn, q) == []


def test_unknown_queue_or_seq_exits_4(
    dsn: str, make_queue: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, "queue", "exceptions", "nosuch", "--dsn", dsn)
    assert (code, err) == (4, "ringq: queue 'nosuch' does not exist (no ringq schema)\n")
    q = make_queue()
    for action in ("exceptions", "requeue", "discard"):
        argv = ["queue", action, "nosuch"] + ([] if action == "exceptions" else ["7"])
        code, _, err = cli(capsys, *argv, "--dsn", dsn)
        assert (code, err) == (4, "ringq: queue 'nosuch' does not exist\n"), action
    for action in ("requeue", "discard"):
        code, _, err = cli(capsys, "queue", action, q, "7", "--dsn", dsn)
        assert code == 4, action
        assert (
            err
            == f"ringq: queue {q!r} has no exception entry 7 (see 'ringq queue exceptions {q}')\n"
        )
    code, _, err = cli(capsys, "queue", "requeue", q, "seven", "--dsn", dsn)
    assert code == 2 and "invalid int value" in err
    with psycopg.connect(dsn) as conn:
        with pytest.raises(EntryNotFound) as caught:
            requeue_exception(conn, q, 7)
        assert (caught.value.queue, caught.value.seq) == (q, 7)
        with pytest.raises(EntryNotFound):
            discard_exception(conn, q, 7)
        with pytest.raises(QueueNotFound):
            list_exceptions(conn, "nosuch")


def test_every_action_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for action in ("exceptions", "requeue", "discard"):
        code, out, _ = cli(capsys, "queue", action, "--help")
        assert code == 0 and "[env: RINGQ_DSN]" in out and "exit 4" in out, action


def test_poison_entry_lands_on_the_exception_queue(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    dead = make_queue(max_payload=512)
    q = make_queue(max_payload=256, max_deliveries=2, exception_queue=dead)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN ringq_inbox")
        with connect(dsn) as s:
            s.enqueue(q, b"bad order")
            s.enqueue(q, b"good order")
            s.commit()
            producer = s.producer
            seq = poison(s, q, 2)
            m = s.dequeue(q)
            assert m is not None and m.payload == b"good order"
            s.commit()
        # The monitor's inbox mover is woken, as by ringq.enqueue().
        assert [n.payload for n in listener.notifies(timeout=5, stop_after=1)] == [dead]

    with psycopg.connect(dsn) as conn:
        [entry] = list_exceptions(conn, q)
    assert (entry.seq, entry.deliveries, entry.reason, entry.size) == (
        seq,
        2,
        "max deliveries reached",
        9,
    )
    assert inbox(dsn) == [(dead, b"bad order")]
    assert pump_inbox(dsn) == {dead: 1}
    with connect(dsn) as consumer:  # a consumer of the exception queue takes it
        m = consumer.dequeue(dead)
        assert m is not None and m.payload == b"bad order" and m.deliveries == 1
        # Marked as a poison copy: never taken for one of its producer's own entries.
        assert m.producer == "ringq:poison:" + producer
        consumer.commit()
    assert drain(dsn, dead) == [] and drain(dsn, q) == []

    # Requeued, it goes back to the original queue (the copy already taken
    # from the exception queue is the operator's business).
    with psycopg.connect(dsn) as conn:
        requeue_exception(conn, q, seq)
        assert list_exceptions(conn, q) == []
    assert pump_inbox(dsn) == {q: 1}
    with connect(dsn) as consumer:  # back as a new entry, marked as requeued
        m = consumer.dequeue(q)
        assert m is not None and m.payload == b"bad order" and m.deliveries == 1
        assert m.producer == "ringq:requeue:" + producer
        consumer.commit()
    assert drain(dsn, q) == [] and drain(dsn, dead) == []


def test_exception_queue_must_exist_and_take_the_payloads(
    dsn: str, make_queue: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    small = make_queue(max_payload=100)
    with psycopg.connect(dsn) as conn:
        with pytest.raises(
            QueueNotFound, match="exception queue 'nowhere' of queue 'orders' does not exist"
        ):
            create_queue(conn, QueueSpec("orders", 8, 200, exception_queue="nowhere"))
        with pytest.raises(
            ConfigError, match=f'exception queue "{small}" takes payloads up to 100 bytes'
        ):
            create_queue(conn, QueueSpec("orders", 8, 200, exception_queue=small))
        assert conn.execute(
            "SELECT count(*) FROM ringq.queues WHERE name = 'orders'"
        ).fetchone() == (0,)
    args = ["queue", "create", "orders", "--capacity", "8", "--max-payload", "100", "--dsn", dsn]
    code, _, err = cli(capsys, *args, "--exception-queue", "nowhere")
    assert code == 4 and "create it first" in err
    code, out, _ = cli(capsys, *args, "--exception-queue", small)
    assert code == 0 and out.startswith("created")
    # Re-applied after the exception queue is gone: still "unchanged", not refused.
    with psycopg.connect(dsn) as conn:
        drop_queue(conn, small)
    code, out, _ = cli(capsys, *args, "--exception-queue", small)
    assert (code, out) == (0, "queue 'orders' exists (unchanged)\n")


def test_dropped_exception_queue_keeps_the_entry_in_the_table_only(
    dsn: str, make_queue: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    dead = make_queue()
    q = make_queue(max_deliveries=1, exception_queue=dead)
    code, _, err = cli(capsys, "queue", "drop", dead, "--yes", "--dsn", dsn)
    assert code == 0
    assert err == (
        f"ringq: queue {dead!r} is the exception queue of {q!r}: "
        "once it is dropped, their poison entries stay in ringq.exceptions only\n"
    )
    with connect(dsn) as s:
        s.enqueue(q, b"orphan")
        s.commit()
        seq = poison(s, q, 1)
        assert s.dequeue(q) is None
        s.commit()
    with psycopg.connect(dsn) as conn:
        [entry] = list_exceptions(conn, q)
    assert entry.seq == seq
    assert (
        entry.reason
        == f'max deliveries reached; kept here only: exception queue "{dead}" does not exist'
    )
    assert inbox(dsn) == []


def _dequeue_and_die(dsn: str, queue: str, ready: Any) -> None:
    s = connect(dsn)
    assert s.dequeue(queue) is not None
    ready.set()
    time.sleep(60)  # killed long before: this only keeps the transaction open


def test_entry_of_a_killed_consumer_is_poisoned_onto_the_exception_queue(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    # The monitor's recovery strikes with the same statement as a rollback.
    dead = make_queue()
    q = make_queue(max_deliveries=1, exception_queue=dead)
    with connect(dsn) as s:
        s.enqueue(q, b"kills its consumers")
        s.commit()
        sec = s.section
        ready = FORK.Event()
        p = FORK.Process(target=_dequeue_and_die, args=(dsn, q, ready))
        p.start()
        assert ready.wait(30) and p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        ring = s.ring(q)
        deadline = time.monotonic() + 10
        while ring.counts()["locked"]:
            assert time.monotonic() < deadline, "recovery did not happen in time"
            recover_dead_clients(sec, dsn)  # waits for the dead backend to end, as the monitor does
            time.sleep(0.01)  # polling a condition, not timing a race
        assert s.dequeue(q) is None
        s.commit()
    with psycopg.connect(dsn) as conn:
        assert [(e.deliveries, e.reason) for e in list_exceptions(conn, q)] == [
            (1, "max deliveries reached")
        ]
    assert pump_inbox(dsn) == {dead: 1}
    assert [m.payload for m in drain(dsn, dead)] == [b"kills its consumers"]
