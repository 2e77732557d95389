"""The monitor's settings: a frozen dataclass with named defaults, validated on creation.

Only the command line reads ``RINGQ_*`` variables; a library caller passes
every value it wants explicitly (``data_dir=None`` keeps everything in memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ringq.engine import ConfigError, validate_int, validate_seconds

DEFAULT_INTERVAL = 1.0  # seconds between performance samples
DEFAULT_RECOVERY_INTERVAL = 0.1  # seconds between recovery passes (dead clients, locks, reclaim)
DEFAULT_PORT = 7480
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PREPARED_TIMEOUT = 60.0  # seconds before an undecided prepared transaction is rolled back
# Seconds an idempotency key is kept at least, counted from the key's creation
# (the enqueue that made it), not from its entry's consumption; a key whose
# entry is still on the queue is kept past it, however old.
DEFAULT_KEY_RETENTION = 86_400.0
DEFAULT_HISTORY_SECONDS = 24 * 3600.0  # in-memory history kept per queue
DEFAULT_T4_KEEP_DAYS = 14  # daily T4 files kept
DEFAULT_HIGH_WATER = 0.8  # depth / capacity that raises queue.<name>.high_water
# Seconds a transaction may hold back the xmin horizon (stopping the rings'
# pruning) before the monitor warns and names it.
DEFAULT_XMIN_WARN_S = 30.0
# Dead rows a ring must have gained while the horizon was held for the monitor
# to vacuum it once the holder is gone.
DEFAULT_VACUUM_DEAD_ROWS = 1000

MAX_INTERVAL = 3600.0
MAX_HISTORY_POINTS = 86_400 * 7  # a hard bound on memory whatever the interval


@dataclass(frozen=True)
class MonitorConfig:
    """What a :class:`~ringq.monitor.Monitor` does and where.

    ``interval`` and ``recovery_interval`` are seconds; ``port`` 0 picks a free
    port (read it back from ``Monitor.url``). ``data_dir`` holds the T4 CSV
    files and the JSON-lines log ``monitor.log``; ``None`` writes no files.
    ``token``, when set, is required by every HTTP path but ``/metrics``.
    ``cors_origin`` (``None``: no cross-origin reads) is the one origin, such as
    ``http://127.0.0.1:7481``, or ``*``, whose pages may read the API from a browser.
    ``xmin_warn_s``: seconds a transaction may hold back the xmin horizon
    before the monitor warns (log, event, metric) and names it; once it is
    gone, the rings that gained at least ``vacuum_dead_rows`` dead rows
    meanwhile are vacuumed. ``dsn_file`` names the file ``dsn`` was read
    from (the embedded cluster's, :func:`ringq.engine.dsn_file`): when the
    database cannot be reached, the monitor reads it again and follows a
    cluster that came back under another DSN.

    :raises ConfigError: a value is out of range (the message says which).
    """

    dsn: str
    interval: float = DEFAULT_INTERVAL
    recovery_interval: float = DEFAULT_RECOVERY_INTERVAL
    port: int = DEFAULT_PORT
    host: str = DEFAULT_HOST
    token: str | None = None
    data_dir: Path | None = None
    prepared_timeout: float = DEFAULT_PREPARED_TIMEOUT
    key_retention: float = DEFAULT_KEY_RETENTION
    history_seconds: float = DEFAULT_HISTORY_SECONDS
    t4_keep_days: int = DEFAULT_T4_KEEP_DAYS
    high_water: float = DEFAULT_HIGH_WATER
    http: bool = True  # serve HTTP at all (off for an embedded recovery-only monitor)
    cors_origin: str | None = None
    xmin_warn_s: float = DEFAULT_XMIN_WARN_S
    vacuum_dead_rows: int = DEFAULT_VACUUM_DEAD_ROWS
    dsn_file: Path | None = None
    # Reserve ring slots for SQL producers' ringq.enqueue_many (issue 34):
    # off, every SQL entry goes through the inbox and the pump.
    sql_reserve_slots: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.dsn, str) or not self.dsn:
            raise ConfigError("dsn must be a non-empty string")
        validate_seconds("interval", self.interval, 0.01, MAX_INTERVAL)
        validate_seconds("recovery_interval", self.recovery_interval, 0.01, MAX_INTERVAL)
        if self.recovery_interval > self.interval:
            raise ConfigError(
                f"recovery_interval ({self.recovery_interval:g}s) must not exceed interval "
                f"({self.interval:g}s)"
            )
        validate_seconds("prepared_timeout", self.prepared_timeout, 0.0, 365 * 86_400.0)
        validate_seconds("key_retention", self.key_retention, 0.0, 3650 * 86_400.0)
        validate_seconds("history_seconds", self.history_seconds, self.interval, 366 * 86_400.0)
        validate_int("port", self.port, 0, 65535)
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"host must be an address or host name, not {self.host!r}")
        if self.token is not None and (
            not isinstance(self.token, str)
            or not self.token
            or any(c.isspace() for c in self.token)
        ):
            raise ConfigError(
                "token must be a non-empty string without spaces (or None for no token)"
            )
        validate_int("t4_keep_days", self.t4_keep_days, 1)
        validate_seconds("high_water", self.high_water, 0.01, 1.0)
        validate_seconds("xmin_warn_s", self.xmin_warn_s, 0.0, 365 * 86_400.0)
        if (
            isinstance(self.vacuum_dead_rows, bool) or not isinstance(self.vacuum_dead_rows, int)
            or self.vacuum_dead_rows < 0
        ):
            raise ConfigError(
                f"vacuum_dead_rows must be an integer >= 0, not {self.vacuum_dead_rows!r}"
            )
        if self.cors_origin is not None and not _is_origin(self.cors_origin):
            raise ConfigError(
                f"cors_origin must be '*' or an origin such as http://127.0.0.1:7481 "
                f"(scheme, host, optional port; no path), not {self.cors_origin!r}"
            )
        if self.data_dir is not None and not isinstance(self.data_dir, Path):
            object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.dsn_file is not None and not isinstance(self.dsn_file, Path):
            object.__setattr__(self, "dsn_file", Path(self.dsn_file))

    @property
    def history_points(self) -> int:
        """Samples kept in memory per queue."""
        return min(MAX_HISTORY_POINTS, math.ceil(self.history_seconds / self.interval))

    def replace(self, **changes: Any) -> MonitorConfig:
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)


def _is_origin(value: object) -> bool:
    if value == "*":
        return True
    if not isinstance(value, str) or any(c.isspace() or not c.isprintable() for c in value):
        return False
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018  (raises for a port that is not a number)
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https") and bool(parts.hostname)
        and not parts.path and not parts.query and not parts.fragment and "@" not in parts.netloc
    )

