"""The table `make chaos` prints (Markdown, so it can be pasted into docs/guarantees.md)."""

from __future__ import annotations

from tests.chaos.checker import Result

HEADER = (
    "| scenario | jobs | faults | lost | duplicate effects | duplicate executions "
    "| zombie attempts | stale writes rejected / accepted | limited jobs (starts at a limit) "
    "| limit violations | slots leaked | duplicate unique jobs "
    "| rate exceeded (claims' / start clock) "
    "| recovery p50 / p95 / max | result |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
)


def row(result: Result) -> str:
    verdict = "pass" if result.passed else "FAIL: " + ", ".join(result.failures)
    return (
        f"| {result.scenario} | {result.jobs:,} | {result.faults} | {result.lost} "
        f"| {result.duplicate_effects} | {result.duplicate_executions} "
        f"| {result.zombie_attempts} | {result.stale_rejected} / {result.stale_accepted} "
        f"| {result.limited_jobs:,} ({result.at_limit:,}) | {result.limit_violations} "
        f"| {result.slots_leaked} | {result.duplicate_unique} "
        f"| {result.rate_exceeded[0]} / {result.rate_exceeded[1]} "
        f"| {result.recovery_summary()} | {verdict} |"
    )
