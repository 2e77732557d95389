"""Per-queue performance samples, computed from deltas of the section's counters.

Every key the HTTP API, the T4 files and the viewer use is a constant of
:mod:`ringq.engine.metrics` (the section's own counter names are there too);
this module names the ones its callers use.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from ringq.engine import Section
from ringq.engine import layout as L
from ringq.engine import metrics as M
from ringq.engine.metrics import (
    CAPACITY,
    COMMITS,
    DEAD_ROWS,
    DEPTH,
    DEQ_P50,
    DEQ_P99,
    DEQ_RATE,
    EMPTY,
    ENQ_P50,
    ENQ_P99,
    ENQ_RATE,
    EXCEPTIONS,
    FULL,
    HEAD,
    POISONED,
    RETRIES,
    ROLLBACKS,
    TAIL,
    WAIT_KEYS,
    WAIT_P50,
    WAIT_P95,
    WAIT_P99,
    WAIT_READY,
    WAIT_SPACE,
)

NAME: Final = M.NAME
T: Final = M.T
NUMERIC_KEYS: Final = M.SAMPLE_KEYS  # numeric: also the T4 columns and the history point keys
QUEUE_KEYS: Final = (NAME, *NUMERIC_KEYS)  # one queue in /api/queues, in this order
DUE_KEYS: Final = M.DUE_KEYS  # after them, for every queue (entries that wait: M.due_figures)
GROUP_KEYS: Final = M.GROUP_KEYS  # after them, for a grouped queue only (monitor/_groups.py)


@dataclass
class _Snap:
    """Raw counters of one queue block at one instant."""

    mono_ns: int
    ident: tuple[int, int, int]  # (qid, loaded_ns, section generation): a reload resets deltas
    stats: dict[str, int]
    enq_hist: np.ndarray
    deq_hist: np.ndarray
    full_cum_ns: int  # closed full periods + the open one so far
    wait_hist: np.ndarray  # consumed entries' enqueue-to-commit waits (M.wait_histogram)


def snapshot(sec: Section, qidx: int, now_ns: int) -> _Snap:
    enq, deq = M.latency_histograms(sec, qidx)
    stats = M.queue_stats(sec, qidx)
    since = sec.q(qidx, L.Q_FULL_SINCE_NS)
    full_cum = stats[M.FULL_NS] + (max(0, now_ns - since) if since else 0)
    ident = (sec.q(qidx, L.Q_QID), sec.q(qidx, L.Q_LOADED_NS), int(sec.generation))
    return _Snap(
        now_ns, ident, stats, np.array(enq, dtype=np.int64), np.array(deq, dtype=np.int64),
        full_cum, np.array(M.wait_histogram(sec, qidx), dtype=np.int64),
    )


def _pct(hist: np.ndarray, q: float) -> float:
    return M.percentile_us([int(x) for x in hist], q)


def compute(
    name: str,
    prev: _Snap | None,
    cur: _Snap,
    *,
    t: float,
    empty_s: float,
    full_s: float = 0.0,
    exceptions: int,
    dead_rows: int,
) -> dict[str, float | str]:
    """One sample of ``name`` over the interval between ``prev`` and ``cur``.

    Without a comparable ``prev`` (first sample, or the queue was reloaded)
    the interval quantities are 0.
    """
    s = cur.stats
    out: dict[str, float | str] = {
        NAME: name,
        T: round(t, 3),
        CAPACITY: s[M.CAPACITY],
        DEPTH: max(0, s[M.DEPTH]),
        HEAD: s[M.HEAD],
        TAIL: s[M.TAIL],
        WAIT_READY: max(0, s[M.WAIT_READY]),
        WAIT_SPACE: max(0, s[M.WAIT_SPACE]),
        EXCEPTIONS: exceptions,
        DEAD_ROWS: dead_rows,
    }
    if prev is None or prev.ident != cur.ident or cur.mono_ns <= prev.mono_ns:
        out.update({k: 0.0 for k in (ENQ_RATE, DEQ_RATE, ENQ_P50, ENQ_P99, DEQ_P50, DEQ_P99, FULL,
                                      RETRIES, COMMITS, ROLLBACKS, POISONED, *WAIT_KEYS)})
        out[EMPTY] = 0.0
        return out
    dt = (cur.mono_ns - prev.mono_ns) / 1e9
    p = prev.stats

    def d(key: str) -> int:
        return max(0, s[key] - p[key])  # a counter never runs backwards within one load

    enq_h = np.maximum(cur.enq_hist - prev.enq_hist, 0)
    deq_h = np.maximum(cur.deq_hist - prev.deq_hist, 0)
    out[ENQ_RATE] = round(d(M.ENQ_COMMITS) / dt, 3)
    out[DEQ_RATE] = round(d(M.DEQ_COMMITS) / dt, 3)
    out[ENQ_P50] = _pct(enq_h, 0.50)
    out[ENQ_P99] = _pct(enq_h, 0.99)
    out[DEQ_P50] = _pct(deq_h, 0.50)
    out[DEQ_P99] = _pct(deq_h, 0.99)
    wait_h = np.maximum(cur.wait_hist - prev.wait_hist, 0)
    out[WAIT_P50] = _pct(wait_h, 0.50)
    out[WAIT_P95] = _pct(wait_h, 0.95)
    out[WAIT_P99] = _pct(wait_h, 0.99)
    # Enqueuers time the full periods they meet (exact); the monitor's passes
    # catch the ones nobody met. The larger of the two.
    blocked = max(0, cur.full_cum_ns - prev.full_cum_ns) / 1e9
    out[FULL] = round(min(dt, max(blocked, full_s)), 3)
    out[EMPTY] = round(min(dt, empty_s), 3)
    out[RETRIES] = d(M.DEQ_ROLLBACKS)
    out[COMMITS] = d(M.ENQ_COMMITS) + d(M.DEQ_COMMITS)
    out[ROLLBACKS] = d(M.ENQ_ROLLBACKS) + d(M.DEQ_ROLLBACKS)
    out[POISONED] = d(M.POISONED)
    return out


class Series:
    """A bounded time series of one queue's samples (numpy ring, grown on demand)."""

    _FIRST = 1024

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self._data = np.zeros((min(self._FIRST, max_points), len(NUMERIC_KEYS)), dtype=np.float64)
        self._n = 0  # points stored
        self._next = 0  # row the next point goes to

    def __len__(self) -> int:
        return self._n

    def append(self, sample: dict[str, float | str]) -> None:
        rows = self._data.shape[0]
        if self._n == rows and rows < self.max_points:
            grown = np.zeros((min(rows * 2, self.max_points), len(NUMERIC_KEYS)), dtype=np.float64)
            grown[:rows] = self._data  # not wrapped yet: still in time order
            self._data = grown
            rows = grown.shape[0]
        self._data[self._next] = [float(sample[k]) for k in NUMERIC_KEYS]
        self._next = (self._next + 1) % rows
        self._n = min(self._n + 1, rows)

    def since(
        self, t0: float, t1: float = float("inf"), limit: int | None = None
    ) -> list[dict[str, float]]:
        """Points with ``t0 < t <= t1``, oldest first (the newest ``limit`` if given)."""
        sel = self.rows(t0, t1)
        if limit is not None and len(sel) > limit:
            sel = sel[-limit:]
        return points(sel)

    def rows(self, t0: float, t1: float = float("inf")) -> np.ndarray:
        """Rows (a copy) with ``t0 < t <= t1``, oldest first; columns as :data:`NUMERIC_KEYS`."""
        rows = self._data.shape[0]
        if self._n < rows:
            ordered = self._data[: self._n]
        else:
            ordered = np.concatenate([self._data[self._next :], self._data[: self._next]])
        times = ordered[:, 0]
        return ordered[(times > t0) & (times <= t1)]

    def first_t(self) -> float | None:
        """The oldest point's time (None while empty)."""
        if self._n == 0:
            return None
        oldest = 0 if self._n < self._data.shape[0] else self._next
        return float(self._data[oldest, 0])


