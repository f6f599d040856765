-- pgqueue schema, version 3: per-second aggregates for the dashboard and /metrics.
-- Placeholders: {schema} is the quoted schema identifier. Literal braces are doubled.

-- One row per worker, queue and second with anything to report, written by one INSERT per worker
-- per flush (never per job). No primary key: a worker that flushes twice in one second simply
-- writes two rows, and readers sum them. Histograms are sparse jsonb objects {{"bin": count}}
-- over the log-spaced bins of pgqueue.stats (4 per doubling, about +-9 % relative error).
CREATE TABLE {schema}.pgqueue_stats (
    bucket      timestamptz NOT NULL,
    worker_id   uuid NOT NULL,
    queue       text NOT NULL,
    succeeded   integer NOT NULL DEFAULT 0,
    retried     integer NOT NULL DEFAULT 0,
    dead        integer NOT NULL DEFAULT 0,
    lost        integer NOT NULL DEFAULT 0,
    pickup_hist jsonb NOT NULL DEFAULT '{{}}',
    run_hist    jsonb NOT NULL DEFAULT '{{}}'
);

-- The dashboard reads the last two minutes and pruning drops the oldest: both range scans.
CREATE INDEX pgqueue_stats_bucket_idx ON {schema}.pgqueue_stats (bucket);

-- Queue depth once per second, written by whichever worker gets there first (the primary key
-- makes the others' inserts no-ops).
CREATE TABLE {schema}.pgqueue_depth (
    bucket   timestamptz NOT NULL,
    queue    text NOT NULL,
    queued   integer NOT NULL,
    retrying integer NOT NULL,
    running  integer NOT NULL,
    PRIMARY KEY (bucket, queue)
);

-- The problems panel: dead and retrying jobs are few, but a scan for them through the finished or
-- ready indexes would wade through every succeeded or queued row. These partial indexes only hold
-- rows in those states, and status, run_at and finished_at are already indexed columns, so they
-- change no update from HOT to non-HOT and cost nothing on the hot path of successful jobs.
CREATE INDEX pgqueue_jobs_dead_idx ON {schema}.pgqueue_jobs (finished_at)
    WHERE status = 'dead';
CREATE INDEX pgqueue_jobs_retrying_idx ON {schema}.pgqueue_jobs (run_at)
    WHERE status = 'retrying';
