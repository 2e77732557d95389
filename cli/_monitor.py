"""``ringq monitor``: run the monitor of one database (foreground, or ``--detach``).

Only the options and the dispatch live here; the daemon (signals, pidfile,
``--detach``, SIGHUP reload, ``--reset-section``) is
:func:`ringq.monitor.run_daemon` and :func:`ringq.monitor.reset_section`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from ringq.engine import ConfigError, dsn_file, exits, resolve_dsn, ringq_home

from ._args import env_option, subparser

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
prepared_timeout, high_water, xmin_warn_s, vacuum_dead_rows) override the
options. A transaction holding back the xmin horizon past --xmin-warn is
named in a WARNING (and an event, and /metrics); once it ends, the rings it
bloated are vacuumed. Prefer RINGQ_MONITOR_TOKEN
or the config file to --token, which other users can see in ps."""


def register(sub: Any) -> None:
    p = subparser(sub, "monitor", "run the monitor (recovery, reclaim, metrics, HTTP)", DESCRIPTION)
    env_option(p, "--dsn", env="RINGQ_DSN",
               help="PostgreSQL DSN; default: the embedded cluster under $RINGQ_HOME")
    env_option(p, "--port", env="RINGQ_MONITOR_PORT", default=7480, type=int,
               help="HTTP port (0: any free port)")
    env_option(p, "--host", env="RINGQ_MONITOR_HOST", default="127.0.0.1",
               help="HTTP address to listen on")
    env_option(p, "--interval", env="RINGQ_MONITOR_INTERVAL", default=1.0, type=float,
               help="seconds between performance samples")
    env_option(p, "--token", env="RINGQ_MONITOR_TOKEN", default=None,
               help="token required by every HTTP path but /metrics")
    env_option(p, "--cors-origin", env="RINGQ_MONITOR_CORS_ORIGIN", default=None,
               help="the origin (such as http://127.0.0.1:7481) or '*' whose pages may read the "
                    "API from a browser; None: no cross-origin reads")
    env_option(p, "--data-dir", env="RINGQ_MONITOR_DIR", default=None,
               help="T4 files, monitor.log, monitor.json; default $RINGQ_HOME/monitor")
    env_option(p, "--prepared-timeout", env="RINGQ_MONITOR_PREPARED_TIMEOUT", default=60.0,
               type=float, help="seconds before an undecided prepared transaction is rolled back")
    env_option(p, "--xmin-warn", env="RINGQ_MONITOR_XMIN_WARN", default=30.0, type=float,
               help="seconds a transaction may hold back the xmin horizon before a warning")
    env_option(p, "--config", env="RINGQ_MONITOR_CONFIG", default=None,
               help="TOML file of reloadable settings, re-read on SIGHUP")
    env_option(p, "--pidfile", env="RINGQ_MONITOR_PIDFILE", default=None,
               help="write the monitor's pid here (default with --detach: DATA_DIR/monitor.pid)")
    p.add_argument("--detach", action="store_true",
                   help="run in the background; exit once it serves")
    p.add_argument("--sql-reserve-slots", action=argparse.BooleanOptionalAction, default=True,
                   help="reserve ring slots for SQL producers' ringq.enqueue_many (off: "
                        "every SQL entry goes through ringq.inbox and the pump)")
    p.add_argument("--reset-section", action="store_true",
                   help="remove the database's global section first (after a layout change; "
                        "stop every client first), then run")
    env_option(p, "--log-level", env="RINGQ_LOG_LEVEL", default="info",
               help="stderr log level (debug, info, warning, error)")
    p.set_defaults(func=run)


# -- the command -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from ringq.monitor import MonitorConfig, read_config, reset_section, run_daemon

    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        print(f"ringq monitor: unknown log level {args.log_level!r}", file=sys.stderr)
        return exits.USAGE
    dsn = resolve_dsn(args.dsn)
    data_dir = Path(args.data_dir) if args.data_dir else ringq_home() / "monitor"
    data_dir = data_dir.resolve()
    config_path = Path(args.config).resolve() if args.config else None
    pidfile = (
        Path(args.pidfile).resolve()
        if args.pidfile
        else (data_dir / "monitor.pid" if args.detach else None)
    )
    try:
        config = MonitorConfig(
            dsn=dsn, interval=args.interval, port=args.port, host=args.host,
            token=args.token or None, data_dir=data_dir, prepared_timeout=args.prepared_timeout,
            cors_origin=args.cors_origin or None,
            xmin_warn_s=args.xmin_warn, sql_reserve_slots=args.sql_reserve_slots,
            # the embedded cluster's: followed if it comes back elsewhere
            dsn_file=dsn_file(args.dsn),
        )
        if config_path is not None:
            config = config.replace(**read_config(config_path))
    except ConfigError as exc:
        print(f"ringq monitor: {exc}", file=sys.stderr)
        return exits.USAGE

    if args.reset_section:
        code = reset_section(dsn)
        if code != exits.OK:
            return code
    return run_daemon(
        config, config_path=config_path, pidfile=pidfile, detach=args.detach, log_level=level
    )
