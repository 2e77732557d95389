"""Named SQL of the regression run store (the one module of SQL in this package).

``{schema}`` is ``regress_<run id>`` and ``{table}`` a received table, both
filled only through :func:`psycopg.sql.Identifier` from validated names.
Everything a run needs to be verified again lives in its schema:

- ``run``          one row: the configuration, when, where
- ``queues``       the run's ringq queues and their payload sizes
- ``cycles``       one row per cycle: status, timings, section counters, errors, report
- ``sent``         the ground truth: every committed entry, written by the producer
                   in the same transaction as the enqueue
- ``rolled_back``  every entry of a transaction that was rolled back (written
                   right after the rollback, in its own transaction)
- ``received_<queue>``  what the queue's consumer took, written in the same
                   transaction as the dequeue (payload included)

No indexes beyond primary keys on the small tables: the writers stay cheap and
Spark does the joins.
"""

from __future__ import annotations

from psycopg import sql

SCHEMA_PREFIX = "regress_"

CREATE_RUN = """
CREATE SCHEMA {schema};
CREATE TABLE {schema}.run (
    run_id        text PRIMARY KEY,
    created_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    status        text NOT NULL DEFAULT 'running',
    host          text,
    ringq_version text,
    config        jsonb NOT NULL
);
CREATE TABLE {schema}.queues (
    idx           int2 PRIMARY KEY,
    name          text NOT NULL UNIQUE,
    payload_size  int4 NOT NULL,
    capacity      int4 NOT NULL
);
CREATE TABLE {schema}.cycles (
    cycle         int4 PRIMARY KEY,
    started_at    timestamptz NOT NULL DEFAULT now(),
    ended_at      timestamptz,
    status        text NOT NULL DEFAULT 'running',
    workload_s    float8,
    stats         jsonb,
    errors        jsonb,
    verified_at   timestamptz,
    ok            boolean,
    report        jsonb
);
CREATE TABLE {schema}.sent (
    cycle         int4 NOT NULL,
    queue         int2 NOT NULL,
    qseq          int8 NOT NULL,
    producer      int2 NOT NULL,
    pseq          int8 NOT NULL,
    tx            int8 NOT NULL,
    kind          int2 NOT NULL,
    length        int4 NOT NULL,
    digest        bytea NOT NULL,
    sent_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE {schema}.rolled_back (
    cycle         int4 NOT NULL,
    queue         int2 NOT NULL,
    qseq          int8 NOT NULL,
    producer      int2 NOT NULL,
    pseq          int8 NOT NULL,
    tx            int8 NOT NULL,
    kind          int2 NOT NULL,
    length        int4 NOT NULL,
    digest        bytea NOT NULL,
    reason        text NOT NULL,
    logged_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

CREATE_RECEIVED = """
CREATE TABLE {schema}.{table} (
    cycle         int4 NOT NULL,
    qseq          int8 NOT NULL,
    recv_order    int8 NOT NULL,
    deliveries    int4 NOT NULL,
    consumer      int4 NOT NULL,
    payload       bytea NOT NULL,
    deq_at        timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

INSERT_RUN = (
    "INSERT INTO {schema}.run (run_id, host, ringq_version, config) VALUES (%s, %s, %s, %s)"
)
INSERT_QUEUE = (
    "INSERT INTO {schema}.queues (idx, name, payload_size, capacity) VALUES (%s, %s, %s, %s)"
)
SELECT_RUN = "SELECT run_id, created_at, finished_at, status, config FROM {schema}.run"
SELECT_QUEUES = "SELECT idx, name, payload_size, capacity FROM {schema}.queues ORDER BY idx"
FINISH_RUN = "UPDATE {schema}.run SET finished_at = now(), status = %s"

START_CYCLE = "INSERT INTO {schema}.cycles (cycle) VALUES (%s)"
NEXT_CYCLE = "SELECT coalesce(max(cycle), 0) + 1 FROM {schema}.cycles"
END_CYCLE = """
UPDATE {schema}.cycles SET ended_at = now(), status = %s, workload_s = %s, stats = %s, errors = %s
WHERE cycle = %s
"""
VERIFIED_CYCLE = (
    "UPDATE {schema}.cycles SET verified_at = now(), ok = %s, report = %s WHERE cycle = ANY(%s)"
)
SELECT_CYCLES = """
SELECT cycle, started_at, ended_at, status, workload_s, stats, errors, ok
FROM {schema}.cycles ORDER BY cycle
"""

# The producer's ground truth, in the enqueue's own transaction.
INSERT_SENT = """
INSERT INTO {schema}.sent (cycle, queue, qseq, producer, pseq, tx, kind, length, digest)
SELECT %s, v.q, v.s, %s, v.p, %s, %s, v.l, v.d
FROM unnest(%s::int2[], %s::int8[], %s::int8[], %s::int4[], %b::bytea[]) AS v(q, s, p, l, d)
"""

INSERT_ROLLED_BACK = """
INSERT INTO {schema}.rolled_back
    (cycle, queue, qseq, producer, pseq, tx, kind, length, digest, reason)
SELECT %s, v.q, v.s, %s, v.p, %s, %s, v.l, v.d, %s
FROM unnest(%s::int2[], %s::int8[], %s::int8[], %s::int4[], %b::bytea[]) AS v(q, s, p, l, d)
"""

# The consumer's record, in the dequeue's own transaction.
INSERT_RECEIVED = """
INSERT INTO {schema}.{table} (cycle, qseq, recv_order, deliveries, consumer, payload)
SELECT %s, v.s, v.o, v.d, %s, v.p
FROM unnest(%s::int8[], %s::int8[], %s::int4[], %b::bytea[]) AS v(s, o, d, p)
"""

# Executed without parameters, so % is a literal LIKE wildcard.
LIST_RUNS = r"""
SELECT nspname FROM pg_namespace n
WHERE nspname LIKE 'regress\_%'
  AND EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid AND c.relname = 'run')
ORDER BY nspname
"""
RUN_EXISTS = "SELECT to_regclass(%s) IS NOT NULL"
DROP_RUN = "DROP SCHEMA {schema} CASCADE"
COMMIT_TS_ON = "SELECT current_setting('track_commit_timestamp')::boolean"
LEFTOVERS = "SELECT count(*) FILTER (WHERE state = 1) FROM {table}"


def schema_of(run_id: str) -> sql.Identifier:
    return sql.Identifier(SCHEMA_PREFIX + run_id)


def received_table(queue_name: str) -> sql.Identifier:
    return sql.Identifier("received_" + queue_name)


def q(text: str, run_id: str, table: sql.Composable | None = None) -> sql.Composed:
    """Compose a named statement for ``run_id`` (and a table)."""
    kw: dict[str, sql.Composable] = {"schema": schema_of(run_id)}
    if table is not None:
        kw["table"] = table
    return sql.SQL(text).format(**kw)


# What a restarted worker resumes from (chaos): only what is durably recorded.
RESUME_PRODUCER = """
SELECT coalesce(max(pseq), 0), coalesce(max(tx), 0) FROM (
    SELECT pseq, tx FROM {schema}.sent WHERE cycle = %s AND producer = %s
    UNION ALL
    SELECT pseq, tx FROM {schema}.rolled_back WHERE cycle = %s AND producer = %s
) AS x
"""
SENT_BY_QUEUE = (
    "SELECT queue, count(*) FROM {schema}.sent WHERE cycle = %s AND producer = %s GROUP BY queue"
)
RESUME_CONSUMER = (
    "SELECT coalesce(max(recv_order), 0), count(*) FROM {schema}.{table} WHERE cycle = %s"
)
PREPARED_GIDS = "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
# The backend holding the monitor's lock (the same lock as ringq.monitor takes:
# one serving monitor per database), if any.
MONITOR_LOCK_HOLDER = """
SELECT a.pid, a.application_name
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objid = hashtext('ringq.monitor')::oid AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
LIMIT 1
"""
