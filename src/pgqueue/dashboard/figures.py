"""The dashboard's figures from query rows: pure functions, unit-tested without a database.

Windows: charts cover the last ``WINDOW`` (120) whole seconds of the database clock; the
throughput tile averages the last ``RATE_WINDOW`` (10) settled seconds; the retry, failure and
percentile tiles cover the last 60 seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .. import stats
from .why import queue_reasons

WINDOW = 120
RATE_WINDOW = 10
#: A second is "settled" two seconds after it ends: workers flush once per second.
SETTLE = 2


def seconds(end: int, window: int = WINDOW) -> list[int]:
    """The chart's x values: the ``window`` whole seconds up to and including ``end``."""
    return list(range(end - window + 1, end + 1))


def throughput(rows: Iterable[Sequence[Any]], end: int) -> dict[str, Any]:
    """Per-second finished attempts: succeeded, and failed (retried + dead) stacked on it. The
    retry and failure tiles count every second of the last 60, unsettled ones included."""
    by_second = {int(r[0]): (int(r[1]), int(r[2]) + int(r[3]), int(r[2]), int(r[3])) for r in rows}
    xs = seconds(end)
    succeeded = [by_second.get(t, (0, 0, 0, 0))[0] for t in xs]
    failed = [by_second.get(t, (0, 0, 0, 0))[1] for t in xs]
    last60 = [by_second[t] for t in xs[-60:] if t in by_second]
    settled = xs[-RATE_WINDOW - SETTLE : -SETTLE]
    finished = sum(by_second.get(t, (0, 0, 0, 0))[0] + by_second.get(t, (0, 0, 0, 0))[1]
                   for t in settled)  # fmt: skip
    return {
        "t": xs,
        "succeeded": succeeded,
        "failed": failed,
        # Seconds after this one may still grow (a worker's flush in flight): the chart leaves
        # them out rather than show a drop to zero at its right edge.
        "settled_until": end - SETTLE,
        "rate": finished / RATE_WINDOW,
        "retries_60s": sum(v[2] for v in last60),
        "failed_60s": sum(v[3] for v in last60),
    }


def histograms(rows: Iterable[Sequence[Any]]) -> dict[str, dict[int, int]]:
    merged: dict[str, dict[int, int]] = {"pickup": {}, "run": {}}
    for kind, index, count in rows:
        stats.merge(merged[str(kind)], {int(index): int(count)})
    return merged


def latency(hists: Mapping[str, Mapping[int, int]]) -> dict[str, float | None]:
    return {
        "pickup_p50": stats.percentile(hists["pickup"], 0.50),
        "pickup_p95": stats.percentile(hists["pickup"], 0.95),
        "run_p50": stats.percentile(hists["run"], 0.50),
        "run_p95": stats.percentile(hists["run"], 0.95),
    }


def depth_counts(rows: Iterable[Sequence[Any]]) -> dict[str, dict[str, int]]:
    """{queue: {queued, retrying, running}} from (queue, queued, retrying, running) rows."""
    return {
        str(queue): {"queued": int(queued), "retrying": int(retrying), "running": int(running)}
        for queue, queued, retrying, running in rows
    }


def with_running(
    depth: dict[str, dict[str, int]], running: Iterable[Sequence[Any]]
) -> dict[str, dict[str, int]]:
    """Replace the sampled running counts with live (queue, count) rows; queues that only run
    jobs appear, queues with nothing left disappear."""
    live = {str(queue): int(count) for queue, count in running}
    merged = {q: {**c, "running": live.get(q, 0)} for q, c in depth.items()}
    for queue, count in live.items():
        merged.setdefault(queue, {"queued": 0, "retrying": 0, "running": count})
    return {q: c for q, c in sorted(merged.items()) if any(c.values())}


