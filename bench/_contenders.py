"""The contenders of ``bench_engine.py`` behind one driver, and the one loop that times them.

A :class:`Driver` is one contender's producer and consumer connections and the
six things the benchmark does with them: an enqueue call and its commit, a
dequeue call and its commit, a batched enqueue transaction and a batched
dequeue transaction. Three drivers:

- :func:`ringq_driver`: two ringq sessions on a queue;
- :func:`skq_driver`: the textbook SKIP LOCKED table (``INSERT`` / ``DELETE ...
  FOR UPDATE SKIP LOCKED``) on two default psycopg connections;
- :func:`ring_sql_driver`: the engine's own statements (``engine/queries.sql``)
  sent straight through psycopg on a queue table the engine never loads, with
  the engine's protocol (an enqueue is its guarded row write alone, in
  autocommit: one round trip; a dequeue is BEGIN + the consuming UPDATE in one
  pipeline, then COMMIT: two). What ringq would cost with a free section and
  no Python around the SQL: a dequeue's engine time = ringq - this.

:func:`measure` times a driver (call latencies, single-entry transactions/s,
batched entries/s each way); :func:`pass_through` moves entries through one,
untimed or for the volume test.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

import numpy as np
import psycopg
from psycopg import sql
from ringq.engine import Session, connect, queue_table
from ringq.engine.sqlfile import load

# the engine's own statements, for the SQL-only baseline
ENGINE_SQL = load("ringq.engine", "queries.sql")

# -- the SQL of the comparison queues (tables only via sql.Identifier) ---------------------------

SKQ_CREATE = (
    "CREATE TABLE {t} (id bigserial PRIMARY KEY, payload bytea, enq_at timestamptz DEFAULT now())"
)
SKQ_ENQUEUE = "INSERT INTO {t} (payload) VALUES (%s)"
SKQ_DEQUEUE = (
    "DELETE FROM {t} WHERE id = (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1) "
    "RETURNING payload"
)
SKQ_ENQUEUE_MANY = "INSERT INTO {t} (payload) SELECT unnest(%s::bytea[])"
SKQ_DEQUEUE_MANY = (
    "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED LIMIT %s) "
    "RETURNING payload"
)


def q(template: str, table: str) -> sql.Composed:
    """``template`` with its ``{t}`` filled by the quoted ``table``."""
    return sql.SQL(template).format(t=sql.Identifier(table))


def latency_summary(samples_ns: list[int]) -> dict[str, float]:
    """p50/p90/p99/max/mean of call latencies, in microseconds."""
    a = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    if a.size == 0:
        return {"n": 0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "n": int(a.size),
        "p50_us": float(p50),
        "p90_us": float(p90),
        "p99_us": float(p99),
        "max_us": float(a.max()),
        "mean_us": float(a.mean()),
    }


class Driver(Protocol):
    """One contender: its producer's and its consumer's connection, one payload."""

    label: str  # named in a failure

    def enqueue(self) -> bool:
        """The enqueue call whose latency is timed (one entry); True."""

    def enqueue_commit(self) -> None:
        """End the enqueue's transaction."""

    def dequeue(self) -> bool:
        """The dequeue call whose latency is timed; False when nothing was there."""

    def dequeue_commit(self) -> None:
        """End the dequeue's transaction."""

    def enqueue_batch(self, n: int) -> None:
        """``n`` entries in one transaction, committed."""

    def dequeue_batch(self, n: int) -> int:
        """Up to ``n`` entries in one transaction, committed; how many."""


