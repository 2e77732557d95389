-- SQL of the regression run store (ringq.regression), loaded once by
-- regression/_queries.py. {schema} is regress_<run id> and {table} a queue's
-- table or a received table, both filled only with psycopg.sql.Identifier from
-- validated names; {cycles} is a list of psycopg.sql.Literal cycle numbers. A
-- statement of more than four parameters names them (%(name)s).
--
-- The jdbc_ blocks are what Spark reads through JDBC (regression/_checks.py,
-- regression/_jdbc.py), rendered to text and so kept free of comments:
-- jdbc_sent's {committed_at} is one of the two committed_at_ fragments;
-- jdbc_received's (and jdbc_received_grouped's, jdbc_sent_groups') {idx} is
-- the queue's index in payload headers (a Literal); jdbc_dbtable wraps a
-- query as Spark's derived table; jdbc_partition is one of {partitions} predicates that
-- split a read ({column} an Identifier, {partitions} and {part} Literals).

-- create_run --
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
    sent_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    grp           text
);
CREATE TABLE {schema}.acked (
    cycle         int4 NOT NULL,
    producer      int2 NOT NULL,
    queue         int2 NOT NULL,
    qseq          int8 NOT NULL,
    pseq          int8 NOT NULL,
    tx            int8 NOT NULL,
    on_new        boolean NOT NULL
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
CREATE TABLE {schema}.due (
    cycle         int4 NOT NULL,
    queue         int2 NOT NULL,
    qseq          int8 NOT NULL,
    delay         float8 NOT NULL,
    not_before    timestamptz,
    PRIMARY KEY (cycle, queue, qseq)
);
CREATE TABLE {schema}.queued (
    cycle         int4 NOT NULL,
    queue         int2 NOT NULL,
    qseq          int8 NOT NULL,
    PRIMARY KEY (cycle, queue, qseq)
);
CREATE TABLE {schema}.retried (
    cycle         int4 NOT NULL,
    queue         int2 NOT NULL,
    qseq          int8 NOT NULL,
    deliveries    int4 NOT NULL,
    consumer      int4 NOT NULL,
    rb_at         timestamptz NOT NULL,
    backoff       float8 NOT NULL
);

-- create_received --
CREATE TABLE {schema}.{table} (
    cycle         int4 NOT NULL,
    qseq          int8 NOT NULL,
    recv_order    int8 NOT NULL,
    deliveries    int4 NOT NULL,
    consumer      int4 NOT NULL,
    payload       bytea NOT NULL,
    deq_at        timestamptz NOT NULL DEFAULT clock_timestamp()
)

-- add_received_grouped --
-- The grouped queue's received table is the plain one (create_received) with
-- these columns after: the consumer's number among the queue's consumers
-- (worker), the entry's group as dequeued, and time.monotonic_ns() right
-- after the dequeue returned (deq_ns) and just before the commit
-- (commit_ns): CLOCK_MONOTONIC is system-wide on Linux.
ALTER TABLE {schema}.{table}
    ADD COLUMN worker    int2 NOT NULL,
    ADD COLUMN msg_group text,
    ADD COLUMN deq_ns    int8 NOT NULL,
    ADD COLUMN commit_ns int8 NOT NULL

-- insert_run --
INSERT INTO {schema}.run (run_id, host, ringq_version, config) VALUES (%s, %s, %s, %s)

-- insert_queue --
INSERT INTO {schema}.queues (idx, name, payload_size, capacity) VALUES (%s, %s, %s, %s)

-- select_run --
SELECT run_id, created_at, finished_at, status, config FROM {schema}.run

-- select_queues --
SELECT idx, name, payload_size, capacity FROM {schema}.queues ORDER BY idx

-- finish_run --
UPDATE {schema}.run SET finished_at = now(), status = %s

-- start_cycle --
INSERT INTO {schema}.cycles (cycle) VALUES (%s)

-- next_cycle --
SELECT coalesce(max(cycle), 0) + 1 FROM {schema}.cycles

-- end_cycle --
UPDATE {schema}.cycles
SET ended_at = now(), status = %(status)s, workload_s = %(workload_s)s, stats = %(stats)s,
    errors = %(errors)s
WHERE cycle = %(cycle)s

-- verified_cycle --
UPDATE {schema}.cycles SET verified_at = now(), ok = %s, report = %s WHERE cycle = ANY(%s)

-- select_cycles --
SELECT cycle, started_at, ended_at, status, workload_s, stats, errors, ok
FROM {schema}.cycles ORDER BY cycle

-- insert_sent --
-- The producer's ground truth, in the enqueue's own transaction (grp: the
-- entry's group, NULL outside the grouped queue).
INSERT INTO {schema}.sent (cycle, queue, qseq, producer, pseq, tx, kind, length, digest, grp)
SELECT %(cycle)s, v.q, v.s, %(producer)s, v.p, %(tx)s, %(kind)s, v.l, v.d, v.g
FROM unnest(%(queues)s::int2[], %(qseqs)s::int8[], %(pseqs)s::int8[], %(lengths)s::int4[],
            %(digests)b::bytea[], %(groups)s::text[]) AS v(q, s, p, l, d, g)

-- insert_due --
-- The delayed entries of a producer's transaction, in that transaction (the
-- delay asked for; the due time the database gives is read after the commit).
INSERT INTO {schema}.due (cycle, queue, qseq, delay)
SELECT %(cycle)s, v.q, v.s, v.d
FROM unnest(%(queues)s::int2[], %(qseqs)s::int8[], %(delays)s::float8[]) AS v(q, s, d)

-- read_due --
-- After the commit: the due time the database gave each delayed entry of one
-- queue, read from its row ({table}: the queue's table; a slot is its
-- sequence modulo the capacity). An entry whose slot has been reused since
-- (a whole ring later) keeps NULL: the proof counts it as not read.
UPDATE {schema}.due AS d SET not_before = t.not_before
FROM {table} AS t
WHERE t.slot = ANY(%(slots)s::integer[]) AND t.seq = ANY(%(qseqs)s::int8[])
  AND d.cycle = %(cycle)s AND d.queue = %(queue)s AND d.qseq = t.seq

-- db_clock --
-- The database's clock, read by a consumer just before it rolls back on
-- purpose: its entries' backoff counts from a later moment (the strike's).
SELECT clock_timestamp()

