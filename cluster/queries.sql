-- Runtime SQL of ringq.cluster: the embedded cluster's database, and the
-- standby as its primary sees it. Loaded once by cluster/_queries.py.
-- {database} is filled only with psycopg.sql.Identifier.

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
