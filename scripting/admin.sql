-- Queries of queue administration (`ringq queue list|show|exceptions|requeue|discard`).
-- {table} is the queue's table, filled only with psycopg.sql.Identifier from a
-- validated name.

-- list_queues --
-- depth: committed entries waiting, in the ring and in the SQL inbox.
SELECT name, capacity, ringq.depth(name), max_payload, dequeue_mode, full_policy
FROM ringq.queues
ORDER BY name

-- describe_queue --
-- lease through to_jsonb: a schema made before the column reads the default.
SELECT q.id, q.name, q.capacity, q.max_payload, q.full_policy, q.full_timeout, q.dequeue_mode,
       q.max_deliveries, q.exception_queue, coalesce((to_jsonb(q) ->> 'lease')::float8, 300),
       coalesce((to_jsonb(q) ->> 'cache_payload')::integer, 0),
       q.fillfactor, q.tablespace, q.created_at,
       ringq.depth(q.name),
       (SELECT count(*) FROM ringq.inbox i WHERE i.queue_id = q.id),
       (SELECT count(*) FROM ringq.exceptions x WHERE x.queue_id = q.id)
FROM ringq.queues q
WHERE q.name = %s

-- ring_states --
-- Slots by state (0 free, 1 queued, 2 consumed and not yet reclaimed).
SELECT count(*) FILTER (WHERE state = 0),
       count(*) FILTER (WHERE state = 1),
       count(*) FILTER (WHERE state = 2)
FROM {table}

-- ring_storage --
-- Size on disk (table, index, TOAST) and the statistics collector's dead row
-- versions: a ring that grows or keeps dead rows means something holds back
-- pruning (an old snapshot, a session idle in transaction).
SELECT pg_total_relation_size(c.oid), coalesce(s.n_dead_tup, 0)
FROM pg_class c
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = %s::regclass

-- queue_id --
SELECT id FROM ringq.queues WHERE name = %s

-- list_exceptions --
-- A queue's poison entries, oldest move first. size: payload bytes.
SELECT seq, deliveries, reason, moved_at, octet_length(payload), producer, producer_seq, enq_at,
       msg_group
FROM ringq.exceptions
WHERE queue_id = %s
ORDER BY moved_at, seq

-- requeue_exception --
-- One statement, so the entry is in ringq.exceptions or in the inbox, never
-- both and never neither. The inbox is the SQL path onto the ring: the
-- monitor (or any linked client) moves it in, since ring slots are reserved
-- only through the section. The entry comes back as a new one (a new seq,
-- deliveries from 0), by its original producer, in its group (at the group's end).
WITH x AS (
    DELETE FROM ringq.exceptions
    WHERE queue_id = %s AND seq = %s
    RETURNING queue_id, payload, producer, msg_group
)
INSERT INTO ringq.inbox (queue_id, payload, producer, msg_group)
SELECT queue_id, payload, 'ringq:requeue:' || coalesce(producer, 'sql:' || current_user), msg_group
FROM x
RETURNING id

-- discard_exception --
DELETE FROM ringq.exceptions
WHERE queue_id = %s AND seq = %s
RETURNING seq

-- inbox_notify --
-- Wakes the monitor's inbox mover (delivered at commit), as ringq.enqueue() does.
SELECT pg_notify('ringq_inbox', %s)

-- exception_queue_of --
-- The queues that name this one as their exception queue.
SELECT name FROM ringq.queues WHERE exception_queue = %s ORDER BY name

-- section_ids --
-- The database's section name and every queue id it ever gave (dropped
-- queues' too: their wake-up semaphores may still be on this host).
SELECT (SELECT value FROM ringq.meta WHERE key = 'instance_id'),
       coalesce(pg_sequence_last_value(pg_get_serial_sequence('ringq.queues', 'id')), 0)

-- snapshot --
-- The first statement of a transaction that reads several figures which must
-- agree with each other: one snapshot, and nothing written.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY
