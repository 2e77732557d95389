"""The producers and consumers of ``bench_hosts.py``, by kind, and the prototypes it can measure.

A row of the benchmark is a producer kind and a consumer kind (:data:`ROWS`);
:class:`Side` opens one of each. The kinds of today's code:

- ``linked``: a ringq session (``enqueue_many`` + ``commit``;
  ``dequeue_many(n, wait=)``, the log INSERT through ``Session.execute``,
  ``commit``);
- ``sql``: ``SELECT ringq.enqueue_many(q, %b::bytea[])`` (one statement per
  batch, the array sent in binary: psycopg's text dumping of a bytea list cost
  the bench's process 8.4 us an entry, measured, beside 0.3 in binary, and
  took the GIL from the consumers of the same process) in autocommit; a
  default psycopg connection taking ``SELECT seq, payload FROM
  ringq.dequeue(q, n)``, the INSERT, ``COMMIT``, and waiting for a
  notification when it found nothing (the take LISTENs for it);
- ``pgmq``: a visibility-timeout table as pgmq makes it (send_batch, read
  with a visibility timeout in its own transaction, then delete + the INSERT).

The prototypes (rows ``p_*``, SQL only: scratch tables and functions named
after the run, made in the bench's database and dropped with it; nothing of
ringq's schema, engine or monitor changes), each a candidate of issue 34's
design measured against the rows above in the same run:

- ``sqlb`` (**batch SQL enqueue**): one statement per batch,
  ``enqueue_batch(q, bytea[])``: one queue lookup, one ``INSERT ... SELECT
  unnest``, one NOTIFY, into today's inbox (the pump unchanged);
- ``chunk`` consumers (**SQL consumers take whole chunks**): the entries
  takeable by SQL consumers are listed as chunks of up to ``CHUNK`` entries
  (one row: queue, seq, slot, n); a take deletes the oldest unlocked chunk
  rows (``FOR UPDATE SKIP LOCKED``) and consumes their ring rows by one
  primary-key range each, in the caller's transaction: consumed iff it
  commits, and a chunk that is gone is a chunk consumed, so the agent
  learns what was taken from the listing alone (here :class:`ProtoAgent`
  reads it and verifies the gone chunks' rows, as the agent would). No
  taker scans rows another holds or took. A take that finds nothing
  registers its backend as a waiter (a row) and LISTENs on a channel of its
  own, only while it waits (PostgreSQL makes every listening backend of the
  database read the notification queue, in a transaction, at every
  notifying commit, whatever the channel); whoever lists chunks wakes as
  many waiters as chunks, and the agent's pass sweeps waiters a listing
  missed. No NOTIFY to ask: the waiter's row is the ask;
- ``linked_chunks`` producer: a linked producer that lists its batch's
  chunks in its own transaction (standing in for the agent listing
  committed entries for SQL consumers);
- ``sqlr`` producer (**SQL producers write ring slots reserved in bulk**):
  :class:`ProtoAgent` keeps chunks of free slots listed ahead for SQL
  producers; ``put(bytea[])`` takes as many as it needs (``FOR UPDATE SKIP
  LOCKED``, oldest first, each used once: what it does not fill is void),
  writes the payloads into their ring rows (guarded as the engine's
  ``enqueue_many``: not queued, an older seq) and lists them as takeable
  chunks, one statement, one transaction. No chunk free: SQLSTATE ``RQ002``
  (full), retried by the bench after 1 ms.

The prototypes' queues are never finished in the global section (no agent
of today's code knows their listings), so they get ``--proto-capacity``
slots: enough that no row wraps. A linked session's ``stats()`` of them is
meaningless; ``ringq.depth`` (the rows) is right.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from psycopg import sql
from ringq.engine import Session, connect

# row -> (producer kind, consumer kind)
ROWS: dict[str, tuple[str, str]] = {
    "linked": ("linked", "linked"),
    "sql": ("sql", "sql"),
    "linked_sql": ("linked", "sql"),
    "sql_linked": ("sql", "linked"),
    "pgmq": ("pgmq", "pgmq"),
    "p_sqlb_linked": ("sqlb", "linked"),
    "p_linked_chunk": ("linked_chunks", "chunk"),
    "p_sqlr_chunk": ("sqlr", "chunk"),
}
BASELINE = ("linked", "sql", "linked_sql", "sql_linked", "pgmq")
PROTOTYPES = ("p_sqlb_linked", "p_linked_chunk", "p_sqlr_chunk")
LABELS = {
    "linked": "linked producer + linked consumers",
    "sql": "SQL producer + SQL consumers",
    "linked_sql": "linked producer + SQL consumers",
    "sql_linked": "SQL producer + linked consumers",
    "pgmq": "pgmq-style (visibility timeout)",
    "p_sqlb_linked": "proto: batch SQL enqueue + linked",
    "p_linked_chunk": "proto: linked + SQL chunk takers",
    "p_sqlr_chunk": "proto: SQL into slots + chunk takers",
}
HEADER = struct.Struct("<qq")  # enqueue time (monotonic ns), entry id
CHUNK = 64  # entries per chunk of the prototypes

SQL_ENQUEUE = "SELECT ringq.enqueue_many(%s, %b::bytea[])"  # %b: the array sent binary
SQL_DEQUEUE = "SELECT seq, payload FROM ringq.dequeue(%s, %s)"
PGMQ_CREATE = (
    "CREATE TABLE {t} (msg_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " read_ct integer NOT NULL DEFAULT 0, enqueued_at timestamptz NOT NULL DEFAULT now(),"
    " vt timestamptz NOT NULL DEFAULT clock_timestamp(), message bytea)"
)
PGMQ_INDEX = "CREATE INDEX ON {t} (vt)"
PGMQ_SEND = "INSERT INTO {t} (message) SELECT unnest(%b::bytea[])"
PGMQ_READ = (
    "WITH c AS (SELECT msg_id FROM {t} WHERE vt <= clock_timestamp() ORDER BY msg_id"
    " LIMIT %s FOR UPDATE SKIP LOCKED)"
    " UPDATE {t} m SET vt = clock_timestamp() + make_interval(secs => %s),"
    " read_ct = m.read_ct + 1 FROM c WHERE m.msg_id = c.msg_id RETURNING m.msg_id, m.message"
)
PGMQ_DELETE = "DELETE FROM {t} WHERE msg_id = ANY(%s::bigint[])"
PGMQ_COUNT = "SELECT count(*) FROM {t}"
DONE_CREATE = "CREATE TABLE {t} (kind text, consumer int, id bigint)"
DONE_INSERT = "INSERT INTO {t} SELECT %s, %s, unnest(%s::bigint[])"

# -- the prototypes' SQL ({names} through psycopg.sql only) ---------------------------------------

PROTO_TABLES = (
    "CREATE TABLE {chunks} (queue_id integer, seq bigint, slot integer, n integer,"
    " PRIMARY KEY (queue_id, seq))",
    "CREATE TABLE {free} (queue_id integer, seq bigint, slot integer, n integer,"
    " PRIMARY KEY (queue_id, seq))",
    "CREATE TABLE {waiters} (queue_id integer, pid integer, PRIMARY KEY (queue_id, pid))",
)
# One statement per batch into today's inbox (ringq.enqueue's checks, once).
PROTO_ENQUEUE_BATCH = """
CREATE FUNCTION {fn}(queue text, payloads bytea[]) RETURNS bigint LANGUAGE plpgsql AS $f$
DECLARE
    q ringq.queues;
    n bigint;
