"""A queue's settings, as stored in the management table ``ringq.queues``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QueueInfo:
    """A queue's settings, as stored in ``ringq.queues``."""

    id: int
    name: str
    capacity: int
    max_payload: int
    full_policy: str
    full_timeout: float
    dequeue_mode: str
    max_deliveries: int
    exception_queue: str | None
