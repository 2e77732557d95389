-- Runtime SQL of ringq.scripting beside its DDL (ddl.sql) and the queue
-- administration's queries (admin.sql): what the DDL functions look up, and
-- the embedded cluster's database. Loaded once by scripting/_queries.py.
-- {database} is filled only with psycopg.sql.Identifier.

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

-- database_exists --
SELECT 1 FROM pg_database WHERE datname = %s

-- create_database --
CREATE DATABASE {database}

-- in_recovery --
-- Whether a server is a standby (replaying WAL) or a primary.
SELECT pg_is_in_recovery()

-- create_slot --
-- The standby's physical replication slot on the primary, made once and
-- reserving WAL from now: the primary keeps what the standby has not received.
SELECT pg_create_physical_replication_slot(%(slot)s, true)
WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = %(slot)s)

-- drop_slot --
SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
WHERE slot_name = %s AND NOT active

-- replication_state --
-- The standby as the primary sees it: walsender state (streaming, catchup …),
-- sync_state (sync, async, potential) and how many bytes of WAL it has not
-- replayed yet.
SELECT state, sync_state, pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint
FROM pg_stat_replication WHERE application_name = %s
ORDER BY backend_start DESC LIMIT 1

-- checkpoint --
CHECKPOINT

-- slot_exists --
SELECT 1 FROM pg_replication_slots WHERE slot_name = %s
