"""The monitor a chaos cycle kills and restarts.

If no monitor serves the database, the cycle runs its own (a child process,
on a port of its own, stopped at the end of the cycle). If one does, for
example the one ``ringq run`` leaves running for its viewer, a second monitor
cannot start (one monitor per database: it exits "already running"), so the
cycle takes that one over: it finds it by the state file (``monitor.json``)
in the monitor's data directory, kills it with SIGKILL, and starts it again
detached with the options it was started with (read from ``/proc``, its
environment too), on the same port and data directory, so whatever reads it
(the viewer) keeps reading it. After the cycle it is left running, serving.
(A detached monitor has left its starting directory, so relative paths among
its options, such as ``--config``, are read from the run's directory.)

A monitor that serves the database but cannot be found that way is refused
with :class:`ForeignMonitor`: killing some other process, or none, would not
test recovery at all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringq.engine import RingqError, exits, pg, pid_alive, redact_dsn

from . import _queries as S

STATE_FILE = "monitor.json"  # written by the monitor in its data directory: pid, url, dsn
# `ringq monitor`: the previous monitor's lock is not released yet
RET_ALREADY_RUNNING = exits.CONFLICT
KILL_WAIT_S = 5.0  # for a SIGKILLed monitor to be gone
RESTART_RETRY_S = 0.2  # between attempts while the dead monitor's lock is released
RESTART_LIMIT_S = 60.0  # a monitor not serving again after this long is an error of the cycle
# own monitor: a dead coordinator's undecided prepared transaction rolls back soon
MONITOR_PREPARED_TIMEOUT_S = 2.0
DROPPED_OPTIONS = ("--reset-section",)  # once is enough: never on a restart


class ForeignMonitor(RingqError):
    """A monitor serves the run's database, and chaos cannot take it over
    (its state file is not in the monitor directory given, or names another
    process or database): stop it, name its directory, or run without chaos."""


@dataclass(frozen=True)
class ServingMonitor:
    """The monitor serving the database, as found on this host."""

    pid: int
    url: str | None
    data_dir: Path
    options: tuple[str, ...]  # its command line after ``monitor``
    env: dict[str, str]

    def dsn_option(self) -> str | None:
        """The value of its ``--dsn`` option (None: it had none)."""
        found = None
        for i, o in enumerate(self.options):
            if o == "--dsn" and i + 1 < len(self.options):
                found = self.options[i + 1]
            elif o.startswith("--dsn="):
                found = o[len("--dsn=") :]
        return found

    def restart_command(self, dsn: str | None = None) -> list[str]:
        """``ringq monitor`` with its options, its directory, its port, detached;
        with ``dsn``, on that DSN instead of its own."""
        opts = [o for o in self.options if o not in DROPPED_OPTIONS]
        if dsn is not None:
            kept: list[str] = []
            skip = False
            for o in opts:
                if skip:
                    skip = False
                elif o == "--dsn":
                    skip = True
                elif not o.startswith("--dsn="):
                    kept.append(o)
            opts = [*kept, "--dsn", dsn]
        cmd = [
            sys.executable,
            "-m",
            "ringq.cli",
            "monitor",
            *opts,
            "--data-dir",
            str(self.data_dir),
        ]
        port = urllib.parse.urlsplit(self.url).port if self.url else None
        if port:
            cmd += ["--port", str(port)]  # the last one counts: the port it serves on now
        return [*cmd, "--detach"]


def serving_monitor(
    dsn: str, monitor_dir: Path | None, *, also: tuple[str, ...] = ()
) -> ServingMonitor | None:
    """The monitor that serves ``dsn``'s database; None if none does. Its state
    file may name ``dsn`` or one of ``also`` (the same database by another DSN:
    a fail-over run's single-host DSN beside its multi-host one).

    :raises ForeignMonitor: one does, but not one found in ``monitor_dir``.
    :raises DatabaseUnavailable: the database cannot be reached.
    """
    with pg.connected(dsn, connect_timeout=10) as conn:
        holder = conn.execute(S.MONITOR_LOCK_HOLDER).fetchone()
    if holder is None:
        return None
    who = (
        f"a monitor serves this database (backend pid {holder[0]}, "
        f"{holder[1] or 'no application name'})"
    )
    how = (
        "--chaos kills and restarts the monitor that serves the database: give its data directory "
        "with --monitor-dir (RINGQ_MONITOR_DIR), stop it (ringq run --stop, or SIGTERM), "
        "or run without --chaos"
    )
    if monitor_dir is None:
        raise ForeignMonitor(f"{who}, and no monitor directory was given. {how}")
    data_dir = monitor_dir.resolve()
    path = data_dir / STATE_FILE
    try:
        state = json.loads(path.read_text())
        pid = int(state["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ForeignMonitor(f"{who}, but {path} names no running monitor. {how}") from None
    if not pid_alive(pid):
        raise ForeignMonitor(f"{who}, but the monitor of {path} (pid {pid}) is not running. {how}")
    if state.get("dsn") not in (None, *(redact_dsn(d) for d in (dsn, *also))):
        raise ForeignMonitor(
            f"{who}, but the monitor of {path} (pid {pid}) serves {state.get('dsn')}. {how}"
        )
    options = _monitor_options(pid)
    if options is None:
        raise ForeignMonitor(
            f"{who}, but pid {pid} of {path} is not a 'ringq monitor' process. {how}"
        )
    return ServingMonitor(pid, state.get("url"), data_dir, tuple(options), _environ(pid))


def monitor_serves(dsn: str) -> bool:
    """Whether a monitor (any, found or not) serves ``dsn``'s database.

    :raises DatabaseUnavailable: the database cannot be reached.
    """
    with pg.connected(dsn, connect_timeout=10) as conn:
        return conn.execute(S.MONITOR_LOCK_HOLDER).fetchone() is not None


def _monitor_options(pid: int) -> list[str] | None:
    """What follows ``monitor`` on the command line of a ``ringq monitor`` process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [w.decode(errors="surrogateescape") for w in argv if w]
    for i, w in enumerate(words[:-1]):
        if (w == "ringq.cli" or os.path.basename(w) == "ringq") and words[i + 1] == "monitor":
            return words[i + 2 :]
    return None


def _environ(pid: int) -> dict[str, str]:
    """The process's environment (its RINGQ_* settings: token, interval ...); ours if unreadable."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="surrogateescape")] = value.decode(errors="surrogateescape")
    return env or dict(os.environ)


class OwnMonitor:
    """The cycle's own monitor: a child process, restarted when it ends."""

    taken_over = False

    def __init__(self, dsn: str, logdir: str) -> None:
        self.dsn = dsn
        self.logdir = logdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.errors: list[str] = []
        self.url: str | None = None

    def start(self) -> None:
        self.starts += 1
        log = open(os.path.join(self.logdir, "monitor.log"), "ab")  # noqa: SIM115 - the child owns it
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ringq.cli", "monitor", "--dsn", self.dsn, "--port", "0",
                 "--data-dir", os.path.join(self.logdir, "monitor"),
                 "--prepared-timeout", str(MONITOR_PREPARED_TIMEOUT_S), "--log-level", "warning"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> bool:
        if self.proc is None:
            return False
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.proc.wait()
        self.start()
        return True

    def tick(self) -> None:
        if self.proc is None or self.proc.poll() is None:
            return
        if self.proc.returncode == RET_ALREADY_RUNNING:
            # Another monitor began to serve the database meanwhile: ours can
            # never start; restarting it every tick would only hide that.
            self.errors.append("another monitor began to serve the database during the cycle: "
                               "the cycle's own monitor could not run (and was not killed)")
            self.proc = None
            return
        self.start()  # died: the run needs its monitor

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class TakenMonitor:
    """The monitor that served the database before the cycle, killed and restarted
    as itself (same options, environment, data directory and port), detached;
    left serving when the cycle ends."""

    taken_over = True

    def __init__(self, serving: ServingMonitor, logdir: str, *, dsn: str | None = None) -> None:
        self.serving = serving
        self.dsn = dsn  # restart it on this DSN rather than its own
        self.pid = serving.pid
        self.url = serving.url
        self.logdir = logdir
        self.starts = 0
        self.errors: list[str] = []
        self._launch: subprocess.Popen[bytes] | None = None
        self._retry_at = 0.0
        self._deadline = 0.0
        self._failed = False

    def start(self) -> None:
        pass  # it serves already

    def alive(self) -> bool:
        return self._launch is None and self._retry_at == 0.0 and pid_alive(self.pid)

    def kill(self) -> bool:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        deadline = time.monotonic() + KILL_WAIT_S
        while pid_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._restart()
        return True

    def _restart(self) -> None:
        self._deadline = time.monotonic() + RESTART_LIMIT_S
        self._launch_now()

    def _launch_now(self) -> None:
        self._retry_at = 0.0
        log = open(os.path.join(self.logdir, "monitor-restarts.log"), "ab")  # noqa: SIM115 - the child owns it
        try:
            self._launch = subprocess.Popen(
                self.serving.restart_command(self.dsn), env=self.serving.env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )
        finally:
            log.close()

    def tick(self) -> None:
        if self._failed:
            return
        now = time.monotonic()
        if self._launch is not None:
            rc = self._launch.poll()
            if rc is None:
                return
            self._launch = None
            if rc == 0:
                self._served()
                return
            if now > self._deadline:
                self._failed = True
                self.errors.append(
                    f"the monitor killed by chaos did not serve again within {RESTART_LIMIT_S:g}s "
                    f"(last exit {rc}); "
                    f"see {os.path.join(self.logdir, 'monitor-restarts.log')} "
                    f"and {self.serving.data_dir / 'monitor.out'}"
                )
                return
            # Most often: the dead monitor's lock is not released yet (exit 5).
            self._retry_at = now + RESTART_RETRY_S
            return
        if self._retry_at:
            if now >= self._retry_at:
                self._launch_now()
            return
        if not pid_alive(self.pid):
            self._restart()  # died by itself: the run, and the viewer, need it

    def _served(self) -> None:
        self.starts += 1
        try:
            state: dict[str, Any] = json.loads((self.serving.data_dir / STATE_FILE).read_text())
            self.pid = int(state["pid"])
            self.url = state.get("url")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._failed = True
            self.errors.append(
                f"the restarted monitor serves, but its state file is unreadable: {exc}"
            )

    def stop(self) -> None:
        """Leave it serving: restart it if it is dead, wait for a restart under way."""
        self.tick()
        while not self._failed and (self._launch is not None or self._retry_at):
            time.sleep(0.05)
            self.tick()
