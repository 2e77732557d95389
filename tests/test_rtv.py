"""The Real Time Viewer: its token, its proxy of the monitor, the page in a real
headless chromium (against a real monitor and a real workload), the terminal view."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import multiprocessing as mp
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
from conftest import present, remove_section
from ringq.engine import ConfigError, QueueFull, connect
from ringq.engine import metrics as M
from ringq.rtv import (
    MonitorClient,
    MonitorError,
    MonitorUnavailable,
    ServerLine,
    Viewer,
    ViewerConfig,
    groups_line,
    server_line,
    waiting_line,
)
from ringq.rtv import _metrics as K
from ringq.rtv._source import normalize_client, thin
from ringq.rtv._tui import TuiModel, render
from ringq.scripting import QueueSpec, create_queue
from ringq.worker import Actions, Worker, WorkerConfig

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",  # root in a container has no user namespace sandbox
    "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--no-first-run", "--disable-sync",
]
RINGQ = [sys.executable, "-m", "ringq.cli"]
FORK = mp.get_context("fork")


# -- a stand-in monitor: the real API's shapes, numbers that move with the clock -----


class FakeMonitor:
    """Serves ``/api/queues``, ``/api/history`` and ``/api/clients`` as
    monitor/_http.py does, for two queues whose figures change every second,
    one plain client and one worker (``clients=False``: a monitor without
    ``/api/clients``)."""

    QUEUES = ("alpha", "beta")
    CAPACITY = 1000
    SYSID = 7412345678901234567  # above 2**53: must not go through a float
    SERVER: ClassVar[dict[str, Any]] = {
        "host": "127.0.0.1", "port": 5433, "address": "127.0.0.1:5433", "primary": True,
        "system_identifier": SYSID, "timeline": 2,
        "section_history": {"system_identifier": SYSID, "timeline": 2},
        "section_follows": True, "t": 0.0,
    }
    SERVER_LINE = "server 127.0.0.1:5433 primary, timeline 2 (section: timeline 2)"
    WORKER_PID = 41233
    CLIENT_PID = 41500

    def __init__(
        self, token: str | None = None, history_s: int = 1200, clients: bool = True
    ) -> None:
        self.token = token
        self.serves_clients = clients
        self.started = time.time() - history_s
        self.requests: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self.history_queries: list[dict[str, list[str]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                fake.requests.append((url.path, self.headers.get("Authorization")))
                if fake.token and self.headers.get("Authorization") != f"Bearer {fake.token}":
                    return self._json(401, {"error": "a token is required", "status": 401})
                if url.path == "/api/queues":
                    now = time.time()
                    return self._json(200, {
                        "t": now,
                        "monitor": {"interval": 1.0, "beat": now, "database": True, "steps": {}},
                        "server": fake.SERVER,
                        "queues": [fake.sample(q, math.floor(now)) for q in fake.QUEUES],
                    })
                if url.path == "/api/history":
                    fake.history_queries.append(query)
                    queue = query.get("queue", [""])[0]
                    if queue not in fake.QUEUES:
                        return self._json(
                            404, {"error": f"no history for queue {queue!r}", "status": 404}
                        )
                    since = float(query.get("since", [time.time() - 300])[0])
                    first = max(math.floor(since) + 1, math.ceil(fake.started))
                    points = [
                        fake.sample(queue, t) for t in range(first, math.floor(time.time()) + 1)
                    ]
                    for p in points:
                        del p["name"]
                    return self._json(
                        200, {"queue": queue, "interval": 1.0, "since": since, "points": points}
                    )
                if url.path == "/api/clients" and fake.serves_clients:
                    now = time.time()
                    # In the monitor's order (workers first), but the client listed
                    # first here: the viewer sorts them itself.
                    return self._json(
                        200, {"t": now, "interval": 1.0, "clients": fake.clients(now)}
                    )
                self._json(404, {"error": "no such path", "status": 404})

            def _json(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def sample(self, queue: str, t: int) -> dict[str, Any]:
        phase = 0.0 if queue == "alpha" else 2.0
        depth = round(self.CAPACITY * (0.5 + 0.5 * math.sin(t / 20 + phase)))
        return {
            "name": queue,
            "t": float(t),
            "capacity": self.CAPACITY,
            "depth": depth,
            "head": 10 * t,
            "tail": 10 * t - depth,
            "enq_rate": 100 + 50 * math.sin(t / 7 + phase),
            "deq_rate": 100 + 50 * math.cos(t / 7),
            "enq_p50_us": 150 + (t % 5) * 10,
            "enq_p99_us": 400 + (t % 11) * 40,
            "deq_p50_us": 120 + (t % 3) * 10,
            "deq_p99_us": 300 + (t % 13) * 30,
            "full": 0.5 if depth >= self.CAPACITY - 2 else 0.0,
            "empty": 1.0 if depth <= 2 else 0.0,
            "retries": t % 4 == 0,
            "exceptions": (t // 60) % 5,
            "commits": 200,
            "rollbacks": t % 4 == 0,
            "waiting_dequeuers": int(depth == 0),
            "waiting_enqueuers": 0,
            "poisoned": 0,
            "dead_rows": 3,
        }

    def clients(self, now: float) -> list[dict[str, Any]]:
        n = math.floor(now - self.started)
        zero = dict.fromkeys(
            ("handled", "declined", "failed", "timeouts", "aborted", "poisoned", "in_doubt"), 0
        )
        return [
            {
                "pid": self.CLIENT_PID,
                "backend_pid": 88131,
                "role": "client",
                "state": "active",
                "started": self.started,
                "queues": ["beta", "alpha"],
                "enqueued": 10 * n,
                "dequeued": 0,
                "commits": n,
                "rollbacks": 0,
                "errors": 4,
                **zero,
                "busy_s": 0.0,
                "commit_rate": 10.0,
                "handled_rate": 0.0,
                "failed_rate": 0.0,
                "error_rate": 0.0,
                "last_error": {"kind": "queue_full", "queue": "alpha", "seq": 10400, "t": now - 1},
            },
            {
                "pid": self.WORKER_PID,
                "backend_pid": 88120,
                "role": "worker",
                "state": "active",
                "started": self.started,
                "queues": ["alpha"],
                "enqueued": 0,
                "dequeued": 100 * n,
                "commits": 97 * n,
                "rollbacks": 3 * n,
                "errors": 0,
                **zero,
                "handled": 97 * n,
                "declined": n,
                "failed": 2 * n,
                "timeouts": n,
                "poisoned": 7,
                "busy_s": n / 10,
                "commit_rate": 97.0,
                "handled_rate": 97.0,
                "failed_rate": 3.0,
                "error_rate": 0.0,
                "last_error": None,
            },
        ]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_monitor() -> Iterator[FakeMonitor]:
    mon = FakeMonitor()
    yield mon
    mon.close()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(present(parts.hostname), parts.port, timeout=10)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path or "/", headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


# -- configuration and authentication ------------------------------------------------------


def test_config_is_validated() -> None:
    assert ViewerConfig().port == 7481
    assert len(ViewerConfig().token) >= 20 and ViewerConfig().token != ViewerConfig().token
    for bad in (
        {"monitor_url": "ftp://x"},
        {"monitor_url": "http://127.0.0.1:7480/?token=x"},
        {"token": ""},
        {"token": "has space"},
        {"port": 70000},
        {"refresh": 0},
        {"window": 60},
    ):
        with pytest.raises(ConfigError):
            ViewerConfig(**bad)


def test_every_path_needs_the_token(fake_monitor: FakeMonitor) -> None:
    with Viewer(ViewerConfig(monitor_url=fake_monitor.url, token="s3cret", port=0)) as v:
        base = v.base_url
        for path in (
            "/",
            "/api/queues",
            "/api/clients",
            "/api/history?queue=alpha",
            "/static/app.js",
            "/nope",
        ):
            status, headers, body = _get(base + path)
            assert status == 401, path
            assert headers["www-authenticate"].startswith("Bearer")
            assert b"token" in body
        assert _get(base + "/?token=wrong")[0] == 401
        assert _get(base + "/api/queues", {"Authorization": "Bearer wrong"})[0] == 401
        assert _get(base + "/api/queues", {"Cookie": f"ringq_rtv_{v.port}=wrong"})[0] == 401
        # A wrong token in the address is not rescued by a good cookie.
        assert _get(base + "/?token=wrong", {"Cookie": f"ringq_rtv_{v.port}=s3cret"})[0] == 401

        status, headers, body = _get(v.url)
        assert status == 200 and b"uPlot.iife.min.js" in body
        assert v.url == f"{base}/?token=s3cret"
        cookie = headers["set-cookie"]
        assert cookie.startswith(f"ringq_rtv_{v.port}=s3cret;") and "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert "default-src 'none'" in headers["content-security-policy"]
        assert headers["referrer-policy"] == "no-referrer"
        assert _get(base + "/api/queues", {"Authorization": "Bearer s3cret"})[0] == 200
        assert _get(base + "/static/app.js", {"Cookie": f"ringq_rtv_{v.port}=s3cret"})[0] == 200
        status, headers, _ = _get(
            base + "/static/vendor/uPlot.min.css", {"Authorization": "Bearer s3cret"}
        )
        assert status == 200 and headers["content-type"].startswith("text/css")
        # Nothing outside static/ is served, however the path is spelled.
        for path in ("/static/../_server.py", "/static/%2e%2e/_server.py", "/static//etc/passwd",
                     "/static/vendor/../../_config.py"):
            assert _get(base + path, {"Authorization": "Bearer s3cret"})[0] == 404, path


def test_proxy_forwards_the_monitor_token_and_reports_its_failures() -> None:
    mon = FakeMonitor(token="mon-token")
    try:
        cfg = ViewerConfig(monitor_url=mon.url, monitor_token="mon-token", token="t", port=0)
        with Viewer(cfg) as v:
            auth = {"Authorization": "Bearer t"}
            status, _, body = _get(v.base_url + "/api/queues", auth)
            assert status == 200
            doc = json.loads(body)
            assert [q["name"] for q in doc["queues"]] == ["alpha", "beta"]
            assert doc["interval"] == 1.0
            assert set(doc["queues"][0]) == {M.NAME, M.T, *K.NUMERIC, *M.DUE_KEYS}
            # the stand-in does not say how many entries wait: None, and no line
            assert [doc["queues"][0][k] for k in M.DUE_KEYS] == [None, None]
            assert "waiting_line" not in doc["queues"][0]
            assert doc["queues"][0]["retries"] in (0.0, 1.0)  # booleans come out as numbers
            # The viewer's token never reaches the monitor; the monitor's does.
            assert {h for _, h in mon.requests} == {"Bearer mon-token"}

            status, _, body = _get(v.base_url + "/api/history?queue=alpha&window=300", auth)
            hist = json.loads(body)
            assert status == 200 and hist["queue"] == "alpha" and 290 <= len(hist["points"]) <= 301
            ts = [p["t"] for p in hist["points"]]
            assert ts == sorted(ts)
            status, _, body = _get(v.base_url + f"/api/history?queue=alpha&since={ts[-3]}", auth)
            assert [p["t"] for p in json.loads(body)["points"]][:2] == ts[-2:]
            assert _get(v.base_url + "/api/history?queue=nosuch", auth)[0] == 404
            assert _get(v.base_url + "/api/history", auth)[0] == 400
            assert _get(v.base_url + "/api/history?queue=alpha&since=nan", auth)[0] == 400

            # The clients, workers first, every key there; without the token: 401.
            status, _, body = _get(v.base_url + "/api/clients", auth)
            assert status == 200, body
            doc = json.loads(body)
            assert doc["interval"] == 1.0 and doc["t"] > 0
            assert [(c["pid"], c["role"]) for c in doc["clients"]] == [
                (FakeMonitor.WORKER_PID, "worker"), (FakeMonitor.CLIENT_PID, "client")]
            worker, client = doc["clients"]
            assert set(worker) == set(M.CLIENT_KEYS)
            assert (
                worker["handled"] > 0 and worker["poisoned"] == 7 and worker["handled_rate"] == 97.0
            )
            assert client["queues"] == ["alpha", "beta"]
            assert client["last_error"] == {"kind": "queue_full", "queue": "alpha", "seq": 10400,
                                            "t": pytest.approx(doc["t"] - 1, abs=1)}
            assert mon.requests[-1] == ("/api/clients", "Bearer mon-token")
            status, _, body = _get(v.base_url + "/api/clients")
            assert status == 401 and b"token" in body
            assert _get(v.base_url + "/api/clients", {"Authorization": "Bearer wrong"})[0] == 401

        with Viewer(cfg.replace(monitor_token="wrong")) as v:
            status, _, body = _get(v.base_url + "/api/queues", {"Authorization": "Bearer t"})
            assert status == 502 and "401" in json.loads(body)["error"]
            assert "--monitor-token" in json.loads(body)["error"]
    finally:
        mon.close()
    with Viewer(ViewerConfig(monitor_url=mon.url, token="t", port=0, timeout=1)) as v:
        status, _, body = _get(v.base_url + "/api/queues", {"Authorization": "Bearer t"})
        assert status == 502 and json.loads(body)["monitor"] == "unreachable"
        status, _, body = _get(v.base_url + "/api/clients", {"Authorization": "Bearer t"})
        assert status == 502 and json.loads(body)["monitor"] == "unreachable"
    with pytest.raises(MonitorUnavailable):
        MonitorClient(mon.url, timeout=1).queues()
    assert issubclass(MonitorUnavailable, MonitorError)


def test_viewer_asks_the_monitor_for_what_the_page_can_draw(fake_monitor: FakeMonitor) -> None:
    cfg = ViewerConfig(monitor_url=fake_monitor.url, token="t", port=0, max_points=1500)
    with Viewer(cfg) as v:
        auth = {"Authorization": "Bearer t"}
        for asked, sent in ((None, "1500"), ("500", "500"), ("99999", "1500"), ("1", "10")):
            extra = "" if asked is None else f"&max_points={asked}"
            status, _, body = _get(
                v.base_url + f"/api/history?queue=alpha&window=86400{extra}", auth
            )
            assert status == 200, body
            assert fake_monitor.history_queries[-1]["max_points"] == [sent]
            doc = json.loads(body)
            # The fake monitor serves its 1200 s raw: the viewer thins what it did not.
            assert len(doc["points"]) <= int(sent) and doc["thinned"] == (int(sent) < 1000)
        assert _get(v.base_url + "/api/history?queue=alpha&max_points=x", auth)[0] == 400
    assert MonitorClient(fake_monitor.url).history("alpha", time.time() - 60).step == 0.0


def test_long_history_is_thinned_keeping_the_worst_moments() -> None:
    points = [
        {M.T: float(t), **{k: 1.0 for k in K.NUMERIC}} for t in range(86_400)
    ]
    points[50_000][M.ENQ_P99] = 9_999.0
    points[50_001][M.FULL] = 1.0
    thinned = thin(points, 1000)
    assert 900 <= len(thinned) <= 1001
    assert thinned[-1][M.T] == 86_399.0
    assert max(p[M.ENQ_P99] for p in thinned) == 9_999.0  # the p99 spike survives
    assert max(p[M.FULL] for p in thinned) > 1.0 - 1e-9  # averaged, but visible
    assert thin(points[:10], 1000) == points[:10]


def test_viewer_metric_names_are_the_monitors() -> None:
    from ringq.monitor import _sample as S

    assert set(K.NUMERIC) == set(S.NUMERIC_KEYS) - {S.T}
    assert M.T == S.T and M.NAME == S.NAME
    assert set(K.BUCKET) == set(K.NUMERIC)


def test_viewer_client_names_are_the_monitors() -> None:
    from ringq.monitor import _clients as C

    # The document the monitor serves for a client, and the viewer's row of it.
    raw = C.Raw(cidx=0, pid=7, backend_pid=8, role=M.ROLE_WORKER, state=M.STATE_ACTIVE,
                started_ns=1, registered_ns=1, qids=[(1, "q")],
                stats={k: 1 for k in M.CLIENT_COUNTERS}, error=(1, 1, 0, 5, 1))
    no_section: Any = None  # read only for the name of a queue id > 0
    doc = C.client_doc(raw, None, {}, no_section)
    assert set(doc) == set(normalize_client(doc)) == set(M.CLIENT_KEYS)
    assert set(doc[M.LAST_ERROR]) == set(normalize_client(doc)[M.LAST_ERROR]) == {
        M.ERROR_KIND, M.ERROR_QUEUE, M.ERROR_SEQ, M.T}
    assert set(K.CLIENT_NUMERIC) <= set(M.CLIENT_KEYS)


def test_the_server_line_says_which_server_and_flags_a_section_on_another_history() -> None:
    server = dict(FakeMonitor.SERVER)
    assert server_line(server) == ServerLine(FakeMonitor.SERVER_LINE, alarm=False)
    line = server_line({**server, "section_history": {"system_identifier": FakeMonitor.SYSID,
                                                      "timeline": 1}, "section_follows": False})
    assert line == ServerLine(
        "server 127.0.0.1:5433 primary, timeline 2 (section: timeline 1)  HISTORY MISMATCH", True
    )
    line = server_line({**server, "section_history": {"system_identifier": 5, "timeline": 2},
                        "section_follows": False})
    assert line.alarm and f"system {FakeMonitor.SYSID}, timeline 2 (section: system 5," in line.text
    line = server_line({**server, "primary": False, "timeline": -1, "section_follows": False})
    assert line == ServerLine(
        "server 127.0.0.1:5433 standby (in recovery) (section: timeline 2)  NOT THE PRIMARY", True
    )
    assert server_line(None) == ServerLine(
        "server unknown: the monitor has no database connection", True
    )
    # A monitor without section_follows: the same rule, from the histories.
    assert not server_line({k: v for k, v in server.items() if k != "section_follows"}).alarm


def test_clients_are_normalized() -> None:
    row = normalize_client(
        {
            "pid": "12",
            "role": "worker",
            "handled": True,
            "failed": float("nan"),
            "queues": "not-a-list",
            "last_error": {"kind": "queue_full", "seq": 3.0},
        }
    )
    assert row[M.PID] == 12 and row[M.BACKEND_PID] is None and row[M.STATE] == "active"
    assert row[M.HANDLED] == 1.0 and row[M.FAILED] is None and row[M.TIMEOUTS] is None
    assert row[M.QUEUES] == []
    assert row[M.LAST_ERROR] == {"kind": "queue_full", "queue": None, "seq": 3, "t": None}
    assert normalize_client({"pid": 5})[M.ROLE] == "client"


# -- the terminal view -------------------------------------------------------------------


def test_tui_model_and_render(fake_monitor: FakeMonitor) -> None:
    from rich.console import Console

    model = TuiModel(MonitorClient(fake_monitor.url), window=300)
    model.update()
    assert model.error is None and [q["name"] for q in model.queues] == ["alpha", "beta"]
    assert 290 <= len(model.history["alpha"]) <= 301
    console = Console(record=True, width=160, color_system=None)
    console.print(render(model, fake_monitor.url, width=160))
    text = console.export_text()
    print(text)
    assert "…" not in text  # nothing cut at 160 columns
    for needle in ("alpha", "beta", "Depth / cap", "EnQ p50 / p99", "DeQ p99", "Retries", "/ 1000",
                   "Over the last 5 min", "Full █ / empty ░"):
        assert needle in text, needle
    # Under the status line: the server the monitor is on.
    assert text.splitlines()[1] == FakeMonitor.SERVER_LINE
    assert model.server and model.server["system_identifier"] == FakeMonitor.SYSID
    assert re.search(r"[▁▂▃▄▅▆▇█]{5}", text)  # sparklines drawn
    # The clients, below the queues: the worker's row first, with its throughput and failures.
    assert text.index("Clients") > text.index("Over the last 5 min")
    lines = text.splitlines()
    worker = next(line for line in lines if str(FakeMonitor.WORKER_PID) in line)
    client = next(line for line in lines if str(FakeMonitor.CLIENT_PID) in line)
    assert lines.index(worker) < lines.index(client)
    assert re.search(r"worker\s+alpha\s+97\.0 msg/s\s+\S+\s+\S+\s+\S+\s+7\s+0\s+active", worker), (
        worker
    )
    assert re.search(
        r"client\s+alpha, beta\s+10\.0 commit/s(\s+–){4}\s+4\s+active\s+queue_full on alpha", client
    ), client
    fake_monitor.close()
    model.update()
    assert model.error and "unreachable" in model.error
    assert [q["name"] for q in model.queues] == ["alpha", "beta"]  # the last figures stay
    assert len(model.clients) == 2


def test_tui_without_clients_still_shows_the_queues() -> None:
    from rich.console import Console

    mon = FakeMonitor(clients=False)  # a monitor older than /api/clients
    try:
        model = TuiModel(MonitorClient(mon.url), window=300)
        model.update()
        assert model.error is None and len(model.queues) == 2
        assert model.clients == [] and model.clients_error and "404" in model.clients_error
        console = Console(record=True, width=160, color_system=None)
        console.print(render(model, mon.url, width=160))
        text = console.export_text()
        assert "alpha" in text and "Clients" in text and "/api/clients answered 404" in text
    finally:
        mon.close()


def test_tui_command_refreshes_in_place_and_ctrl_c_exits_0(fake_monitor: FakeMonitor) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: `ringq rtv --tui` on a terminal
        os.environ.update(COLUMNS="220", LINES="30", TERM="xterm-256color")
        os.execv(sys.executable, [*RINGQ, "rtv", "--tui", "--monitor", fake_monitor.url])
    out = b""
    deadline = time.monotonic() + 30
    try:
        # Two frames with a queue name: the second one redrawn over the first.
        while out.count(b"alpha") < 2 and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    break
        assert out.count(b"alpha") >= 2, out.decode(errors="replace")[-2000:]
        assert b"\x1b[" in out  # cursor movement: redrawn in place, not scrolled
        os.kill(pid, signal.SIGINT)
        # Keep reading the terminal until the child has exited: its last
        # frame and the terminal's restoring must never block on a full pty.
        status = None
        stop_at = time.monotonic() + 60
        while status is None and time.monotonic() < stop_at:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                break
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                with contextlib.suppress(OSError):
                    os.read(fd, 65536)
        assert status is not None, "ringq rtv --tui did not exit on SIGINT"
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


# -- the page in a real headless browser ------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(
            f"{CHROMIUM} is missing: the viewer's page is tested in Debian's chromium. "
            "Install it with `apt-get install -y chromium chromium-driver` (.ci/setup does), "
            "and Playwright into the venv with `pip install -e '.[dev]'`. "
            "Never `playwright install`: the test uses the system browser.",
            pytrace=False,
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "playwright is not installed in this Python: `pip install -e '.[dev]'` "
            "(never `playwright install`: the test uses /usr/bin/chromium)",
            pytrace=False,
        )
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _start_rtv(
    monitor_url: str, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """``ringq rtv --port 0`` as a process; returns it and the address it printed."""
    proc = subprocess.Popen(
        [*RINGQ, "rtv", "--port", "0", "--monitor", monitor_url, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"(http://127\.0\.0\.1:\d+/\?token=\S+)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError(f"ringq rtv printed no address; stderr: {proc.communicate()[1]!r}")


def _stop(proc: subprocess.Popen[str]) -> int:
    """Ctrl-C the viewer; its exit code (its output is printed for the record)."""
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    print(f"ringq rtv stdout: {out!r}\nringq rtv stderr: {err!r}")
    return proc.returncode


def _chart_data(page: Any, name: str) -> list[list[float | None]]:
    data: list[list[float | None]] = page.evaluate(
        "name => window.ringqRtv.charts[name].data.map(col => Array.from(col))", name
    )
    return data


def _wait_until(page: Any, condition: str, timeout_s: float = 20) -> None:
    """Wait until the page's own state satisfies ``condition`` (a JS expression).

    Checked from outside with ``evaluate`` every 100 ms: ``wait_for_function``
    would ``eval`` the condition inside the page, which the page's CSP forbids.
    """
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(f"() => !!(window.ringqRtv && ({condition}))"):
        if time.monotonic() > deadline:
            state = page.evaluate(
                "() => window.ringqRtv && JSON.stringify({ticks: window.ringqRtv.state.ticks, "
                "error: window.ringqRtv.state.error, n: window.ringqRtv.state.points.length})"
            )
            raise AssertionError(f"the page never reached {condition!r}; state {state}")
        page.wait_for_timeout(100)


def _wait_ticks(page: Any, more: int, timeout_s: float = 20) -> None:
    """Wait (on the page's own counter) for ``more`` completed refreshes."""
    now = page.evaluate("window.ringqRtv.state.ticks")
    _wait_until(page, f"window.ringqRtv.state.ticks >= {now + more}", timeout_s)


def _screenshot(page: Any, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)
    print(f"\nrtv screenshot: {path}")


def test_page_against_a_stand_in_monitor(
    browser: Any, fake_monitor: FakeMonitor, tmp_path: Path
) -> None:
    proc, url = _start_rtv(fake_monitor.url, "--token", "page-token")
    try:
        assert url.endswith("/?token=page-token")
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.goto(url)
        _wait_until(page, "window.ringqRtv.state.ticks >= 2")
        assert "token=" not in page.url  # taken out of the address bar
        assert page.locator("#queues tbody tr").count() == 2
        assert page.inner_text("#detail-name") == "alpha"
        assert page.inner_text("#server") == FakeMonitor.SERVER_LINE
        assert page.get_attribute("#server", "class") == "server"  # not flagged
        clients = page.locator("#clients tbody tr").evaluate_all(
            "rows => rows.map(r => [r.dataset.pid, r.dataset.role, r.cells[3].textContent, "
            "r.cells[7].textContent])"
        )
        assert clients == [[str(FakeMonitor.WORKER_PID), "worker", "97.0 msg/s", "7"],
                           [str(FakeMonitor.CLIENT_PID), "client", "10.0 commit/s", "–"]]
        for name in ("depth", "rates", "enq", "deq", "state", "faults"):
            assert len(_chart_data(page, name)[0]) >= 290, name
        before = _chart_data(page, "enq")
        _wait_ticks(page, 3)
        after = _chart_data(page, "enq")
        # new samples arrived without a reload
        assert present(after[0][-1]) > present(before[0][-1])
        # Choosing another window reloads that much history (the stand-in's 1200 s,
        # thinned to no more points than the chart is wide); another queue its own.
        spans = "s.points.length >= 100 && s.thinned && s.lastT - s.points[0].t >= 1100"
        page.select_option("#window", "3600")
        _wait_until(page, f"(s => {spans})(window.ringqRtv.state)")
        page.click("#queues tbody tr[data-queue=beta]")
        _wait_until(page, f"(s => s.queue === 'beta' && {spans})(window.ringqRtv.state)")
        width = page.evaluate("document.getElementById('chart-depth').clientWidth")
        assert page.evaluate("window.ringqRtv.state.points.length") <= width + 5
        assert errors == []
        _screenshot(page, tmp_path / "rtv-stand-in.png")
        page.close()
    finally:
        assert _stop(proc) == 0


class GroupedFakeMonitor(FakeMonitor):
    """The stand-in monitor, with ``beta`` a grouped queue (its samples carry the group figures)."""

    def sample(self, queue: str, t: int) -> dict[str, Any]:
        s = super().sample(queue, t)
        if queue == "beta":
            s.update(groups_ready=2, groups_busy=1, group_oldest_age_s=75.5, group_skips=3)
        return s


GROUPS_LINE = "groups: 2 ready, 1 busy, oldest waiting 1 min 15 s, 3 skips"


def test_a_grouped_queue_gets_a_line_in_the_terminal_view() -> None:
    from rich.console import Console

    assert groups_line({M.GROUP_SKIPS: 1}) == "groups: ? ready, ? busy, oldest waiting ?, 1 skips"
    mon = GroupedFakeMonitor()
    try:
        model = TuiModel(MonitorClient(mon.url), window=60)
        model.update()
        console = Console(record=True, width=160, color_system=None)
        console.print(render(model, mon.url, width=160))
        text = console.export_text()
        assert f"beta  {GROUPS_LINE}" in text and text.count("groups:") == 1
    finally:
        mon.close()


def _page_lines(browser: Any, mon: FakeMonitor, key: str) -> tuple[list[Any], list[list[str]]]:
    """The page of a viewer of ``mon`` after its first tick: each queue's
    ``key`` in the page's state, and the rows of the queues' table (queue,
    class, text). The viewer and ``mon`` are stopped afterwards."""
    proc, url = _start_rtv(mon.url)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url)
        _wait_until(page, "window.ringqRtv.state.ticks >= 1")
        lines = [q.get(key) for q in page.evaluate("window.ringqRtv.state.queues")]
        rows = page.locator("#queues tbody tr").evaluate_all(
            "rows => rows.map(r => [r.dataset.queue, r.className, r.textContent])"
        )
        page.close()
        return lines, rows
    finally:
        assert _stop(proc) == 0
        mon.close()


