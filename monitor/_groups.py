"""A grouped queue's figures in the monitor's sample (issue 16).

From the section: the groups with a ready entry and none held, the groups
with an entry held, and the claims that read past a busy group (cumulative).
From the queue's table: how long the oldest ready entry of any group (the
head of the group that has waited longest) has waited, by one primary-key
read of its row. An ungrouped queue (``Q_GROUPED`` 0) has none of these and
costs nothing: no scan, no query.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psycopg
from ringq.engine import DatabaseUnavailable, Ring, Section, queue_table
from ringq.engine import layout as L
from ringq.engine import metrics as M
from ringq.engine.sqlfile import compose

from . import _queries as Qy

logger = logging.getLogger("ringq.monitor")

# The oldest entry may be consumed between the section's reading and its row's:
# read both again, at most this many times in all, before leaving the age out.
_TRIES = 2


def grouped(sec: Section, qidx: int) -> bool:
    """Whether queue block ``qidx`` has held an entry with a group since it was loaded."""
    return bool(sec.q(qidx, L.Q_GROUPED))


def group_figures(
    sec: Section,
    qidx: int,
    name: str,
    connect: Callable[[], psycopg.Connection[Any]],
) -> dict[str, float | str]:
    """:data:`~ringq.engine.metrics.GROUP_KEYS` of grouped queue ``name`` (block
    ``qidx``) now. ``group_oldest_age_s`` is 0 when no group entry is ready, and
    left out when the database could not be read (``connect`` raised, or the
    query failed: the monitor's database step reports that; the rest stays)."""
    out: dict[str, float | str] = {M.GROUP_SKIPS: sec.q(qidx, L.Q_N_GROUP_SKIPS)}
    ring = Ring(sec, qidx)
    try:
        for _ in range(_TRIES):
            # Read without the queue lock, like every other figure of the sample:
            # it is for display, and a claim running meanwhile can only make it
            # one group off for one interval. The monitor holds no queue's lock
            # for its figures.
            counts = ring.group_counts()
            out[M.GROUPS_READY] = counts["ready"]
            out[M.GROUPS_BUSY] = counts["busy"]
            if counts["oldest_slot"] < 0:
                out[M.GROUP_OLDEST_AGE_S] = 0.0
                break
            age = _waited(name, counts["oldest_slot"], counts["oldest_seq"], connect)
            if age is not None:
                out[M.GROUP_OLDEST_AGE_S] = round(max(0.0, age), 3)
                break
    except (psycopg.Error, DatabaseUnavailable):
        # A lost connection is re-made by the next step that needs it.
        logger.debug("ringq monitor: no group age for %s", name, exc_info=True)
    return {k: out[k] for k in M.GROUP_KEYS if k in out}


def _waited(
    name: str, slot: int, seq: int, connect: Callable[[], psycopg.Connection[Any]]
) -> float | None:
    """Seconds entry ``seq`` in ``slot`` has waited, by the server's clock; None
    if the row holds it no longer (consumed since the section was read).

    :raises psycopg.Error: the query failed.
    :raises DatabaseUnavailable: no connection.
    """
    row = connect().execute(
        compose(Qy.GROUP_OLDEST_AGE, table=queue_table(name)), (slot, seq)
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])
