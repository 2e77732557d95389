"""What every worker process of a cycle shares with the others and the parent.

The layout of the shared counters (one block of ``WORDS`` int64 per worker,
each writing only its own, and the parent's ``PROMOTED`` word after them),
the arguments a worker is started with (:class:`WorkerArgs`), the wrapper that
runs a worker's body and reports its failure (:func:`run_worker`), and the way
a worker survives a lost database session under chaos (:func:`retrying`,
:func:`wait_recovered`). The producer is in :mod:`._producer`, the consumer in
:mod:`._consumer`, the parent's side in :mod:`._cycle`.

Every process makes its own session after it starts (nothing crosses a fork:
the processes come from a fork server that has never opened a connection).
Workers ignore SIGINT: the parent decides when a cycle stops.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from ringq.engine import (
    DatabaseError,
    DatabaseUnavailable,
    InDoubt,
    Retryable,
    Session,
    exits,
    pid_alive,
)
from ringq.engine import layout as L

from ._config import RegressConfig
from ._store import QueueRef

# -- shared counters: one block of WORDS int64 per worker (each writes only its own) --
WORDS = 11
# producer words
P_ENTRIES = 0  # committed entries
P_TX = 1  # committed transactions
P_TX_2PC = 2  # of which two-phase
P_RB_TX = 3  # deliberately rolled-back transactions
P_FULL_TX = 4  # transactions rolled back because a queue stayed full
P_RB_ENTRIES = 5  # entries of rolled-back transactions (that had a sequence)
P_MULTI_TX = 6  # committed transactions that touched several queues
# consumer words
C_ENTRIES = 0  # entries taken in committed transactions
C_TX = 1
C_RB_TX = 2  # deliberately rolled-back dequeue transactions
C_STALLS = 3  # times it stopped dequeuing to let its queue fill
C_REDELIVERED = 4  # committed entries whose delivery count was > 1
C_FIRST_AFTER = 5  # fail-over: time.monotonic() in µs of its first commit after the promotion
# the grouped queue's first consumer's block only: 1 once any of its consumers
# saw the queue full at the start of the cycle (they all go on then)
C_FILLED = 6
HEARTBEAT = 7  # any step at all (the watchdog's progress measure)
RECONNECTS = 8  # both: sessions lost to a database restart and opened again (chaos)
RESUMED = 9  # both: times the worker resumed from what the database holds (restarts)
# a linked consumer's block: 1 while it stands still for its queue to fill (the
# SQL consumers of its queue stand still with it, or the queue would not fill)
C_PAUSED = 10
# a producer's block: entries it enqueued with a delay (committed; word 10 as
# C_PAUSED is a linked consumer's only)
P_DELAYED = 10
# SQL consumer words (C_ENTRIES, C_TX, C_RB_TX, C_REDELIVERED as a consumer's, and)
S_EMPTY = 3  # calls of ringq.dequeue that returned nothing

# The word after the workers' blocks: when the standby was promoted (fail-over;
# time.monotonic() in µs; 0 before, 1 if the fail-over failed), written by the
# parent only.
PROMOTED = -1

# Errors of a database going away under a session (chaos restarts PostgreSQL):
# the worker backs off, opens a new session and resumes from the database.
LOST_SESSION = (DatabaseUnavailable, InDoubt, DatabaseError, psycopg.OperationalError)
# ... and any transaction known not to have committed (a conflict; after a
# fail-over, a section replaced under it, or a commit cut off and decided from
# the rows): the same way back.
RETRIED = (*LOST_SESSION, Retryable)
BACKOFF_S = (0.1, 2.0)

# The parent's loop turns every POLL_S (progress, depth samples, watchdog), and
# a consumer's dequeue waits as long for an entry.
POLL_S = 0.2


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process needs (pickled to it; no connection, no section)."""

    dsn: str
    run_id: str
    cycle: int
    config: RegressConfig
    queues: tuple[QueueRef, ...]
    index: int  # producer index, or queue index for a consumer
    slot: int  # its block in the counters
    seed: int
    quota: tuple[int, ...] = ()  # producers: committed entries owed to each queue
    ack_dir: str = ""  # fail-over: where producers log what they were told had committed
    worker: int = 0  # consumers: its number among its queue's consumers (linked ones first)
    first_slot: int = 0  # consumers: the block of its queue's first (linked) consumer


def run_worker(role: str, body: Callable[..., None], args: WorkerArgs, *rest: Any) -> None:
    """Run ``body(args, *rest)`` in a worker process; on any failure put a line
    on the errors queue (``rest[-1]``) and exit with ``exits.FAILURE``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops cycles, not Ctrl-C
    errors: Any = rest[-1]
    try:
        body(args, *rest)
    except BaseException as exc:
        # The name's last part: the producer's index, the queue's, or queue.worker
        # for a consumer of the grouped queue.
        index = mp.current_process().name.rsplit("-", 1)[-1]
        errors.put(f"{role} {index} (pid {os.getpid()}): {type(exc).__name__}: {exc}")
        errors.close()
        errors.join_thread()  # os._exit does not wait for the queue's feeder thread
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(exits.FAILURE)


def wait_recovered(s: Session, abort: Any) -> bool:
    """Wait until the monitor has recovered every dead (or in-doubt) client.

    A restarted worker must not overtake its predecessor: entries a killed
    producer committed but had not yet published, or entries a killed consumer
    held, become visible only when the monitor decides the dead client's slots
    from the rows. Resuming before that lets the new process's entries (or
    dequeues) pass the old ones, which breaks per-producer order.
    False if aborted meanwhile."""
    sec = s.section
    while True:
        pending = [
            c for c in sec.active_clients()
            if sec.c(c, L.C_STATE) == L.CS_IN_DOUBT or not pid_alive(sec.c(c, L.C_PID))
        ]
        if not pending:
            return True
        if abort.is_set():
            return False
        time.sleep(0.02)


def retrying(args: WorkerArgs, counters: Any, abort: Any, body: Callable[[], bool]) -> None:
    """Run ``body`` until it returns True; with chaos, a lost database session
    (PostgreSQL restarted, or failed over) means: back off, reconnect, resume."""
    delay = BACKOFF_S[0]
    while not abort.is_set():
        try:
            if body():
                return
        except RETRIED:
            if not args.config.resilient:
                raise
            counters[args.slot * WORDS + RECONNECTS] += 1
            counters[args.slot * WORDS + HEARTBEAT] += 1
            abort.wait(delay)
            delay = min(BACKOFF_S[1], delay * 2)
