"""The consumer process of a regression cycle.

One consumer process per queue dequeues in random batch sizes and writes what
it took to ``received_<queue>`` in the same transaction as the dequeue; now and
then it rolls back on purpose (the entries come back), and a few times per
cycle it stops dequeuing until producers find its queue full.

The grouped queue (``grouped_consumers`` > 0) is consumed by
``grouped_consumers`` processes at once (``shared`` mode; ``dequeue_many``
takes at most one entry per group). They record each entry's group, the time
right after the dequeue returned and the time just before the commit
(``time.monotonic_ns()``: the clock is system-wide), so that the proof can see
per-group order and whether two entries of a group were ever held at once.
They wait together at the start of the cycle until producers find their queue
full (one of them seeing it is enough for all), so the groups have a backlog
to be taken from in parallel. While a consumer stands still for its queue to
fill (``C_PAUSED`` in its block), the queue's SQL consumers (:mod:`._sql_consumer`)
stand still too. In a run with SQL consumers every consumer records who took
an entry and when, as the grouped queue's do (``QueueRef.timed``).

Each take's database time is the received row's ``deq_at`` (``clock_timestamp()``
of the record, in the dequeue's transaction: after the take, so an entry
released early shows as taken before its due time unless the record came
later still). Before a deliberate rollback the consumer reads the database's
clock, and right after it logs the entries in ``retried`` with that time and
the queue's backoff (``retry_delay``): the entries' strike, and so their
backoff, counts from a moment after it.

A consumer killed by chaos (or whose session was lost) is started again and
resumes from what its received table durably holds.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, cast

from ringq.engine import Message, Session, connect, queue_table
from ringq.engine import metrics as M

from . import _queries as S
from . import _worker as W
from ._store import sql_taking
from ._worker import WorkerArgs, retrying, run_worker, wait_recovered

# A consumer waits for producers to find its queue full at most
# max(STALL_MAX_S, capacity / STALL_MIN_RATE) seconds: long enough for a
# 2,000-slot queue to fill at the ~100 entries/s a small-payload queue gets
# while the producers are held back by the large-payload queue, and for a
# 50,000-slot queue (the original's) at the same rate (a fixed 30 s left the
# original's queues never full: ~640 entries/s per queue needs ~80 s).
STALL_MAX_S = 30.0
STALL_MIN_RATE = 100.0  # entries/s
STALL_IDLE_S = 3.0  # ... and gives up sooner when no producer writes to it any more
STALL_START_GRACE_S = 10.0  # ... at the start of a cycle, while producers start
# The consumer of a single-mode queue that SQL consumers share steps aside now
# and then: the SQL path gets the dequeuer role only while no linked dequeuer
# holds it or waits for it, which a busy linked consumer never leaves.
STEP_ASIDE_RATE = 0.2  # of its committed batches
STEP_ASIDE_S = 0.1


def consumer_main(
    args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, errors: Any
) -> None:
    """The consumer process's target (started by the cycle, again after a chaos kill)."""
    run_worker("consumer", _consume, args, counters, producers_done, abort, errors)


def _consume(args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, errors: Any) -> None:
    state: dict[str, Any] = {}
    retrying(
        args,
        counters,
        abort,
        lambda: _Consumer(args, counters, producers_done, abort, state).session(),
    )


