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
-- Histograms of the last 60 seconds, merged across workers bin by bin: pickup per queue (the
-- queues table's p95; the tile merges the queues), run time across queues.
SELECT 'pickup' AS kind, s.queue, h.key::int, sum(h.value::bigint)::bigint
FROM {schema}.pgqueue_stats s, jsonb_each_text(s.pickup_hist) AS h
WHERE s.bucket >= now() - interval '60 seconds'
GROUP BY s.queue, h.key
UNION ALL
SELECT 'run' AS kind, NULL, h.key::int, sum(h.value::bigint)::bigint
FROM {schema}.pgqueue_stats s, jsonb_each_text(s.run_hist) AS h
WHERE s.bucket >= now() - interval '60 seconds'
GROUP BY h.key

-- name: queue_throughput
-- Finished attempts per queue in the throughput tile's window: the 10 settled seconds that end
-- two seconds ago (figures.RATE_WINDOW, figures.SETTLE); a bucket index range scan.
SELECT queue, sum(succeeded + retried + dead)::bigint
FROM {schema}.pgqueue_stats
WHERE bucket BETWEEN date_trunc('second', now()) - interval '11 seconds'
                 AND date_trunc('second', now()) - interval '2 seconds'
GROUP BY queue

-- name: queue_heads
-- Each queue's earliest run_at among its waiting jobs, without reading them all: a skip scan of
-- the ready-per-queue index (queue, priority DESC, run_at, id), one descent per (queue,
-- priority) pair, whose first entry is that pair's earliest. Positive: how long the oldest due
-- job has waited; negative: nothing is due yet, the next is due in that long. Then the tasks of
-- the due heads (why.queue_reasons: no serving worker may have them).
WITH RECURSIVE heads AS (
    (SELECT queue, priority, run_at, task FROM {schema}.pgqueue_jobs
     WHERE status IN ('queued', 'retrying')
     ORDER BY queue, priority DESC, run_at, id LIMIT 1)
    UNION ALL
    SELECT n.queue, n.priority, n.run_at, n.task
    FROM heads h, LATERAL (
        (SELECT queue, priority, run_at, task FROM {schema}.pgqueue_jobs
         WHERE status IN ('queued', 'retrying') AND queue = h.queue AND priority < h.priority
         ORDER BY queue, priority DESC, run_at, id LIMIT 1)
        UNION ALL
        (SELECT queue, priority, run_at, task FROM {schema}.pgqueue_jobs
         WHERE status IN ('queued', 'retrying') AND queue > h.queue
         ORDER BY queue, priority DESC, run_at, id LIMIT 1)
        LIMIT 1
    ) n
)
SELECT queue, extract(epoch FROM now() - min(run_at))::float8,
       array_agg(DISTINCT task) FILTER (WHERE run_at <= now())
FROM heads GROUP BY queue

-- name: dead_by_queue
-- Dead jobs per queue. The dead index has no queue, so this reads every dead row (6 ms for
-- 10,000): queries.read runs it only when the dead total changed, and past 2,000 dead jobs at
-- most every 30 seconds (in between, dead_since adds the jobs that died since).
SELECT queue, count(*)::bigint FROM {schema}.pgqueue_jobs WHERE status = 'dead' GROUP BY queue

-- name: depth_history
-- Depth samples of the last two minutes (primary key range scan), and of the minute before: a
-- deep backlog's sample stands for the seconds after it (figures.depth_series).
SELECT extract(epoch FROM bucket)::bigint, queue, queued + retrying, running
FROM {schema}.pgqueue_depth
WHERE bucket >= date_trunc('second', now()) - interval '180 seconds'
ORDER BY bucket, queue

-- name: workers
-- Leases held come from the running partial index (few rows), joined by worker id. A heartbeat
-- sets the worker's lease to now() + lease, so their difference is its lease length.
SELECT w.id::text, w.host, w.pid, w.queues, w.concurrency,
       extract(epoch FROM now() - w.started_at)::float8,
       extract(epoch FROM now() - w.last_heartbeat_at)::float8,
       w.stale_writes, COALESCE(r.held, 0)::bigint,
       extract(epoch FROM w.lease_expires_at - w.last_heartbeat_at)::float8,
       extract(epoch FROM w.lease_expires_at - now())::float8, w.tasks
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
-- Totals for the problems panel's header, index-only over the two small partial indexes. Dead
-- jobs are counted only up to %(cap)s + 1: kept by the hundred thousand (no dead_retention),
-- counting them all cost 27 ms of a 31 ms refresh; past the cap queries.read counts them at
-- most every 30 seconds and adds the jobs that died since (dead_since).
SELECT (SELECT count(*) FROM (SELECT FROM {schema}.pgqueue_jobs WHERE status = 'dead'
                              LIMIT %(cap)s + 1) capped)::bigint,
       (SELECT count(*) FROM {schema}.pgqueue_jobs WHERE status = 'retrying')::bigint

-- name: dead_since
-- Dead jobs per queue that died after the last full count (dead_by_queue): a range of the dead
-- index, as short as the deaths of the last 30 seconds.
SELECT queue, count(*)::bigint FROM {schema}.pgqueue_jobs
WHERE status = 'dead' AND finished_at > to_timestamp(%(since)s)
GROUP BY queue

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

-- name: queue_settings
-- Operators' settings (`pgqueue queues pause`, `pgqueue queues limit`): a few rows, for the
-- badges next to queue names and the queues table. Whether the role may read the rate logs:
-- queue_rates runs only then (a role granted before they existed still gets a page).
SELECT name, paused, concurrency_limit, rate_limit, rate_period,
       has_table_privilege(to_regclass(format('%%I.pgqueue_rates', %(schema)s::text)), 'SELECT')
FROM {schema}.pgqueue_queues
ORDER BY name
LIMIT 1000

-- name: queue_rates
-- Starts in the current period of each rate-limited queue, from the limited claim's log (one
-- primary-key probe per rated queue), and when there is room again: as job_why counts them.
SELECT q.name, sum(x.c)::int,
       extract(epoch FROM min(x.at) + make_interval(secs => q.rate_period) - now())::float8
