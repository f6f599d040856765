-- The statements of pgqueue.testing, by name (rendered like queries.sql: {schema} is quoted).

-- name: pending_jobs
-- What keeps run_until_idle from being idle: jobs of the served queues (NULL: every queue) that
-- are running, or waiting and due, outside paused queues (no worker claims those); with
-- %(retries)s, every retrying job, due or not (skip_retry_delays makes it due: judged by the
-- clock instead, a retry falling due between the two statements was neither). The running
-- ones first, then by id; at most %(limit)s rows, each with the total count.
SELECT id, task, queue, status::text, attempts, run_at, count(*) OVER ()
FROM {schema}.pgqueue_jobs
WHERE (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
  AND (status = 'running'
       OR ((status IN ('queued', 'retrying') AND run_at <= now()
            OR status = 'retrying' AND %(retries)s)
           AND queue NOT IN (SELECT name FROM {schema}.pgqueue_queues WHERE paused)))
ORDER BY status = 'running' DESC, id
LIMIT %(limit)s

-- name: skip_retry_delays
-- run_until_idle(retries=True): a failed attempt's retry is due at once instead of after its
-- backoff, so a drain ends with every job finished, whatever the jitter drew.
UPDATE {schema}.pgqueue_jobs SET run_at = now()
WHERE status = 'retrying' AND run_at > now()
  AND (%(queues)s::text[] IS NULL OR queue = ANY(%(queues)s::text[]))
RETURNING id