BEGIN
    q := ringq.queue_of(queue);
    IF array_position(payloads, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'ringq: payload must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF (SELECT max(octet_length(p)) FROM unnest(payloads) p) > q.max_payload THEN
        RAISE EXCEPTION 'ringq: payload exceeds max_payload'
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    INSERT INTO ringq.inbox (queue_id, payload)
    SELECT q.id, u.p FROM unnest(payloads) WITH ORDINALITY AS u(p, i) ORDER BY u.i;
    GET DIAGNOSTICS n = ROW_COUNT;
    PERFORM pg_notify('ringq_inbox', queue);
    RETURN n;
END
$f$
"""
# A SQL consumer's take of whole chunks (its caller's transaction decides).
PROTO_TAKE = """
CREATE FUNCTION {fn}(max_n integer) RETURNS TABLE (seq bigint, payload bytea)
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $f$
#variable_conflict use_column
DECLARE
    got bigint;
    want bigint;
    seqs bigint[];
    slots integer[];
    ns integer[];
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('ringq.dequeue'), {qid});
    WITH c AS (
        DELETE FROM {chunks} k
        WHERE (k.queue_id, k.seq) IN (
            SELECT k2.queue_id, k2.seq FROM {chunks} k2
            WHERE k2.queue_id = {qid} AND k2.xmax = '0'::xid
            ORDER BY k2.seq LIMIT greatest(1, max_n / {chunk})
            FOR UPDATE SKIP LOCKED)
        RETURNING k.seq, k.slot, k.n
    )
    SELECT array_agg(c.seq), array_agg(c.slot), array_agg(c.n), coalesce(sum(c.n), 0)
    INTO seqs, slots, ns, want FROM c;
    RETURN QUERY
    WITH u AS (
        UPDATE {ring} r SET state = 2, deq_at = clock_timestamp(), deq_user = current_user
        FROM unnest(seqs, slots, ns) AS c(seq, slot, n)
        WHERE r.slot >= c.slot AND r.slot < c.slot + c.n AND r.seq = c.seq + (r.slot - c.slot)
          AND r.state = 1
        RETURNING r.seq, r.payload
    )
    SELECT u.seq, u.payload FROM u ORDER BY 1;
    GET DIAGNOSTICS got = ROW_COUNT;
    -- a chunk is unlisted only with all its entries consumed (else RQ001:
    -- nothing of the transaction commits), as the engine's guarded writes
    PERFORM ringq.expect_rows(got::integer, want::integer, {qname});
    IF got = 0 THEN
        -- Wait to be woken on a channel of this backend's own, by whoever
        -- lists a chunk: one consumer woken per chunk, not all of them; and
        -- listen only while waiting: PostgreSQL signals every listening
        -- backend of the database at every notifying commit, whatever the
        -- channel (each reads the queue in a transaction of its own).
        INSERT INTO {waiters} VALUES ({qid}, pg_backend_pid()) ON CONFLICT DO NOTHING;
        EXECUTE format('LISTEN %I', {ready} || '_' || pg_backend_pid());
        -- no NOTIFY to ask: the waiter's row is the ask, read by the agent
    ELSIF EXISTS (SELECT FROM pg_listening_channels()) THEN
        EXECUTE format('UNLISTEN %I', {ready} || '_' || pg_backend_pid());
    END IF;
