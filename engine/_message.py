"""The message a dequeue returns, from its row or from the payload cache."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo

from ._ring import Cached

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Message:
    """An entry taken from a queue; consumed only if the transaction commits.

    ``deliveries`` counts this delivery: 1 the first time, more if earlier
    deliveries were rolled back (so the consumer can check idempotency).
    ``group`` is the group it was enqueued in (None: none): entries of a
    group are delivered in order, one held at a time.
    """

    queue: str
    seq: int
    payload: bytes
    producer: str
    producer_seq: int
    enqueued_at: datetime
    deliveries: int
    group: str | None = None

    @property
    def redelivered(self) -> bool:
        return self.deliveries > 1


def cached_message(queue: str, seq: int, cached: Cached, tz: tzinfo) -> Message:
    """The message of a cache hit: a first delivery (a dequeue that does not
    commit clears its slot's record, so redeliveries read the row); its
    enqueue time in ``tz``, the connection's time zone, as a row read gives it."""
    payload, producer, pseq, enq_at_us, group = cached
    enq_at = (_EPOCH + timedelta(microseconds=enq_at_us)).astimezone(tz)
    return Message(queue, seq, payload, producer, pseq, enq_at, 1, group)
