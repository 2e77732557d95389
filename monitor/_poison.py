"""New poison entries: rows moved to a queue's exception table since the last
look are logged (``entry.poisoned``) and published as events, once each."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg

from . import _events as E
from . import _queries as Qy
from ._link import Link
from ._step import Note, Settings

EXC_WINDOW_MIN_S = 60.0  # how far back new exception-table rows are looked for


class PoisonWatch:
    """Part of step ``database`` (on its connection). Rows moved before the
    monitor started are not news."""

    def __init__(self, link: Link, settings: Settings, note: Note) -> None:
        self._link = link
        self._settings = settings
        self._note = note
        self._seen: dict[tuple[int, int], float] | None = None  # (queue id, seq) -> moved at

    def scan(self, conn: psycopg.Connection[Any]) -> None:
        window = max(EXC_WINDOW_MIN_S, 10 * self._settings().interval)
        rows = conn.execute(Qy.RECENT_EXCEPTIONS, (window,)).fetchall()
        first = self._seen is None
        seen = self._seen if self._seen is not None else {}
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
            self._note("entry.poisoned", logging.WARNING, queue=qname, **fields)
            self._link.publish(E.make_event(E.ENTRY_POISONED, qname, **fields))
        self._seen = {k: t for k, t in seen.items() if t >= horizon}
