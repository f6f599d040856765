-- pgqueue schema, version 2: periodic (cron) schedules.
-- Placeholders as in 0001: {schema} is the quoted schema identifier; literal braces are doubled.

CREATE TABLE {schema}.pgqueue_schedules (
    name         text PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 256),
    -- As declared (five or six fields, or an @alias), always read as UTC.
    cron         text NOT NULL,
    task         text NOT NULL,
    queue        text NOT NULL,
    args         jsonb NOT NULL DEFAULT '{{}}',
    priority     integer NOT NULL DEFAULT 0,
    max_attempts integer NOT NULL DEFAULT 5 CHECK (max_attempts >= 1),
    -- The next scheduled tick; "due" means next_run_at <= now() on the database clock.
    next_run_at  timestamptz NOT NULL,
    -- The most recent tick that was fired (its scheduled time), and the job made for it.
    last_run_at  timestamptz,
    last_job_id  bigint,
    -- Declared by the code of the last worker that started; false once no longer declared.
    enabled      boolean NOT NULL DEFAULT true,
    -- Operator pause (`pgqueue schedules pause`); workers never change it.
    paused       boolean NOT NULL DEFAULT false,
    -- Missed-tick policy: 'latest' fires the newest missed tick once, 'all' every missed tick
    -- up to max_catchup of the most recent ones.
    missed       text NOT NULL DEFAULT 'latest' CHECK (missed IN ('latest', 'all')),
    max_catchup  integer NOT NULL DEFAULT 100 CHECK (max_catchup >= 1),
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

-- The scheduler's question, "which schedules are due?", is a range scan over live schedules.
CREATE INDEX pgqueue_schedules_due_idx ON {schema}.pgqueue_schedules (next_run_at)
    WHERE enabled AND NOT paused;

ALTER TABLE {schema}.pgqueue_jobs
    ADD COLUMN schedule_name text,
    ADD COLUMN schedule_tick timestamptz;

-- The exactly-once backstop: one job per (schedule, tick), whatever raced. Scheduler inserts use
-- ON CONFLICT DO NOTHING against this index.
CREATE UNIQUE INDEX pgqueue_jobs_schedule_tick_idx
    ON {schema}.pgqueue_jobs (schedule_name, schedule_tick)
    WHERE schedule_name IS NOT NULL;
