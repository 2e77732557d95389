"""Step ``sample``: the performance sample of every queue, once per interval.

Each queue's counters are read from the section and turned into rates and
percentiles (``_sample``), with the times the queue was empty or full
(``_watch``), its exception count and dead rows (``_figures``), its waiting
entries and when the next falls due (two words of the queue block) and, for a
grouped queue, its group figures. The samples go to the in-memory history, the
T4 file of the day, and ``/api/queues``; the clients' rates are sampled too,
and per client kind what its clients did over the interval (``_kinds``), into
the kinds' T4 file of the day.
"""

from __future__ import annotations

import time

from ringq.engine import layout as L
from ringq.engine import metrics as M

from . import _clients as C
from . import _kinds as K
from . import _sample as S
from ._figures import DatabaseFigures
from ._groups import group_figures, grouped
from ._link import Link
from ._section import Attachment
from ._t4 import KINDS, T4Writer
from ._watch import WatchQueues


class Sampler:
    """Step ``sample``. ``t4`` is set while the monitor runs with a data directory
    (the kinds' file is written beside it, in the same directory, kept as long)."""

    def __init__(
        self,
        attachment: Attachment,
        link: Link,
        watch: WatchQueues,
        figures: DatabaseFigures,
        history_points: int,
    ) -> None:
        self._attachment = attachment
        self._link = link
        self._watch = watch
        self._figures = figures
        self.history = S.History(history_points)
        self._t4: T4Writer | None = None
        self._kinds_t4: T4Writer | None = None
        self.latest: dict[str, dict[str, float | str]] = {}  # queue name -> last sample
        self.latest_t = 0.0
        self.client_rates = C.Rates()
        self.kinds = K.KindCounts()
        self._snaps: dict[int, S._Snap] = {}

    @property
    def t4(self) -> T4Writer | None:
        """The queues' T4 writer; setting it opens (or, None, closes) the kinds' one beside it."""
        return self._t4

    @t4.setter
    def t4(self, writer: T4Writer | None) -> None:
        if self._kinds_t4 is not None:
            self._kinds_t4.close()
            self._kinds_t4 = None
        self._t4 = writer
        if writer is not None:  # the monitor starts: count the clients from now
            self._kinds_t4 = T4Writer(writer.data_dir, writer.keep_days, KINDS)
            self.kinds.restart()

    def forget(self) -> None:
        """Counters restart with a new segment: the next sample starts afresh."""
        self._snaps.clear()
        self.kinds.restart()

    def run(self) -> None:
        sec = self._attachment.current()
        t = time.time()
        now = time.monotonic_ns()
        samples = []
        snaps: dict[int, S._Snap] = {}
        for qidx in sec.loaded_queues():
            qid = sec.q(qidx, L.Q_QID)
            name = sec.queue_name(qidx)
            cur = S.snapshot(sec, qidx, now)
            empty_s, full_s = self._watch.take_times(qid)
            sample = S.compute(
                name,
                self._snaps.get(qid),
                cur,
                t=t,
                empty_s=empty_s,
                full_s=full_s,
                exceptions=self._figures.exc_counts.get(qid, 0),
                dead_rows=self._figures.dead_rows.get(name, 0),
            )
            sample.update(M.due_figures(sec, qidx))  # two words of the queue block
            if grouped(sec, qidx):  # an ungrouped queue: no scan, no query
                sample.update(group_figures(sec, qidx, name, self._link.connect))
            samples.append(sample)
            snaps[qid] = cur
        self._snaps = snaps
        wall_ns, mono_ns = time.time_ns(), time.monotonic_ns()
        clients = C.read_clients(sec)
        self.client_rates.sample(clients, mono_ns)
        kind_rows = self.kinds.sample(clients, t=t, wall_ns=wall_ns, mono_ns=mono_ns)
        samples.sort(key=lambda s: str(s[S.NAME]))
        for s in samples:
            self.history.add(s)
        self.latest = {str(s[S.NAME]): s for s in samples}
        self.latest_t = t
        if self._t4 is not None:
            self._t4.write(samples)
        if self._kinds_t4 is not None:
            self._kinds_t4.write(kind_rows)
