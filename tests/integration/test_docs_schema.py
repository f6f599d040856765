"""docs/reference/schema.md against a freshly migrated database: every table, column (with its
type), index and enum value on the page exists, and the database has none the page omits."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "reference" / "schema.md").read_text()

Conn = psycopg.Connection[tuple[Any, ...]]


def documented() -> tuple[set[tuple[str, str, str]], set[tuple[str, str]]]:
    """(table, column, type) and (table, index) from the page's tables, by section."""
    columns: set[tuple[str, str, str]] = set()
    indexes: set[tuple[str, str]] = set()
    table = None
    for line in PAGE.splitlines():
        heading = re.match(r"^## (pgqueue_\w+)$", line)
        if heading:
            table = heading[1]
            continue
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if table is None or len(cells) < 3 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        if name.endswith(("_idx", "_pkey")):
            indexes.add((table, name))
        else:
            columns.add((table, name, cells[1]))
    return columns, indexes


def test_schema_page_matches_the_migrated_database(conn: Conn) -> None:
    columns = {
        (str(t), str(c), str(ty))
        for t, c, ty in conn.execute(
            "SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod)"
            " FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND NOT c.relispartition"
            "   AND c.relname LIKE 'pgqueue%'"
            "   AND a.attnum > 0 AND NOT a.attisdropped"
        ).fetchall()
    }
    indexes = {
        (str(t), str(i))
        for t, i in conn.execute(
            "SELECT tablename, indexname FROM pg_indexes"
            " WHERE schemaname = 'public' AND tablename LIKE 'pgqueue%'"
        ).fetchall()
    }
    doc_columns, doc_indexes = documented()
    assert doc_columns == columns, (
        f"on the page only: {sorted(doc_columns - columns)}; "
        f"in the database only: {sorted(columns - doc_columns)}"
    )
    assert doc_indexes == indexes, (
        f"on the page only: {sorted(doc_indexes - indexes)}; "
        f"in the database only: {sorted(indexes - doc_indexes)}"
    )


def test_schema_page_lists_every_status(conn: Conn) -> None:
    row = conn.execute("SELECT enum_range(NULL::pgqueue_status)::text[]").fetchone()
    assert row is not None
    types = PAGE[PAGE.index("## Types") : PAGE.index("## pgqueue_jobs")]
    assert re.findall(r"`(\w+)`", types.split("values", 1)[1]) == list(row[0])
