"""The pages of regression runs: one per cycle, one per run, and two runs compared.

The run's directory (``$RINGQ_HOME/regress/<run>/``) holds, beside the Spark
proof's ``cycle-N.json``: ``run.json`` (the run's queues and configuration),
``cycle-N.series.json`` (the cycle's course as its parent saw it, every
``STEP_S``: each queue's depth and section counters, and the cycle's figures),
and the pages ``cycle-N.html`` and ``run.html`` with their charts. Pages are
made from these files alone, so ``ringq report --runs A B`` needs no database.

When a monitor served the database during the cycle (``ringq run`` starts
one; ``--chaos`` runs its own), its T4 files and log add per-queue call
latencies over time and the events (a killed client recovered, the monitor
restarted, a fail-over) on the time axis.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import numpy as np
from ringq.engine import metrics as M
from ringq.monitor import journal_records, t4_rows

from . import _events as E
from ._charts import BarChart, Line, Mark, TimeChart
from ._errors import NoData
from ._page import Page, utc

STEP_S: Final = 0.2  # the cycle's course is recorded at most this often (its loop: 0.2 s)
MAX_SAMPLES: Final = 20_000  # then every other sample is dropped (a cycle over an hour)
COUNTERS: Final = (M.ENQ_COMMITS, M.DEQ_COMMITS, M.DEQ_ROLLBACKS, M.POISONED, M.FULL_NS)
RUN_FILE: Final = "run.json"
RUN_PAGE: Final = "run"


class CycleProgress(Protocol):
    """What the recorder reads of ``ringq.regression.Progress``."""

    cycle: int
    depth: list[int]
    stats: list[dict[str, int]]
    committed: int
    received: int


class CycleOutcome(Protocol):
    """What a cycle page reads of ``ringq.regression.CycleResult``."""

    cycle: int
    status: str
    workload_s: float
    stats: dict[str, Any]
    errors: list[str]


class ProofReport(Protocol):
    """What a cycle page reads of ``ringq.regression.Report``."""

    @property
    def ok(self) -> bool: ...

    def to_json(self) -> dict[str, Any]: ...

    def summary(self) -> str: ...


@dataclass
class CycleRecorder:
    """A cycle's course: fed every progress report of the cycle's loop (:meth:`chain`)."""

    cycle: int
    queues: list[str]
    started: float = field(default_factory=time.time)
    ended: float = 0.0
    t: list[float] = field(default_factory=list)
    depth: list[list[int]] = field(default_factory=list)  # per sample, per queue
    counters: list[list[list[int]]] = field(default_factory=list)  # per sample, queue, COUNTERS
    committed: list[int] = field(default_factory=list)
    received: list[int] = field(default_factory=list)

    def __call__(self, p: CycleProgress) -> None:
        now = time.time()
        if self.t and now - self.t[-1] < STEP_S:
            return
        if len(self.t) >= MAX_SAMPLES:
            for seq in (self.t, self.depth, self.counters, self.committed, self.received):
                del seq[1::2]
        self.t.append(round(now, 3))
        self.depth.append(list(p.depth))
        self.counters.append([[int(s.get(k, 0)) for k in COUNTERS] for s in p.stats]
                             if len(p.stats) == len(self.queues) else [])
        self.committed.append(p.committed)
        self.received.append(p.received)

    def chain(self, then: Callable[[Any], None] | None) -> Callable[[Any], None]:
        """A progress callback that records, then calls ``then``."""
        def progress(p: Any) -> None:
            self(p)
            if then is not None:
                then(p)
        return progress


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _dump(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":"), default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


class RunPages:
    """Writes a run's pages into ``run_dir`` as its cycles end.

    ``monitor_dirs``: data directories of a monitor that may have served the
    database (read if they exist); a chaos cycle's own monitor's is added
    from the cycle's figures.
    """

    def __init__(self, run_dir: Path, run_id: str, queues: Sequence[str], capacity: int,
                 config: dict[str, Any], monitor_dirs: Sequence[Path] = ()) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.queues = list(queues)
        self.monitor_dirs = list(monitor_dirs)
        self.capacity = capacity
        run_dir.mkdir(parents=True, exist_ok=True)
        _dump(run_dir / RUN_FILE, {"run_id": run_id, "queues": self.queues, "capacity": capacity,
                                   "config": config, "created": time.time()})

    def recorder(self, cycle: int) -> CycleRecorder:
        return CycleRecorder(cycle, self.queues)

    def cycle_page(self, rec: CycleRecorder, result: CycleOutcome,
                   report: ProofReport | None) -> Path:
        """Store the cycle's course and figures, and write ``cycle-N.html``; its path."""
        rec.ended = rec.ended or time.time()
        chaos = result.stats.get("chaos") or {}
        dirs = list(self.monitor_dirs)
        if chaos.get("logs"):
            dirs.append(Path(chaos["logs"]) / "monitor")
        data: dict[str, Any] = {
            "cycle": rec.cycle, "queues": rec.queues, "capacity": self.capacity,
            "started": rec.started, "ended": rec.ended,
            "t": rec.t, "depth": rec.depth, "counters": rec.counters, "counter_keys": COUNTERS,
            "committed": rec.committed, "received": rec.received,
            "status": result.status, "workload_s": result.workload_s, "stats": result.stats,
            "errors": result.errors, "monitor_dirs": [str(d) for d in dirs],
            "proof": None if report is None else report.to_json(),
            "summary": None if report is None else report.summary(),
        }
        _dump(self.run_dir / f"cycle-{rec.cycle}.series.json", data)
        page = _cycle_page(self.run_id, _Cycle.of(data))
        return page.write(self.run_dir, f"cycle-{rec.cycle}")

    def run_page(self, status: str) -> Path:
        """Write ``run.html`` over every cycle stored in the run's directory; its path."""
        run = load_run_dir(self.run_dir)
        run.status = status
        return _run_page(run).write(self.run_dir, RUN_PAGE)


