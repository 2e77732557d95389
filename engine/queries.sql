-- Runtime SQL of the engine. {table} is the queue's table, filled only with
-- psycopg.sql.Identifier from a validated name; {gid} a prepared transaction's
-- name, filled only with psycopg.sql.Literal. %b marks binary parameters; a
-- statement of more than four parameters names them (%(name)s).

-- instance --
SELECT (SELECT value FROM ringq.meta WHERE key = 'instance_id'),
       (SELECT value FROM ringq.meta WHERE key = 'schema_version'),
       pg_backend_pid()

-- attach --
-- What a session checks once: the instance, the schema version, its backend,
-- and that the schema has the guard of deferred row writes and the groups
-- (added after version 1 without a version bump: applying the schema script
-- adds them; the three-argument ringq.enqueue() comes with the msg_group
-- columns, the retry columns with the rings' not_before, the four-argument
-- one with the inbox's not_before, the rings' trace column with the
-- exceptions', ringq.room with the SQL producers' room check); then the database's history (see history); then the database's clock (us).
SELECT (SELECT value FROM ringq.meta WHERE key = 'instance_id'),
       (SELECT value FROM ringq.meta WHERE key = 'schema_version'),
       pg_backend_pid(),
       to_regprocedure('ringq.expect_rows(integer, integer, text)') IS NOT NULL
           AND to_regprocedure('ringq.enqueue(text, bytea, text)') IS NOT NULL
           AND to_regprocedure('ringq.enqueue(text, bytea, text, timestamptz)') IS NOT NULL
           AND to_regclass('ringq.room') IS NOT NULL
           AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'ringq.queues'::regclass
                       AND attname = 'retry_delay' AND NOT attisdropped)
           AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'ringq.exceptions'::regclass
                       AND attname = 'trace' AND NOT attisdropped),
       CASE WHEN has_function_privilege('pg_control_system()', 'execute')
            THEN (SELECT system_identifier FROM pg_control_system()) ELSE 0 END,
       CASE WHEN pg_is_in_recovery() THEN -1
            ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint END,
       (extract(epoch FROM clock_timestamp()) * 1000000)::bigint

-- history --
-- Which history of the database this server has: the cluster's system
-- identifier (0 where the role may not read it) and its timeline, which a
-- promotion (or a point-in-time recovery) moves on; -1 on a standby.
SELECT CASE WHEN has_function_privilege('pg_control_system()', 'execute')
            THEN (SELECT system_identifier FROM pg_control_system()) ELSE 0 END,
       CASE WHEN pg_is_in_recovery() THEN -1
            ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint END

-- queue_info --
-- lease and cache_payload are read through to_jsonb: a database whose schema
-- predates the columns (the schema block adds them) reads 300 s and 0 (no cache).
SELECT id, name, capacity, max_payload, full_policy, full_timeout, dequeue_mode,
       max_deliveries, exception_queue, coalesce((to_jsonb(q) ->> 'lease')::float8, 300),
       coalesce((to_jsonb(q) ->> 'cache_payload')::integer, 0)
FROM ringq.queues q WHERE name = %s

-- queue_infos --
SELECT id, name, capacity, max_payload, full_policy, full_timeout, dequeue_mode,
       max_deliveries, exception_queue, coalesce((to_jsonb(q) ->> 'lease')::float8, 300),
       coalesce((to_jsonb(q) ->> 'cache_payload')::integer, 0)
FROM ringq.queues q

-- queue_ids --
SELECT id FROM ringq.queues

-- queue_by_id --
SELECT id, name, capacity, max_payload, full_policy, full_timeout, dequeue_mode,
       max_deliveries, exception_queue, coalesce((to_jsonb(q) ->> 'lease')::float8, 300),
       coalesce((to_jsonb(q) ->> 'cache_payload')::integer, 0)
FROM ringq.queues q WHERE id = %s

-- enqueue --
-- A deferred enqueue's row write, sent at commit (or flush). Guarded: only a
-- slot that holds no unconsumed entry and an older sequence is written, so a
-- stale section can never overwrite an entry; and a row that does not match
-- makes the statement fail (ringq.expect_rows raises SQLSTATE RQ001), so the
-- transaction can never commit without its queue write. {queue} is the
-- queue's name (a literal), for the error. The second column is the rows'
-- enq_at in microseconds, for the payload cache. Every row write of an
-- enqueue sets trace, the entry's trace context (NULL: none), so that a slot
-- never hands an earlier entry's on.
WITH u AS (
    UPDATE {table}
    SET state = 1, seq = %s::bigint, payload = %b, producer = %s, producer_seq = %s::bigint,
        msg_group = %s::text, deliveries = 0, not_before = NULL, trace = %s::text,
        enq_at = now(), enq_user = current_user, deq_at = NULL, deq_user = NULL
    WHERE slot = %s::integer AND state <> 1 AND seq < %s::bigint
    RETURNING 1
)
SELECT ringq.expect_rows((SELECT count(*) FROM u)::integer, 1, {queue}),
       (extract(epoch FROM now()) * 1000000)::bigint

