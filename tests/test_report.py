"""``ringq report`` and the regression's pages, from real monitors and real runs.

The period page is drawn from the files a real ``ringq monitor`` process wrote
(its T4 files and monitor.log, a killed consumer recovered among its events),
after the monitor stopped. The regression pages come from a real small run
(one cycle proven by Spark, a monitor serving the database; then a second
run, not proven) and are compared on one page. Every page is parsed: each
chart is a valid PNG both beside the page and embedded in it.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import MonitorProcess, cli, drain, fresh_database, queue_in, wait_for
from ringq.engine import connect, exits
from ringq.engine import metrics as M
from ringq.monitor import KIND_KEYS, journal_records, kind_rows, t4_rows
from ringq.regression import RegressConfig, RunOutcome, Verifier, run
from ringq.report import period_page
from ringq.worker import Actions, Worker, WorkerConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PER_QUEUE = ("depth", "rates", "latency", "wait", "full-empty", "deliveries")
KCOL = {k: i for i, k in enumerate(KIND_KEYS)}

HOLDER = r"""
import sys, time
from ringq.engine import connect
s = connect(sys.argv[1])
m = s.dequeue(sys.argv[2])
print(m.seq, flush=True)
time.sleep(120)
"""


class _Page(HTMLParser):
    """The images, headings, table rows and text of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.images: list[dict[str, str]] = []
        self.text: list[str] = []
        self.headings: list[str] = []
        self.rows: list[list[str]] = []  # every table row's cells, of every table
        self._in: str | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append({k: v or "" for k, v in attrs})
        if tag == "tr":
            self.rows.append([])
        self._in = tag

    def handle_endtag(self, tag: str) -> None:
        self._in = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._in in ("h1", "h2", "h3"):
            self.headings.append(data)
        if self._in in ("td", "th") and self.rows:
            self.rows[-1].append(data)

    def table(self, first_header: str) -> list[dict[str, str]]:
        """The rows of the table whose header row starts with ``first_header``, as dicts."""
        for i, row in enumerate(self.rows):
            if row and row[0] == first_header:
                body = []
                for r in self.rows[i + 1:]:
                    if len(r) != len(row):
                        break
                    body.append(dict(zip(row, r, strict=True)))
                return body
        raise AssertionError(f"no table headed {first_header!r}")

    @property
    def all_text(self) -> str:
        return " ".join(self.text)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, from its IHDR chunk; fails the test if it is not one."""
    assert data[:8] == PNG_MAGIC, data[:8]
    assert data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    return int(w), int(h)


def read_page(path: Path) -> _Page:
    """Parse the page; check every image is a non-empty PNG, embedded and beside the page."""
    assert path.is_file(), path
    page = _Page(path.read_text(encoding="utf-8"))
    assert page.images, f"{path}: no chart"
    for img in page.images:
        src = img["src"]
        assert src.startswith("data:image/png;base64,"), src[:40]
        embedded = base64.b64decode(src.split(",", 1)[1])
        w, h = png_size(embedded)
        assert w > 100 and h > 100, (img["alt"], w, h)
        beside = path.parent / img["data-file"]
        assert beside.read_bytes() == embedded, beside
    raw = path.read_text(encoding="utf-8")
    for outside in ('src="http', "src='http", 'href="http', "<script", "<link"):
        assert outside not in raw, outside  # nothing fetched: it opens from the file system
    return page


CHROMIUM = "/usr/bin/chromium"  # Debian's, as tests/test_rtv.py uses it: never `playwright install`
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]


def open_in_chromium(page_file: Path, shot: Path) -> dict[str, Any]:
    """Open the page from the file system in headless chromium with every request but
    file: and data: refused; a full-page screenshot to ``shot``. What the browser saw
    of the images: how many, how many loaded (natural width > 0), requests refused."""
    from playwright.sync_api import Route, sync_playwright

    refused: list[str] = []

    def route(r: Route) -> None:
        if r.request.url.startswith(("file:", "data:")):
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort()

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1200, "height": 900})
            tab.route("**/*", route)
            tab.goto(page_file.as_uri())
            tab.wait_for_load_state("load")
            seen: dict[str, Any] = tab.evaluate(
                "() => { const imgs = [...document.images];"
                " return {images: imgs.length,"
                " loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length}; }"
            )
            tab.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    seen["refused"] = refused
    return seen


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")


# -- a period of a real monitor's history ---------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """A monitor's history: its data directory, the queues it sampled and the
    period (epoch seconds) that holds their traffic."""

    data: Path
    queues: list[str]
    t0: float
    t1: float


@pytest.fixture
def recorded(dsn: str, tmp_path: Path) -> Iterator[Recorded]:
    """Two queues with traffic sampled by a real monitor process: a client enqueues
    into both, a worker handles the second's messages (two client kinds, each
    attached until the monitor counted its calls), a consumer is killed holding an
    entry of the first (recovered: an event); the monitor stopped after."""
    queues = [queue_in(dsn, 64), queue_in(dsn, 64)]
    data = tmp_path / "monitor"
    t0 = time.time()
    mon = MonitorProcess(dsn, data)

    def counted(kind: str, key: str) -> float:
        rows = kind_rows(data, t0, time.time() + 1).get(kind, np.empty((0, len(KCOL))))
        return float(rows[:, KCOL[key]].sum())

    try:
        with connect(dsn) as s:
            for i in range(40):
                for q in queues:
                    s.enqueue(q, b"x%d" % i)
                s.commit()
            wait_for(lambda: counted("client", M.COMMITS) >= 40, what="the client counted")
        # Each call counted once: the client's, and no other client's yet.
        assert counted("client", M.ENQUEUED) == 80 and counted("client", M.COMMITS) == 40
        app = Actions()
        app.add(queues[1], lambda msg, session: None)
        with Worker(app, dsn, config=WorkerConfig(idle_wait=0.1)) as w:
            w.open()
            assert w.run(max_messages=40) == 40
            wait_for(lambda: counted("worker", M.HANDLED) >= 40, what="the worker counted")
        assert counted("worker", M.HANDLED) == 40 and counted("worker", M.DEQUEUED) == 40
        assert len(drain(dsn, queues[0])) == 40
        with connect(dsn) as s:
            s.enqueue(queues[0], b"held")
            s.commit()
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, dsn, queues[0]],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None
        int(holder.stdout.readline())
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
        wait_for(lambda: any(r["event"] == "client.recovered"
                             for r in journal_records(data, t0, time.time() + 1)),
                 what="the dead consumer recovered")
        wait_for(lambda: len(t4_rows(data, t0, time.time() + 1, queues)) == 2, what="samples")
        drain(dsn, queues[0])
        time.sleep(MonitorProcess.INTERVAL * 3)  # a few samples after the recovery
    finally:
        assert mon.stop() == 0
    yield Recorded(data, queues, t0, time.time())


def test_a_period_renders_every_queue_chart_and_event_without_a_monitor(
    recorded: Recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, queues, t0, t1 = recorded.data, recorded.queues, recorded.t0, recorded.t1
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "report", "--from", iso(t0 - 1), "--to", iso(t1 + 1),
                            "--data-dir", str(data), "--out", str(out))
    assert code == exits.OK, err
    path = Path(stdout.strip())
    assert path == out / "report.html"
    assert "reading the T4 files" in err and f"drawing queue {queues[0]}" in err  # progress
    page = read_page(path)
    names = {img["alt"] for img in page.images}
    for q in queues:
        assert f"Queue {q}" in page.headings
        assert {f"{q}-{chart}" for chart in PER_QUEUE} <= names, names
    assert "clients" in names  # per client kind: the recovered consumer
    # Per client kind its counts over time, from the monitor's kinds file.
    assert {"kind-client-calls", "kind-worker-calls", "kind-worker-work",
            "kinds-clients"} <= names, names
    assert "kind-client-work" not in names  # a plain client handles no messages
    assert {"Client kind client", "Client kind worker"} <= set(page.headings)
    totals = {r["client kind"]: r for r in page.table("client kind")}
    assert set(totals) == {"client", "worker"}, totals
    # the "held" entry's session closes within milliseconds: counted only if a sample
    # fell while it was attached (a client's calls after the last sample are not counted)
    assert int(totals["client"][M.ENQUEUED].replace(",", "")) in (80, 81)
    assert int(totals["client"][M.COMMITS].replace(",", "")) >= 40
    assert totals["worker"][M.HANDLED] == "40" and totals["worker"][M.DEQUEUED] == "40"
    assert int(totals["worker"]["max clients"]) == 1
    assert len(list((out / "report_png").glob("*.png"))) == len(page.images)
    text = page.all_text
    # Both queues' entries were consumed: their waits, enqueue to the consuming commit.
    waits = t4_rows(data, t0, t1, queues)
    for q in queues:
        assert waits[q][:, M.SAMPLE_KEYS.index(M.WAIT_P50)].max() > 0, q
    assert "to the commit of the dequeue that consumed it" in text
    assert "client died (consumer.died)" in text and queues[0] in text
    # Mailed: the page alone, without its PNG folder, shows every chart in a browser.
    mailed = tmp_path / "mailed" / "report.html"
    mailed.parent.mkdir()
    mailed.write_bytes(path.read_bytes())
    seen = open_in_chromium(mailed, tmp_path / "shot.png")
    assert seen == {"images": len(page.images), "loaded": len(page.images), "refused": []}, seen
    w, h = png_size((tmp_path / "shot.png").read_bytes())
    assert w >= 1200 and h > 900 * 2, (w, h)  # the whole page: many charts tall
    # One queue only: its charts, not the other's.
    code, stdout, err = cli(capsys, "report", "--from", iso(t0 - 1), "--to", iso(t1 + 1),
                            "--data-dir", str(data), "--out", str(tmp_path / "one"),
                            "--queue", queues[1], "--quiet")
    assert code == exits.OK and err == "", err
    one = read_page(Path(stdout.strip()))
    alts = {img["alt"] for img in one.images}
    assert {f"{queues[1]}-{c}" for c in PER_QUEUE} <= alts
    assert not any(a.startswith(queues[0]) for a in alts)


def test_a_period_without_data_says_so_and_exits_not_found(
    recorded: Recorded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = recorded.data
    out = tmp_path / "empty"
    code, _out, err = cli(capsys, "report", "--from", "2020-01-01T08:00",
                          "--to", "2020-01-01T20:00", "--data-dir", str(data), "--out", str(out))
    assert code == exits.NOT_FOUND == 4
    assert "no data for any queue from 2020-01-01 08:00:00 to 2020-01-01 20:00:00 UTC" in err
    assert not out.exists()
    code, _out, err = cli(capsys, "report", "--data-dir", str(data), "--queue", "no_such_queue",
                          "--out", str(out))  # the last 24 h: data, but not of that queue
    assert code == exits.NOT_FOUND and "no_such_queue" in err
    code, _out, err = cli(capsys, "report", "--data-dir", str(tmp_path / "none"))
    assert code == exits.NOT_FOUND and "no monitor data directory" in err
    code, _out, err = cli(capsys, "report", "--from", "yesterday", "--data-dir", str(data))
    assert code == exits.USAGE and "ISO 8601" in err
    code, help_text, _err = cli(capsys, "report", "--help")
    assert code == 0 and "--from" in help_text and "--runs" in help_text


def test_a_t4_file_without_the_wait_columns_reads_and_gets_its_page(tmp_path: Path) -> None:
    """A day file a monitor wrote before the wait percentiles: its rows read with
    those columns 0 (nothing measured), the others by name; the page has the
    wait chart, without points."""
    data = tmp_path / "old"
    data.mkdir()
    old_keys = [k for k in M.SAMPLE_KEYS if k not in M.WAIT_KEYS]
    t0 = datetime(2026, 11, 20, 12, tzinfo=UTC).timestamp()
    lines = [",".join(["time", "t", "name", *old_keys[1:]])]
    for i in range(5):
        t = t0 + i
        vals = {k: 0 for k in old_keys} | {M.DEPTH: i, M.CAPACITY: 64, M.ENQ_P50: 8}
        stamp = datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
        lines.append(",".join([stamp, str(t), "oldq", *(str(vals[k]) for k in old_keys[1:])]))
    (data / "t4-2026-11-20.csv").write_text("\n".join(lines) + "\n")
    rows = t4_rows(data, t0 - 1, t0 + 10)["oldq"]
    col = {k: i for i, k in enumerate(M.SAMPLE_KEYS)}
    assert rows.shape == (5, len(M.SAMPLE_KEYS))
    assert rows[:, col[M.DEPTH]].tolist() == [0, 1, 2, 3, 4]
    assert set(rows[:, col[M.ENQ_P50]].tolist()) == {8.0}
    assert not rows[:, [col[k] for k in M.WAIT_KEYS]].any()
    path = period_page(data, t0 - 1, t0 + 10, tmp_path / "out")
    page = read_page(path)
    assert {f"oldq-{c}" for c in PER_QUEUE} <= {img["alt"] for img in page.images}


def test_importing_the_report_does_not_import_matplotlib() -> None:
    probe = ("import sys, ringq.report, ringq.regression, ringq.cli._main;"
             "print('matplotlib' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


# -- regression runs ------------------------------------------------------------------------


SMALL = RegressConfig(payload_sizes=(16, 2000), capacity=32, entries_per_queue=120, producers=2,
                      grouped_consumers=0, seed=20261126)


@pytest.fixture(scope="module")
def runs(pg_cluster: Any, verifier: Verifier, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Path, RunOutcome, RunOutcome]]:
    """Run A: one cycle proven by Spark, a monitor serving the database; run B: one
    cycle, not proven."""
    reports = tmp_path_factory.mktemp("report_runs")
    mon_dir = tmp_path_factory.mktemp("report_monitor") / "monitor"
    with fresh_database(pg_cluster, "t_report") as dsn:
        queue_in(dsn, 8)  # the schema, for the monitor to serve
        mon = MonitorProcess(dsn, mon_dir)
        try:
            a = run(dsn, SMALL, cycles=1, verifier=verifier, report_dir=reports, run_id="rep_a",
                    monitor_dir=mon_dir)
            b = run(dsn, SMALL, cycles=1, report_dir=reports, run_id="rep_b")
        finally:
            assert mon.stop() == 0
        yield reports, a, b


@pytest.mark.slow
def test_a_regression_cycle_and_its_run_get_their_pages(
    runs: tuple[Path, RunOutcome, RunOutcome],
) -> None:
    reports, a, b = runs
    assert a.ok and a.reports and a.reports[0].ok, a
    assert b.status == "done" and not b.reports, b
    run_dir = reports / "rep_a"
    assert (run_dir / "cycle-1.json").is_file()  # the proof's JSON, beside the page
    page = read_page(run_dir / "cycle-1.html")
    assert page.headings[0] == "ringq regress: run rep_a, cycle 1: PASS"
    names = {img["alt"] for img in page.images}
    assert {"depth", "rate-enq_commits", "rate-deq_commits", "throughput", "latency",
            "latency-queues"} <= names, names
    text = page.all_text
    assert "lost" in text and "duplicate" in text  # the violations table
    for q in a.reports[0].queues:
        assert q["name"] in text
    # The monitor served the run: its T4 samples give per-queue call latencies.
    assert any(n.endswith("-p99") for n in names), names
    series = json.loads((run_dir / "cycle-1.series.json").read_text())
    assert len(series["t"]) >= 2 and series["proof"]["ok"] is True
    # The cycle's course: each queue's section counters as the cycle went on.
    keys = series["counter_keys"]
    enq = keys.index("enq_commits")
    assert len(series["counters"]) == len(series["t"])
    assert all(c[enq] > 0 for c in series["counters"][-1]), series["counters"][-1]
    assert a.page == str(run_dir / "run.html")
    run_page = read_page(run_dir / "run.html")
    assert "cycle 1: PASS" in run_page.all_text
    # Run B was not proven: its page says so.
    b_page = read_page(reports / "rep_b" / "cycle-1.html")
    assert b_page.headings[0].endswith("not proven") and "ringq regress verify" in b_page.all_text


@pytest.mark.slow
def test_two_runs_compared_on_one_page(
    runs: tuple[Path, RunOutcome, RunOutcome], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    reports, _a, _b = runs
    out = tmp_path / "cmp"
    code, stdout, err = cli(capsys, "report", "--runs", "rep_a", "rep_b",
                            "--report-dir", str(reports), "--out", str(out))
    assert code == exits.OK, err
    page = read_page(Path(stdout.strip()))
    assert page.headings[0] == "ringq regress: rep_a vs rep_b"
    assert "Run rep_a" in page.headings and "Run rep_b" in page.headings
    assert {"throughput-cycles", "latency", "depth", "rate"} <= {i["alt"] for i in page.images}
    code, _o, err = cli(capsys, "report", "--runs", "rep_a", "nope", "--report-dir", str(reports))
    assert code == exits.NOT_FOUND and "nope" in err
