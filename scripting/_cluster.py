"""The embedded PostgreSQL cluster: a private server under ``$RINGQ_HOME``.

``ringq db start`` gives a user a working database without any set-up of
their own: a data directory in ``$RINGQ_HOME/pgdata`` (``./.ringq`` by
default), a server listening on 127.0.0.1 on a free port and on a unix socket,
and a database ``ringq``. Its DSN is written to ``$RINGQ_HOME/dsn``, the file
the engine reads (``ringq.engine.resolve_dsn``), and removed on stop.

The server settings are in :data:`SETTINGS`; ``scripting/CLUSTER.md`` explains
each one. Files under the home::

    pgdata/           the data directory (initdb; pgdata/ringq.conf holds our settings)
    pgdata/log/       server logs (startup.log from pg_ctl, then the logging collector)
    run/              the unix socket directory (a short /tmp/ringq-* one when
                      this path is too long for a socket, recorded in ringq.conf)
    dsn               the DSN while the server runs
    lock              serialises start and stop of this home (fcntl)

As root, the server programs run as the ``postgres`` OS user (``initdb`` and
``postgres`` refuse root): the home is given to that user and every directory
above it is made traversable (search permission only) for it.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import psycopg
from psycopg import sql
from ringq.engine import ConfigError, DatabaseUnavailable, RingqError, converted, ringq_home
from ringq.engine.sqlfile import compose

from . import _queries as Qy

DATABASE = "ringq"
SUPERUSER = "postgres"
SERVER_OS_USER = "postgres"  # the OS user the server runs as when we are root
HOST = "127.0.0.1"
DSN_FILE = "dsn"  # the contract with ringq.engine._dsn
CONF_FILE = "ringq.conf"  # inside the data directory, included by postgresql.conf
START_TIMEOUT = 60  # seconds pg_ctl waits for the server to accept connections
STOP_TIMEOUT = 60  # seconds pg_ctl waits for a fast shutdown before an immediate one
PORT_ATTEMPTS = 8  # free ports tried when another process takes ours first
# sun_path is 108 bytes with its NUL; PostgreSQL appends "/.s.PGSQL.<port>" (at most 16).
SOCKET_PATH_MAX = 107
SOCKET_SUFFIX_MAX = len("/.s.PGSQL.65535")
INSTALL_HINT = "install postgresql (apt-get install postgresql)"

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
    "logging_collector": "on",
    "log_directory": "'log'",
    "log_filename": "'postgresql-%a.log'",
    "log_rotation_age": "1d",
    "log_rotation_size": "0",
    "log_truncate_on_rotation": "on",
    "log_line_prefix": "'%m [%p] %q%u@%d '",
}

_VERSION_RE = re.compile(r"\(PostgreSQL\)\s+(\S+)")
_BIND_FAILURE = ("could not bind", "could not create any TCP/IP sockets", "Address already in use")


class ClusterError(RingqError):
    """The embedded PostgreSQL cluster could not be created, started or stopped."""


class PostgresNotFound(ClusterError):
    """No PostgreSQL server programs (``initdb``, ``pg_ctl``, ``postgres``) were found."""


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


def find_bindir(
    *,
    search_path: str | None = None,
    lib_root: Path = Path("/usr/lib/postgresql"),
    prefer_major: str | None = None,
) -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Looked for in order: ``PATH`` (symlinks followed, so Debian's wrappers in
    /usr/local/bin find their real directory), ``pg_config --bindir``, then
    ``<lib_root>/<major>/bin``, highest major first (``prefer_major``, the
    version of an existing data directory, first of all).

    :raises PostgresNotFound: none holds all three programs.
    """
    candidates: list[Path] = []
    initdb = shutil.which("initdb", path=search_path)
    if initdb:
        candidates.append(Path(initdb).resolve().parent)
    pg_config = shutil.which("pg_config", path=search_path)
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out:
            candidates.append(Path(out))
    versioned = sorted(
        (Path(p) for p in glob.glob(str(lib_root / "*" / "bin"))),
        key=lambda p: _version_key(p.parent.name),
        reverse=True,
    )
    candidates.extend(versioned)
    if prefer_major:
        # A data directory only opens with its own major version's server.
        candidates.sort(key=lambda p: _major_of(p) != prefer_major)
    for bindir in candidates:
        if all(os.access(bindir / prog, os.X_OK) for prog in ("initdb", "pg_ctl", "postgres")):
            return bindir
    looked = ", ".join(str(c) for c in candidates) or "nothing on PATH"
    raise PostgresNotFound(
        f"no PostgreSQL server found (initdb, pg_ctl, postgres; looked at PATH, pg_config "
        f"--bindir and {lib_root}/*/bin: {looked}): {INSTALL_HINT}"
    )


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name)) or (-1,)


