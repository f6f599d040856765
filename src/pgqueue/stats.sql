-- The statements of pgqueue.stats, by name: per-second aggregates written by workers.
-- {schema} is the quoted schema; values are always %(name)s parameters.

-- name: record_stats
-- One INSERT per worker flush, whatever the number of jobs: rows are bucketed at the database
-- clock's second, so workers on skewed hosts still line up.
INSERT INTO {schema}.pgqueue_stats
    (bucket, worker_id, queue, succeeded, retried, dead, lost, pickup_hist, run_hist)
SELECT date_trunc('second', now()), %(worker_id)s, r.queue, r.succeeded, r.retried, r.dead,
       r.lost, r.pickup_hist, r.run_hist
FROM jsonb_to_recordset(%(rows)s::jsonb) AS r(queue text, succeeded int, retried int, dead int,
                                             lost int, pickup_hist jsonb, run_hist jsonb)

-- name: sample_depth
-- At most one sample per second across all workers: the NOT EXISTS probe (primary key) skips the
-- count when another worker was first, ON CONFLICT settles the race between two at once. Each
-- count reads one partial index: waiting jobs index-only from the ready index (grouped by its
-- leading queue column), retrying and running ones from their small indexes; finished rows and
-- a status-by-status heap scan are never touched.
INSERT INTO {schema}.pgqueue_depth (bucket, queue, queued, retrying, running)
SELECT date_trunc('second', now()), queue, (sum(waiting) - sum(retrying))::int AS queued, sum(retrying)::int AS retrying,
       sum(running)::int AS running
FROM (
    SELECT queue, count(*) AS waiting, 0 AS retrying, 0 AS running
    FROM {schema}.pgqueue_jobs WHERE status IN ('queued', 'retrying') GROUP BY queue
    UNION ALL
    SELECT queue, 0, count(*), 0
    FROM {schema}.pgqueue_jobs WHERE status = 'retrying' GROUP BY queue
    UNION ALL
    SELECT queue, 0, 0, count(*)
    FROM {schema}.pgqueue_jobs WHERE status = 'running' GROUP BY queue
) counts
WHERE NOT EXISTS (SELECT 1 FROM {schema}.pgqueue_depth
                  WHERE bucket = date_trunc('second', now()))
GROUP BY queue
ON CONFLICT DO NOTHING

-- name: prune_stats
-- Range deletes on the bucket index and the depth primary key.
WITH stats AS (
    DELETE FROM {schema}.pgqueue_stats
    WHERE bucket < now() - make_interval(secs => %(older_than)s)
)
DELETE FROM {schema}.pgqueue_depth
WHERE bucket < now() - make_interval(secs => %(older_than)s)
