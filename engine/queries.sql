-- Runtime SQL of the engine. {table} is the queue's table, filled only with
-- psycopg.sql.Identifier from a validated name. %b marks binary parameters.

-- instance --
SELECT (SELECT value FROM ringq.meta WHERE key = 'instance_id'),
       (SELECT value FROM ringq.meta WHERE key = 'schema_version'),
       pg_backend_pid()

-- queue_info --
SELECT id, name, capacity, max_payload, full_policy, full_timeout, dequeue_mode,
       max_deliveries, exception_queue
FROM ringq.queues WHERE name = %s

-- queue_by_id --
SELECT id, name, capacity, max_payload, full_policy, full_timeout, dequeue_mode,
       max_deliveries, exception_queue
FROM ringq.queues WHERE id = %s

-- enqueue --
-- Guarded: only a slot that holds no unconsumed entry and an older sequence
-- is written, so a stale section can never overwrite an entry.
UPDATE {table}
SET state = 1, seq = %s::bigint, payload = %b, producer = %s, producer_seq = %s::bigint, deliveries = 0,
    enq_at = now(), enq_user = current_user, deq_at = NULL, deq_user = NULL
WHERE slot = %s::integer AND state <> 1 AND seq < %s::bigint

-- enqueue_key --
WITH k AS (
    INSERT INTO ringq.keys (queue_id, key, seq) VALUES (%s::integer, %s, %s::bigint)
    ON CONFLICT DO NOTHING RETURNING seq
), u AS (
    UPDATE {table}
    SET state = 1, seq = %s::bigint, payload = %b, producer = %s, producer_seq = %s::bigint, deliveries = 0,
        enq_at = now(), enq_user = current_user, deq_at = NULL, deq_user = NULL
    WHERE slot = %s::integer AND state <> 1 AND seq < %s::bigint AND EXISTS (SELECT 1 FROM k)
    RETURNING slot
)
SELECT (SELECT count(*) FROM k), (SELECT count(*) FROM u),
       (SELECT seq FROM ringq.keys WHERE queue_id = %s AND key = %s)

-- key_forget --
DELETE FROM ringq.keys WHERE queue_id = %s AND key = %s AND seq = %s

-- enqueue_many --
UPDATE {table} AS t
SET state = 1, seq = v.seq, payload = v.payload, producer = %s, producer_seq = v.pseq,
    deliveries = 0, enq_at = now(), enq_user = current_user, deq_at = NULL, deq_user = NULL
FROM unnest(%s::integer[], %s::bigint[], %b::bytea[], %s::bigint[]) AS v(slot, seq, payload, pseq)
WHERE t.slot = v.slot AND t.state <> 1 AND t.seq < v.seq
RETURNING t.slot

-- dequeue --
-- Guarded by (slot, seq, state): an entry is consumed at most once.
UPDATE {table}
SET state = 2, deq_at = now(), deq_user = current_user
WHERE slot = %s::integer AND seq = %s::bigint AND state = 1
RETURNING payload, producer, producer_seq, enq_at, deliveries

-- dequeue_many --
UPDATE {table} AS t
SET state = 2, deq_at = now(), deq_user = current_user
FROM unnest(%s::integer[], %s::bigint[]) AS v(slot, seq)
WHERE t.slot = v.slot AND t.seq = v.seq AND t.state = 1
RETURNING t.slot, t.seq, t.payload, t.producer, t.producer_seq, t.enq_at, t.deliveries

-- strike --
-- A delivery that did not commit: count it; at max_deliveries the entry moves
-- to ringq.exceptions and its slot is consumed.
WITH s AS (
    UPDATE {table}
    SET deliveries = deliveries + 1,
        state = CASE WHEN deliveries + 1 >= %s THEN 2 ELSE 1 END,
        deq_at = CASE WHEN deliveries + 1 >= %s THEN now() END
    WHERE slot = ANY(%s::integer[]) AND seq = ANY(%s::bigint[]) AND state = 1
    RETURNING slot, seq, state, deliveries, payload, producer, producer_seq, enq_at
), x AS (
    INSERT INTO ringq.exceptions (queue_id, seq, payload, producer, producer_seq, enq_at,
                                  deliveries, reason)
    SELECT %s, seq, payload, producer, producer_seq, enq_at, deliveries, %s
    FROM s WHERE state = 2
    ON CONFLICT DO NOTHING
)
SELECT slot, seq, state, deliveries FROM s

-- rows --
SELECT slot, state, seq FROM {table} WHERE slot = ANY(%s::integer[])

-- all_rows --
SELECT slot, state, seq FROM {table}

-- backend_alive --
SELECT count(*) FROM pg_stat_activity WHERE pid = %s

-- backend_state --
SELECT pid, state, backend_xid IS NOT NULL OR state LIKE 'idle in transaction%%'
FROM pg_stat_activity WHERE pid = ANY(%s::integer[])

-- terminate --
SELECT pg_terminate_backend(%s)

-- tpc_log --
INSERT INTO ringq.tpc_log (gid, queue_id, slot, seq, kind)
SELECT %s, q, s, n, k FROM unnest(%s::integer[], %s::integer[], %s::bigint[], %s::"char"[]) AS v(q, s, n, k)
ON CONFLICT DO NOTHING

-- tpc_forget --
DELETE FROM ringq.tpc_log WHERE gid = %s

-- tpc_decide --
INSERT INTO ringq.tpc_decisions (gid) VALUES (%s) ON CONFLICT DO NOTHING

-- tpc_undecide --
DELETE FROM ringq.tpc_decisions WHERE gid = %s

-- inbox_take --
DELETE FROM ringq.inbox
WHERE id IN (SELECT id FROM ringq.inbox WHERE queue_id = %s ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id, payload, producer
