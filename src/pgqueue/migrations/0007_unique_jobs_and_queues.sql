-- pgqueue schema, version 7: unique jobs, and a row per queue for operator state (pause).
-- Placeholders as in 0001: {schema} is the quoted schema identifier; literal braces are doubled.

-- A unique job carries its key (task name, ':', then the caller's key or a hash of the
-- arguments) and the rule for how long the key holds: unique_while 'waiting' (queued or
-- retrying) or 'active' (also while running), and unique_for seconds after success (NULL:
-- not after success). A key is checked against the existing row only when a second job with
-- that key is enqueued (insert_job), so no claim, ack or reap writes these columns: the hot
-- path is unchanged, and rows written by workers of an older release obey the same rule. No
-- CHECK clauses: checking existing rows would scan the table (the producer validates).
ALTER TABLE {schema}.pgqueue_jobs
    ADD COLUMN unique_key text,
    ADD COLUMN unique_while text,
    ADD COLUMN unique_for float8;

-- Operator state per queue. A queue has a row only once someone paused it (or, later, limited
-- it); queues without a row run as before. Workers read paused queues inside the claim.
CREATE TABLE {schema}.pgqueue_queues (
    name       text PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 128),
    paused     boolean NOT NULL DEFAULT false,
    paused_at  timestamptz,
    updated_at timestamptz NOT NULL DEFAULT now()
);
