"""``ringq db start|stop|status|url|promote`` and ``ringq db standby start|stop|rebuild|remove``:
the embedded PostgreSQL cluster under ``$RINGQ_HOME``, and its streaming standby."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringq.cluster import Cluster, ClusterStatus, NoStandby, StandbyStatus
from ringq.engine import Tidied, exits, resolve_dsn
from ringq.scripting import connect_admin, create_schema

from ._args import action, add_dsn, command_group, env_option, failed

DESCRIPTION = """\
A private PostgreSQL server under $RINGQ_HOME (default ./.ringq), listening on
127.0.0.1 on a free port, with a database 'ringq'. While it runs, its DSN is in
$RINGQ_HOME/dsn, where every other ringq command finds it when neither --dsn
nor RINGQ_DSN is given. 'ringq db standby start' adds a streaming standby on
this host, 'ringq db promote' fails over to it. See cluster/CLUSTER.md."""

STANDBY_DESCRIPTION = """\
A streaming standby of the embedded cluster on this host, in
$RINGQ_HOME/standby/pgdata, on a port of its own: to try fail-over on one
machine. 'ringq db promote' makes it the primary; 'ringq db standby rebuild'
then brings the old primary back as the new primary's standby."""


START_HELP = """\
Create the cluster on first use, start it if it is not running, and create
the database 'ringq'. Prints what it did; the DSN is the last line.
Harmless when it already runs (the DSN is the same). Starts the standby
too when there is one (not stopped with 'ringq db standby stop')."""

STOP_HELP = """\
Fast shutdown: sessions are disconnected and their transactions rolled back;
prepared (two-phase) transactions survive. Removes $RINGQ_HOME/dsn. The
primary stops first, so that the standby receives all its WAL. Then the
global sections and semaphores of the cluster's databases leave /dev/shm;
one that a live process still holds is kept, and named."""

URL_HELP = """\
Print only the DSN, for scripts: psql "$(ringq db url)".
With --both, a multi-host DSN naming the primary and the standby with
target_session_attrs=read-write: clients that reconnect with it follow
a promotion (exit 4 if there is no standby)."""

PROMOTE_HELP = """\
Promote the standby (pg_ctl promote) and point $RINGQ_HOME/dsn at it, so
every ringq process that reads that file follows it. A primary still
running is stopped first (a switchover: nothing is lost, even with an
asynchronous standby); a dead one is a fail-over. The old primary is not
started again: 'ringq db standby rebuild' brings it back as a standby."""

STANDBY_START_HELP = """\
The first time: a base backup of the running primary (pg_basebackup through
the replication slot 'ringq_standby') into $RINGQ_HOME/standby/pgdata.
Then start it on a free port of its own (kept across restarts), wait until
it streams, and with --sync until the primary waits for it at every commit
(synchronous_standby_names). Harmless when it runs: changes the mode if asked."""

STANDBY_STOP_HELP = """\
The primary stops waiting for it first (synchronous replication off), then
the standby stops. 'ringq db standby start' starts it again and catches up."""

STANDBY_REBUILD_HELP = """\
Stop it if it runs, then pg_rewind it to the new primary's history (what it
committed that the new primary never received is undone), or, with --fresh
or when pg_rewind cannot, copy it anew with pg_basebackup. Its port and logs
are kept. Then start it as a standby, as 'standby start' does."""

# What 'ringq db --help' and 'ringq db standby --help' say of each action.
ACTIONS = {
    "start": "create (first time) and start the cluster; print its DSN",
    "stop": "stop the cluster, and its standby (harmless when stopped)",
    "status": "show the primary and the standby: running, where, which is primary "
    "(exit 0 if the primary runs, 1 if not)",
    "url": "print only the DSN (exit 3 if the cluster is not running)",
    "promote": "make the standby the primary; print the new DSN (exit 4 if no standby)",
    "standby start": "make (first time) and start the standby; print its DSN",
    "standby stop": "stop the standby (kept, with its slot; harmless when stopped)",
    "standby rebuild": "bring the old primary (after a promotion) back as a standby of the new one",
    "standby remove": "stop the standby, drop its slot and delete its data directory",
    "upgrade": "bring a database's ringq schema up to date (any database: --dsn)",
}

