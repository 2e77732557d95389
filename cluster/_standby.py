"""The embedded cluster's streaming standby: its replication settings and
slot, the base backup that makes it, ``pg_rewind`` that brings an old primary
back as a standby, the promotion, and its status as the primary sees it.

The two data directories keep their paths; ``$RINGQ_HOME/replication``
(:class:`ringq.cluster._home.Pair`) says which one is the primary.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ringq.engine import DatabaseUnavailable, RingqError

from . import _queries as Qy
from ._errors import ClusterError, NoStandby
from ._home import (
    ASYNC,
    PRIMARY_DIR,
    STANDBY_DIR,
    STANDBY_REBUILD,
    STANDBY_RUNNING,
    STANDBY_STOPPED,
    SYNC,
    Pair,
    relative,
    write_dsn,
)
from ._programs import Programs
from ._server import (
    CONF_FILE,
    COPY_TIMEOUT,
    HOST,
    START_TIMEOUT,
    SUPERUSER,
    ClusterStatus,
    Server,
    admin,
    dsn_of,
    tail,
)

STANDBY_NAME = "ringq_standby"  # the standby's application_name and its replication slot
STREAM_TIMEOUT = 60  # seconds a new standby has to stream (and to become synchronous)


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


class Replication:
    """The primary and standby servers of one home, and what passes between
    them. The caller (``Cluster``) holds the home's lock around each call."""

    def __init__(self, home: Path, programs: Programs) -> None:
        self.home = home
        self.programs = programs

    def server(self, relative_dir: str) -> Server:
        """The server of the data directory ``relative_dir`` (to the home)."""
        return Server(self.programs, self.home / relative_dir)

    def primary(self) -> Server:
        return self.server(Pair.read(self.home).primary)

    # -- settings ------------------------------------------------------------

    def primary_settings(self, pair: Pair) -> dict[str, str]:
        """The primary's replication settings: it waits for its standby's
        flush only while a synchronous standby is meant to run."""
        waits = pair.standby is not None and pair.mode == SYNC and pair.state == STANDBY_RUNNING
        return {"synchronous_standby_names": f"'{STANDBY_NAME}'" if waits else "''"}

    def standby_settings(self, primary_port: int | None) -> dict[str, str]:
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

    # -- what Cluster's public calls do ------------------------------------------

    def status(self) -> StandbyStatus | None:
        """The standby's server and replication, or None when the home has none."""
        pair = Pair.read(self.home)
        if pair.standby is None:
            return None
        st = self.server(pair.standby).status()
        streaming = sync_state = None
        lag = None
        port = self.server(pair.primary).running_port()
        if port is not None:
            try:
                with admin(port, timeout=5) as conn:
                    row = conn.execute(Qy.REPLICATION_STATE, (STANDBY_NAME,)).fetchone()
            except RingqError:
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

    def keep_running(self, pair: Pair, primary_port: int) -> None:
        """At start: start the standby that should run, or point it at the
        primary's port. If it cannot start, the primary must not wait for it."""
        assert pair.standby is not None
        standby = self.server(pair.standby)
        settings = self.standby_settings(primary_port)
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

    def start(self, sync: bool | None) -> str:
        """``Cluster.start_standby``: make (first time) and start the standby; its DSN."""
        pair = Pair.read(self.home)
        primary = self.server(pair.primary)
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
        standby = self.server(pair.standby or free)
        if not (standby.datadir / "PG_VERSION").exists():
            self._create_slot(port)
            self._base_backup(port, standby)
        pair = Pair(pair.primary, relative(self.home, standby.datadir), mode, STANDBY_STOPPED)
        pair.write(self.home)
        return self._run_standby(pair, primary, standby, port=standby.configured_port())

    def stop(self) -> None:
        """``Cluster.stop_standby``: stop it, the primary no longer waiting for it."""
        pair = self._pair_with_standby()
        if pair.state == STANDBY_RUNNING:
            pair = replace(pair, state=STANDBY_STOPPED)
            pair.write(self.home)
            self._apply_primary_settings(pair)
        assert pair.standby is not None
        self.server(pair.standby).stop()

    def remove(self) -> None:
        """``Cluster.remove_standby``: stop it, drop its slot, delete its data directory."""
        pair = self._pair_with_standby()
        assert pair.standby is not None
        port = self._primary_port(self.server(pair.primary))
        standby = self.server(pair.standby)
        Pair(pair.primary).write(self.home)
        self._apply_primary_settings(Pair(pair.primary))
        standby.stop()
        standby.recover_crashed()  # frees the shared memory a killed server left
        self._drop_slot(port)
        shutil.rmtree(standby.datadir)

    def promote(self) -> str:
        """``Cluster.promote``: the standby becomes the primary; its DSN, written to the home."""
        pair = self._pair_with_standby()
        assert pair.standby is not None
        if pair.state == STANDBY_REBUILD:
            raise ClusterError(
                f"{self.home / pair.standby} is the old primary, not a standby: nothing "
                f"to promote (bring it back first with 'ringq db standby rebuild')"
            )
        old, new = self.server(pair.primary), self.server(pair.standby)
        old.stop()
        port = new.running_port()
        if port is None:
            port = new.start(self.standby_settings(old.configured_port()))
        if new.in_recovery(port) is not False:
            proc = new.pg_ctl("promote", "-t", str(START_TIMEOUT))
            if proc.returncode != 0 or new.in_recovery(port) is not False:
                raise ClusterError(
                    f"the standby in {new.datadir} was not promoted: {tail(proc.stdout)}"
                )
        # The old primary's slot, made at once: the new primary then keeps
        # its WAL from the fork on (a slot reserves from the last checkpoint's
        # redo), which the old primary, rewound, must replay to stream again;
        # its checkpoints until the rebuild would recycle it otherwise.
        # max_slot_wal_keep_size bounds what a standby never rebuilt holds.
        self._create_slot(port)
        pair = Pair(pair.standby, pair.primary, pair.mode, STANDBY_REBUILD)
        pair.write(self.home)
        new.rewrite_conf(self.primary_settings(pair))  # a primary's, for its next start
        dsn = dsn_of(port)
        write_dsn(self.home, dsn)
        return dsn

    def rebuild(self, fresh: bool) -> str:
        """``Cluster.rebuild_standby``: ``rewound``, ``unchanged`` or ``copied``."""
        pair = self._pair_with_standby()
        assert pair.standby is not None
        primary, target = self.server(pair.primary), self.server(pair.standby)
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
        if how is not None:
            try:
                self._run_standby(pair, primary, target, port=keep_port)
                return how
            except ClusterError as exc:
                # Rewound, it may still need WAL the new primary no longer
                # has (its checkpoints since the promotion recycled the
                # segment of the fork: "requested WAL segment ... has already
                # been removed"): copy it anew instead.
                with (target.datadir / "log" / "rebuild.log").open("a") as f:
                    f.write(f"rewound, but it did not stream ({exc}): copying it anew\n")
                target.stop()
                target.wait_gone()
                pair = Pair.read(self.home)
        target.recover_crashed()  # frees the shared memory a killed server left
        self._base_backup(port, target)
        self._run_standby(pair, primary, target, port=keep_port)
        return "copied"

    # -- steps -----------------------------------------------------------------

    def _pair_with_standby(self) -> Pair:
        pair = Pair.read(self.home)
        if pair.standby is None:
            raise NoStandby(
                f"the embedded cluster under {self.home} has no standby: "
                f"make one with 'ringq db standby start'"
            )
        return pair

    def _primary_port(self, primary: Server) -> int:
        port = primary.running_port()
        if port is None:
            raise DatabaseUnavailable(
                f"the primary of the embedded cluster under {self.home} ({primary.datadir}) "
                f"is not running: start it with 'ringq db start'"
            )
        return port

    def _apply_primary_settings(self, pair: Pair) -> None:
        """Rewrite the primary's replication settings and reload it (when it runs)."""
        primary = self.server(pair.primary)
        primary.rewrite_conf(self.primary_settings(pair))
        if primary.running_port() is not None:
            primary.reload()

    def _run_standby(
        self, pair: Pair, primary: Server, standby: Server, *, port: int | None
    ) -> str:
        """Start ``standby`` (or point the running one at the primary), wait
        until it streams, then record it as running and let the primary wait
        for it when synchronous; the standby's DSN."""
        primary_port = self._primary_port(primary)
        settings = self.standby_settings(primary_port)
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
        return dsn_of(standby_port)

    def _wait_replication(self, primary_port: int, standby: Server, *, sync: bool) -> None:
        """Wait until the primary streams to the standby (and counts it as synchronous)."""
        deadline = time.monotonic() + STREAM_TIMEOUT
        row = None
        with admin(primary_port) as conn:
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
        with admin(primary_port) as conn:
            conn.execute(Qy.CREATE_SLOT, {"slot": STANDBY_NAME})

    def _drop_slot(self, primary_port: int) -> None:
        """Drop the standby's slot, once the walsender of the stopped standby has left it."""
        deadline = time.monotonic() + STREAM_TIMEOUT
        with admin(primary_port) as conn:
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

    def _base_backup(self, primary_port: int, target: Server) -> None:
        """Copy the primary into ``target``'s data directory (replacing it, its
        logs kept) with pg_basebackup through the standby's slot."""
        parent = target.datadir.parent
        if not parent.is_dir():
            parent.mkdir(parents=True, mode=0o755)
            self.programs.give(parent)
        staging = parent / f"{target.datadir.name}.init"
        shutil.rmtree(staging, ignore_errors=True)  # what a killed backup left
        source = (
            f"host={HOST} port={primary_port} user={SUPERUSER} "
            "application_name=ringq_basebackup"
        )
        proc = self.programs.run(
            [
                str(self.programs.bindir / "pg_basebackup"),
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
            raise ClusterError(f"pg_basebackup into {staging} failed: {tail(proc.stdout)}")
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
            self.programs.give(staging / "log")
        if target.datadir.exists():
            shutil.rmtree(target.datadir)
        staging.rename(target.datadir)

    def _rewind(self, primary_port: int, target: Server) -> str | None:
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
        with admin(primary_port) as conn:
            conn.execute(Qy.CHECKPOINT)
        try:
            proc = self.programs.run(
                [
                    str(self.programs.bindir / "pg_rewind"),
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
