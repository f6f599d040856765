"""Plans of pgqueue's statements as PostgreSQL runs them, for tests that check their shape and
their cost: the executed plan (EXPLAIN ANALYZE, BUFFERS) of a server-side prepared statement."""

from __future__ import annotations

import json
import re
from typing import Any

import psycopg

Conn = psycopg.Connection[tuple[Any, ...]]


def explain(
    conn: Conn, statement: bytes, values: dict[str, Any], *, generic: bool = True
) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of ``statement`` prepared on the server and planned generically
    (as PostgreSQL runs a cached plan) or with its parameters' values (a custom plan), inside a
    transaction that is rolled back."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    text = re.sub(r"%\((\w+)\)[sb]", number, statement.decode())
    mode = "force_generic_plan" if generic else "force_custom_plan"
    with conn.transaction(force_rollback=True):
        conn.execute(f"SET LOCAL plan_cache_mode = {mode}".encode())
        conn.execute(f"PREPARE hot AS {text}".encode())
        try:
            # EXECUTE takes no bound parameters: a client-side cursor writes them in as literals.
            arguments = f"({', '.join(['%s'] * len(names))})" if names else ""
            cur = psycopg.ClientCursor(conn)
            cur.execute(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE hot{arguments}".encode(),
                [values[n] for n in names],
            )
            row = cur.fetchone()
        finally:
            conn.execute("DEALLOCATE hot")
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    return dict(plan[0]["Plan"])


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a plan, the root first (subplans and InitPlans included)."""
    found = [plan]
    for child in plan.get("Plans", []):
        found += nodes(child)
    return found


def buffers(plan: dict[str, Any]) -> int:
    """Shared buffers the whole execution touched (a node counts its children's)."""
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def claim_selection(plan: dict[str, Any]) -> dict[str, Any]:
    """The part of a claim's plan that finds and locks the jobs (the ``ARRAY(...)`` under the
    UPDATE), without the UPDATE's own writes."""
    (update,) = [n for n in nodes(plan) if n["Node Type"] == "ModifyTable"]
    (selection,) = [
        child
        for child in update.get("Plans", [])
        if child.get("Parent Relationship") == "InitPlan"
        and any(n["Node Type"] == "LockRows" for n in nodes(child))
    ]
    return dict(selection)


def without_paused_lookups(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a plan but its reads of pgqueue_queues and pgqueue_tasks, after checking
    that each of those is an InitPlan that ran at most once: the paused-queue filter and the
    limited tasks' list cost one lookup per statement, never one per row or per loop (see
    claim_jobs)."""
    found = []
    for node in nodes(plan):
        if node.get("Relation Name") in ("pgqueue_queues", "pgqueue_tasks"):
            assert node["Parent Relationship"] == "InitPlan", node
            assert node["Actual Loops"] <= 1, node
        else:
            found.append(node)
    return found