def measure(d: Driver, n_single: int, n_batches: int, batch: int) -> dict[str, Any]:
    """Call latency each way, single-entry tx/s each way, batched entries/s each way,
    after 10 single-entry transactions each way to warm up (caches filled, statements
    prepared)."""
    for _ in range(10):
        d.enqueue()
        d.enqueue_commit()
    for _ in range(10):
        if not d.dequeue():
            raise RuntimeError(f"{d.label}: nothing to dequeue in the warm-up")
        d.dequeue_commit()

    pc = time.perf_counter_ns
    out: dict[str, Any] = {}
    sides: tuple[tuple[str, Callable[[], bool], Callable[[], None]], ...] = (
        ("enqueue", d.enqueue, d.enqueue_commit),
        ("dequeue", d.dequeue, d.dequeue_commit),
    )
    for kind, call, commit in sides:
        lat: list[int] = []
        start = pc()
        for _ in range(n_single):
            t0 = pc()
            got = call()
            lat.append(pc() - t0)
            commit()
            if not got:
                raise RuntimeError(f"{d.label}: ran dry after {len(lat)} {kind}s")
        out[f"{kind}_tx_per_s"] = n_single / ((pc() - start) / 1e9)
        out[f"{kind}_latency"] = latency_summary(lat)

    start = pc()
    for _ in range(n_batches):
        d.enqueue_batch(batch)
    out["enqueue_many_entries_per_s"] = n_batches * batch / ((pc() - start) / 1e9)
    taken = 0
    start = pc()
    for _ in range(n_batches):
        taken += d.dequeue_batch(batch)
    out["dequeue_many_entries_per_s"] = n_batches * batch / ((pc() - start) / 1e9)
    if taken != n_batches * batch:
        raise RuntimeError(f"{d.label}: dequeued {taken} of {n_batches * batch} batched entries")
    return out