UPGRADE_HELP = """\
Apply the management schema to the database: objects a newer ringq adds
(tables, columns, SQL functions such as ringq.dequeue and each queue's
ringq.dq_<name>) are created, nothing is dropped, and applying it again
changes nothing. The database is --dsn, else RINGQ_DSN, else the embedded
cluster. Exit 0 when done, 3 if the database cannot be reached."""


def register(sub: Any) -> None:
    actions = command_group(sub, "db", "the embedded PostgreSQL cluster", DESCRIPTION)
    homed = [
        action(actions, "start", _start, ACTIONS["start"], START_HELP),
        action(actions, "stop", _stop, ACTIONS["stop"], STOP_HELP),
        action(actions, "status", _status, ACTIONS["status"]),
    ]
    url = action(actions, "url", _url, ACTIONS["url"], URL_HELP)
    url.add_argument(
        "--both",
        action="store_true",
        help="the multi-host DSN of the primary and its standby",
    )
    homed += [url, action(actions, "promote", _promote, ACTIONS["promote"], PROMOTE_HELP)]
    add_dsn(action(actions, "upgrade", _upgrade, ACTIONS["upgrade"], UPGRADE_HELP))

    standby = command_group(actions, "standby", "the streaming standby", STANDBY_DESCRIPTION)
    s_start = action(
        standby, "start", _standby_start, ACTIONS["standby start"], STANDBY_START_HELP
    )
    mode = s_start.add_mutually_exclusive_group()
    mode.add_argument(
        "--sync",
        dest="sync",
        action="store_true",
        default=argparse.SUPPRESS,
        help="synchronous: a commit returns once the standby has its WAL on disk, so a "
        "fail-over loses nothing committed (default: a new standby is synchronous, "
        "an existing one keeps its mode)",
    )
    mode.add_argument(
        "--async",
        dest="sync",
        action="store_false",
        default=argparse.SUPPRESS,
        help="asynchronous: commits do not wait; a fail-over loses what the standby "
        "had not received yet",
    )
    s_stop = action(standby, "stop", _standby_stop, ACTIONS["standby stop"], STANDBY_STOP_HELP)
    s_rebuild = action(
        standby, "rebuild", _standby_rebuild, ACTIONS["standby rebuild"], STANDBY_REBUILD_HELP
    )
    s_rebuild.add_argument(
        "--fresh", action="store_true", help="a fresh base backup instead of pg_rewind"
    )
    s_remove = action(standby, "remove", _standby_remove, ACTIONS["standby remove"])
    homed += [s_start, s_stop, s_rebuild, s_remove]
    for parser in homed:
        env_option(
            parser,
            "--home",
            env="RINGQ_HOME",
            default=".ringq",
            help="directory of the cluster (data, socket, DSN file)",
        )


