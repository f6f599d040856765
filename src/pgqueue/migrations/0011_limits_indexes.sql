-- pgqueue: no-transaction
-- pgqueue schema, version 11: the indexes of the limited claim.
-- Placeholders as in 0001: {schema} is the quoted schema identifier.

-- Waiting jobs of limited tasks by group, each group in claim order: the limited claim walks
-- the groups (one descent per group, round-robin from where it stopped) and takes each group's
-- first jobs. Only jobs with a limit group are in it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS pgqueue_jobs_limited_idx
    ON {schema}.pgqueue_jobs (task, limit_key, priority DESC, run_at, id)
    WHERE status IN ('queued', 'retrying') AND limit_key IS NOT NULL;

-- Running jobs by limit group: a group's taken slots are counted here.
CREATE INDEX CONCURRENTLY IF NOT EXISTS pgqueue_jobs_running_limited_idx
    ON {schema}.pgqueue_jobs (task, limit_key)
    WHERE status = 'running' AND limit_key IS NOT NULL
