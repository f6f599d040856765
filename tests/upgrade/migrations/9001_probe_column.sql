-- Test-only: a new nullable column on the hot table, as a future release might add. Without a
-- default (or with a constant one) this changes only the catalog: no rewrite, but an ACCESS
-- EXCLUSIVE lock, which every enqueue, claim and ack queues behind while it waits.
ALTER TABLE {schema}.pgqueue_jobs ADD COLUMN upgrade_probe text;