-- enqueue_alone --
-- enqueue's row write when it is the whole transaction (sent alone in
-- autocommit: a commit on an idle connection). A row that does not match is
-- written by no one and the empty transaction commits nothing, so the guard
-- is the client's (no row back: StaleSection), without expect_rows' CTE and
-- function call, which cost the server ~15 us per transaction (a ninth).
UPDATE {table}
SET state = 1, seq = %s::bigint, payload = %b, producer = %s, producer_seq = %s::bigint,
    msg_group = %s::text, deliveries = 0, not_before = NULL, trace = %s::text,
    enq_at = now(), enq_user = current_user, deq_at = NULL, deq_user = NULL
WHERE slot = %s::integer AND state <> 1 AND seq < %s::bigint
RETURNING 1, (extract(epoch FROM now()) * 1000000)::bigint

-- enqueue_due --
-- enqueue_many for entries of which some wait or carry a trace context: each
-- row's not_before is the database's clock plus its delay (counted from this
-- write, sent at commit), or the time given, or NULL (due at once); its
-- trace the W3C traceparent given, or NULL (every other row write clears
-- it). Also returns the due times in us of the rows that have one (slots and
-- times as two arrays) and the database's clock, for the section.
WITH u AS (
    UPDATE {table} AS t
    SET state = 1, seq = v.seq, payload = v.payload, producer = v.producer, producer_seq = v.pseq,
        msg_group = v.grp, deliveries = 0,
        not_before = coalesce(clock_timestamp() + make_interval(secs => v.delay), v.nb),
        trace = v.trace,
        enq_at = now(), enq_user = current_user, deq_at = NULL, deq_user = NULL
    FROM unnest(%(slots)s::integer[], %(seqs)s::bigint[], %(payloads)b::bytea[],
                %(producers)s::text[], %(pseqs)s::bigint[], %(groups)s::text[],
                %(delays)s::float8[], %(nbs)s::timestamptz[], %(traces)s::text[])
        AS v(slot, seq, payload, producer, pseq, grp, delay, nb, trace)
    WHERE t.slot = v.slot AND t.state <> 1 AND t.seq < v.seq
    RETURNING t.slot, t.not_before
)
SELECT ringq.expect_rows((SELECT count(*) FROM u)::integer, %(n)s::integer, {queue}),
       (extract(epoch FROM now()) * 1000000)::bigint,
       (SELECT array_agg(slot) FROM u WHERE not_before IS NOT NULL),
       (SELECT array_agg((extract(epoch FROM not_before) * 1000000)::bigint) FROM u
        WHERE not_before IS NOT NULL),
       (extract(epoch FROM clock_timestamp()) * 1000000)::bigint

-- enqueue_key --
WITH k AS (
    INSERT INTO ringq.keys (queue_id, key, seq) VALUES (%(queue_id)s::integer, %(key)s, %(seq)s::bigint)
    ON CONFLICT DO NOTHING RETURNING seq
), u AS (
    UPDATE {table}
    SET state = 1, seq = %(seq)s::bigint, payload = %(payload)b, producer = %(producer)s,
        producer_seq = %(producer_seq)s::bigint, msg_group = %(group)s::text, deliveries = 0,
        trace = %(trace)s::text,
        not_before = coalesce(clock_timestamp() + make_interval(secs => %(delay)s::float8),
                              %(not_before)s::timestamptz),
        enq_at = now(), enq_user = current_user, deq_at = NULL, deq_user = NULL
    WHERE slot = %(slot)s::integer AND state <> 1 AND seq < %(seq)s::bigint AND EXISTS (SELECT 1 FROM k)
    RETURNING slot, not_before
)
SELECT (SELECT count(*) FROM k), (SELECT count(*) FROM u),
       (SELECT seq FROM ringq.keys WHERE queue_id = %(queue_id)s AND key = %(key)s),
       (SELECT (extract(epoch FROM not_before) * 1000000)::bigint FROM u),
       (extract(epoch FROM clock_timestamp()) * 1000000)::bigint

-- key_forget --
DELETE FROM ringq.keys WHERE queue_id = %s AND key = %s AND seq = %s

-- key_seq --
SELECT seq FROM ringq.keys WHERE queue_id = %s AND key = %s

-- enqueue_many --
-- Several deferred row writes of one queue in one statement (as enqueue),
-- all with one trace context (NULL: none).
WITH u AS (
    UPDATE {table} AS t
    SET state = 1, seq = v.seq, payload = v.payload, producer = v.producer, producer_seq = v.pseq,
        msg_group = v.grp, deliveries = 0, not_before = NULL, trace = %s::text, enq_at = now(),
        enq_user = current_user, deq_at = NULL, deq_user = NULL
    FROM unnest(%s::integer[], %s::bigint[], %b::bytea[], %s::text[], %s::bigint[], %s::text[])
        AS v(slot, seq, payload, producer, pseq, grp)
    WHERE t.slot = v.slot AND t.state <> 1 AND t.seq < v.seq
    RETURNING 1
)
SELECT ringq.expect_rows((SELECT count(*) FROM u)::integer, %s::integer, {queue}),
       (extract(epoch FROM now()) * 1000000)::bigint

