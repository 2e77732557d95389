-- SQL of the mover and of the updates-applied helper (ringq.move), loaded once
-- by move/_queries.py. Plain statements: no identifier is ever filled in.

-- try_lock --
-- One lock per source queue: (hashtext('ringq.move'), queue id), the two-key
-- form that keeps ringq's locks apart from an application's own (as the inbox
-- pump does with 'ringq.inbox').
SELECT pg_try_advisory_lock(hashtext('ringq.move'), %s), pg_backend_pid()

-- unlock --
SELECT pg_advisory_unlock(hashtext('ringq.move'), %s)

-- ping --
SELECT 1

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
    consumer   text        NOT NULL,
    queue      text        NOT NULL,
    seq        bigint      NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, queue, seq)
)

-- applied_exists --
SELECT to_regclass('ringq.applied') IS NOT NULL

-- applied_record --
INSERT INTO ringq.applied (consumer, queue, seq) VALUES (%s, %s, %s)
ON CONFLICT DO NOTHING RETURNING 1
