"""The documents the HTTP service serves (``monitor/API.md``): ``/api/queues``
(with the monitor's own figures and the server), ``/api/clients``,
``/api/history`` and ``/metrics``, made from what the steps last read.

:class:`Documents` builds them: it is the :class:`~._http.ApiSource` the HTTP
service reads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringq import __version__
from ringq.engine import Section
from ringq.engine import metrics as M

from . import _clients as C
from ._client_watch import WatchClients
from ._config import MonitorConfig
from ._figures import DatabaseFigures
from ._history import DAY, Answer, HistoryReader
from ._horizon import HorizonReport
from ._leases import ExpireLeases
from ._link import Link
from ._primary import ReadServer
from ._prom import CONTENT_TYPE, SectionCollector, render
from ._recover import RecoverClients
from ._sampler import Sampler
from ._section import Attachment
from ._step import Settings, StepRunner
from ._t4 import T4Reader


@dataclass(frozen=True)
class Sources:
    """Where the documents' figures come from: the monitor's parts and steps."""

    settings: Settings
    running: Callable[[], bool]
    started: Callable[[], float]  # when the monitor started (seconds since the epoch)
    attachment: Attachment
    link: Link
    runner: StepRunner
    recover: RecoverClients
    leases: ExpireLeases
    clients: WatchClients
    horizon: HorizonReport
    figures: DatabaseFigures
    server: ReadServer
    sampler: Sampler


class Documents:
    """Builds the HTTP documents from :class:`Sources`."""

    def __init__(self, src: Sources) -> None:
        self._src = src
        cfg = src.settings()
        # /api/history: the memory, and before it the T4 files (a restarted monitor still
        # serves the day).
        t4 = T4Reader(cfg.data_dir) if cfg.data_dir is not None else None
        self._history = HistoryReader(src.sampler.history, t4,
                                      reach=max(DAY, cfg.history_seconds))
        self._collector = SectionCollector(src.attachment.read, self.status, self._sampled,
                                           self.clients_doc, self.client_errors_by_kind)

    @property
    def config(self) -> MonitorConfig:
        """The monitor's configuration now (read per request: ``cors_origin``)."""
        return self._src.settings()

    def current_token(self) -> str | None:
        return self._src.settings().token

    def status(self) -> dict[str, Any]:
        """The monitor's own figures (the ``monitor`` object of ``/api/queues``)."""
        src = self._src
        cfg = src.settings()
        read = src.attachment.read
        clients = read(lambda s: len(s.active_clients()))
        section = read(lambda s: s.name)
        horizon = src.horizon
        oldest = horizon.watch.oldest
        return {
            "pid": os.getpid(),
            "version": __version__,
            "running": src.running(),
            "interval": cfg.interval,
            "recovery_interval": cfg.recovery_interval,
            "started": round(src.started(), 3),
            "beat": round(src.attachment.beat_t, 3),
            "section": section,
            "clients": clients or 0,
            "recovered_clients": src.recover.recovered,
            M.EXPIRED_LEASES: src.leases.expired,
            "client_errors": sum(src.clients.by_kind.values()),
            "client_errors_at_start": src.clients.errors.seen_at_start,
            M.XMIN_AGE_S: round(horizon.xmin_age, 3),
            M.SNAPSHOT_HELD: horizon.watch.held,
            M.XMIN_HOLDER: oldest.as_dict() if oldest is not None else None,
            M.VACUUMS: horizon.vacuums,
            "database": src.link.connected,
            "steps": src.runner.as_dict(),
        }

    def queues_doc(self) -> dict[str, Any]:
        sampler = self._src.sampler
        latest = sampler.latest
        return {
            "t": round(sampler.latest_t, 3),
            "monitor": self.status(),
            "server": self.server_doc(),
            "queues": [dict(latest[name]) for name in sorted(latest)],
        }

    def server_doc(self) -> dict[str, Any] | None:
        """``server`` in ``/api/queues``: the last sample's reading of the server
        the monitor's connection is on (None before it, and while disconnected),
        beside the history the section describes now (shared memory, no query)."""
        server = self._src.server.server
        if server is None:
            return None
        return server.as_dict(self._src.attachment.read(lambda sec: sec.history()))

    def clients_doc(self) -> dict[str, Any]:
        """``/api/clients``: every client entry, counters read now, rates of the last interval."""
        rates = self._src.sampler.client_rates.rates
        known = self._src.figures.queue_names

        def read(sec: Section) -> list[dict[str, Any]]:
            return [C.client_doc(c, rates.get(c.key), known, sec) for c in C.read_clients(sec)]

        clients = self._src.attachment.read(read) or []
        clients.sort(key=lambda c: (c[C.ROLE] != "worker", c[C.PID], c[C.STARTED]))
        return {"t": round(time.time(), 3), "interval": self._src.settings().interval,
                "clients": clients}

    def client_errors_by_kind(self) -> dict[str, int]:
        """Client errors the monitor logged since it started, by kind."""
        return dict(self._src.clients.by_kind)

    def history_points(
        self,
        queue: str,
        since: float,
        until: float,
        limit: int,
        step: float = 0.0,
        max_points: int | None = None,
    ) -> Answer | None:
        return self._history.query(queue, since, until, limit, step=step, max_points=max_points)

    def metrics_text(self) -> tuple[bytes, str]:
        return render(self._collector), CONTENT_TYPE

    def _sampled(self) -> dict[str, dict[str, float | str]]:
        return self._src.sampler.latest