-- dequeue --
-- Guarded by (slot, seq, state): an entry is consumed at most once. Every
-- linked consuming write (this and the six below) also refuses a row whose
-- due time is still to come: the section releases an entry only once the
-- database's clock passed it, so this holds back only an entry the section
-- made ready by mistake (a race between two deciders of a dead delivery, one
-- of which wrote a backoff): the row decides, and the mismatch is repaired
-- (a read: the slot waits; a consume at commit: StaleSection, then a resync).
UPDATE {table}
SET state = 2, deq_at = now(), deq_user = current_user
WHERE slot = %s::integer AND seq = %s::bigint AND state = 1
  AND (not_before IS NULL OR not_before <= clock_timestamp())
RETURNING payload, producer, producer_seq, enq_at, deliveries, msg_group, trace

-- dequeue_many --
-- The slots and the seqs as two arrays, not a join with unnest(): a ring row's
-- seq is always one its slot holds (slot = seq mod capacity) and a transaction
-- holds a slot once, so (slot, seq) pairs need no join; and a join let the
-- planner, once the statistics said state = 1 was rare (an analyze of a
-- drained ring), scan the table once per entry: 100 ms for 100 entries in
-- bench_engine, against 0.4 ms by primary key. slot = ANY is an index
-- condition whatever the estimate.
UPDATE {table} AS t
SET state = 2, deq_at = now(), deq_user = current_user
WHERE t.slot = ANY(%s::integer[]) AND t.seq = ANY(%s::bigint[]) AND t.state = 1
  AND (t.not_before IS NULL OR t.not_before <= clock_timestamp())
RETURNING t.slot, t.seq, t.payload, t.producer, t.producer_seq, t.enq_at, t.deliveries,
          t.msg_group, t.trace

-- dequeue_span --
-- dequeue_many of slots first .. first + n - 1 whose seqs are the slot plus
-- one offset (a batch claimed in one stretch, the usual one): one range of
-- the primary key instead of a lookup per slot (an index condition too).
UPDATE {table} AS t
SET state = 2, deq_at = now(), deq_user = current_user
WHERE t.slot >= %s::integer AND t.slot < %s::integer AND t.seq = t.slot + %s::bigint
  AND t.state = 1 AND (t.not_before IS NULL OR t.not_before <= clock_timestamp())
RETURNING t.slot, t.seq, t.payload, t.producer, t.producer_seq, t.enq_at, t.deliveries,
          t.msg_group, t.trace

-- consume --
-- The consuming write of a dequeue served from the payload cache, sent at
-- commit (or flush). Guarded as dequeue, and as a deferred enqueue it fails
-- (RQ001) unless it consumed the entry, so the transaction cannot commit
-- without it.
WITH u AS (
    UPDATE {table}
    SET state = 2, deq_at = now(), deq_user = current_user
    WHERE slot = %s::integer AND seq = %s::bigint AND state = 1
      AND (not_before IS NULL OR not_before <= clock_timestamp())
    RETURNING 1
)
SELECT ringq.expect_rows((SELECT count(*) FROM u)::integer, 1, {queue})

-- consume_alone --
-- consume's write when it is the whole transaction (as enqueue_alone).
UPDATE {table}
SET state = 2, deq_at = now(), deq_user = current_user
WHERE slot = %s::integer AND seq = %s::bigint AND state = 1
  AND (not_before IS NULL OR not_before <= clock_timestamp())
RETURNING 1

-- consume_many --
-- The arrays as in dequeue_many, for the same reason.
WITH u AS (
    UPDATE {table} AS t
    SET state = 2, deq_at = now(), deq_user = current_user
    WHERE t.slot = ANY(%s::integer[]) AND t.seq = ANY(%s::bigint[]) AND t.state = 1
      AND (t.not_before IS NULL OR t.not_before <= clock_timestamp())
    RETURNING 1
)
SELECT ringq.expect_rows((SELECT count(*) FROM u)::integer, %s::integer, {queue})

-- consume_span --
-- consume_many of a run of consecutive slots first .. first + n - 1 whose
-- seqs are the slot plus one offset (a batch claimed in one stretch, the
-- usual one): one range of the primary key instead of n lookups, guarded
-- the same way.
WITH u AS (
    UPDATE {table} AS t
    SET state = 2, deq_at = now(), deq_user = current_user
    WHERE t.slot >= %s::integer AND t.slot < %s::integer AND t.seq = t.slot + %s::bigint
      AND t.state = 1 AND (t.not_before IS NULL OR t.not_before <= clock_timestamp())
    RETURNING 1
)
SELECT ringq.expect_rows((SELECT count(*) FROM u)::integer, %s::integer, {queue})

