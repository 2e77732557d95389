"""The monitor service: a loop that schedules the monitor's steps.

One loop thread runs *steps*, each an object with one method, ``run()``, in a
module of its own (``_step`` says what a step is). Every ``recovery_interval``
(100 ms): heartbeat, section check (following a fail-over), dead-client
recovery, lease expiry, lock-holder repair, reclaim, the watch that raises
queue events, and the clients' errors. Every ``interval`` (1 s): database
figures (queue list, exception table, the xmin horizon, poison entries), the
server the connection is on, lost backends, prepared transactions, key
pruning, SQL inbox, performance sample (T4 file, history). Entries enqueued
through SQL are also pumped as soon as their NOTIFY arrives (``_pump``). A
step that fails is logged (rate-limited), counted and retried on the next
pass; it never stops the loop.

The HTTP documents are built by ``_api.Documents``, the
:class:`~._http.ApiSource` the HTTP service reads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self, TypeVar

from ringq import __version__
from ringq.engine import Section, redact_dsn

from ._api import Documents, Sources
from ._client_watch import WatchClients
from ._config import MonitorConfig
from ._errors import MonitorError
from ._failover import FollowFailover
from ._figures import DatabaseFigures
from ._horizon import HorizonReport
from ._http import HttpService
from ._journal import LOG_NAME, Journal
from ._keys import PruneKeys
from ._leases import ExpireLeases
from ._link import Link
from ._poison import PoisonWatch
from ._primary import ReadServer
from ._pump import Inbox, Pump
from ._reclaim import Reclaim
from ._recover import RecoverBackends, RecoverClients, RepairLocks, ResolvePrepared
from ._sample import History
from ._sampler import Sampler
from ._section import Attachment, Heartbeat
from ._sql_consumers import SqlConsumers
from ._statefile import remove_state_file, write_state_file
from ._step import Step, StepRunner
from ._t4 import T4Writer
from ._tidy import SectionTidy
from ._watch import WatchQueues

T = TypeVar("T")


class Monitor:
    """The ringq monitor of one database. ``start()``/``stop()`` are idempotent;
    it is also a context manager.

    :raises DatabaseUnavailable: (start) the database cannot be reached.
    :raises SchemaMissing: (start) the database holds no ringq schema.
    :raises MonitorRunning: (start) another monitor serves this database.
    :raises MonitorError: (start) the HTTP port or the data directory is unusable.
    """

    def __init__(self, config: MonitorConfig) -> None:
        self.config = config
        self._pending: MonitorConfig | None = None
        self._journal: Journal | None = None
        self._http: HttpService | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._running = False
        self._started_t = 0.0

        def settings() -> MonitorConfig:
            return self.config

        note = self.note
        self._link = link = Link(settings, note, self._dsn_changed)
        self._attachment = att = Attachment(settings, link, note)
        self._runner = StepRunner(note, link.drop)
        self._inbox = inbox = Inbox()
        link.on_connect.append(inbox.mark_due)  # NOTIFYs sent while we were away are lost
        self._server = server = ReadServer(link.connect)
        link.on_drop.append(server.forget)
        self._horizon = horizon = HorizonReport(link, settings, note)
        figures = DatabaseFigures(link, att, horizon, PoisonWatch(link, settings, note))
        watch = WatchQueues(att, link, settings)
        self._clients = clients = WatchClients(att, note, lambda: figures.queue_names)
        self._sampler = sampler = Sampler(att, link, watch, figures, config.history_points)
        att.on_replaced.append(sampler.forget)  # counters restart with a new segment
        self.history: History = sampler.history
        recover = RecoverClients(att, link, settings, note)
        leases = ExpireLeases(att, link, settings, note)
        # Every recovery_interval, in this order:
        self._fast: list[tuple[str, Step]] = [
            ("heartbeat", Heartbeat(att)),
            ("section", FollowFailover(att, link, settings)),
            ("recover", recover),
            ("leases", leases),
            ("repair", RepairLocks(att, settings, note)),
            ("reclaim", Reclaim(att, inbox)),
            ("watch", watch),
            ("clients", clients),
        ]
        # Every interval, after those:
        self._pump_all = Pump(inbox, settings, note, retry_full=True)
        self._slow: list[tuple[str, Step]] = [
            ("database", figures),
            ("server", server),
            ("backends", RecoverBackends(att, link, note)),
            ("prepared", ResolvePrepared(att, settings, note)),
            ("keys", PruneKeys(settings, note)),
            # sections of this server's dropped databases (at most once a minute)
            ("tidy", SectionTidy(lambda: self.config.dsn, note)),
            ("inbox", self._pump_all),
            ("sample", sampler),
        ]
        # Between samples, when a NOTIFY (or a reclaim) says the inbox has entries:
        self._pump = Pump(inbox, settings, note, retry_full=False)
        # The SQL consumers' agent (ringq.dequeue): a thread of its own, see _sql_consumers.
        self._sql = SqlConsumers(settings, att, note)
        self._docs = Documents(Sources(
            settings=settings, running=lambda: self.running, started=lambda: self._started_t,
            attachment=att, link=link, runner=self._runner, recover=recover, leases=leases,
            clients=clients, horizon=horizon, figures=figures, server=server, sampler=sampler,
        ))

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Attach the section (rebuilding it from the tables), serve HTTP, start the loop."""
        if self._running:
            return
        cfg = self.config
        self._stop.clear()
        try:
            if cfg.data_dir is not None:
                try:
                    cfg.data_dir.mkdir(parents=True, exist_ok=True)
                    self._journal = Journal(cfg.data_dir / LOG_NAME)
                    self._sampler.t4 = T4Writer(cfg.data_dir, cfg.t4_keep_days)
                except OSError as exc:
                    raise MonitorError(
                        f"data directory {cfg.data_dir} is not usable: {exc}"
                    ) from exc
            else:
                self._journal = Journal(None)
            self._link.connect(first=True)
            self._attachment.attach(reason=None)
            # Take the clients' error counters as they are now, before the loop
            # runs: errors from before this start are not news (a predecessor
            # logged them), errors from after it are.
            self._clients.restart()
            if cfg.http:
                self._http = HttpService(self._docs, cfg.host, cfg.port)
                try:
                    self._http.start()
                except OSError as exc:
                    self._http = None
                    raise MonitorError(
                        f"cannot serve HTTP on {cfg.host}:{cfg.port}: {exc}"
                    ) from exc
        except BaseException:
            self._teardown()
            raise
        self._started_t = time.time()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="ringq-monitor", daemon=True)
        self._thread.start()
        self._sql.start()
        self._write_state_file()
        sec = self._attachment.section
        self.note(
            "monitor.started",
            url=self.url,
            dsn=redact_dsn(cfg.dsn),
            interval=cfg.interval,
            section=sec.name if sec else None,
            version=__version__,
        )

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish the current step, stop the loop and the HTTP service, release everything."""
        if not self._running:
            return
        self._stop.set()
        self._sql.stop(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._running = False
        self._horizon.join(timeout)  # a vacuum's record goes to the journal before it closes
        if self._journal is not None:
            self._journal.write("monitor.stopped", uptime_s=round(time.time() - self._started_t, 3))
        self._teardown()

    def _teardown(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None
        self._pump.close()  # their linked sessions, before the section goes
        self._pump_all.close()
        self._attachment.release()
        self._link.close()  # releases the monitor lock
        if self._sampler.t4 is not None:
            self._sampler.t4.close()
            self._sampler.t4 = None
        remove_state_file(self.config.data_dir)
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """True while the loop runs (False once it ended, even if by itself)."""
        return self._running and self._thread is not None and self._thread.is_alive()

    @property
    def url(self) -> str | None:
        """The HTTP base URL (``http://127.0.0.1:7480``), None if HTTP is off or not started."""
        if self._http is None:
            return None
        host, port = self._http.address
        return f"http://{host}:{port}"

    def note(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        """Write a record to ``monitor.log`` (and the ``ringq.monitor`` logger)."""
        if self._journal is not None:
            self._journal.write(event, level, **fields)

    def reopen_log(self) -> None:
        """Reopen ``monitor.log`` (after logrotate moved it)."""
        if self._journal is not None:
            self._journal.reopen()

    def reconfigure(self, **changes: Any) -> MonitorConfig:
        """Apply new ``interval``, ``recovery_interval``, ``token``, ``prepared_timeout``
        or ``high_water`` from the next pass on (others need a restart).

        :raises ConfigError: a value is invalid or cannot change while running.
        """
        from ringq.engine import ConfigError

        fixed = {
            "dsn", "dsn_file", "port", "host", "data_dir", "history_seconds", "t4_keep_days", "http"
        }
        bad = fixed & {k for k, v in changes.items() if getattr(self.config, k) != v}
        if bad:
            raise ConfigError(
                f"{', '.join(sorted(bad))} cannot change while the monitor runs: restart it"
            )
        new = self.config.replace(**changes)
        if self._running:
            self._pending = new
        else:
            self.config = new
        return new

    # -- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        next_sample = next_fast = time.monotonic()
        try:
            while not self._stop.is_set():
                tick = time.monotonic()
                if self._pending is not None:
                    old, self.config, self._pending = self.config, self._pending, None
                    self.note("monitor.reconfigured", interval=self.config.interval,
                              token_changed=old.token != self.config.token)
                slow: list[tuple[str, Step]] = []
                if tick >= next_sample:
                    slow = self._slow
                    next_sample += self.config.interval
                    if next_sample <= tick:  # fell behind (a long step): do not catch up in a burst
                        next_sample = tick + self.config.interval
                elif self._inbox.due and tick >= self._inbox.retry_at:
                    slow = [("inbox", self._pump)]
                # Woken early by an inbox NOTIFY: the pump alone, at once (an SQL
                # enqueue's consumer waits for it); the fast steps keep their pace.
                fast = self._fast if tick >= next_fast or slow is self._slow else []
                if fast:
                    next_fast = tick + self.config.recovery_interval
                # The NOTIFY-driven pump goes before fast steps that fell due
                # with it: an SQL enqueue's consumer waits for it.
                steps = fast + slow if slow is self._slow else slow + fast
                for name, step in steps:
                    if self._stop.is_set():
                        break  # drain: the step under way was finished
                    self._runner.run(name, step)
                delay = min(next_fast, next_sample) - time.monotonic()
                if self._link.wait(delay, self._stop):
                    self._inbox.due = True
        except BaseException as exc:
            # Steps catch Exception; only something graver gets here. stop() still
            # tears everything down (``running`` is False from now on).
            self.note(
                "monitor.loop_died", logging.CRITICAL, error=f"{type(exc).__name__}: {exc}"
            )
            raise

    def _dsn_changed(self, old: str, new: str, path: Path) -> None:
        """The DSN file names another DSN (``_link``): every step uses it from now on."""
        self.config = self.config.replace(dsn=new)
        pending = self._pending
        if pending is not None:
            self._pending = pending.replace(dsn=new)
        self.note("database.dsn_changed", logging.WARNING, old=redact_dsn(old),
                  new=redact_dsn(new), file=str(path))
        if self._running:
            self._write_state_file()

    def _write_state_file(self) -> None:
        write_state_file(self.config.data_dir, self.url, self._started_t, self.config.dsn)

    # -- what the HTTP service and the tests read ----------------------------------------

    def read_section(self, fn: Callable[[Section], T]) -> T | None:
        """Run ``fn`` on the attached section, under the lock that guards its replacement."""
        return self._attachment.read(fn)

    @property
    def documents(self) -> Documents:
        """The HTTP documents (the :class:`~._http.ApiSource` the HTTP service reads)."""
        return self._docs

    def status(self) -> dict[str, Any]:
        """The monitor's own figures (the ``monitor`` object of ``/api/queues``)."""
        return self._docs.status()
