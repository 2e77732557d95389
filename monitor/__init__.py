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

:func:`run_daemon` is the body of ``ringq monitor`` (signals, pidfile,
``--detach``, SIGHUP reload of a config file); :func:`pump_inbox` and
:func:`prune_keys` are two of the monitor's steps, callable on their own;
:func:`t4_rows`, :func:`t4_queues`, :func:`kind_rows` (per client kind, columns
:data:`KIND_KEYS`), :func:`client_kinds` and :func:`journal_records` read its
files back without a monitor (``ringq report``).
"""

from ._config import (
    DEFAULT_HOST,
    DEFAULT_INTERVAL,
    DEFAULT_KEY_RETENTION,
    DEFAULT_PORT,
    DEFAULT_PREPARED_TIMEOUT,
    MonitorConfig,
)
from ._daemon import RELOADABLE, read_config, read_state, reset_section, run_daemon
from ._errors import MonitorError, MonitorRunning
from ._events import Event, Subscription, subscribe
from ._inbox import pump_inbox
from ._keys import prune_keys
from ._readback import (
    KIND_KEYS,
    client_kinds,
    journal_records,
    kind_rows,
    t4_queues,
    t4_rows,
)
from ._service import Monitor
from ._statefile import STATE_FILE

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_INTERVAL",
    "DEFAULT_KEY_RETENTION",
    "DEFAULT_PORT",
    "DEFAULT_PREPARED_TIMEOUT",
    "KIND_KEYS",
    "RELOADABLE",
    "STATE_FILE",
    "Event",
    "Monitor",
    "MonitorConfig",
    "MonitorError",
    "MonitorRunning",
    "Subscription",
    "client_kinds",
    "journal_records",
    "kind_rows",
    "prune_keys",
    "pump_inbox",
    "read_config",
    "read_state",
    "reset_section",
    "run_daemon",
    "subscribe",
    "t4_queues",
    "t4_rows",
]