END
$f$
"""
# Chunks listed (by the linked producer standing in for the agent, or by a
# SQL producer's put) wake as many waiting consumers as there are chunks.
PROTO_WAKE = """
    FOR w IN
        WITH d AS (DELETE FROM {waiters} x WHERE (x.queue_id, x.pid) IN (
                       SELECT y.queue_id, y.pid FROM {waiters} y WHERE y.queue_id = {qid}
                       LIMIT {n} FOR UPDATE SKIP LOCKED)
                   RETURNING x.pid)
        SELECT d.pid FROM d
    LOOP
        PERFORM pg_notify({ready} || '_' || w.pid, '');
    END LOOP;
"""
# The agent's sweep: waiters woken for the chunks listed that none takes now
# (a waiter that registered just after a listing's look at the waiters).
PROTO_SWEEP_FN = """
CREATE FUNCTION {fn}() RETURNS void LANGUAGE plpgsql AS $f$
DECLARE
    w record;
BEGIN
    {wake}
END
$f$
"""
PROTO_LIST_FN = """
CREATE FUNCTION {fn}(seqs bigint[], slots integer[], ns integer[]) RETURNS void
LANGUAGE plpgsql AS $f$
DECLARE
    w record;
BEGIN
    INSERT INTO {chunks} (queue_id, seq, slot, n)
    SELECT {qid}, s.seq, s.slot, s.n FROM unnest(seqs, slots, ns) AS s(seq, slot, n);
    {wake}
