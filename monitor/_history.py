"""What ``GET /api/history`` answers: the monitor's memory, older points from the T4 files, thinned.

Data access only (the HTTP module renders it). The memory holds what the
monitor sampled since it started; what precedes the oldest point in memory is
read from the T4 day files (today's and, as far as ``since`` reaches back,
earlier ones), so a restarted monitor still serves the day. The two are joined
at the memory's oldest point: a sample is in both (the T4 file and the memory
are written from the same sample), and each is taken once.

A long answer is thinned on request (``step`` seconds per bucket, or at most
``max_points`` points): each bucket gives, per key, the worst value (peaks of
depth, p99, retries, waiters), the mean (rates, full/empty seconds) or the last
value (positions), stamped with its last point's time so that a caller asking
``since=<that t>`` next gets the raw points that follow. The viewer
summarizes by the same rules (:data:`ringq.engine.metrics.BUCKET`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Final

import numpy as np
from ringq.engine import metrics as M

from . import _sample as S
from ._t4 import T4Reader

DAY: Final = 86_400.0
BUCKET: Final = M.BUCKET  # how a bucket sums up each key (t: the last point's time)
_RULES = [BUCKET[k] for k in S.NUMERIC_KEYS]
_MAX_COLS = [i for i, r in enumerate(_RULES) if r == M.MAX]
_MEAN_COLS = [i for i, r in enumerate(_RULES) if r == M.MEAN]
_LAST_COLS = [i for i, r in enumerate(_RULES) if r == M.LAST]
# Bucket widths, seconds: a thinned answer uses the smallest one wide enough,
# so buckets fall on round times and stay put from one request to the next.
NICE_STEPS: Final = (1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1800, 3600)


@dataclass(frozen=True)
class Answer:
    """The points of one queue, oldest first; ``step`` the bucket width in
    seconds (0: raw samples); ``from_files`` how many of the raw samples came
    from the T4 files."""

    points: list[dict[str, float]]
    step: float
    from_files: int


def nice_step(raw: float) -> float:
    """The smallest of :data:`NICE_STEPS` (then whole hours) not below ``raw`` seconds."""
    for s in NICE_STEPS:
        if s >= raw:
            return float(s)
    return float(math.ceil(raw / 3600.0) * 3600)


def downsample(
    rows: np.ndarray, step: float = 0.0, max_points: int | None = None
) -> tuple[np.ndarray, float]:
    """``rows`` (by time, columns as ``NUMERIC_KEYS``) in buckets of ``step``
    seconds on round times, widened so that at most ``max_points`` come out.
    Returns the rows and the step used (0.0 when the rows are returned as they are)."""
    n = len(rows)
    if n == 0 or (step <= 0 and (max_points is None or n <= max_points)):
        return rows, 0.0
    t = rows[:, 0]
    if max_points is not None and n > max_points:
        # k buckets on round times cover a span of at most (k - 1) * step + step:
        # a step of span / (max_points - 1) leaves at most max_points + 1; the clip below
        # makes it max_points.
        step = max(step, nice_step((t[-1] - t[0]) / max(1, max_points - 1)))
    idx = np.floor(t / step).astype(np.int64)
    idx -= idx[0]
    if max_points is not None:
        np.minimum(idx, max_points - 1, out=idx)
    starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
    if len(starts) == n:
        return rows, step
    ends = np.r_[starts[1:], n]
    out = np.empty((len(starts), rows.shape[1]))
    out[:, _MAX_COLS] = np.maximum.reduceat(rows[:, _MAX_COLS], starts, axis=0)
    out[:, _MEAN_COLS] = (
        np.add.reduceat(rows[:, _MEAN_COLS], starts, axis=0) / (ends - starts)[:, None]
    )
    out[:, _LAST_COLS] = rows[ends - 1][:, _LAST_COLS]
    return out, step


class HistoryReader:
    """Answers history requests from ``memory`` and, before it, ``t4`` (None: no files).

    ``reach`` (seconds) bounds how far back the files are read, whatever
    ``since`` says (the work of one request stays a couple of day files).
    """

    def __init__(self, memory: S.History, t4: T4Reader | None, reach: float = DAY) -> None:
        self.memory = memory
        self.t4 = t4
        self.reach = reach

    def query(
        self,
        queue: str,
        since: float,
        until: float = math.inf,
        limit: int | None = None,
        *,
        step: float = 0.0,
        max_points: int | None = None,
        now: float | None = None,
    ) -> Answer | None:
        """Points of ``queue`` with ``since < t <= until``, oldest first: at most
        ``limit`` (the newest), thinned per ``step``/``max_points``. None if the
        queue is neither in memory nor in the files."""
        held = self.memory.rows(queue, since, until)
        rows = held[0] if held is not None else np.empty((0, len(S.NUMERIC_KEYS)))
        older = np.empty((0, len(S.NUMERIC_KEYS)))
        in_files = False
        if self.t4 is not None:
            now = time.time() if now is None else now
            t0 = max(since, now - self.reach)
            t1 = until if held is None else min(until, float(np.nextafter(held[1], -math.inf)))
            if t1 > t0:
                older, in_files = self.t4.lookup(queue, t0, t1)
        if held is None and not in_files:
            return None  # never sampled (as far as the memory and the files reached know)
        if len(older):
            rows = np.concatenate([older, rows])
        rows, used = downsample(rows, step, max_points)
        if limit is not None and len(rows) > limit:
            rows = rows[-limit:]
        return Answer(S.points(rows), used, len(older))
