-- pgqueue schema, version 19: the trigger looks for a waiting worker before it is called.
-- Placeholders as in 0001: {schema} is the quoted schema identifier, {channel} the quoted NOTIFY
-- channel literal; literal braces are doubled.

-- Until now every insert statement called pgqueue_notify_ready(), a PL/pgSQL function that read
-- its transition table and only then took the two advisory locks of migration 0004 to find
-- that, on a busy system, nobody waits. The call and its query cost a single-row enqueue
-- 0.04 ms of its ~0.28 ms on the server (pgbench, one client, durable commits;
-- docs/performance.md, "Single enqueue"). The same two locks are now taken in the trigger's
-- WHEN condition, built-in functions only, in the same order: "enqueuing" (key 2) shared until
-- the transaction ends, then "waiting" (key 1) tried exclusively for an instant. The function
-- runs only when some worker waits, and then only notifies. A statement-level WHEN is evaluated
-- when the statement's rows are in, as the trigger fired before, so the promise of 0004 holds:
-- a worker that starts waiting after this look finds key 2 taken until the insert commits.
-- One difference: key 2 is now taken by every insert statement, also one that inserted only
-- blocked jobs or nothing (a unique duplicate), since a WHEN cannot read the inserted rows. A
-- worker about to wait may then claim once or twice more until that transaction ends; no job
-- and no wake-up is lost.
CREATE OR REPLACE FUNCTION {schema}.pgqueue_notify_ready() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    FOR q IN SELECT DISTINCT n.queue FROM new_rows n WHERE n.status IN ('queued', 'retrying')
    LOOP
        IF NOT EXISTS (SELECT FROM {schema}.pgqueue_queues p WHERE p.name = q AND p.paused) THEN
            PERFORM pg_notify({channel}, q);
        END IF;
    END LOOP;
    RETURN NULL;
END;
$$;

DROP TRIGGER pgqueue_jobs_notify_ready ON {schema}.pgqueue_jobs;

-- CASE evaluates its branches in order: the first takes key 2 (the function returns void, never
-- NULL), the second is true when nobody holds key 1 shared, and then gives it back.
CREATE TRIGGER pgqueue_jobs_notify_ready
    AFTER INSERT ON {schema}.pgqueue_jobs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT
    WHEN (CASE WHEN pg_advisory_xact_lock_shared(hashtext({channel}), 2) IS NULL THEN true
               WHEN pg_try_advisory_lock(hashtext({channel}), 1)
                    THEN NOT pg_advisory_unlock(hashtext({channel}), 1)
               ELSE true END)
    EXECUTE FUNCTION {schema}.pgqueue_notify_ready();
