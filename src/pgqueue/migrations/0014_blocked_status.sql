-- pgqueue schema, version 14: the 'blocked' status, for a job that waits for other jobs.
-- Placeholders as in 0001: {schema} is the quoted schema identifier.

-- A job enqueued with after=[...] is 'blocked' until its parents finish (migration 0015). It
-- is in no ready index, so claims never read it. Its own migration: a new enum value cannot be
-- used in the transaction that adds it.
ALTER TYPE {schema}.pgqueue_status ADD VALUE IF NOT EXISTS 'blocked'
