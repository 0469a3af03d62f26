"""The ``--executor`` / ``--address`` options: checking them and building the executor they name.

:func:`make_executor` is the one place that picks an implementation (the local executor of
:mod:`evictlab.executor.base`, or :class:`~evictlab.executor.ray_backend.RayExecutor`), so
neither of those modules imports the other's.
"""

from __future__ import annotations

from evictlab.errors import InputError
from evictlab.executor.base import Executor, LocalExecutor

#: The values of ``--executor``.
EXECUTORS = ("local", "ray")


def check_executor(executor: str, address: str | None) -> None:
    """InputError for an unknown ``--executor`` or an ``--address`` without Ray (no import)."""
    if executor not in EXECUTORS:
        raise InputError("--executor", f"unknown executor {executor!r}", f"use one of: {', '.join(EXECUTORS)}")
    if executor == "local" and address is not None:
        raise InputError("--address", "is only used with --executor ray",
                         "drop --address, or pass --executor ray to run on that Ray cluster")


def make_executor(executor: str = "local", address: str | None = None, *, retries: int = 3) -> Executor:
    """The executor of ``--executor`` / ``--address`` (checked; Ray is connected at once, so a
    missing Ray or a bad address is refused before any work). ``retries``: how often a task
    whose worker died is run again (Ray)."""
    check_executor(executor, address)
    if executor == "local":
        return LocalExecutor()
    from evictlab.executor.ray_backend import RayExecutor

    return RayExecutor(address, retries=retries)
