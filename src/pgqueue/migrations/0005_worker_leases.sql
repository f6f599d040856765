-- pgqueue schema, version 5: one lease per worker, covering every job it holds; wake-ups for
-- jobs enqueued to run later.
-- Placeholders: {schema} is the quoted schema identifier, {channel} the quoted NOTIFY channel.

-- A worker's heartbeat extends this one row instead of every job it holds: running jobs are
-- never written between their claim and their ack, so a handler's own transaction (any
-- isolation level) and an outside lock on one job's row never conflict with a heartbeat. A job
-- claimed by a worker of this version keeps pgqueue_jobs.lease_expires_at NULL, and its lease is
-- its worker's (the reaper reads both; jobs of workers from before this version keep their
-- per-job lease until they finish).
ALTER TABLE {schema}.pgqueue_workers ADD COLUMN lease_expires_at timestamptz;

-- Idle workers sleep until the earliest run_at they know of, so they must hear of jobs enqueued
-- to run later too: the trigger now notifies for every inserted row waiting to run, due or not
-- (still once per statement and queue, and only while some worker waits: migration 0004).
CREATE OR REPLACE FUNCTION {schema}.pgqueue_notify_ready() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    looked boolean := false;
BEGIN
    FOR q IN SELECT DISTINCT n.queue FROM new_rows n WHERE n.status IN ('queued', 'retrying')
    LOOP
        IF NOT looked THEN
            PERFORM pg_advisory_xact_lock_shared(hashtext({channel}), 2);
            IF (SELECT CASE WHEN pg_try_advisory_lock(hashtext({channel}), 1)
                            THEN pg_advisory_unlock(hashtext({channel}), 1)
                            ELSE false END) THEN
                RETURN NULL;  -- nobody is waiting
            END IF;
            looked := true;
        END IF;
        PERFORM pg_notify({channel}, q);
    END LOOP;
    RETURN NULL;
END;
$$;
