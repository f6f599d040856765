"""Queues routed to independent PostgreSQL clusters: ``App(dsn, routes={queue: dsn})``.

Each cluster is a complete pgqueue (its schema, workers, schedules, dashboard); a routed queue
lives on its route's cluster and every other queue on the app's own DSN, the default cluster.
The app keeps one member ``App`` per routed DSN (``app.cluster(queue)``) that shares its tasks,
hooks and schedules and has connections of its own. Whatever names a queue (every enqueue, a
pause, a limit, a worker's ``queues``) goes to that queue's cluster; nothing spans two of them.

Job ids repeat across clusters (each has its own sequence), so an id alone does not say where
its job is: an ``Enqueued`` remembers the queue it was enqueued into, and a call given a plain
id on an app with routes needs ``queue=`` rather than guess and act on another cluster's job
(docs/operating-at-scale.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from . import db, producer
from .errors import ConfigurationError, InvalidJobError
from .jobs import Enqueued

if TYPE_CHECKING:
    from .app import App


def check_routes(routes: object) -> dict[str, str]:
    """``{queue: dsn}``, checked at declaration: names as at enqueue, DSNs that parse."""
    if routes is None:
        return {}
    if not isinstance(routes, Mapping):
        raise ConfigurationError("routes must map queue names to DSNs")
    checked: dict[str, str] = {}
    for queue, dsn in routes.items():
        try:
            name = producer.check_name("queue", queue, producer.MAX_QUEUE_LENGTH)
        except InvalidJobError as exc:
            raise ConfigurationError(f"routes: {exc}") from None
        if not isinstance(dsn, str) or not dsn.strip():
            raise ConfigurationError(f"routes: queue {name!r} needs a DSN string, got {dsn!r}")
        try:
            checked[name] = db.resolve_dsn(dsn)
        except ConfigurationError as exc:
            raise ConfigurationError(f"routes: queue {name!r}: {exc}") from None
    return checked


def member(root: App, dsn: str) -> App:
    """The app of a routed cluster: ``root``'s settings on ``dsn``, with connections of its
    own, sharing (not copying) what is declared on ``root``, so later declarations apply."""
    coalesce, window, most = root._coalesce_options
    app = type(root)(
        dsn, name=root.name, schema=root.schema, default_queue=root.default_queue,
        max_payload_bytes=root.max_payload_bytes, backoff=root.backoff,
        prepared_statements=root.prepared_statements, coalesce=coalesce, coalesce_window=window,
        coalesce_max=most, reconnect_timeout=root.reconnect_timeout, pool_size=root.pool_size,
    )  # fmt: skip
    app._root = root
    app.tasks = root.tasks
    app.middleware_stack = root.middleware_stack
    app.enqueue_hooks = root.enqueue_hooks
    app.around_enqueue_hooks = root.around_enqueue_hooks
    app.periodic_schedules = root.periodic_schedules
    app.retired_schedules = root.retired_schedules
    return app


def by_cluster(
    here: App, chunks: Iterator[list[producer.JobRow]], on_connection: bool
) -> list[tuple[App, list[list[producer.JobRow]]]]:
    """A bulk enqueue over routed queues: every job checked before any is written, then split
    by cluster, in chunks as ``producer.copy_rows`` takes them (one COPY per cluster)."""
    clusters: dict[App, list[list[producer.JobRow]]] = {}
    for chunk in chunks:
        for row in chunk:
            target = here.cluster(row.queue)
            if on_connection:
                refuse_connection(target, here, row.queue)
            parts = clusters.setdefault(target, [[]])
            if len(parts[-1]) == producer.COPY_CHUNK:
                parts.append([])
            parts[-1].append(row)
    return list(clusters.items())


def placed(job: Enqueued, queue: str) -> Enqueued:
    """The id as the caller gets it: with the queue, which names its cluster."""
    job.queue = queue
    return job


def one_cluster(route: Callable[[str], App], queues: Iterable[str], what: str) -> App:
    """The cluster of every one of ``queues``; refused if they are on more than one."""
    by_cluster: dict[App, list[str]] = {}
    for queue in queues:
        names = by_cluster.setdefault(route(queue), [])
        if queue not in names:
            names.append(queue)
    if len(by_cluster) > 1:
        groups = " and ".join(str(names) for names in by_cluster.values())
        raise InvalidJobError(
            f"{what} spans clusters: queues {groups} are routed to different PostgreSQL "
            "clusters, and nothing spans two of them"
        )
    return next(iter(by_cluster))


def check_parents(
    route: Callable[[str], App], target: App, queue: str, parents: Sequence[int] | None
) -> None:
    """A job runs after parents on its own cluster only: one cluster's trigger releases it.
    A parent given as the ``Enqueued`` of another cluster's queue is refused; a plain id is
    taken as an id on the child's cluster."""
    for parent in parents or ():
        parent_queue = parent.queue if isinstance(parent, Enqueued) else None
        if parent_queue is not None and route(parent_queue) is not target:
            raise InvalidJobError(
                f"after: job {int(parent)} is in queue {parent_queue!r}, routed to another "
                f"cluster than queue {queue!r}: parents and children must be on one cluster"
            )


def refuse_connection(target: App, here: App, queue: str) -> None:
    """``connection=`` writes on the caller's connection: to the cluster of the app it is
    called on. A queue routed to another cluster could not commit with that transaction."""
    if target is not here:
        raise InvalidJobError(
            f"queue {queue!r} is routed to another cluster than this app's: a job enqueued "
            "with connection= could not commit with your transaction there. Enqueue it "
            "without connection=, or through app.cluster(queue) on a connection to that cluster"
        )


def unknown_cluster(job_id: object) -> InvalidJobError:
    return InvalidJobError(
        f"job {job_id!r}: this app routes queues to several clusters, whose job ids repeat; "
        "pass queue= (the job's queue) or the Enqueued that enqueue returned"
    )
