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
-- At most one sample per second across all workers, and fewer when the backlog is deep: counting
-- costs about half a microsecond per waiting job (64 ms at 150,000 here), so a sample that found
-- N jobs waiting holds for N / rows_per_second seconds (at least one) before anyone counts again,
-- and the count takes at most ~2 percent of a core however deep the queue. The dashboard's
-- depth_sampled uses the same rule to decide whether a sample still stands. The NOT EXISTS probe
-- reads the newest sample (primary key, backwards) and skips the count while it holds; ON
-- CONFLICT settles the race between two workers at once. Each count reads one partial index:
-- waiting jobs index-only from the ready index (grouped by its leading queue column), retrying
-- and running ones from their small indexes; finished rows and a status-by-status heap scan are
-- never touched.
INSERT INTO {schema}.pgqueue_depth (bucket, queue, queued, retrying, running)
SELECT date_trunc('second', now()), queue, (sum(waiting) - sum(retrying))::int AS queued,
       sum(retrying)::int AS retrying, sum(running)::int AS running
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
WHERE NOT EXISTS (
    SELECT 1 FROM {schema}.pgqueue_depth
    WHERE bucket = (SELECT max(bucket) FROM {schema}.pgqueue_depth)
    GROUP BY bucket
    HAVING bucket + make_interval(secs => greatest(1, sum(queued + retrying) / %(rows_per_second)s))
           > date_trunc('second', now()))
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
