"""The global section the monitor works on: attaching it (rebuilt from the
tables), reading it under the lock that guards its replacement, and the heartbeat
the monitor writes in its header."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from ringq.engine import RingqError, Section
from ringq.engine import layout as L
from ringq.engine.recovery import rebuild, shared_section

from ._link import Link
from ._step import Note, Settings

T = TypeVar("T")


class Attachment:
    """The attached section. ``on_replaced`` hooks run when ``attach`` finds
    another segment than before (its counters restart)."""

    def __init__(self, settings: Settings, link: Link, note: Note) -> None:
        self._settings = settings
        self._link = link
        self._note = note
        self._sec: Section | None = None
        self._lock = threading.RLock()
        self._rebuilt: list[Section] = []  # attachments made by rebuild(), closed at release
        self.beat_t = 0.0  # when the last heartbeat was written (seconds since the epoch)
        self.on_replaced: list[Callable[[], None]] = []

    @property
    def section(self) -> Section | None:
        """The section attached now, if any (it may have been closed or unlinked)."""
        return self._sec

    def current(self) -> Section:
        """The attached section.

        :raises RingqError: none is attached.
        """
        sec = self._sec
        if sec is None or sec.closed:
            raise RingqError("no global section attached")
        return sec

    def read(self, fn: Callable[[Section], T]) -> T | None:
        """Run ``fn`` on the attached section, under the lock that guards its replacement."""
        with self._lock:
            sec = self._sec
            if sec is None or sec.closed:
                return None
            return fn(sec)

    def attach(self, *, reason: str | None) -> None:
        """Rebuild (load every queue not loaded, create the section if absent) and
        work on this process's shared attachment of it.

        The monitor uses the same :class:`Section` object as the sessions of its
        process (the engine's per-process attachment), because a second
        attachment in one process would not exclude them: fcntl locks belong to
        the process and the thread locks to the object. For the same reason
        the attachments :func:`rebuild` returns are closed only at ``release()``
        (closing any descriptor of the segment drops every fcntl lock this
        process holds on it).
        """
        fresh = rebuild(self._settings().dsn)
        self._rebuilt.append(fresh)
        shared = shared_section(self._link.instance)
        with self._lock:
            old, self._sec = self._sec, shared
        if old is not shared:
            for hook in self.on_replaced:
                hook()
        self.beat()
        if reason is not None:
            self._note("section.rebuilt", reason=reason, section=shared.name,
                       queues=[shared.queue_name(i) for i in shared.loaded_queues()])

    def beat(self) -> None:
        """Write this process's pid and the time in the header (the monitor is alive)."""
        sec = self._sec
        if sec is None or sec.closed:
            return
        now = time.time_ns()
        sec.header[L.H_MONITOR_PID] = os.getpid()
        sec.header[L.H_MONITOR_BEAT_NS] = now
        self.beat_t = now / 1e9

    def release(self) -> None:
        """Say no monitor serves the section now, and close the rebuilt attachments."""
        with self._lock:
            sec, self._sec = self._sec, None
            if sec is not None and not sec.closed and sec.header[L.H_MONITOR_PID] == os.getpid():
                sec.header[L.H_MONITOR_PID] = 0  # no monitor now (the process's attachment stays)
        rebuilt, self._rebuilt = self._rebuilt, []
        for extra in rebuilt:
            extra.close()


class Heartbeat:
    """Step ``heartbeat``: the monitor's pid and the time, in the section's header."""

    def __init__(self, attachment: Attachment) -> None:
        self._attachment = attachment

    def run(self) -> None:
        self._attachment.beat()
