"""ringq.move: moving entries between databases exactly once, and exactly-once effects.

A :class:`Mover` dequeues from a queue in one database and enqueues in a
queue of another, committing the destination first and the source after,
with an idempotency key per entry (:func:`move_key`): nothing is lost and
nothing arrives twice, without two-phase commit. A moved payload travels in
an envelope (:func:`wrap`, :func:`unwrap`, :class:`Moved`)::

    from ringq.move import Mover

    with Mover(src_dsn, "orders", dst_dsn, "orders") as mover:
        mover.run(stop_event)

:func:`already_applied` records, in a consumer's own transaction, which
entries it applied (``ringq.applied``), so that a second delivery is
recognized whatever road it took.
"""

from ._applied import already_applied, applied_identity, create_applied_table
from ._mover import (
    MoveConfig,
    Moved,
    MoveIntoItself,
    MoveLockHeld,
    Mover,
    MoveSourceShared,
    MoveWontFit,
    envelope_overhead,
    is_moved,
    move_key,
    unwrap,
    wrap,
)

__all__ = [
    "MoveConfig",
    "MoveIntoItself",
    "MoveLockHeld",
    "MoveSourceShared",
    "MoveWontFit",
    "Moved",
    "Mover",
    "already_applied",
    "applied_identity",
    "create_applied_table",
    "envelope_overhead",
    "is_moved",
    "move_key",
    "unwrap",
    "wrap",
]
