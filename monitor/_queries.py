"""Named SQL of the monitor: the only module here that holds SQL text.

(Kept as a module rather than a ``.sql`` file so the wheel needs no extra
package-data entry; the blocks are the same plain constants, never formatted
with Python string operations.)
"""

from __future__ import annotations

from typing import Final

# One monitor per database: a session-level advisory lock, released by the
# server when the monitor's connection ends (kill -9 included).
TRY_MONITOR_LOCK: Final = "SELECT pg_try_advisory_lock(hashtext('ringq.monitor'))"

MONITOR_LOCK_HOLDER: Final = """
SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objid = hashtext('ringq.monitor')::oid AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
LIMIT 1
"""

INSTANCE_ID: Final = "SELECT value FROM ringq.meta WHERE key = 'instance_id'"

QUEUES: Final = "SELECT id, name, capacity FROM ringq.queues ORDER BY id"

EXCEPTION_COUNTS: Final = "SELECT queue_id, count(*) FROM ringq.exceptions GROUP BY queue_id"

# Entries moved to the exception table lately (the window is wider than any
# transaction the monitor could miss between two passes; the caller keeps
# the keys it has already announced).
RECENT_EXCEPTIONS: Final = """
SELECT e.queue_id, q.name, e.seq, e.producer, e.producer_seq, e.deliveries, e.reason,
       extract(epoch FROM e.moved_at)::float8
FROM ringq.exceptions e LEFT JOIN ringq.queues q ON q.id = e.queue_id
WHERE e.moved_at > now() - make_interval(secs => %s)
ORDER BY e.moved_at, e.queue_id, e.seq
"""

# The design's known enemy: an open snapshot stops pruning, so even a fixed
# size ring table grows. Age (seconds) of the oldest transaction holding back
# the xmin horizon in this database, and dead row versions per queue table.
XMIN_HORIZON_AGE: Final = """
SELECT coalesce(max(extract(epoch FROM now() - xact_start)), 0)::float8
FROM pg_stat_activity
WHERE datname = current_database() AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
"""

DEAD_ROWS: Final = """
SELECT substr(relname, 3), n_dead_tup FROM pg_stat_user_tables
WHERE schemaname = 'ringq' AND relname LIKE 'q\\_%'
"""

INBOX_CHANNEL: Final = "ringq_inbox"  # ringq.enqueue() notifies it (scripting/ddl.sql)
