"""The table `make chaos` prints (Markdown, so it can be pasted into docs/guarantees.md)."""

from __future__ import annotations

from tests.chaos.checker import Result

HEADER = (
    "| scenario | jobs | faults | lost | duplicate effects | duplicate executions "
    "| zombie attempts | stale writes rejected / accepted | duplicate unique jobs "
    "| recovery p50 / p95 / max | result |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
)


def row(result: Result) -> str:
    verdict = "pass" if result.passed else "FAIL: " + ", ".join(result.failures)
    return (
        f"| {result.scenario} | {result.jobs:,} | {result.faults} | {result.lost} "
        f"| {result.duplicate_effects} | {result.duplicate_executions} "
        f"| {result.zombie_attempts} | {result.stale_rejected} / {result.stale_accepted} "
        f"| {result.duplicate_unique} | {result.recovery_summary()} "
        f"| {verdict} |"
    )