-- insert_retried --
-- A consumer's deliberate rollback, logged right after it: the entries, the
-- deliveries they had, the time read before the rollback and the backoff.
INSERT INTO {schema}.retried (cycle, queue, qseq, deliveries, consumer, rb_at, backoff)
SELECT %(cycle)s, %(queue)s, v.s, v.d, %(consumer)s, %(rb_at)s, %(backoff)s
FROM unnest(%(qseqs)s::int8[], %(deliveries)s::int4[]) AS v(s, d)

-- insert_acked --
-- What producers of a fail-over cycle were told had committed (their commit
-- returned), kept outside the database and loaded after the cycle; on_new:
-- acknowledged by the promoted standby.
INSERT INTO {schema}.acked (cycle, producer, queue, qseq, pseq, tx, on_new)
SELECT %(cycle)s, v.p, v.q, v.s, v.ps, v.t, v.n
FROM unnest(%(producers)s::int2[], %(queues)s::int2[], %(qseqs)s::int8[], %(pseqs)s::int8[],
            %(txs)s::int8[], %(on_new)s::bool[]) AS v(p, q, s, ps, t, n)

-- insert_rolled_back --
-- Every entry of a rolled-back transaction, right after the rollback.
INSERT INTO {schema}.rolled_back
    (cycle, queue, qseq, producer, pseq, tx, kind, length, digest, reason)
SELECT %(cycle)s, v.q, v.s, %(producer)s, v.p, %(tx)s, %(kind)s, v.l, v.d, %(reason)s
FROM unnest(%(queues)s::int2[], %(qseqs)s::int8[], %(pseqs)s::int8[], %(lengths)s::int4[],
            %(digests)b::bytea[]) AS v(q, s, p, l, d)

-- insert_received --
-- The consumer's record, in the dequeue's own transaction.
INSERT INTO {schema}.{table} (cycle, qseq, recv_order, deliveries, consumer, payload)
SELECT %(cycle)s, v.s, v.o, v.d, %(consumer)s, v.p
FROM unnest(%(qseqs)s::int8[], %(orders)s::int8[], %(deliveries)s::int4[],
            %(payloads)b::bytea[]) AS v(s, o, d, p)

-- insert_received_grouped --
-- The record of a consumer of the grouped queue, in the dequeue's own transaction.
INSERT INTO {schema}.{table}
    (cycle, qseq, recv_order, deliveries, consumer, payload, worker, msg_group, deq_ns, commit_ns)
SELECT %(cycle)s, v.s, v.o, v.d, %(consumer)s, v.p, %(worker)s, v.g, %(deq_ns)s, %(commit_ns)s
FROM unnest(%(qseqs)s::int8[], %(orders)s::int8[], %(deliveries)s::int4[],
            %(payloads)b::bytea[], %(groups)s::text[]) AS v(s, o, d, p, g)

-- list_runs --
-- Executed without parameters, so % is a literal LIKE wildcard.
SELECT nspname FROM pg_namespace n
WHERE nspname LIKE 'regress\_%'
  AND EXISTS (SELECT 1 FROM pg_class c WHERE c.relnamespace = n.oid AND c.relname = 'run')
ORDER BY nspname

-- run_exists --
-- The parameter is the run's schema name; format() quotes it as an identifier.
SELECT to_regclass(format('%%I.run', %s::text)) IS NOT NULL

-- drop_run --
DROP SCHEMA {schema} CASCADE

-- commit_ts_on --
SELECT current_setting('track_commit_timestamp')::boolean

-- leftovers --
-- Entries still queued in a ringq queue's table (ringq.engine.queue_table).
SELECT count(*) FILTER (WHERE state = 1) FROM {table}