def depth_series(
    sampled: Iterable[Sequence[Any]],
    observed: Mapping[int, Mapping[str, int]],
    end: int,
    rows_per_second: int = stats.DEPTH_ROWS_PER_SECOND,
    sampling: Iterable[tuple[float, float]] = (),
) -> dict[str, Any]:
    """Waiting jobs per queue per second, None where nobody knows. Workers' samples (shared,
    survive restarts) win; the seconds they miss are filled from what this dashboard observed
    itself, else from the last sample of a deep backlog, which is taken less often and stands
    for the seconds it holds (``stats.depth_holds``). A second with no sample while a worker was
    running (``sampling``: its (first, last) seconds) had nothing waiting: a running worker
    samples every second and writes no row for an empty queue. Any other second is unknown (no
    worker, and the dashboard was not watching): a gap on the chart, never a made-up 0."""
    by_second: dict[int, dict[str, int]] = {}
    for second, queue, waiting, _running in sampled:
        by_second.setdefault(int(second), {})[str(queue)] = int(waiting)
    held: dict[int, dict[str, int]] = {}
    for second, counts in sorted(by_second.items()):
        holds = stats.depth_holds(sum(counts.values()), rows_per_second)
        if holds > 1:
            for t in range(second + 1, second + holds + 1):
                held[t] = counts
    spans = list(sampling)
    xs = seconds(end)
    known: dict[int, dict[str, int]] = {}
    for t in xs:
        if t in by_second:
            known[t] = by_second[t]
        elif t in observed or t in held:
            known[t] = dict(observed[t] if t in observed else held[t])
        # A worker's sample for the last seconds may still be on its way: unknown, not 0.
        elif t <= end - SETTLE and any(first <= t <= last for first, last in spans):
            known[t] = {}
    names = sorted({q for counts in known.values() for q in counts})
    series = {q: [known[t].get(q, 0) if t in known else None for t in xs] for q in names}
    # A queue that never had anything waiting in the window is noise on the chart.
    series = {q: v for q, v in series.items() if any(v)}
    return {"t": xs, "queues": series}


def worker_row(row: Sequence[Any], late_after: float) -> dict[str, Any]:
    age = float(row[6])
    lease = float(row[9]) if len(row) > 9 and row[9] is not None else None
    lease_left = float(row[10]) if len(row) > 10 and row[10] is not None else None
    tasks = row[11] if len(row) > 11 else None
    return {
        "id": row[0],
        "host": row[1],
        "pid": int(row[2]),
        "queues": list(row[3]) if row[3] is not None else None,
        "concurrency": int(row[4]),
        "uptime": float(row[5]),
        "heartbeat_age": age,
        "stale_writes": int(row[7]),
        "leases": int(row[8]),
        "late": age > late_after,
        "lease": lease,
        # The tasks its code has (None: not recorded, a worker from before migration 0017).
        "tasks": list(tasks) if tasks is not None else None,
        # What a claim needs (queries.sql, job_why): a recent heartbeat and a lease in force.
        "live": age <= late_after and (lease_left is None or lease_left > 0),
    }


def serves(worker: Mapping[str, Any], queue: str) -> bool:
    """A worker with no queue list serves every queue."""
    return worker["queues"] is None or queue in worker["queues"]