def test_a_grouped_queue_gets_a_line_on_the_page(browser: Any) -> None:
    lines, rows = _page_lines(browser, GroupedFakeMonitor(), "groups_line")
    assert lines == [None, GROUPS_LINE]
    assert [(q, c) for q, c, _ in rows] == [("alpha", "selected"), ("beta", ""),
                                            ("beta", "groups")]
    assert rows[2][2] == GROUPS_LINE


class WaitingFakeMonitor(GroupedFakeMonitor):
    """The grouped stand-in, with 12 of ``beta``'s entries waiting for their due
    time (issue 24) and none of ``alpha``'s."""

    def sample(self, queue: str, t: int) -> dict[str, Any]:
        s = super().sample(queue, t)
        beta = queue == "beta"
        s.update(waiting_entries=12 if beta else 0, next_due_s=3.2 if beta else 0.0)
        return s


WAITING_LINE = "waiting: 12 entries, next due in 3.2 s"


def test_waiting_line_says_how_many_wait_and_when_the_next_is_due() -> None:
    assert waiting_line({}) is None  # a monitor that does not say
    assert waiting_line({M.WAITING_ENTRIES: 0, M.NEXT_DUE_S: 0.0}) is None
    assert waiting_line({M.WAITING_ENTRIES: 12.0, M.NEXT_DUE_S: 3.2}) == WAITING_LINE
    assert waiting_line({M.WAITING_ENTRIES: 1, M.NEXT_DUE_S: 0}) == "waiting: 1 entry, next due now"
    assert waiting_line({M.WAITING_ENTRIES: 2_500, M.NEXT_DUE_S: 7_380}) == (
        "waiting: 2,500 entries, next due in 2 h 03 min"
    )
    assert waiting_line({M.WAITING_ENTRIES: 3, M.NEXT_DUE_S: None}) == (
        "waiting: 3 entries, next due ?"
    )