def _major_of(bindir: Path) -> str | None:
    if bindir.parent.parent.name == "postgresql":
        return bindir.parent.name
    try:
        out = subprocess.run(
            [str(bindir / "pg_ctl"), "--version"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = _VERSION_RE.search(out)
    return m.group(1).split(".")[0] if m else None


class Cluster:
    """A private PostgreSQL cluster under ``home`` (default: :func:`ringq.engine.ringq_home`).

    ``start()`` and ``stop()`` are idempotent and serialised per home, so two
    ``ringq db start`` at once start one server. ``with Cluster(home) as c:``
    starts it and, on exit, stops it only if this block started it.
    """

    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.home = Path(home).resolve() if home is not None else ringq_home()
        self.datadir = self.home / "pgdata"
        self._bindir: Path | None = None
        self._version: str | None = None
        self._started_by_enter = False

    # -- public ------------------------------------------------------------

    def start(self) -> str:
        """Start the server if it is not running; return the DSN of database ``ringq``.

        Creates the data directory on first use. Blocks until the server
        accepts connections (pg_ctl -w, at most :data:`START_TIMEOUT` s).

        :raises PostgresNotFound: no PostgreSQL server is installed.
        :raises ClusterError: initdb or the server failed (the message has the log's tail).
        :raises ConfigError: the home cannot be a directory (a file is in the way, no permission).
        """
        try:
            self.home.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot use {self.home} as the cluster's home: {exc.strerror or exc}"
            ) from exc
        with self._locked():
            st = self.status()
            if st.running and st.port is not None:
                dsn = self._dsn(st.port)
                self._ensure_database(st.port)
                self._write_dsn(dsn)
                return dsn
            if not (self.datadir / "PG_VERSION").exists():
                self._initdb()
            port = self._start_server()
            self._ensure_database(port)
            dsn = self._dsn(port)
            self._write_dsn(dsn)
            return dsn

    def stop(self) -> None:
        """Stop the server (fast shutdown: sessions are disconnected, transactions
        roll back, prepared ones survive) and remove the DSN file. Harmless when
        stopped.

        :raises ClusterError: the server would not stop, even with an immediate shutdown.
        """
        if not self.home.is_dir():
            return
        with self._locked():
            st = self.status()
            if st.running:
                proc = self._pg_ctl("stop", "-m", "fast", "-t", str(STOP_TIMEOUT))
                if proc.returncode != 0 and self.status().running:
                    proc = self._pg_ctl("stop", "-m", "immediate", "-t", str(STOP_TIMEOUT))
                    if proc.returncode != 0 and self.status().running:
                        raise ClusterError(
                            f"the server in {self.datadir} would not stop: {_tail(proc.stdout)}"
                        )
            self._remove_dsn()
            self._remove_short_socket_dir(st.socket_dir)

    def status(self) -> ClusterStatus:
        """Whether the server runs, and where. Never raises for a stopped or absent cluster."""
        pid, port, socket_dir = self._read_pidfile()
        running = pid is not None
        if socket_dir is None:
            socket_dir = self._configured_socket_dir()
        try:
            bindir: Path | None = self.bindir
            version: str | None = self.version
        except PostgresNotFound:
            bindir = version = None
        return ClusterStatus(
            running=running,
            pid=pid,
            port=port if running else None,
            datadir=self.datadir,
            dsn=self._dsn(port) if running and port is not None else None,
            bindir=bindir,
            version=version,
            socket_dir=socket_dir,
        )

    def url(self, dbname: str = DATABASE) -> str:
        """The DSN of database ``dbname`` (default ``ringq``) on the running server.

        :raises DatabaseUnavailable: the server is not running.
        """
        st = self.status()
        if not st.running or st.port is None:
            raise DatabaseUnavailable(
                f"the embedded cluster under {self.home} is not running: "
                f"start it with 'ringq db start'"
            )
        return self._dsn(st.port, dbname)

    @property
    def bindir(self) -> Path:
        """The directory of the server programs used (see :func:`find_bindir`)."""
        if self._bindir is None:
            major = None
            try:
                major = (self.datadir / "PG_VERSION").read_text().strip()
            except OSError:
                pass
            self._bindir = find_bindir(prefer_major=major)
        return self._bindir

    @property
    def version(self) -> str:
        """The server's version, e.g. ``15.18``."""
        if self._version is None:
            out = subprocess.run(
                [str(self.bindir / "postgres"), "--version"],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            m = _VERSION_RE.search(out)
            self._version = m.group(1) if m else out.strip()
        return self._version

    def __enter__(self) -> Self:
        self._started_by_enter = not self.status().running
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._started_by_enter:
            self._started_by_enter = False
            self.stop()

    def __repr__(self) -> str:
        return f"Cluster({str(self.home)!r})"

    # -- the server user ---------------------------------------------------

    def _server_user(self) -> pwd.struct_passwd | None:
        """The OS user to run the server as, or None to run it as ourselves."""
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam(SERVER_OS_USER)
        except KeyError:
            raise ClusterError(
                f"running as root, the server must run as the OS user {SERVER_OS_USER!r} "
                f"(PostgreSQL refuses root), and there is none: {INSTALL_HINT}"
            ) from None

    def _prepare_server_user(self) -> None:
        """As root: give the home to the server user and make its path traversable."""
        user = self._server_user()
        if user is None:
            return
        os.chown(self.home, user.pw_uid, user.pw_gid)
        gids = set(os.getgrouplist(user.pw_name, user.pw_gid))
        for directory in reversed(self.home.parents):
            st = directory.stat()
            if st.st_uid == user.pw_uid:
                bit = stat.S_IXUSR
            elif st.st_gid in gids:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not st.st_mode & bit:
                # Search permission only: the server user can reach the home but
                # cannot list what is beside it. (pytest's /tmp/pytest-of-root is 0700.)
                os.chmod(directory, stat.S_IMODE(st.st_mode) | bit)

    def _give(self, path: Path) -> None:
        """Make ``path`` (made by us) belong to the server user."""
        user = self._server_user()
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def _run(self, argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a server program (as the server user when we are root), output captured."""
        cmd = list(argv)
        user = self._server_user()
        if user is not None:
            # Before every program, not once: a pytest session starting meanwhile
            # resets /tmp/pytest-of-root to 0700, closing the path again.
            self._prepare_server_user()
            runuser = shutil.which("runuser") or "/usr/sbin/runuser"
            cmd = [runuser, "-u", user.pw_name, "--", *cmd]
        env = dict(os.environ, LC_ALL="C", LANG="C")  # we read the messages; keep them English
        env.pop("PGDATA", None)
        try:
            return subprocess.run(
                cmd,
                check=False,
                cwd=self.home,  # the caller's cwd (/root) may be closed to the server user
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"{argv[0]} did not finish in {timeout:g} s") from exc
        except OSError as exc:
            raise ClusterError(f"cannot run {cmd[0]}: {exc}") from exc

    def _pg_ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self._run(
            [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-w", *args],
            timeout=max(START_TIMEOUT, STOP_TIMEOUT) + 30,
        )

    # -- creation and start ------------------------------------------------

    def _initdb(self) -> None:
        """Create the data directory, atomically: initdb into a side directory, then rename."""
        if self.datadir.exists():
            if any(self.datadir.iterdir()):
                raise ClusterError(
                    f"{self.datadir} exists but is not a PostgreSQL data directory "
                    f"(no PG_VERSION): move it away"
                )
            self.datadir.rmdir()
        staging = self.home / "pgdata.init"
        shutil.rmtree(staging, ignore_errors=True)  # what a killed initdb left
        proc = self._run(
            [
                str(self.bindir / "initdb"),
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
            raise ClusterError(f"initdb failed in {staging}: {_tail(proc.stdout)}")
        with (staging / "postgresql.conf").open("a") as f:
            f.write(
                "\n# ringq's settings (rewritten at every 'ringq db start')\n"
                f"include = '{CONF_FILE}'\n"
            )
        (staging / "log").mkdir(mode=0o700, exist_ok=True)
        self._give(staging / "log")
        staging.rename(self.datadir)

    def _socket_dir(self) -> Path:
        """``$home/run``, or a short directory under /tmp when that path is too long."""
        run = self.home / "run"
        if len(os.fsencode(run)) + SOCKET_SUFFIX_MAX <= SOCKET_PATH_MAX:
            run.mkdir(mode=0o755, exist_ok=True)
            self._give(run)
            return run
        previous = self._configured_socket_dir()
        if previous is not None and previous != run and previous.is_dir():
            return previous
        short = Path(tempfile.mkdtemp(prefix="ringq-"))
        short.chmod(0o755)
        self._give(short)
        return short

    def _configured_socket_dir(self) -> Path | None:
        value = self._read_conf().get("unix_socket_directories")
        return Path(value.strip("'")) if value else None

    def _configured_port(self) -> int | None:
        value = self._read_conf().get("port")
        return int(value) if value and value.isdigit() else None

    def _read_conf(self) -> dict[str, str]:
        try:
            text = (self.datadir / CONF_FILE).read_text()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and not key.lstrip().startswith("#"):
                out[key.strip()] = value.split("#", 1)[0].strip()
        return out

    def _write_conf(self, port: int, socket_dir: Path) -> None:
        lines = [
            "# Written by ringq at every 'ringq db start'; edits here are overwritten.",
            "# Use ALTER SYSTEM (postgresql.auto.conf) to override a value.",
            f"port = {port}",
            f"unix_socket_directories = '{socket_dir}'",
        ]
        lines += [f"{key} = {value}" for key, value in SETTINGS.items()]
        path = self.datadir / CONF_FILE
        path.write_text("\n".join(lines) + "\n")
        self._give(path)

    def _start_server(self) -> int:
        """Start the server on a free port (the last one used if still free); return the port."""
        socket_dir = self._socket_dir()
        log = self.datadir / "log"
        if not log.is_dir():
            log.mkdir(mode=0o700)
            self._give(log)
        startup_log = log / "startup.log"
        port = self._configured_port()
        if port is None or not _port_free(port):
            port = _free_port()
        for attempt in range(PORT_ATTEMPTS):
            self._write_conf(port, socket_dir)
            offsets = _log_sizes(log)
            proc = self._pg_ctl("start", "-t", str(START_TIMEOUT), "-l", str(startup_log))
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
                f"(logs: {log}): {_tail(text)}"
            )
        raise AssertionError("unreachable")

    def _ensure_database(self, port: int) -> None:
        admin = self._dsn(port, "postgres")
        with (
            converted(dsn=admin),
            psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn,
        ):
            found = conn.execute(Qy.DATABASE_EXISTS, (DATABASE,)).fetchone()
            if found is None:
                conn.execute(compose(Qy.CREATE_DATABASE, database=sql.Identifier(DATABASE)))

    # -- state files ---------------------------------------------------------

    def _read_pidfile(self) -> tuple[int | None, int | None, Path | None]:
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

    def _dsn(self, port: int, dbname: str = DATABASE) -> str:
        return f"postgresql://{SUPERUSER}@{HOST}:{port}/{dbname}"

    def _write_dsn(self, dsn: str) -> None:
        path = self.home / DSN_FILE
        tmp = path.with_name(f".{DSN_FILE}.{os.getpid()}")
        tmp.write_text(dsn + "\n")
        tmp.chmod(0o644)
        os.replace(tmp, path)  # readers never see a half-written file

    def _remove_dsn(self) -> None:
        try:
            (self.home / DSN_FILE).unlink()
        except FileNotFoundError:
            pass

    def _remove_short_socket_dir(self, socket_dir: Path | None) -> None:
        """Remove a /tmp/ringq-* socket directory made for a too-long home path."""
        if socket_dir is None or socket_dir == self.home / "run":
            return
        if (
            socket_dir.parent == Path(tempfile.gettempdir())
            and socket_dir.name.startswith("ringq-")
        ):
            shutil.rmtree(socket_dir, ignore_errors=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise start/stop of this home across processes (released by the kernel on death)."""
        with open(self.home / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _is_postmaster(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
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


def _tail(text: str, lines: int = 15) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(kept) or "(no output)"
