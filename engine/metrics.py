"""Metric names, public: one place, read by the engine, the monitor and the
viewer::

    from ringq.engine import metrics as M

    stats = M.queue_stats(section, qidx)   # {M.DEPTH: ..., M.ENQ_COMMITS: ...}

The definitions (and their comments) are in ``ringq/engine/section/_metrics.py``:
the names of the section's counters belong to the section layer, which the
session's ``stats()`` reads too.
"""

from __future__ import annotations

from .section.metrics import *  # noqa: F403 - every public name of the metrics, nothing else
