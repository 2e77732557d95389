"""One server of the embedded cluster: its data directory (initdb, the
settings file, the standby marker), its start and stop through ``pg_ctl``,
what its ``postmaster.pid`` says, its sockets and port; and the status
``ringq db status`` shows of it.

Inside a data directory::

    ringq.conf        our settings (SETTINGS, port, sockets, replication), included
                      by postgresql.conf and rewritten at every start
    log/              server logs (startup.log from pg_ctl, then the logging collector)

Its unix sockets are in ``run`` beside the data directory, or in a short
/tmp/ringq-* directory when that path is too long for a socket (recorded in
ringq.conf). The server settings are in :data:`SETTINGS`; ``CLUSTER.md``
explains each one.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from ringq.engine import RingqError, pg

from . import _queries as Qy
from ._errors import ClusterError, PostgresNotFound
from ._home import parse_conf
from ._programs import Programs

DATABASE = "ringq"
SUPERUSER = "postgres"
HOST = "127.0.0.1"
CONF_FILE = "ringq.conf"  # inside the data directory, included by postgresql.conf
START_TIMEOUT = 60  # seconds pg_ctl waits for the server to accept connections
STOP_TIMEOUT = 60  # seconds pg_ctl waits for a fast shutdown before an immediate one
PORT_ATTEMPTS = 8  # free ports tried when another process takes ours first
COPY_TIMEOUT = 3600  # seconds a base backup, a pg_rewind or a crash recovery may take
# sun_path is 108 bytes with its NUL; PostgreSQL appends "/.s.PGSQL.<port>" (at most 16).
SOCKET_PATH_MAX = 107
SOCKET_SUFFIX_MAX = len("/.s.PGSQL.65535")

# Server settings, written to pgdata/ringq.conf at every start so that a
# cluster made by an older ringq gets today's values. CLUSTER.md says why each.
SETTINGS: dict[str, str] = {
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "200",
    "max_prepared_transactions": "64",
    "shared_buffers": "128MB",
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "autovacuum_naptime": "10s",
    "track_commit_timestamp": "on",
    "wal_log_hints": "on",
    "max_slot_wal_keep_size": "'1GB'",
    "logging_collector": "on",
    "log_directory": "'log'",
    "log_filename": "'postgresql-%a.log'",
    "log_rotation_age": "1d",
    "log_rotation_size": "0",
    "log_truncate_on_rotation": "on",
    "log_line_prefix": "'%m [%p] %q%u@%d '",
}

_BIND_FAILURE = ("could not bind", "could not create any TCP/IP sockets", "Address already in use")


@dataclass(frozen=True)
class ClusterStatus:
    """What ``ringq db status`` shows. ``pid``, ``port`` and ``dsn`` are None when stopped;
    ``bindir`` and ``version`` are None when no PostgreSQL server is installed."""

    running: bool
    pid: int | None
    port: int | None
    datadir: Path
    dsn: str | None
    bindir: Path | None
    version: str | None
    socket_dir: Path | None = None
    # pg_is_in_recovery() of the running server: True for a standby; None when
    # stopped or when it did not answer.
    in_recovery: bool | None = None



class Server:
    """One data directory under a cluster's home, and the server that runs on it."""

    def __init__(self, programs: Programs, datadir: Path) -> None:
        self.programs = programs
        self.datadir = datadir

    def pg_ctl(
        self, *args: str, timeout: float = max(START_TIMEOUT, STOP_TIMEOUT)
    ) -> subprocess.CompletedProcess[str]:
        """pg_ctl on this data directory, waiting (-w); ``timeout``: the longest
        wait its arguments ask for, in seconds (the program gets 30 more)."""
        return self.programs.run(
            [str(self.programs.bindir / "pg_ctl"), "-D", str(self.datadir), "-w", *args],
            timeout=timeout + 30,
        )

    def status(self) -> ClusterStatus:
        """Whether the server runs, and where. Never raises for a stopped or absent cluster."""
        pid, port, socket_dir = self.read_pidfile()
        running = pid is not None
        if socket_dir is None:
            socket_dir = self.configured_socket_dir()
        try:
            bindir: Path | None = self.programs.bindir
            version: str | None = self.programs.version
        except PostgresNotFound:
            bindir = version = None
        return ClusterStatus(
            running=running,
            pid=pid,
            port=port if running else None,
            datadir=self.datadir,
            dsn=dsn_of(port) if running and port is not None else None,
            bindir=bindir,
            version=version,
            socket_dir=socket_dir,
            in_recovery=self.in_recovery(port) if running and port is not None else None,
        )

    def running_port(self) -> int | None:
        """The port of the running server, or None when it is not running."""
        pid, port, _ = self.read_pidfile()
        return port if pid is not None else None

    def in_recovery(self, port: int) -> bool | None:
        """pg_is_in_recovery() of the server on ``port`` (True: a standby);
        None if it does not answer."""
        try:
            with admin(port, timeout=5) as conn:
                row = conn.execute(Qy.IN_RECOVERY).fetchone()
        except RingqError:
            return None
        return None if row is None else bool(row[0])

    # -- creation and start ------------------------------------------------

    def initdb(self) -> None:
        """Create the data directory, atomically: initdb into a side directory, then rename."""
        if self.datadir.exists():
            if any(self.datadir.iterdir()):
                raise ClusterError(
                    f"{self.datadir} exists but is not a PostgreSQL data directory "
                    f"(no PG_VERSION): move it away"
                )
            self.datadir.rmdir()
        staging = self.datadir.with_name(f"{self.datadir.name}.init")
        shutil.rmtree(staging, ignore_errors=True)  # what a killed initdb left
        proc = self.programs.run(
            [
                str(self.programs.bindir / "initdb"),
                "-D",
                str(staging),
                "--auth=trust",
                "-U",
                SUPERUSER,
                "-E",
                "UTF8",
                "--locale=C",
            ],
            timeout=300,
        )
        if proc.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise ClusterError(f"initdb failed in {staging}: {tail(proc.stdout)}")
        with (staging / "postgresql.conf").open("a") as f:
            f.write(
                "\n# ringq's settings (rewritten at every 'ringq db start')\n"
                f"include = '{CONF_FILE}'\n"
            )
        (staging / "log").mkdir(mode=0o700, exist_ok=True)
        self.programs.give(staging / "log")
        staging.rename(self.datadir)

    def make_standby(self) -> None:
        """Mark the (stopped) data directory as a standby's: ``standby.signal``, and
        no replication slot of its own (an old primary's would hold WAL forever)."""
        signal = self.datadir / "standby.signal"
        signal.touch(mode=0o600)
        self.programs.give(signal)
        for slot in (self.datadir / "pg_replslot").glob("*"):
            shutil.rmtree(slot, ignore_errors=True)

    def wait_gone(self) -> None:
        """Wait for the processes of a killed postmaster to leave the data directory:
        its backends exit when they notice, and hold its shared memory until then."""
        try:
            pid: int | None = int((self.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pid = None
        deadline = time.monotonic() + STOP_TIMEOUT
        # PostgreSQL refuses a data directory whose postmaster.pid names a
        # process that exists, even a zombie not yet reaped.
        while _processes_in(self.datadir) or (pid is not None and _lingers(pid)):
            if time.monotonic() > deadline:
                left = _processes_in(self.datadir) + ([pid] if pid is not None else [])
                raise ClusterError(
                    f"processes of a dead server remain in {self.datadir}: "
                    f"{', '.join(map(str, left))}"
                )
            time.sleep(0.05)

    def recover_crashed(self) -> None:
        """Finish the crash recovery of a killed primary in single-user mode (as
        pg_rewind does), so that it frees the shared memory its dead server
        left (PostgreSQL frees it only when the data directory starts again).
        Nothing for a running or cleanly stopped server, or a standby's."""
        if (
            not (self.datadir / "postmaster.pid").exists()
            or (self.datadir / "standby.signal").exists()
            or self.running_port() is not None
        ):
            return
        self.wait_gone()
        proc = self.programs.run(
            [
                str(self.programs.bindir / "postgres"),
                "--single",
                "-F",
                "-D",
                str(self.datadir),
                "template1",
            ],
            timeout=COPY_TIMEOUT,
        )
        if proc.returncode != 0:
            raise ClusterError(
                f"the crash recovery of {self.datadir} failed: {tail(proc.stdout)}"
            )

    def socket_dir(self) -> Path:
        """``run`` beside the data directory, or a short directory under /tmp
        when that path is too long for a socket."""
        run = self.datadir.parent / "run"
        if len(os.fsencode(run)) + SOCKET_SUFFIX_MAX <= SOCKET_PATH_MAX:
            run.mkdir(mode=0o755, exist_ok=True)
            self.programs.give(run)
            return run
        previous = self.configured_socket_dir()
        if previous is not None and previous != run and previous.is_dir():
            return previous
        short = Path(tempfile.mkdtemp(prefix="ringq-"))
        short.chmod(0o755)
        self.programs.give(short)
        return short

    def configured_socket_dir(self) -> Path | None:
        value = self.read_conf().get("unix_socket_directories")
        return Path(value.strip("'")) if value else None

    def configured_port(self) -> int | None:
        value = self.read_conf().get("port")
        return int(value) if value and value.isdigit() else None

    def read_conf(self) -> dict[str, str]:
        try:
            text = (self.datadir / CONF_FILE).read_text()
        except OSError:
            return {}
        return dict(parse_conf(text))

    def write_conf(self, port: int, socket_dir: Path, replication: dict[str, str]) -> None:
        lines = [
            "# Written by ringq at every 'ringq db start'; edits here are overwritten.",
            "# Use ALTER SYSTEM (postgresql.auto.conf) to override a value.",
            f"port = {port}",
            f"unix_socket_directories = '{socket_dir}'",
        ]
        lines += [f"{key} = {value}" for key, value in SETTINGS.items()]
        lines += [f"{key} = {value}" for key, value in replication.items()]
        path = self.datadir / CONF_FILE
        tmp = path.with_name(f".{CONF_FILE}.{os.getpid()}")
        tmp.write_text("\n".join(lines) + "\n")
        self.programs.give(tmp)
        os.replace(tmp, path)  # a reload never reads half a file

    def rewrite_conf(self, replication: dict[str, str]) -> bool:
        """Rewrite ringq.conf with new replication settings, its port and socket
        directory kept; whether anything changed (reload it then)."""
        before = self.read_conf()
        port = self.configured_port()
        socket_dir = self.configured_socket_dir()
        if port is None or socket_dir is None:
            return False  # never started: its first start writes it
        self.write_conf(port, socket_dir, replication)
        return self.read_conf() != before

    def reload(self) -> None:
        proc = self.pg_ctl("reload")
        if proc.returncode != 0:
            raise ClusterError(f"the server in {self.datadir} did not reload: {tail(proc.stdout)}")

    def start(self, replication: dict[str, str], *, port: int | None = None) -> int:
        """Start the server on a free port (``port``, else the last one used, if
        still free); return the port."""
        socket_dir = self.socket_dir()
        log = self.datadir / "log"
        if not log.is_dir():
            log.mkdir(mode=0o700)
            self.programs.give(log)
        startup_log = log / "startup.log"
        port = port or self.configured_port()
        if port is None or not _port_free(port):
            port = _free_port()
        for attempt in range(PORT_ATTEMPTS):
            self.write_conf(port, socket_dir, replication)
            offsets = _log_sizes(log)
            proc = self.pg_ctl("start", "-t", str(START_TIMEOUT), "-l", str(startup_log))
            if proc.returncode == 0:
                return port
            # The logging collector may start before the sockets are bound, so
            # the reason can be in its file rather than in startup.log.
            text = proc.stdout + _log_text_since(log, offsets)
            if any(s in text for s in _BIND_FAILURE) and attempt + 1 < PORT_ATTEMPTS:
                port = _free_port()  # someone took it between our probe and the server's bind
                continue
            raise ClusterError(
                f"the PostgreSQL server in {self.datadir} did not start "
                f"(logs: {log}): {tail(text)}"
            )
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Fast shutdown (an immediate one if that fails); harmless when stopped."""
        pid, _, socket_dir = self.read_pidfile()
        if pid is not None:
            proc = self.pg_ctl("stop", "-m", "fast", "-t", str(STOP_TIMEOUT))
            if proc.returncode != 0 and self.running_port() is not None:
                proc = self.pg_ctl("stop", "-m", "immediate", "-t", str(STOP_TIMEOUT))
                if proc.returncode != 0 and self.running_port() is not None:
                    raise ClusterError(
                        f"the server in {self.datadir} would not stop: {tail(proc.stdout)}"
                    )
        self._remove_short_socket_dir(socket_dir or self.configured_socket_dir())

    def restart(self, *, timeout: int, log: Path) -> None:
        """Fast shutdown, then start again on the same settings (its port kept);
        pg_ctl's output to ``log``. Starts a stopped server too.

        :raises ClusterError: it did not stop, or did not accept connections,
            within ``timeout`` s each.
        """
        proc = self.pg_ctl(
            "restart", "-m", "fast", "-t", str(timeout), "-l", str(log), timeout=2 * timeout
        )
        if proc.returncode != 0:
            raise ClusterError(
                f"the server in {self.datadir} did not restart (logs: {log.parent}): "
                f"{tail(proc.stdout)}"
            )

    def read_pidfile(self) -> tuple[int | None, int | None, Path | None]:
        """(pid, port, socket dir) from postmaster.pid when its server is alive."""
        try:
            lines = (self.datadir / "postmaster.pid").read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            return None, None, None
        try:
            pid = int(lines[0])
            port = int(lines[3])
        except (IndexError, ValueError):
            return None, None, None
        if not _is_postmaster(pid):
            return None, None, None  # stale: the server died without removing it
        socket_dir = Path(lines[4]) if len(lines) > 4 and lines[4].strip() else None
        return pid, port, socket_dir

    def _remove_short_socket_dir(self, socket_dir: Path | None) -> None:
        """Remove a /tmp/ringq-* socket directory made for a too-long home path."""
        if socket_dir is None or socket_dir == self.datadir.parent / "run":
            return
        if (
            socket_dir.parent == Path(tempfile.gettempdir())
            and socket_dir.name.startswith("ringq-")
        ):
            shutil.rmtree(socket_dir, ignore_errors=True)


def dsn_of(port: int, dbname: str = DATABASE) -> str:
    return f"postgresql://{SUPERUSER}@{HOST}:{port}/{dbname}"


def admin(port: int, *, timeout: int = 10) -> AbstractContextManager[psycopg.Connection[Any]]:
    """A superuser connection to database ``postgres`` on ``port``, autocommit,
    for one ``with`` block: psycopg errors in it are converted (the DSN named).

    :raises DatabaseUnavailable: the server does not answer on ``port``.
    :raises RingqError: a statement of the block failed, converted.
    """
    return pg.connected(dsn_of(port, "postgres"), connect_timeout=timeout)


def _exists(pid: int) -> bool:
    """Whether ``pid`` names a process, ours or another user's, a zombie included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def _lingers(pid: int) -> bool:
    """Whether a dead postmaster's ``pid`` still exists: as a zombie, or still dying."""
    if not _exists(pid):
        return False
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True
    return fields[0] == "Z" or _is_postmaster(pid)


def _processes_in(directory: Path) -> list[int]:
    """Pids of the processes whose working directory is ``directory`` (a
    server's processes work in its data directory)."""
    pids = []
    target = str(directory)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/cwd") == target:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def _is_postmaster(pid: int) -> bool:
    if not _exists(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc to ask: trust kill(0) like pg_ctl does
    # After a reboot the pid may belong to some other program.
    return b"postgres" in cmdline or b"postmaster" in cmdline


def _port_free(port: int) -> bool:
    """True if the server could listen on ``port`` now. Probed as the server
    binds (SO_REUSEADDR): a stopped server's connections in TIME_WAIT do not
    make its port busy, so a restart keeps its port and every client's DSN."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _free_port() -> int:
    """A port the kernel says is free now (the server may still lose a race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def _log_sizes(log: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in log.glob("*.log")}


def _log_text_since(log: Path, sizes: dict[Path, int]) -> str:
    """What the server wrote to the files of ``log`` since ``sizes`` were taken."""
    parts = []
    for path in sorted(log.glob("*.log")):
        try:
            with path.open("rb") as f:
                offset = sizes.get(path, 0)
                if f.seek(0, os.SEEK_END) < offset:
                    offset = 0  # truncated by rotation
                f.seek(offset)
                parts.append(f.read().decode(errors="replace"))
        except OSError:
            pass
    return "\n".join(parts)


def tail(text: str, lines: int = 15) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept) or "(no output)"
