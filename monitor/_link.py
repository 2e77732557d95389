"""The monitor's own database connection, and following the embedded cluster's DSN.

One connection holds the monitor lock (one monitor per database), LISTENs for
the SQL inbox's NOTIFY, publishes events and reads figures. It is made again
after a loss, at most once per interval. When it cannot be made and
``config.dsn_file`` names another DSN (the embedded cluster came back on
another port, or its standby was promoted), the monitor follows it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from ringq.engine import (
    DatabaseUnavailable,
    RingqError,
    SchemaMissing,
    pg,
    read_dsn_file,
)
from ringq.engine.sqlfile import compose

from . import _events as E
from . import _queries as Qy
from ._errors import MonitorRunning
from ._step import Note, Settings

logger = logging.getLogger("ringq.monitor")

# (old DSN, new DSN, the file that named it): the monitor replaces its config
DsnChanged = Callable[[str, str, Path], None]


class Link:
    """The monitor's connection. ``on_connect`` hooks run after every (re)connect,
    ``on_drop`` hooks after a loss; ``instance`` is the database's ringq instance id."""

    def __init__(self, settings: Settings, note: Note, dsn_changed: DsnChanged) -> None:
        self._settings = settings
        self._note = note
        self._dsn_changed = dsn_changed
        self._conn: psycopg.Connection[Any] | None = None
        self._retry_at = 0.0
        self._error = "database unavailable"
        self.instance = ""
        self.on_connect: list[Callable[[], None]] = []
        self.on_drop: list[Callable[[], None]] = []

    @property
    def connected(self) -> bool:
        conn = self._conn
        return conn is not None and not conn.closed and not conn.broken

    def connect(self, *, first: bool = False) -> psycopg.Connection[Any]:
        """The connection, made again after a loss (at most once per interval).

        :raises DatabaseUnavailable: the database cannot be reached.
        :raises SchemaMissing: the database holds no ringq schema.
        :raises MonitorRunning: another monitor holds the monitor lock.
        """
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        if not first and time.monotonic() < self._retry_at:
            # The same text as the last attempt's, so the failed step is not logged anew.
            raise DatabaseUnavailable(self._error)
        self._retry_at = time.monotonic() + self._settings().interval
        while True:
            dsn = self._settings().dsn
            try:
                conn = pg.connect(dsn, connect_timeout=5, application_name="ringq-monitor")
                break
            except RingqError as err:
                if self._follow_dsn():
                    continue  # the embedded cluster came back under another DSN: try that one
                self._error = str(err)
                raise
        try:
            # attaching: a missing ringq.meta is SchemaMissing, "create a queue first"
            row = pg.run(conn, Qy.INSTANCE_ID, dsn=dsn, attaching=True).fetchone()
            if not row or not row[0]:
                raise SchemaMissing("ringq.meta holds no instance_id")
            locked = pg.run(conn, Qy.TRY_MONITOR_LOCK, dsn=dsn).fetchone()
            if not locked or not locked[0]:
                holder = pg.run(conn, Qy.MONITOR_LOCK_HOLDER, dsn=dsn).fetchone()
                who = (
                    f" (backend pid {holder[0]}, {holder[1] or 'no application name'})"
                    if holder
                    else ""
                )
                raise MonitorRunning(f"another ringq monitor serves this database{who}")
            listen = compose(Qy.LISTEN_INBOX, channel=sql.Identifier(Qy.INBOX_CHANNEL))
            pg.run(conn, listen, dsn=dsn)
        except BaseException:
            conn.close()
            raise
        self.instance = str(row[0])
        self._conn = conn
        # NOTIFYs sent while we were away are lost; a reconnect may have found a promoted standby.
        for hook in self.on_connect:
            hook()
        if not first:
            self._note("database.reconnected")
        return conn

    def _follow_dsn(self) -> bool:
        """Read the DSN file again (``config.dsn_file``, the embedded cluster's);
        True if it names another DSN, which every step uses from now on."""
        cfg = self._settings()
        path = cfg.dsn_file
        new = None if path is None else read_dsn_file(path)
        if path is None or new is None or new == cfg.dsn:
            return False
        self._dsn_changed(cfg.dsn, new, path)
        return True

    def publish(self, event: E.Event) -> None:
        """NOTIFY ``event`` on this connection."""
        E.publish(self.connect(), event)

    def drop(self) -> None:
        """Forget a connection that failed; the next ``connect()`` makes another."""
        conn, self._conn = self._conn, None
        for hook in self.on_drop:
            hook()  # the next connection may be on another server
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self) -> None:
        """Close the connection (which releases the monitor lock)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def wait(self, delay: float, stop: threading.Event) -> bool:
        """Sleep up to ``delay`` seconds, waking early for a SQL inbox NOTIFY or a stop;
        True if an inbox NOTIFY came."""
        if delay <= 0:
            return False
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            stop.wait(delay)
            return False
        notified = False
        try:
            for n in conn.notifies(timeout=delay, stop_after=1):
                if n.channel == Qy.INBOX_CHANNEL:
                    notified = True
        except psycopg.Error:
            self.drop()
            stop.wait(min(delay, 0.05))
        return notified
