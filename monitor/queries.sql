-- SQL of the monitor (ringq.monitor), loaded once by monitor/_queries.py.
-- {table} is a queue's table, filled only with psycopg.sql.Identifier from a
-- validated name.

-- try_monitor_lock --
-- One monitor per database: a session-level advisory lock, released by the
-- server when the monitor's connection ends (kill -9 included).
SELECT pg_try_advisory_lock(hashtext('ringq.monitor'))

-- monitor_lock_holder --
SELECT a.pid, a.application_name, a.client_addr::text, a.backend_start
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objid = hashtext('ringq.monitor')::oid AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
LIMIT 1

-- instance_id --
SELECT value FROM ringq.meta WHERE key = 'instance_id'

-- in_recovery --
-- Whether the server the monitor's connection is on is a standby (in
-- recovery) rather than the primary; read once per sample.
SELECT pg_is_in_recovery()

-- queues --
-- lease (seconds) through to_jsonb: a schema made before the column reads the default.
SELECT id, name, capacity, coalesce((to_jsonb(q) ->> 'lease')::float8, 300) FROM ringq.queues q ORDER BY id

-- exception_counts --
SELECT queue_id, count(*) FROM ringq.exceptions GROUP BY queue_id

-- recent_exceptions --
-- Entries moved to the exception table lately (the window is wider than any
-- transaction the monitor could miss between two passes; the caller keeps
-- the keys it has already announced).
SELECT e.queue_id, q.name, e.seq, e.producer, e.producer_seq, e.deliveries, e.reason,
       extract(epoch FROM e.moved_at)::float8, e.msg_group
FROM ringq.exceptions e LEFT JOIN ringq.queues q ON q.id = e.queue_id
WHERE e.moved_at > now() - make_interval(secs => %s)
ORDER BY e.moved_at, e.queue_id, e.seq

-- xmin_holders --
-- What holds back this database's xmin horizon, oldest transaction first:
-- client backends with a snapshot (backend_xmin) or a transaction id, and
-- prepared transactions (their xact_start is their PREPARE). Never the query
-- text: it may hold secrets. Autovacuum workers are left out (they end by
-- themselves), and so are replication slots.
SELECT * FROM (
    SELECT 'backend' AS kind, pid, application_name, usename::text, state,
           extract(epoch FROM xact_start)::float8, extract(epoch FROM query_start)::float8,
           extract(epoch FROM now() - xact_start)::float8 AS age_s,
           greatest(age(backend_xmin), age(backend_xid)) AS xid_age, NULL::text AS gid
    FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid()
      AND backend_type = 'client backend' AND xact_start IS NOT NULL
      AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
    UNION ALL
    SELECT 'prepared', NULL, NULL, owner::text, 'prepared', extract(epoch FROM prepared)::float8,
           NULL, extract(epoch FROM now() - prepared)::float8, age(transaction), gid
    FROM pg_prepared_xacts WHERE database = current_database()
) AS h
ORDER BY age_s DESC
LIMIT 100

-- ring_storage --
-- A ring table's size on disk (table, TOAST, indexes) and its dead row
-- versions (statistics); no row once the table is gone.
SELECT pg_total_relation_size(c.oid), coalesce(s.n_dead_tup, 0)
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid = to_regclass(%s)

-- dead_rows --
-- Dead row versions per queue table.
SELECT substr(relname, 3), n_dead_tup FROM pg_stat_user_tables
WHERE schemaname = 'ringq' AND relname LIKE 'q\_%'

