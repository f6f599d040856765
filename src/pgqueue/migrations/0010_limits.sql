-- pgqueue schema, version 10: concurrency limits and rates across every worker.
-- Placeholders as in 0001: {schema} is the quoted schema identifier; literal braces are doubled.

-- A job of a task declared with a limit or a rate carries its limit group's key: '' for a
-- limit over the whole task, the caller's key (limit_key=) for a limit per key. The producer
-- writes it at enqueue; claims that are not limited skip these jobs (limit_key IS NULL), and the
-- limited claim (claim_limited_jobs) finds them by group. The key is part of the job, so a
-- limit's value can change at run time while the grouping stays.
ALTER TABLE {schema}.pgqueue_jobs ADD COLUMN limit_key text;

-- A queue's limit and rate, changed at run time by an operator (`pgqueue queues limit`).
-- NULL: none. Jobs of a queue with either are claimed by the limited claim only.
ALTER TABLE {schema}.pgqueue_queues
    ADD COLUMN concurrency_limit integer CHECK (concurrency_limit >= 0),
    ADD COLUMN rate_limit integer CHECK (rate_limit >= 1),
    ADD COLUMN rate_period float8 CHECK (rate_period > 0);

-- A task's limit and rate, per key when per_key. Workers write the values their code declares
-- (@app.task(limit=, rate=, limit_key=)) unless an operator set them (`pgqueue tasks limit`:
-- overridden), so a change made at run time survives restarts until it is reset.
CREATE TABLE {schema}.pgqueue_tasks (
    name              text PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 256),
    concurrency_limit integer CHECK (concurrency_limit >= 0),
    rate_limit        integer CHECK (rate_limit >= 1),
    rate_period       float8 CHECK (rate_period > 0),
    per_key           boolean NOT NULL DEFAULT false,
    overridden        boolean NOT NULL DEFAULT false,
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- The starts of the last rate period per rate-limited group (named 'q:' and the queue, or 't:',
-- the task's length, ':', the task, ':' and the key: unambiguous whatever the names hold): one
-- entry per claim that started jobs (when, how many), pruned as entries leave the period. A sliding log, not a token
-- bucket: it holds "at most N starts in any window of the period" exactly, which a bucket that
-- starts full does not (it lets 2N through across a refill).
CREATE TABLE {schema}.pgqueue_rates (
    name       text PRIMARY KEY,
    period     float8 NOT NULL,
    times      timestamptz[] NOT NULL,
    counts     integer[] NOT NULL
);
