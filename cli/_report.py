"""``ringq report``: charts of a period of the monitor's history, or of regression runs."""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from ringq.engine import ConfigError, exits, ringq_home

from ._args import env_option, subparser

RET_OK = exits.OK
RET_NO_DATA = exits.NOT_FOUND  # the period holds no data, or a run has no report
DEFAULT_HOURS = 24.0

DESCRIPTION = """\
Render one self-contained HTML page with its charts (PNG files beside it, and
embedded in the page, so it opens from the file system and can be mailed).

A period of the monitor's history (default: the last 24 hours), read from its
data directory alone (T4 files and monitor.log; no monitor needs to run): per
queue depth, committed enqueue and dequeue rates, call latency percentiles,
full and empty time, redeliveries, poison and the exception table; per client
kind the errors, deaths and expired leases the log holds; the events
(consumer died, lease expired, fail-over, held snapshot, monitor restarts)
marked on the time axis and listed. A period without a sample or an event
says so and exits 4.

  ringq report --from 2026-11-26T08:00 --to 2026-11-26T20:00 --queue orders --out /tmp/day

Times are ISO 8601 (UTC unless an offset is given) or unix seconds.

--runs A B: two (or more) regression runs on one page, from their directories
under --report-dir (where 'ringq regress' writes cycle-N.json, cycle-N.html and
run.html): throughput per cycle, latency percentiles, depth and commit rate
over the cycles end to end, each cycle's verdict. A RUN may also be a path."""


def register(sub: Any) -> None:
    p = subparser(sub, "report", "charts of a period of the monitor's history, or of "
                  "regression runs, as one HTML page", DESCRIPTION)
    p.set_defaults(func=run, _parser=p)
    p.add_argument("--from", dest="start", default=None, metavar="TIME",
                   help=f"start of the period (default: --to minus {DEFAULT_HOURS:g} h)")
    p.add_argument("--to", dest="end", default=None, metavar="TIME",
                   help="end of the period (default: now)")
    p.add_argument("--queue", action="append", default=None, metavar="Q",
                   help="only this queue (repeatable; default: every queue of the period)")
    p.add_argument("--runs", nargs="+", default=None, metavar="RUN",
                   help="compare these regression runs (two or more) instead")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the page goes (default: $RINGQ_HOME/reports/<period or runs>); "
                        "report.html (compare.html for --runs) and its _png/ folder")
    env_option(p, "--data-dir", env="RINGQ_MONITOR_DIR", default=None,
               help="the monitor's data directory; default $RINGQ_HOME/monitor")
    env_option(p, "--report-dir", env="RINGQ_REGRESS_REPORTS", default=None,
               help="with --runs: where the runs' directories are; default $RINGQ_HOME/regress")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def parse_time(text: str, flag: str) -> float:
    """ISO 8601 (naive: UTC) or unix seconds. :raises ConfigError:"""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is neither ISO 8601 (2026-11-26T08:00) "
                          "nor unix seconds") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def run(args: argparse.Namespace) -> int:
    from ringq.report import NoData

    t_start = time.monotonic()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"report: {msg} ({time.monotonic() - t_start:.1f} s)", file=sys.stderr,
                  flush=True)

    try:
        path = _compare(args, say) if args.runs else _period(args, say)
    except NoData as exc:
        print(f"ringq report: {exc}", file=sys.stderr)
        return RET_NO_DATA
    print(path)
    return RET_OK


def _period(args: argparse.Namespace, say: Any) -> Path:
    from ringq.report import period_page

    end = parse_time(args.end, "--to") if args.end else time.time()
    start = (parse_time(args.start, "--from") if args.start
             else end - timedelta(hours=DEFAULT_HOURS).total_seconds())
    if not end > start:
        raise ConfigError("--from must be before --to")
    data_dir = Path(args.data_dir) if args.data_dir else ringq_home() / "monitor"
    if not data_dir.is_dir():
        from ringq.report import NoData

        raise NoData(f"no monitor data directory at {data_dir} (see --data-dir)")
    out = Path(args.out) if args.out else ringq_home() / "reports" / (
        f"period-{_stamp(start)}-{_stamp(end)}")
    return period_page(data_dir, start, end, out, queues=args.queue, progress=say)


def _compare(args: argparse.Namespace, say: Any) -> Path:
    from ringq.report import NoData, compare_page

    if len(args.runs) < 2:
        raise ConfigError("--runs needs two runs (or more) to compare")
    if args.start or args.end or args.queue:
        raise ConfigError("--runs compares whole runs: --from, --to and --queue do not apply")
    base = Path(args.report_dir) if args.report_dir else ringq_home() / "regress"
    dirs = []
    for name in args.runs:
        d = Path(name) if Path(name).is_dir() else base / name
        if not d.is_dir():
            raise NoData(f"no regression run {name!r} in {base} (see 'ringq regress list')")
        dirs.append(d)
    out = Path(args.out) if args.out else ringq_home() / "reports" / (
        "compare-" + "-".join(d.name for d in dirs))
    say(f"reading {len(dirs)} runs")
    return compare_page(dirs, out)


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y%m%dT%H%M")
