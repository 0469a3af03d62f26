"""The local process executor (--workers): the in-process results, in either order, errors
reach the driver, leaving early cancels what is left."""

from __future__ import annotations

import os

import pytest

from evictlab.errors import InputError
from evictlab.executor.base import LocalExecutor
from evictlab.executor.processes import ProcessExecutor


def square_and_threads(x: int) -> tuple[int, str, int]:
    import torch

    return x * x, os.environ.get("OMP_NUM_THREADS", ""), torch.get_num_threads()


def refuse_three(x: int) -> int:
    if x == 3:
        raise InputError("--n", "three is refused", "use another number")
    return x


def sleep_long(x: int) -> int:
    import time

    time.sleep(600)
    return x


def test_an_interrupt_ends_the_running_tasks_at_once() -> None:
    """Ctrl-C (here raised by the progress callback once the tasks are out) leaves the block
    with every worker ended: nothing waits for the 600 s tasks still running."""
    procs: list = []

    def interrupt(counts) -> None:
        if counts.running == 2 and not procs:
            procs.extend(ex._pool._processes.values())
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with ProcessExecutor(2) as ex:
            list(ex.map(sleep_long, range(4), on_progress=interrupt))
    assert len(procs) == 2 and not any(p.is_alive() for p in procs)


def test_results_are_the_local_ones_in_either_order() -> None:
    items = list(range(7))
    local = dict(LocalExecutor().map(square_and_threads, items))
    with ProcessExecutor(2) as ex:
        unordered = dict(ex.map(square_and_threads, items))
        ordered = [i for i, _ in ex.map(square_and_threads, items, ordered=True)]
    assert {i: r[0] for i, r in unordered.items()} == {i: r[0] for i, r in local.items()}
    assert ordered == items
    assert {r[1] for r in unordered.values()} == {"1"} and {r[2] for r in unordered.values()} == {1}


def test_a_task_error_reaches_the_driver_and_bad_sizes_are_refused() -> None:
    with ProcessExecutor(2) as ex, pytest.raises(InputError, match="three is refused"):
        list(ex.map(refuse_three, range(6)))
    with pytest.raises(InputError, match="--workers"):
        ProcessExecutor(0)
    with pytest.raises(RuntimeError, match="context manager"):
        list(ProcessExecutor(1).map(refuse_three, [1]))


def test_leaving_early_stops_the_rest() -> None:
    with ProcessExecutor(1) as ex:
        it = ex.map(square_and_threads, range(50))
        item, result = next(it)
        it.close()  # the tasks still out are cancelled; leaving the block stops the worker
    assert result[0] == item * item
