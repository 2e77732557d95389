"""The words every layer above the section shares about a slot's row: the
codes stored in the rows, and an enqueue's row write.

A queue row's ``state`` and a ``tpc_log`` row's ``kind`` are stored as small
codes (see scripting/ddl.sql); these enums name them. Their values are the
stored ones and never change.
"""

from __future__ import annotations

from datetime import datetime
from enum import IntEnum, StrEnum
from typing import NamedTuple

# the reason recorded with an entry moved to ringq.exceptions
POISON_REASON = "max deliveries reached"


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
    """The row write of an enqueue that falls due later, or carries a trace
    context: :class:`RowWrite`'s fields, and ``delay`` seconds after the
    write (the database's clock) or ``not_before`` (both None: due at once),
    and ``trace``, the W3C traceparent the entry carries (None: none; an
    entry that carries one is not put in the payload cache). (A type of its
    own: more fields in every RowWrite cost 0.1 us per entry of a batch that
    has neither.)"""

    payload: bytes
    producer_seq: int
    producer: str
    group: str | None
    delay: float | None
    not_before: datetime | None
    trace: str | None = None


Write = RowWrite | DueWrite