# -- reading a run's directory back -----------------------------------------------------------


@dataclass
class _Cycle:
    n: int
    data: dict[str, Any]
    t: np.ndarray
    depth: np.ndarray  # (samples, queues)
    counters: np.ndarray | None  # (samples, queues, COUNTERS)

    @classmethod
    def of(cls, data: dict[str, Any]) -> _Cycle:
        t = np.asarray(data.get("t") or [], dtype=np.float64)
        nq = len(data.get("queues") or [])
        depth = (np.asarray(data["depth"], dtype=np.float64).reshape(len(t), -1)
                 if len(t) and data.get("depth") else np.empty((len(t), nq)))
        raw = data.get("counters") or []
        counters = None
        if raw and all(len(c) == nq for c in raw):
            counters = np.asarray(raw, dtype=np.float64).reshape(len(t), nq, len(COUNTERS))
        return cls(int(data["cycle"]), data, t, depth, counters)

    @property
    def proof(self) -> dict[str, Any] | None:
        p = self.data.get("proof")
        return p if isinstance(p, dict) else None

    def verdict(self) -> str:
        p = self.proof
        if p is None:
            return "not proven"
        return "PASS" if p.get("ok") else "FAIL"

    def rates(self, k: int) -> np.ndarray:
        """Per second, per queue, of counter ``COUNTERS[k]`` (a counter reset: from 0)."""
        assert self.counters is not None
        c = self.counters[:, :, k]
        d = np.diff(c, axis=0)
        d = np.where(d < 0, c[1:], d)  # the section was rebuilt: counters restarted
        dt = np.diff(self.t)[:, None]
        out: np.ndarray = np.r_[np.full((1, c.shape[1]), np.nan), d / np.where(dt > 0, dt, np.nan)]
        return out


@dataclass
class _Run:
    run_id: str
    path: Path
    info: dict[str, Any]
    cycles: list[_Cycle]
    status: str = ""


def load_run_dir(path: Path) -> _Run:
    """A run's directory read back: its cycles' courses, or (runs made before the
    pages) its proofs alone. :raises NoData: neither is there."""
    info = _load(path / RUN_FILE) or {}
    cycles: dict[int, _Cycle] = {}
    for f in path.glob("cycle-*.series.json"):
        data = _load(f)
        if data is not None and "cycle" in data:
            cycles[int(data["cycle"])] = _Cycle.of(data)
    for f in path.glob("cycle-*.json"):
        n_text = f.name[len("cycle-"):-len(".json")]
        if not n_text.isdigit() or int(n_text) in cycles:
            continue
        proof = _load(f)
        if proof is not None:
            cycles[int(n_text)] = _Cycle.of({"cycle": int(n_text), "proof": proof,
                                             "summary": None, "status": "?"})
    if not cycles:
        raise NoData(f"no regression run in {path} (no cycle-N.json, no cycle-N.series.json)")
    return _Run(str(info.get("run_id") or path.name), path, info,
                [cycles[n] for n in sorted(cycles)])


