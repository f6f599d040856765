"""Every option of the ``pgqueue`` command can come from the environment, so a deploy can
configure workers and the dashboard without editing a command line.

The variable is ``PGQUEUE_<COMMAND>_<OPTION>``, with each group's name in between for the
commands inside it: ``pgqueue worker --concurrency`` reads ``PGQUEUE_WORKER_CONCURRENCY``,
``pgqueue queues limit --schema`` reads ``PGQUEUE_QUEUES_LIMIT_SCHEMA``. These are the names
click's ``auto_envvar_prefix`` gives, but from the long flag rather than the Python name
(``--app``: ``PGQUEUE_WORKER_APP``, not ``..._APP_SPEC``). An option that already has a
variable of its own keeps it (``--dsn``: ``PGQUEUE_DSN``).

They are set on each option rather than through ``auto_envvar_prefix``, which would also make
``--version`` and ``--help`` read ``PGQUEUE_VERSION`` and ``PGQUEUE_<COMMAND>_HELP`` (a
deploy's own ``PGQUEUE_VERSION=1.2`` would turn every command into a version print), and which
the generated CLI reference (mkdocs-click) cannot see.
"""

from __future__ import annotations

from collections.abc import Iterator

import click
from click.core import ParameterSource

PREFIX = "PGQUEUE"


def variable_name(path: tuple[str, ...], option: click.Option) -> str:
    """``PGQUEUE_`` + the command path + the option's long flag, upper case, ``-`` as ``_``."""
    flag = next((o for o in option.opts if o.startswith("--")), None) or f"--{option.name}"
    return "_".join((PREFIX, *path, flag[2:])).upper().replace("-", "_")


def options(
    command: click.Command, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Option]]:
    """Every option a user sets (not --help or --version), with its command's path."""
    for param in command.params:
        if isinstance(param, click.Option) and param.expose_value:
            yield path, param
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from options(sub, (*path, name))


def read_from_environment(command: click.Command) -> None:
    """Give every option of ``command`` and its subcommands its variable, shown in ``--help``."""
    for path, option in options(command):
        if option.envvar is None:
            option.envvar = variable_name(path, option)
        option.show_envvar = True


def name_the_variable(exc: click.BadParameter) -> None:
    """A bad value that came from the environment names its variable: the command line the
    user sees holds nothing wrong."""
    param, ctx = exc.param, exc.ctx
    if param is None or ctx is None or not isinstance(param.envvar, str) or param.name is None:
        return
    if ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT:
        flags = " / ".join(f"'{o}'" for o in param.opts)
        exc.param_hint = f"{flags} from ${param.envvar}"


class Group(click.Group):
    """The ``pgqueue`` group: its subcommands' bad environment values name their variable."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except click.BadParameter as exc:
            name_the_variable(exc)
            raise
