"""The embedded cluster's errors, under :class:`ringq.engine.RingqError`."""

from __future__ import annotations

from ringq.engine import RingqError


class ClusterError(RingqError):
    """The embedded PostgreSQL cluster could not be created, started or stopped."""


class PostgresNotFound(ClusterError):
    """No PostgreSQL server programs (``initdb``, ``pg_ctl``, ``postgres``) were found."""


class NoStandby(ClusterError):
    """The home has no standby (make one with ``ringq db standby start``)."""
