"""The terminal view (``ringq rtv --tui``): the page's figures as one table, refreshed in place.

Data comes from :class:`~ringq.rtv._source.MonitorClient` (kept apart from
rendering: :class:`TuiModel` fetches, :func:`render` draws). Below the status
line, the server the monitor is on (:func:`~ringq.rtv._server_line.server_line`).
Each queue row shows its current figures (a grouped queue's groups on a line
below the table: :func:`~ringq.rtv._groups_line.groups_line`; entries waiting
for their due time too: :func:`~ringq.rtv._waiting_line.waiting_line`) and, over the
chosen window, sparklines of depth, rates and p99 latencies and a strip of
its full/empty periods. Below the
queues, one row per session attached to the section (workers first): its
throughput over the monitor's last interval and its totals of handled and
failed messages, time-outs, poisoned entries and errors.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text
from ringq.engine import metrics as M

from ._groups_line import groups_line
from ._server_line import server_line
from ._source import MonitorClient, MonitorError, Row
from ._waiting_line import waiting_line

BLOCKS = " ▁▂▃▄▅▆▇█"
SPARK_WIDTH = 24  # default columns of a sparkline
# Points asked of the monitor per queue: far more than a sparkline has columns,
# far fewer than a day of 1 s samples (86,400, which the monitor thins).
HISTORY_POINTS = 600


@dataclass
class TuiModel:
    """What the terminal view shows: the latest queue rows, each queue's
    history over the last ``window`` seconds and the clients attached.
    ``update()`` never raises for a monitor failure: it keeps the last figures
    and records ``error`` (or ``clients_error`` when only the clients could
    not be read, e.g. from a monitor older than ``/api/clients``)."""

    client: MonitorClient
    window: float = 300.0
    queues: list[Row] = field(default_factory=list)
    server: Row | None = None  # None: the monitor does not say which server it is on
    history: dict[str, list[Row]] = field(default_factory=dict)
    clients: list[Row] = field(default_factory=list)
    interval: float | None = None
    error: str | None = None
    clients_error: str | None = None
    updated: float | None = None

    def update(self) -> None:
        try:
            overview = self.client.overview()
            self.queues, self.interval = overview.queues, overview.interval
            self.server = overview.server
            now = time.time()
            names = {q[M.NAME] for q in self.queues}
            for name in list(self.history):
                if name not in names:
                    del self.history[name]
            for name in sorted(names):
                points = self.history.setdefault(name, [])
                since = points[-1][M.T] if points else now - self.window
                points.extend(self.client.history(name, since, max_points=HISTORY_POINTS).points)
                cut = 0
                while cut < len(points) and points[cut][M.T] < now - self.window:
                    cut += 1
                del points[:cut]
        except MonitorError as exc:
            self.error = str(exc)
            return
        self.error = None
        self.updated = time.time()
        try:
            self.clients = self.client.clients().clients
        except MonitorError as exc:
            self.clients_error = str(exc)
        else:
            self.clients_error = None


def _columns(
    points: Sequence[Row], key: str, start: float, end: float, width: int
) -> list[list[float]]:
    """The values of ``key`` in ``width`` equal time columns over [start, end]."""
    columns: list[list[float]] = [[] for _ in range(width)]
    span = max(end - start, 1e-9)
    for p in points:
        v, t = p.get(key), p[M.T]
        if v is None or t is None or t < start:
            continue
        columns[min(width - 1, int((t - start) / span * width))].append(v)
    return columns


def sparkline(
    points: Sequence[Row],
    key: str,
    *,
    start: float,
    end: float,
    width: int = SPARK_WIDTH,
    high: float | None = None,
    reduce: Callable[[list[float]], float] = max,
) -> str:
    """``width`` block characters over [start, end]: each column the reduced
    value of its points, scaled to ``high`` (default: the largest); a blank
    where there is no sample."""
    values = [reduce(c) if c else None for c in _columns(points, key, start, end, width)]
    top = high if high else max((v for v in values if v is not None), default=0.0)
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif top <= 0 or v <= 0:
            out.append(BLOCKS[1])
        else:
            out.append(BLOCKS[max(1, min(8, math.ceil(v / top * 8)))])
    return "".join(out)


def state_strip(
    points: Sequence[Row],
    *,
    start: float,
    end: float,
    interval: float | None,
    width: int = SPARK_WIDTH,
) -> Text:
    """One character per column: red █ if the queue was full at any time in
    it, grey ░ if it was empty most of the time, green ─ otherwise."""
    half = (interval or 1.0) / 2
    full = _columns(points, M.FULL, start, end, width)
    empty = _columns(points, M.EMPTY, start, end, width)
    text = Text()
    for f, e in zip(full, empty, strict=True):
        if not f and not e:
            text.append(" ")
        elif f and max(f) > 0:
            text.append("█", style="red")
        elif e and _mean(e) >= half:
            text.append("░", style="grey50")
        else:
            text.append("─", style="green")
    return text


def _state(q: Row) -> Text:
    """The queue now: FULL (no free slot), empty (nothing ready) or flowing."""
    depth, capacity = q[M.DEPTH], q[M.CAPACITY]
    if depth is not None and capacity and depth >= capacity:
        return Text("FULL", style="bold red")
    if depth == 0:
        return Text("empty", style="grey50")
    return Text("flowing", style="green")


def _client_state(c: Row) -> Text:
    if c[M.STATE] == M.STATE_ACTIVE:
        return Text(c[M.STATE], style="green")
    return Text(str(c[M.STATE]), style="bold red")  # in_doubt: lost its connection holding slots


def _throughput(c: Row) -> str:
    """A worker's messages handled per second, a client's commits per second."""
    if c[M.ROLE] == M.ROLE_WORKER:
        return f"{_num(c[M.HANDLED_RATE], 1)} msg/s"
    return f"{_num(c[M.COMMIT_RATE], 1)} commit/s"


def _last_error(c: Row) -> str:
    last = c[M.LAST_ERROR]
    if not last:
        return ""
    where = f" on {last[M.ERROR_QUEUE]}" if last[M.ERROR_QUEUE] else ""
    return f"{last[M.ERROR_KIND]}{where}"


def clients_table(model: TuiModel) -> Table:
    """The sessions attached to the section, workers first: throughput over
    the monitor's last interval, then totals since each session opened (the
    worker counters are shown for workers only)."""
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title="Clients",
        title_justify="left",
        title_style="bold",
        caption_justify="left",
    )
    table.add_column("PID", justify="right", no_wrap=True, style="bold")
    table.add_column("Role", no_wrap=True)
    table.add_column("Queues", overflow="ellipsis", max_width=40, no_wrap=True)
    for header in ("Rate", "Handled", "Failed", "Timeouts", "Poisoned", "Errors"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("State", no_wrap=True)
    table.add_column("Last error", overflow="ellipsis", max_width=40, no_wrap=True, style="red")
    for c in model.clients:
        worker = c[M.ROLE] == M.ROLE_WORKER
        table.add_row(
            str(c[M.PID]),
            Text(str(c[M.ROLE]), style="cyan" if worker else ""),
            ", ".join(c[M.QUEUES]) or "–",
            _throughput(c),
            *(
                _num(c[k]) if worker else "–"
                for k in (M.HANDLED, M.FAILED, M.TIMEOUTS, M.POISONED)
            ),
            Text(_num(c[M.ERRORS]), style="bold red" if c[M.ERRORS] else ""),
            _client_state(c),
            _last_error(c),
        )
    if model.clients_error:
        table.caption = Text(model.clients_error, style="bold red")
    elif not model.clients:
        table.caption = Text("no client attached", style="grey50")
    return table


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _num(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "–"
    if abs(v) >= 1e6:
        return f"{v / 1e6:.1f}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.1f}k"
    return f"{v:.{digits}f}"


def _us(v: float | None) -> str:
    if v is None:
        return "–"
    if v >= 1e6:
        return f"{v / 1e6:.2f}s"
    if v >= 1e3:
        return f"{v / 1e3:.1f}ms"
    return f"{v:.0f}µs"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _window_label(seconds: float) -> str:
    if seconds >= 86_400:
        return "day"
    if seconds >= 3600:
        return f"{seconds / 3600:g} h"
    return f"{seconds / 60:g} min"


def render(
    model: TuiModel, monitor_url: str, *, width: int = 160, now: float | None = None
) -> RenderableType:
    """The whole screen for ``model`` on a terminal ``width`` columns wide: a
    status line, the server the monitor is on, the queues now, their trends
    over the window, and the clients."""
    now = time.time() if now is None else now
    start = now - model.window
    # While the monitor's history is shorter than the window, the trends
    # span what there is instead of squeezing it into the last columns.
    firsts = [pts[0][M.T] for pts in model.history.values() if pts]
    if firsts:
        start = max(start, min(firsts) - (model.interval or 1.0))
    span = f"the last {_window_label(model.window)}"
    if now - start < model.window - 1:
        span = (
            f"the last {_duration(now - start)} (of {_window_label(model.window)}: "
            "the monitor has no more yet)"
        )
    status = Text()
    status.append("ringq rtv ", style="bold")
    status.append(f"· monitor {monitor_url} · ")
    if model.error:
        status.append(model.error, style="bold red")
    elif model.updated:
        status.append(
            f"updated {time.strftime('%H:%M:%S', time.localtime(model.updated))}", style="green"
        )
    else:
        status.append("connecting…", style="yellow")

    name_width = min(32, max([5, *(len(str(q[M.NAME])) for q in model.queues)]))
    current = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, title="Now", title_justify="left", title_style="bold"
    )
    current.add_column(
        "Queue", style="bold", overflow="ellipsis", min_width=name_width, max_width=32
    )
    for header in ("Depth / cap", "State", "EnQ/s", "DeQ/s", "EnQ p50 / p99", "DeQ p50 / p99",
                   "Retries", "Exc", "Commits", "Rollbk", "Wait d/e", "Dead rows"):
        current.add_column(header, justify="right", no_wrap=True)

    spark = max(8, min(60, (width - name_width - 2 * 7 - 4) // 6))  # 7 columns, 2 of padding each
    trends = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left", title_style="bold",
        title=f"Over {span}",
    )
    trends.add_column(
        "Queue", style="bold", overflow="ellipsis", min_width=name_width, max_width=32
    )
    for header, style in (("Depth", "magenta"), ("Full █ / empty ░", None), ("EnQ/s", "blue"),
                          ("DeQ/s", "green"), ("EnQ p99", "red"), ("DeQ p99", "red")):
        trends.add_column(header, no_wrap=True, style=style, min_width=spark, max_width=spark)

    for q in model.queues:
        pts = model.history.get(q[M.NAME], [])
        current.add_row(
            q[M.NAME],
            f"{_num(q[M.DEPTH])} / {_num(q[M.CAPACITY])}",
            _state(q),
            _num(q[M.ENQ_RATE], 1),
            _num(q[M.DEQ_RATE], 1),
            f"{_us(q[M.ENQ_P50])} / {_us(q[M.ENQ_P99])}",
            f"{_us(q[M.DEQ_P50])} / {_us(q[M.DEQ_P99])}",
            _num(q[M.RETRIES]),
            _num(q[M.EXCEPTIONS]),
            _num(q[M.COMMITS]),
            _num(q[M.ROLLBACKS]),
            f"{_num(q[M.WAIT_READY])} / {_num(q[M.WAIT_SPACE])}",
            _num(q[M.DEAD_ROWS]),
        )
        trends.add_row(
            q[M.NAME],
            sparkline(pts, M.DEPTH, start=start, end=now, width=spark, high=q[M.CAPACITY] or None),
            state_strip(pts, start=start, end=now, width=spark, interval=model.interval),
            sparkline(pts, M.ENQ_RATE, start=start, end=now, width=spark, reduce=_mean),
            sparkline(pts, M.DEQ_RATE, start=start, end=now, width=spark, reduce=_mean),
            sparkline(pts, M.ENQ_P99, start=start, end=now, width=spark),
            sparkline(pts, M.DEQ_P99, start=start, end=now, width=spark),
        )
    if not model.queues:
        current.add_row(Text("no queue reported yet", style="grey50"), *[""] * 12)
    # Grouped queues and queues with entries waiting for their time only, one
    # line each below the table: no column for the others.
    grouped = [
        (q[M.NAME], text)
        for q in model.queues
        for text in (groups_line(q), waiting_line(q))
        if text is not None
    ]
    groups = Text("\n").join(
        Text.assemble((str(name), "bold"), f"  {text}") for name, text in grouped
    )
    footer = Text(
        "Depth is drawn against capacity; rates and latencies against their own peak. "
        "Clients: rates over the monitor's last interval, counts since each session opened. "
        "Ctrl-C to quit.",
        style="grey50",
    )
    head: list[RenderableType] = [status]
    if model.server is not None:
        line = server_line(model.server)
        head.append(Text(line.text, style="bold red" if line.alarm else "green"))
    now_part: list[RenderableType] = [current, groups] if grouped else [current]
    return Group(*head, *now_part, trends, clients_table(model), footer)


class _StopFlag:
    """SIGINT/SIGTERM set the flag (and nothing else); the previous handlers come back on exit."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> threading.Event:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self.event

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.event.set()

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_tui(
    client: MonitorClient,
    *,
    refresh: float = 1.0,
    window: float = 300.0,
    console: Console | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Show the terminal view until Ctrl-C (or SIGTERM, or ``stop`` is set); returns 0."""
    model = TuiModel(client, window=window)
    console = console or Console()
    with (
        _StopFlag() as flag,
        Live(
            render(model, client.url, width=console.width),
            console=console,
            auto_refresh=False,
            transient=False,
        ) as live,
    ):
        while not (flag.is_set() or (stop is not None and stop.is_set())):
            began = time.monotonic()
            model.update()
            live.update(render(model, client.url, width=console.width), refresh=True)
            flag.wait(max(0.0, refresh - (time.monotonic() - began)))
    return 0
