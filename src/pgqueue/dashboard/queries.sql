-- The dashboard's read queries, by name. One refresh runs them all in one read-only
-- REPEATABLE READ transaction, so every panel shows the same instant (now() is shared).
-- {schema} is the quoted schema; values are always %(name)s parameters. List panels read
-- arguments only through a short preview that skips large (toasted) values unread.

-- name: clock
-- The database clock: charts and "ago" figures use it, never the dashboard host's clock.
SELECT extract(epoch FROM now())::float8,
       extract(epoch FROM date_trunc('second', now()))::bigint

-- name: depth_sampled
-- Current depth from the workers' shared sample while it holds (see sample_depth in stats.sql:
-- one second, longer when the backlog is deep), with two seconds of slack for the workers' own
-- one-second rhythm: with workers running, nobody counts the queue twice.
SELECT d.queue, d.queued, d.retrying, d.running
FROM {schema}.pgqueue_depth d
JOIN (SELECT bucket, greatest(1, sum(queued + retrying) / %(rows_per_second)s) AS holds
      FROM {schema}.pgqueue_depth
      WHERE bucket = (SELECT max(bucket) FROM {schema}.pgqueue_depth)
      GROUP BY bucket) latest ON d.bucket = latest.bucket
WHERE latest.bucket + make_interval(secs => latest.holds + 2) > date_trunc('second', now())
ORDER BY d.queue

-- name: depth_count
-- No fresh sample (no worker running): count, one partial index per figure (waiting jobs
-- index-only from the ready index, retrying ones from their small index). Running jobs are
-- always counted live (running_by_queue).
SELECT queue, (sum(waiting) - sum(retrying))::int AS queued, sum(retrying)::int AS retrying,
       0 AS running
FROM (
    SELECT queue, count(*) AS waiting, 0 AS retrying
    FROM {schema}.pgqueue_jobs WHERE status IN ('queued', 'retrying') GROUP BY queue
    UNION ALL
    SELECT queue, 0, count(*)
    FROM {schema}.pgqueue_jobs WHERE status = 'retrying' GROUP BY queue
) counts
GROUP BY queue
ORDER BY queue

-- name: running_by_queue
-- Running jobs, counted now rather than taken from the (up to 2 s old) sample, so the tile
-- agrees with the running-jobs table of the same refresh. Bounded by total worker concurrency:
-- an index-only scan of the running partial index.
SELECT queue, count(*)::int
FROM {schema}.pgqueue_jobs
WHERE status = 'running'
GROUP BY queue

-- name: throughput
-- Finished attempts per second for the last two minutes (bucket index range scan).
SELECT extract(epoch FROM bucket)::bigint, sum(succeeded)::bigint, sum(retried)::bigint,
       sum(dead)::bigint, sum(lost)::bigint
FROM {schema}.pgqueue_stats
WHERE bucket >= date_trunc('second', now()) - interval '120 seconds'
GROUP BY bucket
ORDER BY bucket

-- name: latency_histograms
-- Histograms of the last 60 seconds, merged across workers and queues bin by bin.
SELECT 'pickup' AS kind, h.key::int, sum(h.value::bigint)::bigint
FROM {schema}.pgqueue_stats s, jsonb_each_text(s.pickup_hist) AS h
WHERE s.bucket >= now() - interval '60 seconds'
GROUP BY h.key
UNION ALL
SELECT 'run' AS kind, h.key::int, sum(h.value::bigint)::bigint
FROM {schema}.pgqueue_stats s, jsonb_each_text(s.run_hist) AS h
WHERE s.bucket >= now() - interval '60 seconds'
GROUP BY h.key

-- name: depth_history
-- Depth samples of the last two minutes (primary key range scan), and of the minute before: a
-- deep backlog's sample stands for the seconds after it (figures.depth_series).
SELECT extract(epoch FROM bucket)::bigint, queue, queued + retrying, running
FROM {schema}.pgqueue_depth
WHERE bucket >= date_trunc('second', now()) - interval '180 seconds'
ORDER BY bucket, queue

-- name: workers
-- Leases held come from the running partial index (few rows), joined by worker id.
SELECT w.id::text, w.host, w.pid, w.queues, w.concurrency,
       extract(epoch FROM now() - w.started_at)::float8,
       extract(epoch FROM now() - w.last_heartbeat_at)::float8,
       w.stale_writes, COALESCE(r.held, 0)::bigint
FROM {schema}.pgqueue_workers w
LEFT JOIN (
    SELECT worker_id, count(*) AS held FROM {schema}.pgqueue_jobs
    WHERE status = 'running' GROUP BY worker_id
) r ON r.worker_id = w.id
ORDER BY w.started_at, w.id
LIMIT 200

-- name: running_jobs
-- Running jobs are bounded by total worker concurrency: read through the running partial index.
-- A job's lease is its worker's (pgqueue_workers.lease_expires_at) unless it has its own.
SELECT j.id, j.task, j.queue, j.worker_id::text, j.attempts, j.max_attempts,
       extract(epoch FROM now() - j.claimed_at)::float8,
       extract(epoch FROM COALESCE(j.lease_expires_at, w.lease_expires_at) - now())::float8,
       CASE WHEN pg_column_size(j.args) <= 2048 THEN left(j.args::text, 120)
            ELSE '… ' || pg_column_size(j.args) || ' bytes' END,
       j.progress,
       (SELECT count(*) FROM {schema}.pgqueue_job_deps d WHERE d.child_id = j.id),
       CASE WHEN j.has_children
            THEN (SELECT count(*) FROM {schema}.pgqueue_job_deps d WHERE d.parent_id = j.id)
            ELSE 0 END
