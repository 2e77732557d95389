"""Step ``watch``: raise the queue events full / empty / high-water on the edge,
and time how long each queue was empty or full (read by the sample)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ringq.engine import layout as L

from . import _events as E
from ._link import Link
from ._section import Attachment
from ._step import Settings


@dataclass
class QueueWatch:
    """Event state of one queue, so each condition is announced once per occurrence."""

    full: bool = False
    empty: bool = False
    high: bool = False
    empty_s: float = 0.0  # seconds nothing was ready since the last sample
    full_s: float = 0.0  # seconds without a free slot since the last sample
    seen_ns: int = 0


class WatchQueues:
    """Step ``watch``."""

    def __init__(self, attachment: Attachment, link: Link, settings: Settings) -> None:
        self._attachment = attachment
        self._link = link
        self._settings = settings
        self._watch: dict[int, QueueWatch] = {}  # by queue id

    def take_times(self, qid: int) -> tuple[float, float]:
        """Seconds queue ``qid`` was (empty, full) since the last call; they start again at 0."""
        w = self._watch.get(qid)
        if w is None:
            return 0.0, 0.0
        empty_s, w.empty_s = w.empty_s, 0.0
        full_s, w.full_s = w.full_s, 0.0
        return empty_s, full_s

    def run(self) -> None:
        sec = self._attachment.current()
        now = time.monotonic_ns()
        hw = self._settings().high_water
        publish = self._link.publish
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
                w = self._watch[qid] = QueueWatch(empty=empty, seen_ns=now)
            else:
                # Time in a state, at this pass's resolution (a change counts half the pass).
                dt = (now - w.seen_ns) / 1e9
                w.empty_s += dt * ((w.empty + empty) / 2)
                w.full_s += dt * ((w.full + full) / 2)
                w.seen_ns = now
            if full and not w.full:
                publish(
                    E.make_event(E.queue_event(name, E.QUEUE_FULL), name, depth=depth, capacity=cap)
                )
            w.full = full
            if empty and not w.empty and not first:
                publish(E.make_event(E.queue_event(name, E.QUEUE_EMPTY), name, capacity=cap))
            w.empty = empty
            if depth >= threshold and not w.high:
                publish(
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
