"""A queue's settings, as stored in the management table ``ringq.queues``."""

from __future__ import annotations

from dataclasses import dataclass

# Seconds a session may hold a dequeued entry without committing before the
# monitor ends it (the entry comes back, counted as a delivery); 0: no lease.
DEFAULT_LEASE = 300.0


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
    # seconds; 0: none. No default: QueueDetails (ringq.scripting) adds fields
    # without defaults after these. Read as DEFAULT_LEASE from a schema that
    # predates the column.
    lease: float
    # payload bytes cached in the global section per slot (0: none); 0 from a
    # schema that predates the column.
    cache_payload: int
