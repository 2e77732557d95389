"""The monitor's named events, published through the engine's events.

The channel, the payload and the subscription are the engine's
(exported as ``ringq.engine.Event``,
``Subscription``, ``subscribe``, ``publish``); this module only names what
the monitor publishes:

- ``queue.<name>.full`` — no free slot left in the ring;
- ``queue.<name>.empty`` — the last ready entry was taken;
- ``queue.<name>.high_water`` — depth reached the high-water mark (80% of capacity);
- ``consumer.died`` — a dead client's slots were recovered (``pid``, ``slots``, ``queues``);
- ``entry.poisoned`` — an entry moved to the exception table (``seq``, ``deliveries``, ``reason``,
  ``group``: its group, None if none, which goes on without it);
- ``entry.lease_expired`` — a session held a dequeued entry past its queue's lease: its
  backend was terminated and its entries came back (``pid``, ``backend_pid``, ``held_s``,
  ``lease_s``, ``queues``, ``slots``);
- ``database.snapshot_held`` — a transaction has held back the xmin horizon past the
  monitor's ``xmin_warn_s`` (``pid``, ``application``, ``user``, ``state``, ``age_s`` …);
- ``database.snapshot_released`` — it ended; the ring tables that gained dead rows were
  vacuumed (``held_s``, ``vacuumed``).

A program subscribes with a shell-style wildcard: ``subscribe(dsn, "queue.*.full")``.
"""

from __future__ import annotations

from typing import Any, Final

from ringq.engine import Event, Subscription, publish, subscribe

__all__ = [
    "CONSUMER_DIED",
    "ENTRY_LEASE_EXPIRED",
    "ENTRY_POISONED",
    "QUEUE_EMPTY",
    "QUEUE_FULL",
    "QUEUE_HIGH_WATER",
    "SNAPSHOT_HELD",
    "SNAPSHOT_RELEASED",
    "Event",
    "Subscription",
    "make_event",
    "publish",
    "queue_event",
    "subscribe",
]

QUEUE_FULL: Final = "full"
QUEUE_EMPTY: Final = "empty"
QUEUE_HIGH_WATER: Final = "high_water"
CONSUMER_DIED: Final = "consumer.died"
ENTRY_POISONED: Final = "entry.poisoned"
ENTRY_LEASE_EXPIRED: Final = "entry.lease_expired"
SNAPSHOT_HELD: Final = "database.snapshot_held"
SNAPSHOT_RELEASED: Final = "database.snapshot_released"


def queue_event(queue: str, what: str) -> str:
    """The name of a queue event: ``queue.<queue>.<what>``."""
    return f"queue.{queue}.{what}"


def make_event(name: str, queue: str | None = None, **data: Any) -> Event:
    """An event to publish now (``t`` is the current time)."""
    return Event.make(name, queue, **data)
