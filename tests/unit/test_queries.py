"""The statements as the worker sends them: short enough for psycopg to cache their conversion."""

from __future__ import annotations

import dataclasses

from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

from pgqueue.sql import queries


def test_every_statement_fits_psycopgs_query_cache() -> None:
    """psycopg converts a statement's ``%(name)s`` placeholders at every execution unless the
    text is at most 4 KB; the claim's comments once took it past that and cost the worker ~1 us
    of CPU per job. Comments document queries.sql and are not sent."""
    q = queries("a_schema_name_as_long_as_a_user_might_choose")
    sizes = {
        field.name: len(value)
        for field in dataclasses.fields(q)
        if isinstance(value := getattr(q, field.name), bytes)
    }
    assert sizes and max(sizes.values()) <= MAX_CACHED_STATEMENT_LENGTH, sizes
    assert not any(b"\n--" in getattr(q, name) for name in sizes)
