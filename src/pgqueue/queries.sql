-- Every statement pgqueue runs, by name. {schema} is the quoted schema and {channel} the quoted
-- NOTIFY channel literal; values are always %(name)s parameters.

-- name: insert_job
-- One row, run_at from the database clock (now() + delay) unless an absolute time is given.
-- The limit group is the producer's (its task declares a limit) or, when it has none, '' for a
-- task limited in the database (an app that does not declare the task, an operator's limit):
-- one primary-key probe of the small pgqueue_tasks, so no job of a limited task escapes it.
INSERT INTO {schema}.pgqueue_jobs
    (queue, task, args, priority, run_at, max_attempts, limit_key, meta)
VALUES (%(queue)s, %(task)s, %(args)s::jsonb, %(priority)s,
        COALESCE(%(run_at)s::timestamptz, now() + make_interval(secs => %(delay)s)),
        %(max_attempts)s,
        COALESCE(%(limit_key)s, (SELECT '' FROM {schema}.pgqueue_tasks WHERE name = %(task)s)),
        %(meta)s::jsonb)
RETURNING id

-- name: insert_child_job
-- A job that runs after others (after=[...], chains, group callbacks; migration 0015). Its
-- parents are locked first (FOR UPDATE, in id order): a parent's ack waits for this transaction,
-- then sees the dependency and releases the child (the trigger reads it in a newer snapshot),
-- and a parent that finished before is seen finished here. So the child is counted against
-- exactly the parents still unfinished, never released early, never forgotten. A parent already
-- dead or cancelled cancels the child at once unless after_failure is 'run'. Every parent gets
-- a dependency row (position: its place in after, for the results a callback receives); those
-- unfinished are marked has_children. No row: some parent does not exist.
WITH parents AS (
    SELECT p.id, p.status::text AS status, a.ord
    FROM (SELECT id, status FROM {schema}.pgqueue_jobs WHERE id = ANY(%(after)s::bigint[])
          ORDER BY id FOR UPDATE) p
    JOIN (SELECT DISTINCT ON (id) id, ord
          FROM unnest(%(after)s::bigint[]) WITH ORDINALITY AS a(id, ord) ORDER BY id, ord) a
      ON a.id = p.id
), state AS (
    SELECT count(*) FILTER (WHERE status NOT IN ('succeeded', 'dead', 'cancelled')) AS pending,
           min(id) FILTER (WHERE status IN ('dead', 'cancelled')) AS failed,
           count(*) AS found
    FROM parents
), child AS (
    INSERT INTO {schema}.pgqueue_jobs
        (queue, task, args, priority, run_at, max_attempts, limit_key, meta, status,
         finished_at, last_error)
    SELECT %(queue)s, %(task)s, %(args)s::jsonb, %(priority)s,
           COALESCE(%(run_at)s::timestamptz, now() + make_interval(secs => %(delay)s)),
           %(max_attempts)s,
           COALESCE(%(limit_key)s, (SELECT '' FROM {schema}.pgqueue_tasks WHERE name = %(task)s)),
           %(meta)s::jsonb,
           (CASE WHEN s.failed IS NOT NULL AND %(after_failure)s <> 'run' THEN 'cancelled'
                 WHEN s.pending > 0 THEN 'blocked' ELSE 'queued' END)::{schema}.pgqueue_status,
           CASE WHEN s.failed IS NOT NULL AND %(after_failure)s <> 'run' THEN now() END,
           CASE WHEN s.failed IS NOT NULL AND %(after_failure)s <> 'run'
                THEN 'ParentFailed: job ' || s.failed
                     || ', which this job runs after, had already ended' END
    FROM state s
    WHERE s.found = cardinality(ARRAY(SELECT DISTINCT unnest(%(after)s::bigint[])))
    RETURNING id, status::text
), waits AS (
    INSERT INTO {schema}.pgqueue_job_waits (child_id, waiting, failed_parent, after_failure)
    SELECT c.id, s.pending, s.failed, %(after_failure)s
    FROM child c, state s WHERE c.status = 'blocked'
), deps AS (
    INSERT INTO {schema}.pgqueue_job_deps (parent_id, child_id, position)
    SELECT p.id, c.id, p.ord FROM parents p, child c
), marked AS (
    UPDATE {schema}.pgqueue_jobs j SET has_children = true
    FROM parents p, child c
    WHERE j.id = p.id AND c.status = 'blocked' AND NOT j.has_children
      AND p.status NOT IN ('succeeded', 'dead', 'cancelled')
)
SELECT id, status FROM child

-- name: insert_group_members
-- A group's members in one chunk, returning their ids (in insertion order: identity values are
-- drawn row by row). They are parents of the group's callback from birth: has_children.
INSERT INTO {schema}.pgqueue_jobs
    (queue, task, args, priority, run_at, max_attempts, limit_key, meta, has_children)
SELECT d.queue, d.task, d.args::jsonb, d.priority, d.run_at, d.max_attempts,
       COALESCE(d.limit_key, (SELECT '' FROM {schema}.pgqueue_tasks WHERE name = d.task)),
       d.meta::jsonb, %(has_children)s
FROM unnest(%(queues)s::text[], %(tasks)s::text[], %(args)s::text[], %(priorities)s::int[],
            %(run_ats)s::timestamptz[], %(max_attempts)s::int[], %(limit_keys)s::text[],
            %(metas)s::text[]) WITH ORDINALITY
     AS d(queue, task, args, priority, run_at, max_attempts, limit_key, meta, ord)
ORDER BY d.ord
RETURNING id

-- name: parent_results
-- A callback's parents' results, in their order (its results argument).
SELECT j.result FROM {schema}.pgqueue_job_deps d
JOIN {schema}.pgqueue_jobs j ON j.id = d.parent_id
WHERE d.child_id = %(id)s
ORDER BY d.position

-- name: insert_unique_job
-- A unique job (concepts/uniqueness.md). PostgreSQL enforces the key: of two producers racing
-- with one key, the second waits for the first's transaction and lands in ON CONFLICT, never
-- beside it. The existing job is the answer while the rule still holds for it (the WHERE, checked
-- on its newest version under the row lock): 'replace' then takes the new arguments and
-- priority, 'debounce' those and the later run_at, but only while the existing job waits (a
-- running job is left alone). A job that no longer holds its key (finished; running under the
-- 'waiting' rule; succeeded longer ago than unique_for) returns no row: the producer releases
-- its key (release_unique_keys) and runs this again. So the rule is applied by the next enqueue
-- with the key, never on the claim, ack or reap path, and the common case is one statement.
-- RETURNING: the id, whether it is an existing job (ON CONFLICT's lock sets its xmax), and
-- whether that job took the new values.
INSERT INTO {schema}.pgqueue_jobs AS j
    (queue, task, args, priority, run_at, max_attempts, unique_key, unique_while, unique_for,
     limit_key, meta)
VALUES (%(queue)s, %(task)s, %(args)s::jsonb, %(priority)s,
        COALESCE(%(run_at)s::timestamptz, now() + make_interval(secs => %(delay)s)),
        %(max_attempts)s, %(unique_key)s, %(unique_while)s, %(unique_for)s,
        COALESCE(%(limit_key)s, (SELECT '' FROM {schema}.pgqueue_tasks WHERE name = %(task)s)),
        %(meta)s::jsonb)
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO UPDATE
SET args = CASE WHEN %(on_conflict)s <> 'keep' AND j.status IN ('queued', 'retrying')
                THEN EXCLUDED.args ELSE j.args END,
    priority = CASE WHEN %(on_conflict)s <> 'keep' AND j.status IN ('queued', 'retrying')
                    THEN EXCLUDED.priority ELSE j.priority END,
    run_at = CASE WHEN %(on_conflict)s = 'debounce' AND j.status IN ('queued', 'retrying')
                  THEN greatest(j.run_at, EXCLUDED.run_at) ELSE j.run_at END
WHERE j.status IN ('queued', 'retrying')
       OR (j.status = 'running' AND j.unique_while IS NOT DISTINCT FROM 'active')
       OR (j.status = 'succeeded' AND j.unique_for IS NOT NULL
           AND j.finished_at + make_interval(secs => j.unique_for) > now())
RETURNING j.id, j.xmax <> 0,
          j.xmax <> 0 AND %(on_conflict)s <> 'keep' AND j.status IN ('queued', 'retrying')

-- name: insert_unique_jobs
-- insert_unique_job for a bulk enqueue, one chunk of rows given as arrays (a COPY cannot say
-- ON CONFLICT). Keys are distinct within a chunk (the producer merges repeats first: one
-- statement cannot update a row twice) and one on_conflict applies to the chunk. Rows without a
-- key are plain inserts. RETURNING names the keys answered; the producer releases the keys of
-- the rest (their jobs no longer hold them) and runs those rows again.
INSERT INTO {schema}.pgqueue_jobs AS j
    (queue, task, args, priority, run_at, max_attempts, unique_key, unique_while, unique_for,
     limit_key, meta)
SELECT d.queue, d.task, d.args::jsonb, d.priority, d.run_at, d.max_attempts, d.unique_key,
       d.unique_while, d.unique_for, d.limit_key, d.meta::jsonb
FROM unnest(%(queues)b::text[], %(tasks)b::text[], %(args)b::text[], %(priorities)b::int[],
            %(run_ats)b::timestamptz[], %(max_attempts)b::int[], %(keys)b::text[],
            %(whiles)b::text[], %(fors)b::float8[], %(limit_keys)b::text[], %(metas)b::text[])
     WITH ORDINALITY
     AS d(queue, task, args, priority, run_at, max_attempts, unique_key, unique_while,
          unique_for, limit_key, meta, ord)
ORDER BY d.ord
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO UPDATE
SET args = CASE WHEN %(on_conflict)s <> 'keep' AND j.status IN ('queued', 'retrying')
                THEN EXCLUDED.args ELSE j.args END,
    priority = CASE WHEN %(on_conflict)s <> 'keep' AND j.status IN ('queued', 'retrying')
                    THEN EXCLUDED.priority ELSE j.priority END,
    run_at = CASE WHEN %(on_conflict)s = 'debounce' AND j.status IN ('queued', 'retrying')
                  THEN greatest(j.run_at, EXCLUDED.run_at) ELSE j.run_at END
WHERE j.status IN ('queued', 'retrying')
       OR (j.status = 'running' AND j.unique_while IS NOT DISTINCT FROM 'active')
       OR (j.status = 'succeeded' AND j.unique_for IS NOT NULL
           AND j.finished_at + make_interval(secs => j.unique_for) > now())
RETURNING j.unique_key, j.xmax = 0

-- name: insert_coalesced_jobs
-- Many callers' single jobs in one autocommit statement (the coalescing producer,
-- pgqueue.coalesce): every row of it commits or none does, in one round trip and one commit.
-- Plain jobs and unique jobs with on_conflict 'keep' only (the producer sends the others alone).
-- run_at and the limit group per row as in insert_job: the database clock, and '' for a task
-- limited in the database. Unique rows go first, in key order, so two batches sharing keys lock
-- them in the same order and cannot deadlock (keys are distinct within a batch: the producer
-- answers a repeat with the first's job, as if sent in turn). Plain rows follow in the callers'
-- order and draw their ids row by row, so sorted, their ids are the callers' in order (as in
-- insert_group_members). A key held by a job the rule of insert_unique_job still holds for
-- answers that job; a key whose job no longer holds it answers nothing (released, sent again).
-- RETURNING: the id, the key (NULL for a plain job), and whether the job already existed.
-- A column whose value is the same in every row (queue, task, priority, delay, max_attempts:
-- most batches) comes as that one value (the *_all parameters) and a NULL array, which unnest
-- pads with NULLs; a column NULL in every row comes as a NULL array alone (coalesce._column):
-- psycopg dumps an array element by element, and the producer's process is the limit.
INSERT INTO {schema}.pgqueue_jobs AS j
    (queue, task, args, priority, run_at, max_attempts, unique_key, unique_while, unique_for,
     limit_key, meta)
SELECT d.queue, d.task, d.args::jsonb, d.priority,
       COALESCE(d.run_at, now() + make_interval(secs => d.delay)), d.max_attempts,
       d.unique_key, d.unique_while, d.unique_for,
       COALESCE(d.limit_key, (SELECT '' FROM {schema}.pgqueue_tasks WHERE name = d.task)),
       d.meta::jsonb
FROM (
    SELECT COALESCE(u.queue, %(queue_all)s::text) AS queue,
           COALESCE(u.task, %(task_all)s::text) AS task, u.args,
           COALESCE(u.priority, %(priority_all)s::int) AS priority, u.run_at,
           COALESCE(u.delay, %(delay_all)s::float8) AS delay,
           COALESCE(u.max_attempts, %(max_attempts_all)s::int) AS max_attempts,
           u.unique_key, u.unique_while, u.unique_for, u.limit_key, u.meta, u.ord
    FROM unnest(%(queues)b::text[], %(tasks)b::text[], %(args)b::text[], %(priorities)b::int[],
                %(run_ats)b::timestamptz[], %(delays)b::float8[], %(max_attempts)b::int[],
                %(keys)b::text[], %(whiles)b::text[], %(fors)b::float8[],
                %(limit_keys)b::text[], %(metas)b::text[]) WITH ORDINALITY
         AS u(queue, task, args, priority, run_at, delay, max_attempts, unique_key,
              unique_while, unique_for, limit_key, meta, ord)
) d
ORDER BY d.unique_key, d.ord
ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO UPDATE SET args = j.args
WHERE j.status IN ('queued', 'retrying')
       OR (j.status = 'running' AND j.unique_while IS NOT DISTINCT FROM 'active')
       OR (j.status = 'succeeded' AND j.unique_for IS NOT NULL
           AND j.finished_at + make_interval(secs => j.unique_for) > now())
RETURNING j.id, j.unique_key, j.xmax <> 0

-- name: release_unique_keys
-- Keys whose job no longer holds them (the rule of insert_unique_job, negated) are cleared, so
-- the next insert can take them. The job itself is untouched. One index probe per key.
UPDATE {schema}.pgqueue_jobs o SET unique_key = NULL
WHERE o.unique_key = ANY(%(keys)s::text[])
  AND NOT (o.status IN ('queued', 'retrying')
       OR (o.status = 'running' AND o.unique_while IS NOT DISTINCT FROM 'active')
       OR (o.status = 'succeeded' AND o.unique_for IS NOT NULL
           AND o.finished_at + make_interval(secs => o.unique_for) > now()))

-- name: copy_jobs
-- Bulk enqueue. COPY fires the statement-level trigger once for the whole batch. Text format:
-- the producer writes pre-formatted, escaped lines, cheaper than formatting binary rows in Python.
-- Unique jobs are copied too, optimistically: a key that some job already carries fails the
-- COPY (pgqueue_jobs_unique_idx), its savepoint rolls back, and the producer writes those chunks
-- again with insert_unique_jobs, which answers duplicates. A batch of new keys costs a COPY.
-- Limit groups come from the producer (BatchClock: it read the limited tasks with the clock).
COPY {schema}.pgqueue_jobs
    (queue, task, args, priority, run_at, max_attempts, unique_key, unique_while, unique_for,
     limit_key, meta)
