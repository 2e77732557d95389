"""Step ``inbox``: move the entries enqueued through SQL (``ringq.inbox``) into the rings.

The pump runs at every sample, and between samples as soon as a NOTIFY says
the inbox has entries. It never waits for space: a full queue keeps its SQL
entries in the inbox, is left out of the NOTIFY-driven pumps, and is tried
again on the next sample, or as soon as a reclaim finds room in it
(``_reclaim``). A pump that fails (the database unreachable …) is tried again
at the next sample, not on every pass.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

from ringq.engine import Session, connect
from ringq.engine import layout as L

from . import _queries as Qy
from ._inbox import pump_inbox
from ._step import REPEAT_LOG_S, Note, Settings

logger = logging.getLogger("ringq.monitor")


@dataclass
class Inbox:
    """What the pumps, the reclaim and the loop's NOTIFY wait share."""

    due: bool = True  # a NOTIFY (or a reconnect, or a reclaim) asks for a pump
    # monotonic: after a failed pump, NOTIFYs wait for this (or the sample)
    retry_at: float = 0.0
    # Full queues with SQL entries waiting: {name: queue id}, left out of the
    # NOTIFY-driven pumps until the next sample or until a reclaim finds room.
    full: dict[str, int] = field(default_factory=dict)
    # name -> when "inbox.queue_full" was written
    full_logged: dict[str, float] = field(default_factory=dict)

    def mark_due(self) -> None:
        self.due = True


class Pump:
    """Step ``inbox``: ``retry_full`` for the sample's pump (full queues are
    looked at again too), not for the NOTIFY-driven one."""

    def __init__(self, inbox: Inbox, settings: Settings, note: Note, *, retry_full: bool) -> None:
        self._inbox = inbox
        self._settings = settings
        self._note = note
        self._retry_full = retry_full
        # Kept between pumps (a new session is two connections: most of an SQL
        # enqueue's way to its consumer); made again after a failure or a new DSN.
        self._session: Session | None = None
        self._session_dsn = ""
        # {queue id: (free slots, inbox entries waiting)} last written to
        # ringq.room (rewritten only on change)
        self._published: dict[int, tuple[int, int]] = {}

    def _linked(self) -> Session:
        dsn = self._settings().dsn
        if self._session is not None and (self._session.closed or self._session_dsn != dsn):
            self.close()
        if self._session is None:
            self._session = connect(dsn)
            self._session_dsn = dsn
            # Its calls are the monitor's own, not an application client's (kinds).
            self._session.set_client_role(L.CR_MONITOR)
            self._session.connection.execute(Qy.PUMP_ASYNC_COMMIT)
            self._session.commit()  # a SET in a transaction rolled back would be undone
        return self._session

    def close(self) -> None:
        """Close the kept session (the monitor stops, or a pump failed)."""
        session, self._session = self._session, None
        self._published.clear()  # written again in full by the next session's pass
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()

    def run(self) -> None:
        inbox = self._inbox
        inbox.due = False
        full: dict[str, int] = {}
        skip = () if self._retry_full else tuple(inbox.full)
        try:
            moved = pump_inbox(self._settings().dsn, skip=skip, full=full,
                               session=self._linked(), published=self._published)
        except BaseException:
            self.close()
            # Retried by the next sample's pump; until then NOTIFYs only mark it due.
            inbox.retry_at = time.monotonic() + self._settings().interval
            raise
        inbox.retry_at = 0.0
        if self._retry_full:
            inbox.full = full
        else:
            inbox.full.update(full)
        if moved:
            logger.debug("ringq monitor: inbox moved %s", moved)
        # Logged on the edge, then again at most every REPEAT_LOG_S while it
        # lasts: an exception queue nobody drains would otherwise write a line
        # every sample, for hours.
        now = time.monotonic()
        for name in full:
            last = inbox.full_logged.get(name)
            if last is None or now - last >= REPEAT_LOG_S:
                inbox.full_logged[name] = now
                self._note("inbox.queue_full", logging.WARNING, queue=name,
                           reason="queue full: its SQL entries wait in ringq.inbox")
        for name in [n for n in inbox.full_logged if n not in inbox.full]:
            del inbox.full_logged[name]
            self._note("inbox.resumed", queue=name, moved=moved.get(name, 0))
