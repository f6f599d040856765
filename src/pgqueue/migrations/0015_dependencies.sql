-- pgqueue schema, version 15: jobs that run after other jobs (after=, chains, groups).
-- Placeholders as in 0001: {schema} is the quoted schema identifier, {channel} the quoted NOTIFY
-- channel literal; literal braces are doubled.

-- has_children marks a parent, so that the trigger below costs nothing on the ack of a job
-- without children (its WHEN is false).
ALTER TABLE {schema}.pgqueue_jobs ADD COLUMN has_children boolean NOT NULL DEFAULT false;

-- One row per (parent, child); position orders a group's members for its callback's results.
CREATE TABLE {schema}.pgqueue_job_deps (
    parent_id bigint NOT NULL,
    child_id  bigint NOT NULL,
    position  integer NOT NULL,
    PRIMARY KEY (parent_id, child_id)
);
CREATE INDEX pgqueue_job_deps_child_idx ON {schema}.pgqueue_job_deps (child_id, position);

-- Roles that may read the jobs (the dashboard's SELECT-only role, docs/dashboard.md) may read
-- which job waits for which: the dashboard shows those counts, and an upgrade must not break it.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN SELECT DISTINCT grantee FROM information_schema.role_table_grants
             WHERE table_schema = (SELECT relnamespace::regnamespace::name FROM pg_class
                                   WHERE oid = '{schema}.pgqueue_jobs'::regclass)
                   AND table_name = 'pgqueue_jobs'
                   AND privilege_type = 'SELECT' AND grantee <> current_user
    LOOP
        EXECUTE format('GRANT SELECT ON {schema}.pgqueue_job_deps TO %I', r.grantee);
    END LOOP;
END;
$$;

-- A blocked child's count of unfinished parents, the first parent that ended dead or
-- cancelled, and what that does to it ('cancel', or 'run' anyway). Kept out of pgqueue_jobs:
-- a group's callback is counted down once per member (100,000 times for 100,000 members), and
-- a row on a dense page of the hot table updated that often leaves a chain of versions, and
-- index entries, that every later update walks. Here the row sits on a nearly empty page
-- (fillfactor 10), every decrement is a HOT update, and pruning keeps its chain short. The row
-- goes when the child is released.
CREATE TABLE {schema}.pgqueue_job_waits (
    child_id      bigint PRIMARY KEY,
    waiting       integer NOT NULL,
    failed_parent bigint,
    after_failure text NOT NULL DEFAULT 'cancel'
) WITH (fillfactor = 10);

-- A parent that finishes releases its children in the same transaction as its own ack (or
-- reap, or cancel): each child's count goes down, a child with nothing left to wait for becomes
-- 'queued' (due at once, workers notified), and a child whose parent ended dead or cancelled
-- is cancelled right away unless it asked to run anyway. A cancelled child that is a parent
-- fires this trigger in turn: cancellation is transitive. Counters are updated in child id
-- order, so two parents' acks that share children do not deadlock over them.
CREATE FUNCTION {schema}.pgqueue_release_children() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    failed boolean := NEW.status::text <> 'succeeded';
    due bigint[];
    q text;
BEGIN
    -- One statement in the common case (a child with parents left): count down, and find the
    -- children with nothing left to wait for or condemned by a failed parent.
    WITH counted AS (
        UPDATE {schema}.pgqueue_job_waits w
        SET waiting = w.waiting - 1,
            failed_parent = CASE WHEN failed THEN COALESCE(w.failed_parent, NEW.id)
                                 ELSE w.failed_parent END
        FROM (SELECT d.child_id FROM {schema}.pgqueue_job_deps d
              WHERE d.parent_id = NEW.id ORDER BY d.child_id) d
        WHERE w.child_id = d.child_id
        RETURNING w.child_id, w.waiting, w.failed_parent, w.after_failure
    )
    SELECT array_agg(child_id ORDER BY child_id) INTO due FROM counted
    WHERE waiting <= 0 OR (failed_parent IS NOT NULL AND after_failure <> 'run');
    IF due IS NULL THEN
        RETURN NULL;
    END IF;
    FOR q IN
        WITH gone AS (
            DELETE FROM {schema}.pgqueue_job_waits w WHERE w.child_id = ANY(due)
            RETURNING w.child_id, w.failed_parent, w.after_failure
        ), released AS (
            UPDATE {schema}.pgqueue_jobs c
            SET status = CASE WHEN r.failed_parent IS NOT NULL AND r.after_failure <> 'run'
                              THEN 'cancelled' ELSE 'queued' END::{schema}.pgqueue_status,
                finished_at = CASE WHEN r.failed_parent IS NOT NULL AND r.after_failure <> 'run'
                                   THEN now() END,
                last_error = CASE WHEN r.failed_parent IS NOT NULL AND r.after_failure <> 'run'
                                  THEN 'ParentFailed: job ' || r.failed_parent
                                       || ', which this job runs after, ended '
                                       || NEW.status::text || ' (or one before it did)'
                                  ELSE c.last_error END,
                run_at = greatest(c.run_at, now())
            FROM gone r
            WHERE c.id = r.child_id AND c.status = 'blocked'
            RETURNING c.queue, c.status
        )
        SELECT DISTINCT r.queue FROM released r WHERE r.status = 'queued'
    LOOP
        -- Always, not only while some worker waits (as the insert trigger does): the worker
        -- whose ack released them is busy, asks for no notification, and would otherwise leave
        -- them to its poll. Only releases notify, never the count-downs.
        PERFORM pg_notify({channel}, q);
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE TRIGGER pgqueue_jobs_release_children
AFTER UPDATE OF status ON {schema}.pgqueue_jobs
FOR EACH ROW
WHEN (NEW.has_children AND OLD.status IS DISTINCT FROM NEW.status
      AND NEW.status::text IN ('succeeded', 'dead', 'cancelled'))
EXECUTE FUNCTION {schema}.pgqueue_release_children();
