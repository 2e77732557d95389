"""The SQL consumer process of a regression cycle (``sql_consumers``).

A SQL consumer is what a worker on another host or in another language is: a
plain psycopg connection, no global section, no ringq session. It loops
``SELECT ... FROM ringq.dequeue(queue, n)`` in its own transaction, writes
what it took to the queue's received table in that same transaction (so the
proof's exactly-once and order checks cover it as they cover the linked
consumers), and commits; now and then it rolls back on purpose (the entries
come back, counted as a delivery, after the queue's backoff: logged in
``retried`` as the linked consumer does). When it gets nothing it commits (the
``ringq_want`` NOTIFY that asks the monitor's agent for entries goes out at
commit) and waits for its wake-up (``ringq.dequeue`` LISTENs on the
backend's own ``ringq_ready_<pid>`` while the queue is empty for it) a moment.

It stands still while a linked consumer of its queue does (``C_PAUSED``:
waiting for producers to fill the queue), or the queue would never fill. It
is done when the producers are and ``ringq.depth`` finds nothing left.

Killed by chaos (kill -9, or its backend ended with ``pg_terminate_backend``),
it is started again (or reconnects) and resumes from what its received rows
durably hold; its open take rolled back with the backend, and the agent
counts that delivery before the entries are offered again. Its backend's
``application_name`` is ``ringq-regress-sql-<pid>``, for chaos to find.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import psycopg

from . import _queries as S
from . import _worker as W
from ._consumer import db_clock, log_retried
from ._worker import WorkerArgs, retrying, run_worker

WAIT_S = 0.25  # at most this long for a wake-up after an empty take (one may come late)
PAUSE_S = 0.02  # between looks while the queue's linked consumer stands still
APP_PREFIX = "ringq-regress-sql-"  # + the process's pid: its backend's application_name


def application_name(pid: int) -> str:
    """The ``application_name`` of the SQL consumer process ``pid``'s backend."""
    return f"{APP_PREFIX}{pid}"


def sql_consumer_main(
    args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, errors: Any
) -> None:
    """The SQL consumer process's target (started by the cycle, again after a chaos kill)."""
    run_worker("sql_consumer", _consume, args, counters, producers_done, abort, errors)


def _consume(args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, errors: Any) -> None:
    rng = random.Random(args.seed)
    retrying(
        args,
        counters,
        abort,
        lambda: _SqlConsumer(args, counters, producers_done, abort, rng).session(),
    )


class _SqlConsumer:
    """One connection of a SQL consumer: resume, then take batches until the
    producers are done and the queue is empty."""

    def __init__(
        self, args: WorkerArgs, counters: Any, producers_done: Any, abort: Any,
        rng: random.Random,
    ) -> None:
        self.a = args
        self.c = counters
        self.producers_done = producers_done
        self.abort = abort
        self.rng = rng
        self.ref = ref = args.queues[args.index]
        self.base = args.slot * W.WORDS
        linked = args.config.grouped_consumers if ref.grouped else 1
        # the C_PAUSED words of the queue's linked consumers
        self.paused_words = [
            (args.first_slot + i) * W.WORDS + W.C_PAUSED for i in range(linked)
        ]
        self.record_sql = S.q(S.INSERT_RECEIVED_GROUPED, args.run_id, S.received_table(ref.name))
        self.pid = os.getpid()
        self.retried_sql = S.q(S.INSERT_RETRIED, args.run_id)
        self.order = 0  # the last recv_order recorded

    def session(self) -> bool:
        a = self.a
        with psycopg.connect(
            a.dsn, application_name=application_name(self.pid), connect_timeout=10
        ) as conn:
            self.resume(conn)
            while not self.abort.is_set():
                if self.paused():
                    self.abort.wait(PAUSE_S)
                elif self.take(conn):
                    return True
        return True

    def paused(self) -> bool:
        """The queue's linked consumer stands still for the queue to fill (until
        the producers are done)."""
        return any(self.c[w] for w in self.paused_words) and not self.producers_done.is_set()

    def resume(self, conn: psycopg.Connection[Any]) -> None:
        """Go on from the last order and the count of what this consumer durably took."""
        a = self.a
        row = conn.execute(
            S.q(S.RESUME_GROUPED_CONSUMER, a.run_id, S.received_table(self.ref.name)),
            (a.cycle, a.worker),
        ).fetchone()
        conn.commit()
        assert row is not None
        self.order, taken = int(row[0]), int(row[1])
        if taken:
            self.c[self.base + W.RESUMED] += 1
            self.rng.seed(f"{a.seed}:{self.order}:{self.pid}")
        self.c[self.base + W.C_ENTRIES] = taken

    def take(self, conn: psycopg.Connection[Any]) -> bool:
        """One ringq.dequeue, recorded and committed (or rolled back on purpose);
        True once the producers are done and nothing is left."""
        c, base, rng = self.c, self.base, self.rng
        finished = self.producers_done.is_set()  # read before the dequeue: no entry can come after
        n = rng.choice((1, 1, 4, 16, 32, 64))
        rows = conn.execute(S.SQL_DEQUEUE, (self.ref.name, n)).fetchall()
        deq_ns = time.monotonic_ns()
        c[base + W.HEARTBEAT] += 1
        if not rows:
            conn.commit()  # the waiter row (the ask) at commit; the first waiter wakes the agent
            c[base + W.S_EMPTY] += 1
            if finished:
                (left,) = conn.execute(S.SQL_DEPTH, (self.ref.name,)).fetchone() or (0,)
                conn.commit()
                if not left:
                    return True
            for _ in conn.notifies(timeout=WAIT_S, stop_after=1):
                pass
            return False
        self.record(conn, rows, deq_ns)
        if rng.random() < self.a.config.consumer_rollback_rate and all(r[2] == 1 for r in rows):
            # Only first deliveries, as the linked consumer: never struck out
            # to the exceptions by our own choice.
            rb_at = db_clock(conn) if self.a.config.retry_delay > 0 else None
            conn.rollback()
            c[base + W.C_RB_TX] += 1
            if rb_at is not None:
                log_retried(conn, self.retried_sql, self.a, self.pid, rb_at,
                            [(r[0], r[2]) for r in rows])
                conn.commit()
            return False
        conn.commit()
        c[base + W.C_ENTRIES] += len(rows)
        c[base + W.C_TX] += 1
        c[base + W.C_REDELIVERED] += sum(1 for r in rows if r[2] > 1)
        return False

    def record(self, conn: psycopg.Connection[Any], rows: list[Any], deq_ns: int) -> None:
        """Write the take to the received table, in the dequeue's transaction."""
        orders = list(range(self.order + 1, self.order + 1 + len(rows)))
        self.order += len(rows)
        conn.execute(
            self.record_sql,
            {
                "cycle": self.a.cycle,
                "consumer": self.pid,
                "qseqs": [r[0] for r in rows],
                "orders": orders,
                "deliveries": [r[2] for r in rows],
                "payloads": [bytes(r[1]) for r in rows],
                "worker": self.a.worker,
                "groups": [r[3] for r in rows],
                "deq_ns": deq_ns,
                "commit_ns": time.monotonic_ns(),
            },
        )
