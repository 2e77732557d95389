"""A session helping recovery: the slots of dead clients in its queue's way.

A session that finds nothing ready (or no room) may find that a dead
client's slot or dequeuer role is what stands in the way; it then runs
recovery itself (:func:`help_recover`), at once when no monitor serves, else
after the monitor's grace. ``Session.recover_dead_holders`` waits until none
is left (:func:`wait_dead_holders`).
"""

from __future__ import annotations

import logging
import time

from ..driver.errors import QueueError, RingqError
from ..ring import Ring
from ..section import Section
from ._decide import dead_in_the_way
from .recovery import recover_dead_clients

logger = logging.getLogger("ringq.engine")
# A session that finds nothing ready (or no room) looks for dead holders in
# the queue's way at most this often, in seconds, per process and queue.
HELP_RECOVER_S = 1.0
# With a monitor serving (its heartbeat fresher than MONITOR_FRESH_S), a
# session leaves a dead holder to it (it recovers every 100 ms, and reports
# the death) for MONITOR_GRACE_S seconds before it recovers it itself.
MONITOR_FRESH_S = 2.0
MONITOR_GRACE_S = 2.0
_last_help: dict[tuple[str, int], float] = {}  # (instance, qid) -> last look; first dead seen:
_dead_since: dict[tuple[str, int], float] = {}


def help_due(instance: str, qid: int) -> bool:
    """Whether :func:`help_recover` of queue ``qid`` would look now (it looks
    at most every ``HELP_RECOVER_S`` per process and queue): the asyncio face
    asks first, and runs it in a thread only then (it may make round trips)."""
    return time.monotonic() - _last_help.get((instance, qid), -HELP_RECOVER_S) >= HELP_RECOVER_S


def help_recover(
    sec: Section, dsn: str, ring: Ring, queue: str, *, owner: int, instance: str
) -> bool:
    """A session (token ``owner``, database ``instance``) found nothing ready (or no room) in
    ``queue``: if a dead holder's slot or dequeuer role is in the way, run
    recovery for it, at once when no monitor serves, else after
    ``MONITOR_GRACE_S`` if the monitor has not. Looked at most every
    ``HELP_RECOVER_S`` per process and queue; returns True if recovery
    decided anything. Failures are logged, not raised: the caller only found nothing.
    """
    key = (instance, ring.qid)
    now = time.monotonic()
    if now - _last_help.get(key, -HELP_RECOVER_S) < HELP_RECOVER_S:
        return False
    _last_help[key] = now
    if not dead_in_the_way(sec, ring, owner):
        _dead_since.pop(key, None)
        return False
    since = _dead_since.setdefault(key, now)
    if now - since < MONITOR_GRACE_S and sec.monitor_serving(MONITOR_FRESH_S):
        return False
    try:
        recovered = recover_dead_clients(sec, dsn)
    except RingqError as exc:
        logger.info("ringq: queue %s: recovering a dead holder in its way failed: %s",
                          queue, exc)
        return False
    if recovered:
        logger.info(
            "ringq: queue %s: a session recovered %d dead holders in its way",
            queue,
            len(recovered),
        )
    return bool(recovered)


def wait_dead_holders(
    sec: Section, dsn: str, ring: Ring, queue: str, *, owner: int, timeout: float
) -> None:
    """``Session.recover_dead_holders``: recover until no dead holder is in
    ``queue``'s way. :raises QueueError: some remain after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while dead_in_the_way(sec, ring, owner):
        recover_dead_clients(sec, dsn)
        if not dead_in_the_way(sec, ring, owner):
            return
        if time.monotonic() >= deadline:
            raise QueueError(
                f"queue {queue!r}: slots of dead clients still held after {timeout:g}s",
                queue=queue,
            )
        time.sleep(0.05)  # their backends are ending, or another process is recovering
