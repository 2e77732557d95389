"""The Real Time Viewer: live plots of every queue, read only from the monitor's HTTP API.

Below the queues, a table of the sessions attached to the section (the
monitor's ``/api/clients``), workers first: each one's throughput (messages
handled per second for a worker, commits per second for a plain client) and
its handled, failed, timed-out and poisoned messages and errors.

- :class:`Viewer` serves the page (``start()/stop()``, a context manager);
  the browser talks only to it, and it proxies the monitor's API.
- :func:`run_tui` is the same figures in a terminal, refreshed in place.
- :class:`MonitorClient` reads the monitor's API, normalized for both.
- :func:`server_line` is the line both show (and ``ringq status`` prints):
  which server the monitor is on, whether it is the primary, and whether the
  section follows its database history.
- :func:`groups_line` is the line a grouped queue shows below its row (groups
  ready and busy, the oldest waiting entry's age, read-past skips), and
  :func:`waiting_line` the line of a queue whose entries wait for their due
  time (how many, when the next falls due).

The charts use uPlot, shipped in ``static/vendor`` (see its README there).
"""

from __future__ import annotations

from ._config import (
    DEFAULT_MONITOR_URL,
    DEFAULT_PORT,
    DEFAULT_REFRESH,
    WINDOWS,
    ViewerConfig,
    new_token,
)
from ._groups_line import groups_line
from ._server import Viewer, ViewerError
from ._server_line import ServerLine, server_line
from ._source import MonitorClient, MonitorError, MonitorUnavailable
from ._tui import run_tui
from ._waiting_line import waiting_line

__all__ = [
    "DEFAULT_MONITOR_URL",
    "DEFAULT_PORT",
    "DEFAULT_REFRESH",
    "WINDOWS",
    "MonitorClient",
    "MonitorError",
    "MonitorUnavailable",
    "ServerLine",
    "Viewer",
    "ViewerConfig",
    "ViewerError",
    "groups_line",
    "new_token",
    "run_tui",
    "server_line",
    "waiting_line",
]
