"""ringq.monitor: the monitor daemon of a database's queues.

It rebuilds the global section from the tables, recovers dead clients,
reclaims slots, moves SQL-enqueued entries into the rings, resolves
prepared transactions, samples per-queue performance (T4 CSV files,
in-memory history), publishes events over NOTIFY and serves it all over
HTTP (``monitor/API.md``).

    from ringq.monitor import Monitor, MonitorConfig, subscribe

    with Monitor(MonitorConfig(dsn, port=0)) as mon:
        print(mon.url)

    with subscribe(dsn, "queue.*.full") as events:
        for event in events:
            print(event.name, event.queue)
"""

from ._config import (
    DEFAULT_HOST,
    DEFAULT_INTERVAL,
    DEFAULT_PORT,
    DEFAULT_PREPARED_TIMEOUT,
    MonitorConfig,
)
from ._events import Event, Subscription, subscribe
from ._service import STATE_FILE, Monitor, MonitorError, MonitorRunning

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_INTERVAL",
    "DEFAULT_PORT",
    "DEFAULT_PREPARED_TIMEOUT",
    "STATE_FILE",
    "Event",
    "Monitor",
    "MonitorConfig",
    "MonitorError",
    "MonitorRunning",
    "Subscription",
    "subscribe",
]