FROM STDIN

-- name: database_now
-- The reference time for bulk rows' run_at: the database clock, never the caller's; and the
-- tasks limited in the database, whose jobs a bulk enqueue gives a limit group ('').
SELECT now(), ARRAY(SELECT name FROM {schema}.pgqueue_tasks)

-- name: database_now_bounded
-- database_now, first in a transaction of pgqueue's own that waits for its client (a bulk
-- enqueue, a chain, a group: producer.bound_client_waits), bounding the server's wait for this
-- client until the transaction ends. Mid-COPY the server waits for the next chunk with no
-- timeout (idle_in_transaction_session_timeout does not run there, and is off by default
-- between statements), so a producer cut off from the network held its jobs' unique keys
-- (another enqueue of those keys waited) and the NOTIFY trigger's shared lock until TCP's
-- default keepalives gave up, about two hours. Here the server probes the client as pgqueue's
-- side probes the server (db.KEEPALIVES): a vanished client is dropped within about 15 s and
-- its transaction rolls back. set_config(..., true) reverts at the
-- transaction's end, so nothing stays on the session (behind a transaction-pooling PgBouncer
-- they are set on PgBouncer's link, which they leave as they found it); on a Unix socket
-- PostgreSQL ignores them.
SELECT now(), ARRAY(SELECT name FROM {schema}.pgqueue_tasks),
       set_config('tcp_keepalives_idle', %(idle)s, true),
       set_config('tcp_keepalives_interval', %(interval)s, true),
       set_config('tcp_keepalives_count', %(count)s, true),
       set_config('tcp_user_timeout', %(user_timeout)s, true)

-- name: announce_waiting
-- A worker waiting for work says so, on its LISTEN connection: producers notify while any worker
-- holds this lock (migration 0004 explains the pair of locks).
SELECT pg_advisory_lock_shared(hashtext({channel}), 1)

-- name: withdraw_waiting
SELECT pg_advisory_unlock_shared(hashtext({channel}), 1)

-- name: enqueuers_settled
-- True when no transaction that inserted ready jobs is open: none can still be hiding a job whose
-- NOTIFY it skipped before this worker announced itself.
SELECT CASE WHEN pg_try_advisory_lock(hashtext({channel}), 2)
            THEN pg_advisory_unlock(hashtext({channel}), 2)
            ELSE false END

-- name: job_attempts
-- Every attempt of a job, as App.job_attempts lists them: the latest %(limit)s of those that did
-- not succeed (pgqueue_attempts, migration 0016: one range of pgqueue_attempts_job_idx), and the
-- job row's own attempt when it is running or succeeded (no history row holds that one; an ack
-- clears the worker). The last column tells them apart; one statement, so both are one snapshot.
(SELECT attempt, outcome, worker_id, claimed_at, started_at, finished_at, error, false
 FROM {schema}.pgqueue_attempts
 WHERE job_id = %(id)s
 ORDER BY finished_at DESC
 LIMIT %(limit)s)
UNION ALL
SELECT attempts, status::text, worker_id, claimed_at, started_at, finished_at, NULL, true
FROM {schema}.pgqueue_jobs
WHERE id = %(id)s AND status IN ('running', 'succeeded') AND attempts > 0

-- name: get_job
-- A running job's lease is its worker's (migration 0005) unless it carries its own. A job that
-- is no longer in pgqueue_jobs may have been archived (archive_finished_jobs): the second
-- branch runs only when the first found nothing (Append under LIMIT 1), one probe per archive
-- partition. One snapshot sees a job in one of the two tables, never both, never neither.
(SELECT j.id, j.queue, j.task, j.args, j.priority, j.run_at, j.status::text, j.attempts,
        j.max_attempts, j.lease_token,
        CASE WHEN j.status = 'running' THEN COALESCE(j.lease_expires_at, w.lease_expires_at) END,
        j.worker_id, j.last_error, j.result, j.created_at, j.claimed_at, j.started_at,
        j.finished_at, j.unique_key, j.meta, j.progress
 FROM {schema}.pgqueue_jobs j
 LEFT JOIN {schema}.pgqueue_workers w ON w.id = j.worker_id
 WHERE j.id = %(id)s)
UNION ALL
(SELECT a.id, a.queue, a.task, a.args, a.priority, a.run_at, a.status, a.attempts,
        a.max_attempts, NULL::uuid, NULL::timestamptz, NULL::uuid, a.last_error, a.result,
        a.created_at, a.claimed_at, a.started_at, a.finished_at, a.unique_key, a.meta,
        a.progress
 FROM {schema}.pgqueue_jobs_archive a
 WHERE a.id = %(id)s)
LIMIT 1