class _Consumer:
    """One session of a consumer: resume, (grouped) wait for a full queue, then
    take batches until the producers are done and the queue is empty.
    ``state`` outlives the session (the stall plan)."""

    def __init__(
        self,
        args: WorkerArgs,
        counters: Any,
        producers_done: Any,
        abort: Any,
        state: dict[str, Any],
    ) -> None:
        self.a = args
        self.c = counters
        self.producers_done = producers_done
        self.abort = abort
        self.ref = ref = args.queues[args.index]
        self.cfg = cfg = args.config
        self.rng = rng = random.Random(args.seed)
        self.base = args.slot * W.WORDS
        self.table = S.received_table(ref.name)
        self.stmt = S.q(
            S.INSERT_RECEIVED_GROUPED if ref.timed else S.INSERT_RECEIVED, args.run_id, self.table
        )
        # A few times per cycle the consumer stops until producers find the queue
        # full (or STALL_MAX_S passes): the queues are driven full, not just busy.
        # Each stop comes when exactly ``n`` entries were taken (the batches before
        # it are cut to fit), with n at most 60% of the cycle and leaving more than
        # a ring's worth still to take: while the consumer stands still the
        # producers owe the queue more entries than it holds, so some enqueue must
        # find it full. (Only with entries_per_queue > capacity can a queue fill.)
        # (The grouped queue's consumers instead wait together once, at the start.)
        early = max(
            1, min(cfg.entries_per_queue * 6 // 10, cfg.entries_per_queue - cfg.capacity - 1)
        )
        self.stalls: list[int] = state.setdefault(
            "stalls",
            []
            if ref.grouped
            else sorted(rng.sample(range(1, early + 1), min(early, rng.randint(1, 2)))),
        )
        self.filled = args.first_slot * W.WORDS + W.C_FILLED
        self.paused = self.base + W.C_PAUSED
        self.steps_aside = not ref.grouped and any(
            q == args.index for q, _w in sql_taking(args.queues, cfg)
        )
        self.pid = os.getpid()
        self.left_sql = S.q(S.LEFTOVERS, args.run_id, queue_table(ref.name))
        self.retried_sql = S.q(S.INSERT_RETRIED, args.run_id)
        self.order = 0  # the last recv_order recorded
        self.taken = 0  # entries taken in committed transactions this cycle
        self.max_stall_s = max(STALL_MAX_S, cfg.capacity / STALL_MIN_RATE)

    def session(self) -> bool:
        a = self.a
        with connect(
            a.dsn, producer=f"regress-{a.run_id}-c{a.index}", application_name="ringq-regress"
        ) as s:
            # Resume from what the table durably holds: a killed predecessor's (or
            # a lost session's) open dequeue rolled back with its rows.
            if a.config.resilient and not wait_recovered(s, self.abort):
                return True
            self.resume(s)
            if self.ref.grouped and not self.c[self.filled]:
                self.wait_filled(s)
            self.c[self.paused] = 0  # (a killed predecessor may have left it set)
            while not self.abort.is_set():
                if self.take(s):
                    return True
        return True

    def resume(self, s: Session) -> None:
        """Go on from the last order and the count the received table holds."""
        a = self.a
        if self.ref.timed:  # the table holds other consumers' takes too: count our own
            resume = S.q(S.RESUME_GROUPED_CONSUMER, a.run_id, self.table)
            row = s.connection.execute(resume, (a.cycle, a.worker)).fetchone()
        else:
            row = s.connection.execute(
                S.q(S.RESUME_CONSUMER, a.run_id, self.table), (a.cycle,)
            ).fetchone()
        s.commit()
        assert row is not None
        self.order, self.taken = int(row[0]), int(row[1])
        if self.taken:
            self.c[self.base + W.RESUMED] += 1
            self.rng.seed(f"{a.seed}:{self.order}:{self.pid}")
            self.stalls[:] = [n for n in self.stalls if n > self.taken]
        self.c[self.base + W.C_ENTRIES] = self.taken

    def wait_filled(self, s: Session) -> None:
        """The grouped queue's consumers: wait together, once, for a full queue."""
        self.c[self.base + W.C_STALLS] += 1
        self.c[self.paused] = 1
        if _wait_full(
            s,
            self.ref.name,
            self.producers_done,
            self.abort,
            self.max_stall_s,
            others_saw=lambda: bool(self.c[self.filled]),
            grace=STALL_START_GRACE_S,
        ):
            self.c[self.filled] = 1

    def take(self, s: Session) -> bool:
        """Dequeue one batch, record it and commit (or roll back on purpose);
        True once the producers are done and nothing is left to take."""
        c, base, rng = self.c, self.base, self.rng
        finished = self.producers_done.is_set()  # read before the dequeue: no entry can come after
        n = rng.choice((1, 1, 4, 16, 32, 64))
        if self.stalls:
            n = max(1, min(n, self.stalls[0] - self.taken))
        msgs = s.dequeue_many(self.ref.name, n, wait=W.POLL_S)
        deq_ns = time.monotonic_ns()
        c[base + W.HEARTBEAT] += 1
        if not msgs:
            if finished:
                # Nothing left, unless a dead client (or a lost session)
                # still holds an entry that recovery has yet to give back.
                (left,) = s.connection.execute(self.left_sql).fetchone() or (0,)
                s.commit()
                if not left:
                    return True
            return False
        self.record(s, msgs, deq_ns)
        if rng.random() < self.cfg.consumer_rollback_rate and all(
            m.deliveries == 1 for m in msgs
        ):
            # Only first deliveries: an entry is never struck out to the
            # exception queue by our own choice.
            backoff = self.cfg.retry_delay > 0
            rb_at = db_clock(s.connection) if backoff else None
            s.rollback()
            c[base + W.C_RB_TX] += 1
            if rb_at is not None:
                log_retried(s.connection, self.retried_sql, self.a, self.pid, rb_at,
                            [(m.seq, m.deliveries) for m in msgs])
                s.commit()
            return False
        s.commit()
        self.committed(s, msgs)
        return False

    def record(self, s: Session, msgs: list[Message], deq_ns: int) -> None:
        """Write the batch to the received table (in the dequeue's transaction)."""
        seqs, orders, dels, payloads, groups = [], [], [], [], []
        for m in msgs:
            self.order += 1
            seqs.append(m.seq)
            orders.append(self.order)
            dels.append(m.deliveries)
            payloads.append(m.payload)
            groups.append(m.group)
        # The grouped queue's record (and the commit right after it): the
        # entries are held from deq_ns until at least commit_ns.
        s.connection.execute(
            self.stmt,
            {
                "cycle": self.a.cycle,
                "consumer": self.pid,
                "qseqs": seqs,
                "orders": orders,
                "deliveries": dels,
                "payloads": payloads,
                "worker": self.a.worker,
                "groups": groups,
                "deq_ns": deq_ns,
                "commit_ns": time.monotonic_ns(),
            },
        )

    def committed(self, s: Session, msgs: list[Message]) -> None:
        """Count a committed batch; stop for a full queue when a stall is due."""
        c, base = self.c, self.base
        if self.cfg.chaos_failover is not None and not c[base + W.C_FIRST_AFTER]:
            now_us, promoted = int(time.monotonic() * 1e6), c[W.PROMOTED]
            if promoted and now_us >= promoted:
                c[base + W.C_FIRST_AFTER] = now_us
        self.taken += len(msgs)
        c[base + W.C_ENTRIES] += len(msgs)
        c[base + W.C_TX] += 1
        c[base + W.C_REDELIVERED] += sum(1 for m in msgs if m.deliveries > 1)
        if self.steps_aside and self.rng.random() < STEP_ASIDE_RATE:
            self.abort.wait(STEP_ASIDE_S)
        if self.stalls and self.taken >= self.stalls[0]:
            self.stalls.pop(0)
            c[base + W.C_STALLS] += 1
            c[self.paused] = 1  # the queue's SQL consumers stand still too
            try:
                _wait_full(s, self.ref.name, self.producers_done, self.abort, self.max_stall_s)
            finally:
                c[self.paused] = 0


def db_clock(conn: Any) -> datetime:
    """The database's clock now (read inside the transaction about to roll back)."""
    row = conn.execute(S.DB_CLOCK).fetchone()
    assert row is not None
    return cast(datetime, row[0])


def log_retried(
    conn: Any,
    stmt: Any,
    a: WorkerArgs,
    consumer: int,
    rb_at: datetime,
    taken: list[tuple[int, int]],
) -> None:
    """Log a deliberate rollback's entries ((seq, deliveries) each) in ``retried``:
    none may be taken again before ``rb_at`` plus the queue's backoff. (Not
    committed here; a consumer killed before the commit leaves them unlogged,
    which only leaves them unchecked.)"""
    conn.execute(
        stmt,
        {
            "cycle": a.cycle,
            "queue": a.index,
            "qseqs": [seq for seq, _d in taken],
            "deliveries": [d for _s, d in taken],
            "consumer": consumer,
            "rb_at": rb_at,
            "backoff": a.config.retry_delay,
        },
    )


def _wait_full(
    s: Session,
    queue: str,
    producers_done: Any,
    abort: Any,
    max_s: float,
    others_saw: Callable[[], bool] = lambda: False,
    grace: float = 0.0,
) -> bool:
    """Stop dequeuing until a producer finds the queue full, the producers stop
    feeding it (its head has not moved for STALL_IDLE_S), ``max_s`` seconds pass,
    or ``others_saw()`` (another consumer of the queue saw it full). The head
    may stand still ``grace`` seconds more at first (producers starting). True
    if this one saw it full."""
    st = s.stats(queue)
    start, head = st[M.FULL_HITS], st[M.HEAD]
    now = time.monotonic()
    deadline, moved = now + max_s, now + grace
    while (
        now < deadline
        and now - moved < STALL_IDLE_S
        and not producers_done.is_set()
        and not abort.is_set()
        and not others_saw()
    ):
        st = s.stats(queue)
        if st[M.FULL_HITS] > start:
            return True
        if st[M.HEAD] != head:
            head, moved = st[M.HEAD], now
        time.sleep(0.02)
        now = time.monotonic()
    return False