def queue_table(
    depth: Mapping[str, Mapping[str, int]],
    *,
    dead: Mapping[str, int],
    finished: Mapping[str, int],
    pickup: Mapping[str, Mapping[int, int]],
    heads: Mapping[str, float],
    settings: Mapping[str, Any],
    workers: Sequence[Mapping[str, Any]],
    head_tasks: Mapping[str, Sequence[str]] | None = None,
) -> list[dict[str, Any]]:
    """One row per queue that has jobs, dead jobs, recent throughput or an operator's setting.
    ``oldest`` is how long its oldest due job has waited (negative: none is due yet, the next
    is due in that long); ``workers`` are the live workers that serve it (their ids);
    ``head_tasks`` the tasks of each queue's due heads (queries.sql, queue_heads)."""
    names = sorted(set(depth) | set(dead) | set(finished) | set(settings))
    rows = []
    for q in names:
        counts = depth.get(q, {})
        queued, retrying = counts.get("queued", 0), counts.get("retrying", 0)
        running = counts.get("running", 0)
        setting = settings.get(q)
        serving = [w for w in workers if w["live"] and serves(w, q)]
        oldest = heads.get(q) if queued + retrying else None
        row: dict[str, Any] = {
            "queue": q,
            "queued": queued,
            "retrying": retrying,
            "running": running,
            "dead": dead.get(q, 0),
            "rate": finished.get(q, 0) / RATE_WINDOW,
            "pickup_p95": stats.percentile(dict(pickup.get(q, {})), 0.95),
            "oldest": oldest,
            "workers": [w["id"] for w in serving],
            "paused": bool(setting and setting.paused),
            "limit": setting.limit if setting else None,
            "rate_limit": setting.rate if setting else None,
            "rate_period": setting.period if setting else None,
            "rate_used": setting.used[0] if setting and setting.used else None,
            "why": None,
        }
        # The reason matters where jobs wait and none of the queue's runs.
        if queued + retrying and not running:
            reason = queue_reasons(
                live=sum(1 for w in workers if w["live"]),
                live_queues=sorted({n for w in workers if w["live"] for n in w["queues"] or ()}),
                serving=[(w["leases"], w["concurrency"]) for w in serving],
                due_in=-oldest if oldest is not None else None,
                unknown_tasks=unknown_tasks(serving, (head_tasks or {}).get(q, ())),
                setting=setting,
                running=running,
            )[0]
            row["why"] = {"code": reason.code, "text": reason.text}
        rows.append(row)
    return rows


def unknown_tasks(serving: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> list[str]:
    """``tasks`` (a queue's next jobs') when no worker in ``serving`` has any of them, else
    none: one it has would run. A worker whose tasks are not recorded counts as having all."""
    known: set[str] = set()
    for worker in serving:
        if worker.get("tasks") is None:
            return []
        known.update(worker["tasks"])
    return [] if known & set(tasks) else sorted(set(tasks))


def health(
    *,
    oldest_transaction: Sequence[Any] | None,
    hidden_sessions: int,
    tuples: tuple[int, int, float | None] | None,
    workers: Sequence[Mapping[str, Any]],
    dead_tuple_ratio: float,
    dead_tuple_minimum: int,
    late_after: float,
) -> dict[str, Any]:
    """The warnings strip: the oldest transaction holding back vacuum (already past its
    threshold in SQL), the jobs table's dead rows past theirs, and workers that missed a
    heartbeat. Workers do not record their heartbeat interval; its default is a third of the
    lease they record, so a worker is behind when its last heartbeat is two of those old (a
    worker without a lease: past ``late_after``)."""
    transaction = None
    if oldest_transaction is not None:
        pid, app, state, age, query_age, query, xmin_age = oldest_transaction
        transaction = {
            "pid": int(pid), "application_name": app, "state": state, "age": age,
            "query_age": query_age, "query": query,
            "xmin_age": int(xmin_age) if xmin_age is not None else None,
        }  # fmt: skip
    dead_rows = None
    if tuples is not None:
        live, dead, vacuumed = tuples
        if dead >= dead_tuple_minimum and dead > dead_tuple_ratio * live:
            dead_rows = {"live": live, "dead": dead, "vacuumed_ago": vacuumed}
    behind = []
    for w in workers:
        due = 2 * w["lease"] / 3 if w.get("lease") else late_after
        if w["heartbeat_age"] > due:
            behind.append({"id": w["id"], "host": w["host"], "pid": w["pid"],
                           "heartbeat_age": w["heartbeat_age"],
                           "interval": w["lease"] / 3 if w.get("lease") else None})  # fmt: skip
    return {
        "transaction": transaction,
        "dead_rows": dead_rows,
        "workers": behind,
        "hidden_sessions": hidden_sessions,
    }
