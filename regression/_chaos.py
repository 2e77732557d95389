"""Fault injection of a regression cycle (``--chaos``).

:class:`Chaos` kills a random producer, consumer, SQL consumer or the monitor
every ``chaos_interval`` seconds, or ends a SQL consumer's backend
(``pg_terminate_backend``: the process lives on and reconnects); the monitor
is restarted at once, the workers by the cycle's loop (:mod:`._cycle`). With
``chaos_pg_restart`` it restarts the embedded PostgreSQL once. It also runs
the monitor of a ``chaos_failover`` cycle, on the DSN that follows the
primary, and of a cycle with SQL consumers (their agent) when none serves the
database. Its figures go to the cycle's ``stats["chaos"]``.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ringq.engine import pg

from . import _queries as S
from ._config import RegressConfig
from ._failover import embedded_cluster
from ._monitors import OwnMonitor, TakenMonitor, monitor_serves, serving_monitor
from ._sql_consumer import application_name
from ._worker import LOST_SESSION, RECONNECTS, RESUMED, WORDS


class Chaos:
    """Fault injection of a cycle: every ``chaos_interval`` seconds kill -9 a
    random producer, consumer or the monitor (restarted at once; the workers
    are restarted by the cycle's loop), and with ``chaos_pg_restart`` restart
    the embedded PostgreSQL once (``pg_ctl restart -m fast``). The monitor is
    the cycle's own, or the one already serving the database, taken over
    (:mod:`._monitors`). Killing stops once the producers are done, so the
    cycle can drain. Without ``chaos`` (a ``chaos_failover`` cycle alone) it
    only runs the monitor, on the DSN that follows the primary; without
    either (a cycle with SQL consumers) it only runs a monitor if none serves
    the database, and leaves a serving one alone.

    :raises ForeignMonitor: (start) a monitor serves the database that cannot be taken over.
    """

    def __init__(
        self,
        dsn: str,
        cfg: RegressConfig,
        rng: random.Random,
        monitor_dir: Path | None = None,
        monitor_dsns: tuple[str, ...] = (),
    ) -> None:
        self.dsn = dsn
        self.monitor_dsns = monitor_dsns
        self.cfg = cfg
        self.rng = rng
        self.monitor_dir = monitor_dir
        self.kills = {"producers": 0, "consumers": 0, "monitor": 0, "pg_restarts": 0,
                      "sql_consumers": 0, "sql_backends": 0}
        self.killed: set[int] = set()  # pids we killed (their exit is not a failure)
        self.monitor: OwnMonitor | TakenMonitor | None = None
        self.next_at = 0.0
        self.events = 0
        self.pg_event = rng.randint(2, 3) if cfg.chaos_pg_restart else -1
        # The first kills cover every kind (in random order), then any kind.
        self.first_kinds = ["producers", "consumers", "monitor"]
        if cfg.sql_consumers:
            self.first_kinds += ["sql_consumers", "sql_backends"]
        rng.shuffle(self.first_kinds)
        self.pg_errors: list[str] = []
        self.logdir = ""

    def start(self, now: float) -> None:
        self.logdir = tempfile.mkdtemp(prefix="ringq-regress-chaos-")
        if not self.cfg.resilient:
            # Only the SQL consumers' agent is needed: any monitor serving will do.
            if not monitor_serves(self.dsn):
                self.monitor = OwnMonitor(self.dsn, self.logdir)
                self.monitor.start()
            return
        serving = serving_monitor(self.dsn, self.monitor_dir, also=self.monitor_dsns)
        if serving is None:
            self.monitor = OwnMonitor(self.dsn, self.logdir)
        elif self.cfg.chaos_failover is not None:
            # Restarted at once on the DSN that follows the primary: on a
            # single-host DSN it would lose the database for good at the kill.
            self.monitor = TakenMonitor(serving, self.logdir, dsn=self.dsn)
            if serving.dsn_option() != self.dsn:
                self.monitor.kill()
        else:
            self.monitor = TakenMonitor(serving, self.logdir)
        self.monitor.start()
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        lo, hi = self.cfg.chaos_interval
        self.next_at = now + self.rng.uniform(lo, hi)

    def was_killed(self, proc: Any) -> bool:
        if proc.pid in self.killed:
            self.killed.discard(proc.pid)
            return True
        return False

    def tick(
        self,
        now: float,
        producers: Sequence[Any],
        consumers: Sequence[Any],
        producers_done: bool,
        sql_consumers: Sequence[Any] = (),
    ) -> None:
        if self.monitor is not None:
            self.monitor.tick()  # restarts it if it died, follows a restart under way
        if not self.cfg.chaos or producers_done or now < self.next_at:
            return
        self.events += 1
        if self.events == self.pg_event:
            self._restart_pg()
        else:
            self._kill_one(producers, consumers, sql_consumers)
        self._schedule(time.monotonic())

    def _kill_one(
        self, producers: Sequence[Any], consumers: Sequence[Any], sql_consumers: Sequence[Any]
    ) -> None:
        """kill -9 a random live producer, consumer or SQL consumer, end a SQL
        consumer's backend, or kill (and restart) the monitor; the first kills
        cover every kind, in random order."""

        def live(procs: Sequence[Any]) -> list[Any]:
            return [p for p in procs if p.exitcode is None and p.pid not in self.killed]

        choices = {
            "producers": live(producers),
            "consumers": live(consumers),
            "monitor": [self.monitor] if self.monitor is not None and self.monitor.alive() else [],
            "sql_consumers": live(sql_consumers),
            "sql_backends": live(sql_consumers),
        }
        kinds = [k for k, v in choices.items() if v]
        first = [k for k in self.first_kinds if k in kinds]
        if first:
            kinds = first[:1]
            self.first_kinds.remove(first[0])
        if not kinds:
            return
        kind = self.rng.choice(kinds)
        victim = self.rng.choice(choices[kind])
        if kind == "monitor":
            if victim.kill():  # and restart it
                self.kills[kind] += 1
        elif kind == "sql_backends":
            if self._terminate_backend(victim.pid):
                self.kills[kind] += 1
        else:
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            else:
                self.kills[kind] += 1
                self.killed.add(victim.pid)

    def _terminate_backend(self, pid: int) -> bool:
        """pg_terminate_backend of SQL consumer ``pid``'s backend (none yet, or
        the database away: no kill)."""
        try:
            with pg.connected(self.dsn, connect_timeout=5) as conn:
                row = conn.execute(S.TERMINATE_SQL_CONSUMER, (application_name(pid),)).fetchone()
        except LOST_SESSION:
            return False
        return bool(row and row[0])

    def _restart_pg(self) -> None:
        try:
            cluster = embedded_cluster(self.dsn)
            if cluster is None:
                self.pg_errors.append(
                    "the DSN is not the embedded cluster: PostgreSQL not restarted"
                )
                return
            cluster.restart(timeout=60)  # fast: sessions cut, the same port
            self.kills["pg_restarts"] += 1
        except Exception as exc:
            self.pg_errors.append(f"PostgreSQL restart failed: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        """Stop the cycle's own monitor; leave a taken-over one serving (restarted if need be)."""
        if self.monitor is not None:
            self.monitor.stop()

    def report(self, counters: Any, slots: Sequence[int]) -> dict[str, Any]:
        return {
            **self.kills,
            "interval_s": list(self.cfg.chaos_interval),
            "monitor_starts": self.monitor.starts if self.monitor is not None else 0,
            "monitor_taken_over": bool(self.monitor is not None and self.monitor.taken_over),
            "monitor_url": self.monitor.url if self.monitor is not None else None,
            "reconnects": int(sum(counters[i * WORDS + RECONNECTS] for i in slots)),
            "resumed": int(sum(counters[i * WORDS + RESUMED] for i in slots)),
            "errors": self.pg_errors + (self.monitor.errors if self.monitor is not None else []),
            "logs": self.logdir,
        }
