"""Step ``database``: the figures read from the tables once per interval.

The queue list (a queue created or dropped rebuilds the section; a lease
changed in ``ringq.queues`` takes effect), the exception counts and dead rows
per queue (read by the sample), who holds back the xmin horizon
(:class:`~._horizon.HorizonReport`), and new poison entries
(:class:`~._poison.PoisonWatch`), in that order, on the monitor's connection.
"""

from __future__ import annotations

from ringq.engine import layout as L

from . import _queries as Qy
from ._horizon import HorizonReport
from ._link import Link
from ._poison import PoisonWatch
from ._section import Attachment


class DatabaseFigures:
    """Step ``database``."""

    def __init__(
        self, link: Link, attachment: Attachment, horizon: HorizonReport, poison: PoisonWatch
    ) -> None:
        self._link = link
        self._attachment = attachment
        self._horizon = horizon
        self._poison = poison
        self.queue_names: dict[int, str] = {}  # id -> name, from the last queue list
        self.exc_counts: dict[int, int] = {}  # queue id -> rows in its exception table
        self.dead_rows: dict[str, int] = {}  # queue name -> dead rows in its ring table

    def run(self) -> None:
        conn = self._link.connect()
        queues = conn.execute(Qy.QUEUES).fetchall()
        self.queue_names = {int(q[0]): str(q[1]) for q in queues}
        sec = self._attachment.current()
        loaded = {sec.q(i, L.Q_QID) for i in sec.loaded_queues()}
        if {q[0] for q in queues} != loaded:
            self._attachment.attach(reason="queues created or dropped")
            sec = self._attachment.current()
        # A lease changed in ringq.queues (or a block loaded by older code) takes effect here.
        leases = {int(q[0]): float(q[3]) for q in queues}
        for qidx in sec.loaded_queues():
            lease = leases.get(sec.q(qidx, L.Q_QID))
            if lease is not None and sec.q(qidx, L.Q_LEASE_MS) != max(0, round(lease * 1000)):
                sec.set_lease(qidx, lease)
        self.exc_counts = {int(q): int(n) for q, n in conn.execute(Qy.EXCEPTION_COUNTS).fetchall()}
        self.dead_rows = {str(n): int(d) for n, d in conn.execute(Qy.DEAD_ROWS).fetchall()}
        self._horizon.update(conn, self.dead_rows)
        self._poison.scan(conn)
