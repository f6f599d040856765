-- pgqueue schema, version 12: cancelling running jobs, a caller's metadata, progress.
-- Placeholders as in 0001: {schema} is the quoted schema identifier; literal braces are doubled.

-- Set by App.cancel on a running job: its worker stops the attempt (at its next heartbeat, or at
-- once by NOTIFY) and the job ends 'cancelled', never retried (complete_jobs and the reaper
-- read it). Not indexed: read only through rows already found by id.
ALTER TABLE {schema}.pgqueue_jobs
    ADD COLUMN cancel_requested_at timestamptz,
    ADD COLUMN meta jsonb,
    ADD COLUMN progress jsonb;
