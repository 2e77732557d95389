"""The message a dequeue returns, from its row or from the payload cache."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, tzinfo
from operator import itemgetter
from typing import Any

from ..ring import Cached

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_new = tuple.__new__


class Message(tuple[Any, ...]):
    """An entry taken from a queue; consumed only if the transaction commits.

    ``deliveries`` counts this delivery: 1 the first time, more if earlier
    deliveries were rolled back (so the consumer can check idempotency).
    ``group`` is the group it was enqueued in (None: none): entries of a
    group are delivered in order, one held at a time. ``trace`` is the W3C
    ``traceparent`` of the span that enqueued it (None: none; see the
    ``otel`` extra), not part of the payload and not compared.

    Immutable and compared by value (with messages only). A message served
    from the payload cache keeps its enqueue time as the integer the cache
    holds and makes the ``enqueued_at`` datetime when it is read: a batch
    pays for none it does not read. (A tuple underneath: made in a fraction
    of a dataclass's time, which counts at 100 messages a call.)
    """

    __slots__ = ()

    def __new__(
        cls,
        queue: str,
        seq: int,
        payload: bytes,
        producer: str,
        producer_seq: int,
        enqueued_at: datetime,
        deliveries: int,
        group: str | None = None,
        trace: str | None = None,
    ) -> Message:
        return _new(cls, (queue, seq, payload, producer, producer_seq, deliveries, group,
                          enqueued_at, 0, None, trace))

    queue: str = property(itemgetter(0))  # type: ignore[assignment]
    seq: int = property(itemgetter(1))  # type: ignore[assignment]
    payload: bytes = property(itemgetter(2))  # type: ignore[assignment]
    producer: str = property(itemgetter(3))  # type: ignore[assignment]
    producer_seq: int = property(itemgetter(4))  # type: ignore[assignment]
    deliveries: int = property(itemgetter(5))  # type: ignore[assignment]
    group: str | None = property(itemgetter(6))  # type: ignore[assignment]
    trace: str | None = property(itemgetter(10))  # type: ignore[assignment]

    @property
    def enqueued_at(self) -> datetime:
        """When the entry's transaction wrote it (the row's time; in the
        connection's time zone for a dequeued entry)."""
        at: datetime | None = self[7]
        if at is None:
            tz: tzinfo = self[9]
            return (_EPOCH + timedelta(microseconds=self[8])).astimezone(tz)
        return at

    @property
    def redelivered(self) -> bool:
        return self.deliveries > 1

    def _key(self) -> tuple[Any, ...]:
        return (self[0], self[1], self[2], self[3], self[4], self[5], self[6], self.enqueued_at)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._key() == other._key()

    def __ne__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._key() != other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"Message(queue={self.queue!r}, seq={self.seq!r}, payload={self.payload!r}, "
            f"producer={self.producer!r}, producer_seq={self.producer_seq!r}, "
            f"enqueued_at={self.enqueued_at!r}, deliveries={self.deliveries!r}, "
            f"group={self.group!r}"
            + ("" if self[10] is None else f", trace={self[10]!r}") + ")"
        )

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self[0], self[1], self[2], self[3], self[4], self.enqueued_at, self[5], self[6],
                self[10])


def cached_message(queue: str, seq: int, cached: Cached, tz: tzinfo) -> Message:
    """The message of a cache hit: a first delivery (a dequeue that does not
    commit clears its slot's record, so redeliveries read the row); its
    enqueue time in ``tz``, the connection's time zone, as a row read gives it.
    (No trace: an entry that carries one is not cached.)"""
    payload, producer, pseq, enq_at_us, group = cached
    return _new(Message, (queue, seq, payload, producer, pseq, 1, group, None, enq_at_us, tz,
                          None))


def cached_messages(
    queue: str, seqs: list[int], cached: list[Cached | None], tz: tzinfo
) -> list[Message]:
    """:func:`cached_message` of each hit of a batch (None: not a hit, left out)."""
    return [
        _new(Message, (queue, seq, c[0], c[1], c[2], 1, c[4], None, c[3], tz, None))
        for seq, c in zip(seqs, cached, strict=True)
        if c is not None
    ]
