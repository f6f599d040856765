-- pgqueue schema, version 16: the history of attempts that did not succeed.
-- Placeholders as in 0001: {schema} is the quoted schema identifier; literal braces are doubled.

-- One row per attempt that failed, was cancelled or lost its lease, written by the same
-- statement as the fenced write that ended it (complete_jobs, reap_expired_leases), so a refused
-- (stale) ack writes none. A successful ack writes nothing here: the succeeded (or running)
-- attempt is read from the job row. No primary key on (job_id, attempt): a requeue starts the
-- count again at 1. No foreign key to pgqueue_jobs either: it would add a lookup here to every
-- delete of a job; the statements that delete jobs (prune_finished_jobs, the purge of
-- bulk_batch) delete their history in the same statement instead. outcome: 'retrying',
-- 'dead' or 'cancelled' (what the job became after a failed or cancelled attempt), or
-- 'lease expired' (the reaper took the attempt back). The error is cut to 8,000 characters.
CREATE TABLE {schema}.pgqueue_attempts (
    job_id      bigint NOT NULL,
    attempt     integer NOT NULL,
    worker_id   uuid,
    claimed_at  timestamptz,
    started_at  timestamptz,
    finished_at timestamptz NOT NULL DEFAULT now(),
    outcome     text NOT NULL,
    error       text
);
CREATE INDEX pgqueue_attempts_job_idx ON {schema}.pgqueue_attempts (job_id, finished_at);

-- Roles that may read the jobs (the dashboard's SELECT-only role) may read their attempts.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
             WHERE table_schema = (SELECT relnamespace::regnamespace::name FROM pg_class
                                   WHERE oid = '{schema}.pgqueue_jobs'::regclass)
                   AND table_name = 'pgqueue_jobs'
                   AND privilege_type = 'SELECT' AND grantee <> current_user
    LOOP
        EXECUTE format('GRANT SELECT ON {schema}.pgqueue_attempts TO %I', r.grantee);
    END LOOP;
END;
$$;
