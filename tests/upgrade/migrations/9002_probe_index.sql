-- pgqueue: no-transaction
-- Test-only: an index on the hot table, built without blocking writes.
CREATE INDEX CONCURRENTLY IF NOT EXISTS pgqueue_jobs_upgrade_probe_idx
    ON {schema}.pgqueue_jobs (upgrade_probe)
    WHERE upgrade_probe IS NOT NULL;