def test_waiting_entries_get_a_line_in_the_terminal_view() -> None:
    from rich.console import Console

    mon = WaitingFakeMonitor()
    try:
        model = TuiModel(MonitorClient(mon.url), window=60)
        model.update()
        assert [(q[M.WAITING_ENTRIES], q[M.NEXT_DUE_S]) for q in model.queues] == [
            (0.0, 0.0), (12.0, 3.2)
        ]
        console = Console(record=True, width=160, color_system=None)
        console.print(render(model, mon.url, width=160))
        lines = console.export_text().splitlines()
        at = lines.index(f"beta  {GROUPS_LINE}")
        assert lines[at + 1] == f"beta  {WAITING_LINE}"  # below the groups' line
        assert sum("waiting:" in line for line in lines) == 1  # none for alpha
    finally:
        mon.close()


def test_waiting_entries_get_a_line_on_the_page(browser: Any) -> None:
    lines, rows = _page_lines(browser, WaitingFakeMonitor(), "waiting_line")
    assert lines == [None, WAITING_LINE]
    assert [(q, c) for q, c, _ in rows] == [("alpha", "selected"), ("beta", ""),
                                            ("beta", "groups"), ("beta", "waiting")]
    assert rows[3][2] == WAITING_LINE


# -- the real thing: a monitor over a real database and a workload that runs --------------------