-- group_oldest_age --
-- How long the oldest ready entry of a grouped queue has waited (seconds,
-- by the server's clock): its row by primary key, guarded by the entry's
-- seq and state (no row: it was consumed or reclaimed since the section was read).
SELECT extract(epoch FROM now() - enq_at)::float8 FROM {table}
WHERE slot = %s::integer AND seq = %s::bigint AND state = 1

-- inbox_pending --
-- Queues with entries enqueued through SQL (ringq.enqueue()) waiting in the
-- inbox, but those named in the array.
SELECT q.name, q.id FROM ringq.queues q WHERE q.name <> ALL(%s) AND EXISTS
(SELECT 1 FROM ringq.inbox i WHERE i.queue_id = q.id) ORDER BY q.id

-- inbox_full --
-- Which of these queues (ids: full in the section now) have entries waiting
-- in the inbox, but those named in the array.
SELECT q.name, q.id FROM ringq.queues q
WHERE q.id = ANY(%(ids)s::integer[]) AND q.name <> ALL(%(skip)s::text[])
  AND EXISTS (SELECT 1 FROM ringq.inbox i WHERE i.queue_id = q.id)

-- inbox_next --
-- The pump's next batch, in one statement (an SQL enqueue's consumer waits
-- for it): the first queue, by id, with entries in the inbox, not named in
-- skip, with room (limits: the section's free slots of the queues loaded
-- there, as arrays of ids and slots; a queue not loaded takes a whole
-- batch) and whose pump lock this transaction gets (one pumper per queue at
-- a time, so that entries reach the ring in inbox order; a queue another
-- pumper holds is passed); then its oldest entries, at most its limit, taken
-- out in the pump's transaction (they go back with a rollback). Each row
-- carries the queue's id, name and limit and how many other queues have
-- entries waiting (the pump is done when none has), then the entry: id, payload,
-- producer, group and due time (NULL when due already, nothing to carry; a
-- time past what a Python datetime holds, an 'infinity' put in by hand
-- around ringq.enqueue(), kept at year 9999: it never falls due, and never
-- stops the pump). Rows that a pumper which held the lock before moved and
-- committed after this statement's snapshot are passed over by the DELETE
-- (deleted concurrently), never moved twice.
WITH p AS MATERIALIZED (
    SELECT q.id, q.name, least(%(batch)s, coalesce(r.room, %(batch)s)) AS lim
    FROM ringq.queues q
    LEFT JOIN unnest(%(ids)s::integer[], %(rooms)s::integer[]) AS r(qid, room)
           ON r.qid = q.id
    WHERE q.name <> ALL(%(skip)s::text[])
      AND EXISTS (SELECT 1 FROM ringq.inbox i WHERE i.queue_id = q.id)
    ORDER BY q.id
), q AS (
    SELECT p.id, p.name, p.lim FROM (
        SELECT * FROM p ORDER BY p.id OFFSET 0  -- a fence: the lock is tried in this order, last
    ) p
    WHERE p.lim > 0 AND pg_try_advisory_xact_lock(hashtext('ringq.inbox'), p.id)
    LIMIT 1
)
DELETE FROM ringq.inbox WHERE id IN (
    SELECT i.id FROM ringq.inbox i WHERE i.queue_id = (SELECT id FROM q)
    ORDER BY i.id LIMIT (SELECT lim FROM q))
RETURNING (SELECT id FROM q), (SELECT name FROM q), (SELECT lim FROM q),
          (SELECT count(*) FROM p WHERE p.id <> (SELECT id FROM q)),
          id, payload, producer, msg_group,
          CASE WHEN not_before > now() THEN least(not_before, '9999-12-01 00:00+00') END

-- inbox_refuse --
-- An inbox entry the library refuses (put there by hand, around
-- ringq.enqueue()): moved to the exception table, in the pump's transaction,
-- under the negative of its inbox id (ring sequences are never negative),
-- so the entries behind it move on and the operator sees why.
INSERT INTO ringq.exceptions (queue_id, seq, payload, producer, deliveries, msg_group, reason)
VALUES (%(queue_id)s, -%(id)s::bigint, %(payload)b, %(producer)s, 0, %(group)s, %(reason)s)
ON CONFLICT DO NOTHING

-- keys_queues --
-- Queues with idempotency keys older than the retention (seconds): one probe
-- of keys_queue_id_created_at per queue (its oldest key), not a scan of
-- ringq.keys. A scalar subquery, because the planner flattens EXISTS into a
-- semi-join that reads every key.
SELECT q.id, q.name, q.capacity FROM ringq.queues q
WHERE (SELECT min(k.created_at) FROM ringq.keys k WHERE k.queue_id = q.id)
      < now() - make_interval(secs => %s)
ORDER BY q.id

-- keys_prune --
-- Spent keys: older than the retention and their entry no longer queued
-- (its row is consumed or holds a later sequence). Oldest first, a batch at a
-- time, along keys_queue_id_created_at: the walk stops at the batch, passing
-- at most the keys whose entries are still queued (at most the capacity).
DELETE FROM ringq.keys
WHERE ctid = ANY(ARRAY(
    SELECT k.ctid FROM ringq.keys k
    WHERE k.queue_id = %s AND k.created_at < now() - make_interval(secs => %s)
      AND NOT EXISTS (SELECT 1 FROM {table} t
                      WHERE t.slot = mod(k.seq, %s)::integer AND t.seq = k.seq AND t.state = 1)
    ORDER BY k.created_at
    LIMIT %s))

-- keys_prune_dropped --
-- Keys of queues that no longer exist (the drop script deletes them; these
-- are left by drops made otherwise), a batch at a time. The distinct
-- queue ids are found by a skip scan of the index (one probe per queue id),
-- not by an anti-join over every key.
WITH RECURSIVE ids(queue_id) AS (
    (SELECT queue_id FROM ringq.keys ORDER BY queue_id LIMIT 1)
    UNION ALL
    SELECT (SELECT k.queue_id FROM ringq.keys k WHERE k.queue_id > ids.queue_id ORDER BY k.queue_id LIMIT 1)
    FROM ids WHERE ids.queue_id IS NOT NULL
)
DELETE FROM ringq.keys
WHERE ctid = ANY(ARRAY(
    SELECT k.ctid FROM ringq.keys k
    WHERE k.queue_id IN (SELECT ids.queue_id FROM ids
                         WHERE ids.queue_id IS NOT NULL
                           AND NOT EXISTS (SELECT 1 FROM ringq.queues q WHERE q.id = ids.queue_id))
    LIMIT %s))

-- listen_inbox --
-- Wakes the inbox pump: ringq.enqueue() notifies {channel} (filled only with
-- psycopg.sql.Identifier).
LISTEN {channel}

-- pump_async_commit --
-- The inbox pump's session commits without waiting for the WAL flush: a
-- consumer's commit of a moved entry flushes the move before it (the WAL is one
-- sequence), and a move lost in a crash leaves its entries in the inbox (the
-- move and the inbox delete are one transaction), to be moved again; the
-- section's stale bits cost a re-read, never a loss or a duplicate.
SET synchronous_commit = off

-- room_publish --
-- The ring's free slots of these queues as the pump sees them in the section
-- now, the inbox's entries it left waiting for each, and the inbox's highest
-- id now (arrays of ids, free slots, waiting), for ringq.enqueue()'s room
-- check (ringq.make_room, scripting/ddl.sql: it counts only the rows past
-- that id); a row is written only when a figure changed, and only for a
-- queue that still exists.
INSERT INTO ringq.room (queue_id, free, waiting, upto, at)
SELECT r.qid, r.free, r.waiting, (SELECT coalesce(max(i.id), 0) FROM ringq.inbox i), now()
FROM unnest(%(ids)s::integer[], %(frees)s::integer[], %(waiting)s::integer[])
    AS r(qid, free, waiting)
WHERE EXISTS (SELECT 1 FROM ringq.queues q WHERE q.id = r.qid)
ON CONFLICT (queue_id) DO UPDATE
SET free = excluded.free, waiting = excluded.waiting, upto = excluded.upto, at = excluded.at
WHERE (ringq.room.free, ringq.room.waiting, ringq.room.upto)
      IS DISTINCT FROM (excluded.free, excluded.waiting, excluded.upto)

-- inbox_counts --
-- Entries waiting in the inbox for these queues (ids), for the section's
-- Q_INBOX: read along inbox_queue_id_id, at most what the room check let in.
SELECT i.queue_id, count(*) FROM ringq.inbox i
WHERE i.queue_id = ANY(%(ids)s::integer[]) GROUP BY i.queue_id

-- room_short --
-- Whether a queue's published room is short of its capacity (a pump made
-- for one call must then publish it again, even with nothing to move).
SELECT EXISTS (SELECT 1 FROM ringq.room r JOIN ringq.queues q ON q.id = r.queue_id
               WHERE r.free < q.capacity)