-- record_queued --
-- At a cycle's end, its workers stopped: the entries still queued in one of
-- the run's queues ({table}: the queue's table), kept for the proof (the
-- queues are dropped with the run, their evidence stays); how many. An entry
-- a consumer held when it stopped is queued again (its take rolled back).
WITH t AS (SELECT seq FROM {table} WHERE state = 1),
i AS (
    INSERT INTO {schema}.queued (cycle, queue, qseq)
    SELECT %(cycle)s, %(queue)s, seq FROM t
    ON CONFLICT DO NOTHING
)
SELECT count(*) FROM t

-- queued_kept --
-- Whether the run keeps what was queued at its cycles' ends (runs stored
-- before the queued table existed do not). The parameter is the run's schema name.
SELECT to_regclass(format('%%I.queued', %s::text)) IS NOT NULL

-- resume_producer --
-- What a restarted worker resumes from (chaos): only what is durably recorded.
SELECT coalesce(max(pseq), 0), coalesce(max(tx), 0) FROM (
    SELECT pseq, tx FROM {schema}.sent WHERE cycle = %(cycle)s AND producer = %(producer)s
    UNION ALL
    SELECT pseq, tx FROM {schema}.rolled_back WHERE cycle = %(cycle)s AND producer = %(producer)s
) AS x

-- sent_by_queue --
SELECT queue, count(*) FROM {schema}.sent WHERE cycle = %s AND producer = %s GROUP BY queue

-- resume_consumer --
SELECT coalesce(max(recv_order), 0), count(*) FROM {schema}.{table} WHERE cycle = %s

-- resume_grouped_consumer --
-- The same for one of the grouped queue's consumers: what it took itself.
SELECT coalesce(max(recv_order), 0), count(*) FROM {schema}.{table}
WHERE cycle = %s AND worker = %s

-- prepared_gids --
SELECT gid FROM pg_prepared_xacts WHERE database = current_database()

-- monitor_lock_holder --
-- The backend holding the monitor's lock (the same lock as ringq.monitor takes:
-- one serving monitor per database), if any.
SELECT a.pid, a.application_name
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objid = hashtext('ringq.monitor')::oid AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
LIMIT 1

-- data_directory --
-- Where the server keeps its data: finds the embedded cluster that serves a DSN.
SELECT current_setting('data_directory')

-- replication_gap --
-- The standby as the primary sees it just before a fail-over: its walsender's
-- pid, and the WAL (bytes) it has not flushed / not replayed yet.
SELECT pid, sync_state, (pg_current_wal_lsn() - flush_lsn)::int8,
       (pg_current_wal_lsn() - replay_lsn)::int8
FROM pg_stat_replication ORDER BY backend_start LIMIT 1

-- received_count --
-- Rows of the chosen cycles in one received table.
SELECT count(*) FROM {schema}.{table} WHERE cycle IN ({cycles})

-- jdbc_sent --
SELECT cycle, queue, qseq, producer, pseq, tx, kind, length, digest, {committed_at} AS committed_at
FROM {schema}.sent WHERE cycle IN ({cycles})

-- committed_at_commit_ts --
coalesce(pg_xact_commit_timestamp(xmin), sent_at)

-- committed_at_sent --
sent_at

-- jdbc_due --
SELECT cycle, queue, qseq, delay, not_before FROM {schema}.due WHERE cycle IN ({cycles})

-- jdbc_retried --
SELECT cycle, queue, qseq, deliveries, rb_at, backoff
FROM {schema}.retried WHERE cycle IN ({cycles})

-- jdbc_acked --
SELECT cycle, producer, queue, qseq, pseq, tx, on_new
FROM {schema}.acked WHERE cycle IN ({cycles})

-- jdbc_queued --
SELECT cycle, queue, qseq FROM {schema}.queued WHERE cycle IN ({cycles})

-- jdbc_rolled_back --
SELECT cycle, queue, qseq, producer, pseq, tx, kind, reason
FROM {schema}.rolled_back WHERE cycle IN ({cycles})

-- jdbc_received --
SELECT {idx}::int2 AS queue, cycle, qseq, recv_order, deliveries, payload, deq_at
FROM {schema}.{table} WHERE cycle IN ({cycles})

-- jdbc_received_grouped --
SELECT {idx}::int2 AS queue, cycle, qseq, recv_order, deliveries, payload, deq_at,
       worker, msg_group, deq_ns, commit_ns
FROM {schema}.{table} WHERE cycle IN ({cycles})

-- jdbc_sent_groups --
SELECT cycle, queue, qseq, grp FROM {schema}.sent WHERE cycle IN ({cycles}) AND queue = {idx}

-- jdbc_dbtable --
({query}) AS t

-- jdbc_partition --
{column} % {partitions} = {part}

-- sql_dequeue --
-- What a SQL consumer of the regression calls: the SQL path as any client would.
SELECT seq, payload, deliveries, msg_group FROM ringq.dequeue(%s, %s)

-- sql_depth --
-- Entries of a queue not consumed yet (held, set aside or waiting): a SQL
-- consumer is done when the producers are and this is 0.
SELECT ringq.depth(%s)

-- terminate_sql_consumer --
-- Chaos: end the backend of one SQL consumer (its application_name names its pid).
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE application_name = %s AND datname = current_database()
