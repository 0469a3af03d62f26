"""The ``--executor`` / ``--address`` options shared by ``capture``, ``solve`` and ``eval run``,
and ``--workers`` (local processes: :class:`~evictlab.executor.processes.ProcessExecutor`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer

from evictlab.executor.base import Executor, TaskFailedError
from evictlab.executor.factory import make_executor

EXECUTOR_OPTIONS = {
    "executor": typer.Option("local", "--executor",
                             help="local (this process) or ray (one Ray task per unit of work; "
                                  "needs the extra evictlab[ray]; docs/cluster.md)."),
    "address": typer.Option(None, "--address", show_default=False,
                            help="With --executor ray: the cluster's HOST:PORT (`ray start --head` prints it), "
                                 "ray://HOST:10001 (Ray Client) or auto; omitted: RAY_ADDRESS, else a local "
                                 "Ray instance started for this run."),
    "workers": typer.Option(1, "--workers", help="local processes running the units of work, one torch thread "
                            "each unless --threads says more (1: in this process)"),
}


@contextlib.contextmanager
def executor_for(executor: str, address: str | None) -> Iterator[Executor]:
    """The executor of the options (checked and connected now), closed at the end; a task
    that lost its worker more often than retried ends the command with one line, exit 1."""
    with make_executor(executor, address) as ex:
        try:
            yield ex
        except TaskFailedError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
