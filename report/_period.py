"""The page of a period of the monitor's history (``ringq report --from … --to …``).

Read from the monitor's data directory alone (T4 day files, ``monitor.log``):
no monitor, no database. Per queue: depth, enqueue and dequeue rates, call
latency percentiles, enqueue → dequeue latency percentiles, full and empty
time, deliveries (retries) and poison, with the marked events on the time
axis; per client kind (the section's client roles: ``client``, ``worker``)
its clients' calls, commits, rollbacks and errors per second (the monitor's
kinds T4 file) and the errors, deaths and expired leases the log holds; the
events listed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from ringq.engine import metrics as M
from ringq.monitor import KIND_KEYS, journal_records, kind_rows, t4_rows

from . import _events as E
from ._charts import BarChart, Line, Mark, TimeChart, thin
from ._errors import NoData
from ._page import Page, utc

COL = {k: i for i, k in enumerate(M.SAMPLE_KEYS)}
KCOL = {k: i for i, k in enumerate(KIND_KEYS)}
KIND_CLIENTS = "clients"  # the KIND_KEYS column of the clients attached at a sample
INTERVAL_S = "interval_s"  # the KIND_KEYS column of the seconds a row's counts cover
# per kind, the counts drawn as rates: (column, legend, line style)
Series = tuple[tuple[str, str, str], ...]
CALLS: Series = ((M.ENQUEUED, "enqueue calls", "-"), (M.DEQUEUED, "dequeues", "--"),
         (M.COMMITS, "commits", "-"), (M.ROLLBACKS, "rollbacks", ":"), (M.ERRORS, "errors", "-."))
WORK: Series = ((M.HANDLED, "messages handled", "-"), (M.FAILED, "failed", "--"),
        (M.TIMEOUTS, "timed out", ":"), (M.ABORTED, "aborted", "-."))
# A queue's charts after its depth: (name, title, unit, series, log scale, caption).
QUEUE_CHARTS: tuple[tuple[str, str, str, Series, bool, str], ...] = (
    ("rates", "committed enqueues and dequeues", "per second",
     ((M.ENQ_RATE, "enqueue", "-"), (M.DEQ_RATE, "dequeue", "--")), False, ""),
    ("latency", "call latency percentiles", "µs (log)",
     ((M.ENQ_P50, "enqueue p50", "-"), (M.ENQ_P99, "enqueue p99", "--"),
      (M.DEQ_P50, "dequeue p50", "-"), (M.DEQ_P99, "dequeue p99", "--")), True,
     "enqueue: the enqueue call; dequeue: the dequeue call (from enqueue to dequeue: the "
     "regression pages' Spark latency); no traffic: no point"),
    ("wait", "enqueue → dequeue latency (commit to commit)", "µs (log)",
     ((M.WAIT_P50, "p50", "-"), (M.WAIT_P95, "p95", "--"), (M.WAIT_P99, "p99", ":")), True,
     "from an entry's enqueue (its row's enq_at) to the commit of the dequeue that consumed "
     "it, over the entries consumed in each sample interval (upper bounds of power-of-two "
     "buckets); none consumed, or a monitor older than these figures: no point"),
    ("full-empty", "full and empty time", "s per sample interval",
     ((M.FULL, "full", "-"), (M.EMPTY, "empty", "--")), False, ""),
    ("deliveries", "redeliveries (dequeues rolled back), poison, exception table", "entries",
     ((M.RETRIES, "retries", "-"), (M.POISONED, "poisoned", "--"),
      (M.EXCEPTIONS, "in exception table", ":")), False, ""),
)
Progress = Callable[[str], None]


def period_page(
    data_dir: Path,
    t0: float,
    t1: float,
    out_dir: Path,
    *,
    queues: list[str] | None = None,
    progress: Progress | None = None,
    stem: str = "report",
) -> Path:
    """Write the page of ``t0 < t <= t1`` (unix seconds) into ``out_dir``; its path.

    :raises NoData: the data directory holds no sample of the period and no event of the
        monitor's log (with ``queues``: no sample of them).
    """
    say = progress or (lambda _msg: None)
    say(f"reading the T4 files in {data_dir}")
    rows = t4_rows(data_dir, t0, t1, queues)
    kinds = kind_rows(data_dir, t0, t1)
    say(f"reading {data_dir / 'monitor.log'}")
    records = journal_records(data_dir, t0, t1)
    evs = E.events(records, set(queues) if queues else None)
    if not rows and (queues or not (evs or kinds)):  # the queues asked for: their samples
        what = f"queue {', '.join(queues)}" if queues else "any queue"
        raise NoData(
            f"no data for {what} from {utc(t0)} to {utc(t1)} UTC in {data_dir} "
            "(no T4 sample, no event in monitor.log)"
        )
    page = Page(f"ringq report: {utc(t0)} to {utc(t1)} UTC")
    page.paragraph(
        f"From the monitor's files in {data_dir}: {len(rows)} queue(s), "
        f"{sum(len(r) for r in rows.values()):,} samples, {len(evs)} marked event(s)."
    )
    if queues:
        missing = [q for q in queues if q not in rows]
        if missing:
            page.paragraph(f"No samples in this period for: {', '.join(missing)}.", "empty")
    _summary(page, rows)
    for i, (name, r) in enumerate(sorted(rows.items()), 1):
        say(f"drawing queue {name} ({i}/{len(rows)}, {len(r):,} samples)")
        queue_charts(page, name, r, E.marks(evs, name))
    _clients(page, kinds, records, E.marks(evs), say)
    _event_list(page, evs)
    say(f"writing the page into {out_dir}")
    return page.write(out_dir, stem)


def _summary(page: Page, rows: dict[str, np.ndarray]) -> None:
    page.heading("Queues")
    table = []
    for name, r in sorted(rows.items()):
        dt = np.diff(r[:, 0], prepend=r[0, 0])
        table.append([
            name, len(r), utc(r[0, 0]), utc(r[-1, 0]),
            int(r[:, COL[M.DEPTH]].max()), int(r[-1, COL[M.CAPACITY]]),
            float(np.sum(r[:, COL[M.ENQ_RATE]] * dt)), float(np.sum(r[:, COL[M.DEQ_RATE]] * dt)),
            float(r[:, COL[M.FULL]].sum()), float(r[:, COL[M.EMPTY]].sum()),
            int(r[:, COL[M.RETRIES]].sum()), int(r[:, COL[M.POISONED]].sum()),
            int(r[-1, COL[M.EXCEPTIONS]]),
        ])
    page.table(
        ["queue", "samples", "first (UTC)", "last (UTC)", "max depth", "capacity",
         "enqueued ~", "dequeued ~", "full s", "empty s", "retries", "poisoned", "exceptions"],
        table, left=4,
    )
    page.paragraph("enqueued ~ / dequeued ~: the rates integrated over the samples' intervals.",
                   "note")


def queue_charts(page: Page, name: str, r: np.ndarray, marks: list[Mark] | None = None,
                 ) -> None:
    """The charts of one queue's samples (columns as ``SAMPLE_KEYS``)."""
    keys = list(M.SAMPLE_KEYS)
    r = r.copy()
    # 0: no call (no entry consumed) in the interval, or a T4 file without the column
    for k in (M.ENQ_P50, M.ENQ_P99, M.DEQ_P50, M.DEQ_P99, *M.WAIT_KEYS):
        r[:, COL[k]] = np.where(r[:, COL[k]] > 0, r[:, COL[k]], np.nan)
    t, cols = thin(r[:, 0], [r[:, i] for i in range(r.shape[1])], [M.BUCKET[k] for k in keys])
    c = dict(zip(keys, cols, strict=True))
    mk = marks or []
    page.heading(f"Queue {name}", 3)
    page.chart(f"{name}-depth", TimeChart(
        f"{name}: depth", "entries", [Line("depth", t, c[M.DEPTH])], mk,
        hline=("capacity", float(r[-1, COL[M.CAPACITY]])),
    ), "the largest depth of each point's samples")
    for slug, what, unit, series, log, caption in QUEUE_CHARTS:
        page.chart(f"{name}-{slug}", TimeChart(
            f"{name}: {what}", unit, [Line(label, t, c[k], style) for k, label, style in series],
            mk, log=log,
        ), caption)


