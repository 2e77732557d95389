"""Pruning of spent idempotency keys (``ringq.keys``): :func:`prune_keys`, and
the monitor's step ``keys`` that calls it once a minute."""

from __future__ import annotations

import time

from ringq.engine import queue_table
from ringq.engine.sqlfile import compose

from . import _queries as Qy
from ._config import DEFAULT_KEY_RETENTION
from ._db import connect_step
from ._step import Note, Settings

PRUNE_EVERY_S = 60.0  # key pruning runs at most this often (retentions are in hours)


def prune_keys(
    dsn: str, retention_s: float = DEFAULT_KEY_RETENTION, *, batch: int = 10_000
) -> dict[str, int]:
    """Delete spent idempotency keys; returns {queue: keys deleted} ("" for dropped queues).

    A key goes once it was made more than ``retention_s`` seconds ago *and*
    its entry is no longer on the queue (consumed, reclaimed or overwritten):
    a producer retrying within the retention still gets the first entry's
    sequence, and a key never goes while its entry can still be delivered.
    Keys of dropped queues go regardless of age. At most ``batch`` keys per
    queue (and ``batch`` of dropped queues) per call, oldest first, so a long
    backlog is pruned over several passes. Every query runs along the index
    ``ringq.keys (queue_id, created_at)``.

    :raises DatabaseUnavailable: the database cannot be reached.
    :raises RingqError: any other database error, converted.
    """
    pruned: dict[str, int] = {}
    with connect_step(dsn) as conn:
        dropped = conn.execute(Qy.KEYS_PRUNE_DROPPED, (batch,)).rowcount
        if dropped:
            pruned[""] = dropped
        queues = conn.execute(Qy.KEYS_QUEUES, (retention_s,)).fetchall()
        for qid, name, capacity in queues:
            n = conn.execute(
                compose(Qy.KEYS_PRUNE, table=queue_table(name)),
                (qid, retention_s, capacity, batch),
            ).rowcount
            if n:
                pruned[name] = n
    return pruned


class PruneKeys:
    """Step ``keys``: index probes per queue (ringq.keys (queue_id, created_at)),
    not a scan; still, once a minute is plenty for a retention in hours."""

    def __init__(self, settings: Settings, note: Note) -> None:
        self._settings = settings
        self._note = note
        self._due = 0.0  # monotonic

    def run(self) -> None:
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + PRUNE_EVERY_S
        cfg = self._settings()
        for queue, n in prune_keys(cfg.dsn, cfg.key_retention).items():
            self._note("keys.pruned", queue=queue or None, keys=n)
