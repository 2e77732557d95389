"""Named events (as RTR's named broadcasts) over PostgreSQL NOTIFY.

Events travel on the channel ``ringq_events`` as a JSON payload
``{"name": ..., "queue": ..., "t": <unix seconds>, ...}``. The monitor
publishes ``queue.<name>.full``, ``queue.<name>.empty``,
``queue.<name>.high_water``, ``consumer.died`` and ``entry.poisoned``
(``ringq.monitor`` names them); any program may publish its own. A program
subscribes by name with shell-style wildcards (:func:`fnmatch.fnmatchcase`,
``queue.*.full``).

Delivery follows NOTIFY's rules: only to sessions listening when the event is
published, after the publishing transaction commits, in order; nothing is
replayed. This is the one implementation; the monitor uses it.
"""

from __future__ import annotations

import fnmatch
import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Self

import psycopg
from psycopg import sql

from ..driver import QUERIES as _Q
from ..driver import compose
from ..driver.errors import DatabaseUnavailable, SessionClosed, redact_dsn, scrub_exception
from ..driver.pg import connect, run

CHANNEL: Final = "ringq_events"
MAX_PAYLOAD: Final = 7900  # NOTIFY payloads must stay under 8000 bytes

_LISTEN: Final = compose(_Q["listen_events"], channel=sql.Identifier(CHANNEL))
_NOTIFY: Final = _Q["notify_event"]


@dataclass(frozen=True)
class Event:
    """One named event.

    ``name`` (e.g. ``queue.orders.full``), the ``queue`` it concerns (or
    None), the publication time ``t`` (unix seconds, 0.0 if the publisher
    gave none), the other fields in ``data``, and ``received_at`` (unix
    seconds, set by the subscriber; 0.0 on an event not received).
    """

    name: str
    data: dict[str, Any] = field(default_factory=dict)
    queue: str | None = None
    t: float = 0.0
    received_at: float = 0.0

    @classmethod
    def make(cls, name: str, queue: str | None = None, **data: Any) -> Event:
        """An event to publish now (``t`` is the current time)."""
        return cls(name, data, queue, time.time())

    @classmethod
    def from_payload(cls, payload: str, *, received_at: float = 0.0) -> Event:
        """Parse a NOTIFY payload; :raises ValueError: it is not an event."""
        obj = json.loads(payload)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("not a ringq event")
        name = obj.pop("name")
        queue = obj.pop("queue", None)
        try:
            t = float(obj.pop("t", 0.0))
        except (TypeError, ValueError):
            t = 0.0
        return cls(name, obj, queue if isinstance(queue, str) else None, t, received_at)

    def payload(self) -> str:
        """The JSON text published (long field values are cut to fit NOTIFY's limit)."""
        body: dict[str, Any] = {**self.data, "name": self.name, "queue": self.queue, "t": self.t}
        text = json.dumps(body, separators=(",", ":"), default=str)
        if len(text.encode()) > MAX_PAYLOAD:
            body = {"name": self.name, "queue": self.queue, "t": self.t, "truncated": True}
            text = json.dumps(body, separators=(",", ":"))
        return text


def publish(conn: psycopg.Connection[Any], event: Event | str, **data: Any) -> None:
    """NOTIFY ``event`` on ``conn``: delivered when its transaction commits.

    ``event`` is an :class:`Event`, or a name whose event is made now from
    ``data`` (a ``queue`` keyword fills :attr:`Event.queue`).

    :raises psycopg.Error: the caller converts it (sessions do).
    """
    if isinstance(event, str):
        queue = data.pop("queue", None)
        event = Event.make(event, queue if isinstance(queue, str) else None, **data)
    elif data:
        raise TypeError("publish(conn, Event) takes no extra fields")
    conn.execute(_NOTIFY, (CHANNEL, event.payload()))


class Subscription:
    """Events whose name matches any of ``patterns``, on a LISTEN connection of its own.

    Iterate it (blocks until the next matching event), or call :meth:`get`
    with a timeout. ``close()`` is idempotent; it is also a context manager.
    Notifications that arrive together (one network read may carry many,
    e.g. several events committed in one transaction) are all kept, in order.

    :raises ValueError: no pattern given.
    :raises DatabaseUnavailable: the database cannot be reached.
    """

    def __init__(
        self, dsn: str, patterns: str | tuple[str, ...], *, connect_timeout: float = 10.0
    ) -> None:
        if isinstance(patterns, str):
            patterns = (patterns,)
        if not patterns:
            raise ValueError("subscribe to at least one pattern")
        self.patterns: tuple[str, ...] = patterns
        self._dsn = dsn
        self._pending: deque[Event] = deque()
        self._closed = False
        self._conn: psycopg.Connection[Any] = connect(
            dsn, connect_timeout=connect_timeout, application_name="ringq-subscriber"
        )
        try:
            # LISTEN has taken effect when this returns: later events reach us.
            run(self._conn, _LISTEN, dsn=dsn)
        except BaseException:
            self._conn.close()
            raise

    def matches(self, name: str) -> bool:
        """Whether ``name`` matches one of the subscription's patterns."""
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def get(self, timeout: float | None = None) -> Event | None:
        """The next matching event, or None after ``timeout`` seconds (None: wait forever).

        :raises DatabaseUnavailable: the connection was lost.
        :raises SessionClosed: the subscription is closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                # Still look once, without waiting: get(0) polls.
                self._receive(0.0)
                break
            self._receive(remaining)
        return self._pending.popleft() if self._pending else None

    def _receive(self, timeout: float | None) -> None:
        if self._closed:
            raise SessionClosed("the subscription is closed")
        try:
            # Run the generator to its end, never return from inside it: the
            # notifications of one packet are handed over together, and
            # leaving early would drop the rest of the batch.
            for n in self._conn.notifies(timeout=timeout, stop_after=1):
                try:
                    event = Event.from_payload(n.payload, received_at=time.time())
                except ValueError:
                    continue
                if self.matches(event.name):
                    self._pending.append(event)
        except psycopg.OperationalError as exc:
            scrub_exception(exc, self._dsn)  # it is the cause: printed with the traceback
            lost = DatabaseUnavailable(
                f"event subscription to {redact_dsn(self._dsn)} lost its connection: {exc}"
            )
            scrub_exception(lost, self._dsn)
            raise lost from exc

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.get()
            if event is not None:
                yield event

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        self._conn.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def subscribe(dsn: str, *patterns: str) -> Subscription:
    """Listen for events whose name matches any of ``patterns`` (default: all).

    ``subscribe(dsn, "queue.*.full")`` receives every queue's full events;
    ``"queue.orders.*"`` every event of queue ``orders``.

    :raises DatabaseUnavailable: the database cannot be reached.
    """
    return Subscription(dsn, patterns or ("*",))