def pass_through(d: Driver, entries: int, batch: int) -> None:
    """``entries`` (rounded up to whole batches) enqueued and dequeued, ``batch`` per
    transaction, untimed."""
    for _ in range(-(-entries // batch)):
        d.enqueue_batch(batch)
        d.dequeue_batch(batch)


PgConnection: TypeAlias = psycopg.Connection[Any]
Conn = TypeVar("Conn", Session, PgConnection)


class _Batches(Generic[Conn]):
    """A driver's two connections (``prod`` enqueues, ``cons`` dequeues) and its
    list of ``n`` payloads, made again only when ``n`` changes."""

    def __init__(self, prod: Conn, cons: Conn, payload: bytes) -> None:
        self.prod: Conn = prod
        self.cons: Conn = cons
        self.payload = payload
        self.items: list[bytes] = []

    def of(self, n: int) -> list[bytes]:
        if len(self.items) != n:
            self.items = [self.payload] * n
        return self.items


# -- ringq ----------------------------------------------------------------------------------------


class RingqDriver(_Batches[Session]):
    def __init__(self, prod: Session, cons: Session, queue: str, payload: bytes) -> None:
        super().__init__(prod, cons, payload)
        self.queue = queue
        self.label = f"ringq queue {queue}"

    def enqueue(self) -> bool:
        self.prod.enqueue(self.queue, self.payload)
        return True

    def enqueue_commit(self) -> None:
        self.prod.commit()

    def dequeue(self) -> bool:
        return self.cons.dequeue(self.queue) is not None

    def dequeue_commit(self) -> None:
        self.cons.commit()

    def enqueue_batch(self, n: int) -> None:
        self.prod.enqueue_many(self.queue, self.of(n))
        self.prod.commit()

    def dequeue_batch(self, n: int) -> int:
        got = len(self.cons.dequeue_many(self.queue, n))
        self.cons.commit()
        return got


@contextlib.contextmanager
def ringq_driver(dsn: str, queue: str, payload: bytes) -> Iterator[RingqDriver]:
    with connect(dsn) as prod, connect(dsn) as cons:
        yield RingqDriver(prod, cons, queue, payload)


# -- SKIP LOCKED textbook queue -------------------------------------------------------------------


class SkqDriver(_Batches[PgConnection]):
    def __init__(self, prod: PgConnection, cons: PgConnection, table: str, payload: bytes) -> None:
        super().__init__(prod, cons, payload)
        self.label = f"skip-locked table {table}"
        self.enq_sql, self.deq_sql = q(SKQ_ENQUEUE, table), q(SKQ_DEQUEUE, table)
        self.enq_many_sql = q(SKQ_ENQUEUE_MANY, table)
        self.deq_many_sql = q(SKQ_DEQUEUE_MANY, table)

    def enqueue(self) -> bool:
        self.prod.execute(self.enq_sql, (self.payload,))
        return True

    def enqueue_commit(self) -> None:
        self.prod.commit()

    def dequeue(self) -> bool:
        return self.cons.execute(self.deq_sql).fetchone() is not None

    def dequeue_commit(self) -> None:
        self.cons.commit()

    def enqueue_batch(self, n: int) -> None:
        self.prod.execute(self.enq_many_sql, (self.of(n),))
        self.prod.commit()

    def dequeue_batch(self, n: int) -> int:
        got = len(self.cons.execute(self.deq_many_sql, (n,)).fetchall())
        self.cons.commit()
        return got


@contextlib.contextmanager
def skq_driver(dsn: str, table: str, payload: bytes) -> Iterator[SkqDriver]:
    """On default psycopg connections: each transaction is BEGIN, the statement, COMMIT."""
    with psycopg.connect(dsn) as prod, psycopg.connect(dsn) as cons:
        yield SkqDriver(prod, cons, table, payload)


# -- ringq's SQL alone ----------------------------------------------------------------------------


class RingSQL:
    """Where the SQL-only baseline's queue stands; kept across rounds (its table keeps its rows)."""

    def __init__(self, queue: str, capacity: int) -> None:
        self.queue, self.capacity = queue, capacity
        self.next_seq = 0  # next sequence to enqueue (the table's rows start at seq -1)
        self.next_deq = 0  # oldest sequence not yet dequeued

    def stmt(self, name: str) -> str:
        return (
            sql.SQL(ENGINE_SQL[name])
            .format(table=queue_table(self.queue), queue=sql.Literal(self.queue))
            .as_string(None)
        )


def _begin_with(conn: PgConnection, query: str, params: Any) -> psycopg.Cursor[Any]:
    """BEGIN and ``query`` in one round trip (``conn`` is in autocommit), as a session's dequeue."""
    cur = conn.cursor()
    with conn.pipeline():
        conn.execute("BEGIN", prepare=False)
        cur.execute(query, params, binary=True)
    return cur


class RingSQLDriver(_Batches[PgConnection]):
    def __init__(self, prod: PgConnection, cons: PgConnection, st: RingSQL, payload: bytes) -> None:
        super().__init__(prod, cons, payload)
        self.st = st
        self.label = f"ringq SQL baseline on {st.queue}"
        self.enq_sql, self.deq_sql = st.stmt("enqueue"), st.stmt("dequeue")
        self.enq_many_sql, self.deq_many_sql = st.stmt("enqueue_many"), st.stmt("dequeue_many")

    def enqueue(self) -> bool:
        s, cap = self.st.next_seq, self.st.capacity
        # committed by itself (autocommit); raises if the guard fails; no group
        # no group, no trace context (as the engine's untraced enqueue)
        self.prod.execute(self.enq_sql, (s, self.payload, "bench", s, None, None, s % cap, s))
        self.st.next_seq += 1
        return True

    def enqueue_commit(self) -> None:
        pass  # the enqueue committed by itself

    def dequeue(self) -> bool:
        s = self.st.next_deq
        if _begin_with(self.cons, self.deq_sql, (s % self.st.capacity, s)).fetchone() is None:
            raise RuntimeError(f"{self.label}: dequeue of seq {s} matched no row")
        self.st.next_deq += 1
        return True

    def dequeue_commit(self) -> None:
        self.cons.execute("COMMIT")

    def enqueue_batch(self, n: int) -> None:
        seqs = list(range(self.st.next_seq, self.st.next_seq + n))
        slots = [x % self.st.capacity for x in seqs]
        self.prod.execute(
            self.enq_many_sql,
            (None, slots, seqs, self.of(n), ["bench"] * n, seqs, [None] * n, n),  # trace: none
        )
        self.st.next_seq += n  # committed by itself (autocommit); a guard that fails raises

    def dequeue_batch(self, n: int) -> int:
        seqs = list(range(self.st.next_deq, self.st.next_deq + n))
        slots = [x % self.st.capacity for x in seqs]
        rows = _begin_with(self.cons, self.deq_many_sql, (slots, seqs)).fetchall()
        if len(rows) != n:
            raise RuntimeError(f"{self.label}: a batched dequeue matched fewer rows")
        self.st.next_deq += n
        self.cons.execute("COMMIT")
        return n


@contextlib.contextmanager
def ring_sql_driver(dsn: str, st: RingSQL, payload: bytes) -> Iterator[RingSQLDriver]:
    with (
        psycopg.connect(dsn, autocommit=True) as prod,
        psycopg.connect(dsn, autocommit=True) as cons,
    ):
        yield RingSQLDriver(prod, cons, st, payload)
