"""``ringq db start|stop|status|url``: the embedded PostgreSQL cluster under ``$RINGQ_HOME``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ringq.engine import exits
from ringq.scripting import Cluster

from ._args import env_option, subparser

DESCRIPTION = """\
A private PostgreSQL server under $RINGQ_HOME (default ./.ringq), listening on
127.0.0.1 on a free port, with a database 'ringq'. While it runs, its DSN is in
$RINGQ_HOME/dsn, where every other ringq command finds it when neither --dsn
nor RINGQ_DSN is given. See scripting/CLUSTER.md for its settings."""


def register(sub: Any) -> None:
    db = subparser(sub, "db", "the embedded PostgreSQL cluster", DESCRIPTION)
    db.set_defaults(_parser=db)
    actions = db.add_subparsers(dest="db_command", metavar="ACTION")

    start = subparser(
        actions,
        "start",
        "create (first time) and start the cluster; print its DSN",
        "Create the cluster on first use, start it if it is not running, and create\n"
        "the database 'ringq'. Prints what it did; the DSN is the last line.\n"
        "Harmless when it already runs (the DSN is the same).",
    )
    stop = subparser(
        actions,
        "stop",
        "stop the cluster (harmless when stopped)",
        "Fast shutdown: sessions are disconnected and their transactions rolled back;\n"
        "prepared (two-phase) transactions survive. Removes $RINGQ_HOME/dsn.",
    )
    status = subparser(
        actions,
        "status",
        "show whether the cluster runs (exit 0 if it does, 1 if not)",
    )
    url = subparser(
        actions,
        "url",
        "print only the DSN (exit 3 if the cluster is not running)",
        'Print only the DSN, for scripts: psql "$(ringq db url)".',
    )
    for parser, func in ((start, _start), (stop, _stop), (status, _status), (url, _url)):
        env_option(
            parser,
            "--home",
            env="RINGQ_HOME",
            default=".ringq",
            help="directory of the cluster (data, socket, DSN file)",
        )
        parser.set_defaults(func=func)


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
    print(dsn)
    return exits.OK


def _stop(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if not cluster.status().running:
        cluster.stop()  # still tidies a stale DSN file
        print(f"not running under {cluster.home}")
        return exits.OK
    cluster.stop()
    print(f"stopped (under {cluster.home})")
    return exits.OK


def _status(args: argparse.Namespace) -> int:
    st = _cluster(args).status()
    rows = [
        ("state", "running" if st.running else "not running"),
        ("dsn", st.dsn or "-"),
        ("pid", str(st.pid) if st.pid else "-"),
        ("port", str(st.port) if st.port else "-"),
        ("datadir", str(st.datadir)),
        ("socket", str(st.socket_dir) if st.socket_dir else "-"),
        ("server", f"PostgreSQL {st.version} ({st.bindir})" if st.bindir else "not installed"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return exits.OK if st.running else exits.FAILURE


def _url(args: argparse.Namespace) -> int:
    print(_cluster(args).url())  # DatabaseUnavailable -> exit 3 in _main
    sys.stdout.flush()
    return exits.OK
