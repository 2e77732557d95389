"""``ringq status``: every queue's state, from the running monitor's ``/api/queues``."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ringq.engine import ConfigError, exits, ringq_home

from ._args import env_option, subparser

RET_OK = exits.OK
RET_UNREACHABLE = exits.FAILURE  # no monitor answered, or it refused the token

DEFAULT_URL = "http://127.0.0.1:7480"

DESCRIPTION = """\
Print which server the monitor is on (whether it is the primary, its
timeline, and the one the queues' section describes; flagged when they
differ), then every queue's state as the monitor sees it: capacity, depth, fill,
committed enqueue/dequeue rates, call latencies (p50/p99, microseconds),
delivery retries, entries in the exception table, sleeping dequeuers and
enqueuers, and a state (full, high, empty, ok), with a line under a grouped
queue's row (groups ready and busy, how long the oldest ready entry of any
group has waited, entries read past a busy group) and one under a queue
whose entries wait for their due time (a delay or a retry's backoff: how
many, and when the next falls due); then one row per client
session (pid, role, queues, commits, worker handled/failed/timeouts, errors
and the last one). The monitor is found at
--monitor, else where a local `ringq monitor` recorded it
($RINGQ_HOME/monitor/monitor.json), else at http://127.0.0.1:7480."""

HIGH_WATER = 0.8
MAX_TIMEOUT = 3600.0  # seconds


def register(sub: Any) -> None:
    p = subparser(sub, "status", "print every queue's state from the monitor", DESCRIPTION)
    env_option(p, "--monitor", env="RINGQ_MONITOR_URL", default=None, help="the monitor's base URL")
    env_option(
        p,
        "--token",
        env="RINGQ_MONITOR_TOKEN",
        default=None,
        help="the monitor's token, if it has one",
    )
    env_option(p, "--data-dir", env="RINGQ_MONITOR_DIR", default=None,
               help="where a local monitor records its URL; default $RINGQ_HOME/monitor")
    p.add_argument("--json", action="store_true", help="print the monitor's JSON document as it is")
    p.add_argument("--timeout", type=float, default=5.0,
                   help=f"seconds to wait for the monitor (at most {MAX_TIMEOUT:g})")
    p.set_defaults(func=run)


def monitor_url(args: argparse.Namespace) -> str:
    if args.monitor:
        return str(args.monitor).rstrip("/")
    from ringq.monitor import read_state

    data_dir = Path(args.data_dir) if args.data_dir else ringq_home() / "monitor"
    url = (read_state(data_dir) or {}).get("url")
    if isinstance(url, str) and url:
        return url.rstrip("/")
    return DEFAULT_URL


def fetch(url: str, token: str | None, timeout: float, path: str = "/api/queues") -> dict[str, Any]:
    """GET ``url/api/queues`` (or ``path``).

    :raises OSError: unreachable or refused (the message says which).
    """
    req = urllib.request.Request(url + path)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise OSError(
                f"the monitor at {url} wants a token (--token or RINGQ_MONITOR_TOKEN)"
            ) from exc
        raise OSError(f"the monitor at {url} answered {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise OSError(
            f"no monitor answers at {url}: {reason} (is `ringq monitor` running?)"
        ) from exc
    if not isinstance(doc, dict) or path.rsplit("/", 1)[-1] not in doc:
        raise OSError(f"{url}{path} did not answer a ringq document")
    return doc


def fetch_clients(url: str, token: str | None, timeout: float) -> list[dict[str, Any]] | None:
    """The monitor's ``/api/clients`` list, None if it does not serve one (an older monitor)."""
    try:
        return list(fetch(url, token, timeout, "/api/clients")["clients"])
    except OSError:
        return None