-- name: requeue_job
-- Dead or cancelled jobs only, with a fresh set of attempts; wakes the queue's workers. A job
-- without a limit group whose task has since been limited task-wide gets the group '' (the
-- passes that group a newly limited task's jobs look only at waiting ones); under a per-key
-- limit it stays without one, and the worker that claims it gives it back with its key.
WITH requeued AS (
    UPDATE {schema}.pgqueue_jobs
    SET status = 'queued', attempts = 0, run_at = now(), finished_at = NULL,
        claimed_at = NULL, started_at = NULL, result = NULL,
        limit_key = COALESCE(limit_key, (SELECT '' FROM {schema}.pgqueue_tasks k
                                         WHERE k.name = task AND NOT k.per_key))
    WHERE id = %(id)s AND status IN ('dead', 'cancelled')
    RETURNING queue
)
SELECT pg_notify({channel}, queue) FROM requeued

-- name: cancel_job
-- A waiting job (queued, retrying, or blocked behind its parents: its own children are then
-- cancelled by the release trigger, in this transaction) is cancelled here; a running one is only marked (cancel_requested_at): its
-- worker stops the attempt and writes 'cancelled' itself, fenced like any ack, so a success
-- that lands first wins and nothing is yanked from under a handler that is still running. The
-- worker hears of it by NOTIFY ('cancel,' and the id: no queue name has a comma), or at its next
-- heartbeat if that is lost; a crashed worker's job is cancelled by the reaper instead of
-- retried. Waiters for a cancelled job's result hear of it at commit. Returns the status the job
-- had (no row: no such job).
WITH target AS (
    SELECT id, status::text AS was FROM {schema}.pgqueue_jobs WHERE id = %(id)s FOR UPDATE
), changed AS (
    UPDATE {schema}.pgqueue_jobs j
    SET status = CASE WHEN t.was = 'running' THEN j.status ELSE 'cancelled' END,
        finished_at = CASE WHEN t.was = 'running' THEN j.finished_at ELSE now() END,
        cancel_requested_at = now()
    FROM target t
    WHERE j.id = t.id AND t.was IN ('queued', 'retrying', 'blocked', 'running')
    RETURNING j.id
)
SELECT t.was, CASE WHEN t.was IN ('queued', 'retrying', 'blocked')
                   THEN pg_notify({done_channel}, t.id::text)
                   WHEN t.was = 'running' THEN pg_notify({channel}, 'cancel,' || t.id) END,
       (SELECT count(*) FROM changed)
FROM target t

-- name: find_jobs
-- `pgqueue jobs`: the newest jobs matching a filter (sql.JOB_FILTER: each part NULL matches
-- any), newest first. The error is its first line.
SELECT id, task, queue, status::text, attempts, max_attempts, created_at, finished_at,
       split_part(left(last_error, 2000), E'\n', 1)
FROM {schema}.pgqueue_jobs
WHERE {job_filter}
ORDER BY id DESC
LIMIT %(limit)s

-- name: count_jobs
-- A dry run: how many jobs a bulk action would change.
SELECT count(*) FROM {schema}.pgqueue_jobs
WHERE {job_filter}

-- name: bulk_batch
-- One batch of a bulk action: up to %(batch)s matching jobs after id %(after)s, in id order,
-- locked without waiting (a job being claimed or acked right now is skipped: the action's next
-- run takes it), then changed by the action (the requeued, cancelled or purged step; the others
-- change nothing; a purged job's attempts go with it; a requeued job's limit group as in
-- requeue_job) and counted into the audit row, all in one short transaction: an interrupted action leaves every batch it finished done and
-- recorded, and no lock held. Returns the last id looked at and how
-- many changed; the caller goes on after that id until a batch comes back short.
WITH picked AS (
    SELECT id FROM {schema}.pgqueue_jobs
    WHERE id > %(after)s AND {job_filter}
    ORDER BY id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE {schema}.pgqueue_jobs j
    SET status = 'queued', attempts = 0, run_at = now(), finished_at = NULL, claimed_at = NULL,
        started_at = NULL, result = NULL, cancel_requested_at = NULL, progress = NULL,
        limit_key = COALESCE(j.limit_key, (SELECT '' FROM {schema}.pgqueue_tasks k
                                           WHERE k.name = j.task AND NOT k.per_key))
    FROM picked p WHERE j.id = p.id AND %(action)s = 'requeue'
    RETURNING j.id, j.queue
), cancelled AS (
    UPDATE {schema}.pgqueue_jobs j
    SET status = CASE WHEN j.status = 'running' THEN j.status ELSE 'cancelled' END,
        finished_at = CASE WHEN j.status = 'running' THEN NULL ELSE now() END,
        cancel_requested_at = now()
    FROM picked p WHERE j.id = p.id AND %(action)s = 'cancel'
    RETURNING j.id, j.status::text
), purged AS (
    DELETE FROM {schema}.pgqueue_jobs j USING picked p
    WHERE j.id = p.id AND %(action)s = 'purge'
    RETURNING j.id
), purged_history AS (
    DELETE FROM {schema}.pgqueue_attempts WHERE job_id = ANY(ARRAY(SELECT id FROM purged))
), changed AS (
    SELECT id FROM requeued UNION ALL SELECT id FROM cancelled UNION ALL SELECT id FROM purged
), audited AS (
    UPDATE {schema}.pgqueue_audit SET matched = matched + (SELECT count(*) FROM changed)
    WHERE id = %(audit)s
)
SELECT (SELECT max(id) FROM picked), (SELECT count(*) FROM changed),
       (SELECT count(*) FROM picked),
       ARRAY(SELECT DISTINCT queue FROM requeued),
       (SELECT count(pg_notify({channel}, 'cancel,' || id)) FROM cancelled
        WHERE status = 'running'),
       (SELECT count(pg_notify({done_channel}, id::text)) FROM cancelled
        WHERE status = 'cancelled')

-- name: begin_audit
INSERT INTO {schema}.pgqueue_audit (actor, action, filter, dry_run, matched, finished_at)
VALUES (%(actor)s, %(action)s, %(filter)s::jsonb, %(dry_run)s, %(matched)s,
        CASE WHEN %(dry_run)s THEN now() END)
RETURNING id

-- name: end_audit
UPDATE {schema}.pgqueue_audit SET finished_at = now() WHERE id = %(id)s

-- name: audit_log
SELECT id, at, actor, action, filter, dry_run, matched, finished_at
FROM {schema}.pgqueue_audit ORDER BY id DESC LIMIT %(limit)s

-- name: retry_now
-- A retrying (or queued, delayed) job runs now instead of at its run_at; the caller then wakes
-- the queue's workers. Returns its status before (no row: no such job).
WITH target AS (
    SELECT id, status::text AS was FROM {schema}.pgqueue_jobs WHERE id = %(id)s FOR UPDATE
), moved AS (
    UPDATE {schema}.pgqueue_jobs j SET run_at = now()
    FROM target t WHERE j.id = t.id AND t.was IN ('queued', 'retrying') AND j.run_at > now()
    RETURNING j.id
)
SELECT t.was, j.queue, (SELECT count(*) FROM moved)
FROM target t JOIN {schema}.pgqueue_jobs j ON j.id = t.id

-- name: status_counts
SELECT queue, status::text, count(*) FROM {schema}.pgqueue_jobs
GROUP BY queue, status ORDER BY queue, status

-- name: pause_queue
-- A queue gets its row the first time it is paused. Only a change returns the name, so the
-- caller can say whether the queue was already paused (its paused_at then stays).
INSERT INTO {schema}.pgqueue_queues AS q (name, paused, paused_at)
VALUES (%(name)s, true, now())
ON CONFLICT (name) DO UPDATE SET paused = true, paused_at = now(), updated_at = now()
WHERE NOT q.paused
RETURNING q.name

-- name: resume_queue
-- The row stays (paused_at records the last pause). The caller then runs wake_waiting_workers
-- in a later transaction, once this one has committed: a worker that starts waiting after that
-- look still sees the queue resumed in the claim it makes as it starts waiting.
UPDATE {schema}.pgqueue_queues SET paused = false, updated_at = now()
WHERE name = %(name)s AND paused
RETURNING name

-- name: paused_queues
SELECT name, paused_at FROM {schema}.pgqueue_queues WHERE paused ORDER BY name

-- name: set_queue_limits
-- An operator's limit and/or rate for a queue (`pgqueue queues limit|rate`), NULL for none. The
-- caller wakes waiting workers after the commit (a raised limit frees slots at once).
INSERT INTO {schema}.pgqueue_queues AS q (name, concurrency_limit, rate_limit, rate_period)
VALUES (%(name)s, %(limit)s, %(rate_limit)s, %(rate_period)s)
ON CONFLICT (name) DO UPDATE
SET concurrency_limit = CASE WHEN %(set_limit)s THEN EXCLUDED.concurrency_limit
                             ELSE q.concurrency_limit END,
    rate_limit = CASE WHEN %(set_rate)s THEN EXCLUDED.rate_limit ELSE q.rate_limit END,
    rate_period = CASE WHEN %(set_rate)s THEN EXCLUDED.rate_period ELSE q.rate_period END,
    updated_at = now()
RETURNING q.name

-- name: queue_settings
-- Every queue with operator state (paused, limited), by name.
SELECT name, paused, paused_at, concurrency_limit, rate_limit, rate_period
FROM {schema}.pgqueue_queues ORDER BY name

-- name: declare_task_limits
-- A worker's declared limits (@app.task(limit=, rate=, limit_key=)), written at its start. A
-- task an operator set (overridden) keeps the operator's values; whether it is limited per key
-- always follows the code, which computes the keys. Rows that already match stay as they are.
-- RETURNING names the tasks new to the table or changed to or from per key: the worker gives
-- their waiting jobs a limit group (stamp_limit_keys).
INSERT INTO {schema}.pgqueue_tasks AS t (name, concurrency_limit, rate_limit, rate_period, per_key)
SELECT d.name, d.lim, d.rate_limit, d.rate_period, d.per_key
FROM unnest(%(names)s::text[], %(limits)s::int[], %(rate_limits)s::int[],
            %(rate_periods)s::float8[], %(per_keys)s::bool[])
     AS d(name, lim, rate_limit, rate_period, per_key)
ORDER BY d.name
ON CONFLICT (name) DO UPDATE
SET concurrency_limit = CASE WHEN t.overridden THEN t.concurrency_limit
                             ELSE EXCLUDED.concurrency_limit END,
    rate_limit = CASE WHEN t.overridden THEN t.rate_limit ELSE EXCLUDED.rate_limit END,
    rate_period = CASE WHEN t.overridden THEN t.rate_period ELSE EXCLUDED.rate_period END,
    per_key = EXCLUDED.per_key, updated_at = now()
WHERE t.per_key <> EXCLUDED.per_key
   OR (NOT t.overridden
       AND (t.concurrency_limit, t.rate_limit, t.rate_period)
           IS DISTINCT FROM (EXCLUDED.concurrency_limit, EXCLUDED.rate_limit, EXCLUDED.rate_period))
RETURNING t.name, t.xmax = 0 OR t.per_key

-- name: set_task_limits
-- An operator's limit and/or rate for a task (`pgqueue tasks limit|rate`): kept over what the
-- code declares until reset_task_limits. A task without a row gets one (its later jobs get the
-- group '' at enqueue; waiting ones are given it by stamp_task_jobs).
INSERT INTO {schema}.pgqueue_tasks AS t
    (name, concurrency_limit, rate_limit, rate_period, overridden)
VALUES (%(name)s, %(limit)s, %(rate_limit)s, %(rate_period)s, true)
ON CONFLICT (name) DO UPDATE
SET concurrency_limit = CASE WHEN %(set_limit)s THEN EXCLUDED.concurrency_limit
                             ELSE t.concurrency_limit END,
    rate_limit = CASE WHEN %(set_rate)s THEN EXCLUDED.rate_limit ELSE t.rate_limit END,
    rate_period = CASE WHEN %(set_rate)s THEN EXCLUDED.rate_period ELSE t.rate_period END,
    overridden = true, updated_at = now()
RETURNING t.name, t.xmax = 0

-- name: reset_task_limits
-- The code's values apply again from the next worker start (workers write them).
UPDATE {schema}.pgqueue_tasks SET overridden = false, updated_at = now()
WHERE name = %(name)s AND overridden
RETURNING name

-- name: task_limits
SELECT name, concurrency_limit, rate_limit, rate_period, per_key, overridden
FROM {schema}.pgqueue_tasks ORDER BY name

-- name: served_queues
-- The queue names that wake every waiting worker: each listed queue, and one name for the
-- workers that serve every queue (any name wakes those).
SELECT DISTINCT q FROM {schema}.pgqueue_workers w,
       unnest(COALESCE(w.queues, ARRAY['default'])) AS q

-- name: snapshot_horizon
-- After a task's limit was declared: the first transaction id not yet assigned. A transaction
-- that enqueued a job of the task without its group (it read pgqueue_tasks before the
-- declaration committed) has an id below it, or none yet and then it still can read the new row.
SELECT pg_snapshot_xmax(pg_current_snapshot())::text

-- name: horizon_passed
-- Every transaction below the horizon has ended: the jobs they wrote are visible or never will be.
SELECT pg_snapshot_xmin(pg_current_snapshot()) >= %(horizon)s::xid8

-- name: unstamped_jobs
-- Waiting jobs of a task without a limit group (enqueued before its limit existed), a batch at a
-- time in id order; only when a task's limit is new, so a pass over the table is rare.
SELECT id, args::text FROM {schema}.pgqueue_jobs
WHERE id > %(after)s AND task = %(task)s AND status IN ('queued', 'retrying')
      AND limit_key IS NULL
ORDER BY id LIMIT 1000

-- name: stamp_limit_keys
-- Gives those jobs their group. Rows locked right now are skipped (SKIP LOCKED), so the pass
-- never waits: a job being claimed by the plain claim runs as it would have before the limit
-- existed. But a row can be locked while it stays waiting (a bulk action or a debounce in a
-- producer's transaction, or a claim that passed the row and keeps its lock until it ends), so
-- the caller asks which skipped rows still wait without a group (unstamped_among) and tries
-- those again (limits.STAMP_RETRY).
UPDATE {schema}.pgqueue_jobs j SET limit_key = s.key
FROM unnest(%(ids)s::bigint[], %(keys)s::text[]) AS s(id, key)
WHERE j.id = s.id AND j.status IN ('queued', 'retrying') AND j.limit_key IS NULL
  AND j.id = ANY(ARRAY(SELECT l.id FROM {schema}.pgqueue_jobs l
                       WHERE l.id = ANY(%(ids)s::bigint[]) ORDER BY l.id
                       FOR UPDATE SKIP LOCKED))
RETURNING j.id

-- name: unstamped_among
-- Which of these jobs still wait without a limit group (stamp_limit_keys skipped them).
SELECT id FROM {schema}.pgqueue_jobs
WHERE id = ANY(%(ids)s::bigint[]) AND status IN ('queued', 'retrying') AND limit_key IS NULL

-- name: claim_jobs
-- One statement claims a batch: due jobs in the order priority DESC, run_at, id. The inner SELECT
-- is a range scan of pgqueue_jobs_ready_idx in exactly its order; SKIP LOCKED lets any number of
-- workers claim at once without waiting on each other. Jobs not due yet of a higher priority lie
-- in that range too and are read past (500,000 of them cost every claim 38 ms): while any job is
-- not due yet the fetcher claims with claim_jobs_by_priority instead, which skips them.
-- Each claim gets a fresh lease token: the fencing token for every later write. The worker draws
-- it (a random UUID per statement, shared by the jobs of that claim): fencing needs (id, token) to
-- change at every claim of a job, which it does, and gen_random_uuid() per row cost ~1.4 us of
-- the server's time per job here, plus parsing a returned UUID per row.
-- The claimed jobs' lease is the worker's own (pgqueue_workers.lease_expires_at, extended by
-- extend_leases), so the claim takes nothing unless that lease is live: a worker whose heartbeats
-- stopped reaching the database never claims jobs that any reaper may take back at once (the
-- EXISTS is a one-time filter, evaluated once per claim). %(tasks)s is NULL unless the worker met
-- a task it does not know (a rolling deploy): it then claims only its own tasks and leaves the
-- others' jobs queued for workers that know them.
-- Jobs of paused queues (pgqueue_queues) are skipped, and so are the jobs that only the limited
-- claim may take (claim_limited_jobs): those of queues with a limit or a rate, and those with a
-- limit group (limit_key). The ARRAY of such queue names is an
-- uncorrelated subquery, so PostgreSQL reads that small table once per claim (an InitPlan), not
-- per row. `queue || ''` hides the column from the planner's statistics: with a few distinct
-- queues it would estimate `queue <> ALL(unknown array)` to keep almost no row, and then sort
-- a bitmap scan of every waiting job instead of reading the index in order. Paused rows that
-- lie ahead in claim order are read and skipped; a worker whose every queue is paused reads
-- none (the one-time filter in sql.IN_QUEUES).
-- The locked ids reach the UPDATE as an array (id = ANY), not a join: a join's plan depends on
-- the LIMIT parameter, and the generic plan for an unknown LIMIT assumes a tenth of the table and
-- hash-joins a sequential scan of every row, finished ones included. The outer query puts the
-- batch back in claim order, with the arguments as JSON text that the worker parses itself:
-- psycopg's jsonb loader took ~5 us of the worker's CPU per row here, text and the fetcher's
-- parse ~1.5. `stray` says the job's task has a limit or a rate in pgqueue_tasks: such a job
-- here has no limit group (a lock kept it out of every pass that gives one, or an operator set
-- the limit on a task the worker's code leaves unlimited), and the worker gives it back with
-- one (regroup_leases). The list is another InitPlan: one read of that small table per claim.
-- Rendered twice (sql.VARIANTS): as claim_jobs with queue_filter empty, and as
-- claim_jobs_in_queues restricted to a list of queues, which for a single queue reads
-- pgqueue_jobs_ready_queue_idx in order (its custom plan folds `queue = (queues)[1]` into an
-- equality). Both are rendered again as the fetcher's sweep behind claim_jobs_after's bound,
-- claim_jobs_before(_in_queues), which fills sweep_range and position_columns (sql.SWEEP).
-- The LIMIT (claim_limit) differs between the two. A plain parameter makes PostgreSQL plan every
-- claim anew (~0.35 ms, ~2 us a job): its custom plan, which sees the value, always looks
-- cheaper than the generic one. claim_jobs hides the value in a subquery, so both plans assume
-- the same unknown LIMIT and the cached generic plan is kept (test_query_plans checks its
-- shape at depth). claim_jobs_in_queues keeps the plain parameter: its custom plan also sees
-- the queue list, and that is what picks the per-queue index for one queue.
WITH claimed AS (
    UPDATE {schema}.pgqueue_jobs j
    SET status = 'running', attempts = j.attempts + 1, lease_token = %(token)s,
        lease_expires_at = NULL, worker_id = %(worker_id)s, claimed_at = now(), started_at = NULL
    WHERE j.id = ANY(ARRAY(
        SELECT id FROM {schema}.pgqueue_jobs
        WHERE status IN ('queued', 'retrying') AND run_at <= now() {queue_filter} {sweep_range}
          AND queue || '' <> ALL(ARRAY(SELECT name FROM {schema}.pgqueue_queues
                                       WHERE paused OR concurrency_limit IS NOT NULL
                                             OR rate_limit IS NOT NULL))
          AND limit_key IS NULL
          AND (%(tasks)s::text[] IS NULL OR task = ANY(%(tasks)s::text[]))
          AND EXISTS (SELECT FROM {schema}.pgqueue_workers w
                      WHERE w.id = %(worker_id)s AND w.lease_expires_at > now())
        ORDER BY priority DESC, run_at, id
        LIMIT {claim_limit}
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING j.id, j.queue, j.task, j.args, j.attempts, j.max_attempts,
              extract(epoch FROM j.claimed_at - j.run_at)::float8 AS pickup_seconds,
              j.priority, j.run_at, j.meta
)
SELECT id, queue, task, args::text, attempts, max_attempts, pickup_seconds,
       task = ANY(ARRAY(SELECT name FROM {schema}.pgqueue_tasks
                        WHERE concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL)) AS stray,
       meta::text {position_columns}
FROM claimed ORDER BY priority DESC, run_at, id

-- name: claim_jobs_by_priority
-- claim_jobs for a table that holds jobs not due yet: the same batch in the same order (claim_jobs
-- says why the rest of the statement is shaped as it is), found without reading those jobs. The
-- fetcher uses it while next_ready_at says some job is not due yet, checked at least once a second
-- and at every short claim; it costs a few index descents more than claim_jobs otherwise.
-- Jobs not due yet are not read. pgqueue_jobs_ready_idx is in claim order, and within one
-- priority the due rows come first, so a scan bounded by run_at <= now() stops at the first
-- future row; across priorities it cannot (a higher priority's future rows lie between the due
-- ones: 500,000 delayed priority-10 jobs cost every claim 38 ms). So the id selection walks the
-- distinct priorities (`groups`, a loose index scan: one descent per priority, highest first,
-- pulled lazily), skips a priority whose earliest run_at is ahead, and takes each priority's due
-- rows in order, from where its first visible entry was found (entries before it are claimed
-- jobs not yet vacuumed, which the descent has already stepped over). The walk stops after 32
-- priorities and the rest is one ordered scan as before, so many distinct priorities cost at
-- most 32 descents more than that scan. Rows are locked only as the outer LIMIT pulls them: the
-- order is that of the nested loop over `groups` (recursion order) and then of UNION ALL's
-- branches, and nothing sorts above the row locks (a Sort there would lock every due row). The
-- LIMITs of the inner scans hide their value in a subquery, which keeps the planner on ordered
-- index scans (with the value known, a bitmap scan and a sort of a whole priority can look
-- cheaper).
-- Rendered twice (sql.VARIANTS): over all queues (queue_list is one pass for every queue at once,
-- the filters empty), and as claim_jobs_by_priority_in_queues, which finds each priority by one
-- descent per listed queue in pgqueue_jobs_ready_queue_idx and, for a single queue, reads its due
-- rows there too (its custom plan folds `queue = (queues)[1]` into an equality, which an index
-- scans in order; `queue = ANY` alone cannot).
-- The batch's LIMIT (claim_limit) is hidden in a subquery or not as in claim_jobs. The worker's
-- live lease gates the walk's first row (no live lease: no priorities, no rows). Paused queues
-- are skipped as in claim_jobs, where the due rows are read: the walk over all queues still
-- finds their priorities, and their due rows are read and skipped; the walk over listed queues
-- leaves paused ones out.
WITH claimed AS (
    UPDATE {schema}.pgqueue_jobs j
    SET status = 'running', attempts = j.attempts + 1, lease_token = %(token)s,
        lease_expires_at = NULL, worker_id = %(worker_id)s, claimed_at = now(), started_at = NULL
    WHERE j.id = ANY(ARRAY(
        WITH RECURSIVE groups (depth, priority, first_run_at, first_id) AS (
            SELECT 0, 2147483648, NULL::timestamptz, NULL::bigint  -- above any int4 priority
            WHERE EXISTS (SELECT FROM {schema}.pgqueue_workers w
                          WHERE w.id = %(worker_id)s AND w.lease_expires_at > now())
            UNION ALL
            SELECT g.depth + 1, n.* FROM groups g CROSS JOIN LATERAL (
                SELECT f.* FROM {queue_list} AS l(queue) CROSS JOIN LATERAL (
                    SELECT priority, run_at, id FROM {schema}.pgqueue_jobs
                    WHERE status IN ('queued', 'retrying') AND priority < g.priority {queue_match}
                    ORDER BY priority DESC, run_at, id LIMIT 1
                ) f
                ORDER BY f.priority DESC, f.run_at, f.id LIMIT 1
            ) n
            WHERE g.depth < 32
        )
        SELECT due.id FROM groups g CROSS JOIN LATERAL (
            SELECT id FROM {schema}.pgqueue_jobs
            WHERE status IN ('queued', 'retrying') AND priority = g.priority
                  AND (run_at, id) >= (g.first_run_at, g.first_id) AND run_at <= now()
                  {queue_filter}
                  AND queue || '' <> ALL(ARRAY(
                      SELECT name FROM {schema}.pgqueue_queues
                      WHERE paused OR concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL))
                  AND limit_key IS NULL
                  AND (%(tasks)s::text[] IS NULL OR task = ANY(%(tasks)s::text[]))
            ORDER BY run_at, id
            LIMIT (SELECT %(limit)s::int)
            FOR UPDATE SKIP LOCKED
        ) due
        WHERE g.first_run_at <= now()
        UNION ALL
        SELECT rest.id FROM (
            SELECT id FROM {schema}.pgqueue_jobs
            WHERE status IN ('queued', 'retrying') AND run_at <= now() {queue_filter}
                  AND priority < (SELECT priority FROM groups WHERE depth = 32)
                  AND queue || '' <> ALL(ARRAY(
                      SELECT name FROM {schema}.pgqueue_queues
                      WHERE paused OR concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL))
                  AND limit_key IS NULL
                  AND (%(tasks)s::text[] IS NULL OR task = ANY(%(tasks)s::text[]))
            ORDER BY priority DESC, run_at, id
            LIMIT (SELECT %(limit)s::int)
            FOR UPDATE SKIP LOCKED
        ) rest
        LIMIT {claim_limit}
    ))
    RETURNING j.id, j.queue, j.task, j.args, j.attempts, j.max_attempts,
              extract(epoch FROM j.claimed_at - j.run_at)::float8 AS pickup_seconds,
              j.priority, j.run_at, j.meta
)
SELECT id, queue, task, args::text, attempts, max_attempts, pickup_seconds,
       task = ANY(ARRAY(SELECT name FROM {schema}.pgqueue_tasks
                        WHERE concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL)) AS stray,
       meta::text
FROM claimed ORDER BY priority DESC, run_at, id

-- name: claim_jobs_after
-- claim_jobs from where the worker's last claim ended (priority, run_at, id: its last row), for
-- while a long transaction holds back vacuum (docs/concepts/claiming.md, "Long transactions").
-- A claimed job's entry stays in pgqueue_jobs_ready_idx, pointing at its queued row version,
-- until vacuum removes both; vacuum can remove neither while an older snapshot is open, so every
-- claim that starts at the beginning of the index reads every job claimed since that snapshot
-- (a heap visit each: 73,000 of them cost a claim 34 ms after 40 s at 2,000 jobs/s). Here the
-- bound's priority is read from the bound on, an index start key (priority equal, then the row
-- comparison), so those entries are stepped over. What it misses is a job of the bound's
-- priority that became ready behind it (a released or reaped job, a past run_at, a resumed
-- queue): the fetcher claims from the start again at least every BOUND_RESET seconds
-- (fetcher.py). The other priorities are found as claim_jobs_by_priority finds them, one index
-- descent each (`above` the bound's, highest first, then `below` it), and each one's due rows
-- read in order from its first entry, so jobs not due yet are not read: read whole, a million
-- delayed jobs of a higher priority cost every claim 18 ms (a worker enters this mode after one
-- slow claim, and the `delayed` benchmark's drain ran at 65-80 % of its rate whenever it did).
-- Unlike claim_jobs_by_priority's, the walks have no cap: this mode is entered only when claims
-- are slow anyway, and a descent per priority costs less than reading the jobs between them.
-- `steps` is each priority's start in claim order (the bound's own: the bound, exclusive; the
-- others: just before their first entry); rows are locked only as the outer LIMIT pulls them
-- (see claim_jobs_by_priority). The rest is claim_jobs'; rendered twice like it.
WITH claimed AS (
    UPDATE {schema}.pgqueue_jobs j
    SET status = 'running', attempts = j.attempts + 1, lease_token = %(token)s,
        lease_expires_at = NULL, worker_id = %(worker_id)s, claimed_at = now(), started_at = NULL
    WHERE j.id = ANY(ARRAY(
        WITH RECURSIVE above (priority, first_run_at, first_id) AS (
            SELECT 2147483648, NULL::timestamptz, NULL::bigint  -- above any int4 priority
            UNION ALL
            SELECT n.* FROM above g CROSS JOIN LATERAL (
                SELECT f.* FROM {queue_list} AS l(queue) CROSS JOIN LATERAL (
                    SELECT priority, run_at, id FROM {schema}.pgqueue_jobs
                    WHERE status IN ('queued', 'retrying') AND priority < g.priority
                          AND priority > %(after_priority)s::int {queue_match}
                    ORDER BY priority DESC, run_at, id LIMIT 1
                ) f
                ORDER BY f.priority DESC, f.run_at, f.id LIMIT 1
            ) n
        ),
        below (priority, first_run_at, first_id) AS (
            SELECT %(after_priority)s::int, NULL::timestamptz, NULL::bigint
            UNION ALL
            SELECT n.* FROM below g CROSS JOIN LATERAL (
                SELECT f.* FROM {queue_list} AS l(queue) CROSS JOIN LATERAL (
                    SELECT priority, run_at, id FROM {schema}.pgqueue_jobs
                    WHERE status IN ('queued', 'retrying') AND priority < g.priority {queue_match}
                    ORDER BY priority DESC, run_at, id LIMIT 1
                ) f
                ORDER BY f.priority DESC, f.run_at, f.id LIMIT 1
            ) n
        ),
        steps (priority, after_run_at, after_id) AS (
            SELECT priority, first_run_at, first_id - 1 FROM above WHERE first_id IS NOT NULL
            UNION ALL
            SELECT %(after_priority)s::int, %(after_run_at)s::timestamptz, %(after_id)s::bigint
            UNION ALL
            SELECT priority, first_run_at, first_id - 1 FROM below WHERE first_id IS NOT NULL
        )
        SELECT due.id FROM steps s CROSS JOIN LATERAL (
            SELECT id FROM {schema}.pgqueue_jobs
            WHERE status IN ('queued', 'retrying') AND priority = s.priority
                  AND (run_at, id) > (s.after_run_at, s.after_id) AND run_at <= now()
                  {queue_filter}
                  AND queue || '' <> ALL(ARRAY(
                      SELECT name FROM {schema}.pgqueue_queues
                      WHERE paused OR concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL))
                  AND limit_key IS NULL
                  AND (%(tasks)s::text[] IS NULL OR task = ANY(%(tasks)s::text[]))
            ORDER BY run_at, id
            LIMIT (SELECT %(limit)s::int)
            FOR UPDATE SKIP LOCKED
        ) due
        WHERE s.after_run_at <= now()
          AND EXISTS (SELECT FROM {schema}.pgqueue_workers w
                      WHERE w.id = %(worker_id)s AND w.lease_expires_at > now())
        LIMIT {claim_limit}
    ))
    RETURNING j.id, j.queue, j.task, j.args, j.attempts, j.max_attempts,
              extract(epoch FROM j.claimed_at - j.run_at)::float8 AS pickup_seconds,
              j.priority, j.run_at, j.meta
)
SELECT id, queue, task, args::text, attempts, max_attempts, pickup_seconds,
       task = ANY(ARRAY(SELECT name FROM {schema}.pgqueue_tasks
                        WHERE concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL)) AS stray,
       meta::text, priority, run_at::text
FROM claimed ORDER BY priority DESC, run_at, id

-- name: claim_position
-- Where a claim from the start ended, when it was slow: the last claimed job's place in claim
-- order (claim_jobs_after's first bound). A primary-key probe, only when claims turn slow, so the
-- claims from the start return no more than they always did.
SELECT priority, run_at::text FROM {schema}.pgqueue_jobs WHERE id = %(id)s

-- name: claim_dry_position
-- Where a claim from the start that was slow and came back short leaves the next ones
-- (claim_jobs_after's bound), when it really read past jobs it could not take: the first
-- waiting job in claim order is due, yet that claim did not take it (a paused or limited
-- queue's backlog, jobs of limited tasks, jobs of tasks this worker does not know). The next
-- claim from the start would read them all again to find nothing. No row when that first job is
-- not due yet or none waits: the claim was only slow (a loaded machine), and nothing changes.
-- The bound is that job's priority, a time no later than the claim's start and than any open
-- transaction's of this database (%(lookback)s: seconds since the claim was sent, plus a
-- margin; xact_start of the client sessions this role may see: an autovacuum of the table,
-- which enqueues nothing, would hold the bound back for as long as it runs), and past any id.
-- A job enqueued, released, reaped or retried from then on has a later run_at and is claimed
-- after it, and so has one a transaction already open then enqueues (run_at is its
-- transaction's start). One that
-- became claimable behind it (a queue resumed, a limit removed, a run_at set in the past) waits
-- for the sweep (fetcher.py), as in claim_jobs_after. One descent of pgqueue_jobs_ready_idx and
-- one pass over pg_stat_activity (in memory), only as claims enter this mode; rendered again
-- for a worker's list of queues (claim_dry_position_in_queues), whose first priority is the one
-- its claims start from.
SELECT f.priority,
       (least(now() - make_interval(secs => %(lookback)s),
              (SELECT min(a.xact_start) FROM pg_stat_activity a
               WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                     AND a.backend_type = 'client backend'))
        - interval '1 microsecond')::text
FROM (SELECT priority, run_at FROM {schema}.pgqueue_jobs
      WHERE status IN ('queued', 'retrying') {queue_filter}
      ORDER BY priority DESC, run_at, id LIMIT 1) f
WHERE f.run_at <= now()

-- name: vacuum_horizon_holder
-- The oldest transaction of this database older than %(older_than)s seconds that holds back
-- vacuum (it has a snapshot or an xid), as the dashboard's health strip finds it
-- (oldest_transaction in dashboard/queries.sql): its pid, application_name, state and age in
-- seconds. No row: none. One pass over pg_stat_activity, in memory; asked only when claims slow.
SELECT a.pid, a.application_name, a.state, extract(epoch FROM now() - a.xact_start)::float8
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
  AND a.xact_start < now() - make_interval(secs => %(older_than)s)
ORDER BY a.xact_start LIMIT 1

-- name: begin_limited_claim
-- The limited claim's transaction counts slots in its second statement with a snapshot newer
-- than its locks: READ COMMITTED whatever the server's default. A claimer that stalls between
-- its statements (SIGSTOP) would hold its groups' locks: its session ends after %(idle)s ms
-- idle in the transaction (limit_claim_settings), which gives the locks back and claims nothing.
SET TRANSACTION ISOLATION LEVEL READ COMMITTED

-- name: limit_claim_settings
-- The limited claim's settings, for its transaction only (set_config(..., true): nothing stays
-- on the session, so a transaction-pooling PgBouncer is safe). The idle timeout: see
-- begin_limited_claim. Then every read of pgqueue_jobs a plain index scan: both statements count
-- running jobs (`held`) through pgqueue_jobs_running_idx or pgqueue_jobs_running_limited_idx,
-- whose entries for every job that ran since the last vacuum point at dead row versions. A plain
-- index scan marks those entries dead as it passes them (once no snapshot can see the rows) and
-- later scans step over them; a bitmap scan never marks them and visits each one's heap row,
-- every claim, and a sequential scan reads the whole table. Planned with statistics taken while
-- jobs ran, the counts were bitmap scans: a queue limited to 100 with 300,000 jobs drained at
-- 6,500 jobs/s, its claim growing from 3.6 to 14 ms as the drain went on (191,000 dead versions
-- visited by one count); with bitmap scans off, 16,500 jobs/s, the claim flat at 2.9 ms, and a
-- limit per key over 1,000 keys 9,800 -> 17,600 jobs/s (docs/performance.md). Sequential scans
-- are off too, so that statistics taken while most of a small table ran cannot turn a count into
-- a scan of the table once it has grown. The statements' other reads (the walk's descents, each
-- group's and queue's jobs in claim order up to a LIMIT, probes by primary key) are index scans
-- either way; pgqueue_queues, a few rows, is still read whole where no index applies, and that
-- scan, now costed as disabled, puts the plan's estimate above jit_above_cost: JIT is off, or it
-- compiles the walk on every claim (0.43 s each, seen with enable_seqscan off alone).
SELECT set_config('idle_in_transaction_session_timeout', %(idle)s, true),
       set_config('enable_bitmapscan', 'off', true), set_config('enable_seqscan', 'off', true),
       set_config('jit', 'off', true)

-- name: lock_limit_groups
-- The limited claim's first statement (concepts/limits.md), in a READ COMMITTED transaction
-- with claim_limited_jobs: it takes, without waiting, the advisory lock of each limited queue the
-- worker serves and of the limit groups it will claim from, so that one claimer at a time counts
-- and fills a group's slots. The count is claim_limited_jobs' job, in the next statement: its
-- snapshot, taken after these locks, sees every claim of the group committed before them (a
-- count in this statement could miss one that committed while it waited for nothing).
-- Groups are found by a walk over pgqueue_jobs_limited_idx, one descent per distinct (task,
-- key) with waiting jobs, from the cursor the worker keeps (its last group) to %(scan)s groups
-- on, then from the start up to the cursor: round-robin, so a key with 100,000 waiting jobs
-- gets its turn like a key with 5. Every group walked is returned (locked or not), so the
-- worker's cursor also moves past groups of tasks it does not run. A group is locked only if it
-- may give a job (by this statement's snapshot: free slots, rate left, a due job); a group out of
-- rate returns when it has rate again (wait, seconds), so the worker can sleep until then. Lock
-- keys are the schema and the group's name, hashed: a collision can only serialise two groups'
-- claims. Paused queues the worker serves are returned too ('p'): with the limited queues it
-- could not lock, their jobs are left alone by claim_limited_jobs (%(blocked)s). Their rows end
-- with the tasks that pgqueue_tasks limits (one read per statement): a limited queue's claim
-- takes jobs without a group, and one of those tasks there has lost its group (claim_jobs'
-- `stray`), which the worker gives back (regroup_leases).
-- The free slots are read from `held`: the running jobs with a limit group, counted per group
-- by one pass over them (bounded by the fleet's concurrency), and looked up by group name in a
-- jsonb object. A count per group (a subquery per walked group) was at the planner's mercy:
-- with statistics taken while nothing ran, pgqueue_jobs_running_idx (every running job, by id)
-- looks as cheap as pgqueue_jobs_running_limited_idx, and scanning all of it once per group
-- cost a claim over 1,000 keys 9 of its 12 ms (400 groups x 200 running jobs). Neither a pass
-- nor a jsonb lookup has a plan that can turn quadratic. The walk's row for a group is one of
-- its waiting jobs (the first in index order: highest priority, earliest run_at): when that one
-- is due and the worker serves every queue, the group is due without another descent. A
-- group's rate log is read only if it has a rate.
WITH RECURSIVE after_cursor (n, task, key, run_at) AS (
    SELECT 0, %(after_task)s::text, %(after_key)s::text, NULL::timestamptz
    UNION ALL
    SELECT w.n + 1, nx.* FROM after_cursor w CROSS JOIN LATERAL (
        SELECT j.task, j.limit_key, j.run_at FROM {schema}.pgqueue_jobs j
        WHERE j.status IN ('queued', 'retrying') AND j.limit_key IS NOT NULL
          AND (j.task, j.limit_key) > (w.task, w.key)
        ORDER BY j.task, j.limit_key LIMIT 1
    ) nx
    WHERE w.n < %(scan)s
),
from_start (n, task, key, run_at) AS (
    SELECT 0, ''::text, ''::text, NULL::timestamptz
    UNION ALL
    SELECT w.n + 1, nx.* FROM from_start w CROSS JOIN LATERAL (
        SELECT j.task, j.limit_key, j.run_at FROM {schema}.pgqueue_jobs j
        WHERE j.status IN ('queued', 'retrying') AND j.limit_key IS NOT NULL
          AND (j.task, j.limit_key) > (w.task, w.key)
        ORDER BY j.task, j.limit_key LIMIT 1
    ) nx
    WHERE w.n < %(scan)s - (SELECT max(n) FROM after_cursor)
      AND (nx.task, nx.limit_key) <= (%(after_task)s::text, %(after_key)s::text)
),
walked AS (
    SELECT n, task, key, run_at FROM after_cursor WHERE n > 0
    UNION ALL
    SELECT %(scan)s + n, task, key, run_at FROM from_start WHERE n > 0
),
held AS (
    SELECT jsonb_object_agg('t:' || length(task) || ':' || task || ':' || limit_key, n) AS n
    FROM (SELECT task, limit_key, count(*) AS n FROM {schema}.pgqueue_jobs
          WHERE status = 'running' AND limit_key IS NOT NULL GROUP BY task, limit_key) h
),
looked AS (
    SELECT w.n, w.task, w.key, w.run_at, t.concurrency_limit, t.rate_limit, t.rate_period,
           't:' || length(w.task) || ':' || w.task || ':' || w.key AS name,
           w.task = ANY(%(tasks)s::text[]) AS served
    FROM walked w LEFT JOIN {schema}.pgqueue_tasks t ON t.name = w.task
),
checked AS (
    SELECT l.*,
           (l.concurrency_limit IS NULL OR l.concurrency_limit
                > COALESCE(((SELECT n FROM held) ->> l.name)::int, 0)) AS free,
           CASE WHEN l.rate_limit IS NOT NULL THEN
           (SELECT extract(epoch FROM min(x.at) + make_interval(secs => l.rate_period) - now())
            FROM {schema}.pgqueue_rates rt, unnest(rt.times, rt.counts) AS x(at, c)
            WHERE rt.name = l.name AND x.at > now() - make_interval(secs => l.rate_period)
            HAVING sum(x.c) >= l.rate_limit)::float8 END AS wait,
           CASE WHEN l.run_at <= now() AND %(queues)s::text[] IS NULL THEN true
           ELSE EXISTS (SELECT FROM {schema}.pgqueue_jobs d
                        WHERE d.status IN ('queued', 'retrying') AND d.task = l.task
                              AND d.limit_key = l.key AND d.run_at <= now()
                              AND (%(queues)s::text[] IS NULL OR d.queue = ANY(%(queues)s::text[])))
           END AS due
    FROM looked l
),
queues AS (
    SELECT q.name, q.paused FROM {schema}.pgqueue_queues q
    WHERE (q.paused OR q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL)
      AND (%(queues)s::text[] IS NULL OR q.name = ANY(%(queues)s::text[]))
)
SELECT 'g', c.task, c.key, c.n,
       CASE WHEN c.served AND c.free AND c.wait IS NULL AND c.due
            THEN pg_try_advisory_xact_lock(hashtextextended(%(schema)s || ':' || c.name, 0))
            ELSE false END,
       c.wait, NULL
FROM checked c
UNION ALL
SELECT CASE WHEN q.paused THEN 'p' ELSE 'q' END, q.name, NULL, NULL,
       NOT q.paused
       AND pg_try_advisory_xact_lock(hashtextextended(%(schema)s || ':q:' || q.name, 0)),
       NULL,
       ARRAY(SELECT t.name FROM {schema}.pgqueue_tasks t
             WHERE t.concurrency_limit IS NOT NULL OR t.rate_limit IS NOT NULL)
FROM queues q

-- name: claim_limited_jobs
-- The limited claim's second statement: jobs of the groups and queues lock_limit_groups locked,
-- within their slots and rates, counted now (this statement's snapshot is newer than the locks,
-- see there). A group's slots are its running jobs: taken here, given back only when the job
-- leaves 'running' (the fenced ack, the reaper once its lease expired, a release), so a crashed
-- or stalled worker holds a slot until its lease is reaped and never frees one twice. A
-- group's rate is what pgqueue_rates logged in the last period; the jobs started here are
-- logged in the same statement. Each group gives its budget in claim order; the batch takes
-- every group's first job before any group's second (fair between keys), within each limited
-- queue's own budget, which the jobs of limited tasks in that queue count against too. Jobs of a
-- limited queue this claimer could not lock, or of a paused one, are left alone (%(blocked)s,
-- from lock_limit_groups: a queue paused or limited since then waits for the next claim). Rows are
-- locked as the groups' scans find them (SKIP LOCKED); those the batch leaves out stay locked
-- until the transaction ends, a few milliseconds.
-- Clocks: the claim's transaction began before the walk, and a claimer can stall between the two
-- (a GC pause, a blocked event loop, SIGSTOP) while it holds the group's lock. So the rate window
-- is judged at this statement's start (statement_timestamp(), never now(), the transaction's),
-- claimed_at is that time too (the update is limited_claimed, sql.py, shared with
-- claim_head_jobs), and the starts are logged with clock_timestamp(), taken after the
-- rows were claimed: a later claim's window then always covers them (the fault suite found the
-- rate exceeded when both were now()). The worker's lease is checked at this statement's start
-- too: checked at now(), a claimer whose lease ran out while it stalled after the walk still
-- claimed, and a reaper that had seen the lapse could take those jobs back as they started
-- (found reading this after a chaos blackhole failure). Due rows are still those due at the
-- transaction's start.
-- Slots are counted in `held`: one pass over the running jobs that have a limit group or are in
-- a locked queue (bounded by the fleet's concurrency), counted per group and per queue at once
-- (GROUPING SETS; rows of neither kind get the key '', which no group has) into a jsonb object
-- that each group looks up by name (an uncorrelated subquery: it runs once per claim). A count
-- per group (a subquery each) was at the planner's mercy, as in lock_limit_groups (see there).
-- A queue that lost its limits since lock_limit_groups is claimed from with the batch as its
-- budget. A group's rate log is read only if it has a rate,
-- and starts are logged only for such groups: `rated` is materialised, so the log's join with
-- the claimed jobs reads an empty set when no group has one (joined with every group, it cost
-- 4 of a 7 ms claim of 200 jobs from 200 groups).
-- The statement keeps a generic plan (psycopg prepares it): %(tasks)s reaches the queue groups'
-- scan through a subquery. With the value in sight, a custom plan estimated that scan cheaper
-- than the generic plan did, so PostgreSQL planned every claim anew (~0.8 ms of a 4 ms claim).
WITH grp (ord, what, key, lim, rate_limit, rate_period, name) AS (
    SELECT g.ord, g.task, g.key, t.concurrency_limit, t.rate_limit, t.rate_period, g.name
    FROM unnest(%(g_tasks)s::text[], %(g_keys)s::text[], %(g_names)s::text[])
         WITH ORDINALITY AS g(task, key, name, ord)
    LEFT JOIN {schema}.pgqueue_tasks t ON t.name = g.task
    UNION ALL
    SELECT 0, q.name, NULL, q.concurrency_limit, q.rate_limit, q.rate_period, 'q:' || q.name
    FROM {schema}.pgqueue_queues q
    WHERE q.name = ANY(%(lq)s::text[]) AND NOT q.paused
),
bud AS (
    SELECT g.*, least(%(limit)s, g.lim - COALESCE(((
            SELECT jsonb_object_agg(k, n) FROM (
                SELECT coalesce('t:' || length(task) || ':' || task || ':' || limit_key,
                                'q:' || queue, '') k, count(*) n
                FROM {schema}.pgqueue_jobs
                WHERE status = 'running' AND (limit_key IS NOT NULL OR queue = ANY(%(lq)s::text[]))
                GROUP BY GROUPING SETS ((task, limit_key), queue)) held
        ) ->> g.name)::int, 0),
        g.rate_limit - (
            SELECT COALESCE(sum(x.c), 0)
            FROM {schema}.pgqueue_rates rt, unnest(rt.times, rt.counts) x(at, c)
            WHERE g.rate_limit IS NOT NULL AND rt.name = g.name
                  AND x.at > statement_timestamp() - make_interval(secs => g.rate_period))
    ) room
    FROM grp g
),
rated AS MATERIALIZED (SELECT * FROM bud WHERE rate_limit IS NOT NULL),
cand AS (
    SELECT c.*, b.ord, b.what FROM bud b, LATERAL (
        SELECT j.id, j.queue, j.priority, j.run_at FROM {schema}.pgqueue_jobs j
        WHERE j.status IN ('queued', 'retrying') AND j.task = b.what
              AND j.limit_key = b.key AND j.run_at <= now()
              AND (%(queues)s::text[] IS NULL OR j.queue = ANY(%(queues)s::text[]))
              AND j.queue <> ALL(%(blocked)s::text[])
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT greatest(b.room, 0)
        FOR UPDATE SKIP LOCKED
    ) c
    WHERE b.ord > 0
    UNION ALL
    SELECT c.*, 0, b.what FROM bud b, LATERAL (
        SELECT j.id, j.queue, j.priority, j.run_at FROM {schema}.pgqueue_jobs j
        WHERE j.status IN ('queued', 'retrying') AND j.queue = b.what AND j.run_at <= now()
              AND j.limit_key IS NULL AND j.task = ANY((SELECT %(tasks)s::text[])::text[])
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT greatest(b.room, 0)
        FOR UPDATE SKIP LOCKED
    ) c
    WHERE b.ord = 0
),
taken AS (
    SELECT r.id FROM (
        SELECT r.*, row_number() OVER (PARTITION BY r.queue ORDER BY r.tu, r.ord) nq
        FROM (SELECT c.*, row_number() OVER (PARTITION BY c.ord, c.what
                                             ORDER BY c.priority DESC, c.run_at, c.id) tu
              FROM cand c) r
    ) r
    LEFT JOIN bud b ON b.ord = 0 AND b.what = r.queue
    WHERE b.what IS NULL OR r.nq <= b.room
    ORDER BY r.tu, r.ord
    LIMIT %(limit)s
),
claimed AS ({limited_claimed}),
logged AS (
    INSERT INTO {schema}.pgqueue_rates AS rt (name, period, times, counts)
    SELECT b.name, b.rate_period, ARRAY[clock_timestamp()], ARRAY[count(*)::int]
    FROM claimed c JOIN rated b
         ON (b.ord > 0 AND b.what = c.task AND b.key = c.limit_key)
            OR (b.ord = 0 AND b.what = c.queue)
    GROUP BY b.name, b.rate_period
    ON CONFLICT (name) DO UPDATE
    SET period = EXCLUDED.period, (times, counts) = (
        SELECT array_agg(x.at ORDER BY x.at) || EXCLUDED.times,
               array_agg(x.c ORDER BY x.at) || EXCLUDED.counts
        FROM unnest(rt.times, rt.counts) x(at, c)
        WHERE x.at > now() - make_interval(secs => EXCLUDED.period))
)
SELECT id, queue, task, args::text, attempts, max_attempts, w, limit_key, meta::text
FROM claimed ORDER BY priority DESC, run_at, id

-- name: lock_head_groups
-- The limited claim's fast path (concepts/limits.md, "The head of the queue"), its first
-- statement, in the transaction of begin_limited_claim and limit_claim_settings like the walk's:
-- the first %(scan)s waiting jobs in claim order (pgqueue_jobs_ready_idx, one range read, no
-- descent per group), and of those the due jobs with a limit group, of a task this worker runs,
-- in a queue it serves that is not paused. The head serves a job of a task with a concurrency
-- limit and no rate, in a queue without limits, and returns its group's free slots (`room`, by
-- this statement's snapshot); the others (room NULL) are the walk's, which the worker then runs
-- too. A job the head serves whose group has room locks its group (the walk's lock: one claimer
-- at a time counts a group's slots); claim_head_jobs counts again with its own snapshot, newer
-- than the lock. Rows in claim order; a group's later rows lock it again (an advisory lock is
-- counted, not refused, in its own transaction), and the worker keeps the first job of each
-- group (fetcher.read_head): the batch takes every group's first job before any group's second,
-- as the walk's does. Slots and limits are looked up by name in two jsonb objects, each built
-- once (held_slots and head_limits, sql.py).
WITH held AS ({held_slots}),
lims AS ({head_limits}),
head AS (
    SELECT h.*, ((SELECT l FROM lims) ->> h.task)::int AS lim,
           h.queue <> ALL(ARRAY(SELECT q.name FROM {schema}.pgqueue_queues q
                                WHERE q.concurrency_limit IS NOT NULL OR q.rate_limit IS NOT NULL))
           AS unlimited_queue
    FROM (
        SELECT j.id, j.task, j.limit_key, j.queue, j.priority, j.run_at,
               't:' || length(j.task) || ':' || j.task || ':' || j.limit_key AS name
        FROM {schema}.pgqueue_jobs j
        WHERE j.status IN ('queued', 'retrying')
        ORDER BY j.priority DESC, j.run_at, j.id
        LIMIT %(scan)s
    ) h
    WHERE h.limit_key IS NOT NULL AND h.run_at <= now() AND h.task = ANY(%(tasks)s::text[])
      AND (%(queues)s::text[] IS NULL OR h.queue = ANY(%(queues)s::text[]))
      AND h.queue <> ALL(ARRAY(SELECT q.name FROM {schema}.pgqueue_queues q WHERE q.paused))
)
SELECT r.id, r.task, r.limit_key,
       CASE WHEN r.room > 0
            THEN pg_try_advisory_xact_lock(hashtextextended(%(schema)s || ':' || r.name, 0))
            ELSE false END,
       r.room
FROM (SELECT r.*, CASE WHEN r.unlimited_queue
                       THEN r.lim - COALESCE(((SELECT n FROM held) ->> r.name)::int, 0) END room
      FROM head r) r
ORDER BY r.priority DESC, r.run_at, r.id

-- name: claim_head_jobs
-- The fast path's claim (lock_head_groups): the jobs it found, one per group it locked, that
-- are still waiting, still in that group, and whose group still has a free slot, counted now
-- (this statement's snapshot is newer than the locks), as claim_limited_jobs counts them. The
-- worker's lease and the clocks as there (the same update: limited_claimed, sql.py); a task
-- with a rate is left to the walk, whose claim logs the starts. Each job is read by its primary
-- key (a lateral probe per id: as a join, a plan chose to scan every waiting job, 11 ms of a
-- 14 ms claim of 100).
WITH held AS ({held_slots}),
lims AS ({head_limits}),
taken AS (
    SELECT c.id FROM unnest(%(ids)s::bigint[], %(keys)s::text[]) AS g(id, key), LATERAL (
        SELECT c.id FROM {schema}.pgqueue_jobs c
        WHERE c.id = g.id AND c.status IN ('queued', 'retrying') AND c.limit_key = g.key
          AND c.run_at <= now()
          AND ((SELECT l FROM lims) ->> c.task)::int > COALESCE(((SELECT n FROM held)
               ->> ('t:' || length(c.task) || ':' || c.task || ':' || c.limit_key))::int, 0)
        FOR UPDATE SKIP LOCKED
    ) c
),
claimed AS ({limited_claimed})
SELECT id, queue, task, args::text, attempts, max_attempts, w, limit_key, meta::text
FROM claimed ORDER BY priority DESC, run_at, id

-- name: next_ready_at
-- %(lookback)s: seconds since the worker sent the claim that came back short. A job that fell due
-- in between was not due for that claim and is due now: it counts (the answer is then 0 or less,
-- "claim again") instead of being read past as due, which left it to the poll (a reaped job with
-- a backoff of milliseconds was lost that way, 1 in 4 runs of test_a_reaped_job_wakes_an_idle_
-- worker). A due job the claim did see but could not take (another worker's lock) counts at most
-- once: the next claim's lookback starts after it.
-- Seconds from the database's now() to the earliest run_at still ahead among waiting jobs (NULL:
-- none), for a worker that has nothing to claim and may sleep until then, and for the fetcher to
-- choose its claim statement. The same walk over the priorities as claim_jobs_by_priority: a
-- priority's first index entry holds its earliest run_at, and when some of its jobs are due one
-- more descent finds its first future one; so one or two index descents per distinct priority
-- (per listed queue in next_ready_at_in_queues), however many jobs wait. Beyond the 32 highest
-- priorities the rest is one scan of their waiting jobs, as in claim_jobs_by_priority. Rendered
-- twice like claim_jobs (sql.VARIANTS).
-- Jobs of paused queues are not work the worker could claim, due or not: counting them would
-- wake an idle worker each time one falls due, to claim nothing. While any queue is paused the
-- earliest future job of each priority is looked up past them (one descent while nothing is
-- paused, when a priority's first entry is its answer). The scan beyond 32 priorities still
-- counts them: filtering there needs the heap, and the planner then reads the whole table; an
-- early wake-up is all they can cost. Jobs only the limited claim may take count while they are
-- still ahead (one falling due is worth a look), but not in the lookback: a due job whose group
-- was full at the claim would say "claim again" after every claim for the margin's length, a
-- burst of claims that find nothing. A limited job that falls due in those milliseconds waits
-- for the next wake-up: a freed slot, a notification, a rate's refill, or the poll.
-- The second column says whether the limited claim has anything to do for this worker: jobs
-- with a limit group wait, or a queue it serves has a limit or a rate (one index probe each).
WITH RECURSIVE groups (depth, priority, first_run_at, first_id) AS (
    VALUES (0, 2147483648, NULL::timestamptz, NULL::bigint)
    UNION ALL
    SELECT g.depth + 1, n.* FROM groups g CROSS JOIN LATERAL (
        SELECT f.* FROM {queue_list} AS l(queue) CROSS JOIN LATERAL (
            SELECT priority, run_at, id FROM {schema}.pgqueue_jobs
            WHERE status IN ('queued', 'retrying') AND priority < g.priority {queue_match}
            ORDER BY priority DESC, run_at, id LIMIT 1
        ) f
        ORDER BY f.priority DESC, f.run_at, f.id LIMIT 1
    ) n
    WHERE g.depth < 32
)
SELECT extract(epoch FROM least(
    (SELECT min(CASE WHEN g.first_run_at > now() - make_interval(secs => %(lookback)s)
                          AND NOT EXISTS (SELECT FROM {schema}.pgqueue_queues WHERE paused)
                          AND (g.first_run_at > now() OR NOT EXISTS (
                                   SELECT FROM {schema}.pgqueue_queues
                                   WHERE concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL
                               ) AND NOT EXISTS (
                                   SELECT FROM {schema}.pgqueue_jobs
                                   WHERE status IN ('queued', 'retrying')
                                         AND limit_key IS NOT NULL))
                     THEN g.first_run_at ELSE (
        SELECT min(f.run_at) FROM {queue_list} AS l(queue) CROSS JOIN LATERAL (
            SELECT run_at FROM {schema}.pgqueue_jobs
            WHERE status IN ('queued', 'retrying') AND priority = g.priority
                  AND run_at > now() - make_interval(secs => %(lookback)s)
                  {queue_match}
                  AND queue || '' <> ALL(ARRAY(
                      SELECT name FROM {schema}.pgqueue_queues WHERE paused))
                  AND (run_at > now() OR limit_key IS NULL AND queue || '' <> ALL(ARRAY(
                      SELECT name FROM {schema}.pgqueue_queues
                      WHERE concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL)))
            ORDER BY run_at LIMIT 1
        ) f
    ) END) FROM groups g WHERE g.depth > 0),
    (SELECT min(run_at) FROM {schema}.pgqueue_jobs
     WHERE status IN ('queued', 'retrying')
           AND run_at > now() - make_interval(secs => %(lookback)s) {queue_filter}
           AND priority < (SELECT priority FROM groups WHERE depth = 32))
) - now())::float8,
       EXISTS (SELECT FROM {schema}.pgqueue_jobs
               WHERE status IN ('queued', 'retrying') AND limit_key IS NOT NULL)
       OR EXISTS (SELECT FROM {schema}.pgqueue_queues
                  WHERE NOT paused AND (concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL)
                        {limited_queue_match})

-- name: complete_jobs
-- The second column says whether anyone waits for results (App.wait: notify_finished), one
-- look per statement (an InitPlan), made once every row of the batch is written and locked:
-- its count(*) reads all of `done` first. A waiter that announces itself after that look then
-- finds the batch's rows locked until the acks commit (lock_awaited_job waits for them), so an
-- ack that saw nobody waiting can never commit unseen behind a waiter's first look. Looked at
-- in RETURNING instead, at the batch's first row, a later row could still be unlocked when a
-- waiter arrived: it read the job still running and slept until its own next look.
-- Batched acks, fenced per job: a row changes only while it still carries the lease token this
-- worker got when it claimed it. Rows missing from RETURNING were lost (reaped, re-claimed or
-- cancelled) and the stale result is dropped. The token stays on the finished row (only a new
-- claim replaces it; reaper and release clear it), so an ack whose commit went unseen can be
-- recognised as ours (applied_completions) instead of being miscounted as stale.
-- Times are statement_timestamp(), not now(): in a handler's own transaction (transactional
-- completion) now() is when that transaction began, not when the job finished.
-- `status::text = 'running'` (here, in release_leases and expire_leases) keeps the planner off
-- pgqueue_jobs_running_idx: statistics taken while nothing ran say "about one running row", and
-- the plan then scanned every running row once per element of the arrays (400 x 200 comparisons
-- per ack, seen at 20-30 ms instead of 2). With only the primary key usable, each element is one
-- index probe whatever the statistics say.
-- The completer sends ids in ascending order, as every multi-row write does, so two writers
-- that must wait for each other's rows lock them in the same order and cannot deadlock.
-- No row lock is waited for longer than %(lock_timeout)s (100 ms for the completer, the lease
-- for a handler's own transaction): a row locked by someone else (an operator's SELECT ... FOR
-- UPDATE) then fails the statement instead of stalling every ack behind it, and the completer
-- writes the batch again as complete_jobs_skip_locked (this statement with {lock_filter}), which
-- skips rows locked right now; those acks are tried again a little later. The timeout is set by
-- set_config(..., true) inside the statement, which lasts until its transaction ends: no session
-- state, so it is safe behind a transaction-pooling PgBouncer. The scalar subquery is evaluated
-- once, at the first candidate row, before any row is locked.
-- An attempt that did not succeed goes into pgqueue_attempts in the same statement (migration
-- 0016), so it commits with the ack and a refused ack writes none. Its worker is read from the
-- statement's snapshot (the update clears it) by a subquery run per failed row only, one
-- primary-key probe: a batch of successes inserts and reads nothing more.
-- Acks that free limit slots wake the workers waiting for them in the same statement
-- (complete_jobs_waking: {woke}, wake_waiting_workers' look for the queues in %(queues)s, run by
-- the one-time filter {woke_gate} whether or not any ack was taken; the NOTIFY goes out when the
-- acks commit). One statement, so one message with its Sync: a pipeline of the ack and a wake
-- left the server inside the transaction, the acked rows locked, for as long as the Sync took
-- to come, with no idle timeout (PostgreSQL starts it only at a Sync), for the whole outage of a
-- worker cut off between the two.
-- In a handler's own transaction (complete_jobs_in_transaction) the ack is the last statement
-- before COMMIT, and {ack_idle} bounds that wait: a session idle in it longer than %(idle)s
-- (half the lease) is ended by the server, its locks with it, so that a worker cut off there
-- leaves the job's row to the reaper once the lease runs out instead of holding it locked for
-- as long as the network takes to say the worker is gone.
WITH done AS (
UPDATE {schema}.pgqueue_jobs j
SET status = CASE WHEN j.cancel_requested_at IS NOT NULL AND a.status <> 'succeeded'
                  THEN 'cancelled' ELSE a.status END::{schema}.pgqueue_status,
    run_at = CASE WHEN a.status = 'retrying' AND j.cancel_requested_at IS NULL
                  THEN statement_timestamp() + make_interval(secs => a.delay) ELSE j.run_at END,
    finished_at = CASE WHEN a.status = 'retrying' AND j.cancel_requested_at IS NULL THEN NULL
                       ELSE statement_timestamp() END,
    started_at = greatest(j.claimed_at,
                          statement_timestamp() - make_interval(secs => a.run_seconds)),
    last_error = COALESCE(a.error, j.last_error),
    result = a.result::jsonb,
    progress = CASE WHEN a.status = 'retrying' THEN NULL ELSE j.progress END,
    lease_expires_at = NULL, worker_id = NULL
FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[], %(statuses)b::text[], %(delays)b::float8[],
            %(errors)b::text[], %(results)b::text[], %(run_seconds)b::float8[])
     AS a(id, token, status, delay, error, result, run_seconds)
WHERE j.id = a.id AND j.lease_token = a.token AND j.status::text = 'running'
  AND (SELECT set_config('lock_timeout', %(lock_timeout)s, true){ack_idle}) IS NOT NULL {lock_filter}
RETURNING j.id, j.status::text AS status, j.attempts, j.claimed_at, j.started_at, a.error
), history AS (
    INSERT INTO {schema}.pgqueue_attempts
        (job_id, attempt, worker_id, claimed_at, started_at, finished_at, outcome, error)
    SELECT d.id, d.attempts,
           (SELECT o.worker_id FROM {schema}.pgqueue_jobs o WHERE o.id = d.id),
           d.claimed_at, d.started_at, statement_timestamp(), d.status, left(d.error, 8000)
    FROM done d
    WHERE d.status <> 'succeeded'
){woke}
SELECT id, (SELECT CASE WHEN pg_try_advisory_lock(hashtext({channel}), 3)
                        THEN NOT pg_advisory_unlock(hashtext({channel}), 3)
                        ELSE true END
            FROM (SELECT count(*) FROM done) AS written) AS waited
FROM done{woke_gate}

-- name: hand_off_queue_slots
-- Pipelined after complete_jobs, in the acks' transaction, when the batch finished jobs of a
-- queue with a concurrency limit: the slots those acks freed go straight to that queue's next
-- waiting jobs, claimed for the same worker, so a queue limited to the worker's concurrency
-- does not wait for a limited claim's round trips after every batch of acks
-- (concepts/limits.md, "Slot hand-off"). The freed slots are the batch's rows this
-- transaction took out of 'running' (its own token on a row no longer running: only an ack of
-- that claim does that), counted per queue, jobs without a limit group only. A queue gets at
-- most that many jobs, never more than its limit leaves free by this statement's count (which
-- sees the acks), and none while it is paused or has a rate (the limited claim keeps the rate's
-- log). Taking no more than the transaction freed, it never raises a queue's count, so no
-- group lock is needed: a limited claim counting at the same time sees the acks and the new
-- claims together or neither. The worker's lease is checked at this statement's start, as in
-- claim_limited_jobs. The next jobs are taken in claim order, and a slot whose next job is of
-- a task this worker does not run (a rolling deploy) is not handed off: it goes to the
-- workers the acks' wake tells, which run that task; skipping over such jobs, one worker could
-- keep every slot of the queue while they wait. %(tasks)s also leaves out the tasks this worker
-- declares limited, and the statement those the database limits (the worker's code may not
-- declare an operator's limit): such a job here has lost its group, which the limited claim
-- gives back (regroup_leases). Same rows and columns as claim_limited_jobs (limit_key always
-- NULL).
WITH freed AS (
    SELECT j.queue, count(*) AS n
    FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS a(id, token)
    JOIN {schema}.pgqueue_jobs j ON j.id = a.id AND j.lease_token = a.token
    WHERE j.status::text <> 'running' AND j.limit_key IS NULL
    GROUP BY j.queue
),
room AS (
    SELECT f.queue, least(f.n, q.concurrency_limit - (
               SELECT count(*) FROM {schema}.pgqueue_jobs r
               WHERE r.status = 'running' AND r.queue = f.queue)) AS n
    FROM freed f JOIN {schema}.pgqueue_queues q ON q.name = f.queue
    WHERE q.concurrency_limit IS NOT NULL AND q.rate_limit IS NULL AND NOT q.paused
      AND EXISTS (SELECT FROM {schema}.pgqueue_workers w WHERE w.id = %(worker_id)s
                  AND w.lease_expires_at > statement_timestamp())
),
claimed AS (
    UPDATE {schema}.pgqueue_jobs j
    SET status = 'running', attempts = j.attempts + 1, lease_token = %(token)s,
        lease_expires_at = NULL, worker_id = %(worker_id)s, claimed_at = statement_timestamp(),
        started_at = NULL
    WHERE j.id = ANY(ARRAY(
        SELECT c.id FROM room r CROSS JOIN LATERAL (
            SELECT w.id, w.task FROM {schema}.pgqueue_jobs w
            WHERE w.status IN ('queued', 'retrying') AND w.queue = r.queue AND w.run_at <= now()
              AND w.limit_key IS NULL
            ORDER BY w.priority DESC, w.run_at, w.id
            LIMIT greatest(r.n, 0)
            FOR UPDATE SKIP LOCKED
        ) c
        WHERE c.task = ANY(%(tasks)s::text[])
          AND c.task <> ALL(ARRAY(SELECT name FROM {schema}.pgqueue_tasks
                                  WHERE concurrency_limit IS NOT NULL OR rate_limit IS NOT NULL))
    ))
    RETURNING j.id, j.queue, j.task, j.limit_key, j.args, j.attempts, j.max_attempts,
              extract(epoch FROM statement_timestamp() - j.run_at)::float8 w,
              j.priority, j.run_at, j.meta
)
SELECT id, queue, task, args::text, attempts, max_attempts, w, limit_key, meta::text
FROM claimed ORDER BY priority DESC, run_at, id

-- name: notify_finished
-- Jobs that reached a final state (succeeded, dead, cancelled), announced to whoever waits for
-- results (App.wait) on the done channel: ids, comma-separated. Only while someone waits (a
-- waiter holds advisory lock 3 of the channel, shared, like the waiting workers of migration
-- 0004 hold lock 1); complete_jobs' second column says so for its batch, so a worker with nobody
-- waiting never sends this. The jobs are committed before it is sent.
SELECT pg_notify({done_channel}, %(ids)s)
WHERE NOT (SELECT CASE WHEN pg_try_advisory_lock(hashtext({channel}), 3)
                       THEN pg_advisory_unlock(hashtext({channel}), 3)
                       ELSE false END)

-- name: announce_result_wait
-- A waiter for results says so on its LISTEN connection, for as long as it waits.
SELECT pg_advisory_lock_shared(hashtext({channel}), 3)

-- name: lock_awaited_job
-- A waiter's first look, right after announce_result_wait: waits for any write holding the
-- job's row (FOR SHARE conflicts with an ack's update), so an ack that looked for waiters
-- before this one announced itself has committed before the waiter reads the job (see
-- complete_jobs). No longer than %(lock_timeout)s: the waiter then reads the job anyway and
-- looks again later, as it always does.
SELECT FROM {schema}.pgqueue_jobs j
WHERE j.id = %(id)s AND (SELECT set_config('lock_timeout', %(lock_timeout)s, true)) IS NOT NULL
FOR SHARE OF j

-- name: applied_completions
-- Only after an ack write went wrong: which of these acks are already in (the connection was
-- lost mid-commit), and which jobs are still ours and running (their rows were locked by
-- someone else, or the write failed before it ran). A row that is no longer running but still
-- carries our token was finished by our own earlier write: tokens are fresh per claim, and the
-- reaper and releases clear them.
SELECT j.id, j.status = 'running'
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS a(id, token)
JOIN {schema}.pgqueue_jobs j ON j.id = a.id AND j.lease_token = a.token

-- name: release_leases
-- Shutdown: give back jobs this worker will not finish, without counting the attempt, so other
-- workers can take them at once (the worker then wakes waiting workers: wake_waiting_workers).
-- Fenced like every other write; rows locked by someone else right now are skipped, not waited
-- for (usually another worker's claim that passed the row: locked for milliseconds): the worker
-- tries those again for a moment (RELEASE_RETRY), and leaves one still locked to the reapers.
UPDATE {schema}.pgqueue_jobs j
SET status = CASE WHEN j.attempts <= 1 THEN 'queued' ELSE 'retrying' END::{schema}.pgqueue_status,
    attempts = greatest(j.attempts - 1, 0), run_at = now(),
    lease_token = NULL, lease_expires_at = NULL, worker_id = NULL
FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[]) AS r(id, token)
WHERE j.id = r.id AND j.lease_token = r.token AND j.status::text = 'running'
  AND r.id = ANY(ARRAY(SELECT l.id FROM {schema}.pgqueue_jobs l
                       WHERE l.id = ANY(%(ids)b::bigint[]) ORDER BY l.id
                       FOR UPDATE SKIP LOCKED))
RETURNING j.id, j.queue

-- name: regroup_leases
-- A claim took jobs of a limited task (declared by this worker, or limited in pgqueue_tasks:
-- the claim's `stray`) that have no limit group: each was locked through every pass that gives
-- waiting jobs their group (limits.stamp_skipped gave up), was claimed before the worker's own
-- pass reached it, or was requeued or released by its parents after those passes. They go back
-- waiting with their group (computed by the worker; '' when its code does not declare the
-- limit), attempt uncounted, for the limited claim to take under the limit.
-- Fenced like release_leases; a row locked right now is skipped: the worker gives those back
-- with regroup_leases_waiting (the same statement, waiting for the locks, under a lock_timeout),
-- and runs here only a job whose row stayed locked past that.
UPDATE {schema}.pgqueue_jobs j
SET status = CASE WHEN j.attempts <= 1 THEN 'queued' ELSE 'retrying' END::{schema}.pgqueue_status,
    attempts = greatest(j.attempts - 1, 0), limit_key = r.key,
    lease_token = NULL, lease_expires_at = NULL, worker_id = NULL
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(keys)s::text[]) AS r(id, token, key)
WHERE j.id = r.id AND j.lease_token = r.token AND j.status::text = 'running'
  AND r.id = ANY(ARRAY(SELECT l.id FROM {schema}.pgqueue_jobs l
                       WHERE l.id = ANY(%(ids)s::bigint[]) {regroup_wait} ORDER BY l.id
                       FOR UPDATE {regroup_skip}))
RETURNING j.id, j.queue

-- name: extend_leases
-- The heartbeat: one row per worker, whatever it holds. It extends the worker's lease, which
-- covers every job the worker claimed (a job's own lease_expires_at stays NULL), and re-creates
-- the worker's row if a reaper pruned it during a long stall. Job rows are only read, never
-- locked or written, so a heartbeat never waits on a job's row lock and never conflicts with a
-- handler's own transaction. It returns the jobs the worker holds that are no longer its own
-- (reaped, or taken by hand; third column false), and those still its own that someone asked
-- to cancel (true): one primary-key probe each.
WITH worker AS (
    INSERT INTO {schema}.pgqueue_workers AS w
        (id, host, pid, queues, concurrency, lease_expires_at)
    VALUES (%(worker_id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s,
            now() + make_interval(secs => %(lease)s))
    ON CONFLICT (id) DO UPDATE
    SET last_heartbeat_at = now(), lease_expires_at = EXCLUDED.lease_expires_at,
        stale_writes = w.stale_writes + %(stale_writes)s
)
SELECT h.id, h.token, j.id IS NOT NULL
FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[]) AS h(id, token)
LEFT JOIN {schema}.pgqueue_jobs j
       ON j.id = h.id AND j.lease_token = h.token AND j.status::text = 'running'
WHERE j.id IS NULL OR j.cancel_requested_at IS NOT NULL

-- name: save_progress
-- The handlers' latest ctx.progress(...), written by the heartbeat after extend_leases: one
-- statement for every job that reported since the last beat, fenced like an ack (id, token,
-- still running). Rows locked by someone else right now are skipped, not waited for (the
-- heartbeat never waits on a job's row lock, see extend_leases): their progress is written at a
-- later beat. progress is in no index, so this is a HOT update.
UPDATE {schema}.pgqueue_jobs j SET progress = p.progress::jsonb
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[], %(progress)s::text[]) AS p(id, token, progress)
WHERE j.id = p.id AND j.lease_token = p.token AND j.status::text = 'running'
  AND j.id = ANY(ARRAY(SELECT l.id FROM {schema}.pgqueue_jobs l
                       WHERE l.id = ANY(%(ids)s::bigint[]) ORDER BY l.id
                       FOR UPDATE SKIP LOCKED))
RETURNING j.id

-- name: untracked_jobs
-- Jobs running under this worker's lease that it does not track (a bug, or a claim whose answer
-- a failover lost; jobs it gave up or abandoned it expires itself). The heartbeat asks now and
-- then and after an outage, not every beat: this reads every running row.
SELECT j.id, j.lease_token FROM {schema}.pgqueue_jobs j
WHERE j.status = 'running' AND j.worker_id = %(worker_id)s
  AND NOT EXISTS (SELECT FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS h(id, token)
                  WHERE h.id = j.id AND h.token = j.lease_token)

-- name: register_worker
-- The worker's lease starts here: claims need it live (claim_jobs).
INSERT INTO {schema}.pgqueue_workers AS w
    (id, host, pid, queues, concurrency, lease_expires_at, tasks)
VALUES (%(worker_id)s, %(host)s, %(pid)s, %(queues)s, %(concurrency)s,
        now() + make_interval(secs => %(lease)s), %(tasks)s)
ON CONFLICT (id) DO UPDATE
SET last_heartbeat_at = now(), lease_expires_at = EXCLUDED.lease_expires_at

-- name: worker_fleet
-- The live workers (a few rows: pgqueue_workers holds one per worker), the connection slots
-- PostgreSQL leaves non-superusers, and the client connections open now (pg_stat_activity reads
-- shared memory, one entry per slot): every worker takes its share of the slots and grows no
-- further while the server is nearly full (worker/connections.py), and spaces the fleet-wide
-- chores by the count (reaper, scheduler, depth samples). reserved_connections exists from
-- PostgreSQL 16 (missing_ok: NULL before).
SELECT (SELECT count(*) FROM {schema}.pgqueue_workers WHERE lease_expires_at >= now())::int,
       current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int
         + COALESCE(current_setting('reserved_connections', true)::int, 0),
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int

-- name: deregister_worker
-- The worker's lease ends with its row: a job it could not release is any reaper's at once.
DELETE FROM {schema}.pgqueue_workers WHERE id = %(worker_id)s

-- name: reap_expired_leases
-- Expired leases go back to retrying (with the same capped, fully jittered backoff as failures:
-- random() * least(cap, base * 2^(attempts-1))) or to dead when out of attempts. A running job's
-- lease is its worker's (pgqueue_workers.lease_expires_at; a worker that deregistered or was
-- pruned has none) unless the job carries its own lease_expires_at (expire_leases sets it to
-- give one attempt up, and workers from before migration 0005 extend it per job).
-- The find locks what it takes and skips rows locked right now (an ack or a release on its way,
-- an operator's lock): never waiting is what lets one stuck row cost only that row; a skipped
-- row is found again next round if its lease is still expired. Locking re-checks the find's
-- WHERE on the newest row version (READ COMMITTED), so a job that was completed, released or
-- claimed again since the statement's snapshot is left alone: its status, token or worker no
-- longer match. The worker rows are read from the snapshot, which is why the find also demands
-- claimed_at < now(): a claim that started after this statement (by a worker that registered
-- too late for the snapshot to see its lease) is never mistaken for an orphan. Ids are locked in
-- ascending order, as in every multi-row write.
-- %(pause)s is a test hook (0 in production): it stalls the reaper after finding each row in
-- its snapshot and before locking it, the window in which a completion, a new claim or an
-- extension can land; the fault suite's reaper_race scenario plays every one of them there.
-- The attempt taken back goes into pgqueue_attempts ('lease expired') in the same statement,
-- with its worker and claim as locked (the find's row) and no start: started_at is written
-- with a result, which an expired attempt never had.
WITH reaped AS (
UPDATE {schema}.pgqueue_jobs j
SET status = CASE WHEN j.cancel_requested_at IS NOT NULL THEN 'cancelled'
                  WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'retrying' END
             ::{schema}.pgqueue_status,
    run_at = CASE WHEN j.attempts >= j.max_attempts OR j.cancel_requested_at IS NOT NULL
                  THEN j.run_at
                  ELSE now() + make_interval(secs => random() * least(
                      %(backoff_cap)s::float8,
                      %(backoff_base)s::float8 * power(2, greatest(j.attempts - 1, 0))))
             END,
    finished_at = CASE WHEN j.attempts >= j.max_attempts OR j.cancel_requested_at IS NOT NULL
                       THEN now() END,
    progress = NULL,
    last_error = 'LeaseExpired: worker ' || COALESCE(j.worker_id::text, '?')
                 || ' no longer held its lease on this attempt (it crashed, stalled, lost its'
                 || ' connection or gave the attempt up)',
    lease_token = NULL, lease_expires_at = NULL, worker_id = NULL
FROM (
    SELECT r.id, r.worker_id, r.claimed_at FROM {schema}.pgqueue_jobs r
    WHERE r.status = 'running' AND r.claimed_at < now()
      AND CASE WHEN r.lease_expires_at IS NOT NULL THEN r.lease_expires_at < now()
               ELSE NOT EXISTS (SELECT FROM {schema}.pgqueue_workers w
                                WHERE w.id = r.worker_id AND w.lease_expires_at >= now())
          END
      AND (%(pause)s::float8 = 0 OR pg_sleep(%(pause)s::float8) IS NOT NULL)
    ORDER BY r.id
    LIMIT 1000
    FOR UPDATE OF r SKIP LOCKED
) expired
WHERE j.id = expired.id
RETURNING j.id, j.status::text AS status, j.attempts, j.queue, expired.worker_id,
          expired.claimed_at, j.last_error
), history AS (
    INSERT INTO {schema}.pgqueue_attempts
        (job_id, attempt, worker_id, claimed_at, finished_at, outcome, error)
    SELECT id, attempts, worker_id, claimed_at, now(), 'lease expired', last_error FROM reaped
)
SELECT id, status, attempts, queue FROM reaped

-- name: end_lapsed_sessions
-- Run by the reaper before it reaps: ends the sessions that workers whose lease ran out left
-- waiting inside a transaction on the server, so that the rows they hold (the reaper skips
-- locked rows) are freed and reaped. A worker cut off from the server mid-transaction leaves
-- its transaction open until TCP gives up on it (hours, with the server's default keepalives);
-- its lease is over, so whatever that transaction would still write is fenced anyway
-- (docs/guarantees.md, "Cut off mid-transaction"). A worker's sessions carry its id in their
-- application_name (pgqueue-worker:PID:ID:ROLE, ID the first 16 hex digits of the worker's id).
-- Only sessions waiting for their client inside a transaction: idle in one, or in the middle of
-- a pipeline (active, reading from the client); a statement still running ends on its own. Only
-- sessions this role may end (pg_terminate_backend's own rule), never the caller's own worker's
-- nor its own session. The count is of sessions told to end: each exits, and its locks go, a
-- moment later.
SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid))
FROM pg_stat_activity a
JOIN {schema}.pgqueue_workers w
  ON a.application_name LIKE 'pgqueue-worker:%%:' || left(replace(w.id::text, '-', ''), 16) || ':%%'
WHERE w.lease_expires_at < now() AND w.id IS DISTINCT FROM %(worker_id)s::uuid
  AND a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND a.xact_start IS NOT NULL
  AND (a.state LIKE 'idle in transaction%%' OR (a.state = 'active' AND a.wait_event = 'ClientRead'))
  AND pg_has_role(a.usesysid, 'MEMBER')

-- name: expire_leases
-- Gives attempts up that this worker can no longer see through (an ack that cannot be written,
-- a job it lost track of): their lease ends now, and the next reaper round records them as
-- failed attempts (retrying or dead) instead of leaving them running under a live worker.
UPDATE {schema}.pgqueue_jobs j
SET lease_expires_at = now() - interval '1 microsecond'
FROM unnest(%(ids)s::bigint[], %(tokens)s::uuid[]) AS e(id, token)
WHERE j.id = e.id AND j.lease_token = e.token AND j.status::text = 'running'
RETURNING j.id

-- name: wake_waiting_workers
-- Jobs that an UPDATE made ready (a retry, a hand-back, a reap) wake nobody by themselves (the
-- NOTIFY trigger only sees inserts): the worker that wrote them calls this after its write, and
-- it notifies each queue once, only while some worker waits for work (migration 0004's lock).
-- The jobs are committed by then, so a worker that starts waiting after this look still finds
-- them with the claim it makes as it starts waiting.
{wake_look}

-- name: prune_workers
-- Worker rows whose heartbeat stopped long ago (their jobs are the reaper's business).
DELETE FROM {schema}.pgqueue_workers
WHERE last_heartbeat_at < now() - make_interval(secs => %(older_than)s)

-- name: prune_rates
-- Rate logs that count for nothing: the newest entry has left the period, judged by the longer
-- of the row's own period and the one its task or queue has now (a rate whose period was raised
-- since the row was written still counts its entries, as the claim's window does; a group's
-- name starts with its task's, see limits.group_name). A per-key rate writes one row per key,
-- so a key that went quiet would keep its row for ever. A row being written right now is
-- skipped (SKIP LOCKED); the claim that writes a pruned group's row again inserts it anew (ON
-- CONFLICT in claim_limited_jobs). In batches.
DELETE FROM {schema}.pgqueue_rates
WHERE name = ANY(ARRAY(
    SELECT r.name FROM {schema}.pgqueue_rates r
    WHERE r.times[cardinality(r.times)] < now() - make_interval(secs => greatest(
              r.period,
              (SELECT max(t.rate_period) FROM {schema}.pgqueue_tasks t
               WHERE starts_with(r.name, 't:' || length(t.name) || ':' || t.name || ':')),
              (SELECT q.rate_period FROM {schema}.pgqueue_queues q
               WHERE starts_with(r.name, 'q:') AND q.name = substr(r.name, 3))))
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
))

-- name: prune_finished_jobs
-- Keeps the hot table small: finished jobs past their retention go, at most %(batch)s per
-- statement (the reaper loops, with a time budget per round). Rendered twice (sql.VARIANTS):
-- succeeded and cancelled jobs here (the worker's retention), dead ones as prune_dead_jobs (its
-- dead_retention; without one they stay until requeued or deleted). The status list is a
-- literal so that the planner proves pgqueue_jobs_finished_idx's predicate and reads the oldest
-- rows in finished_at order. Rows locked by someone else are skipped, so pruning never waits for
-- a lock, and it takes none that a claim or an ack waits for: it only deletes finished rows,
-- which claims never read and acks never match.
-- Kept: a succeeded unique job whose key still holds (unique_for after success: deleting the
-- row would free the key early), and a parent whose children have not all finished (a
-- callback reads its parents' results when it runs: parent_results). The parent check runs for
-- rows with has_children only. A pruned job's attempts (pgqueue_attempts has no foreign key to
-- cascade) and its dependency links go in the same statement: `= ANY(ARRAY(...))` probes
-- pgqueue_attempts_job_idx and the pgqueue_job_deps indexes per id, where a join hashed the
-- whole table (a sequential scan of it per batch).
WITH picked AS (
    SELECT id FROM {schema}.pgqueue_jobs j
    WHERE status IN ({pruned_statuses})
      AND finished_at < now() - make_interval(secs => %(older_than)s)
      AND NOT (unique_key IS NOT NULL AND unique_for IS NOT NULL AND status = 'succeeded'
               AND finished_at >= now() - make_interval(secs => unique_for))
      AND NOT (has_children AND EXISTS (
          SELECT FROM {schema}.pgqueue_job_deps d
          JOIN {schema}.pgqueue_jobs c ON c.id = d.child_id
          WHERE d.parent_id = j.id AND c.status NOT IN ('succeeded', 'dead', 'cancelled')))
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), history AS (
    DELETE FROM {schema}.pgqueue_attempts WHERE job_id = ANY(ARRAY(SELECT id FROM picked))
), links AS (
    DELETE FROM {schema}.pgqueue_job_deps
    WHERE child_id = ANY(ARRAY(SELECT id FROM picked))
       OR parent_id = ANY(ARRAY(SELECT id FROM picked))
)
DELETE FROM {schema}.pgqueue_jobs WHERE id IN (SELECT id FROM picked)

-- name: archive_finished_jobs
-- prune_finished_jobs for workers with archive=True: the same rows (same conditions, same
-- batches, same locks; see there), moved to pgqueue_jobs_archive (migration 0018) instead of
-- deleted, by one statement, so a job is in one table or the other at every instant. Their
-- attempts go with them as attempt_history (a hash join of the batch's history, aggregated
-- per job). Rendered twice like the prune: archive_dead_jobs for dead ones. The day's
-- partition must exist: the reaper calls archive_partitions before each round, which creates
-- them from the day %(keep_seconds)s ago (the archive's retention; NULL: from the oldest
-- finished job), and deletes older jobs with prune_finished_jobs instead of moving them.
WITH picked AS (
    SELECT id FROM {schema}.pgqueue_jobs j
    WHERE status IN ({pruned_statuses})
      AND finished_at < now() - make_interval(secs => %(older_than)s)
      AND (%(keep_seconds)s::float8 IS NULL
           OR finished_at >= now() - make_interval(secs => %(keep_seconds)s::float8))
      AND NOT (unique_key IS NOT NULL AND unique_for IS NOT NULL AND status = 'succeeded'
               AND finished_at >= now() - make_interval(secs => unique_for))
      AND NOT (has_children AND EXISTS (
          SELECT FROM {schema}.pgqueue_job_deps d
          JOIN {schema}.pgqueue_jobs c ON c.id = d.child_id
          WHERE d.parent_id = j.id AND c.status NOT IN ('succeeded', 'dead', 'cancelled')))
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), history AS (
    DELETE FROM {schema}.pgqueue_attempts WHERE job_id = ANY(ARRAY(SELECT id FROM picked))
    RETURNING job_id, attempt, worker_id, claimed_at, started_at, finished_at, outcome, error
), per_job AS (
    SELECT job_id, jsonb_agg(jsonb_build_object(
               'attempt', attempt, 'worker_id', worker_id, 'claimed_at', claimed_at,
               'started_at', started_at, 'finished_at', finished_at, 'outcome', outcome,
               'error', error) ORDER BY finished_at) AS attempt_history
    FROM history GROUP BY job_id
), links AS (
    DELETE FROM {schema}.pgqueue_job_deps
    WHERE child_id = ANY(ARRAY(SELECT id FROM picked))
       OR parent_id = ANY(ARRAY(SELECT id FROM picked))
), moved AS (
    DELETE FROM {schema}.pgqueue_jobs WHERE id IN (SELECT id FROM picked)
    RETURNING id, queue, task, args, priority, run_at, status, attempts, max_attempts,
              last_error, result, created_at, claimed_at, started_at, finished_at,
              schedule_name, schedule_tick, unique_key, meta, progress
)
INSERT INTO {schema}.pgqueue_jobs_archive
    (id, queue, task, args, priority, run_at, status, attempts, max_attempts, last_error,
     result, created_at, claimed_at, started_at, finished_at, schedule_name, schedule_tick,
     unique_key, meta, progress, attempt_history)
SELECT m.id, m.queue, m.task, m.args, m.priority, m.run_at, m.status::text, m.attempts,
       m.max_attempts, m.last_error, m.result, m.created_at, m.claimed_at, m.started_at,
       m.finished_at, m.schedule_name, m.schedule_tick, m.unique_key, m.meta, m.progress,
       h.attempt_history
FROM moved m LEFT JOIN per_job h ON h.job_id = m.id

-- name: archive_partitions
-- The archive's daily partitions: created ahead, and dropped once older than
-- %(keep_seconds)s (NULL keeps them); %(with_dead)s: dead jobs are archived too (a
-- dead_retention). See pgqueue_archive_partitions in migration 0018.
SELECT {schema}.pgqueue_archive_partitions(%(keep_seconds)s::float8, %(with_dead)s::boolean)

-- ---------------------------------------------------------------------------------------------
-- schedules
-- ---------------------------------------------------------------------------------------------

-- name: lock_schedule_sync
-- Syncs, prunes and transfers run one after another, so each sees the others' rows whole.
-- The transaction's idle timeout: one whose client was cut off from the server ends 10 s after
-- its last statement instead of holding the lock (and every other sync behind it) until TCP
-- gives up on the client (docs/guarantees.md, "Cut off mid-transaction").
SELECT set_config('idle_in_transaction_session_timeout', '10s', true),
       pg_advisory_xact_lock(hashtextextended('pgqueue.schedules:' || %(schema)s, 0))

-- name: schedule_owners
-- Names a sync or a prune wants that another app owns: refused by name, so the log can say
-- which two apps collide. upsert_schedules and retire_schedules check the owner themselves.
SELECT name, app FROM {schema}.pgqueue_schedules
WHERE name = ANY(%(names)s::text[]) AND app <> %(app)s
ORDER BY name

-- name: upsert_schedules
-- Declared schedules by name, for rows of this app only: a name another app owns is left as it
-- is (the WHERE refuses the update; READ COMMITTED re-checks it on the newest row version).
-- next_run_at (computed from the database clock) is only taken for new rows, a changed cron, or
-- a schedule declared again after it was retired; otherwise the stored tick stands, so a restart
-- never skips or repeats one. paused is never touched, and rows that already match are left
-- alone (no new row version, updated_at stays).
INSERT INTO {schema}.pgqueue_schedules AS s
    (app, name, cron, task, queue, args, priority, max_attempts, next_run_at, missed,
     max_catchup)
SELECT %(app)s, d.name, d.cron, d.task, d.queue, d.args::jsonb, d.priority, d.max_attempts,
       d.next_run_at, d.missed, d.max_catchup
FROM unnest(%(names)s::text[], %(crons)s::text[], %(tasks)s::text[], %(queues)s::text[],
            %(args)s::text[], %(priorities)s::int[], %(max_attempts)s::int[],
            %(next_run_ats)s::timestamptz[], %(misseds)s::text[], %(max_catchups)s::int[])
     AS d(name, cron, task, queue, args, priority, max_attempts, next_run_at, missed, max_catchup)
ORDER BY d.name
ON CONFLICT (name) DO UPDATE
SET cron = EXCLUDED.cron, task = EXCLUDED.task, queue = EXCLUDED.queue, args = EXCLUDED.args,
    priority = EXCLUDED.priority, max_attempts = EXCLUDED.max_attempts,
    missed = EXCLUDED.missed, max_catchup = EXCLUDED.max_catchup, enabled = true,
    next_run_at = CASE WHEN s.cron <> EXCLUDED.cron OR NOT s.enabled
                       THEN EXCLUDED.next_run_at ELSE s.next_run_at END,
    updated_at = now()
WHERE s.app = EXCLUDED.app
  AND (s.cron, s.task, s.queue, s.args, s.priority, s.max_attempts, s.missed, s.max_catchup,
       s.enabled)
      IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.task, EXCLUDED.queue, EXCLUDED.args,
                        EXCLUDED.priority, EXCLUDED.max_attempts, EXCLUDED.missed,
                        EXCLUDED.max_catchup, true)

-- name: undeclared_schedules
-- Live schedules of this app that its code does not declare: they keep firing (a sync only
-- warns about them; another version of the app may still declare them) until retired.
SELECT name FROM {schema}.pgqueue_schedules
WHERE app = %(app)s AND enabled AND name <> ALL(%(declared)s::text[])
ORDER BY name

-- name: retire_schedules
-- The only statement that stops a schedule for good, and only on request (prune, or a declared
-- retirement): rows of this app, by name. The row and its history stay; declaring the name again
-- brings it back from its next future tick.
UPDATE {schema}.pgqueue_schedules
SET enabled = false, updated_at = now()
WHERE app = %(app)s AND enabled AND name = ANY(%(names)s::text[])
RETURNING name

-- name: transfer_schedules
-- A renamed App takes over its schedules (`pgqueue schedules transfer OLD NEW [NAME...]`; names
-- NULL: all of them): the rows keep their ticks, pause and history; only the owner changes.
UPDATE {schema}.pgqueue_schedules
SET app = %(to_app)s, updated_at = now()
WHERE app = %(from_app)s AND (%(names)s::text[] IS NULL OR name = ANY(%(names)s::text[]))
RETURNING name

-- name: lock_due_schedules
-- The firing transaction's first step. pgqueue_schedules_due_idx finds due rows; SKIP LOCKED
-- lets every worker's scheduler run at once: a schedule another worker is firing is skipped,
-- and once that commits its next_run_at is in the future, so the row no longer matches (READ
-- COMMITTED re-checks the WHERE on the newest row version). "Due" is the database clock. The
-- task and arguments let a scheduler whose app declares the task's limit compute the jobs' group.
-- The firing transaction's idle timeout is set here (a one-time filter, before any row is
-- locked): a scheduler cut off from the server between its statements has its session ended
-- 10 s after the last one, so that the rows it locked go back to the other schedulers instead of
-- missing their ticks until TCP gives up on it (docs/guarantees.md, "Cut off mid-transaction").
SELECT name, cron, next_run_at, missed, max_catchup, now(), task, args::text
FROM {schema}.pgqueue_schedules
WHERE enabled AND NOT paused AND next_run_at <= now()
  AND (SELECT set_config('idle_in_transaction_session_timeout', '10s', true)) IS NOT NULL
ORDER BY next_run_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: insert_schedule_jobs
-- Ordinary jobs (retries, dead letters, NOTIFY), tagged with their schedule and tick. The
-- unique index on (schedule_name, schedule_tick) makes a second job for a tick impossible even
-- if two transactions raced past the row lock; the loser inserts nothing. The limit group is
-- as insert_job's: the scheduler's (its app declares the task's limit) or, when it has none,
-- '' for a task limited in the database, so a limited task's scheduled jobs run under its limit.
INSERT INTO {schema}.pgqueue_jobs
    (queue, task, args, priority, max_attempts, run_at, schedule_name, schedule_tick, limit_key)
SELECT s.queue, s.task, s.args, s.priority, s.max_attempts, t.tick, s.name, t.tick,
       COALESCE(t.limit_key, (SELECT '' FROM {schema}.pgqueue_tasks k WHERE k.name = s.task))
FROM unnest(%(names)s::text[], %(ticks)s::timestamptz[], %(limit_keys)s::text[])
     WITH ORDINALITY AS t(name, tick, limit_key, ord)
JOIN {schema}.pgqueue_schedules s ON s.name = t.name
ORDER BY t.ord
ON CONFLICT (schedule_name, schedule_tick) WHERE schedule_name IS NOT NULL DO NOTHING
RETURNING id, schedule_name, schedule_tick

-- name: advance_schedules
-- Same transaction as the insert: move each fired schedule to its next future tick, and record
-- the newest fired tick and its job (found through the unique index, whoever inserted it).
UPDATE {schema}.pgqueue_schedules s
SET next_run_at = a.next_run_at, last_run_at = a.last_tick,
    last_job_id = COALESCE(j.id, s.last_job_id)
FROM unnest(%(names)s::text[], %(next_run_ats)s::timestamptz[], %(last_ticks)s::timestamptz[])
     AS a(name, next_run_at, last_tick)
LEFT JOIN {schema}.pgqueue_jobs j
       ON j.schedule_name = a.name AND j.schedule_tick = a.last_tick
WHERE s.name = a.name

-- name: seconds_until_next_schedule
-- How long the scheduler may sleep, measured on the database clock (NULL: nothing scheduled).
SELECT extract(epoch FROM min(next_run_at) - now())::float8
FROM {schema}.pgqueue_schedules
WHERE enabled AND NOT paused

-- name: list_schedules
-- `pgqueue schedules`: every row, retired ones too, with its owner (a few rows, by name).
SELECT name, app, cron, task, queue, next_run_at, last_run_at, last_job_id, enabled, paused,
       missed, max_catchup
FROM {schema}.pgqueue_schedules
ORDER BY name

-- name: pause_schedule
UPDATE {schema}.pgqueue_schedules SET paused = true, updated_at = now()
WHERE name = %(name)s
RETURNING name

-- name: lock_schedule
-- Resume reads the cron and the database clock under the row lock, then sets next_run_at.
SELECT cron, paused, now() FROM {schema}.pgqueue_schedules WHERE name = %(name)s FOR UPDATE

-- name: resume_schedule
-- Ticks that fell inside the pause are skipped on purpose: the schedule continues from the
-- next future tick instead of treating the pause as an outage to catch up on.
UPDATE {schema}.pgqueue_schedules
SET paused = false, next_run_at = %(next_run_at)s, updated_at = now()
WHERE name = %(name)s
