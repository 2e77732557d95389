-- Runtime SQL of ringq.scripting beside its DDL (ddl.sql) and the queue
-- administration's queries (admin.sql): what the DDL functions look up.
-- Loaded once by scripting/_queries.py.

-- schema_present --
-- Whether ringq's schema exists at all (the queue administration asks too).
SELECT to_regclass('ringq.queues') IS NOT NULL

-- queue_exists --
SELECT 1 FROM ringq.queues WHERE name = %s

-- queue_section --
-- A queue's id and its database's section name: what names its wake-up
-- semaphores on this host.
SELECT q.id, m.value FROM ringq.queues q
LEFT JOIN ringq.meta m ON m.key = 'instance_id'
WHERE q.name = %s
