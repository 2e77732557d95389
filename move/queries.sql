-- SQL of the mover and of the updates-applied helper (ringq.move), loaded once
-- by move/_queries.py. {table} is a queue's table, filled only with
-- psycopg.sql.Identifier from a validated name; no other identifier is filled in.

-- try_lock --
-- One lock per source queue: (hashtext('ringq.move'), queue id), the two-key
-- form that keeps ringq's locks apart from an application's own (as the inbox
-- pump does with 'ringq.inbox').
SELECT pg_try_advisory_lock(hashtext('ringq.move'), %s), pg_backend_pid()

-- unlock --
SELECT pg_advisory_unlock(hashtext('ringq.move'), %s)

-- ping --
SELECT 1

-- due_times --
-- The due times of a source batch's entries that have one (a delayed enqueue,
-- or a retry's backoff), read in the source transaction by (slot, seq): the
-- primary key, as the dequeue reads them. The mover enqueues each with it, so
-- an entry is due in the destination when it was due in the source.
SELECT seq, not_before FROM {table}
WHERE slot = ANY(%s::integer[]) AND seq = ANY(%s::bigint[]) AND not_before IS NOT NULL

-- moved_keys --
-- Keys of entries already moved (read in the destination transaction, for
-- redelivered entries only: they are the ones that may be there already).
SELECT key, seq FROM ringq.keys WHERE queue_id = %s AND key = ANY(%s::text[])

-- prune_keys --
-- Keys are needed only until the source dequeue has committed; this mover's
-- keys at or below a destination sequence whose source side committed go.
DELETE FROM ringq.keys WHERE queue_id = %s AND seq <= %s AND starts_with(key, %s)

-- applied_create --
-- Idempotent DDL; run on a connection of its own, committed at once, so a
-- consumer's transaction never waits on (or aborts on) the table's creation.
CREATE SCHEMA IF NOT EXISTS ringq;
CREATE TABLE IF NOT EXISTS ringq.applied (
    consumer    text        NOT NULL,
    queue       text        NOT NULL,
    seq         bigint      NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    enqueued_at timestamptz,
    PRIMARY KEY (consumer, queue, seq)
);
-- (enqueued_at came later: NULL in the records made before it)
ALTER TABLE ringq.applied ADD COLUMN IF NOT EXISTS enqueued_at timestamptz

-- applied_exists --
SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('ringq.applied')
               AND attname = 'enqueued_at' AND NOT attisdropped)

-- applied_record --
-- Returns a row if the entry was not recorded yet. A record of the same
-- queue and sequence with another enqueue time is another entry's: after an
-- asynchronous fail-over of the source the sequences of entries lost in the
-- gap are given again. It is replaced (that entry is gone for good).
INSERT INTO ringq.applied AS a (consumer, queue, seq, enqueued_at) VALUES (%s, %s, %s, %s)
ON CONFLICT (consumer, queue, seq) DO UPDATE
    SET enqueued_at = excluded.enqueued_at, applied_at = now()
    WHERE a.enqueued_at IS NOT NULL AND a.enqueued_at <> excluded.enqueued_at
RETURNING 1
