"""The embedded PostgreSQL cluster: a private server under ``$RINGQ_HOME``,
and optionally a streaming standby of it on the same host.

``ringq db start`` gives a user a working database without any set-up of
their own: a data directory in ``$RINGQ_HOME/pgdata`` (``./.ringq`` by
default), a server listening on 127.0.0.1 on a free port and on a unix socket,
and a database ``ringq``. Its DSN is written to ``$RINGQ_HOME/dsn``, the file
the engine reads (``ringq.engine.resolve_dsn``), and removed on stop.

``ringq db standby start`` adds a streaming standby (a base backup of the
primary in ``$RINGQ_HOME/standby/pgdata``, its own port, a replication slot,
synchronous or asynchronous); ``ringq db promote`` makes it the primary and
points ``$RINGQ_HOME/dsn`` at it; ``ringq db standby rebuild`` brings the old
primary back as the new one's standby (pg_rewind, or a fresh base backup). The
two data directories keep their paths; ``$RINGQ_HOME/replication`` says which
one is the primary.

The server settings are in :data:`SETTINGS`; ``scripting/CLUSTER.md`` explains
each one. Files under the home::

    pgdata/           the data directory (initdb; pgdata/ringq.conf holds our settings)
    pgdata/log/       server logs (startup.log from pg_ctl, then the logging collector)
    run/              the unix socket directory (a short /tmp/ringq-* one when
                      this path is too long for a socket, recorded in ringq.conf)
    standby/pgdata/   the standby's data directory (a base backup), standby/run its sockets
    replication       which data directory is the primary, which the standby, and how
    dsn               the primary's DSN while it runs
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
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

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

# The replication pair (see ringq db standby).
PRIMARY_DIR = "pgdata"  # the first data directory, made by initdb
STANDBY_DIR = "standby/pgdata"  # the standby's, made by a base backup of the primary
PAIR_FILE = "replication"  # which of the two is the primary (absent: pgdata, no standby)
STANDBY_NAME = "ringq_standby"  # the standby's application_name and its replication slot
SYNC, ASYNC = "sync", "async"
STANDBY_RUNNING = "running"  # streaming; synchronous if the mode says so
STANDBY_STOPPED = "stopped"  # stopped by 'ringq db standby stop' (kept, slot kept)
STANDBY_REBUILD = "rebuild"  # the old primary after a promotion: 'ringq db standby rebuild'
STREAM_TIMEOUT = 60  # seconds a new standby has to stream (and to become synchronous)
COPY_TIMEOUT = 3600  # seconds a base backup or a pg_rewind may take

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

_VERSION_RE = re.compile(r"\(PostgreSQL\)\s+(\S+)")
_BIND_FAILURE = ("could not bind", "could not create any TCP/IP sockets", "Address already in use")


class ClusterError(RingqError):
    """The embedded PostgreSQL cluster could not be created, started or stopped."""


class PostgresNotFound(ClusterError):
    """No PostgreSQL server programs (``initdb``, ``pg_ctl``, ``postgres``) were found."""


class NoStandby(ClusterError):
    """The home has no standby (make one with ``ringq db standby start``)."""


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


@dataclass(frozen=True)
class StandbyStatus(ClusterStatus):
    """The standby's side of ``ringq db status``: its server (the fields of
    :class:`ClusterStatus`), the pair's settings, and the standby as its
    primary sees it (None where the primary does not see it).

    ``mode``: ``sync`` or ``async``. ``state``: ``running`` (it should run and
    stream), ``stopped`` (``ringq db standby stop``) or ``rebuild`` (the old
    primary after a promotion, to bring back with ``ringq db standby rebuild``).
    ``streaming``: the primary's walsender state (``streaming``, ``catchup`` …);
    ``sync_state``: ``sync`` or ``async``; ``lag_bytes``: WAL it has not replayed yet.
    """

    mode: str = SYNC
    state: str = STANDBY_RUNNING
    streaming: str | None = None
    sync_state: str | None = None
    lag_bytes: int | None = None


@dataclass(frozen=True)
class _Pair:
    """``$RINGQ_HOME/replication``: which data directory (relative to the home)
    is the primary and which the standby, the standby's mode and state."""

    primary: str = PRIMARY_DIR
    standby: str | None = None
    mode: str = SYNC
    state: str = STANDBY_RUNNING

    @classmethod
    def read(cls, home: Path) -> _Pair:
        try:
            text = (home / PAIR_FILE).read_text()
        except (FileNotFoundError, NotADirectoryError):  # no home yet: a primary alone
            return cls()
        except OSError as exc:
            raise ClusterError(f"cannot read {home / PAIR_FILE}: {exc.strerror or exc}") from exc
        values = dict(_parse_conf(text))
        known = {f.name for f in fields(cls)}
        pair = cls(**{k: v for k, v in values.items() if k in known})
        states = (STANDBY_RUNNING, STANDBY_STOPPED, STANDBY_REBUILD)
        if pair.mode not in (SYNC, ASYNC) or pair.state not in states:
            raise ClusterError(
                f"{home / PAIR_FILE} is damaged (mode {pair.mode!r}, "
                f"state {pair.state!r}): fix it or remove it"
            )
        return pair

    def write(self, home: Path) -> None:
        lines = [
            "# The embedded cluster's replication pair: which data directory is the",
            "# primary and which the standby. Written by 'ringq db standby|promote'.",
            f"primary = {self.primary}",
        ]
        if self.standby is not None:
            lines += [f"standby = {self.standby}", f"mode = {self.mode}", f"state = {self.state}"]
        path = home / PAIR_FILE
        tmp = path.with_name(f".{PAIR_FILE}.{os.getpid()}")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.chmod(0o644)
        os.replace(tmp, path)


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
    """A private PostgreSQL cluster under ``home`` (default: :func:`ringq.engine.ringq_home`),
    with an optional streaming standby on the same host.

    ``start()`` and ``stop()`` are idempotent and serialised per home, so two
    ``ringq db start`` at once start one server. ``with Cluster(home) as c:``
    starts it and, on exit, stops it only if this block started it. Both act
    on the standby too, when the home has one.
    """

    def __init__(self, home: str | os.PathLike[str] | None = None) -> None:
        self.home = Path(home).resolve() if home is not None else ringq_home()
        self._bindir: Path | None = None
        self._version: str | None = None
        self._started_by_enter = False

    @property
    def datadir(self) -> Path:
        """The primary's data directory: ``pgdata`` until a promotion says otherwise."""
        return self.home / _Pair.read(self.home).primary

    @property
    def standby_datadir(self) -> Path | None:
        """The standby's data directory, or None when the home has no standby."""
        standby = _Pair.read(self.home).standby
        return None if standby is None else self.home / standby

    @staticmethod
    def home_of(datadir: str | os.PathLike[str]) -> Path | None:
        """The home whose primary or standby data directory is ``datadir``
        (``<home>/pgdata`` or ``<home>/standby/pgdata``, whichever
        ``$RINGQ_HOME/replication`` names), or None when ``datadir`` is no
        embedded cluster's. After a promotion the primary's data directory is
        ``<home>/standby/pgdata``: this finds the home either way."""
        path = Path(datadir).resolve()
        for relative in (STANDBY_DIR, PRIMARY_DIR):  # the longer first: <home>/standby/pgdata
            parts = Path(relative).parts
            if path.parts[-len(parts) :] != parts:
                continue
            home = path.parents[len(parts) - 1]
            try:
                pair = _Pair.read(home)
            except ClusterError:
                return None
            if relative in (pair.primary, pair.standby):
                return home
        return None

    # -- public ------------------------------------------------------------

    def start(self) -> str:
        """Start the server if it is not running; return the DSN of database ``ringq``.

        Creates the data directory on first use. Blocks until the server
        accepts connections (pg_ctl -w, at most :data:`START_TIMEOUT` s).
        When the home has a standby that should run (``ringq db standby
        start``, not stopped since), starts it too.

        :raises PostgresNotFound: no PostgreSQL server is installed.
        :raises ClusterError: initdb or the server failed (the message has the log's tail);
            or the standby did not start (the primary runs then, with synchronous
            replication off).
        :raises ConfigError: the home cannot be a directory (a file is in the way, no permission).
        """
        try:
            self.home.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot use {self.home} as the cluster's home: {exc.strerror or exc}"
            ) from exc
        with self._locked():
            pair = _Pair.read(self.home)
            primary = self._server(pair.primary)
            port = primary.running_port()
            if port is None:
                if not (primary.datadir / "PG_VERSION").exists():
                    if pair.primary != PRIMARY_DIR:
                        raise ClusterError(
                            f"the primary's data directory {primary.datadir} is missing "
                            f"(named in {self.home / PAIR_FILE})"
                        )
                    primary.initdb()
                port = primary.start(self._primary_settings(pair))
            standby_failed = None
            if pair.standby is not None and pair.state == STANDBY_RUNNING:
                try:
                    self._keep_standby_running(pair, port)
                except ClusterError as exc:
                    standby_failed = exc  # the primary runs: still give it its DSN
            self._ensure_database(port)
            dsn = _dsn(port)
            self._write_dsn(dsn)
            if standby_failed is not None:
                raise standby_failed
            return dsn

    def stop(self) -> None:
        """Stop the server, and the standby if one runs (fast shutdown: sessions
        are disconnected, transactions roll back, prepared ones survive), and
        remove the DSN file. Harmless when stopped.

        The primary stops first: its clean shutdown sends the standby all its WAL.

        :raises ClusterError: a server would not stop, even with an immediate shutdown.
        """
        if not self.home.is_dir():
            return
        with self._locked():
            pair = _Pair.read(self.home)
            self._server(pair.primary).stop()
            if pair.standby is not None:
                self._server(pair.standby).stop()
            self._remove_dsn()

    def status(self) -> ClusterStatus:
        """Whether the primary runs, and where. Never raises for a stopped or absent cluster."""
        return self._server(_Pair.read(self.home).primary).status()

    def standby_status(self) -> StandbyStatus | None:
        """The standby's server and replication, or None when the home has none.
        Never raises for a stopped server."""
        pair = _Pair.read(self.home)
        if pair.standby is None:
            return None
        st = self._server(pair.standby).status()
        streaming = sync_state = None
        lag = None
        port = self._server(pair.primary).running_port()
        if port is not None:
            try:
                with _admin(port, timeout=5) as conn:
                    row = conn.execute(Qy.REPLICATION_STATE, (STANDBY_NAME,)).fetchone()
            except psycopg.Error:
                row = None
            if row is not None:
                streaming, sync_state, lag = row
        return StandbyStatus(
            **{f.name: getattr(st, f.name) for f in fields(ClusterStatus)},
            mode=pair.mode,
            state=pair.state,
            streaming=streaming,
            sync_state=sync_state,
            lag_bytes=lag,
        )

    def url(self, dbname: str = DATABASE, *, both: bool = False) -> str:
        """The DSN of database ``dbname`` (default ``ringq``) on the running primary.

        With ``both``, a multi-host DSN naming the primary and then the
        standby, with ``target_session_attrs=read-write``: libpq connects to
        whichever of the two is the primary at the time, so a client that
        reconnects with it follows a promotion. It is made from the ports the
        two servers keep across restarts, whether they run or not.

        :raises DatabaseUnavailable: the server is not running.
        :raises NoStandby: ``both``, and the home has no standby (or it never started).
        """
        if both:
            pair = _Pair.read(self.home)
            if pair.standby is None:
                raise NoStandby(
                    f"the embedded cluster under {self.home} has no standby: "
                    f"make one with 'ringq db standby start'"
                )
            ports = [self._server(d).configured_port() for d in (pair.primary, pair.standby)]
            if None in ports:
                raise NoStandby(f"the standby under {self.home} has never started")
            hosts = ",".join(f"{HOST}:{p}" for p in ports)
            return f"postgresql://{SUPERUSER}@{hosts}/{dbname}?target_session_attrs=read-write"
        st = self.status()
        if not st.running or st.port is None:
            raise DatabaseUnavailable(
                f"the embedded cluster under {self.home} is not running: "
                f"start it with 'ringq db start'"
            )
        return _dsn(st.port, dbname)

    # -- the standby ---------------------------------------------------------

    def start_standby(self, *, sync: bool | None = None) -> str:
        """Make (first time) and start a streaming standby of the running primary;
        return its DSN (read-only). Blocks until it streams, and when ``sync``
        until the primary counts it as its synchronous standby.

        The first time, the standby is a base backup of the primary
        (pg_basebackup through the replication slot ``ringq_standby``) in
        ``$RINGQ_HOME/standby/pgdata``, on a free port of its own that it keeps
        across restarts. ``sync``: True makes it synchronous (the primary's
        commits wait for the standby to have the WAL on disk: a fail-over loses
        nothing committed), False asynchronous; None keeps the standby's mode
        (synchronous for a new one). Harmless when it runs: the mode is changed
        if asked.

        :raises DatabaseUnavailable: the primary is not running.
        :raises ClusterError: the backup or the server failed, the standby did not
            stream in :data:`STREAM_TIMEOUT` s, or the standby is the old primary
            after a promotion (:meth:`rebuild_standby` brings that back).
        """
        with self._locked():
            pair = _Pair.read(self.home)
            primary = self._server(pair.primary)
            port = self._primary_port(primary)
            if pair.standby is not None and pair.state == STANDBY_REBUILD:
                raise ClusterError(
                    f"{self.home / pair.standby} holds the old primary, not a standby: "
                    f"bring it back with 'ringq db standby rebuild'"
                )
            if sync is None:
                mode = pair.mode if pair.standby is not None else SYNC
            else:
                mode = SYNC if sync else ASYNC
            # After a promotion the primary may be standby/pgdata: then pgdata is free.
            free = PRIMARY_DIR if pair.primary == STANDBY_DIR else STANDBY_DIR
            standby = self._server(pair.standby or free)
            if not (standby.datadir / "PG_VERSION").exists():
                self._create_slot(port)
                self._base_backup(port, standby)
            pair = _Pair(pair.primary, _relative(self.home, standby.datadir), mode, STANDBY_STOPPED)
            pair.write(self.home)
            return self._run_standby(pair, primary, standby, port=standby.configured_port())

    def stop_standby(self) -> None:
        """Stop the standby; it is kept (with its slot) for ``start_standby``.
        Synchronous replication is turned off first, so the primary's commits
        do not wait for it. Harmless when stopped.

        :raises NoStandby: the home has no standby.
        """
        with self._locked():
            pair = self._pair_with_standby()
            if pair.state == STANDBY_RUNNING:
                pair = replace(pair, state=STANDBY_STOPPED)
                pair.write(self.home)
                self._apply_primary_settings(pair)
            assert pair.standby is not None
            self._server(pair.standby).stop()

    def remove_standby(self) -> None:
        """Stop the standby, drop its replication slot on the primary and delete
        its data directory: the home has a primary alone again.

        :raises NoStandby: the home has no standby.
        :raises DatabaseUnavailable: the primary is not running (its slot must be dropped).
        """
        with self._locked():
            pair = self._pair_with_standby()
            assert pair.standby is not None
            port = self._primary_port(self._server(pair.primary))
            standby = self._server(pair.standby)
            _Pair(pair.primary).write(self.home)
            self._apply_primary_settings(_Pair(pair.primary))
            standby.stop()
            standby.recover_crashed()  # frees the shared memory a killed server left
            self._drop_slot(port)
            shutil.rmtree(standby.datadir)

    def promote(self) -> str:
        """Make the standby the primary; return the new primary's DSN, which
        ``$RINGQ_HOME/dsn`` names from then on.

        A primary still running is stopped first (a switchover: its clean
        shutdown sends the standby all its WAL, so nothing is lost even with
        asynchronous replication); a dead one is left (a fail-over). The old
        primary is not started again: it may hold transactions the standby
        never received, so it comes back only as a standby of the new primary
        (:meth:`rebuild_standby`). Until then the new primary has no standby
        and commits without waiting for one.

        :raises NoStandby: the home has no standby.
        :raises ClusterError: the standby is the old primary (rebuild it first),
            or pg_ctl promote failed.
        """
        with self._locked():
            pair = self._pair_with_standby()
            assert pair.standby is not None
            if pair.state == STANDBY_REBUILD:
                raise ClusterError(
                    f"{self.home / pair.standby} is the old primary, not a standby: nothing "
                    f"to promote (bring it back first with 'ringq db standby rebuild')"
                )
            old, new = self._server(pair.primary), self._server(pair.standby)
            old.stop()
            port = new.running_port()
            if port is None:
                port = new.start(self._standby_settings(old.configured_port()))
            if new.in_recovery(port) is not False:
                proc = new.pg_ctl("promote", "-t", str(START_TIMEOUT))
                if proc.returncode != 0 or new.in_recovery(port) is not False:
                    raise ClusterError(
                        f"the standby in {new.datadir} was not promoted: {_tail(proc.stdout)}"
                    )
            pair = _Pair(pair.standby, pair.primary, pair.mode, STANDBY_REBUILD)
            pair.write(self.home)
            new.rewrite_conf(self._primary_settings(pair))  # a primary's, for its next start
            dsn = _dsn(port)
            self._write_dsn(dsn)
            return dsn

    def rebuild_standby(self, *, fresh: bool = False) -> str:
        """Bring the standby's data directory back as a streaming standby of
        the primary; above all the old primary after :meth:`promote`. Returns
        how: ``rewound`` (pg_rewind undid what it had that the new primary
        never received), ``unchanged`` (nothing to undo) or ``copied`` (a
        fresh base backup: with ``fresh``, or when pg_rewind could not do it).
        Its port, and its logs, are kept. Blocks until it streams.

        :raises NoStandby: the home has no standby.
        :raises DatabaseUnavailable: the primary is not running.
        :raises ClusterError: the copy or the server failed, or it did not
            stream in :data:`STREAM_TIMEOUT` s (after a rewind: the WAL it
            needs is gone from the primary; ``fresh`` copies it anew).
        """
        with self._locked():
            pair = self._pair_with_standby()
            assert pair.standby is not None
            primary, target = self._server(pair.primary), self._server(pair.standby)
            port = self._primary_port(primary)
            keep_port = target.configured_port()
            if pair.state == STANDBY_RUNNING:  # the primary must not wait for it meanwhile
                pair = replace(pair, state=STANDBY_STOPPED)
                pair.write(self.home)
                self._apply_primary_settings(pair)
            target.stop()
            target.wait_gone()
            self._create_slot(port)
            how = None
            if not fresh and (target.datadir / "PG_VERSION").exists():
                how = self._rewind(port, target)
            if how is None:
                target.recover_crashed()  # frees the shared memory a killed server left
                self._base_backup(port, target)
                how = "copied"
            self._run_standby(pair, primary, target, port=keep_port)
            return how

    # -- properties of the installation -------------------------------------

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

    # -- the pair --------------------------------------------------------------

    def _server(self, relative: str) -> _Server:
        return _Server(self, self.home / relative)

    def _pg_ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """pg_ctl on the primary's data directory (the regression's and tests' restarts)."""
        return self._server(_Pair.read(self.home).primary).pg_ctl(*args)

    def _pair_with_standby(self) -> _Pair:
        pair = _Pair.read(self.home)
        if pair.standby is None:
            raise NoStandby(
                f"the embedded cluster under {self.home} has no standby: "
                f"make one with 'ringq db standby start'"
            )
        return pair

    def _primary_port(self, primary: _Server) -> int:
        port = primary.running_port()
        if port is None:
            raise DatabaseUnavailable(
                f"the primary of the embedded cluster under {self.home} ({primary.datadir}) "
                f"is not running: start it with 'ringq db start'"
            )
        return port

    def _primary_settings(self, pair: _Pair) -> dict[str, str]:
        """The primary's replication settings: it waits for its standby's
        flush only while a synchronous standby is meant to run."""
        waits = pair.standby is not None and pair.mode == SYNC and pair.state == STANDBY_RUNNING
        return {"synchronous_standby_names": f"'{STANDBY_NAME}'" if waits else "''"}

    def _standby_settings(self, primary_port: int | None) -> dict[str, str]:
        """A standby's settings: where its primary is (kept here rather than in
        postgresql.auto.conf, so that they follow the primary's port)."""
        conninfo = (
            f"host={HOST} port={primary_port or 0} user={SUPERUSER} "
            f"application_name={STANDBY_NAME}"
        )
        return {
            "primary_conninfo": f"'{conninfo}'",
            "primary_slot_name": f"'{STANDBY_NAME}'",
            "synchronous_standby_names": "''",
            # Between attempts at WAL after its primary died (5 s by default):
            # a promotion was seen to wait that long on this host.
            "wal_retrieve_retry_interval": "'200ms'",
        }

    def _apply_primary_settings(self, pair: _Pair) -> None:
        """Rewrite the primary's replication settings and reload it (when it runs)."""
        primary = self._server(pair.primary)
        primary.rewrite_conf(self._primary_settings(pair))
        if primary.running_port() is not None:
            primary.reload()

    def _run_standby(
        self, pair: _Pair, primary: _Server, standby: _Server, *, port: int | None
    ) -> str:
        """Start ``standby`` (or point the running one at the primary), wait
        until it streams, then record it as running and let the primary wait
        for it when synchronous; the standby's DSN."""
        primary_port = self._primary_port(primary)
        settings = self._standby_settings(primary_port)
        standby_port = standby.running_port()
        if standby_port is None:
            standby.make_standby()
            standby_port = standby.start(settings, port=port)
        elif standby.rewrite_conf(settings):
            standby.reload()
        self._wait_replication(primary_port, standby, sync=False)
        pair = replace(pair, state=STANDBY_RUNNING)
        pair.write(self.home)
        self._apply_primary_settings(pair)
        if pair.mode == SYNC:
            self._wait_replication(primary_port, standby, sync=True)
        return _dsn(standby_port)

    def _keep_standby_running(self, pair: _Pair, primary_port: int) -> None:
        """At start: start the standby that should run, or point it at the
        primary's port. If it cannot start, the primary must not wait for it."""
        assert pair.standby is not None
        standby = self._server(pair.standby)
        settings = self._standby_settings(primary_port)
        if standby.running_port() is not None:
            if standby.rewrite_conf(settings):
                standby.reload()
            return
        try:
            standby.start(settings)
        except ClusterError as exc:
            pair = replace(pair, state=STANDBY_STOPPED)
            pair.write(self.home)
            self._apply_primary_settings(pair)
            raise ClusterError(
                f"the primary runs, but its standby did not start, so it no longer waits "
                f"for it ('ringq db standby start' tries again): {exc}"
            ) from exc

    def _wait_replication(self, primary_port: int, standby: _Server, *, sync: bool) -> None:
        """Wait until the primary streams to the standby (and counts it as synchronous)."""
        deadline = time.monotonic() + STREAM_TIMEOUT
        row = None
        with converted(), _admin(primary_port) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(Qy.REPLICATION_STATE, (STANDBY_NAME,)).fetchone()
                if row is not None and row[0] == "streaming" and (not sync or row[1] == SYNC):
                    return
                time.sleep(0.05)  # the walreceiver connects on its own schedule
        seen = f"{row[0]}, {row[1]}" if row else "not connected"
        goal = "become synchronous" if sync else "stream"
        raise ClusterError(
            f"the standby in {standby.datadir} did not {goal} "
            f"in {STREAM_TIMEOUT} s (it is {seen}; logs: {standby.datadir / 'log'}); "
            f"if it needs WAL the primary no longer has, 'ringq db standby rebuild --fresh' "
            f"copies it anew"
        )

    def _create_slot(self, primary_port: int) -> None:
        with converted(), _admin(primary_port) as conn:
            conn.execute(Qy.CREATE_SLOT, {"slot": STANDBY_NAME})

    def _drop_slot(self, primary_port: int) -> None:
        """Drop the standby's slot, once the walsender of the stopped standby has left it."""
        deadline = time.monotonic() + STREAM_TIMEOUT
        with converted(), _admin(primary_port) as conn:
            while True:
                conn.execute(Qy.DROP_SLOT, (STANDBY_NAME,))
                if conn.execute(Qy.SLOT_EXISTS, (STANDBY_NAME,)).fetchone() is None:
                    return
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"the replication slot {STANDBY_NAME!r} is still in use after "
                        f"{STREAM_TIMEOUT} s: drop it with pg_drop_replication_slot()"
                    )
                time.sleep(0.05)  # its walsender is ending

    def _base_backup(self, primary_port: int, target: _Server) -> None:
        """Copy the primary into ``target``'s data directory (replacing it, its
        logs kept) with pg_basebackup through the standby's slot."""
        parent = target.datadir.parent
        if not parent.is_dir():
            parent.mkdir(parents=True, mode=0o755)
            self._give(parent)
        staging = parent / f"{target.datadir.name}.init"
        shutil.rmtree(staging, ignore_errors=True)  # what a killed backup left
        source = (
            f"host={HOST} port={primary_port} user={SUPERUSER} "
            "application_name=ringq_basebackup"
        )
        proc = self._run(
            [
                str(self.bindir / "pg_basebackup"),
                "-D", str(staging),
                "-d", source,
                "-X", "stream",
                "-S", STANDBY_NAME,
                "-c", "fast",  # an immediate checkpoint, not a spread one
                "-w",
            ],
            timeout=COPY_TIMEOUT,
        )
        if proc.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise ClusterError(f"pg_basebackup into {staging} failed: {_tail(proc.stdout)}")
        # The copy has the primary's logs and settings file: not the target's
        # (a new standby's first start writes its own, on a port of its own).
        shutil.rmtree(staging / "log", ignore_errors=True)
        (staging / CONF_FILE).unlink(missing_ok=True)
        if (target.datadir / CONF_FILE).exists():
            (target.datadir / CONF_FILE).rename(staging / CONF_FILE)
        old_log = target.datadir / "log"
        if old_log.is_dir():
            old_log.rename(staging / "log")
        else:
            (staging / "log").mkdir(mode=0o700)
            self._give(staging / "log")
        if target.datadir.exists():
            shutil.rmtree(target.datadir)
        staging.rename(target.datadir)

    def _rewind(self, primary_port: int, target: _Server) -> str | None:
        """pg_rewind ``target`` to the primary's history: ``rewound`` or
        ``unchanged``; None when it cannot (the caller copies instead). Its
        port and logs are kept (pg_rewind copies the source's files over them)."""
        conf = target.datadir / CONF_FILE
        own_conf = conf.read_bytes() if conf.exists() else None
        logs = target.datadir / "log"
        aside = target.datadir.parent / f".{target.datadir.name}.log"
        shutil.rmtree(aside, ignore_errors=True)
        if logs.is_dir():
            logs.rename(aside)
        source = f"host={HOST} port={primary_port} user={SUPERUSER} dbname=postgres"
        # pg_rewind reads the source's timeline from its control file, which a
        # fresh promotion updates only at its first checkpoint: without one,
        # it would take the two for the same history ("no rewind required").
        with converted(), _admin(primary_port) as conn:
            conn.execute(Qy.CHECKPOINT)
        try:
            proc = self._run(
                [
                    str(self.bindir / "pg_rewind"),
                    "-D",
                    str(target.datadir),
                    f"--source-server={source}",
                ],
                timeout=COPY_TIMEOUT,
            )
        finally:
            if aside.is_dir():
                shutil.rmtree(logs, ignore_errors=True)
                aside.rename(logs)
        with (logs / "rebuild.log").open("a") as f:  # what it did, or why we copy instead
            f.write(proc.stdout)
        if proc.returncode != 0:
            return None
        if own_conf is not None:  # pg_rewind copied the source's: its port, its sockets
            conf.write_bytes(own_conf)
        return "unchanged" if "no rewind required" in proc.stdout else "rewound"

    def _ensure_database(self, port: int) -> None:
        with converted(dsn=_dsn(port, "postgres")), _admin(port) as conn:
            found = conn.execute(Qy.DATABASE_EXISTS, (DATABASE,)).fetchone()
            if found is None:
                conn.execute(compose(Qy.CREATE_DATABASE, database=sql.Identifier(DATABASE)))

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

    # -- state files ---------------------------------------------------------

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

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialise start/stop of this home across processes (released by the kernel on death)."""
        with open(self.home / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class _Server:
    """One data directory under a cluster's home, and the server that runs on it."""

    def __init__(self, cluster: Cluster, datadir: Path) -> None:
        self.cluster = cluster
        self.datadir = datadir

    def pg_ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.cluster._run(
            [str(self.cluster.bindir / "pg_ctl"), "-D", str(self.datadir), "-w", *args],
            timeout=max(START_TIMEOUT, STOP_TIMEOUT) + 30,
        )

    def status(self) -> ClusterStatus:
        """Whether the server runs, and where. Never raises for a stopped or absent cluster."""
        pid, port, socket_dir = self.read_pidfile()
        running = pid is not None
        if socket_dir is None:
            socket_dir = self.configured_socket_dir()
        try:
            bindir: Path | None = self.cluster.bindir
            version: str | None = self.cluster.version
        except PostgresNotFound:
            bindir = version = None
        return ClusterStatus(
            running=running,
            pid=pid,
            port=port if running else None,
            datadir=self.datadir,
            dsn=_dsn(port) if running and port is not None else None,
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
            with _admin(port, timeout=5) as conn:
                row = conn.execute(Qy.IN_RECOVERY).fetchone()
        except psycopg.Error:
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
        proc = self.cluster._run(
            [
                str(self.cluster.bindir / "initdb"),
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
        self.cluster._give(staging / "log")
        staging.rename(self.datadir)

    def make_standby(self) -> None:
        """Mark the (stopped) data directory as a standby's: ``standby.signal``, and
        no replication slot of its own (an old primary's would hold WAL forever)."""
        signal = self.datadir / "standby.signal"
        signal.touch(mode=0o600)
        self.cluster._give(signal)
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
        proc = self.cluster._run(
            [
                str(self.cluster.bindir / "postgres"),
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
                f"the crash recovery of {self.datadir} failed: {_tail(proc.stdout)}"
            )

    def socket_dir(self) -> Path:
        """``run`` beside the data directory, or a short directory under /tmp
        when that path is too long for a socket."""
        run = self.datadir.parent / "run"
        if len(os.fsencode(run)) + SOCKET_SUFFIX_MAX <= SOCKET_PATH_MAX:
            run.mkdir(mode=0o755, exist_ok=True)
            self.cluster._give(run)
            return run
        previous = self.configured_socket_dir()
        if previous is not None and previous != run and previous.is_dir():
            return previous
        short = Path(tempfile.mkdtemp(prefix="ringq-"))
        short.chmod(0o755)
        self.cluster._give(short)
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
        return dict(_parse_conf(text))

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
        self.cluster._give(tmp)
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
            raise ClusterError(f"the server in {self.datadir} did not reload: {_tail(proc.stdout)}")

    def start(self, replication: dict[str, str], *, port: int | None = None) -> int:
        """Start the server on a free port (``port``, else the last one used, if
        still free); return the port."""
        socket_dir = self.socket_dir()
        log = self.datadir / "log"
        if not log.is_dir():
            log.mkdir(mode=0o700)
            self.cluster._give(log)
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
                f"(logs: {log}): {_tail(text)}"
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
                        f"the server in {self.datadir} would not stop: {_tail(proc.stdout)}"
                    )
        self._remove_short_socket_dir(socket_dir or self.configured_socket_dir())

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


def _dsn(port: int, dbname: str = DATABASE) -> str:
    return f"postgresql://{SUPERUSER}@{HOST}:{port}/{dbname}"


def _admin(port: int, *, timeout: int = 10) -> psycopg.Connection[tuple[Any, ...]]:
    """A superuser connection to database ``postgres`` on ``port``, autocommit."""
    return psycopg.connect(_dsn(port, "postgres"), autocommit=True, connect_timeout=timeout)


def _relative(home: Path, path: Path) -> str:
    return str(path.relative_to(home))


def _parse_conf(text: str) -> Iterator[tuple[str, str]]:
    """``key = value`` lines of a settings file (comments and blanks skipped)."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            yield key.strip(), value.split("#", 1)[0].strip()


def _lingers(pid: int) -> bool:
    """Whether a dead postmaster's ``pid`` still exists: as a zombie, or still dying."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
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