# -- the pages ------------------------------------------------------------------------------


def _cycle_page(run_id: str, c: _Cycle) -> Page:
    d = c.data
    page = Page(f"ringq regress: run {run_id}, cycle {c.n}: {c.verdict()}")
    window = f"{utc(d['started'])} to {utc(d['ended'])} UTC" if d.get("started") else ""
    page.paragraph(f"workload {d.get('status')} in {float(d.get('workload_s') or 0):.1f} s"
                   + (f", {window}" if window else ""),
                   "pass" if c.verdict() == "PASS" else ("fail" if c.verdict() == "FAIL" else ""))
    _proof(page, c)
    queues = list(d.get("queues") or [])
    evs, t4 = _monitor_data(d, set(queues))
    mk = E.marks(evs)
    page.heading("Over the cycle")
    if not len(c.t):
        page.paragraph("The cycle's course was not recorded.", "note")
    else:
        _course_charts(page, c, queues, mk)
    _latency(page, [c])
    if t4:
        page.heading("Call latencies (the monitor's T4 samples)")
        for name, r in sorted(t4.items()):
            i, j = M.SAMPLE_KEYS.index(M.ENQ_P99), M.SAMPLE_KEYS.index(M.DEQ_P99)
            page.chart(f"{name}-p99", TimeChart(
                f"{name}: enqueue and dequeue call p99", "µs (log)",
                [Line("enqueue p99", r[:, 0], r[:, i]),
                 Line("dequeue p99", r[:, 0], r[:, j], "--")], mk, log=True,
            ))
    _chaos(page, d, evs)
    errors = d.get("errors") or []
    if errors:
        page.heading("Workload errors")
        page.pre("\n".join(str(e) for e in errors[:50]))
    return page


def _monitor_data(d: dict[str, Any], queues: set[str]
                  ) -> tuple[list[E.Event], dict[str, np.ndarray]]:
    """Events and T4 samples of the cycle's window from the monitors' directories."""
    t0, t1 = float(d.get("started") or 0) - 1.0, float(d.get("ended") or 0) + 1.0
    records: list[dict[str, Any]] = []
    rows: dict[str, np.ndarray] = {}
    for name in d.get("monitor_dirs") or []:
        p = Path(name)
        if not p.is_dir() or t1 <= t0:
            continue
        records += journal_records(p, t0, t1)
        for q, r in t4_rows(p, t0, t1, sorted(queues)).items():
            rows[q] = np.concatenate([rows[q], r]) if q in rows else r
    records.sort(key=lambda r: float(r["t"]))
    return E.events(records, queues), rows


def _proof(page: Page, c: _Cycle) -> None:
    page.heading("The proof")
    p = c.proof
    if p is None:
        page.paragraph("Not proven by Spark (--no-verify, or the cycle did not finish): "
                       "'ringq regress verify RUN' proves it later.", "note")
        return
    v = p.get("violations") or {}
    page.table(["violation", "count"], [[k, int(n)] for k, n in v.items()])
    qs = p.get("queues") or []
    if qs:
        page.table(
            ["queue", "payload B", "committed", "dequeued", "max depth", "full hits",
             "empty hits", "p50 ms", "p99 ms"],
            [[q.get("name"), q.get("payload_size"), q.get("committed"), q.get("delivered"),
              q.get("max_depth"), q.get("full_hits"), q.get("empty_hits"),
              (q.get("latency_ms") or {}).get("p50"), (q.get("latency_ms") or {}).get("p99")]
             for q in qs],
        )
    if c.data.get("summary"):
        page.pre(str(c.data["summary"]))


