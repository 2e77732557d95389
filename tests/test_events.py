"""Named events reach wildcard subscribers, none lost when several arrive together.

psycopg hands over all the notifications of one network read together; a
subscriber that stopped reading after the first would lose the rest. Events
committed in ONE transaction are sent by the server back to back, and a
subscriber that was not reading while they arrived finds them all in one read.
"""

from __future__ import annotations

import array
import fcntl
import termios
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from ringq.engine import EVENTS_CHANNEL as CHANNEL
from ringq.engine import Event, Subscription, connect, publish, subscribe
from ringq.monitor import Monitor, MonitorConfig
from ringq.monitor import _events as ME
from ringq.monitor import subscribe as monitor_subscribe


def _all(sub: Subscription, n: int, timeout: float = 10.0) -> list[Event]:
    """Up to ``n`` events, waiting at most ``timeout`` seconds in all."""
    got: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and (left := deadline - time.monotonic()) > 0:
        ev = sub.get(left)
        if ev is not None:
            got.append(ev)
    return got


def _wait_in_socket(sub: Subscription, payloads: list[str]) -> None:
    """Wait until every notification carrying ``payloads`` waits in ``sub``'s socket.

    The subscriber is not reading meanwhile, so its next read takes them all
    at once: the case where stopping after the first notification loses the rest.
    Each NotificationResponse is 'A', int32 length, int32 pid, channel and
    payload as C strings.
    """
    need = sum(1 + 4 + 4 + len(CHANNEL) + 1 + len(p.encode()) + 1 for p in payloads)
    # white-box (Subscription._conn): the socket itself, to see the notifications
    # waiting in it before the subscription reads them; no public name gives it.
    fd = sub._conn.fileno()
    buf = array.array("i", [0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
        if buf[0] >= need:
            assert buf[0] == need, "more than the expected notifications arrived"
            return
        time.sleep(0.005)
    raise AssertionError(f"only {buf[0]} of {need} bytes of notifications arrived")


def test_every_event_of_one_transaction_reaches_a_wildcard_subscriber(
    dsn: str, make_queue: Any
) -> None:
    q = make_queue()
    names = [f"queue.{q}.{what}" for what in ("full", "high_water", "empty", "full", "custom")]
    with connect(dsn) as s, s.subscribe(f"queue.{q}.*") as mine, subscribe(dsn) as everything:
        with connect(dsn) as other:
            other.publish("queue.other.full", depth=1)  # matches only ``everything``
            for i, name in enumerate(names):
                other.publish(name, queue=q, i=i)
            other.commit()  # one transaction: the server sends them back to back
        every = _all(everything, len(names) + 1)
        assert [e.name for e in every] == ["queue.other.full", *names]
        _wait_in_socket(mine, [e.payload() for e in every])
        got = _all(mine, len(names) + 1, timeout=2)
        assert [e.name for e in got] == names
        assert [e.data["i"] for e in got] == list(range(len(names)))
        assert all(e.queue == q and e.t > 0 and e.received_at >= e.t - 5 for e in got)
        assert mine.get(0) is None and everything.get(0) is None


def test_monitor_events_published_together_all_arrive(dsn: str, make_queue: Any) -> None:
    """The monitor's own event objects, several in one transaction, through its
    own re-exported subscribe; a non-event NOTIFY on the channel is skipped."""
    q = make_queue()
    events = [
        ME.make_event(ME.queue_event(q, ME.QUEUE_FULL), q, depth=4, capacity=4),
        ME.make_event(
            ME.queue_event(q, ME.QUEUE_HIGH_WATER), q, depth=4, capacity=4, threshold=3.2
        ),
        ME.make_event(ME.CONSUMER_DIED, q, pid=1, slots=[1, 2], queues=[q]),
        ME.make_event(ME.ENTRY_POISONED, q, seq=7, deliveries=3, reason="x" * 20_000),  # cut to fit
    ]
    with monitor_subscribe(dsn, "*") as sub:
        with psycopg.connect(dsn) as conn:
            conn.execute("SELECT pg_notify('ringq_events', 'not json')")
            for ev in events:
                publish(conn, ev)
        _wait_in_socket(sub, ["not json", *(ev.payload() for ev in events)])
        got = _all(sub, len(events), timeout=5)
    assert [(e.name, e.queue, e.t) for e in got] == [(e.name, e.queue, e.t) for e in events]
    assert got[0].data == {"depth": 4, "capacity": 4}
    assert got[2].data["slots"] == [1, 2]
    assert got[3].data == {"truncated": True}


def test_real_monitor_full_and_high_water_of_one_pass_both_arrive(
    dsn: str, make_queue: Any, tmp_path: Path
) -> None:
    """Filling a queue in one commit makes one monitor pass publish ``full``
    and ``high_water``; a subscriber that reads only after both were sent
    gets them in one read, and must keep both."""
    q = make_queue(capacity=4, full_policy="raise")
    mon = Monitor(MonitorConfig(dsn, port=0, interval=0.1, data_dir=tmp_path / "monitor"))
    mon.start()
    try:
        with subscribe(dsn, f"queue.{q}.*") as late, subscribe(dsn, f"queue.{q}.*") as witness:
            with connect(dsn) as s:
                for i in range(4):
                    s.enqueue(q, b"%d" % i)
                s.commit()
            # The witness reads as they come; ``late`` does not read until both were sent.
            sent = _all(witness, 2)
            seen = {e.name for e in sent}
            assert seen == {f"queue.{q}.full", f"queue.{q}.high_water"}
            _wait_in_socket(late, [e.payload() for e in sent])
            got = _all(late, 2, timeout=2)
            assert {e.name for e in got} == seen
            assert all(e.queue == q and e.data["capacity"] == 4 for e in got)
    finally:
        mon.stop()


def test_subscription_lifecycle(dsn: str) -> None:
    with pytest.raises(ValueError, match="pattern"):
        Subscription(dsn, ())
    sub = subscribe(dsn, "a.*", "b.*")
    assert sub.matches("a.x") and sub.matches("b.y") and not sub.matches("c.z")
    sub.close()
    sub.close()  # harmless twice
    assert sub.closed
    from ringq.engine import SessionClosed

    with pytest.raises(SessionClosed):
        sub.get(0)
