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
-- count when another worker was first, ON CONFLICT settles the race between two at once. The
-- count reads only the ready and running partial indexes' rows.
INSERT INTO {schema}.pgqueue_depth (bucket, queue, queued, retrying, running)
SELECT date_trunc('second', now()), queue,
       count(*) FILTER (WHERE status = 'queued'),
       count(*) FILTER (WHERE status = 'retrying'),
       count(*) FILTER (WHERE status = 'running')
FROM {schema}.pgqueue_jobs
WHERE status IN ('queued', 'retrying', 'running')
  AND NOT EXISTS (SELECT 1 FROM {schema}.pgqueue_depth
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