def _course_charts(page: Page, c: _Cycle, queues: list[str], mk: list[Mark]) -> None:
    t = c.t
    page.chart("depth", TimeChart(
        "depth per queue", "entries",
        [Line(q, t, c.depth[:, i]) for i, q in enumerate(queues) if i < c.depth.shape[1]], mk,
        hline=("capacity", float(c.data.get("capacity") or 0)) if c.data.get("capacity") else None,
    ), f"read every {STEP_S:g} s or more by the cycle's parent")
    if c.counters is not None:
        for k, title, unit in ((0, "committed enqueues per queue", "per second"),
                               (1, "committed dequeues per queue", "per second"),
                               (2, "redeliveries (dequeues rolled back) per queue", "per second"),
                               (4, "time full per queue", "s per s")):
            r = c.rates(k) / (1e9 if COUNTERS[k] == M.FULL_NS else 1.0)
            page.chart(f"rate-{COUNTERS[k]}", TimeChart(
                title, unit, [Line(q, t, r[:, i]) for i, q in enumerate(queues)], mk))
        poisoned = c.counters[-1, :, 3] - c.counters[0, :, 3]
        page.table(["queue", "poisoned in the cycle"],
                   [[q, int(max(0.0, poisoned[i]))] for i, q in enumerate(queues)])
    dt = np.diff(t, prepend=t[0])
    dt[0] = np.nan
    page.chart("throughput", TimeChart(
        "the cycle's entries, all queues", "per second",
        [Line("committed by producers", t, np.diff(c.data["committed"], prepend=0) / dt),
         Line("received by consumers", t, np.diff(c.data["received"], prepend=0) / dt, "--")],
        mk,
    ))


def _latency(page: Page, cycles: list[_Cycle]) -> None:
    """The Spark proof's enqueue-commit -> dequeue latency: per queue, and overall."""
    proofs = [c.proof for c in cycles if c.proof]
    if not proofs:
        return
    page.heading("Latency (from the sent row to its dequeue, Spark)")
    pct = ("p50", "p95", "p99", "max")
    series = {f"cycle {c.n}": [float((c.proof or {}).get("latency_ms", {}).get(k, 0) or 0)
                               for k in pct] for c in cycles if c.proof}
    page.chart("latency", BarChart("latency distribution, all queues", "ms (log)", list(pct),
                                   series, log=True))
    last = proofs[-1]
    qs = last.get("queues") or []
    if qs:
        page.chart("latency-queues", BarChart(
            "latency per queue" + (f" (cycle {cycles[-1].n})" if len(cycles) > 1 else ""),
            "ms (log)", [str(q.get("name")) for q in qs],
            {k: [float((q.get("latency_ms") or {}).get(k, 0) or 0) for q in qs]
             for k in ("p50", "p99")}, log=True,
        ))


def _chaos(page: Page, d: dict[str, Any], evs: list[E.Event]) -> None:
    chaos = (d.get("stats") or {}).get("chaos")
    failover = (d.get("stats") or {}).get("failover")
    if not chaos and not failover and not evs:
        return
    page.heading("Chaos and events")
    if chaos:
        keys = ("producers", "consumers", "monitor", "pg_restarts", "reconnects", "resumed")
        page.table(["kills and restarts", *keys], [["count", *(chaos.get(k, 0) for k in keys)]])
    if failover:
        page.table(["fail-over", "value"], [[k, str(v)] for k, v in sorted(failover.items())])
    if evs:
        page.table(["time (UTC)", "event", "queue", "detail"],
                   [[utc(e.t), e.kind, e.queue, e.detail] for e in evs[:300]], left=4)
    else:
        page.paragraph("No monitor's log covers this cycle: the events are not on the time axis.",
                       "note")


def _run_page(run: _Run) -> Page:
    page = Page(f"ringq regress: run {run.run_id}" + (f" ({run.status})" if run.status else ""))
    _cycles_table(page, run)
    queues = list(run.info.get("queues") or [])
    timed = [c for c in run.cycles if len(c.t)]
    if timed and queues:
        lines = []
        # one NaN after each cycle: the line breaks between cycles
        xs = np.concatenate([np.r_[c.t, c.t[-1] + 0.001] for c in timed])
        for i, q in enumerate(queues):
            ys = np.concatenate([np.r_[c.depth[:, i] if i < c.depth.shape[1]
                                       else np.full(len(c.t), np.nan), np.nan] for c in timed])
            lines.append(Line(q, xs, ys))
        page.heading("Over the run")
        page.chart("depth", TimeChart("depth per queue, every cycle", "entries", lines))
    _throughput(page, {run.run_id: run})
    _latency(page, run.cycles)
    page.heading("Cycles")
    for c in run.cycles:
        if (run.path / f"cycle-{c.n}.html").exists():
            page.link(f"cycle {c.n}: {c.verdict()}", f"cycle-{c.n}.html")
    return page


