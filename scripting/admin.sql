-- Read-only queries of queue administration (`ringq queue list|show`).
-- {table} is the queue's table, filled only with psycopg.sql.Identifier from a
-- validated name.

-- schema_present --
SELECT to_regclass('ringq.queues') IS NOT NULL

-- list_queues --
-- depth: committed entries waiting, in the ring and in the SQL inbox.
SELECT name, capacity, ringq.depth(name), max_payload, dequeue_mode, full_policy
FROM ringq.queues
ORDER BY name

-- describe_queue --
SELECT q.id, q.name, q.capacity, q.max_payload, q.full_policy, q.full_timeout, q.dequeue_mode,
       q.max_deliveries, q.exception_queue, q.fillfactor, q.tablespace, q.created_at,
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
