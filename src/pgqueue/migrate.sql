-- The statements of pgqueue.migrate, by name: the runner around the migration files.
-- {schema} is the quoted schema; values are always %(name)s parameters.

-- name: try_lock_migrations
-- Session-scoped, not transaction-scoped: a run spans one transaction per migration (and
-- statements outside any), and two migrators must not interleave. Tried, never waited for: a
-- statement waiting for the lock holds a snapshot, which the holder's CREATE INDEX CONCURRENTLY
-- waits for in turn (a deadlock). Same key as the transaction-scoped lock of earlier releases,
-- so an old and a new `pgqueue migrate` still serialise.
SELECT pg_try_advisory_lock(hashtextextended('pgqueue.migrate:' || %(schema)s, 0))

-- name: unlock_migrations
SELECT pg_advisory_unlock(hashtextextended('pgqueue.migrate:' || %(schema)s, 0))

-- name: migration_lock_holder
-- Who holds the migration lock: a bigint advisory key is stored as classid (high half) and objid
-- (low half) with objsubid 1; the shift wraps like the key's own sign bit.
SELECT a.pid, coalesce(a.state, ''), extract(epoch FROM now() - a.backend_start)::float8,
       coalesce(a.application_name, ''), coalesce(a.query, '')
FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint)
      = hashtextextended('pgqueue.migrate:' || %(schema)s, 0)

-- name: lock_holders
-- Who kept a migration step from its locks: sessions of this database whose transaction began
-- before the step's wait did (a session that began later cannot have blocked all of it) and
-- that hold a lock on one of the schema's tables, or, for a concurrent index build (which also
-- waits for older snapshots), any snapshot at all. Oldest first.
SELECT a.pid, coalesce(a.state, ''), extract(epoch FROM now() - a.xact_start)::float8,
       coalesce(a.application_name, ''), coalesce(a.query, '')
FROM pg_stat_activity a
WHERE a.pid <> pg_backend_pid()
  AND a.datname = current_database()
  AND a.xact_start <= now() - make_interval(secs => %(waited)s)
  AND (EXISTS (SELECT 1
               FROM pg_locks l
               JOIN pg_class c ON c.oid = l.relation
               JOIN pg_namespace n ON n.oid = c.relnamespace
               WHERE l.pid = a.pid AND l.granted AND l.locktype = 'relation'
                 AND n.nspname = %(schema_name)s)
       OR (%(snapshots)s AND a.backend_xmin IS NOT NULL))
ORDER BY a.xact_start
LIMIT 3

-- name: set_lock_timeout
-- set_config rather than SET, so that the value is a parameter; local = only until the
-- transaction ends, otherwise for the session (statements that cannot run in a transaction).
SELECT set_config('lock_timeout', %(value)s, %(local)s)

-- name: current_lock_timeout
SELECT current_setting('lock_timeout')

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS {schema}.pgqueue_migrations (
    version integer PRIMARY KEY, name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now())

-- name: applied_migrations
SELECT version FROM {schema}.pgqueue_migrations ORDER BY version

-- name: record_migration
-- In the migration's own transaction when it has one, so a version is recorded exactly when its
-- changes commit.
INSERT INTO {schema}.pgqueue_migrations (version, name) VALUES (%(version)s, %(name)s)

-- name: index_is_invalid
-- An interrupted CREATE INDEX CONCURRENTLY leaves its index behind, invalid (or not even ready):
-- IF NOT EXISTS would keep it, so the runner drops and rebuilds it.
SELECT NOT (i.indisvalid AND i.indisready)
FROM pg_index i
JOIN pg_class c ON c.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema_name)s AND c.relname = %(index)s

-- name: drop_index
-- CONCURRENTLY: like the build, it never blocks enqueues, claims or acks.
DROP INDEX CONCURRENTLY IF EXISTS {schema}.{index}