def points(rows: np.ndarray) -> list[dict[str, float]]:
    """Rows (columns as :data:`NUMERIC_KEYS`) as the API's points (whole numbers as int)."""
    if not len(rows):
        return []
    # Column by column (a day is 86,400 rows): a column of whole numbers at once.
    whole = (rows == np.floor(rows)) & (np.abs(rows) < 2**53)
    cols: list[list[Any]] = []
    for j in range(rows.shape[1]):
        col = rows[:, j]
        if whole[:, j].all():
            cols.append(col.astype(np.int64).tolist())
        elif not whole[:, j].any():
            cols.append(col.tolist())
        else:
            cols.append([_num(x) for x in col.tolist()])
    return [dict(zip(NUMERIC_KEYS, vals, strict=True)) for vals in zip(*cols, strict=True)]


def _num(x: float) -> float:
    # Counts go out as integers, so JSON shows 12 rather than 12.0.
    x = float(x)
    return int(x) if x.is_integer() and abs(x) < 2**53 else x


class History:
    """Every queue's series, safe to read from the HTTP threads."""

    def __init__(self, max_points: int) -> None:
        self.max_points = max_points
        self._lock = threading.Lock()
        self._series: dict[str, Series] = {}

    def add(self, sample: dict[str, float | str]) -> None:
        name = str(sample[NAME])
        with self._lock:
            series = self._series.get(name)
            if series is None:
                series = self._series[name] = Series(self.max_points)
            series.append(sample)

    def query(
        self, name: str, t0: float, t1: float = float("inf"), limit: int | None = None
    ) -> list[dict[str, float]] | None:
        """Points of queue ``name`` (None if it was never sampled)."""
        with self._lock:
            series = self._series.get(name)
            if series is None:
                return None
            return series.since(t0, t1, limit)

    def rows(
        self, name: str, t0: float, t1: float = float("inf")
    ) -> tuple[np.ndarray, float] | None:
        """Rows of queue ``name`` with ``t0 < t <= t1`` and the time of the oldest
        point held (what precedes it is only in the T4 files); None if never sampled."""
        with self._lock:
            series = self._series.get(name)
            first = None if series is None else series.first_t()
            if series is None or first is None:
                return None
            return series.rows(t0, t1), first

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._series)


def now_ns() -> int:
    return time.monotonic_ns()