def check_monitor_url(url: str, where: str = "--monitor") -> str:
    """Return ``url`` if it can address a monitor (``http(s)://host[:port]``).

    :raises ConfigError: another scheme, no host, or a port that is not a number.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number, a bad IPv6 address
        raise ConfigError(f"{where}: not a monitor address {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise ConfigError(f"{where}: not a monitor address {url!r} (expected http://HOST:PORT)")
    return url


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT):
        raise ConfigError(
            f"--timeout must be a number of seconds above 0, at most {MAX_TIMEOUT:g}, "
            f"not {args.timeout:g}"
        )
    url = check_monitor_url(
        monitor_url(args),
        "--monitor (or RINGQ_MONITOR_URL)" if args.monitor else "the recorded monitor URL",
    )
    try:
        doc = fetch(url, args.token, args.timeout)
    except OSError as exc:
        print(f"ringq status: {exc}", file=sys.stderr)
        return RET_UNREACHABLE
    clients = fetch_clients(url, args.token, args.timeout)
    if args.json:
        if clients is not None:
            doc = {**doc, "clients": clients}
        json.dump(doc, sys.stdout, indent=2)
        print()
        return RET_OK
    print(render(doc, url))
    if clients is not None:
        print()
        print(render_clients(clients))
    return RET_OK


def queue_state(q: dict[str, Any]) -> str:
    cap = q.get("capacity") or 0
    depth = q.get("depth") or 0
    if cap and q.get("head", 0) - q.get("tail", 0) >= cap:
        return "full"
    if cap and depth >= HIGH_WATER * cap:
        return "high"
    if depth <= 0:
        return "empty"
    return "ok"


COLUMNS = ("QUEUE", "CAPACITY", "DEPTH", "FILL", "ENQ/S", "DEQ/S", "ENQ P50/P99", "DEQ P50/P99",
           "RETRIES", "EXC", "WAIT D/E", "STATE")
_LEFT = {"QUEUE", "STATE"}


def _us(x: Any) -> str:
    x = float(x or 0)
    return "-" if x == 0 else (f"{x / 1000:.0f}ms" if x >= 10_000 else f"{x:.0f}")


def render(doc: dict[str, Any], url: str) -> str:
    """Plain aligned text: a line about the monitor, one about the server it is
    on (when the monitor says), then one row per queue."""
    mon = doc.get("monitor", {})
    lines = []
    age = time.time() - float(doc.get("t") or 0)
    up = time.time() - float(mon.get("started") or time.time())
    failing = [
        k
        for k, s in mon.get("steps", {}).items()
        if s.get("last_failure_t")
        and s.get("failures")
        and s["last_failure_t"] > time.time() - 10 * float(mon.get("interval", 1))
    ]
    lines.append(
        f"monitor {url}  pid {mon.get('pid', '?')}  up {_duration(up)}  every "
        f"{mon.get('interval', '?')}s  "
        f"clients {mon.get('clients', 0)}  sampled {age:.1f}s ago"
        + (f"  FAILING: {', '.join(failing)}" if failing else "")
        + ("" if mon.get("database", True) else "  DATABASE UNREACHABLE")
    )
    from ringq.rtv import groups_line, server_line, waiting_line

    if "server" in doc:  # a monitor older than the server object says nothing
        lines.append(server_line(doc["server"]).text)
    queues = doc.get("queues", [])
    if not queues:
        lines.append("no queues")
        return "\n".join(lines)
    rows: list[tuple[str, ...]] = []
    # row -> the lines printed under it (a grouped queue's, one with entries waiting)
    below: dict[int, list[str]] = {}
    for q in queues:
        for extra in (groups_line(q), waiting_line(q)):
            if extra is not None:
                below.setdefault(len(rows), []).append("  " + extra)
        cap = int(q.get("capacity") or 0)
        depth = int(q.get("depth") or 0)
        rows.append((
            str(q.get("name")),
            f"{cap:,}",
            f"{depth:,}",
            f"{100 * depth / cap:.0f}%" if cap else "-",
            f"{float(q.get('enq_rate') or 0):,.1f}",
            f"{float(q.get('deq_rate') or 0):,.1f}",
            f"{_us(q.get('enq_p50_us'))}/{_us(q.get('enq_p99_us'))}",
            f"{_us(q.get('deq_p50_us'))}/{_us(q.get('deq_p99_us'))}",
            f"{int(q.get('retries') or 0):,}",
            f"{int(q.get('exceptions') or 0):,}",
            f"{int(q.get('waiting_dequeuers') or 0)}/{int(q.get('waiting_enqueuers') or 0)}",
            queue_state(q),
        ))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]

    def line(cells: tuple[str, ...]) -> str:
        out = [
            c.ljust(w) if COLUMNS[i] in _LEFT else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    lines.append(line(COLUMNS))
    for i, r in enumerate(rows):
        lines.append(line(r))
        lines.extend(below.get(i, ()))
    lines.append(
        "latencies in microseconds (p50/p99 of the last interval); "
        "rates are committed entries per second"
    )
    return "\n".join(lines)


CLIENT_COLUMNS = ("PID", "ROLE", "QUEUES", "COMMITS", "ROLLBACKS", "COMMIT/S", "HANDLED", "FAILED",
                  "TIMEOUTS", "ERRORS", "LAST ERROR")
_CLIENT_LEFT = {"PID", "ROLE", "QUEUES", "LAST ERROR"}


def render_clients(clients: list[dict[str, Any]]) -> str:
    """One row per client entry of the section (from ``/api/clients``)."""
    if not clients:
        return "no clients"
    rows = []
    for c in clients:
        last = c.get("last_error") or None
        err = "-"
        if last:
            err = f"{last.get('kind')} {last.get('queue') or '-'}"
            if last.get("seq") is not None:
                err += f"#{last['seq']}"
        role = str(c.get("role", "?")) + (
            "" if c.get("state", "active") == "active" else f" ({c['state']})"
        )
        worker = c.get("role") == "worker"
        rows.append((
            str(c.get("pid")),
            role,
            ",".join(c.get("queues") or []) or "-",
            f"{int(c.get('commits') or 0):,}",
            f"{int(c.get('rollbacks') or 0):,}",
            f"{float(c.get('commit_rate') or 0):,.1f}",
            f"{int(c.get('handled') or 0):,}" if worker else "-",
            f"{int(c.get('failed') or 0):,}" if worker else "-",
            f"{int(c.get('timeouts') or 0):,}" if worker else "-",
            f"{int(c.get('errors') or 0):,}",
            err,
        ))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(CLIENT_COLUMNS)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if CLIENT_COLUMNS[i] in _CLIENT_LEFT else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(CLIENT_COLUMNS), *(line(r) for r in rows)])


def _duration(s: float) -> str:
    s = max(0, int(s))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
