"""``ringq monitor``: run the monitor of one database (foreground, or ``--detach``).

Signals: the first SIGTERM (or SIGINT) drains — the step under way finishes,
the loop and the HTTP service stop, exit 0; a second one exits at once (130).
SIGHUP reopens the log file (for logrotate) and re-reads ``--config``.
The handlers only set flags; the main thread acts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import tomllib
from pathlib import Path
from types import FrameType
from typing import Any

from ringq.engine import (
    ConfigError,
    DatabaseUnavailable,
    RingqError,
    SchemaMissing,
    resolve_dsn,
    ringq_home,
)

from . import _exit
from ._args import env_option, subparser

# Exit codes of `ringq monitor` (the shared values of `ringq --help`).
RET_OK = _exit.OK  # stopped after a drain
RET_FAILURE = _exit.FAILURE  # could not start (port, files, schema), or the loop died
RET_USAGE = _exit.USAGE  # bad option or config file
RET_DB_UNAVAILABLE = _exit.DB_UNAVAILABLE  # the database cannot be reached at start
RET_ALREADY_RUNNING = _exit.CONFLICT  # another monitor serves the database (or the pidfile is live)
RET_INTERRUPTED = _exit.INTERRUPTED  # a second signal: exited without finishing the drain

RELOADABLE = ("interval", "recovery_interval", "token", "prepared_timeout", "high_water")

DESCRIPTION = """\
The monitor of a database's queues: rebuilds the global section from the
tables at start, recovers clients killed at any point (their slots come back
within a second), reclaims consumed slots, moves entries enqueued through SQL
into the rings, resolves prepared transactions, samples per-queue performance
(T4 CSV files and monitor.log in --data-dir) and serves it over HTTP:
/api/queues, /api/queues.xml, /api/history, /metrics (see monitor/API.md).

Runs in the foreground until SIGTERM or Ctrl-C (drains: the step under way
finishes; a second signal exits at once). SIGHUP reopens monitor.log and
re-reads --config, whose keys (interval, recovery_interval, token,
prepared_timeout, high_water) override the options. Prefer RINGQ_MONITOR_TOKEN
or the config file to --token, which other users can see in ps."""


def register(sub: Any) -> None:
    p = subparser(sub, "monitor", "run the monitor (recovery, reclaim, metrics, HTTP)", DESCRIPTION)
    env_option(p, "--dsn", env="RINGQ_DSN", help="PostgreSQL DSN; default: the embedded cluster under $RINGQ_HOME")
    env_option(p, "--port", env="RINGQ_MONITOR_PORT", default=7480, type=int, help="HTTP port (0: any free port)")
    env_option(p, "--host", env="RINGQ_MONITOR_HOST", default="127.0.0.1", help="HTTP address to listen on")
    env_option(p, "--interval", env="RINGQ_MONITOR_INTERVAL", default=1.0, type=float,
               help="seconds between performance samples")
    env_option(p, "--token", env="RINGQ_MONITOR_TOKEN", default=None,
               help="token required by every HTTP path but /metrics")
    env_option(p, "--data-dir", env="RINGQ_MONITOR_DIR", default=None,
               help="T4 files, monitor.log, monitor.json; default $RINGQ_HOME/monitor")
    env_option(p, "--prepared-timeout", env="RINGQ_MONITOR_PREPARED_TIMEOUT", default=60.0, type=float,
               help="seconds before an undecided prepared transaction is rolled back")
    env_option(p, "--config", env="RINGQ_MONITOR_CONFIG", default=None,
               help="TOML file of reloadable settings, re-read on SIGHUP")
    env_option(p, "--pidfile", env="RINGQ_MONITOR_PIDFILE", default=None,
               help="write the monitor's pid here (default with --detach: DATA_DIR/monitor.pid)")
    p.add_argument("--detach", action="store_true", help="run in the background; exit once it serves")
    p.add_argument("--reset-section", action="store_true",
                   help="remove the database's global section first (after a layout change; "
                        "stop every client first), then run")
    env_option(p, "--log-level", env="RINGQ_LOG_LEVEL", default="info",
               help="stderr log level (debug, info, warning, error)")
    p.set_defaults(func=run)


# -- the command -----------------------------------------------------------------------------


class _Flags:
    """What the signal handlers tell the main thread (they do nothing else)."""

    def __init__(self) -> None:
        self.terms = 0
        self.hup = False

    def on_term(self, signum: int, frame: FrameType | None) -> None:
        self.terms += 1

    def on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.hup = True


def run(args: argparse.Namespace) -> int:
    import logging

    from ringq.monitor import Monitor, MonitorConfig, MonitorRunning

    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        print(f"ringq monitor: unknown log level {args.log_level!r}", file=sys.stderr)
        return RET_USAGE
    dsn = resolve_dsn(args.dsn)
    data_dir = Path(args.data_dir) if args.data_dir else ringq_home() / "monitor"
    data_dir = data_dir.resolve()
    config_path = Path(args.config).resolve() if args.config else None
    pidfile = Path(args.pidfile).resolve() if args.pidfile else (data_dir / "monitor.pid" if args.detach else None)
    try:
        config = MonitorConfig(
            dsn=dsn, interval=args.interval, port=args.port, host=args.host, token=args.token or None,
            data_dir=data_dir, prepared_timeout=args.prepared_timeout,
        )
        if config_path is not None:
            config = config.replace(**_read_config(config_path))
    except ConfigError as exc:
        print(f"ringq monitor: {exc}", file=sys.stderr)
        return RET_USAGE

    if args.reset_section:
        code = _reset_section(dsn)
        if code != RET_OK:
            return code

    report: int | None = None  # the daemon's pipe to the waiting parent
    if args.detach:
        data_dir.mkdir(parents=True, exist_ok=True)
        role, value = _daemonize(data_dir)
        if role == "parent":
            return value  # the daemon's verdict
        report = value
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger("ringq")
    root.addHandler(handler)
    root.setLevel(level)

    def tell(code: int, text: str) -> int:
        if report is not None:
            os.write(report, f"{code} {text}\n".encode())
            os.close(report)
        else:
            print(text, file=sys.stdout if code == RET_OK else sys.stderr, flush=True)
        return code

    if pidfile is not None:
        other = _take_pidfile(pidfile)
        if other:
            return tell(RET_ALREADY_RUNNING, f"ringq monitor: already running (pid {other}, pidfile {pidfile})")
    flags = _Flags()
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, flags.on_term),
        signal.SIGINT: signal.signal(signal.SIGINT, flags.on_term),
        signal.SIGHUP: signal.signal(signal.SIGHUP, flags.on_hup),
    }
    monitor = Monitor(config)
    try:
        try:
            monitor.start()
        except MonitorRunning as exc:
            return tell(RET_ALREADY_RUNNING, f"ringq monitor: {exc}")
        except DatabaseUnavailable as exc:
            return tell(RET_DB_UNAVAILABLE, f"ringq monitor: {exc}")
        except (SchemaMissing, RingqError) as exc:
            return tell(RET_FAILURE, f"ringq monitor: {exc}")
        tell(RET_OK, f"ringq monitor: pid {os.getpid()} serving {monitor.url or '(no HTTP)'}; data in {data_dir}")
        return _serve(monitor, flags, config_path, pidfile)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if pidfile is not None:
            _release_pidfile(pidfile)


def _serve(monitor: Any, flags: _Flags, config_path: Path | None, pidfile: Path | None) -> int:
    import logging

    log = logging.getLogger("ringq.monitor")
    while not flags.terms:
        if flags.hup:
            flags.hup = False
            _reload(monitor, config_path, log)
        if not monitor.running:
            log.error("ringq monitor: the loop ended unexpectedly")
            monitor.stop()
            return RET_FAILURE
        time.sleep(0.1)
    log.info("ringq monitor: stopping (finishing the step under way; signal again to exit at once)")
    stopper = threading.Thread(target=monitor.stop, name="ringq-monitor-stop", daemon=True)
    stopper.start()
    while stopper.is_alive():
        stopper.join(0.05)
        if flags.terms >= 2:
            if pidfile is not None:
                _release_pidfile(pidfile)
            print("ringq monitor: second signal: exiting without draining", file=sys.stderr, flush=True)
            os._exit(RET_INTERRUPTED)
    log.info("ringq monitor: stopped")
    return RET_OK


def _reload(monitor: Any, config_path: Path | None, log: Any) -> None:
    import logging

    monitor.reopen_log()
    if config_path is None:
        log.info("ringq monitor: SIGHUP: log reopened (no --config to re-read)")
        return
    try:
        changes = _read_config(config_path)
        new = monitor.reconfigure(**changes)
    except (ConfigError, OSError) as exc:
        monitor.note("config.rejected", logging.ERROR, path=str(config_path), error=str(exc),
                     outcome="kept the old settings")
        return
    log.info("ringq monitor: SIGHUP: settings re-read from %s (interval %gs)", config_path, new.interval)


def _read_config(path: Path) -> dict[str, Any]:
    """The reloadable settings of a TOML file.

    :raises ConfigError: unreadable, not TOML, or an unknown key.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    unknown = sorted(set(data) - set(RELOADABLE))
    if unknown:
        raise ConfigError(f"config file {path}: unknown keys {unknown}; known: {list(RELOADABLE)}")
    return data


# -- --reset-section ------------------------------------------------------------------------


def _reset_section(dsn: str) -> int:
    import psycopg
    from ringq.engine import Section, SectionIncompatible
    from ringq.engine import _layout as L
    from ringq.engine._errors import from_psycopg
    from ringq.engine._section import pid_alive
    from ringq.monitor import _queries as Qy

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute(Qy.INSTANCE_ID).fetchone()
            qids = [r[0] for r in conn.execute(Qy.QUEUES).fetchall()]
            locked = conn.execute(Qy.TRY_MONITOR_LOCK).fetchone()
            if not locked or not locked[0]:
                print("ringq monitor: another monitor serves this database: stop it before --reset-section",
                      file=sys.stderr)
                return RET_ALREADY_RUNNING
    except psycopg.errors.UndefinedTable:
        print("ringq monitor: no ringq schema in this database: nothing to reset", file=sys.stderr)
        return RET_OK
    except psycopg.Error as exc:
        raise from_psycopg(exc, dsn=dsn) from exc
    if not row:
        return RET_OK
    instance = str(row[0])
    try:
        sec = Section.attach(instance, create=False)
    except SectionIncompatible:
        sec = None  # made by another layout: its clients are of another version; it goes
    except RingqError:
        print("ringq monitor: no global section to reset", file=sys.stderr)
        return RET_OK
    if sec is not None:
        try:
            live = sorted({sec.c(i, L.C_PID) for i in sec.active_clients() if pid_alive(sec.c(i, L.C_PID))})
        finally:
            sec.close()
        if live:
            print(f"ringq monitor: {len(live)} live clients use the section (pids {live[:10]}): "
                  "stop them before --reset-section", file=sys.stderr)
            return RET_ALREADY_RUNNING
    Section.unlink(instance)
    Section.unlink_semaphores(instance, qids)
    print(f"ringq monitor: global section of instance {instance} removed; it is rebuilt from the tables",
          file=sys.stderr)
    return RET_OK


# -- --detach and the pidfile ---------------------------------------------------------------


def _daemonize(data_dir: Path) -> tuple[str, int]:
    """Fork into the background (before any thread or connection exists).

    Returns ``("parent", exit code)`` in the original process once the
    daemon reported that it serves (or why it could not), and
    ``("daemon", fd)`` in the daemon, which reports on ``fd``.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(w)
        chunks = []
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(r)
        os.waitpid(pid, 0)
        text = b"".join(chunks).decode(errors="replace").strip()
        if not text:
            print("ringq monitor: the background monitor died while starting; see "
                  f"{data_dir / 'monitor.out'}", file=sys.stderr)
            return "parent", RET_FAILURE
        code_s, _, message = text.partition(" ")
        code = int(code_s)
        print(message, file=sys.stdout if code == RET_OK else sys.stderr, flush=True)
        return "parent", code
    # First child: a new session, then fork again so the daemon is no session leader.
    os.close(r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(data_dir / "monitor.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(devnull)
    os.close(out)
    return "daemon", w


def _take_pidfile(path: Path) -> int | None:
    """Write our pid; return the pid of a live monitor already named there instead."""
    try:
        other = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        other = 0
    if other and other != os.getpid() and _alive(other):
        return other
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(path)
    return None


def _release_pidfile(path: Path) -> None:
    try:
        if int(path.read_text().split()[0]) == os.getpid():
            path.unlink()
    except (OSError, ValueError, IndexError):
        pass


def _alive(pid: int) -> bool:
    from ringq.engine._section import pid_alive

    return pid_alive(pid)


def read_state(data_dir: Path) -> dict[str, Any] | None:
    """The running monitor's state file (pid, url), if any (used by ``ringq status``)."""
    try:
        state = json.loads((data_dir / "monitor.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None