def _workload(dsn: str, queues: list[str], stop: Any, started: Any) -> None:
    """Fill the queues until they are full, then drain them until empty, over
    and over, so depth, rates, latencies and the full/empty periods all move;
    now and then a dequeue is rolled back (a retry on the page)."""
    with connect(dsn) as s:
        n = 0
        started.set()
        while not stop.is_set():
            filling = int(time.monotonic() / 2.5) % 2 == 0
            for q in queues:
                for _ in range(40 if filling else 4):
                    try:
                        s.enqueue(q, b"x" * 64, timeout=0.02)
                    except QueueFull:
                        break
                s.commit()
                for _ in range(10 if filling else 50):
                    if s.dequeue(q) is None:
                        break
                if n % 7 == 0:
                    s.rollback()
                else:
                    s.commit()
            n += 1
            stop.wait(0.01)


def _no_op_worker(dsn: str, queue: str, stop: Any, started: Any) -> None:
    """A worker (role "worker" in the section) handling ``queue``'s messages with a no-op action."""
    app = Actions()
    app.add(queue, lambda msg, session: None)
    with Worker(app, dsn, config=WorkerConfig(idle_wait=0.1)) as w:
        w.open()
        started.set()
        while not stop.is_set():
            w.run_one(wait=0.1)


@pytest.fixture
def live_queues(dsn: str) -> Iterator[list[str]]:
    names = ["rtv_" + uuid.uuid4().hex[:8], "rtv_" + uuid.uuid4().hex[:8]]
    with psycopg.connect(dsn) as conn:
        for name in names:
            create_queue(conn, QueueSpec(name, 400, 256))
    yield names
    remove_section(dsn)


