-- pgqueue schema, version 1.
-- Placeholders: {schema} is the quoted schema identifier, {channel} the quoted NOTIFY channel
-- literal. Literal braces are doubled.

CREATE TYPE {schema}.pgqueue_status AS ENUM
    ('queued', 'running', 'retrying', 'succeeded', 'dead', 'cancelled');

CREATE TABLE {schema}.pgqueue_jobs (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue            text NOT NULL CHECK (length(queue) BETWEEN 1 AND 128),
    task             text NOT NULL CHECK (length(task) BETWEEN 1 AND 256),
    args             jsonb NOT NULL DEFAULT '{{}}',
    priority         integer NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT now(),
    status           {schema}.pgqueue_status NOT NULL DEFAULT 'queued',
    attempts         integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    -- The fencing token: a fresh value per claim. Every result write and heartbeat matches it.
    lease_token      uuid,
    -- Extended by heartbeats. Deliberately in no index so that heartbeats are HOT updates.
    lease_expires_at timestamptz,
    worker_id        uuid,
    last_error       text,
    result           jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    claimed_at       timestamptz,
    started_at       timestamptz,
    finished_at      timestamptz
) WITH (
    -- Room on each page for HOT heartbeat updates; aggressive autovacuum keeps the hot table
    -- and its partial indexes small.
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- The claim's ORDER BY, restricted to ready rows: a claim is an index range scan however many
-- finished rows the table holds. Used by workers that serve every queue.
CREATE INDEX pgqueue_jobs_ready_idx ON {schema}.pgqueue_jobs (priority DESC, run_at, id)
    WHERE status IN ('queued', 'retrying');

-- Same order within one queue, for workers that serve a list of queues.
CREATE INDEX pgqueue_jobs_ready_queue_idx
    ON {schema}.pgqueue_jobs (queue, priority DESC, run_at, id)
    WHERE status IN ('queued', 'retrying');

-- Running jobs are few (bounded by total worker concurrency); the reaper and the dashboard scan
-- them here. Keyed on id, not on the lease expiry, which heartbeats change.
CREATE INDEX pgqueue_jobs_running_idx ON {schema}.pgqueue_jobs (id)
    WHERE status = 'running';

-- Finished rows, newest first: for pruning, the problems panel and the live feed.
CREATE INDEX pgqueue_jobs_finished_idx ON {schema}.pgqueue_jobs (finished_at)
    WHERE status IN ('succeeded', 'dead', 'cancelled');

CREATE TABLE {schema}.pgqueue_workers (
    id                uuid PRIMARY KEY,
    host              text NOT NULL,
    pid               integer NOT NULL,
    queues            text[],
    concurrency       integer NOT NULL,
    started_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stale_writes      bigint NOT NULL DEFAULT 0
);

-- One NOTIFY per statement and queue, never per row: a 10,000-row COPY wakes workers once. The
-- payload is the queue name only (never arguments); queues of any length share one channel.
CREATE FUNCTION {schema}.pgqueue_notify_ready() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    FOR q IN SELECT DISTINCT n.queue FROM new_rows n
             WHERE n.status IN ('queued', 'retrying') AND n.run_at <= now()
    LOOP
        PERFORM pg_notify({channel}, q);
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE TRIGGER pgqueue_jobs_notify_ready
    AFTER INSERT ON {schema}.pgqueue_jobs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.pgqueue_notify_ready();
