"""The embedded PostgreSQL cluster's face: :class:`Cluster`, a private server
under ``$RINGQ_HOME`` and optionally a streaming standby of it on the same host.

``ringq db start`` gives a user a working database without any set-up of
their own: a data directory in ``$RINGQ_HOME/pgdata`` (``./.ringq`` by
default), a server listening on 127.0.0.1 on a free port and on a unix socket,
and a database ``ringq``. Its DSN is written to ``$RINGQ_HOME/dsn``, the file
the engine reads (``ringq.engine.resolve_dsn``), and removed on stop.

``ringq db standby start`` adds a streaming standby (a base backup of the
primary in ``$RINGQ_HOME/standby/pgdata``, its own port, a replication slot,
synchronous or asynchronous); ``ringq db promote`` makes it the primary and
points ``$RINGQ_HOME/dsn`` at it; ``ringq db standby rebuild`` brings the old
primary back as the new one's standby (pg_rewind, or a fresh base backup).

The work is done by the modules beside this one: ``_home`` (the home's files
and lock), ``_programs`` (the server programs, run as the server's OS user),
``_server`` (one data directory and its server), ``_standby`` (replication).
``CLUSTER.md`` explains the layout and the settings.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType
from typing import Self

from psycopg import sql
from ringq.engine import (
    ConfigError,
    DatabaseUnavailable,
    RingqError,
    Tidied,
    ringq_home,
    scan_server,
    tidy_sections,
)
from ringq.engine.sqlfile import compose

from . import _queries as Qy
from ._errors import ClusterError, NoStandby
from ._home import (
    PAIR_FILE,
    PRIMARY_DIR,
    STANDBY_RUNNING,
    Pair,
    home_of,
    locked,
    remove_dsn,
    write_dsn,
)
from ._programs import Programs
from ._server import DATABASE, HOST, START_TIMEOUT, SUPERUSER, ClusterStatus, admin, dsn_of
from ._standby import Replication, StandbyStatus


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
        self._programs = Programs(self.home)
        self._replication = Replication(self.home, self._programs)
        self._started_by_enter = False

    @property
    def datadir(self) -> Path:
        """The primary's data directory: ``pgdata`` until a promotion says otherwise."""
        return self.home / Pair.read(self.home).primary

    @property
    def standby_datadir(self) -> Path | None:
        """The standby's data directory, or None when the home has no standby."""
        standby = Pair.read(self.home).standby
        return None if standby is None else self.home / standby

    @staticmethod
    def home_of(datadir: str | os.PathLike[str]) -> Path | None:
        """The home whose primary or standby data directory is ``datadir``
        (``<home>/pgdata`` or ``<home>/standby/pgdata``, whichever
        ``$RINGQ_HOME/replication`` names), or None when ``datadir`` is no
        embedded cluster's. After a promotion the primary's data directory is
        ``<home>/standby/pgdata``: this finds the home either way."""
        return home_of(datadir)

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
        with locked(self.home):
            pair = Pair.read(self.home)
            primary = self._replication.server(pair.primary)
            port = primary.running_port()
            if port is None:
                if not (primary.datadir / "PG_VERSION").exists():
                    if pair.primary != PRIMARY_DIR:
                        raise ClusterError(
                            f"the primary's data directory {primary.datadir} is missing "
                            f"(named in {self.home / PAIR_FILE})"
                        )
                    primary.initdb()
                port = primary.start(self._replication.primary_settings(pair))
            standby_failed = None
            if pair.standby is not None and pair.state == STANDBY_RUNNING:
                try:
                    self._replication.keep_running(pair, port)
                except ClusterError as exc:
                    standby_failed = exc  # the primary runs: still give it its DSN
            self._ensure_database(port)
            dsn = dsn_of(port)
            write_dsn(self.home, dsn)
            if standby_failed is not None:
                raise standby_failed
            return dsn

    def stop(self) -> Tidied:
        """Stop the server, and the standby if one runs (fast shutdown: sessions
        are disconnected, transactions roll back, prepared ones survive), and
        remove the DSN file. Harmless when stopped.

        The primary stops first: its clean shutdown sends the standby all its WAL.

        Then the global sections (and semaphores) of the cluster's databases
        leave this host's shared memory, which would keep them for ever: those
        of the databases the server had when it stopped, and any describing
        this cluster's history (databases dropped before). A section a live
        process still holds is kept; the returned :class:`~ringq.engine.Tidied`
        lists it (``kept``, with the holders' pids).

        :raises ClusterError: a server would not stop, even with an immediate shutdown.
        """
        if not self.home.is_dir():
            return Tidied()
        with locked(self.home):
            pair = Pair.read(self.home)
            primary = self._replication.server(pair.primary)
            instances = _instances(primary.running_port())
            primary.stop()
            if pair.standby is not None:
                self._replication.server(pair.standby).stop()
            remove_dsn(self.home)
            return tidy_sections(instances, _system_identifier(primary.datadir))

    def restart(self, *, timeout: int = START_TIMEOUT, log: Path | None = None) -> None:
        """Restart the primary: a fast shutdown (sessions are disconnected,
        transactions roll back, prepared ones survive), then a start on the
        same port, so every client's DSN still holds. Starts a stopped primary.
        The standby, if any, is left alone (it reconnects by itself).

        ``timeout``: seconds the stop, then the start, may each take.
        ``log``: where pg_ctl's server output goes (default: the primary's
        ``log/startup.log``, as at every start).

        :raises ClusterError: it did not stop or start in time (the message has
            pg_ctl's output).
        """
        with locked(self.home):
            primary = self._replication.primary()
            primary.restart(timeout=timeout, log=log or primary.datadir / "log" / "startup.log")

    def status(self) -> ClusterStatus:
        """Whether the primary runs, and where. Never raises for a stopped or absent cluster."""
        return self._replication.primary().status()

    def standby_status(self) -> StandbyStatus | None:
        """The standby's server and replication, or None when the home has none.
        Never raises for a stopped server."""
        return self._replication.status()

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
            pair = Pair.read(self.home)
            if pair.standby is None:
                raise NoStandby(
                    f"the embedded cluster under {self.home} has no standby: "
                    f"make one with 'ringq db standby start'"
                )
            ports = [
                self._replication.server(d).configured_port() for d in (pair.primary, pair.standby)
            ]
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
        return dsn_of(st.port, dbname)

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
        with locked(self.home):
            return self._replication.start(sync)

    def stop_standby(self) -> None:
        """Stop the standby; it is kept (with its slot) for ``start_standby``.
        Synchronous replication is turned off first, so the primary's commits
        do not wait for it. Harmless when stopped.

        :raises NoStandby: the home has no standby.
        """
        with locked(self.home):
            self._replication.stop()

    def remove_standby(self) -> None:
        """Stop the standby, drop its replication slot on the primary and delete
        its data directory: the home has a primary alone again.

        :raises NoStandby: the home has no standby.
        :raises DatabaseUnavailable: the primary is not running (its slot must be dropped).
        """
        with locked(self.home):
            self._replication.remove()

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
        with locked(self.home):
            return self._replication.promote()

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
        with locked(self.home):
            return self._replication.rebuild(fresh)

    # -- properties of the installation -------------------------------------

    @property
    def bindir(self) -> Path:
        """The directory of the server programs used (see :func:`find_bindir`)."""
        return self._programs.bindir

    @property
    def version(self) -> str:
        """The server's version, e.g. ``15.18``."""
        return self._programs.version

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
            self.stop()  # a section a live process holds is kept: stop() tells, nobody to tell here

    def __repr__(self) -> str:
        return f"Cluster({str(self.home)!r})"

    def _ensure_database(self, port: int) -> None:
        with admin(port) as conn:
            found = conn.execute(Qy.DATABASE_EXISTS, (DATABASE,)).fetchone()
            if found is None:
                conn.execute(compose(Qy.CREATE_DATABASE, database=sql.Identifier(DATABASE)))


def _instances(port: int | None) -> set[str]:
    """The instance ids of the running server's databases (none when it is
    stopped or does not answer: the system identifier still finds their sections)."""
    if port is None:
        return set()
    try:
        return set(scan_server(dsn_of(port, "postgres"), timeout=2).instances)
    except RingqError:
        return set()


def _system_identifier(datadir: Path) -> int:
    """The cluster's system identifier, the first word of ``global/pg_control``
    (in the host's byte order); 0 when it cannot be read."""
    try:
        with open(datadir / "global" / "pg_control", "rb") as f:
            head = f.read(8)
    except OSError:
        return 0
    return struct.unpack("=Q", head)[0] if len(head) == 8 else 0
