"""Operations a session holds in flight, and the row states that decide them.

A queue row's ``state`` and a ``tpc_log`` row's ``kind`` are stored as small
codes (see scripting/ddl.sql); these enums name them. Their values are the
stored ones and never change.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, NamedTuple

# the reason recorded with an entry moved to ringq.exceptions
POISON_REASON = "max deliveries reached"

if TYPE_CHECKING:
    from ._queue_info import QueueInfo
    from ._ring import Ring


class RowState(IntEnum):
    """``state`` of a queue table row."""

    FREE = 0  # never written, or withdrawn (void): holds no entry
    QUEUED = 1  # holds a committed entry not yet consumed
    CONSUMED = 2  # its entry was dequeued and the dequeue committed (or it was poisoned)


class OpKind(StrEnum):
    """What a session does to a slot (stored as ``tpc_log.kind``)."""

    ENQUEUE = "e"  # the slot is reserved for a new entry
    DEQUEUE = "d"  # the slot's entry is locked for consumption


class RowWrite(NamedTuple):
    """An enqueue's row write, kept in the session until commit (or
    ``flush()``) sends it: the entry's payload, its producer and producer
    sequence (as they were at the enqueue call), and its group (None: none).
    (A named tuple: a batch makes one per entry, at a third of a frozen
    dataclass's cost.)"""

    payload: bytes
    producer_seq: int
    producer: str
    group: str | None = None


class DueWrite(NamedTuple):
    """The row write of an enqueue that falls due later: :class:`RowWrite`'s
    fields, and ``delay`` seconds after the write (the database's clock) or
    ``not_before``. (A type of its own: two more fields in every RowWrite
    cost 0.1 us per entry of a batch that has no delay.)"""

    payload: bytes
    producer_seq: int
    producer: str
    group: str | None
    delay: float | None
    not_before: datetime | None


Write = RowWrite | DueWrite


@dataclass(slots=True)
class Op:
    """One slot in flight: reserved for an enqueue or locked for a dequeue.

    Fixed once made, except ``latency_ns``: the call's latency (ns), filled in
    once its statement has answered (0 until then, and for ops that recovery
    rebuilds); ``write``: an enqueue's row write while the session still
    holds it (None once sent, and for every other op), then ``fill``: the
    same, sent, kept for the payload cache until the commit is finished;
    and ``consume``: a dequeue served from the payload cache whose consuming
    row write the session still holds (sent with the commit); ``enq_us``: a
    dequeue's entry's enqueue time (its row's ``enq_at``, us since the epoch),
    set where its message is made, for the wait its commit records (0:
    unknown, nothing recorded: ops recovery rebuilds, rows found stale);
    ``due_us``: when the entry falls due (the database's clock, us since the
    epoch; 0: at once), from the row write's answer (an enqueue) or the
    strike's (a dequeue given back with a backoff), for the section.
    """

    ring: Ring
    info: QueueInfo
    slot: int
    seq: int
    kind: OpKind
    latency_ns: int = 0
    write: Write | None = None
    fill: Write | None = None
    consume: bool = False
    enq_us: int = 0
    due_us: int = 0

    @property
    def held(self) -> bool:
        """Whether the session still holds this op's row write (not sent yet)."""
        return self.write is not None or self.consume

    def committed_in(self, state: int, row_seq: int) -> bool:
        """Whether the row (its ``state`` and ``seq``) shows this op committed:
        an enqueue iff the row holds its sequence (queued or consumed), a
        dequeue iff the row is consumed."""
        if row_seq != self.seq:
            return False
        if self.kind == OpKind.ENQUEUE:
            return state in (RowState.QUEUED, RowState.CONSUMED)
        return state == RowState.CONSUMED
