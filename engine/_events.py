"""Named events (as RTR's named broadcasts) over PostgreSQL NOTIFY.

The monitor publishes ``queue.<name>.full``, ``queue.<name>.empty``,
``queue.<name>.high_water``, ``consumer.died`` and ``entry.poisoned`` on the
channel ``ringq_events`` with a JSON payload ``{"name": ..., ...}``; a program
subscribes by name with shell-style wildcards (``queue.*.full``).
"""

from __future__ import annotations

import fnmatch
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg

from ._errors import from_psycopg

CHANNEL = "ringq_events"
MAX_PAYLOAD = 7900  # NOTIFY payloads must stay under 8000 bytes


@dataclass(frozen=True)
class Event:
    """One named event: ``name`` (e.g. ``queue.orders.full``) and its data."""

    name: str
    data: dict[str, Any] = field(default_factory=dict)
    received_at: float = 0.0


def publish(conn: psycopg.Connection[Any], name: str, **data: Any) -> None:
    """Publish an event on ``conn`` (delivered when its transaction commits)."""
    body = json.dumps({"name": name, **data}, default=str)
    if len(body.encode()) > MAX_PAYLOAD:
        body = json.dumps({"name": name, "truncated": True})
    conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, body))


class Subscription:
    """Events whose name matches any of ``patterns``, on a connection of its own.

    Iterate (blocks), or call :meth:`get` with a timeout. ``close()`` is idempotent.
    """

    def __init__(self, dsn: str, patterns: tuple[str, ...]) -> None:
        if not patterns:
            raise ValueError("subscribe to at least one pattern")
        self.patterns = patterns
        try:
            self._conn: psycopg.Connection[Any] | None = psycopg.connect(dsn, autocommit=True)
            self._conn.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error as exc:
            raise from_psycopg(exc, dsn=dsn) from exc

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def get(self, timeout: float | None = None) -> Event | None:
        """The next matching event, or None after ``timeout`` seconds."""
        if self._conn is None:
            raise ValueError("subscription closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            for n in self._conn.notifies(timeout=remaining, stop_after=1):
                event = _parse(n.payload)
                if event is not None and self.matches(event.name):
                    return event
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.get()
            if event is not None:
                yield event

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse(payload: str) -> Event | None:
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    name = data.pop("name")
    return Event(name, data, time.time())
