"""The monitor's own errors (under :class:`ringq.engine.RingqError`)."""

from __future__ import annotations

from ringq.engine import RingqError


class MonitorError(RingqError):
    """The monitor could not start (port taken, files not writable …)."""


class MonitorRunning(MonitorError):
    """Another monitor already serves this database (it holds the monitor lock)."""
