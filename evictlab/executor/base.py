"""The executor contract and the local executor.

An executor runs ``fn(item)`` for every item of a list and yields ``(item, result)`` pairs::

    with make_executor("ray", address=None) as ex:          # or "local"
        for item, result in ex.map(fn, items, spec=TaskSpec(cpus=1), ordered=True):
            ...                                              # the driver writes result

``fn`` must be a module-level function (a worker imports it by name) whose item and result
pickle; the driver alone writes files. ``ordered=True`` yields in the order of ``items``
(capture commits prompts in order, so its shards are the local run's), ``ordered=False``
as tasks finish. ``on_progress`` receives a :class:`TaskCounts` whenever a count changes.
Leaving the loop early (``break``, an exception, Ctrl-C) cancels the tasks still out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class TaskSpec:
    """What one task asks the cluster for (Ray's ``num_cpus`` / ``num_gpus``): ``cpus``
    CPU cores (the task runs its computation on that many threads) and ``gpus`` GPUs."""

    cpus: float = 1.0
    gpus: float = 0.0


@dataclass
class TaskCounts:
    """Progress of one ``map``, in tasks: ``done`` (results received), ``running`` (holding
    a slot of the cluster), ``queued`` (submitted, waiting for a slot), ``failed`` (attempts
    lost to a dead worker or node; each was retried) out of ``total``."""

    total: int
    done: int = 0
    running: int = 0
    queued: int = 0
    failed: int = 0

    def text(self) -> str:
        """One line, e.g. ``12/40 done, 4 running, 4 queued, 1 failed (retried)``."""
        return (f"{self.done}/{self.total} done, {self.running} running, {self.queued} queued, "
                f"{self.failed} failed (retried)")


class TaskFailedError(RuntimeError):
    """A task lost its worker more often than the executor retries (not an input error:
    the commands report it in one line and exit 1)."""


class Executor(Protocol):
    """Runs tasks: see the module docstring."""

    name: str

    def map(self, fn: Callable[[T], R], items: Iterable[T], *, spec: TaskSpec = TaskSpec(),
            ordered: bool = False, on_progress: Callable[[TaskCounts], None] | None = None,
            ) -> Iterator[tuple[T, R]]: ...

    def __enter__(self) -> Executor: ...

    def __exit__(self, *exc: Any) -> None: ...


class LocalExecutor:
    """Every task in this process, one after the other, in order."""

    name = "local"

    def map(self, fn: Callable[[T], R], items: Iterable[T], *, spec: TaskSpec = TaskSpec(),
            ordered: bool = False, on_progress: Callable[[TaskCounts], None] | None = None,
            ) -> Iterator[tuple[T, R]]:
        todo = list(items)
        counts = TaskCounts(total=len(todo))
        for i, item in enumerate(todo):
            counts.running, counts.queued = 1, len(todo) - i - 1
            if on_progress is not None:
                on_progress(counts)
            result = fn(item)
            counts.done, counts.running = counts.done + 1, 0
            if on_progress is not None:
                on_progress(counts)
            yield item, result

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class TaskBar:
    """A tqdm bar over tasks whose postfix shows running, queued and failed tasks; call it
    with a :class:`TaskCounts` (an executor's ``on_progress``)."""

    def __init__(self, desc: str, *, initial: int = 0, disable: bool = False) -> None:
        from tqdm.auto import tqdm

        self.initial = initial
        self.bar = tqdm(total=None, initial=initial, desc=desc, unit="task", disable=disable)

    def __call__(self, c: TaskCounts) -> None:
        self.bar.total = self.initial + c.total
        self.bar.n = self.initial + c.done
        self.bar.set_postfix(running=c.running, queued=c.queued, failed=c.failed, refresh=True)

    def close(self) -> None:
        self.bar.close()


def task_bar(desc: str, *, initial: int = 0, disable: bool = False) -> TaskBar:
    """A :class:`TaskBar` (``initial``: tasks already done by an earlier run)."""
    return TaskBar(desc, initial=initial, disable=disable)