def test_page_live_over_a_real_monitor_and_workload(
    browser: Any, dsn: str, live_queues: list[str], tmp_path: Path
) -> None:
    from ringq.monitor import Monitor, MonitorConfig

    stop, started, handling = FORK.Event(), FORK.Event(), FORK.Event()
    with Monitor(
        MonitorConfig(dsn, port=0, token="mon-secret", interval=0.5, recovery_interval=0.1)
    ) as mon:
        assert mon.url
        worker = FORK.Process(target=_workload, args=(dsn, live_queues, stop, started), daemon=True)
        worker.start()
        # A no-op worker on the queue the page does not chart (the first by name is charted).
        served = sorted(live_queues)[1]
        handler = FORK.Process(
            target=_no_op_worker, args=(dsn, served, stop, handling), daemon=True
        )
        handler.start()
        env = {**os.environ, "RINGQ_MONITOR_TOKEN": "mon-secret"}
        env.pop("RINGQ_RTV_TOKEN", None)
        proc, url = _start_rtv(mon.url, "--refresh", "0.5", env=env)
        try:
            assert started.wait(30) and handling.wait(30)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            _wait_until(
                page,
                "window.ringqRtv.state.ticks >= 2 && window.ringqRtv.state.points.length >= 2",
                30,
            )
            assert sorted(page.locator("#queues tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.queue)")) == sorted(live_queues)
            # The header names the server the monitor is on: the primary, on the
            # section's timeline.
            _wait_until(
                page,
                r"/^server \S+:\d+ primary, timeline (\d+) \(section: timeline \1\)$/"
                ".test(document.getElementById('server').textContent)",
            )
            assert page.get_attribute("#server", "class") == "server"  # not flagged
            first = _chart_data(page, "rates")
            _wait_ticks(page, 16)  # eight seconds of the workload: filled and drained
            second = _chart_data(page, "rates")
            assert len(second[0]) > len(first[0]) and present(second[0][-1]) > present(first[0][-1])
            assert second != first
            assert max(v or 0 for v in second[1]) > 0, "no enqueue rate plotted"
            depth = _chart_data(page, "depth")
            assert max(v or 0 for v in depth[1]) > 0 and depth[2][-1] == 400  # depth, capacity
            enq = _chart_data(page, "enq")
            assert max(v or 0 for v in enq[2]) >= max(v or 0 for v in enq[1]) > 0  # p99 >= p50 > 0
            # The clients table: the worker first, having handled messages, then the
            # workload's session.
            _wait_until(
                page,
                "window.ringqRtv.state.clients.some("
                f"c => c.pid === {handler.pid} && c.handled > 0)",
            )
            _wait_ticks(page, 1)
            rows = page.locator("#clients tbody tr").evaluate_all(
                "rows => rows.map(r => [Number(r.dataset.pid), r.dataset.role, "
                "r.cells[2].textContent,"
                " r.cells[4].textContent])"
            )
            print(f"clients table: {rows}")
            assert rows[0][:3] == [handler.pid, "worker", served] and rows[0][3] not in ("0", "–")
            assert [worker.pid, "client"] in [r[:2] for r in rows]
            assert errors == []
            _screenshot(page, tmp_path / "rtv-live.png")

            # A wrong token gets 401, in the browser as elsewhere.
            bad = browser.new_page()
            response = bad.goto(url.split("?")[0] + "?token=wrong")
            assert response is not None and response.status == 401
            assert "token" in bad.inner_text("body")
            assert bad.goto(url.split("?")[0]).status == 401  # and no token at all
            bad.close()
            page.close()
        finally:
            stop.set()
            for child in (worker, handler):
                child.join(20)
                if child.is_alive():
                    child.kill()
            assert _stop(proc) == 0


def test_rtv_command_help_lists_its_variables() -> None:
    out = subprocess.run(
        [*RINGQ, "rtv", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for var in ("RINGQ_RTV_PORT", "RINGQ_MONITOR_URL", "RINGQ_MONITOR_TOKEN", "RINGQ_RTV_TOKEN"):
        assert var in out
    assert "--tui" in out