FROM {schema}.pgqueue_jobs j
LEFT JOIN {schema}.pgqueue_workers w ON w.id = j.worker_id
WHERE j.status = 'running'
ORDER BY j.claimed_at, j.id
LIMIT %(limit)s

-- name: problems
-- Dead jobs newest first and retrying jobs soonest first, each through its own small partial
-- index (0003): neither scan touches the millions of succeeded or queued rows. The error is cut
-- to a preview; the full text is one /api/jobs/{{id}} fetch away.
(SELECT id, task, queue, 'dead' AS status, attempts, max_attempts,
        left(last_error, 300), COALESCE(length(last_error), 0),
        extract(epoch FROM finished_at - now())::float8,
        CASE WHEN pg_column_size(args) <= 2048 THEN left(args::text, 120)
             ELSE '… ' || pg_column_size(args) || ' bytes' END,
        (SELECT count(*) FROM {schema}.pgqueue_job_deps d WHERE d.child_id = j.id),
        CASE WHEN has_children
             THEN (SELECT count(*) FROM {schema}.pgqueue_job_deps d WHERE d.parent_id = j.id)
             ELSE 0 END
 FROM {schema}.pgqueue_jobs j WHERE status = 'dead'
 ORDER BY finished_at DESC LIMIT %(limit)s)
UNION ALL
(SELECT id, task, queue, 'retrying' AS status, attempts, max_attempts,
        left(last_error, 300), COALESCE(length(last_error), 0),
        extract(epoch FROM run_at - now())::float8,
        CASE WHEN pg_column_size(args) <= 2048 THEN left(args::text, 120)
             ELSE '… ' || pg_column_size(args) || ' bytes' END,
        (SELECT count(*) FROM {schema}.pgqueue_job_deps d WHERE d.child_id = j.id),
        CASE WHEN has_children
             THEN (SELECT count(*) FROM {schema}.pgqueue_job_deps d WHERE d.parent_id = j.id)
             ELSE 0 END
 FROM {schema}.pgqueue_jobs j WHERE status = 'retrying'
 ORDER BY run_at LIMIT %(limit)s)

-- name: problem_counts
-- Totals for the problems panel's header; index-only over the two small partial indexes.
SELECT (SELECT count(*) FROM {schema}.pgqueue_jobs WHERE status = 'dead')::bigint,
       (SELECT count(*) FROM {schema}.pgqueue_jobs WHERE status = 'retrying')::bigint

-- name: feed
-- Job events from the rows' own timestamps, so the feed is right after any restart: the newest
-- enqueued (primary key backwards), started (running index) and finished (finished index
-- backwards) jobs, merged. Each branch is a bounded index scan.
SELECT * FROM (
    (SELECT id, task, queue, 'enqueued' AS event, extract(epoch FROM created_at)::float8 AS at,
            attempts
     FROM {schema}.pgqueue_jobs ORDER BY id DESC LIMIT %(limit)s)
    UNION ALL
    (SELECT id, task, queue, 'started', extract(epoch FROM claimed_at)::float8, attempts
     FROM {schema}.pgqueue_jobs WHERE status = 'running'
     ORDER BY claimed_at DESC LIMIT %(limit)s)
    UNION ALL
    (SELECT id, task, queue, status::text, extract(epoch FROM finished_at)::float8, attempts
     FROM {schema}.pgqueue_jobs
     WHERE status IN ('succeeded', 'dead', 'cancelled') AND finished_at IS NOT NULL
     ORDER BY finished_at DESC LIMIT %(limit)s)
) events
ORDER BY at DESC, id DESC
LIMIT %(limit)s

-- name: schedules
-- A few rows (one per declared schedule), ordered by name for a stable table.
SELECT name, cron, task, queue,
       extract(epoch FROM next_run_at - now())::float8,
       extract(epoch FROM last_run_at - now())::float8,
       enabled, paused
FROM {schema}.pgqueue_schedules
ORDER BY name
LIMIT 500

-- name: paused_queues
-- Operators' pauses (`pgqueue queues pause`): a few rows, for the badges next to queue names.
SELECT name FROM {schema}.pgqueue_queues WHERE paused ORDER BY name

-- name: insert_counter
-- Cumulative inserts into the jobs table (statistics, no table scan), for the INSERT arrow's rate.
SELECT n_tup_ins::bigint
FROM pg_stat_user_tables
WHERE relid = to_regclass(format('%%I.pgqueue_jobs', %(schema)s::text))

-- name: finished_since
-- For /metrics: settled buckets since the last read, added to in-memory counters. Buckets are
-- read two seconds late so a worker's flush for that second has landed.
SELECT s.queue, sum(s.succeeded)::bigint, sum(s.retried)::bigint, sum(s.dead)::bigint,
       sum(s.lost)::bigint, jsonb_agg(s.pickup_hist), jsonb_agg(s.run_hist)
FROM {schema}.pgqueue_stats s
WHERE s.bucket > %(after)s::timestamptz
  AND s.bucket <= date_trunc('second', now()) - interval '2 seconds'
GROUP BY s.queue

-- name: settled_until
SELECT date_trunc('second', now()) - interval '2 seconds'

-- name: job_detail
-- One job for the problem details; arguments still cut to a preview (8 kB).
SELECT id, task, queue, status::text, attempts, max_attempts, priority,
       CASE WHEN pg_column_size(args) <= 65536 THEN left(args::text, 8192)
            ELSE '… ' || pg_column_size(args) || ' bytes' END,
       left(last_error, 65536),
       created_at, run_at, claimed_at, finished_at, worker_id::text,
       CASE WHEN pg_column_size(meta) <= 65536 THEN meta END, progress,
       cancel_requested_at
FROM {schema}.pgqueue_jobs
WHERE id = %(id)s
