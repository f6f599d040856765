-- pgqueue schema, version 17: the tasks each worker's code has.
-- Placeholders as in 0001: {schema} is the quoted schema identifier.

-- Written by register_worker, so the dashboard can say a waiting job's task is unknown to every
-- live worker that serves its queue (a worker gives such jobs back unrun: fetcher.py). NULL for
-- a worker from before this version: its tasks are not known, so it counts as knowing all.
ALTER TABLE {schema}.pgqueue_workers ADD COLUMN tasks text[];
