"""Operations a session holds in flight: one slot (:class:`Op`) or a batch's
slots of one queue (:class:`Run`), each with its ring and its queue's settings.
The row states that decide them, and their row writes, are :mod:`._kinds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._kinds import DueWrite, OpKind, RowState, RowWrite, Write
from ._queue_info import QueueInfo
from ._ring import Ring
from ._scan import SMALL_BATCH


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


@dataclass(slots=True, eq=False)
class Run:
    """A batch's slots of one kind in one queue, in flight together: what an
    ``enqueue_many`` (entries due at once) or a ``dequeue_many`` served
    wholly from the payload cache holds, as arrays instead of an :class:`Op`
    per entry. A commit that succeeds sends its row write and finishes it
    as arrays; everything else (a rollback, a failed or lost commit,
    two-phase commit, recovery, a trace) works on its :meth:`ops`.

    ``slots`` and ``seqs`` are int64 arrays; ``latency_ns`` the batch's call
    latency per entry. An enqueue run has its ``payloads``, ``producer``, the
    first entry's producer sequence ``pseq0`` (the i-th has ``pseq0 + i``),
    ``groups`` (None: no groups) and the ``trace`` context they all carry
    (None: none; then not cached); ``sent`` once its row write has gone
    (the payloads are then kept for the payload cache until the commit is
    finished). A dequeue run has its entries' enqueue times ``enq_us`` (us
    since the epoch) and ``consume`` while the session still holds its
    consuming row write.
    """

    ring: Ring
    info: QueueInfo
    kind: OpKind
    slots: np.ndarray
    seqs: np.ndarray
    latency_ns: int
    payloads: list[bytes] | None = None
    producer: str = ""
    pseq0: int = 0
    groups: list[str | None] | None = None
    sent: bool = False
    consume: bool = False
    enq_us: np.ndarray | None = None
    trace: str | None = None

    @property
    def held(self) -> bool:
        """Whether the session still holds this run's row write (not sent yet)."""
        return (self.kind is OpKind.ENQUEUE and not self.sent) or self.consume

    def __len__(self) -> int:
        return len(self.slots)

    def span(self) -> tuple[int, int, int] | None:
        """:func:`stretch` of the run's slots and seqs."""
        return stretch(self.slots, self.seqs)

    def ops(self) -> list[Op]:
        """The run as one :class:`Op` per entry, in the same state."""
        ring, info, kind, lat = self.ring, self.info, self.kind, self.latency_ns
        slots, seqs = self.slots.tolist(), self.seqs.tolist()
        if kind is OpKind.ENQUEUE:
            assert self.payloads is not None
            groups = self.groups or [None] * len(slots)
            out = []
            for i, (slot, seq, payload, group) in enumerate(
                zip(slots, seqs, self.payloads, groups, strict=True)
            ):
                w: Write = (
                    RowWrite(payload, self.pseq0 + i, self.producer, group)
                    if self.trace is None
                    else DueWrite(payload, self.pseq0 + i, self.producer, group, None, None,
                                  self.trace)
                )
                out.append(Op(ring, info, slot, seq, kind, lat,
                              None if self.sent else w, w if self.sent else None))
            return out
        enq = [0] * len(slots) if self.enq_us is None else self.enq_us.tolist()
        return [
            Op(ring, info, slot, seq, kind, lat, None, None, self.consume, e)
            for slot, seq, e in zip(slots, seqs, enq, strict=True)
        ]


Item = Op | Run  # what a session holds in flight


def stretch(slots: np.ndarray, seqs: np.ndarray) -> tuple[int, int, int] | None:
    """(first slot, how many, seq - slot) if ``slots`` (int64, distinct, not
    empty) are one stretch of consecutive slots whose seqs are each the slot
    plus one offset (a batch claimed in one stretch: ``consume_span``'s and
    ``dequeue_span``'s range); None otherwise."""
    n = len(slots)
    if n <= SMALL_BATCH:  # plain ints (see SMALL_BATCH)
        xs, ys = slots.tolist(), seqs.tolist()
        lo = min(xs)
        if max(xs) - lo != n - 1:
            return None
        first = ys[0] - xs[0]
        for x, y in zip(xs, ys, strict=True):
            if y - x != first:
                return None
        return lo, n, first
    lo = int(slots.min())
    if int(slots.max()) - lo != n - 1:  # distinct slots: n of them in a range of n
        return None
    offset = seqs - slots
    first = int(offset[0])
    if not (offset == first).all():
        return None
    return lo, n, first


def each_op(items: Sequence[Item]) -> list[Op]:
    """``items`` with every :class:`Run` as its ops (the per-entry paths)."""
    out: list[Op] = []
    for i in items:
        if isinstance(i, Op):
            out.append(i)
        else:
            out.extend(i.ops())
    return out


def entries(items: Sequence[Item]) -> int:
    """How many entries ``items`` hold."""
    return sum(1 if isinstance(i, Op) else len(i) for i in items)
