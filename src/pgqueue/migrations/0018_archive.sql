-- pgqueue schema, version 18: an archive for teams that keep the history of finished jobs.
-- Placeholders as in 0001: {schema} is the quoted schema identifier; literal braces are doubled.

-- Workers started with archive=True move finished jobs past their retention here in batches
-- (archive_finished_jobs: one statement deletes them from pgqueue_jobs and inserts them here), so
-- the table that claims and acks write stays small while the history is kept. Partitioned by
-- the day the job finished (UTC): expiring a day is a DROP of its partition, with no dead rows
-- left for vacuum. Only the parent is created here; workers create each day's partition ahead
-- and drop those older than archive_retention (pgqueue_archive_partitions below). No primary
-- key: it would have to include finished_at. A job is in pgqueue_jobs or here, never both (it
-- moves in one transaction); attempt_history holds its pgqueue_attempts rows, moved with it.
CREATE TABLE {schema}.pgqueue_jobs_archive (
    id              bigint NOT NULL,
    queue           text NOT NULL,
    task            text NOT NULL,
    args            jsonb NOT NULL,
    priority        integer NOT NULL,
    run_at          timestamptz NOT NULL,
    status          text NOT NULL,
    attempts        integer NOT NULL,
    max_attempts    integer NOT NULL,
    last_error      text,
    result          jsonb,
    created_at      timestamptz NOT NULL,
    claimed_at      timestamptz,
    started_at      timestamptz,
    finished_at     timestamptz NOT NULL,
    schedule_name   text,
    schedule_tick   timestamptz,
    unique_key      text,
    meta            jsonb,
    progress        jsonb,
    archived_at     timestamptz NOT NULL DEFAULT now(),
    attempt_history jsonb
) PARTITION BY RANGE (finished_at);

-- A job looked up by id (App.get_job, results, the dashboard's job page) that is no longer in
-- pgqueue_jobs: one probe per partition.
CREATE INDEX pgqueue_jobs_archive_id_idx ON {schema}.pgqueue_jobs_archive (id);

-- Creates a partition for every UTC day from the oldest job still in pgqueue_jobs that may move
-- (succeeded or cancelled, and dead ones if with_dead; or today) to the day after tomorrow, so a move never finds its day missing, and drops the
-- partitions whose whole day is older than keep_seconds (NULL keeps them). Days come from the
-- database clock. Partition names are pgqueue_jobs_archive_YYYYMMDD, quoted by format('%I'); the
-- advisory lock keeps two workers' reapers from creating the same partition at once. Returns
-- the number of partitions created and dropped. Never touches pgqueue_jobs beyond one read of
-- the finished and dead indexes: claims and acks never wait for it.
CREATE FUNCTION {schema}.pgqueue_archive_partitions(keep_seconds float8, with_dead boolean)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    first_day date;
    day date;
    part record;
    changed integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('pgqueue.archive:' || '{schema}'));
    -- A DROP waits for readers of the archive (a dashboard page) and would queue the moves
    -- behind it: give up after a second instead, and try again next round.
    PERFORM set_config('lock_timeout', '1s', true);
    -- Two index reads (pgqueue_jobs_finished_idx, pgqueue_jobs_dead_idx): dead jobs kept for
    -- good must not make a partition for every day since the oldest of them.
    SELECT (least((SELECT min(finished_at) FROM {schema}.pgqueue_jobs
                   WHERE status IN ('succeeded', 'cancelled')),
                  (SELECT min(finished_at) FROM {schema}.pgqueue_jobs
                   WHERE status = 'dead' AND with_dead)) AT TIME ZONE 'UTC')::date
    INTO first_day;
    first_day := least(COALESCE(first_day, today), today);
    IF keep_seconds IS NOT NULL THEN
        -- Rows finished before the kept window would land in a partition dropped next round.
        first_day := greatest(first_day, ((now() - make_interval(secs => keep_seconds))
                                          AT TIME ZONE 'UTC')::date);
    END IF;
    day := first_day;
    WHILE day <= today + 2 LOOP
        IF to_regclass(format('{schema}.%I', 'pgqueue_jobs_archive_' || to_char(day, 'YYYYMMDD')))
           IS NULL THEN
            EXECUTE format(
                'CREATE TABLE {schema}.%I PARTITION OF {schema}.pgqueue_jobs_archive '
                'FOR VALUES FROM (%L) TO (%L)',
                'pgqueue_jobs_archive_' || to_char(day, 'YYYYMMDD'),
                day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
            changed := changed + 1;
        END IF;
        day := day + 1;
    END LOOP;
    IF keep_seconds IS NOT NULL THEN
        FOR part IN
            SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
            WHERE i.inhparent = '{schema}.pgqueue_jobs_archive'::regclass
              AND c.relname ~ '^pgqueue_jobs_archive_[0-9]{{8}}$'
              AND (to_date(right(c.relname, 8), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC'
                  <= now() - make_interval(secs => keep_seconds)
        LOOP
            EXECUTE format('DROP TABLE {schema}.%I', part.relname);
            changed := changed + 1;
        END LOOP;
    END IF;
    RETURN changed;
END;
$$;

-- Roles that may read the jobs (the dashboard's SELECT-only role) may read archived ones.
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
        EXECUTE format('GRANT SELECT ON {schema}.pgqueue_jobs_archive TO %I', r.grantee);
    END LOOP;
END;
$$;
