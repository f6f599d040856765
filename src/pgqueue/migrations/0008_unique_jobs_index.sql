-- pgqueue: no-transaction
-- pgqueue schema, version 8: the index that makes unique keys unique.
-- Placeholders as in 0001: {schema} is the quoted schema identifier.

-- One row per held key, enforced by PostgreSQL: insert_job's ON CONFLICT names this index, so
-- two producers racing with one key can never both insert. A key that no longer holds (its job
-- finished, or started while the rule was 'waiting') is cleared by the next insert that meets
-- it, in the same statement. Built concurrently: enqueues, claims and acks go on meanwhile.
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS pgqueue_jobs_unique_idx
    ON {schema}.pgqueue_jobs (unique_key)
    WHERE unique_key IS NOT NULL
