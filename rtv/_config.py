"""The viewer's settings: a frozen dataclass with named defaults, validated on creation.

Only the command line reads ``RINGQ_*`` variables; a library caller passes
every value explicitly.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from ringq.engine import ConfigError, validate_int, validate_seconds

DEFAULT_PORT = 7481
DEFAULT_HOST = "127.0.0.1"
DEFAULT_MONITOR_URL = "http://127.0.0.1:7480"
DEFAULT_REFRESH = 1.0  # seconds between updates of the page and the terminal view
DEFAULT_TIMEOUT = 5.0  # seconds allowed for one request to the monitor
DEFAULT_MAX_POINTS = 1800  # at most this many points per history asked of the monitor (it thins)

# The history windows the page offers: (label, seconds). The monitor serves
# what precedes its memory (it starts empty with the monitor) from its T4 day
# files, so "day" is the last 24 hours even after a monitor restart; it thins
# the answer into at most max_points buckets (1 min each for a day).
WINDOWS: tuple[tuple[str, int], ...] = (("5 min", 300), ("1 h", 3600), ("day", 86_400))
MAX_WINDOW = WINDOWS[-1][1]


def new_token() -> str:
    """A random URL-safe token (128 bits)."""
    return secrets.token_urlsafe(16)


@dataclass(frozen=True)
class ViewerConfig:
    """What a :class:`~ringq.rtv.Viewer` serves and where it reads.

    ``monitor_url`` is the monitor's base address (``http://host:port``);
    ``monitor_token`` is sent to it as ``Authorization: Bearer``. ``token``
    protects the viewer itself (a random one by default). ``port`` 0 picks a
    free port (read it back from ``Viewer.url``). ``refresh``, ``timeout`` and
    ``window`` (the history first shown) are seconds.

    :raises ConfigError: a value is out of range (the message says which).
    """

    monitor_url: str = DEFAULT_MONITOR_URL
    monitor_token: str | None = None
    token: str = field(default_factory=new_token)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    refresh: float = DEFAULT_REFRESH
    timeout: float = DEFAULT_TIMEOUT
    max_points: int = DEFAULT_MAX_POINTS
    window: int = WINDOWS[0][1]  # seconds of history first shown (one of WINDOWS)

    def __post_init__(self) -> None:
        parts = urlsplit(self.monitor_url) if isinstance(self.monitor_url, str) else None
        try:
            port = parts.port if parts is not None else None
        except ValueError:  # a port that is not a number: urllib would fail on every request
            port = 0
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or port == 0
        ):
            raise ConfigError(
                "monitor_url must be an http:// or https:// address (a numeric port, if any), "
                f"not {self.monitor_url!r}"
            )
        if parts.query or parts.fragment:
            raise ConfigError(
                "monitor_url must not carry a query or fragment (pass the token as monitor_token)"
            )
        object.__setattr__(self, "monitor_url", self.monitor_url.rstrip("/"))
        _token("token", self.token)
        if self.monitor_token is not None:
            _token("monitor_token", self.monitor_token)
        validate_int("port", self.port, 0, 65535)
        if not isinstance(self.host, str) or not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"host must be an address or host name, not {self.host!r}")
        validate_seconds("refresh", self.refresh, 0.1, 3600.0)
        validate_seconds("timeout", self.timeout, 0.1, 600.0)
        validate_int("max_points", self.max_points, 10)
        if self.window not in [seconds for _, seconds in WINDOWS]:
            choices = ", ".join(str(seconds) for _, seconds in WINDOWS)
            raise ConfigError(f"window must be one of {choices} seconds, not {self.window!r}")

    def replace(self, **changes: Any) -> ViewerConfig:
        """A validated copy with ``changes`` applied."""
        return replace(self, **changes)


def _token(what: str, value: object) -> None:
    if (
        not isinstance(value, str)
        or not value
        or any(c.isspace() or not c.isprintable() for c in value)
    ):
        raise ConfigError(
            f"{what} must be a non-empty string of printable characters without spaces"
        )