END
$f$
"""
# A SQL producer's batch written into ring slots reserved for SQL producers.
PROTO_PUT = """
CREATE FUNCTION {fn}(payloads bytea[]) RETURNS integer
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $f$
DECLARE
    f record;
    total integer := coalesce(cardinality(payloads), 0);
    done integer := 0;
    k integer;
    got integer;
    listed integer := 0;
    w record;
BEGIN
    IF array_position(payloads, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'ringq: payload must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF (SELECT max(octet_length(p)) FROM unnest(payloads) p) > {max_payload} THEN
        RAISE EXCEPTION 'ringq: payload exceeds max_payload'
            USING ERRCODE = 'string_data_right_truncation';
    END IF;
    FOR f IN
        WITH d AS (
            DELETE FROM {free} x
            WHERE (x.queue_id, x.seq) IN (
                SELECT y.queue_id, y.seq FROM {free} y
                WHERE y.queue_id = {qid} AND y.xmax = '0'::xid
                ORDER BY y.seq LIMIT (total + {chunk} - 1) / {chunk}
                FOR UPDATE SKIP LOCKED)
            RETURNING x.seq, x.slot, x.n)
        SELECT d.seq, d.slot, d.n FROM d ORDER BY d.seq
    LOOP
        k := least(f.n, total - done);
        EXIT WHEN k <= 0;  -- what is left of the chunks taken is void
        UPDATE {ring} r
        SET state = 1, seq = f.seq + (r.slot - f.slot),
            payload = payloads[done + 1 + (r.slot - f.slot)],
            producer = 'sql:' || current_user, producer_seq = f.seq + (r.slot - f.slot),
            msg_group = NULL, deliveries = 0, not_before = NULL, enq_at = now(),
            enq_user = current_user, deq_at = NULL, deq_user = NULL
        WHERE r.slot >= f.slot AND r.slot < f.slot + k AND r.state <> 1
          AND r.seq < f.seq + (r.slot - f.slot);
        GET DIAGNOSTICS got = ROW_COUNT;
        IF got <> k THEN
            RAISE EXCEPTION 'ringq: reserved slots no longer free' USING ERRCODE = 'RQ001';
        END IF;
        INSERT INTO {chunks} (queue_id, seq, slot, n) VALUES ({qid}, f.seq, f.slot, k);
        done := done + k;
        listed := listed + 1;
    END LOOP;
    IF done < total THEN
        RAISE EXCEPTION 'ringq: queue full for SQL producers' USING ERRCODE = 'RQ002';
    END IF;
    {wake}
    RETURN done;
END
$f$
"""
PROTO_LIST = (
    "INSERT INTO {chunks} (queue_id, seq, slot, n)"
    " SELECT %s, s.seq, s.slot, s.n FROM unnest(%s::bigint[], %s::integer[], %s::integer[])"
    " AS s(seq, slot, n)"
)
PROTO_LIST_CALL = "SELECT {fn}(%s::bigint[], %s::integer[], %s::integer[])"
PROTO_LISTED = "SELECT seq, slot, n FROM {chunks} WHERE queue_id = %s"
PROTO_FREE_COUNT = "SELECT count(*) FROM {free} WHERE queue_id = %s"
PROTO_VERIFY = (
    "SELECT count(*) FROM {ring} r JOIN unnest(%s::bigint[], %s::integer[], %s::integer[])"
    " AS c(seq, slot, n) ON r.slot >= c.slot AND r.slot < c.slot + c.n"
    " AND r.seq = c.seq + (r.slot - c.slot) WHERE r.state = 2"
)


def q(template: str, table: str) -> sql.Composed:
    return sql.SQL(template).format(t=sql.Identifier(table))


@dataclass(frozen=True)
class Config:
    rows: tuple[str, ...]
    duration: float
    rounds: int
    consumers: int
    take_linked: int
    take_sql: int
    take_pgmq: int
    produce_batch: int
    ready: int
    capacity: int
    proto_capacity: int
    max_payload: int
    payload: int
    work_ms: float
    wait: float
    poll_ms: float
    vt: float
    warm: int
    settle: float
    sample_s: float
    drain_s: float
    statements: bool
    statement_timeout: float
    pace: str
    agent_ms: float
    sql_reserve_slots: bool = True
    rate: float = 0.0  # entries/s the producer puts at most (0: as fast as --ready lets it)


@dataclass(frozen=True)
class Names:
    """The objects one run creates (unique, so ``--dsn`` never touches anyone else's)."""

    tag: str

    def queue(self, row: str) -> str:
        return f"bh_{self.tag}_{row}"

    def fn(self, what: str, row: str = "") -> sql.Identifier:
        return sql.Identifier(f"bh_{self.tag}_{what}{'_' + row if row else ''}")

    @property
    def pgmq(self) -> str:
        return f"bh_{self.tag}_pgmq_t"

    @property
    def done(self) -> str:
        return f"bh_{self.tag}_done"

    @property
    def chunks(self) -> str:
        return f"bh_{self.tag}_chunks"

    @property
    def free(self) -> str:
        return f"bh_{self.tag}_free"

    def channel(self, what: str) -> str:
        return f"bh_{self.tag}_{what}"

    @property
    def waiters(self) -> str:
        return f"bh_{self.tag}_waiters"

    def tables(self) -> list[str]:
        return [self.pgmq, self.done, self.chunks, self.free, self.waiters]


def runs_of(seqs: list[int], capacity: int, chunk: int = CHUNK) -> list[tuple[int, int, int]]:
    """``seqs`` as chunks (seq, slot, n): consecutive seqs at consecutive slots,
    at most ``chunk`` each, never across the ring's last slot."""
    out: list[tuple[int, int, int]] = []
    for s in sorted(seqs):
        if out:
            seq0, slot0, n = out[-1]
            if s == seq0 + n and n < chunk and (slot0 + n) < capacity:
                out[-1] = (seq0, slot0, n + 1)
                continue
        out.append((s, s % capacity, 1))
    return out


def make_protos(conn: psycopg.Connection[Any], names: Names, cfg: Config,
                rows: dict[str, tuple[int, str]]) -> None:
    """The prototypes' tables and functions; ``rows``: proto row -> (queue id, queue)."""
    for stmt in PROTO_TABLES:
        conn.execute(sql.SQL(stmt).format(chunks=sql.Identifier(names.chunks),
                                          free=sql.Identifier(names.free),
                                          waiters=sql.Identifier(names.waiters)))
    conn.execute(sql.SQL(PROTO_ENQUEUE_BATCH).format(fn=names.fn("enqueue_batch")))
    for row, (qid, queue) in rows.items():
        common = {
            "chunks": sql.Identifier(names.chunks), "free": sql.Identifier(names.free),
            "ring": sql.Identifier("ringq", f"q_{queue}"), "qid": sql.Literal(qid),
            "chunk": sql.Literal(CHUNK), "max_payload": sql.Literal(cfg.max_payload),
            "qname": sql.Literal(queue),
            "waiters": sql.Identifier(names.waiters),
        }  # fmt: skip
        ready = sql.Literal(names.channel("ready"))
        conn.execute(sql.SQL(PROTO_TAKE).format(fn=names.fn("take", row), ready=ready,
                                                **common))
        idle = sql.SQL("(SELECT count(*) FROM {chunks} c WHERE c.queue_id = {qid}"
                       " AND c.xmax = '0'::xid)").format(**common)
        conn.execute(sql.SQL(PROTO_SWEEP_FN).format(fn=names.fn("sweep", row), wake=sql.SQL(
            PROTO_WAKE).format(ready=ready, n=idle, **common)))
        conn.execute(sql.SQL(PROTO_PUT).format(fn=names.fn("put", row), wake=sql.SQL(
            PROTO_WAKE).format(ready=ready, n=sql.SQL("listed"), **common), **common))
        conn.execute(sql.SQL(PROTO_LIST_FN).format(fn=names.fn("list", row), wake=sql.SQL(
            PROTO_WAKE).format(ready=ready, n=sql.SQL("cardinality(seqs)"), **common), **common))


def drop_protos(dsn: str, names: Names, rows: list[str]) -> None:
    """The prototypes' functions dropped (their tables go with the run's)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}(text, bytea[])").format(
            names.fn("enqueue_batch")))
        for row in rows:
            conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}(integer)").format(
                names.fn("take", row)))
            conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}(bytea[])").format(
                names.fn("put", row)))
            conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}(bigint[], integer[], integer[])")
                         .format(names.fn("list", row)))
            conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}()").format(names.fn("sweep", row)))


# -- the producers and consumers, by kind -------------------------------------------------------


class Producer(Protocol):
    def put(self, payloads: list[bytes]) -> None:
        """Enqueue ``payloads`` and commit."""


class Consumer(Protocol):
    retries: int

    def take(self, n: int, wait: float) -> list[bytes]:
        """Up to ``n`` payloads in an open transaction; [] (nothing open) after
        waiting at most ``wait`` s (0: not at all) when there were none."""

    def finish(self, row: str, who: int, ids: list[int]) -> None:
        """Record ``ids`` as done in the open transaction, and commit."""


class _LinkedProducer:
    def __init__(self, s: Session, queue: str, list_chunks: sql.Composed | None = None,
                 capacity: int = 0) -> None:
        self.s, self.queue, self.capacity = s, queue, capacity
        self.list_chunks = None if list_chunks is None else list_chunks.as_string(s.connection)

    def put(self, payloads: list[bytes]) -> None:
        seqs = self.s.enqueue_many(self.queue, payloads)
        if self.list_chunks is not None:  # prototype: listed for chunk takers, same transaction
            runs = runs_of(seqs, self.capacity)
            self.s.execute(self.list_chunks, ([r[0] for r in runs], [r[1] for r in runs],
                                              [r[2] for r in runs]))
        self.s.commit()


class _LinkedConsumer:
    def __init__(self, s: Session, queue: str, done: str) -> None:
        self.s, self.queue, self.retries = s, queue, 0
        self.done = q(DONE_INSERT, done).as_string(s.connection)  # a str, for Session.execute

    def take(self, n: int, wait: float) -> list[bytes]:
        got = self.s.dequeue_many(self.queue, n, wait=wait)  # sleeps on the wake-up
        if not got:
            self.s.commit()
        return [m.payload for m in got]

    def finish(self, row: str, who: int, ids: list[int]) -> None:
        self.s.execute(self.done, (row, who, ids), prepare=True)
        self.s.commit()


class _SqlProducer:
    """``stmt`` with (queue, payloads) or (payloads,), in autocommit: one
    statement, one transaction. ``RQ002`` (a prototype's full queue): 1 ms, again."""

    def __init__(self, conn: psycopg.Connection[Any], stmt: Any, args: tuple[Any, ...]) -> None:
        self.conn, self.stmt, self.args = conn, stmt, args
        self.full = 0

    def put(self, payloads: list[bytes]) -> None:
        while True:
            try:
                self.conn.execute(self.stmt, (*self.args, payloads))
                return
            except psycopg.Error as exc:
                if exc.sqlstate != "RQ002":
                    raise
                self.full += 1
                time.sleep(0.001)


class _SqlConsumer:
    """As a client on another host writes it: a default psycopg connection
    (BEGIN, the take, the INSERT, COMMIT), LISTEN for an empty queue."""

    def __init__(self, conn: psycopg.Connection[Any], take: Any, first: tuple[Any, ...],
                 listen: sql.SQL | sql.Composed | None, done: str) -> None:
        self.conn, self.take_sql, self.first, self.done = conn, take, first, q(DONE_INSERT, done)
        self.retries = 0  # takes refused by a guard (RQ001: a stale listing)
        if listen is not None:
            conn.execute(listen)
            conn.commit()

    def take(self, n: int, wait: float) -> list[bytes]:
        try:
            rows = self.conn.execute(self.take_sql, (*self.first, n)).fetchall()
        except psycopg.Error as exc:
            if exc.sqlstate != "RQ001":
                raise
            self.conn.rollback()  # a stale listing: nothing taken, take again
            self.retries += 1
            return []
        if rows:
            return [bytes(r[1]) for r in rows]
        self.conn.commit()  # sends the ask (NOTIFY); never wait in a transaction
        if wait > 0:
            for _n in self.conn.notifies(timeout=wait, stop_after=1):
                pass
        return []

    def finish(self, row: str, who: int, ids: list[int]) -> None:
        self.conn.execute(self.done, (row, who, ids))
        self.conn.commit()


class PgmqConsumer:
    """read (its own transaction: the visibility timeout holds the entries),
    then DELETE + the INSERT in one transaction; polls when it found nothing."""

    def __init__(self, conn: psycopg.Connection[Any], table: str, done: str, cfg: Config) -> None:
        self.conn, self.vt, self.poll, self.retries = conn, cfg.vt, cfg.poll_ms / 1000, 0
        self.read, self.delete = q(PGMQ_READ, table), q(PGMQ_DELETE, table)
        self.done = q(DONE_INSERT, done)
        self.msg_ids: list[int] = []

    def take(self, n: int, wait: float) -> list[bytes]:
        rows = self.conn.execute(self.read, (n, self.vt)).fetchall()
        self.conn.commit()
        if not rows:
            if wait > 0:
                time.sleep(min(wait, self.poll))
            return []
        self.msg_ids = [int(r[0]) for r in rows]
        return [bytes(r[1]) for r in rows]

    def finish(self, row: str, who: int, ids: list[int]) -> None:
        self.conn.execute(self.delete, (self.msg_ids,))
        self.conn.execute(self.done, (row, who, ids))
        self.conn.commit()

    def ack(self) -> None:
        """Delete what the last take read, recording nothing (the warm-up)."""
        self.conn.execute(self.delete, (self.msg_ids,))
        self.conn.commit()


@dataclass(frozen=True)
class Side:
    """How one row's producer and consumers connect."""

    dsn: str
    row: str
    queue: str
    qid: int
    capacity: int
    names: Names
    cfg: Config

    @property
    def producer_kind(self) -> str:
        return ROWS[self.row][0]

    @property
    def consumer_kind(self) -> str:
        return ROWS[self.row][1]

    @property
    def ringq(self) -> bool:
        """A ringq queue (else the pgmq table)."""
        return self.producer_kind != "pgmq"

    @contextmanager
    def producer(self) -> Iterator[Producer]:
        kind, names = self.producer_kind, self.names
        if kind in ("linked", "linked_chunks"):
            with connect(self.dsn, producer="bench-hosts") as s:
                s.queue_info(self.queue)
                listing = (sql.SQL(PROTO_LIST_CALL).format(fn=names.fn("list", self.row))
                           if kind == "linked_chunks" else None)
                yield _LinkedProducer(s, self.queue, listing, self.capacity)
            return
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            if kind == "sql":
                yield _SqlProducer(conn, SQL_ENQUEUE, (self.queue,))
            elif kind == "sqlb":
                stmt = sql.SQL("SELECT {}(%s, %s)").format(names.fn("enqueue_batch"))
                yield _SqlProducer(conn, stmt, (self.queue,))
            elif kind == "sqlr":
                yield _SqlProducer(conn, sql.SQL("SELECT {}(%s)").format(
                    names.fn("put", self.row)), ())
            else:
                yield _SqlProducer(conn, q(PGMQ_SEND, names.pgmq), ())

    @contextmanager
    def consumer(self) -> Iterator[Consumer]:
        kind, names = self.consumer_kind, self.names
        if kind == "linked":
            with connect(self.dsn) as s:
                s.queue_info(self.queue)
                yield _LinkedConsumer(s, self.queue, names.done)
            return
        with psycopg.connect(self.dsn) as conn:
            if kind == "sql":
                # ringq.dequeue LISTENs while the queue is empty for it, and only then
                yield _SqlConsumer(conn, SQL_DEQUEUE, (self.queue,), None, names.done)
            elif kind == "chunk":
                take = sql.SQL("SELECT seq, payload FROM {}(%s)").format(
                    names.fn("take", self.row))
                # the take LISTENs while the queue is empty for it, and only then
                yield _SqlConsumer(conn, take, (), None, names.done)
            else:
                yield PgmqConsumer(conn, names.pgmq, names.done, self.cfg)

    def take_n(self) -> int:
        cfg = self.cfg
        return {"linked": cfg.take_linked, "pgmq": cfg.take_pgmq}.get(
            self.consumer_kind, cfg.take_sql)


def make_payloads(first_id: int, n: int, size: int) -> tuple[list[bytes], int]:
    """``n`` payloads of ``size`` bytes stamped now, ids from ``first_id``."""
    pad = b"\0" * (size - HEADER.size)
    now = time.monotonic_ns()
    return [HEADER.pack(now, first_id + i) + pad for i in range(n)], first_id + n


class ProtoAgent:
    """What the agent would do for a prototype row, in SQL, every ``every`` s
    on a connection of its own: keep ``ahead`` chunks of free slots listed for
    SQL producers (``reserve``: the ``sqlr`` producer), read the chunk
    listing, and verify by their rows (one range of the primary key each)
    that the chunks gone since its last look were consumed (``mismatched``
    counts those that were not: 0 expected). The global section's side (the
    claims and finishes of these slots) is not done: in-process work of the
    agent, not the server's."""

    def __init__(self, side: Side, every: float, *, reserve: bool, ahead: int = 64) -> None:
        self.side, self.every, self.reserve, self.ahead = side, every, reserve, ahead
        self.mismatched = self.verified = self.passes = self.reserved = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(30)  # the first free chunks are listed

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def figures(self) -> dict[str, Any]:
        return {"passes": self.passes, "verified_chunks": self.verified,
                "mismatched_chunks": self.mismatched, "reserved_chunks": self.reserved,
                "error": None if self.error is None else repr(self.error)}  # fmt: skip

    def _run(self) -> None:
        side, names = self.side, self.side.names
        chunks, free = sql.Identifier(names.chunks), sql.Identifier(names.free)
        ring = sql.Identifier("ringq", f"q_{side.queue}")
        try:
            with connect(side.dsn) as s:
                head = int(s.stats(side.queue)["head"])
            with psycopg.connect(side.dsn, autocommit=True) as c:
                # past every seq the ring holds (a former round's SQL producers
                # wrote past the section's head), its former reservations void
                row = c.execute(sql.SQL("SELECT max(seq) FROM {}").format(ring)).fetchone()
                next_seq = max(head, int(row[0]) + 1 if row and row[0] is not None else 0)
                c.execute(sql.SQL("DELETE FROM {} WHERE queue_id = %s").format(free),
                          (side.qid,))
                c.execute("SET enable_seqscan = off")
                seen: dict[int, tuple[int, int]] = {}
                while True:
                    if self.reserve:
                        row = c.execute(sql.SQL(PROTO_FREE_COUNT).format(free=free),
                                        (side.qid,)).fetchone()
                        short = self.ahead - (int(row[0]) if row else 0)
                        if short > self.ahead // 4:
                            runs = runs_of(list(range(next_seq, next_seq + short * CHUNK)),
                                           side.capacity)
                            next_seq += short * CHUNK
                            c.execute(sql.SQL(PROTO_LIST).format(chunks=free), (
                                side.qid, [r[0] for r in runs], [r[1] for r in runs],
                                [r[2] for r in runs]))
                            self.reserved += len(runs)
                    self._ready.set()
                    listed = {int(r[0]): (int(r[1]), int(r[2])) for r in c.execute(
                        sql.SQL(PROTO_LISTED).format(chunks=chunks), (side.qid,)).fetchall()}
                    gone = [(seq, *seen[seq]) for seq in seen if seq not in listed]
                    if gone:
                        row = c.execute(sql.SQL(PROTO_VERIFY).format(ring=ring), (
                            [g[0] for g in gone], [g[1] for g in gone],
                            [g[2] for g in gone])).fetchone()
                        consumed = int(row[0]) if row else 0
                        self.verified += len(gone)
                        if consumed != sum(g[2] for g in gone):
                            self.mismatched += 1
                    seen = listed
                    if listed:
                        c.execute(sql.SQL("SELECT {}()").format(names.fn("sweep", side.row)))
                    self.passes += 1
                    if self._stop.wait(self.every):
                        return
        except BaseException as exc:  # reported with the row
            self.error = exc
            self._ready.set()
