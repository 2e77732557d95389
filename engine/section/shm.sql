-- What ringq.engine._shm asks a server to tell which global sections on
-- this host still have a database.

-- history --
-- The cluster's system identifier (0 where the role may not read it).
SELECT CASE WHEN has_function_privilege('pg_control_system()', 'execute')
            THEN (SELECT system_identifier FROM pg_control_system()) ELSE 0 END

-- databases --
SELECT datname FROM pg_database WHERE datallowconn AND NOT datistemplate ORDER BY datname

-- has_meta --
SELECT to_regclass('ringq.meta') IS NOT NULL

-- instance_id --
SELECT value FROM ringq.meta WHERE key = 'instance_id'
