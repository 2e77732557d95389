"""Named events (as RTR's broadcasts) over PostgreSQL NOTIFY.

The monitor publishes on channel ``ringq_events`` a JSON payload
``{"name": ..., "queue": ..., "t": <unix seconds>, ...}``. Names:

- ``queue.<name>.full`` — no free slot left in the ring;
- ``queue.<name>.empty`` — the last ready entry was taken;
- ``queue.<name>.high_water`` — depth reached the high-water mark (80% of capacity);
- ``consumer.died`` — a dead client's slots were recovered (``pid``, ``slots``, ``queues``);
- ``entry.poisoned`` — an entry moved to the exception table (``seq``, ``deliveries``, ``reason``).

A program subscribes with a shell-style wildcard (:func:`fnmatch.fnmatchcase`):
``subscribe(dsn, "queue.*.full")``. Delivery follows NOTIFY's rules: only to
sessions listening when the event is published, after the publishing
transaction commits, in order; nothing is replayed.
"""

from __future__ import annotations

import fnmatch
import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import psycopg
from psycopg import sql
from ringq.engine import DatabaseUnavailable, RingqError
from ringq.engine._errors import from_psycopg

from ._queries import EVENTS_CHANNEL, NOTIFY

QUEUE_FULL = "full"
QUEUE_EMPTY = "empty"
QUEUE_HIGH_WATER = "high_water"
CONSUMER_DIED = "consumer.died"
ENTRY_POISONED = "entry.poisoned"

_MAX_PAYLOAD = 7900  # NOTIFY payloads must stay under 8000 bytes


def queue_event(queue: str, what: str) -> str:
    """The name of a queue event: ``queue.<queue>.<what>``."""
    return f"queue.{queue}.{what}"


@dataclass(frozen=True)
class Event:
    """One event: its ``name``, the ``queue`` it concerns (or None), the
    publication time ``t`` (unix seconds) and the other fields in ``data``."""

    name: str
    queue: str | None
    t: float
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_payload(cls, payload: str) -> Event:
        """Parse a NOTIFY payload; :raises ValueError: it is not an event."""
        obj = json.loads(payload)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("not a ringq event")  # noqa: TRY004 - one error for any bad payload
        name = obj.pop("name")
        queue = obj.pop("queue", None)
        t = float(obj.pop("t", 0.0))
        return cls(name, queue if isinstance(queue, str) else None, t, obj)

    def payload(self) -> str:
        """The JSON text published (long field values are cut to fit NOTIFY's limit)."""
        body: dict[str, Any] = {"name": self.name, "queue": self.queue, "t": self.t, **self.data}
        text = json.dumps(body, separators=(",", ":"), default=str)
        if len(text.encode()) > _MAX_PAYLOAD:
            body = {"name": self.name, "queue": self.queue, "t": self.t, "truncated": True}
            text = json.dumps(body, separators=(",", ":"))
        return text


def make_event(name: str, queue: str | None = None, **data: Any) -> Event:
    return Event(name, queue, time.time(), data)


class Subscription:
    """Events matching a wildcard, received on a dedicated LISTEN connection.

    Iterate it (blocks until the next matching event), or call :meth:`get`
    with a timeout. ``close()`` is idempotent; it is also a context manager.
    """

    def __init__(self, dsn: str, pattern: str, *, connect_timeout: float = 10.0) -> None:
        self.pattern = pattern
        try:
            self._conn: psycopg.Connection[Any] = psycopg.connect(
                dsn, autocommit=True, connect_timeout=max(1, int(connect_timeout)),
                application_name="ringq-subscriber",
            )
            # LISTEN has taken effect when this returns: later events reach us.
            self._conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(EVENTS_CHANNEL)))
        except psycopg.Error as exc:
            raise from_psycopg(exc, dsn=dsn) from exc
        self._closed = False
        self._pending: deque[Event] = deque()

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    def get(self, timeout: float | None = None) -> Event | None:
        """The next matching event, or None after ``timeout`` seconds (None: wait forever).

        :raises DatabaseUnavailable: the connection was lost.
        :raises RingqError: the subscription is closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self._receive(remaining)
        return self._pending.popleft()

    def _receive(self, timeout: float | None) -> None:
        if self._closed:
            raise RingqError("the subscription is closed")
        try:
            # Run the generator to its end: notifications arriving in one packet
            # come together, and leaving it early would drop the rest.
            for n in self._conn.notifies(timeout=timeout, stop_after=1):
                try:
                    event = Event.from_payload(n.payload)
                except ValueError:
                    continue
                if self.matches(event.name):
                    self._pending.append(event)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"event subscription lost its connection: {exc}") from exc

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.get()
            if event is not None:
                yield event

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._conn.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def subscribe(dsn: str, pattern: str = "*") -> Subscription:
    """Listen for events whose name matches ``pattern`` (``fnmatch`` wildcards).

    ``subscribe(dsn, "queue.*.full")`` receives every queue's full events;
    ``"queue.orders.*"`` every event of queue ``orders``.

    :raises DatabaseUnavailable: the database cannot be reached.
    """
    return Subscription(dsn, pattern)


def publish(conn: psycopg.Connection[Any], event: Event) -> None:
    """NOTIFY ``event`` on ``conn`` (delivered when its transaction commits)."""
    conn.execute(NOTIFY, (EVENTS_CHANNEL, event.payload()))