def _clients(page: Page, kinds: dict[str, np.ndarray], records: list[dict[str, Any]],
             mk: list[Mark], say: Progress) -> None:
    page.heading("Clients, by kind")
    if not kinds:
        page.paragraph("The monitor's kinds T4 files hold no client counts in this period "
                       "(no client attached, or a monitor older than those files).", "note")
    else:
        _kind_totals(page, kinds)
        for i, (kind, r) in enumerate(sorted(kinds.items()), 1):
            say(f"drawing client kind {kind} ({i}/{len(kinds)}, {len(r):,} samples)")
            kind_charts(page, kind, r, mk)
        t_c = [thin(*_gaps(r, [r[:, KCOL[KIND_CLIENTS]]]), [M.MAX]) for r in kinds.values()]
        page.chart("kinds-clients", TimeChart(
            "clients attached, by kind", "clients",
            [Line(k, t, c[0]) for k, (t, c) in zip(kinds, t_c, strict=True)], mk, steps=True,
        ), "sessions in the section's client table at each sample")
    page.heading("Client errors, deaths and expired leases", 3)
    counts = E.client_counts(records)
    if not counts:
        page.paragraph("The monitor's log holds no client error, recovery or expired lease "
                       "in this period.", "note")
        return
    what = sorted({k for c in counts.values() for k in c})
    roles = sorted(counts)
    page.table(["client kind", *what], [[r, *(counts[r][k] for k in what)] for r in roles])
    page.chart("clients", BarChart(
        "client events by kind", "count", what, {r: [float(counts[r][k]) for k in what]
                                                 for r in roles},
    ))


