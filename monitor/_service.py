"""The monitor service: recovery, reclaim, inbox, samples, events, HTTP.

One loop thread runs *steps*. Every ``recovery_interval`` (100 ms): heartbeat,
section check, dead-client recovery, lock-holder repair, reclaim, and the
watch that raises queue events. Every ``interval`` (1 s): queue list,
exception table, the server the connection is on (primary or not, and its
database history), prepared transactions, SQL inbox, performance sample (T4
file, history). Entries enqueued through SQL are also pumped as soon as their
NOTIFY arrives; the pump never waits for space: a full queue keeps its SQL
entries in the inbox and is tried again on the next sample, or as soon as a
reclaim finds room in it. A step that fails is logged (rate-limited), counted and
retried on the next pass; it never stops the loop.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import psycopg
from psycopg import sql
from ringq import __version__
from ringq.engine import (
    DatabaseUnavailable,
    RingqError,
    SchemaMissing,
    Section,
    from_psycopg,
    read_dsn_file,
    redact_dsn,
)
from ringq.engine import layout as L
from ringq.engine import metrics as M
from ringq.engine.recovery import (
    end_holders,
    history_of,
    overdue_holders,
    queue_room,
    rebuild,
    reclaim_all,
    recover_dead_clients,
    recover_lost_backends,
    repair_lock_holders,
    resolve_prepared,
    section_following,
    shared_section,
)
from ringq.engine.sqlfile import compose

from . import _clients as C
from . import _events as E
from . import _queries as Qy
from . import _sample as S
from ._config import MonitorConfig
from ._db import connect_step
from ._groups import group_figures, grouped
from ._history import DAY, Answer, HistoryReader
from ._horizon import HorizonNews, HorizonWatch, read_holders, vacuum_rings
from ._http import HttpService
from ._inbox import pump_inbox
from ._journal import LOG_NAME, Journal
from ._keys import prune_keys
from ._primary import ServerState, read_server
from ._prom import CONTENT_TYPE, SectionCollector, render
from ._t4 import T4Reader, T4Writer

logger = logging.getLogger("ringq.monitor")

STATE_FILE = "monitor.json"  # data_dir: pid and URL of the running monitor (read by `ringq status`)
_REPEAT_LOG_S = 60.0  # a step failing the same way is logged again at most this often
_EXC_WINDOW_MIN_S = 60.0  # how far back new exception-table rows are looked for

T = TypeVar("T")


class MonitorError(RingqError):
    """The monitor could not start (port taken, files not writable …)."""


class MonitorRunning(MonitorError):
    """Another monitor already serves this database (it holds the monitor lock)."""


@dataclass
class StepStats:
    runs: int = 0
    failures: int = 0
    consecutive: int = 0
    last_error: str | None = None
    last_failure_t: float | None = None
    last_logged: float = 0.0
    seconds: float = 0.0  # time spent in the step, in all

    def as_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "failures": self.failures,
            "last_error": self.last_error,
            "last_failure_t": self.last_failure_t,
            "seconds": round(self.seconds, 6),
        }


@dataclass
class _Watch:
    """Event state of one queue, so each condition is announced once per occurrence."""

    full: bool = False
    empty: bool = False
    high: bool = False
    empty_s: float = 0.0  # seconds nothing was ready since the last sample
    full_s: float = 0.0  # seconds without a free slot since the last sample
    seen_ns: int = 0


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
        self._sec: Section | None = None
        self._sec_lock = threading.RLock()
        self._rebuilt: list[Section] = []  # attachments made by rebuild(), closed at stop
        self._conn: psycopg.Connection[Any] | None = None
        self._conn_retry_at = 0.0
        self._conn_error = "database unavailable"
        self._server: ServerState | None = None  # read every sample; None while disconnected
        self._journal: Journal | None = None
        self._t4: T4Writer | None = None
        self._http: HttpService | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._running = False
        self._started_t = 0.0
        self._beat_t = 0.0
        self._steps: dict[str, StepStats] = {}
        self.history = S.History(config.history_points)
        # /api/history: the memory, and before it the T4 files (a restarted monitor still
        # serves the day).
        t4 = T4Reader(config.data_dir) if config.data_dir is not None else None
        self._history = HistoryReader(self.history, t4, reach=max(DAY, config.history_seconds))
        self._latest: dict[str, dict[str, float | str]] = {}
        self._latest_t = 0.0
        self._snaps: dict[int, S._Snap] = {}
        self._watch: dict[int, _Watch] = {}
        self._inbox_due = True
        self._history_due = True  # the section's history is checked after every connect
        # monotonic: after a failed pump, NOTIFYs wait for this (or the sample)
        self._inbox_retry_at = 0.0
        # Full queues with SQL entries waiting: {name: queue id}, left out of the
        # NOTIFY-driven pumps until the next sample or until a reclaim finds room.
        self._inbox_full: dict[str, int] = {}
        # name -> when "inbox.queue_full" was written
        self._inbox_full_logged: dict[str, float] = {}
        self._exc_counts: dict[int, int] = {}
        self._dead_rows: dict[str, int] = {}
        self._seen_exc: dict[tuple[int, int], float] | None = None
        self._error_watch = C.ErrorWatch()
        self._client_rates = C.Rates()
        self._client_errors_by_kind: dict[str, int] = {}  # errors of clients logged, by kind
        self._queue_names: dict[int, str] = {}  # id -> name, from the last queue list
        self._xmin_age = 0.0
        self._horizon = HorizonWatch()
        self._vacuum_thread: threading.Thread | None = None
        self._vacuums = 0  # ring tables vacuumed after a held snapshot was released
        self._recovered_clients = 0
        self._expired_leases = 0
        # (client, hold start) past the lease, not ended
        self._lease_left: set[tuple[int, int]] = set()
        self._instance = ""
        self._collector = SectionCollector(self.read_section, self.status, self._sampled,
                                           self.clients_doc, self.client_errors_by_kind)

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
                    self._t4 = T4Writer(cfg.data_dir, cfg.t4_keep_days)
                except OSError as exc:
                    raise MonitorError(
                        f"data directory {cfg.data_dir} is not usable: {exc}"
                    ) from exc
            else:
                self._journal = Journal(None)
            self._connect(first=True)
            self._attach(reason=None)
            # Take the clients' error counters as they are now, before the loop
            # runs: errors from before this start are not news (a predecessor
            # logged them), errors from after it are.
            self._error_watch = C.ErrorWatch()
            self.read_section(lambda sec: self._error_watch.scan(C.read_clients(sec)))
            if cfg.http:
                self._http = HttpService(self, cfg.host, cfg.port)
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
        self._write_state_file()
        self._journal_write(
            "monitor.started",
            url=self.url,
            dsn=redact_dsn(cfg.dsn),
            interval=cfg.interval,
            section=self._sec.name if self._sec else None,
            version=__version__,
        )

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finish the current step, stop the loop and the HTTP service, release everything."""
        if not self._running:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._running = False
        vacuum = self._vacuum_thread
        if vacuum is not None:
            vacuum.join(timeout)  # its record goes to the journal before it closes
        if self._journal is not None:
            self._journal.write("monitor.stopped", uptime_s=round(time.time() - self._started_t, 3))
        self._teardown()

    def _teardown(self) -> None:
        if self._http is not None:
            self._http.stop()
            self._http = None
        with self._sec_lock:
            sec, self._sec = self._sec, None
            if sec is not None and not sec.closed and sec.header[L.H_MONITOR_PID] == os.getpid():
                sec.header[L.H_MONITOR_PID] = 0  # no monitor now (the process's attachment stays)
        rebuilt, self._rebuilt = self._rebuilt, []
        for extra in rebuilt:
            extra.close()
        if self._conn is not None:
            self._conn.close()  # releases the monitor lock
            self._conn = None
        if self._t4 is not None:
            self._t4.close()
            self._t4 = None
        self._remove_state_file()
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
        self._journal_write(event, level, **fields)

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
        next_sample = time.monotonic()
        try:
            while not self._stop.is_set():
                tick = time.monotonic()
                if self._pending is not None:
                    old, self.config, self._pending = self.config, self._pending, None
                    self._journal_write("monitor.reconfigured", interval=self.config.interval,
                                        token_changed=old.token != self.config.token)
                fast: list[tuple[str, Callable[[], object]]] = [
                    ("heartbeat", self._heartbeat),
                    ("section", self._check_section),
                    ("recover", self._recover),
                    ("leases", self._expire_leases),
                    ("repair", self._repair),
                    ("reclaim", self._reclaim),
                    ("watch", self._watch_queues),
                    ("clients", self._watch_clients),
                ]
                slow: list[tuple[str, Callable[[], object]]] = []
                if tick >= next_sample:
                    slow = [
                        ("database", self._database_figures),
                        ("server", self._read_server),
                        ("backends", self._recover_lost_backends),
                        ("prepared", self._resolve_prepared),
                        ("keys", self._prune_keys),
                        ("inbox", self._pump_inbox_all),
                        ("sample", self._sample),
                    ]
                    next_sample += self.config.interval
                    if next_sample <= tick:  # fell behind (a long step): do not catch up in a burst
                        next_sample = tick + self.config.interval
                elif self._inbox_due and tick >= self._inbox_retry_at:
                    slow = [("inbox", self._pump_inbox)]
                for name, fn in fast + slow:
                    if self._stop.is_set():
                        break  # drain: the step under way was finished
                    self._step(name, fn)
                delay = min(tick + self.config.recovery_interval, next_sample) - time.monotonic()
                self._wait(delay)
        except BaseException as exc:
            # Steps catch Exception; only something graver gets here. stop() still
            # tears everything down (``running`` is False from now on).
            self._journal_write(
                "monitor.loop_died", logging.CRITICAL, error=f"{type(exc).__name__}: {exc}"
            )
            raise

    def _step(self, name: str, fn: Callable[[], object]) -> None:
        st = self._steps.setdefault(name, StepStats())
        st.runs += 1
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:
            st.failures += 1
            st.consecutive += 1
            text = f"{type(exc).__name__}: {exc}".strip()
            now = time.time()
            if (
                st.consecutive == 1
                or text != st.last_error
                or now - st.last_logged >= _REPEAT_LOG_S
            ):
                st.last_logged = now
                self._journal_write(
                    "step.failed", logging.WARNING, step=name, error=text,
                    consecutive=st.consecutive, failures=st.failures,
                )
                logger.debug("ringq monitor: step %s failed", name, exc_info=True)
            st.last_error = text
            st.last_failure_t = now
            if isinstance(exc, psycopg.Error | DatabaseUnavailable):
                self._drop_connection()
        else:
            if st.consecutive:
                self._journal_write("step.recovered", step=name, after_failures=st.consecutive)
            st.consecutive = 0
        finally:
            st.seconds += time.perf_counter() - t0

    def _wait(self, delay: float) -> None:
        """Sleep up to ``delay`` seconds, waking early for a SQL inbox NOTIFY or a stop."""
        if delay <= 0:
            return
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            self._stop.wait(delay)
            return
        try:
            for n in conn.notifies(timeout=delay, stop_after=1):
                if n.channel == Qy.INBOX_CHANNEL:
                    self._inbox_due = True
        except psycopg.Error:
            self._drop_connection()
            self._stop.wait(min(delay, 0.05))

    def _journal_write(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        if self._journal is not None:
            self._journal.write(event, level, **fields)

    # -- database connection ------------------------------------------------------------------

    def _connect(self, *, first: bool = False) -> psycopg.Connection[Any]:
        """The monitor's own connection: holds the monitor lock, LISTENs for the SQL inbox,
        publishes events and reads figures. Re-made after a loss (at most once per interval)."""
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        if not first and time.monotonic() < self._conn_retry_at:
            # The same text as the last attempt's, so the failed step is not logged anew.
            raise DatabaseUnavailable(self._conn_error)
        self._conn_retry_at = time.monotonic() + self.config.interval
        while True:
            dsn = self.config.dsn
            try:
                conn = psycopg.connect(
                    dsn, autocommit=True, connect_timeout=5, application_name="ringq-monitor"
                )
                break
            except psycopg.Error as exc:
                if self._follow_dsn():
                    continue  # the embedded cluster came back under another DSN: try that one
                err = from_psycopg(exc, dsn=dsn)
                self._conn_error = str(err)
                raise err from exc
        try:
            row = conn.execute(Qy.INSTANCE_ID).fetchone()
            if not row or not row[0]:
                raise SchemaMissing("ringq.meta holds no instance_id")
            locked = conn.execute(Qy.TRY_MONITOR_LOCK).fetchone()
            if not locked or not locked[0]:
                holder = conn.execute(Qy.MONITOR_LOCK_HOLDER).fetchone()
                who = (
                    f" (backend pid {holder[0]}, {holder[1] or 'no application name'})"
                    if holder
                    else ""
                )
                raise MonitorRunning(f"another ringq monitor serves this database{who}")
            conn.execute(compose(Qy.LISTEN_INBOX, channel=sql.Identifier(Qy.INBOX_CHANNEL)))
        except psycopg.errors.UndefinedTable as exc:
            conn.close()
            raise SchemaMissing(
                f"no ringq schema in {redact_dsn(dsn)!r}: create a queue first (ringq queue create)"
            ) from exc
        except psycopg.Error as exc:
            conn.close()
            raise from_psycopg(exc, dsn=dsn) from exc
        except BaseException:
            conn.close()
            raise
        self._instance = str(row[0])
        self._conn = conn
        self._inbox_due = True  # NOTIFYs sent while we were away are lost: look once
        self._history_due = True  # a reconnect may have found a promoted standby
        if not first:
            self._journal_write("database.reconnected")
        return conn

    def _follow_dsn(self) -> bool:
        """Read the DSN file again (``config.dsn_file``, the embedded cluster's);
        True if it names another DSN, which every step uses from now on."""
        path = self.config.dsn_file
        new = None if path is None else read_dsn_file(path)
        old = self.config.dsn
        if new is None or new == old:
            return False
        self.config = self.config.replace(dsn=new)
        pending = self._pending
        if pending is not None:
            self._pending = pending.replace(dsn=new)
        self._journal_write("database.dsn_changed", logging.WARNING, old=redact_dsn(old),
                            new=redact_dsn(new), file=str(path))
        if self._running:
            self._write_state_file()
        return True

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._server = None  # the next connection may be on another server
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001, S110 - already broken; nothing to tell
                pass

    # -- fast steps -----------------------------------------------------------------------------

    def _section(self) -> Section:
        sec = self._sec
        if sec is None or sec.closed:
            raise RingqError("no global section attached")
        return sec

    def _heartbeat(self) -> None:
        sec = self._sec
        if sec is None or sec.closed:
            return
        now = time.time_ns()
        sec.header[L.H_MONITOR_PID] = os.getpid()
        sec.header[L.H_MONITOR_BEAT_NS] = now
        self._beat_t = now / 1e9

    def _check_section(self) -> None:
        """Rebuild the section if it was removed (reboot, operator, reset), or
        if the database it describes has another history since the monitor
        (re)connected: a fail-over to a standby, a restore on a new timeline."""
        sec = self._sec
        if sec is not None and not sec.closed and not sec.unlinked():
            if not self._history_due:
                return
            history = history_of(self._connect())
            self._history_due = False
            if section_following(self._instance, history, redact_dsn(self.config.dsn)) is sec:
                return
            reason = "database history changed (fail-over or restore)"
        else:
            reason = "section missing"
        self._attach(reason=reason)

    def _attach(self, *, reason: str | None) -> None:
        """Rebuild (load every queue not loaded, create the section if absent) and
        work on this process's shared attachment of it.

        The monitor uses the same :class:`Section` object as the sessions of its
        process (the engine's per-process attachment), because a second
        attachment in one process would not exclude them: fcntl locks belong to
        the process and the thread locks to the object. For the same reason
        the attachments :func:`rebuild` returns are closed only at ``stop()``
        (closing any descriptor of the segment drops every fcntl lock this
        process holds on it).
        """
        fresh = rebuild(self.config.dsn)
        self._rebuilt.append(fresh)
        shared = shared_section(self._instance)
        with self._sec_lock:
            old, self._sec = self._sec, shared
        if old is not shared:
            self._snaps.clear()  # counters restart with a new segment
        self._heartbeat()
        if reason is not None:
            self._journal_write("section.rebuilt", reason=reason, section=shared.name,
                                queues=[shared.queue_name(i) for i in shared.loaded_queues()])

    def _recover(self) -> None:
        sec = self._section()
        for rec in recover_dead_clients(sec, self.config.dsn):
            info = rec.as_dict()
            self._recovered_clients += 1
            self._journal_write("client.recovered", logging.WARNING, **info)
            self._publish(
                E.make_event(
                    E.CONSUMER_DIED, info["queues"][0] if len(info["queues"]) == 1 else None, **info
                )
            )

    def _expire_leases(self) -> None:
        """End the sessions that hold a dequeued entry past its queue's lease."""
        sec = self._section()
        found = overdue_holders(sec)
        # A holding left alone once (a prepared transaction, a backend that would
        # not end) is not tried again every pass: recovery decides it later.
        still = {(h.cidx, h.since_ns) for h in found}
        self._lease_left = {k for k in self._lease_left if k in still}
        holders = [h for h in found if (h.cidx, h.since_ns) not in self._lease_left]
        if not holders:
            return
        ended = end_holders(sec, self.config.dsn, holders)
        done = {(h.cidx, h.since_ns) for h, _rec in ended}
        for h in holders:
            if (h.cidx, h.since_ns) not in done and sec.c(h.cidx, L.C_HOLD_SINCE_NS) == h.since_ns:
                self._lease_left.add((h.cidx, h.since_ns))
                self._journal_write(
                    "entry.lease_not_ended", logging.WARNING, **h.as_dict(),
                    reason="past the lease, but in a prepared transaction, or its backend "
                    "could not be ended (the monitor's role may not signal it)",
                )
        for holder, rec in ended:
            self._expired_leases += 1
            info = {**holder.as_dict(), "slots": rec.slots, "rolled_back": rec.rolled_back,
                    "committed": rec.committed}
            self._journal_write(
                "entry.lease_expired", logging.WARNING,
                reason="held a dequeued entry past the queue's lease: backend terminated", **info,
            )
            queue = holder.queues[0] if holder.queues else None
            self._publish(E.make_event(E.ENTRY_LEASE_EXPIRED, queue, **info))

    def _recover_lost_backends(self) -> None:
        """Decide the slots of live clients whose backend ended under them (a
        database restart, a backend terminated by someone else)."""
        for rec in recover_lost_backends(self._section(), self._connect()):
            self._journal_write(
                "client.backend_lost", logging.WARNING,
                reason="its backend ended while it held slots: decided from the rows",
                **rec.as_dict(),
            )

    def _repair(self) -> None:
        for name in repair_lock_holders(self._section(), self.config.dsn):
            self._journal_write("queue.repaired", logging.WARNING, queue=name,
                                reason="lock holder died inside the critical section")

    def _reclaim(self) -> None:
        sec = self._section()
        reclaim_all(sec)
        for name, qid in list(self._inbox_full.items()):
            room = queue_room(sec, qid)
            if room is None or room > 0:  # consumed (or dropped): its inbox entries can move now
                del self._inbox_full[name]
                self._inbox_due = True

    def _watch_queues(self) -> None:
        """Raise full / empty / high-water events on the edge, and time emptiness."""
        sec = self._section()
        now = time.monotonic_ns()
        hw = self.config.high_water
        for qidx in sec.loaded_queues():
            qid = sec.q(qidx, L.Q_QID)
            cap = sec.q(qidx, L.Q_CAPACITY)
            depth = sec.q(qidx, L.Q_DEPTH_HINT)
            window = sec.q(qidx, L.Q_HEAD) - sec.q(qidx, L.Q_TAIL)
            name = sec.queue_name(qidx)
            full = window >= cap
            empty = depth <= 0
            threshold = hw * cap
            w = self._watch.get(qid)
            first = w is None
            if w is None:
                w = self._watch[qid] = _Watch(empty=empty, seen_ns=now)
            else:
                # Time in a state, at this pass's resolution (a change counts half the pass).
                dt = (now - w.seen_ns) / 1e9
                w.empty_s += dt * ((w.empty + empty) / 2)
                w.full_s += dt * ((w.full + full) / 2)
                w.seen_ns = now
            if full and not w.full:
                self._publish(
                    E.make_event(E.queue_event(name, E.QUEUE_FULL), name, depth=depth, capacity=cap)
                )
            w.full = full
            if empty and not w.empty and not first:
                self._publish(E.make_event(E.queue_event(name, E.QUEUE_EMPTY), name, capacity=cap))
            w.empty = empty
            if depth >= threshold and not w.high:
                self._publish(
                    E.make_event(
                        E.queue_event(name, E.QUEUE_HIGH_WATER),
                        name,
                        depth=depth,
                        capacity=cap,
                        threshold=round(threshold, 3),
                    )
                )
                w.high = True
            elif w.high and depth <= threshold - max(1.0, 0.1 * cap):  # hysteresis: no flapping
                w.high = False

    def _watch_clients(self) -> None:
        """Log each client whose error counter rose since the last pass: one JSON
        record per client per pass (several errors in one pass are coalesced:
        ``count`` says how many, the record describes the last)."""
        sec = self._section()
        for news in self._error_watch.scan(C.read_clients(sec)):
            raw = news.raw
            self._client_errors_by_kind[news.kind] = (
                self._client_errors_by_kind.get(news.kind, 0) + news.count
            )
            self._journal_write(
                "client.error",
                logging.WARNING,
                pid=raw.pid,
                backend_pid=raw.backend_pid,
                role=raw.role,
                queue=C.queue_name_of(sec, news.qid, self._queue_names),
                queue_id=news.qid or None,
                seq=news.seq,
                kind=news.kind,
                count=news.count,
                errors=news.total,
                at=round(news.t, 6),
            )

    def _publish(self, event: E.Event) -> None:
        E.publish(self._connect(), event)

    # -- slow steps -----------------------------------------------------------------------------

    def _database_figures(self) -> None:
        """Queue list (load new queues), exception counts, new poison entries, vacuum enemies."""
        conn = self._connect()
        queues = conn.execute(Qy.QUEUES).fetchall()
        self._queue_names = {int(q[0]): str(q[1]) for q in queues}
        sec = self._section()
        loaded = {sec.q(i, L.Q_QID) for i in sec.loaded_queues()}
        if {q[0] for q in queues} != loaded:
            self._attach(reason="queues created or dropped")
            sec = self._section()
        # A lease changed in ringq.queues (or a block loaded by older code) takes effect here.
        leases = {int(q[0]): float(q[3]) for q in queues}
        for qidx in sec.loaded_queues():
            lease = leases.get(sec.q(qidx, L.Q_QID))
            if lease is not None and sec.q(qidx, L.Q_LEASE_MS) != max(0, round(lease * 1000)):
                sec.set_lease(qidx, lease)
        self._exc_counts = {int(q): int(n) for q, n in conn.execute(Qy.EXCEPTION_COUNTS).fetchall()}
        self._dead_rows = {str(n): int(d) for n, d in conn.execute(Qy.DEAD_ROWS).fetchall()}
        news = self._horizon.update(read_holders(conn), self._dead_rows, self.config.xmin_warn_s)
        oldest = self._horizon.oldest
        self._xmin_age = oldest.age_s if oldest is not None else 0.0
        if news is not None:
            self._tell_horizon(news)
        self._poisoned(conn)

    def _read_server(self) -> None:
        """Which server the connection is on, whether it is the primary, and
        its history (``server`` in ``/api/queues``)."""
        self._server = read_server(self._connect())

    def _tell_horizon(self, news: HorizonNews) -> None:
        """Warn of a held snapshot; after its release, vacuum the rings it bloated."""
        if news.what == "held":
            fields = {
                **news.holder.as_dict(), "threshold_s": self.config.xmin_warn_s,
                "reason": "holds back the xmin horizon: every ring update leaves a dead row,"
                " rings grow",
            }
            self._journal_write("database.snapshot_held", logging.WARNING, **fields)
            self._publish(E.make_event(E.SNAPSHOT_HELD, None, **fields))
            return
        bloated = sorted(q for q, n in news.dead_rows.items() if n >= self.config.vacuum_dead_rows)
        if self._vacuum_thread is not None and self._vacuum_thread.is_alive():
            self._journal_write("database.snapshot_released", held_s=round(news.held_s, 3),
                                pid=news.holder.pid, vacuumed=[], skipped=bloated,
                                reason="a vacuum is still running")
            return
        # VACUUM of a bloated ring may take a while: not in the loop that recovers clients.
        self._vacuum_thread = threading.Thread(
            target=self._vacuum_after_release, args=(news, bloated),
            name="ringq-monitor-vacuum", daemon=True,
        )
        self._vacuum_thread.start()

    def _vacuum_after_release(self, news: HorizonNews, queues: list[str]) -> None:
        try:
            with connect_step(self.config.dsn) as conn:
                done = vacuum_rings(conn, queues)
                self._vacuums += len(done)
                fields: dict[str, Any] = {
                    "held_s": round(news.held_s, 3), "pid": news.holder.pid,
                    "kind": news.holder.kind, "application": news.holder.application,
                    "vacuumed": done,
                }
                self._journal_write("database.snapshot_released", logging.INFO, **fields)
                E.publish(conn, E.make_event(E.SNAPSHOT_RELEASED, None, **fields))
        except Exception as exc:  # noqa: BLE001 - logged; autovacuum remains the fallback
            self._journal_write("step.failed", logging.WARNING, step="vacuum",
                                error=f"{type(exc).__name__}: {exc}", queues=queues)

    def _poisoned(self, conn: psycopg.Connection[Any]) -> None:
        window = max(_EXC_WINDOW_MIN_S, 10 * self.config.interval)
        rows = conn.execute(Qy.RECENT_EXCEPTIONS, (window,)).fetchall()
        first = self._seen_exc is None
        seen = self._seen_exc if self._seen_exc is not None else {}
        horizon = time.time() - 2 * window
        for qid, qname, seq, producer, pseq, deliveries, reason, moved, group in rows:
            key = (int(qid), int(seq))
            if key in seen:
                continue
            seen[key] = float(moved)
            if first:
                continue  # moved before this monitor started: not news
            fields = {"seq": int(seq), "producer": producer, "producer_seq": pseq,
                      "deliveries": deliveries, "reason": reason, "group": group}
            self._journal_write("entry.poisoned", logging.WARNING, queue=qname, **fields)
            self._publish(E.make_event(E.ENTRY_POISONED, qname, **fields))
        self._seen_exc = {k: t for k, t in seen.items() if t >= horizon}

    def _resolve_prepared(self) -> None:
        for gid, verb in resolve_prepared(
            self._section(), self.config.dsn, self.config.prepared_timeout
        ):
            self._journal_write("prepared.resolved", logging.WARNING, gid=gid, outcome=verb)

    def _prune_keys(self) -> None:
        # Index probes per queue (ringq.keys (queue_id, created_at)), not a scan;
        # still, once a minute is plenty for a retention in hours.
        now = time.monotonic()
        if now < getattr(self, "_keys_due", 0.0):
            return
        self._keys_due = now + 60.0
        for queue, n in prune_keys(self.config.dsn, self.config.key_retention).items():
            self._journal_write("keys.pruned", queue=queue or None, keys=n)

    def _pump_inbox_all(self) -> None:
        """The sample's pump: full queues are looked at again too."""
        self._pump_inbox(retry_full=True)

    def _pump_inbox(self, *, retry_full: bool = False) -> None:
        """Move SQL entries into the rings. Never waits: a full queue is reported
        by the pump, skipped until the next sample (or a reclaim that finds room),
        and does not make the next pass try again at once. A pump that fails
        (the database unreachable …) is tried again at the next sample, not on
        every pass."""
        self._inbox_due = False
        full: dict[str, int] = {}
        skip = () if retry_full else tuple(self._inbox_full)
        try:
            moved = pump_inbox(self.config.dsn, skip=skip, full=full)
        except BaseException:
            # Retried by the next sample's pump; until then NOTIFYs only mark it due.
            self._inbox_retry_at = time.monotonic() + self.config.interval
            raise
        self._inbox_retry_at = 0.0
        if retry_full:
            self._inbox_full = full
        else:
            self._inbox_full.update(full)
        if moved:
            logger.debug("ringq monitor: inbox moved %s", moved)
        # Logged on the edge, then again at most every _REPEAT_LOG_S while it
        # lasts: an exception queue nobody drains would otherwise write a line
        # every sample, for hours.
        now = time.monotonic()
        for name in full:
            last = self._inbox_full_logged.get(name)
            if last is None or now - last >= _REPEAT_LOG_S:
                self._inbox_full_logged[name] = now
                self._journal_write("inbox.queue_full", logging.WARNING, queue=name,
                                    reason="queue full: its SQL entries wait in ringq.inbox")
        for name in [n for n in self._inbox_full_logged if n not in self._inbox_full]:
            del self._inbox_full_logged[name]
            self._journal_write("inbox.resumed", queue=name, moved=moved.get(name, 0))

    def _sample(self) -> None:
        sec = self._section()
        t = time.time()
        now = time.monotonic_ns()
        samples = []
        snaps: dict[int, S._Snap] = {}
        for qidx in sec.loaded_queues():
            qid = sec.q(qidx, L.Q_QID)
            name = sec.queue_name(qidx)
            cur = S.snapshot(sec, qidx, now)
            w = self._watch.get(qid)
            empty_s = full_s = 0.0
            if w is not None:
                empty_s, w.empty_s = w.empty_s, 0.0
                full_s, w.full_s = w.full_s, 0.0
            sample = S.compute(
                name,
                self._snaps.get(qid),
                cur,
                t=t,
                empty_s=empty_s,
                full_s=full_s,
                exceptions=self._exc_counts.get(qid, 0),
                dead_rows=self._dead_rows.get(name, 0),
            )
            if grouped(sec, qidx):  # an ungrouped queue: no scan, no query
                sample.update(group_figures(sec, qidx, name, self._connect))
            samples.append(sample)
            snaps[qid] = cur
        self._snaps = snaps
        self._client_rates.sample(C.read_clients(sec), now)
        samples.sort(key=lambda s: str(s[S.NAME]))
        for s in samples:
            self.history.add(s)
        self._latest = {str(s[S.NAME]): s for s in samples}
        self._latest_t = t
        if self._t4 is not None:
            self._t4.write(samples)

    # -- what the HTTP service reads ------------------------------------------------------------

    def read_section(self, fn: Callable[[Section], T]) -> T | None:
        """Run ``fn`` on the attached section, under the lock that guards its replacement."""
        with self._sec_lock:
            sec = self._sec
            if sec is None or sec.closed:
                return None
            return fn(sec)

    def current_token(self) -> str | None:
        return self.config.token

    def status(self) -> dict[str, Any]:
        """The monitor's own figures (the ``monitor`` object of ``/api/queues``)."""
        clients = self.read_section(lambda s: len(s.active_clients()))
        section = self.read_section(lambda s: s.name)
        return {
            "pid": os.getpid(),
            "version": __version__,
            "running": self.running,
            "interval": self.config.interval,
            "recovery_interval": self.config.recovery_interval,
            "started": round(self._started_t, 3),
            "beat": round(self._beat_t, 3),
            "section": section,
            "clients": clients or 0,
            "recovered_clients": self._recovered_clients,
            M.EXPIRED_LEASES: self._expired_leases,
            "client_errors": sum(self._client_errors_by_kind.values()),
            "client_errors_at_start": self._error_watch.seen_at_start,
            M.XMIN_AGE_S: round(self._xmin_age, 3),
            M.SNAPSHOT_HELD: self._horizon.held,
            M.XMIN_HOLDER: (
                self._horizon.oldest.as_dict() if self._horizon.oldest is not None else None
            ),
            M.VACUUMS: self._vacuums,
            "database": self._conn is not None and not self._conn.closed and not self._conn.broken,
            "steps": {k: v.as_dict() for k, v in sorted(self._steps.items())},
        }

    def queues_doc(self) -> dict[str, Any]:
        latest = self._latest
        return {
            "t": round(self._latest_t, 3),
            "monitor": self.status(),
            "server": self.server_doc(),
            "queues": [dict(latest[name]) for name in sorted(latest)],
        }

    def server_doc(self) -> dict[str, Any] | None:
        """``server`` in ``/api/queues``: the last sample's reading of the server
        the monitor's connection is on (None before it, and while disconnected),
        beside the history the section describes now (shared memory, no query)."""
        server = self._server
        if server is None:
            return None
        return server.as_dict(self.read_section(lambda sec: sec.history()))

    def clients_doc(self) -> dict[str, Any]:
        """``/api/clients``: every client entry, counters read now, rates of the last interval."""
        rates = self._client_rates.rates
        known = self._queue_names

        def read(sec: Section) -> list[dict[str, Any]]:
            return [C.client_doc(c, rates.get(c.key), known, sec) for c in C.read_clients(sec)]

        clients = self.read_section(read) or []
        clients.sort(key=lambda c: (c[C.ROLE] != "worker", c[C.PID], c[C.STARTED]))
        return {"t": round(time.time(), 3), "interval": self.config.interval, "clients": clients}

    def client_errors_by_kind(self) -> dict[str, int]:
        """Client errors the monitor logged since it started, by kind."""
        return dict(self._client_errors_by_kind)

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
        return self._latest

    # -- state file -------------------------------------------------------------------------------

    def _state_path(self) -> Path | None:
        return None if self.config.data_dir is None else self.config.data_dir / STATE_FILE

    def _write_state_file(self) -> None:
        path = self._state_path()
        if path is None:
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "url": self.url, "started": self._started_t,
                                   "dsn": redact_dsn(self.config.dsn)}))
        tmp.replace(path)

    def _remove_state_file(self) -> None:
        path = self._state_path()
        if path is None:
            return
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass
