"""The charts, drawn by matplotlib into PNG bytes.

matplotlib is imported here, inside the functions, and only through its
object API (``Figure`` and the Agg canvas, never ``pyplot``): no display is
needed, no global state is kept between charts, and importing ``ringq.report``
(as the regression runner does) costs nothing until a page is drawn.

A time axis is unix seconds drawn as UTC wall time. Events are vertical lines
across the chart, one colour per kind, named in the legend once.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

WIDTH_IN, HEIGHT_IN, DPI = 10.0, 3.0, 96  # 960 x 288 pixels: readable in a mail client


@dataclass(frozen=True)
class Line:
    """One series: ``x`` unix seconds (or any number when the chart is not a
    time chart), ``y`` its values (NaN: no value, a gap in the line)."""

    label: str
    x: np.ndarray
    y: np.ndarray
    style: str = "-"


@dataclass(frozen=True)
class Mark:
    """An event on the time axis: when (unix seconds), its kind (legend and colour)."""

    t: float
    kind: str
    color: str


@dataclass
class TimeChart:
    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    log: bool = False  # log scale (latencies): zeros and gaps are left out
    time_axis: bool = True  # False: x is plain numbers (seconds since a start)
    xlabel: str = ""
    hline: tuple[str, float] | None = None  # (label, y): a limit, as capacity
    # True: each y holds over the interval that ends at its x (a count per sample
    # interval), drawn as a step, not a slope between two instants
    steps: bool = False


@dataclass
class BarChart:
    """Grouped bars: one group per ``groups`` entry, one bar per series in each."""

    title: str
    ylabel: str
    groups: list[str]
    series: dict[str, list[float]]
    log: bool = False


def draw(chart: TimeChart | BarChart) -> bytes:
    """The chart as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if isinstance(chart, TimeChart):
        _time_chart(ax, chart)
    else:
        _bar_chart(ax, chart)
    ax.set_title(chart.title, fontsize=10, loc="left")
    ax.grid(True, alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _time_chart(ax: Any, chart: TimeChart) -> None:
    drawn = False
    lo, hi = math.inf, -math.inf
    for line in chart.lines:
        x = np.asarray(line.x, dtype=np.float64)
        y = np.asarray(line.y, dtype=np.float64)
        if chart.log:
            y = np.where(y > 0, y, np.nan)
        if not len(x):
            continue
        lo, hi = min(lo, float(x[0])), max(hi, float(x[-1]))
        if not np.isfinite(y).any():
            continue
        (drawn_line,) = ax.plot(_xs(x, chart.time_axis), y, line.style, label=line.label,
                                linewidth=1.2, drawstyle="steps-pre" if chart.steps else "default")
        # A value between two gaps (sparse traffic: one sample with a latency)
        # is no segment: a line alone would not show it, a dot does.
        fin = np.isfinite(y)
        alone = fin & ~np.r_[False, fin[:-1]] & ~np.r_[fin[1:], False]
        if alone.any():
            ax.plot(_xs(x[alone], chart.time_axis), y[alone], ".", markersize=5,
                    color=drawn_line.get_color())
        drawn = True
    if chart.hline is not None:
        ax.axhline(chart.hline[1], color="grey", linestyle=":", linewidth=1, label=chart.hline[0])
    seen: set[str] = set()
    for m in chart.marks:
        lo, hi = min(lo, m.t), max(hi, m.t)
        ax.axvline(_xs(np.array([m.t]), chart.time_axis)[0], color=m.color, linewidth=1,
                   alpha=0.8, label=None if m.kind in seen else m.kind)
        seen.add(m.kind)
    if not math.isfinite(lo):
        ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", va="center")
        return
    if hi - lo < 1.0:  # one instant: give the axis some width (no singular limits)
        lo, hi = lo - 1.0, hi + 1.0
    ax.set_xlim(*_xs(np.array([lo, hi]), chart.time_axis))
    if chart.log:
        if drawn:
            ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    if not drawn:
        ax.text(0.5, 0.5, "nothing measured", transform=ax.transAxes, ha="center", va="center",
                color="grey")
    ax.set_ylabel(chart.ylabel, fontsize=9)
    if chart.time_axis:
        import matplotlib.dates as mdates

        locator = mdates.AutoDateLocator(tz=UTC)  # type: ignore[no-untyped-call]
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(
            mdates.ConciseDateFormatter(locator, tz=UTC)  # type: ignore[no-untyped-call]
        )
        ax.set_xlabel(chart.xlabel or "UTC", fontsize=9)
    elif chart.xlabel:
        ax.set_xlabel(chart.xlabel, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def _xs(x: np.ndarray, time_axis: bool) -> Any:
    if not time_axis:
        return x
    return [datetime.fromtimestamp(float(v), UTC) for v in x]


def _bar_chart(ax: Any, chart: BarChart) -> None:
    n = max(1, len(chart.series))
    width = 0.8 / n
    xs = np.arange(len(chart.groups), dtype=np.float64)
    positive = False
    for i, (label, values) in enumerate(chart.series.items()):
        vals = np.asarray(values, dtype=np.float64)
        positive = positive or bool((vals > 0).any())
        ax.bar(xs + (i - (n - 1) / 2) * width, vals, width, label=label)
    ax.set_xticks(xs, chart.groups, fontsize=8, rotation=20 if len(chart.groups) > 4 else 0)
    if chart.log and positive:
        ax.set_yscale("log")
    if not positive:
        ax.text(0.5, 0.5, "nothing measured", transform=ax.transAxes, ha="center", va="center",
                color="grey")
    ax.set_ylabel(chart.ylabel, fontsize=9)
    if chart.series:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


def thin(x: np.ndarray, ys: Sequence[np.ndarray], rules: Sequence[str], max_points: int = 1500
         ) -> tuple[np.ndarray, list[np.ndarray]]:
    """At most ``max_points`` points: consecutive buckets summed up per ``rules``
    (``ringq.engine.metrics`` MAX, MEAN or LAST, as the monitor thins its history),
    so a spike of one second stays visible on a day's chart."""
    from ringq.engine import metrics as M

    n = len(x)
    if n <= max_points:
        return x, list(ys)
    per = math.ceil(n / max_points)
    starts = np.arange(0, n, per)
    ends = np.r_[starts[1:], n]
    out = []
    for y, rule in zip(ys, rules, strict=True):
        if rule == M.MAX:
            out.append(np.fmax.reduceat(y, starts))
        elif rule == M.MEAN:  # of the points that have a value (NaN: none measured)
            seen = np.add.reduceat((~np.isnan(y)).astype(np.float64), starts)
            total = np.add.reduceat(np.nan_to_num(y), starts)
            out.append(np.divide(total, seen, out=np.full(len(starts), np.nan), where=seen > 0))
        else:
            out.append(y[ends - 1])
    return x[ends - 1], out