def _kind_totals(page: Page, kinds: dict[str, np.ndarray]) -> None:
    shown = [k for k, _label, _style in CALLS + WORK]
    page.table(
        ["client kind", "samples", "max clients", *shown],
        [[kind, len(r), int(r[:, KCOL[KIND_CLIENTS]].max()),
          *(int(r[:, KCOL[k]].sum()) for k in shown)] for kind, r in sorted(kinds.items())],
    )
    page.paragraph(
        "Counted over the period from each client's counters between two samples of the "
        "monitor (a client's exit never makes a count run backwards); what a client did after "
        "the last sample before it exited is not counted.", "note")


def kind_charts(page: Page, kind: str, r: np.ndarray, marks: list[Mark] | None = None) -> None:
    """The charts of one client kind's rows (columns as ``ringq.monitor.KIND_KEYS``):
    its clients' calls per second and, for a kind that handled messages (workers), those."""
    dt = r[:, KCOL[INTERVAL_S]]
    per_s = {k: np.divide(r[:, KCOL[k]], dt, out=np.full(len(r), np.nan), where=dt > 0)
             for k, _label, _style in CALLS + WORK}
    mk = marks or []
    page.heading(f"Client kind {kind}", 3)
    groups: list[tuple[str, str, Series]] = [
        ("calls", "calls, commits, rollbacks and errors per second", CALLS)]
    if any(r[:, KCOL[k]].any() for k, _label, _style in WORK):
        groups.append(("work", "messages handled per second", WORK))
    for slug, what, series in groups:
        t, cols = thin(*_gaps(r, [per_s[k] for k, _l, _s in series]), [M.MEAN] * len(series))
        page.chart(f"kind-{kind}-{slug}", TimeChart(
            f"{kind}: {what}", "per second",
            [Line(label, t, c, style)
             for (_k, label, style), c in zip(series, cols, strict=True)], mk, steps=True,
        ), f"each step: over one sample interval; all clients of kind {kind}, every queue")


def _gaps(r: np.ndarray, ys: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Times and ``ys`` of kind rows with a NaN point where no row covers a stretch
    (the monitor was down): a step line would otherwise draw the row after the
    stretch across it."""
    t, dt = r[:, 0], r[:, KCOL[INTERVAL_S]]
    start = t - dt  # each row's counts cover (start, t]
    gap = np.flatnonzero(start[1:] > t[:-1] + np.maximum(dt[1:], 1.0)) + 1
    if not len(gap):
        return t, ys
    return np.insert(t, gap, start[gap]), [np.insert(y, gap, np.nan) for y in ys]


def _event_list(page: Page, evs: list[E.Event]) -> None:
    page.heading("Events")
    if not evs:
        page.paragraph("No marked event in this period.", "note")
        return
    page.table(["time (UTC)", "event", "queue", "detail"],
               [[utc(e.t), e.kind, e.queue, e.detail] for e in evs[:500]], left=4)
    if len(evs) > 500:
        page.paragraph(f"… and {len(evs) - 500:,} more.", "note")
