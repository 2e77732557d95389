"""``ringq rtv``: the Real Time Viewer, a token-protected web page (or ``--tui``) over the
monitor's API."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

from ringq.engine import exits
from ringq.rtv import (
    DEFAULT_MONITOR_URL,
    DEFAULT_PORT,
    DEFAULT_REFRESH,
    WINDOWS,
    MonitorClient,
    MonitorError,
    Viewer,
    ViewerConfig,
    new_token,
    run_tui,
)

from ._args import env_option, subparser

DESCRIPTION = """\
Live plots of every queue, read only from the monitor's HTTP API
(`ringq monitor` must run): per queue, depth against capacity, enqueue and
dequeue rates, enqueue/dequeue latency p50 and p99 over time, full/empty
periods, retries and exception-queue entries, and a table of all queues.

The page is served on 127.0.0.1 and asks for a token: a random one unless
--token or RINGQ_RTV_TOKEN gives it. Its full address, token included, is
printed at start. The browser talks only to this server, which forwards to
the monitor (with --monitor-token when the monitor asks for one).

--tui shows the same figures in the terminal (for ssh), refreshed in place;
Ctrl-C quits."""

# --window names for the page's choices (rtv.WINDOWS: 5 min, 1 h, the day).
_WINDOW_CHOICES = dict(zip(("5m", "1h", "day"), (seconds for _, seconds in WINDOWS), strict=True))


def register(sub: Any) -> None:
    p = subparser(
        sub, "rtv", "the Real Time Viewer: live web page (or --tui) over the monitor", DESCRIPTION
    )
    env_option(p, "--port", env="RINGQ_RTV_PORT", default=DEFAULT_PORT, type=int,
               help="port of the page on 127.0.0.1 (0: any free port)")
    env_option(p, "--monitor", env="RINGQ_MONITOR_URL", default=DEFAULT_MONITOR_URL,
               help="the monitor's HTTP address")
    env_option(p, "--monitor-token", env="RINGQ_MONITOR_TOKEN", default=None,
               help="token the monitor asks for, if any")
    env_option(p, "--token", env="RINGQ_RTV_TOKEN", default=None,
               help="token protecting the page; default: a random one, printed")
    env_option(p, "--refresh", env="RINGQ_RTV_REFRESH", default=DEFAULT_REFRESH, type=float,
               help="seconds between updates")
    env_option(p, "--window", env="RINGQ_RTV_WINDOW", default="5m", choices=sorted(_WINDOW_CHOICES),
               help="history first shown (the page can change it; --tui draws its trends over it)")
    p.add_argument(
        "--tui",
        action="store_true",
        help="show the figures in this terminal instead of serving a page",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    config = ViewerConfig(
        monitor_url=args.monitor,
        monitor_token=args.monitor_token,
        token=args.token or new_token(),
        port=args.port,
        refresh=args.refresh,
        window=_WINDOW_CHOICES[args.window],
    )
    client = MonitorClient(config.monitor_url, config.monitor_token, timeout=config.timeout)
    if args.tui:
        return run_tui(client, refresh=config.refresh, window=config.window)
    return _serve(config, client)


def _serve(config: ViewerConfig, client: MonitorClient) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Viewer(config, client=client) as viewer:
            print(
                f"ringq rtv: the Real Time Viewer of the monitor at {config.monitor_url}",
                flush=True,
            )
            print(f"open {viewer.url}", flush=True)
            try:
                client.queues()
            except MonitorError as exc:
                print(f"ringq rtv: warning: {exc} (the page shows it and keeps trying)",
                      file=sys.stderr, flush=True)
            stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exits.OK