def _cycles_table(page: Page, run: _Run) -> None:
    rows = []
    for c in run.cycles:
        p = c.proof or {}
        tp = p.get("throughput") or {}
        lat = p.get("latency_ms") or {}
        counts = p.get("counts") or {}
        chaos = (c.data.get("stats") or {}).get("chaos") or {}
        kills = sum(int(chaos.get(k, 0)) for k in ("producers", "consumers", "monitor",
                                                   "pg_restarts"))
        rows.append([c.n, c.data.get("status"), c.verdict(), c.data.get("workload_s"),
                     counts.get("committed"), tp.get("entries_per_s"), lat.get("p50"),
                     lat.get("p99"), kills])
    page.table(["cycle", "workload", "proof", "workload s", "committed", "entries/s",
                "p50 ms", "p99 ms", "chaos kills"], rows, left=3)


def _throughput(page: Page, runs: dict[str, _Run]) -> None:
    n = max(len(r.cycles) for r in runs.values())
    groups = [f"cycle {i + 1}" for i in range(n)]
    series = {}
    for name, r in runs.items():
        vals = [float(((c.proof or {}).get("throughput") or {}).get("entries_per_s", 0) or 0)
                for c in r.cycles]
        series[name] = vals + [0.0] * (n - len(vals))
    page.chart("throughput-cycles", BarChart("throughput per cycle (Spark: committed entries "
                                             "over the workload)", "entries/s", groups, series))


def compare_page(run_dirs: Sequence[Path], out_dir: Path, stem: str = "compare") -> Path:
    """One page comparing the runs in ``run_dirs`` (two, or more); its path.

    :raises NoData: a directory holds no run.
    """
    runs = [load_run_dir(p) for p in run_dirs]
    names = [r.run_id for r in runs]
    page = Page("ringq regress: " + " vs ".join(names))
    cfg_keys = ("capacity", "entries_per_queue", "producers", "payload_sizes", "chaos",
                "chaos_failover", "grouped_consumers")
    page.heading("Runs")
    page.table(["run", "directory", "cycles", "passed", "failed", *cfg_keys],
               [[r.run_id, str(r.path), len(r.cycles),
                 sum(1 for c in r.cycles if c.verdict() == "PASS"),
                 sum(1 for c in r.cycles if c.verdict() == "FAIL"),
                 *(json.dumps((r.info.get("config") or {}).get(k)) for k in cfg_keys)]
                for r in runs], left=2)
    for r in runs:
        page.heading(f"Run {r.run_id}", 3)
        _cycles_table(page, r)
    page.heading("Side by side")
    _throughput(page, dict(zip(names, runs, strict=True)))
    pct = ("p50", "p95", "p99", "max")
    page.chart("latency", BarChart(
        "latency, all queues (the median over each run's cycles)", "ms (log)", list(pct),
        {r.run_id: [_median([float(((c.proof or {}).get("latency_ms") or {}).get(k, 0) or 0)
                             for c in r.cycles if c.proof]) for k in pct] for r in runs},
        log=True,
    ))
    depth, rate = [], []
    for r in runs:
        x, dep, rt = _along(r)
        if len(x):
            depth.append(Line(r.run_id, x, dep))
            rate.append(Line(r.run_id, x, rt))
    if depth:
        page.chart("depth", TimeChart("total depth, all queues, cycles end to end",
                                      "entries", depth, time_axis=False,
                                      xlabel="seconds of workload"))
        page.chart("rate", TimeChart("entries committed by producers, cycles end to end",
                                     "per second", rate, time_axis=False,
                                     xlabel="seconds of workload"))
    return page.write(out_dir, stem)


def _along(run: _Run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds of workload, total depth, commit rate) over the run's cycles end to end."""
    xs, ds, rs = [], [], []
    offset = 0.0
    for c in run.cycles:
        if len(c.t) < 2:
            continue
        x = c.t - c.t[0]
        dt = np.diff(c.t, prepend=np.nan)
        xs.append(x + offset)
        ds.append(c.depth.sum(axis=1))
        rs.append(np.diff(np.asarray(c.data["committed"], dtype=np.float64), prepend=np.nan) / dt)
        offset += float(x[-1]) + 1.0
    if not xs:
        return np.empty(0), np.empty(0), np.empty(0)
    return np.concatenate(xs), np.concatenate(ds), np.concatenate(rs)


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan
