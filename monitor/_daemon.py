"""The monitor as a daemon: the body of ``ringq monitor`` (foreground, or detached).

Signals: the first SIGTERM (or SIGINT) drains — the step under way finishes,
the loop and the HTTP service stop, exit 0; a second one exits at once (130).
SIGHUP reopens the log file (for logrotate) and re-reads the config file.
The handlers only set flags; the main thread acts on them. Exit codes are
those of :mod:`ringq.engine.exits`.
"""

from __future__ import annotations

import json
import logging
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
    Section,
    SectionIncompatible,
    exits,
    pg,
    pid_alive,
)
from ringq.engine import layout as L

from . import _queries as Qy
from ._config import MonitorConfig
from ._errors import MonitorRunning
from ._service import Monitor
from ._statefile import STATE_FILE

# Exit codes of the monitor daemon (the shared values of `ringq --help`).
RET_OK = exits.OK  # stopped after a drain
RET_FAILURE = exits.FAILURE  # could not start (port, files, schema), or the loop died
RET_USAGE = exits.USAGE  # bad option or config file
RET_DB_UNAVAILABLE = exits.DB_UNAVAILABLE  # the database cannot be reached at start
RET_ALREADY_RUNNING = exits.CONFLICT  # another monitor serves the database (or the pidfile is live)
RET_INTERRUPTED = exits.INTERRUPTED  # a second signal: exited without finishing the drain

# Settings a config file may hold (re-read on SIGHUP).
RELOADABLE = (
    "interval", "recovery_interval", "token", "prepared_timeout", "high_water", "xmin_warn_s",
    "vacuum_dead_rows",
)


class _Flags:
    """What the signal handlers tell the main thread (they do nothing else)."""

    def __init__(self) -> None:
        self.terms = 0
        self.hup = False

    def on_term(self, signum: int, frame: FrameType | None) -> None:
        self.terms += 1

    def on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.hup = True


def run_daemon(
    config: MonitorConfig,
    *,
    config_path: Path | None = None,
    pidfile: Path | None = None,
    detach: bool = False,
    log_level: int = logging.INFO,
) -> int:
    """Run the monitor of ``config`` until SIGTERM or SIGINT; returns an exit code.

    ``config_path`` is the TOML file re-read on SIGHUP (:data:`RELOADABLE`
    keys); ``pidfile`` is written while it runs; ``detach`` forks into the
    background first (``config.data_dir`` holds its ``monitor.out``) and
    returns, in the original process, once the daemon serves or failed.
    ``log_level`` is the level of the stderr log of the ``ringq`` loggers.
    Installs SIGTERM, SIGINT and SIGHUP handlers and restores the previous ones.
    """
    data_dir = config.data_dir
    report: int | None = None  # the daemon's pipe to the waiting parent
    if detach:
        if data_dir is None:
            raise ConfigError("a detached monitor needs a data_dir (for its monitor.out)")
        data_dir.mkdir(parents=True, exist_ok=True)
        role, value = _daemonize(data_dir)
        if role == "parent":
            return value  # the daemon's verdict
        report = value
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger("ringq")
    root.addHandler(handler)
    root.setLevel(log_level)

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
            return tell(
                RET_ALREADY_RUNNING,
                f"ringq monitor: already running (pid {other}, pidfile {pidfile})",
            )
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
        tell(
            RET_OK,
            f"ringq monitor: pid {os.getpid()} serving {monitor.url or '(no HTTP)'}; "
            f"data in {data_dir}",
        )
        return _serve(monitor, flags, config_path, pidfile)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if pidfile is not None:
            _release_pidfile(pidfile)


def _serve(monitor: Any, flags: _Flags, config_path: Path | None, pidfile: Path | None) -> int:
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
            print(
                "ringq monitor: second signal: exiting without draining",
                file=sys.stderr,
                flush=True,
            )
            os._exit(RET_INTERRUPTED)
    log.info("ringq monitor: stopped")
    return RET_OK


def _reload(monitor: Any, config_path: Path | None, log: Any) -> None:
    monitor.reopen_log()
    if config_path is None:
        log.info("ringq monitor: SIGHUP: log reopened (no --config to re-read)")
        return
    try:
        changes = read_config(config_path)
        new = monitor.reconfigure(**changes)
    except (ConfigError, OSError) as exc:
        monitor.note("config.rejected", logging.ERROR, path=str(config_path), error=str(exc),
                     outcome="kept the old settings")
        return
    log.info(
        "ringq monitor: SIGHUP: settings re-read from %s (interval %gs)", config_path, new.interval
    )


def read_config(path: Path) -> dict[str, Any]:
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


# -- resetting the section ------------------------------------------------------------------


def reset_section(dsn: str) -> int:
    """Remove the database's global section and semaphores (after a layout
    change), once no monitor serves the database and no live client uses the
    section; the next monitor or client rebuilds it from the tables. Returns
    an exit code: OK (removed, or nothing to remove) or CONFLICT (in use).

    :raises DatabaseUnavailable: the database cannot be reached.
    """
    try:
        with pg.connected(dsn, connect_timeout=5, attaching=True) as conn:
            row = conn.execute(Qy.INSTANCE_ID).fetchone()
            qids = [r[0] for r in conn.execute(Qy.QUEUES).fetchall()]
            locked = conn.execute(Qy.TRY_MONITOR_LOCK).fetchone()
            if not locked or not locked[0]:
                print("ringq monitor: another monitor serves this database: "
                      "stop it before --reset-section", file=sys.stderr)
                return RET_ALREADY_RUNNING
    except SchemaMissing:  # attaching: a missing ringq table is no ringq schema
        print("ringq monitor: no ringq schema in this database: nothing to reset", file=sys.stderr)
        return RET_OK
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
            live = sorted(
                {sec.c(i, L.C_PID) for i in sec.active_clients() if pid_alive(sec.c(i, L.C_PID))}
            )
        finally:
            sec.close()
        if live:
            print(f"ringq monitor: {len(live)} live clients use the section (pids {live[:10]}): "
                  "stop them before --reset-section", file=sys.stderr)
            return RET_ALREADY_RUNNING
    Section.unlink(instance)
    Section.unlink_semaphores(instance, qids)
    print(f"ringq monitor: global section of instance {instance} removed; "
          "it is rebuilt from the tables", file=sys.stderr)
    return RET_OK


# -- detaching and the pidfile ------------------------------------------------------------------


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
    if other and other != os.getpid() and pid_alive(other):
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


def read_state(data_dir: Path) -> dict[str, Any] | None:
    """The running monitor's state file (pid, url), if any (used by ``ringq status``)."""
    try:
        state = json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None
