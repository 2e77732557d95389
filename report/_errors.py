"""The report's errors (in ringq's one tree)."""

from __future__ import annotations

from ringq.engine import RingqError


class NoData(RingqError):
    """Nothing to draw: the period holds no sample and no event, or the named run
    has no report in the directory (``ringq report`` exits 4, not found)."""
