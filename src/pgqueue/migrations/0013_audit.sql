-- pgqueue schema, version 13: an audit log of operators' bulk actions.
-- Placeholders as in 0001: {schema} is the quoted schema identifier; literal braces are doubled.

-- One row per bulk action (`pgqueue requeue|cancel|purge` by filter, and their Python twins),
-- written when it starts and brought up to date by each batch in that batch's transaction, so
-- an interrupted action says how far it got. Dry runs are recorded too.
CREATE TABLE {schema}.pgqueue_audit (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    actor       text NOT NULL,
    action      text NOT NULL,
    filter      jsonb NOT NULL,
    dry_run     boolean NOT NULL DEFAULT false,
    matched     bigint NOT NULL DEFAULT 0,
    finished_at timestamptz
);
