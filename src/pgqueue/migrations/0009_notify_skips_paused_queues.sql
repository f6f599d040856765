-- pgqueue schema, version 9: inserts into a paused queue wake nobody.
-- Placeholders as in 0001: {schema} is the quoted schema identifier, {channel} the quoted NOTIFY
-- channel literal; literal braces are doubled.

-- A waiting worker woken for a paused queue claims nothing (claims skip paused queues), but its
-- claim still reads past the paused backlog: with steady enqueues into a paused queue, every
-- waiting worker would do that at every insert. So the trigger leaves paused queues out. The
-- lookup runs only after the trigger found a worker waiting (migration 0004), one primary-key
-- probe of the small pgqueue_queues per queue of the statement; a busy system pays nothing.
-- Resuming a queue notifies it (resume_queue, then wake_waiting_workers), so nothing that was
-- enqueued during the pause waits for the poll afterwards.
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
        IF NOT EXISTS (SELECT FROM {schema}.pgqueue_queues p WHERE p.name = q AND p.paused) THEN
            PERFORM pg_notify({channel}, q);
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;
