"""``ringq run``: the main job (what ``make run`` does).

Starts the embedded PostgreSQL (unless ``--dsn``), the monitor and the Real
Time Viewer in the background, prints the viewer's address, then runs one
regression cycle proven by Spark in the foreground. The monitor and the viewer
stay up afterwards so the plots can be looked at; ``ringq run --stop`` stops
them and the embedded database.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from ringq.engine import ConfigError, RingqError, exits, pid_alive, ringq_home

from ._args import add_cycle_options, add_dsn, env_option, subparser

RTV_PIDFILE = "rtv.pid"
RTV_LOG = "rtv.log"
RTV_URL = "rtv.url"


def register(sub: Any) -> None:
    p = subparser(
        sub,
        "run",
        "the main job: database, monitor, viewer and one regression cycle proven by Spark",
        description=__doc__,
    )
    add_dsn(p)
    # the regression cycle's shape, passed on to 'ringq regress'
    add_cycle_options(p, "RINGQ_RUN_", entries=4000, capacity=1000)
    env_option(p, "--monitor-port", env="RINGQ_MONITOR_PORT", default=7480, type=int,
               help="monitor HTTP port (another free port if taken)")
    env_option(p, "--rtv-port", env="RINGQ_RTV_PORT", default=7481, type=int,
               help="viewer port (another free port if taken)")
    env_option(
        p, "--home", env="RINGQ_HOME", default=None, help="embedded cluster home (default ./.ringq)"
    )
    p.add_argument(
        "--chaos",
        action="store_true",
        help="run the cycle with fault injection (ringq regress --chaos): producers, consumers "
        "and this monitor are killed -9 and restarted; the monitor comes back on its port",
    )
    p.add_argument(
        "--stop", action="store_true", help="stop the viewer, the monitor and the embedded database"
    )
    p.set_defaults(func=run, _parser=p)


def _say(text: str) -> None:
    print(f"run: {text}", flush=True)


def _ringq(*args: str) -> list[str]:
    return [sys.executable, "-m", "ringq.cli", *args]


def _port_or_any(port: int) -> int:
    if port == 0:
        return 0
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return 0
    return port


def run(args: argparse.Namespace) -> int:
    if args.home:
        os.environ["RINGQ_HOME"] = args.home
    home = ringq_home()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot use {home} as the home: {exc.strerror or exc}") from exc
    if args.stop:
        return _stop(home, stop_db=not args.dsn)

    dsn = args.dsn
    if not dsn:
        from ringq.cluster import Cluster

        t0 = time.monotonic()
        dsn = Cluster(home).start()
        _say(f"database: embedded PostgreSQL at {dsn} ({time.monotonic() - t0:.1f}s)")
    else:
        _say("database: the one given by --dsn / RINGQ_DSN")

    from ringq.scripting import QueueSpec, connect_admin, create_queue

    with connect_admin(dsn) as conn:
        created = create_queue(conn, QueueSpec("demo", capacity=1000, max_payload=512))
    _say(f"queues: schema ready; queue 'demo' {'created' if created else 'exists'} (1,000 slots)")
    monitor_url = _start_monitor(home, dsn, args.monitor_port)
    _say(f"monitor: {monitor_url}  (ringq status; Prometheus at {monitor_url}/metrics)")
    viewer = _start_viewer(home, monitor_url, args.rtv_port)
    print(f"\n  Real Time Viewer: {viewer}\n", flush=True)

    from ringq.regression import new_run_id

    run_id = new_run_id()
    cmd = _ringq(
        "regress",
        "--dsn", dsn,
        "--cycles", str(args.cycles),
        "--entries-per-queue", str(args.entries_per_queue),
        "--capacity", str(args.capacity),
        "--payload-sizes", args.payload_sizes,
        "--grouped-consumers", str(args.grouped_consumers),
        "--groups", str(args.groups),
        "--monitor-dir", str(home / "monitor"),  # where the monitor started above keeps its state
        "--run-id", run_id,  # known here: its page is printed at the end
    )
    if args.chaos:
        cmd.append("--chaos")
    _say("regression: " + " ".join(cmd[3:5]) + " ... (Spark proves the cycle at its end)")
    t0 = time.monotonic()
    try:
        rc = subprocess.call(cmd)
    except KeyboardInterrupt:
        rc = exits.INTERRUPTED
    _say(f"regression finished in {time.monotonic() - t0:.0f}s with exit code {rc} "
         f"({'proven: no violations' if rc == 0 else 'see the report above'})")
    reports = os.environ.get("RINGQ_REGRESS_REPORTS") or home / "regress"  # as regress reads it
    page = Path(reports) / run_id / "run.html"
    if page.is_file():
        _say(f"charts: {page} (each cycle's page beside it; ringq report --runs A B compares runs)")
    print(
        f"\n  The monitor and the viewer keep running: {viewer}\n"
        "  Stop everything with: ringq run --stop   (or: .venv/bin/ringq run --stop)\n",
        flush=True,
    )
    return rc


def _start_monitor(home: Path, dsn: str, port: int) -> str:
    state_file = home / "monitor" / "monitor.json"
    try:
        state = json.loads(state_file.read_text())
        if pid_alive(int(state["pid"])) and _answers(state["url"] + "/metrics"):
            return str(state["url"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    port = _port_or_any(port)
    rc = subprocess.call(_ringq("monitor", "--dsn", dsn, "--port", str(port), "--detach"))
    if rc != 0:
        raise SystemExit(
            f"run: the monitor did not start (exit {rc}); see {home / 'monitor' / 'monitor.log'}"
        )
    state = json.loads(state_file.read_text())
    return str(state["url"])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _start_viewer(home: Path, monitor_url: str, port: int) -> str:
    pidfile, urlfile = home / RTV_PIDFILE, home / RTV_URL
    try:
        pid = int(pidfile.read_text())
        url = urlfile.read_text().strip()
        if pid_alive(pid) and url:
            return url
    except (OSError, ValueError):
        pass
    token = os.environ.get("RINGQ_RTV_TOKEN") or secrets.token_urlsafe(18)
    log = home / RTV_LOG
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _ringq(
                "rtv", "--port", str(_port_or_any(port)), "--monitor", monitor_url, "--token", token
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 20
    url = ""
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"(http://127\.0\.0\.1:\d+/\?token=\S+)", log.read_text())
        if m:
            url = m.group(1)
            break
        time.sleep(0.1)
    if not url:
        raise SystemExit(f"run: the viewer did not start; see {log}")
    pidfile.write_text(str(proc.pid))
    urlfile.write_text(url)
    return url


def _stop(home: Path, *, stop_db: bool) -> int:
    pidfile = home / RTV_PIDFILE
    try:
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGTERM)
        _say(f"viewer (pid {pid}) stopped")
    except (OSError, ValueError):
        pass
    pidfile.unlink(missing_ok=True)
    (home / RTV_URL).unlink(missing_ok=True)
    state_file = home / "monitor" / "monitor.json"
    try:
        pid = int(json.loads(state_file.read_text())["pid"])
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        _say(f"monitor (pid {pid}) stopped")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if stop_db:
        from ringq.cluster import Cluster

        cluster = Cluster(home)
        _remove_section(cluster)
        cluster.stop()
        _say("embedded database stopped")
    return exits.OK


def _remove_section(cluster: Any) -> None:
    """The run's global section and semaphores go with its database (they would
    outlive it in /dev/shm); the monitor and the viewer are stopped already."""
    from ringq.scripting import connect_admin, remove_section

    if not cluster.status().running:
        return
    try:
        with connect_admin(cluster.url()) as conn:
            instance = remove_section(conn)
    except RingqError as exc:
        _say(f"global section not removed: {exc}")
        return
    if instance:
        _say(f"global section {instance} and its semaphores removed")