def _upgrade(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        create_schema(conn)
    print("ringq schema up to date (every queue has its SQL dequeue function)")
    return exits.OK


def _cluster(args: argparse.Namespace) -> Cluster:
    return Cluster(Path(args.home))


def _start(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if cluster.status().running:
        dsn = cluster.start()
        print(f"already running under {cluster.home}")
    else:
        began = time.monotonic()
        created = not (cluster.datadir / "PG_VERSION").exists()
        dsn = cluster.start()
        st = cluster.status()
        what = "created and started" if created else "started"
        print(
            f"{what} PostgreSQL {st.version} under {cluster.home} "
            f"(pid {st.pid}, port {st.port}) in {time.monotonic() - began:.1f} s"
        )
    sb = cluster.standby_status()
    if sb is not None and sb.running:
        print(f"standby running ({sb.mode}, pid {sb.pid}, port {sb.port})")
    print(dsn)
    return exits.OK


def _stop(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    sb = cluster.standby_status()
    if not cluster.status().running and not (sb is not None and sb.running):
        tidied = cluster.stop()  # still tidies a stale DSN file, and sections left before
        print(f"not running under {cluster.home}")
    else:
        tidied = cluster.stop()
        print(f"stopped (under {cluster.home})")
    tell_tidied(tidied)
    return exits.OK


def tell_tidied(tidied: Tidied) -> None:
    """Say which global sections left shared memory, and which stay and why."""
    if tidied.removed:
        mib = sum(s.memory for s in tidied.removed) / 2**20
        print(f"removed {len(tidied.removed)} global section(s) from /dev/shm ({mib:.1f} MiB)")
    for kept in tidied.kept:
        pids = ", ".join(map(str, kept.pids))
        print(
            f"kept global section {kept.name} ({kept.memory / 2**20:.1f} MiB): "
            f"live process(es) {pids} still attached; 'ringq section prune' removes it "
            "once they exit"
        )


def _status(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    st = cluster.status()
    rows = [
        ("state", "running" if st.running else "not running"),
        ("role", _role(st, "primary")),
        ("dsn", st.dsn or "-"),
        ("pid", str(st.pid) if st.pid else "-"),
        ("port", str(st.port) if st.port else "-"),
        ("datadir", str(st.datadir)),
        ("socket", str(st.socket_dir) if st.socket_dir else "-"),
        ("server", f"PostgreSQL {st.version} ({st.bindir})" if st.bindir else "not installed"),
    ]
    sb = cluster.standby_status()
    if sb is not None:
        rows += [
            ("standby", _standby_state(sb)),
            ("  role", _role(sb, "standby")),
            ("  pid", str(sb.pid) if sb.pid else "-"),
            ("  port", str(sb.port) if sb.port else "-"),
            ("  datadir", str(sb.datadir)),
        ]
        with contextlib.suppress(NoStandby):
            rows.append(("both", cluster.url(both=True)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return exits.OK if st.running else exits.FAILURE


def _role(st: ClusterStatus, meant: str) -> str:
    """What the server is, by pg_is_in_recovery(), against what the home means it to be."""
    if st.in_recovery is None:
        return f"{meant} (not answering)" if st.running else f"{meant} (stopped)"
    actual = "standby" if st.in_recovery else "primary"
    return f"{actual} (pg_is_in_recovery: {str(st.in_recovery).lower()})" + (
        "" if actual == meant else f"; expected a {meant}"
    )


def _standby_state(sb: StandbyStatus) -> str:
    if sb.state == "rebuild":
        return "the old primary: bring it back with 'ringq db standby rebuild'"
    what = "running" if sb.running else "not running"
    if sb.state == "stopped":
        what += " (stopped by 'ringq db standby stop')"
    seen = "not connected" if sb.streaming is None else f"{sb.streaming}, {sb.sync_state}"
    lag = "" if sb.lag_bytes is None else f", {sb.lag_bytes} bytes to replay"
    return f"{what}; {sb.mode}; {seen}{lag}"


def _needs_standby(
    command: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """A command that needs the home's standby: without one, it says so
    and exits with NOT_FOUND (4)."""
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except NoStandby as exc:
            return failed(exc, exits.NOT_FOUND)

    return run


@_needs_standby
def _url(args: argparse.Namespace) -> int:
    print(_cluster(args).url(both=args.both))  # DatabaseUnavailable -> exit 3 in _main
    sys.stdout.flush()
    return exits.OK


@_needs_standby
def _promote(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    began = time.monotonic()
    dsn = cluster.promote()
    print(
        f"promoted {cluster.datadir} in {time.monotonic() - began:.1f} s; "
        f"{cluster.home / 'dsn'} names it now"
    )
    print(dsn)
    return exits.OK


def _standby_start(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    began = time.monotonic()
    dsn = cluster.start_standby(sync=getattr(args, "sync", None))  # neither flag: None
    sb = cluster.standby_status()
    assert sb is not None
    print(
        f"standby running under {sb.datadir} ({sb.mode}, pid {sb.pid}, port {sb.port}) "
        f"in {time.monotonic() - began:.1f} s"
    )
    print(dsn)
    return exits.OK


@_needs_standby
def _standby_stop(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    cluster.stop_standby()
    print(f"standby stopped (under {cluster.home}); the primary no longer waits for it")
    return exits.OK


@_needs_standby
def _standby_rebuild(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    began = time.monotonic()
    how = cluster.rebuild_standby(fresh=args.fresh)
    sb = cluster.standby_status()
    assert sb is not None
    said = {"rewound": "pg_rewind", "unchanged": "nothing to rewind", "copied": "pg_basebackup"}
    print(
        f"rebuilt {sb.datadir} as a {sb.mode} standby of {cluster.datadir} "
        f"({said.get(how, how)}; port {sb.port}) in {time.monotonic() - began:.1f} s"
    )
    return exits.OK


@_needs_standby
def _standby_remove(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    cluster.remove_standby()
    print(f"standby removed (under {cluster.home})")
    return exits.OK
