-- pgqueue schema, version 4: NOTIFY only while some worker waits for work.
-- Placeholders: {schema} is the quoted schema identifier, {channel} the quoted NOTIFY channel.

-- Notifying commits serialise on a cluster-wide lock held through their WAL flush, so concurrent
-- single-row producers paid for wake-ups that busy workers never read: a worker whose last claim
-- came back full claims again on its own. Two advisory locks, keyed by the channel, say who needs
-- a wake-up (the worker side is the notifier's announce_waiting / enqueuers_settled):
--   (key, 1) "waiting": held shared by each worker waiting for work, on its LISTEN connection.
--            The trigger looks for such a worker by taking it exclusively for an instant.
--   (key, 2) "enqueuing": held shared until commit by every transaction that inserted ready jobs,
--            taken *before* it looks. A worker that starts waiting after a producer looked (and
--            skipped its NOTIFY) finds this lock taken and keeps claiming until it is free, by
--            which time that producer's jobs are committed or gone. A skipped NOTIFY therefore
--            never leaves a job to the poll.
-- Both locks are transaction-scoped or released within one expression, so the trigger is safe
-- behind a transaction-pooling PgBouncer.
CREATE OR REPLACE FUNCTION {schema}.pgqueue_notify_ready() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    looked boolean := false;
BEGIN
    FOR q IN SELECT DISTINCT n.queue FROM new_rows n
             WHERE n.status IN ('queued', 'retrying') AND n.run_at <= now()
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
