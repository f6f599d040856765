-- pgqueue schema, version 6: every schedule belongs to the app that declared it.
-- Placeholders as in 0001: {schema} is the quoted schema identifier; literal braces are doubled.

-- The owner is App(name=...). A worker's sync writes only rows of its own app and never disables
-- any: before this, a worker disabled every schedule its code did not declare, so two services
-- sharing a database (or two versions during a rolling deploy) switched each other's schedules
-- off. Rows from before this version belong to the default app, the name every App had.
-- `enabled` now means "not retired": a schedule stops firing only when its own app retires it
-- (`pgqueue schedules prune`, or app.retire_schedule at the next worker start).
ALTER TABLE {schema}.pgqueue_schedules
    ADD COLUMN app text NOT NULL DEFAULT 'default' CHECK (length(app) BETWEEN 1 AND 256);
