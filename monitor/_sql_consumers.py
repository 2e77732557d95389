"""The SQL consumers' agent (``ringq.dequeue``), in a thread of the monitor's own.

The engine's :class:`~ringq.engine.sqlpath.SqlAgent` does the work (sets
ready entries aside for SQL consumers, decides them from the rows); this
thread gives it a connection that LISTENs on ``ringq_want`` (a SQL consumer
found nothing) and runs a pass as soon as one asks, as often as the agent
says while SQL consumers are busy (``STARVED_WAIT_S``, ``SUPPLIED_WAIT_S``),
and every ``recovery_interval`` otherwise. A thread of its own, not a step of the
loop: a SQL consumer waits for the agent's answer, and the loop's slow steps
(figures, pruning, the T4 files) must not stand between them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import psycopg
from ringq.engine import Section, pg
from ringq.engine.sqlpath import AgentFigures, SqlAgent

from ._section import Attachment
from ._step import REPEAT_LOG_S, Note, Settings

logger = logging.getLogger("ringq.monitor")

RETRY_S = 0.5  # after a failed pass (the database away …)
LISTEN_WAIT_S = 5.0  # start() waits this long at most for the agent to LISTEN


class SqlConsumers:
    """Start with :meth:`start`, end with :meth:`stop` (idempotent)."""

    def __init__(self, settings: Settings, attachment: Attachment, note: Note) -> None:
        self._settings = settings
        self._attachment = attachment
        self._note = note
        self._agent = SqlAgent()
        self._agent.puts.enabled = settings().sql_reserve_slots
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._logged: tuple[str, float] = ("", 0.0)
        self.failures = 0

    @property
    def figures(self) -> AgentFigures:
        return self._agent.figures

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._listening.clear()
        self._thread = threading.Thread(target=self._run, name="ringq-sql-consumers", daemon=True)
        self._thread.start()
        # A SQL consumer's ask (NOTIFY) sent before the agent LISTENs is lost, and
        # one that then waits on ringq_ready would wait in vain: return once asks
        # are heard (or, the database away, after LISTEN_WAIT_S).
        self._listening.wait(LISTEN_WAIT_S)

    def stop(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        agent = self._agent
        while not self._stop.is_set():
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = pg.connect(self._settings().dsn, autocommit=True, connect_timeout=5)
                    SqlAgent.prepare(conn)  # LISTEN for asks and puts; asynchronous commits
                    self._listening.set()
                    agent.forget()  # asks sent while we were away are lost: look again
                pace = self._attachment.read(functools.partial(self._pass, conn))
                wait = self._settings().recovery_interval if pace is None else pace
                for n in pg.notifies(conn, wait):
                    agent.heard(n.channel, n.payload)
            except Exception as exc:  # a pass that failed is tried again; never fatal
                self.failures += 1
                self._log(exc)
                if conn is not None:
                    conn.close()
                conn = None
                self._stop.wait(RETRY_S)
        if conn is not None:
            conn.close()

    def _pass(self, conn: psycopg.Connection[Any], sec: Section) -> float | None:
        return self._agent.run(sec, conn)

    def _log(self, exc: Exception) -> None:
        text = f"{type(exc).__name__}: {exc}"
        last, t = self._logged
        now = time.monotonic()
        if text != last or now - t >= REPEAT_LOG_S:
            self._logged = (text, now)
            self._note("sql_consumers.failed", logging.WARNING, error=text)
