"""Durations, counts and timestamps as the detail page writes them (the dashboard's script has
the same rules for the live panels)."""

from __future__ import annotations

from datetime import UTC, datetime


def duration(seconds: float) -> str:
    """``420`` → ``"7m 00s"``: the largest two units, like the live panels."""
    a = abs(seconds)
    if a < 1:
        return f"{a * 1000:.0f} ms"
    if a < 60:
        return f"{a:.1f} s" if a < 10 else f"{a:.0f} s"
    if a < 3600:
        return f"{int(a // 60)}m {int(a % 60):02d}s"
    if a < 86400:
        return f"{int(a // 3600)}h {int(a % 3600 // 60):02d}m"
    return f"{int(a // 86400)}d {int(a % 86400 // 3600)}h"


def relative(at: datetime | None, now: datetime) -> str:
    """``"3m 10s ago"`` or ``"in 5 s"``, against the database clock."""
    if at is None:
        return ""
    delta = (at - now).total_seconds()
    return f"in {duration(delta)}" if delta > 0 else f"{duration(delta)} ago"


def timestamp(at: datetime | None) -> str:
    """UTC to the millisecond: the page is read next to logs."""
    if at is None:
        return ""
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")