FROM {schema}.pgqueue_queues q
JOIN {schema}.pgqueue_rates rt ON rt.name = 'q:' || q.name
CROSS JOIN LATERAL unnest(rt.times, rt.counts) AS x(at, c)
WHERE q.rate_limit IS NOT NULL AND x.at > now() - make_interval(secs => q.rate_period)
GROUP BY q.name, q.rate_period

-- name: oldest_transaction
-- How many sessions of this database this role may not see (without pg_read_all_stats, other
-- roles' rows read '<insufficient privilege>', with no times), and the oldest transaction here
-- older than the threshold that holds back vacuum (it has a snapshot or an xid): every dead row
-- newer than its xmin stays, in the jobs table too. One pass over pg_stat_activity, in memory.
SELECT count(*) FILTER (WHERE a.query = '<insufficient privilege>')::int,
       (array_agg(jsonb_build_array(a.pid, a.application_name, a.state,
                  extract(epoch FROM now() - a.xact_start)::float8,
                  extract(epoch FROM now() - a.query_start)::float8, left(a.query, 200),
                  age(a.backend_xmin)) ORDER BY a.xact_start)
        FILTER (WHERE a.pid <> pg_backend_pid()
                  AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
                  AND a.xact_start < now() - make_interval(secs => %(older_than)s)))[1]
FROM pg_stat_activity a
WHERE a.datname = current_database()

-- name: replica
-- In recovery (a hot standby), and how far behind the primary its figures are. Caught up with
-- all the WAL it has received while a WAL receiver streams: 0, since an idle primary sends
-- nothing to replay and the last replayed commit's age would grow for nothing. Otherwise that
-- commit's age (NULL before the first). pg_stat_wal_receiver shows a row, if only its pid, to
-- any role.
SELECT pg_is_in_recovery(),
       CASE WHEN NOT pg_is_in_recovery() THEN NULL
            WHEN pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn()
                 AND EXISTS (SELECT FROM pg_stat_wal_receiver) THEN 0
            ELSE greatest(extract(epoch FROM now() - pg_last_xact_replay_timestamp()), 0)
       END::float8,
       EXISTS (SELECT FROM pg_stat_wal_receiver)

-- name: insert_counter
-- Cumulative inserts into the jobs table (statistics, no table scan), for the INSERT arrow's rate;
-- and its live and dead rows, for the health strip (autovacuum behind, or held back).
SELECT n_tup_ins::bigint, n_live_tup::bigint, n_dead_tup::bigint,
       extract(epoch FROM now() - greatest(last_vacuum, last_autovacuum))::float8
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
-- One job by primary key (/jobs/{{id}} and /api/jobs/{{id}}), with its worker and its schedule, one
-- primary-key probe each. Values over 64 kB (pg_column_size, so a large toasted value is not
-- even fetched) come back NULL with their size; the error is cut to 64 kB. The worker's row is
-- gone once the job finished (acks clear worker_id) or its worker was pruned.
SELECT j.id, j.task, j.queue, j.status::text, j.attempts, j.max_attempts, j.priority,
       CASE WHEN pg_column_size(j.args) <= 65536 THEN j.args::text END, pg_column_size(j.args),
       left(j.last_error, 65536), length(j.last_error),
       j.created_at, j.run_at, j.claimed_at, j.started_at, j.finished_at, j.worker_id::text,
       CASE WHEN pg_column_size(j.meta) <= 65536 THEN j.meta::text END, pg_column_size(j.meta),
       j.progress,
       CASE WHEN pg_column_size(j.result) <= 65536 THEN j.result::text END,
       pg_column_size(j.result),
       j.cancel_requested_at, j.lease_token::text,
       COALESCE(j.lease_expires_at, w.lease_expires_at), j.schedule_name, j.schedule_tick, s.cron,
       j.unique_key, j.limit_key, w.host, w.pid,
       extract(epoch FROM now() - w.last_heartbeat_at)::float8, w.lease_expires_at > now(), now()
FROM {schema}.pgqueue_jobs j
LEFT JOIN {schema}.pgqueue_workers w ON w.id = j.worker_id
LEFT JOIN {schema}.pgqueue_schedules s ON s.name = j.schedule_name
WHERE j.id = %(id)s

-- name: archived_job_detail
-- job_detail for a job that is no longer in pgqueue_jobs: moved to the archive by a worker with
-- archive=True (migration 0018). Run only when job_detail found nothing: one id probe per
-- partition. Same columns; what a finished job no longer has (worker, lease, limit group) is NULL.
SELECT a.id, a.task, a.queue, a.status, a.attempts, a.max_attempts, a.priority,
       CASE WHEN pg_column_size(a.args) <= 65536 THEN a.args::text END, pg_column_size(a.args),
       left(a.last_error, 65536), length(a.last_error),
       a.created_at, a.run_at, a.claimed_at, a.started_at, a.finished_at, NULL::text,
       CASE WHEN pg_column_size(a.meta) <= 65536 THEN a.meta::text END, pg_column_size(a.meta),
       a.progress,
       CASE WHEN pg_column_size(a.result) <= 65536 THEN a.result::text END,
       pg_column_size(a.result),
       NULL::timestamptz, NULL::text, NULL::timestamptz, a.schedule_name, a.schedule_tick, s.cron,
       a.unique_key, NULL::text, NULL::text, NULL::integer, NULL::float8, NULL::boolean, now()
FROM {schema}.pgqueue_jobs_archive a
LEFT JOIN {schema}.pgqueue_schedules s ON s.name = a.schedule_name
WHERE a.id = %(id)s
LIMIT 1

-- name: archived_job_attempts
-- job_attempts for an archived job: its attempts moved with it (attempt_history), newest first.
SELECT h.attempt, h.worker_id::text, h.claimed_at, h.started_at, h.finished_at, h.outcome,
       h.error
FROM {schema}.pgqueue_jobs_archive a,
     jsonb_to_recordset(a.attempt_history) AS h(attempt integer, worker_id uuid,
         claimed_at timestamptz, started_at timestamptz, finished_at timestamptz,
         outcome text, error text)
WHERE a.id = %(id)s
ORDER BY h.finished_at DESC
LIMIT %(limit)s

-- name: job_attempts
-- The job's attempts that did not succeed (pgqueue_attempts, migration 0016), the latest
-- %(limit)s of them, newest first: one range of pgqueue_attempts_job_idx. Errors are kept to
-- 8,000 characters when written.
SELECT attempt, worker_id::text, claimed_at, started_at, finished_at, outcome, error
FROM {schema}.pgqueue_attempts
WHERE job_id = %(id)s
ORDER BY finished_at DESC
LIMIT %(limit)s

-- name: job_family
-- The jobs this one runs after (parents, in their after= order: the child index) and the jobs
-- that run after it (children: the primary key's parent_id prefix), the first %(limit)s of each
-- with task and status (primary-key probes), and how many of each, counted up to 1,001 so
-- that a group's callback with 100,000 parents costs a bounded index-only read. A parent
-- pruned since (succeeded past the retention window) has no status.
SELECT (SELECT count(*) FROM (SELECT FROM {schema}.pgqueue_job_deps
                              WHERE child_id = %(id)s LIMIT 1001) n)::int,
       (SELECT count(*) FROM (SELECT FROM {schema}.pgqueue_job_deps
                              WHERE parent_id = %(id)s LIMIT 1001) n)::int,
       (SELECT jsonb_agg(jsonb_build_array(d.parent_id, j.task, j.status) ORDER BY d.position,
                         d.parent_id)
        FROM (SELECT parent_id, position FROM {schema}.pgqueue_job_deps WHERE child_id = %(id)s
              ORDER BY position, parent_id LIMIT %(limit)s) d
        LEFT JOIN {schema}.pgqueue_jobs j ON j.id = d.parent_id),
       (SELECT jsonb_agg(jsonb_build_array(d.child_id, j.task, j.status) ORDER BY d.child_id)
        FROM (SELECT child_id FROM {schema}.pgqueue_job_deps WHERE parent_id = %(id)s
              ORDER BY child_id LIMIT %(limit)s) d
        LEFT JOIN {schema}.pgqueue_jobs j ON j.id = d.child_id)

-- name: job_why
-- Why a waiting job is not running (dashboard/why.py reads the figures): everything the claims
-- check, for this one job. Live workers are those the dashboard does not show as late, with a
-- lease if they have one (claims need it); the queues they serve are pgqueue_workers.queues
-- (NULL: every queue). Running jobs are read once, from the running partial index (bounded by
-- the fleet's concurrency): leases held per serving worker, and the queue's running count when
-- it has a limit. The task's group count is one probe of pgqueue_jobs_running_limited_idx;
-- queue, task, wait and rate-log rows are primary-key probes. A blocked job's unfinished
-- parents: its count from pgqueue_job_waits, and the first 10 of its first 1,000 parents. Last,
-- whether a serving worker has the job's task (pgqueue_workers.tasks; NULL: a worker from before
-- migration 0017, which counts as having every task).
WITH job AS (
    SELECT j.id, j.queue, j.task, j.status::text AS status, j.run_at, j.limit_key
    FROM {schema}.pgqueue_jobs j WHERE j.id = %(id)s
), live AS (
    SELECT w.id, w.queues, w.concurrency, w.tasks FROM {schema}.pgqueue_workers w
    WHERE w.last_heartbeat_at >= now() - make_interval(secs => %(late_after)s)
      AND (w.lease_expires_at IS NULL OR w.lease_expires_at > now())
), running AS MATERIALIZED (
    SELECT r.worker_id, r.queue FROM {schema}.pgqueue_jobs r WHERE r.status = 'running'
), serving AS (
    SELECT l.id, l.concurrency, l.tasks, COALESCE(h.n, 0) AS held
    FROM live l JOIN job ON l.queues IS NULL OR job.queue = ANY(l.queues)
    LEFT JOIN (SELECT worker_id, count(*) AS n FROM running GROUP BY worker_id) h
           ON h.worker_id = l.id
)
SELECT job.status, extract(epoch FROM job.run_at - now())::float8,
       (SELECT count(*) FROM live)::int,
       ARRAY(SELECT DISTINCT q FROM live, unnest(live.queues) AS q ORDER BY q),
       (SELECT count(*) FROM serving)::int,
       (SELECT COALESCE(sum(concurrency), 0) FROM serving)::int,
       (SELECT COALESCE(sum(least(held, concurrency)), 0) FROM serving)::int,
       COALESCE(q.paused, false), q.concurrency_limit, q.rate_limit, q.rate_period,
       CASE WHEN q.concurrency_limit IS NOT NULL
            THEN (SELECT count(*) FROM running r WHERE r.queue = job.queue)::int END,
       CASE WHEN q.rate_limit IS NOT NULL THEN
           (SELECT jsonb_build_array(sum(x.c),
                   extract(epoch FROM min(x.at) + make_interval(secs => q.rate_period) - now()))
            FROM {schema}.pgqueue_rates rt, unnest(rt.times, rt.counts) AS x(at, c)
            WHERE rt.name = 'q:' || job.queue
              AND x.at > now() - make_interval(secs => q.rate_period)) END,
       t.concurrency_limit, t.rate_limit, t.rate_period, t.per_key, job.limit_key,
       CASE WHEN t.concurrency_limit IS NOT NULL AND job.limit_key IS NOT NULL
            THEN (SELECT count(*) FROM {schema}.pgqueue_jobs r
                  WHERE r.status = 'running' AND r.task = job.task
                        AND r.limit_key = job.limit_key)::int END,
       CASE WHEN t.rate_limit IS NOT NULL AND job.limit_key IS NOT NULL THEN
           (SELECT jsonb_build_array(sum(x.c),
                   extract(epoch FROM min(x.at) + make_interval(secs => t.rate_period) - now()))
            FROM {schema}.pgqueue_rates rt, unnest(rt.times, rt.counts) AS x(at, c)
            WHERE rt.name = 't:' || length(job.task) || ':' || job.task || ':' || job.limit_key
              AND x.at > now() - make_interval(secs => t.rate_period)) END,
       wt.waiting, wt.failed_parent, wt.after_failure,
       CASE WHEN job.status = 'blocked' THEN
           (SELECT jsonb_agg(jsonb_build_array(u.id, u.task, u.status) ORDER BY u.position, u.id)
            FROM (SELECT p.id, p.task, p.status::text AS status, d.position
                  FROM (SELECT parent_id, position FROM {schema}.pgqueue_job_deps
                        WHERE child_id = job.id ORDER BY position, parent_id LIMIT 1000) d
                  JOIN {schema}.pgqueue_jobs p ON p.id = d.parent_id
                  WHERE p.status::text NOT IN ('succeeded', 'dead', 'cancelled')
                  ORDER BY d.position, p.id LIMIT 10) u) END,
       job.task, EXISTS (SELECT FROM serving s WHERE s.tasks IS NULL OR job.task = ANY(s.tasks))
FROM job
LEFT JOIN {schema}.pgqueue_queues q ON q.name = job.queue
LEFT JOIN {schema}.pgqueue_tasks t ON t.name = job.task
LEFT JOIN {schema}.pgqueue_job_waits wt ON wt.child_id = job.id