-- strike --
-- A delivery that did not commit: count it; at max_deliveries the entry moves
-- to ringq.exceptions (with the reason) and its slot is consumed. When the
-- queue names an exception queue, the same statement also puts the entry on
-- it: into ringq.inbox, which the monitor (or any linked client) moves into
-- that queue's ring in order, since ring slots are reserved only through the
-- section. An exception queue that does not exist (dropped after this queue
-- was made) or takes smaller payloads is named in the reason, and the entry
-- stays in ringq.exceptions only. Returns each struck row, the exception
-- queue it was put on (or NULL) and why not (or NULL).
-- An entry that comes back waits for the queue's backoff: retry_delay *
-- retry_factor ^ (deliveries before this one), at most retry_max (0: no
-- cap; never past 1e9 s), from the database's clock; retry_delay 0 (or a
-- schema without the columns): due at once. The last columns are its due
-- time in us (NULL: due at once) and the database's clock, for the section.
WITH r AS (
    SELECT coalesce((to_jsonb(q) ->> 'retry_delay')::float8, 0) AS delay,
           coalesce((to_jsonb(q) ->> 'retry_factor')::float8, 1) AS factor,
           coalesce(nullif((to_jsonb(q) ->> 'retry_max')::float8, 0), 1e9) AS cap
    FROM ringq.queues q WHERE q.id = %(queue_id)s::integer
), s AS (
    UPDATE {table}
    SET deliveries = deliveries + 1,
        state = CASE WHEN deliveries + 1 >= %(max_deliveries)s THEN 2 ELSE 1 END,
        deq_at = CASE WHEN deliveries + 1 >= %(max_deliveries)s THEN now() END,
        not_before = (SELECT clock_timestamp() + make_interval(secs => least(
                                 r.cap, 1e9, r.delay * power(r.factor, least(deliveries, 60))))
                      FROM r WHERE r.delay > 0)
    WHERE slot = ANY(%(slots)s::integer[]) AND seq = ANY(%(seqs)s::bigint[]) AND state = 1
    RETURNING slot, seq, state, deliveries, payload, producer, producer_seq, enq_at, msg_group,
              not_before, trace
), d AS (
    SELECT v.qid, src.exception_queue AS to_name, e.id AS to_id, e.max_payload AS to_max
    FROM (VALUES (%(queue_id)s::integer)) AS v(qid)
    LEFT JOIN ringq.queues src ON src.id = v.qid
    LEFT JOIN ringq.queues e ON e.name = src.exception_queue
), f AS (
    SELECT s.seq, s.payload, s.producer, s.producer_seq, s.enq_at, s.deliveries, s.msg_group,
           s.trace, d.qid, d.to_name, d.to_id,
           CASE WHEN d.to_name IS NULL THEN NULL
                WHEN d.to_id IS NULL THEN 'exception queue "' || d.to_name || '" does not exist'
                WHEN octet_length(s.payload) > d.to_max
                    THEN 'exception queue "' || d.to_name || '" takes payloads up to ' || d.to_max || ' bytes'
           END AS why_not
    FROM s CROSS JOIN d
    WHERE s.state = 2
), x AS (
    INSERT INTO ringq.exceptions (queue_id, seq, payload, producer, producer_seq, enq_at,
                                  deliveries, msg_group, trace, reason)
    SELECT qid, seq, payload, producer, producer_seq, enq_at, deliveries, msg_group, trace,
           %(reason)s || coalesce('; kept here only: ' || why_not, '')
    FROM f
    ON CONFLICT DO NOTHING
    RETURNING seq
), i AS (
    -- Only entries recorded just now (x), so a repeated strike adds nothing.
    INSERT INTO ringq.inbox (queue_id, payload, producer, msg_group)
    SELECT f.to_id, f.payload, 'ringq:poison:' || coalesce(f.producer, '-'), f.msg_group
    FROM f JOIN x ON x.seq = f.seq
    WHERE f.to_id IS NOT NULL AND f.why_not IS NULL
    ORDER BY f.seq
    RETURNING queue_id
), n AS (
    -- Wake the monitor's inbox mover (delivered at commit), as ringq.enqueue() does.
    SELECT count(*) AS n FROM (
        SELECT pg_notify('ringq_inbox', d.to_name) FROM d WHERE EXISTS (SELECT 1 FROM i)
    ) AS z
)
SELECT s.slot, s.seq, s.state, s.deliveries,
       CASE WHEN f.why_not IS NULL THEN f.to_name END, f.why_not, s.msg_group,
       CASE WHEN s.state = 1 THEN (extract(epoch FROM s.not_before) * 1000000)::bigint END,
       (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
FROM s LEFT JOIN f ON f.seq = s.seq CROSS JOIN n

-- retry_after --
-- A rolled-back delivery whose consumer asked for a delay of its own (the
-- worker's Retry(after=)): sent after the strike, in the same round trip;
-- its due time wins over the queue's backoff. Returns (slot, seq, due us,
-- the database's clock).
UPDATE {table}
SET not_before = clock_timestamp() + make_interval(secs => %s::float8)
WHERE slot = ANY(%s::integer[]) AND seq = ANY(%s::bigint[]) AND state = 1
RETURNING slot, seq, (extract(epoch FROM not_before) * 1000000)::bigint,
          (extract(epoch FROM clock_timestamp()) * 1000000)::bigint

-- rows --
-- The last column: a queued entry's due time in us while it is in the future
-- (the database's clock), else NULL.
SELECT slot, state, seq, msg_group,
       CASE WHEN state = 1 AND not_before > clock_timestamp()
            THEN (extract(epoch FROM not_before) * 1000000)::bigint END
FROM {table} WHERE slot = ANY(%s::integer[])

-- in_doubt_rows --
SELECT slot, state, seq, producer, producer_seq FROM {table} WHERE slot = ANY(%s::integer[])

-- all_rows --
-- (the group of queued entries only: the section tags ready and held slots;
-- the due time in us of queued entries not due yet, and the database's clock)
SELECT slot, state, seq, CASE WHEN state = 1 THEN msg_group END,
       CASE WHEN state = 1 AND not_before > clock_timestamp()
            THEN (extract(epoch FROM not_before) * 1000000)::bigint END,
       (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
FROM {table}

-- held_slots --
-- (slot, seq) of prepared two-phase transactions in one queue: in doubt until resolved.
SELECT l.slot, l.seq FROM ringq.tpc_log l JOIN pg_prepared_xacts p ON p.gid = l.gid
WHERE l.queue_id = %s

-- offered_slots --
-- (slot, seq) of the entries set aside for SQL consumers in one queue (ringq.dequeue).
SELECT o.slot + g, o.seq + g FROM ringq.offers o, generate_series(0, o.n - 1) AS g
WHERE o.queue_id = %s

-- has_offers --
-- Whether the schema has SQL consumers' table (a database made before has none).
SELECT to_regclass('ringq.offers') IS NOT NULL

-- prepared_slots --
-- (queue id, slot) of every prepared two-phase transaction's slots.
SELECT l.queue_id, l.slot FROM ringq.tpc_log l JOIN pg_prepared_xacts p ON p.gid = l.gid

-- backend_pid --
SELECT pg_backend_pid()

-- backends_started --
-- The backends of this database among the pids, and when each started (epoch seconds).
SELECT pid, extract(epoch FROM backend_start) FROM pg_stat_activity
WHERE pid = ANY(%s) AND datname = current_database()

-- backends_in_transaction --
-- The backends among the pids that may still end a transaction (committing or
-- not): any state but idle. A pid not listed has ended, or sits outside any
-- transaction, so rows it wrote are decided.
SELECT pid, state IS DISTINCT FROM 'idle' OR backend_xid IS NOT NULL
FROM pg_stat_activity WHERE pid = ANY(%s::integer[])

-- backend_alive --
-- The backend's start (epoch seconds), if the pid is a backend.
SELECT extract(epoch FROM backend_start) FROM pg_stat_activity WHERE pid = %s

-- backend_state --
SELECT pid, state, backend_xid IS NOT NULL OR state LIKE 'idle in transaction%%'
FROM pg_stat_activity WHERE pid = ANY(%s::integer[])

-- terminate --
SELECT pg_terminate_backend(%s)

-- terminate_started_by --
-- End the backend only if it started by then (epoch seconds): a later one
-- with the same pid is another backend.
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE pid = %s AND backend_start <= to_timestamp(%s)

-- tpc_log --
INSERT INTO ringq.tpc_log (gid, queue_id, slot, seq, kind)
SELECT %(gid)s, q, s, n, k
FROM unnest(%(queue_ids)s::integer[], %(slots)s::integer[], %(seqs)s::bigint[], %(kinds)s::"char"[])
    AS v(q, s, n, k)
ON CONFLICT DO NOTHING

-- tpc_slots --
SELECT queue_id, slot, seq, kind FROM ringq.tpc_log WHERE gid = %s

-- tpc_forget --
DELETE FROM ringq.tpc_log WHERE gid = %s

-- tpc_log_unprepared --
-- Slot logs of transactions not prepared (now): committed or rolled back
-- while their session could not clear the log, never prepared (the session
-- died first), or about to be (the session is between its log and PREPARE).
SELECT l.gid, l.queue_id, l.slot FROM ringq.tpc_log l
WHERE NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p WHERE p.gid = l.gid)

-- tpc_forget_unprepared --
DELETE FROM ringq.tpc_log l WHERE l.gid = ANY(%s)
AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p WHERE p.gid = l.gid)

-- tpc_is_prepared --
SELECT 1 FROM pg_prepared_xacts WHERE gid = %s

-- tpc_decide --
INSERT INTO ringq.tpc_decisions (gid) VALUES (%s) ON CONFLICT DO NOTHING

-- tpc_undecide --
DELETE FROM ringq.tpc_decisions WHERE gid = %s

-- tpc_decisions_expire --
-- Decisions older than the timeout (seconds) whose gid is no longer prepared.
DELETE FROM ringq.tpc_decisions d WHERE d.decided_at < now() - make_interval(secs => %s)
AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p WHERE p.gid = d.gid)

-- tpc_prepared --
-- This database's prepared transactions: gid, age (s), whether a decision is
-- recorded, its age (s), and whether it logged slots.
SELECT p.gid, extract(epoch FROM now() - p.prepared), d.gid IS NOT NULL,
       coalesce(extract(epoch FROM now() - d.decided_at), 0),
       EXISTS (SELECT 1 FROM ringq.tpc_log l WHERE l.gid = p.gid)
FROM pg_prepared_xacts p LEFT JOIN ringq.tpc_decisions d ON d.gid = p.gid
WHERE p.database = current_database()

-- commit_prepared --
COMMIT PREPARED {gid}

-- rollback_prepared --
ROLLBACK PREPARED {gid}

-- inbox_take --
DELETE FROM ringq.inbox
WHERE id IN (SELECT id FROM ringq.inbox WHERE queue_id = %s ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id, payload, producer, msg_group

-- listen_events --
-- Named events (engine/_events.py) travel on one channel: {channel}, filled
-- only with psycopg.sql.Identifier.
LISTEN {channel}

-- notify_event --
SELECT pg_notify(%s, %s)

-- offers_queues --
-- The queues with entries set aside for SQL consumers (ringq.dequeue), and
-- those SQL consumers wait for (ringq.waiters: an ask the agent may have
-- missed while it was away): queue id, whether it is waited for.
SELECT DISTINCT queue_id, false FROM ringq.offers
UNION
SELECT DISTINCT queue_id, true FROM ringq.waiters

-- offers_look --
-- One pass of the agent over a queue's listing: its chunks (kind 0: seq,
-- slot, n, whether a take touched the chunk (its xmax: a take under way, or
-- one that did not commit), and whether that xmax is a transaction running
-- now (a take under way; a prepared one is not listed there, and
-- offers_touched, which locks, still tells it apart)), then the number of
-- waiting SQL consumers and the entries they asked for (kind 1, in seq and
-- slot).
SELECT 0, o.seq, o.slot, o.n, o.xmax <> '0'::xid,
       -- read once per statement (an InitPlan), and only when a row gets here
       CASE WHEN o.xmax <> '0'::xid THEN o.xmax = ANY(ARRAY(
           SELECT a.backend_xid FROM pg_stat_activity a WHERE a.backend_xid IS NOT NULL))
       END
FROM ringq.offers o WHERE o.queue_id = %(queue_id)s
UNION ALL
SELECT 1, count(*), coalesce(sum(w.want), 0), NULL, NULL, NULL FROM ringq.waiters w
WHERE w.queue_id = %(queue_id)s

-- offers_gone --
-- Entries the agent listed that are no longer listed (runs: slot, seq, n),
-- checked by their rows: only those NOT consumed at that seq come back
-- (slot, seq, state or NULL when the row holds another seq now, due time in
-- epoch us while in the future). A chunk deleted by a take that committed
-- was consumed with it (the take is all or nothing), so this is nearly
-- always empty.
SELECT r.slot, s.seq + (r.slot - s.slot),
       CASE WHEN r.seq = s.seq + (r.slot - s.slot) THEN r.state END,
       CASE WHEN r.state = 1 AND r.not_before > clock_timestamp()
            THEN (extract(epoch FROM r.not_before) * 1000000)::bigint END
FROM unnest(%s::bigint[], %s::integer[], %s::integer[]) AS s(seq, slot, n)
JOIN {table} r ON r.slot >= s.slot AND r.slot < s.slot + s.n
WHERE NOT (r.seq = s.seq + (r.slot - s.slot) AND r.state = 2)

-- offers_touched --
-- The touched chunks (seqs) that no take holds now, locked for the strike
-- that follows in the same transaction: a live take's lock, a prepared one's
-- too, makes SKIP LOCKED pass its chunk.
SELECT o.seq, o.slot, o.n FROM ringq.offers o
WHERE o.queue_id = %s AND o.seq = ANY(%s::bigint[]) AND o.xmax <> '0'::xid
FOR UPDATE SKIP LOCKED

-- offers_aborted --
-- The rows of locked touched chunks (runs: seq, slot, n) that a take updated
-- and did not commit: still queued at that seq, the take's xid in xmax (the
-- agent cleans a row's xmax before listing it, offers_clean_runs).
SELECT r.slot, r.seq
FROM unnest(%s::bigint[], %s::integer[], %s::integer[]) AS s(seq, slot, n)
JOIN {table} r ON r.slot >= s.slot AND r.slot < s.slot + s.n
WHERE r.seq = s.seq + (r.slot - s.slot) AND r.state = 1 AND r.xmax <> '0'::xid

-- offers_unlist --
-- Chunks (seqs) deleted from a queue's listing, in the agent's transaction.
DELETE FROM ringq.offers WHERE queue_id = %s AND seq = ANY(%s::bigint[])

-- offers_withdraw --
-- Taking chunks back from a single queue (nobody asked for it lately, or its
-- order after a strike): every chunk no take touched, under offers_quiet's
-- lock (no take under way), in one transaction with it.
DELETE FROM ringq.offers WHERE queue_id = %s AND xmax = '0'::xid RETURNING seq, slot, n

-- offers_withdraw_shared --
-- Taking chunks back from a shared queue (nobody asked for it lately): the
-- chunks no take touched or holds, each locked first (SKIP LOCKED: a take
-- that locked one keeps it; one that comes after finds it gone).
DELETE FROM ringq.offers o WHERE o.queue_id = %s AND o.seq IN (
    SELECT x.seq FROM ringq.offers x WHERE x.queue_id = %s AND x.xmax = '0'::xid
    FOR UPDATE SKIP LOCKED)
RETURNING o.seq, o.slot, o.n

-- offers_wake --
-- Wake waiting SQL consumers of a queue (id, name, n), enough to take n
-- entries, delivered at commit.
SELECT ringq.wake(%s, %s, %s)

-- waiters_gone --
-- The waiter rows of backends that ended while they waited.
DELETE FROM ringq.waiters w
WHERE NOT EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = w.pid)

-- offers_clean_runs --
-- Rows about to be listed (runs: seq, slot, n, as offers_runs) written again
-- (same values) where their xmax is not 0 (a linked client's rollback can
-- leave its xid there), so that a listed row shows xmax 0 unless a take of
-- it did not commit (offers_aborted); a range of the primary key per run.
UPDATE {table} AS r SET state = r.state
FROM unnest(%(run_seqs)s::bigint[], %(run_slots)s::integer[], %(run_ns)s::integer[])
    AS s(seq, slot, n)
WHERE r.slot >= s.slot AND r.slot < s.slot + s.n AND r.seq = s.seq + (r.slot - s.slot)
  AND r.state = 1 AND r.xmax <> '0'::xid

-- offers_runs --
INSERT INTO ringq.offers (queue_id, seq, slot, n)
SELECT %(queue_id)s, s.seq, s.slot, s.n
FROM unnest(%(run_seqs)s::bigint[], %(run_slots)s::integer[], %(run_ns)s::integer[])
    AS s(seq, slot, n)

-- offers_quiet --
-- Taking back chunks of a single queue: only while no SQL dequeue of the
-- queue is under way (its take holds this lock for its transaction), so none
-- can take them after.
SELECT pg_try_advisory_xact_lock(hashtext('ringq.dequeue'), %s)

-- offers_overdue --
-- SQL consumers whose transaction has held a listed chunk longer than the
-- queue's lease: the backend whose transaction id is the chunk's xmax (a
-- take under way) and whose transaction started longer ago than the lease.
SELECT DISTINCT a.pid
FROM ringq.offers o JOIN pg_stat_activity a ON a.backend_xid = o.xmax
WHERE o.queue_id = %s AND o.xmax <> '0'::xid
  AND a.xact_start < now() - make_interval(secs => %s)

-- offers_end --
SELECT pg_terminate_backend(%s)

-- slots_look --
-- A queue's chunks of slots reserved for SQL producers (ringq.slots): seq,
-- slot, n, whether a put touched the chunk (its xmax), whether that xmax is
-- a transaction running now (a put under way); then whether the inbox's
-- oldest entry for the queue has waited longer than stalled_ms (a put
-- moves the inbox's entries into chunks first; one that none moved, the
-- agent takes the chunks back for the pump to move it).
SELECT s.seq, s.slot, s.n, s.xmax <> '0'::xid,
       CASE WHEN s.xmax <> '0'::xid THEN s.xmax = ANY(ARRAY(
           SELECT a.backend_xid FROM pg_stat_activity a WHERE a.backend_xid IS NOT NULL))
       END
FROM ringq.slots s WHERE s.queue_id = %(queue_id)s
UNION ALL
-- and a last row (seq NULL): whether the inbox's oldest entry waited that long
SELECT NULL, NULL, NULL, NULL,
       coalesce((SELECT i.enqueued_at FROM ringq.inbox i WHERE i.queue_id = %(queue_id)s
                 ORDER BY i.id LIMIT 1)
                < clock_timestamp() - make_interval(secs => %(stalled_ms)s / 1000.0), false)

-- slots_list --
INSERT INTO ringq.slots (queue_id, seq, slot, n)
SELECT %(queue_id)s, s.seq, s.slot, s.n
FROM unnest(%(run_seqs)s::bigint[], %(run_slots)s::integer[], %(run_ns)s::integer[])
    AS s(seq, slot, n)

-- slots_filled --
-- Reserved slots no longer listed (runs: seq, slot, n), by their rows: those
-- where a put wrote an entry at that seq. First one row with the slots of
-- the entries of no group due at once (an array: a batch's usual) and, when
-- %(cache)s (linked dequeuers read the queue's payload cache), the payloads,
-- producers, producer seqs, enq_at in us and slots of those a record holds
-- (only those: a pass reads no payload it cannot cache); then a row per other entry: slot, its group, its due time in
-- epoch us while in the future. The rest were left void.
WITH f AS (
    SELECT r.slot, r.msg_group AS grp,
           CASE WHEN r.not_before > clock_timestamp()
                THEN (extract(epoch FROM r.not_before) * 1000000)::bigint END AS due,
           r.payload, r.producer, r.producer_seq, r.enq_at, r.trace
    FROM unnest(%(run_seqs)s::bigint[], %(run_slots)s::integer[], %(run_ns)s::integer[])
         AS s(seq, slot, n)
    JOIN {table} r ON r.slot >= s.slot AND r.slot < s.slot + s.n
    WHERE r.seq = s.seq + (r.slot - s.slot) AND r.state = 1
), p AS (
    SELECT * FROM f WHERE f.grp IS NULL AND f.due IS NULL
), c AS (  -- those a cache record holds: no trace, payload and producer that fit
    SELECT array_agg(p.payload) AS payloads, array_agg(p.producer) AS producers,
           array_agg(p.producer_seq) AS pseqs,
           array_agg((extract(epoch FROM p.enq_at) * 1000000)::bigint) AS enq_us,
           array_agg(p.slot) AS slots
    FROM p
    WHERE %(cache)s AND p.trace IS NULL AND octet_length(p.payload) <= %(cache_payload)s
      AND octet_length(p.producer) <= %(cache_producer)s
)
SELECT NULL::integer, coalesce((SELECT array_agg(p.slot) FROM p), '{{}}'), NULL::text,
       NULL::bigint, c.payloads, c.producers, c.pseqs, c.enq_us, c.slots
FROM c
UNION ALL
SELECT f.slot, NULL, f.grp, f.due, NULL, NULL, NULL, NULL, NULL
FROM f WHERE f.grp IS NOT NULL OR f.due IS NOT NULL

-- slots_unlist_touched --
-- Chunks (seqs) a put touched and did not commit, those no transaction
-- holds now (SKIP LOCKED: a prepared put keeps its chunk), unlisted.
DELETE FROM ringq.slots s WHERE s.queue_id = %(queue_id)s AND s.seq IN (
    SELECT x.seq FROM ringq.slots x
    WHERE x.queue_id = %(queue_id)s AND x.seq = ANY(%(seqs)s::bigint[]) AND x.xmax <> '0'::xid
    FOR UPDATE SKIP LOCKED)
RETURNING s.seq, s.slot, s.n

-- slots_withdraw --
-- Unused chunks (seqs) taken back: those no put holds (SKIP LOCKED).
DELETE FROM ringq.slots s WHERE s.queue_id = %(queue_id)s AND s.seq IN (
    SELECT x.seq FROM ringq.slots x
    WHERE x.queue_id = %(queue_id)s AND x.seq = ANY(%(seqs)s::bigint[]) AND x.xmax = '0'::xid
    FOR UPDATE SKIP LOCKED)
RETURNING s.seq, s.slot, s.n

-- reserved_slots --
-- (slot, seq) of the slots reserved for SQL producers in one queue (ringq.slots).
SELECT s.slot + g, s.seq + g FROM ringq.slots s, generate_series(0, s.n - 1) AS g
WHERE s.queue_id = %s

-- has_slots --
-- Whether the schema has SQL producers' reserved slots (a database made before has none).
SELECT to_regclass('ringq.slots') IS NOT NULL

-- agent_schema --
-- Whether the schema has what this agent writes (a database made by an older
-- ringq gets it from `ringq db upgrade`).
SELECT to_regclass('ringq.waiters') IS NOT NULL AND to_regclass('ringq.slots') IS NOT NULL

-- agent_listen --
-- The agent's connection: hears SQL consumers' asks (ringq.dequeue found
-- nothing) and SQL producers' batches (ringq.enqueue_many: into reserved
-- slots, or into the inbox when it found none).
LISTEN ringq_want

-- agent_listen_puts --
LISTEN ringq_put

-- agent_async_commit --
-- The agent's own commits (its listings) need not wait for the WAL flush: a
-- take that commits flushes the listing it saw before it (the WAL is one
-- sequence), and a listing lost in a crash is made again from the rows.
SET synchronous_commit = off

-- agent_index_scans --
-- For the rest of the agent's transaction (an implicit one: a pipeline): its
-- statements find ring rows by ranges of the primary key (a run of slots
-- each); the planner, costing a join with an unnest() it cannot count,
-- chose a scan of the whole ring (35 ms for 16 entries listed). Only there:
-- set for the whole connection, it made the agent slow enough elsewhere to
-- miss a single queue's turns.
SELECT set_config('enable_seqscan', 'off', true)

-- agent_sync_commit --
-- One transaction of the agent's durable at once (its strikes).
SET LOCAL synchronous_commit = on

-- one_snapshot --
-- First in a transaction that reads a queue's rows and the SQL path's
-- listings to load its block: every read sees the same snapshot (read one by
-- one, a put committing between the rows and ringq.slots left its entries
-- neither queued nor reserved in the block: stranded).
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ
