"""Migration files are read and checked before anything runs: a file that breaks the rules of
docs/reference/migrations.md fails at load time with a sentence that says how to fix it, not
half-way through an upgrade of a live database."""

from __future__ import annotations

import pytest

from pgqueue.migrate import Migration, MigrationError, _built_index, available, split_statements


def test_the_shipped_migrations_run_in_a_transaction_each_but_concurrent_index_builds() -> None:
    shipped = available()
    assert [m.version for m in shipped][:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [m.version for m in shipped if not m.transactional] == [8, 11]
    first = shipped[0].statements
    assert first[0].startswith("CREATE TYPE {schema}.pgqueue_status AS ENUM")
    assert first[-1].startswith("CREATE TRIGGER pgqueue_jobs_notify_ready")
    assert len(first) == 9  # the plpgsql body's semicolons stay inside its function


def test_a_header_directive_runs_a_file_outside_a_transaction() -> None:
    upgrade = {m.version: m for m in available("tests.upgrade")}
    assert upgrade[9001].transactional
    assert not upgrade[9002].transactional
    assert upgrade[9002].statements == (
        "CREATE INDEX CONCURRENTLY IF NOT EXISTS pgqueue_jobs_upgrade_probe_idx\n"
        "    ON {schema}.pgqueue_jobs (upgrade_probe)\n"
        "    WHERE upgrade_probe IS NOT NULL",
    )


def test_statements_split_only_at_semicolons_outside_quotes_and_comments() -> None:
    script = """
        -- a comment; with a semicolon
        SELECT 'it''s; one' AS a, E'back\\'slash;' AS b, "odd;name" FROM t;
        /* block; /* nested; */ still comment; */
        CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $body$
        BEGIN RETURN 1; END; $body$;
        SELECT $$a;b$$, x$y FROM t  ;
        ;
        -- trailing comment only
    """
    assert split_statements(script) == [
        "SELECT 'it''s; one' AS a, E'back\\'slash;' AS b, \"odd;name\" FROM t",
        "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $body$\n"
        "        BEGIN RETURN 1; END; $body$",
        "SELECT $$a;b$$, x$y FROM t",
    ]


def test_a_statement_without_a_final_semicolon_is_kept() -> None:
    assert split_statements("SELECT 1; SELECT 2") == ["SELECT 1", "SELECT 2"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS i ON {schema}.pgqueue_jobs (id);",
            "'CREATE INDEX CONCURRENTLY IF' cannot run inside a transaction: "
            "put '-- pgqueue: no-transaction' at the top of the file",
        ),
        (
            "-- pgqueue: no-transaction\nCREATE INDEX CONCURRENTLY i ON {schema}.pgqueue_jobs (id);",
            "must name its index and say IF NOT EXISTS, so that an interrupted run can be resumed",
        ),
        (
            "-- pgqueue: no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS ON t (id);",
            "must name its index and say IF NOT EXISTS",
        ),
        (
            "-- pgqueue: no-transaction\nDROP INDEX CONCURRENTLY {schema}.i;",
            "must say IF EXISTS, so that an interrupted run can be resumed",
        ),
        ("-- pgqueue: no-transacton\nSELECT 1;", "unknown directive 'no-transacton'"),
        (
            "SELECT 1;\n-- pgqueue: no-transaction\nSELECT 2;",
            "a '-- pgqueue:' directive must be in the comment lines at the top of the file",
        ),
        ("BEGIN;\nSELECT 1;\nCOMMIT;", "'BEGIN': leave transaction control out"),
        ("-- nothing but a comment\n", "has no statements"),
    ],
)
def test_a_file_that_breaks_the_rules_is_refused_at_load_time(text: str, message: str) -> None:
    with pytest.raises(MigrationError) as failure:
        Migration(7, "example", text)
    assert str(failure.value).startswith("migration 0007_example")
    assert message in str(failure.value)


@pytest.mark.parametrize(
    ("statement", "index"),
    [
        ("CREATE INDEX CONCURRENTLY IF NOT EXISTS Probe_Idx ON t (a)", "probe_idx"),
        ('CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS "Odd ""Name""" ON t (a)', 'Odd "Name"'),
        ("create index concurrently if not exists p_idx\n  on t (a)", "p_idx"),
        ("CREATE INDEX p_idx ON t (a)", None),
    ],
)
def test_the_index_of_a_concurrent_build_is_named_as_postgresql_names_it(
    statement: str, index: str | None
) -> None:
    """Unquoted names fold to lower case, quoted ones are kept: the name the runner looks up to
    find an invalid index left by an interrupted build."""
    assert _built_index(statement) == index
