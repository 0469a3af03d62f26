"""The local process executor: tasks on ``workers`` processes of this machine (``--workers N``).

Same contract as every executor (:mod:`evictlab.executor.base`): ``fn`` is a module-level
function of one picklable item, results come back to the driver, which alone writes files.
Each worker is a fresh ``spawn`` process (no state inherited from the driver: a loaded
model, torch's thread pool, an open file) limited to ``threads`` threads per library
(OpenMP, MKL, OpenBLAS, Numba and torch), so ``N`` workers of one thread use ``N`` cores
and nothing more; what a worker caches (a loaded model, examples) lives as long as the
worker, i.e. the whole ``map``. Results are the in-process run's: the same function on the
same item.

Leaving the loop early (``break``, an exception, Ctrl-C) cancels the tasks not yet started
and stops the workers; finished results already yielded are the driver's to keep. An
exception or Ctrl-C leaving the ``with`` block also ends the tasks still running (their
results would be discarded), so an interrupted grid exits at once instead of after its
running units.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from evictlab.errors import InputError
from evictlab.executor.base import TaskCounts, TaskSpec

__all__ = ["ProcessExecutor"]

T = TypeVar("T")
R = TypeVar("R")

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")


def _init_worker(threads: int) -> None:
    """Runs first in every worker: cap each library's threads before any of them starts
    (the environment is read when a library loads), and ignore Ctrl-C (the driver stops
    the workers; a worker interrupted mid-task would print its own traceback)."""
    import signal

    for var in _THREAD_VARS:
        os.environ[var] = str(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import threading

    import torch
    from tqdm import tqdm

    # tqdm's default lock holds a named multiprocessing semaphore; a worker ended by
    # _stop_workers could not release it and the resource tracker would warn at exit.
    # Workers' bars (model loading) need no lock across processes.
    tqdm.set_lock(threading.RLock())

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


def _call(fn: Callable[[Any], Any], item: Any) -> Any:
    return fn(item)


class ProcessExecutor:
    """Tasks on ``workers`` local processes of ``threads`` threads each (module docstring)."""

    name = "processes"

    def __init__(self, workers: int, threads: int = 1) -> None:
        if workers < 1:
            raise InputError("--workers", f"{workers} workers", "use --workers 1 or more")
        if threads < 1:
            raise InputError("--threads", f"{threads} threads per worker", "use 1 or more threads per worker")
        self.workers = int(workers)
        self.threads = int(threads)
        self._pool: Any = None

    def __enter__(self) -> ProcessExecutor:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_init_worker, initargs=(self.threads,))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            if exc[0] is not None:
                self._stop_workers()
            # after _stop_workers waiting is short (nothing runs) and lets the pool release its
            # queues and locks (else the resource tracker warns of a leaked semaphore at exit)
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _stop_workers(self) -> None:
        """End the workers now (an exception or Ctrl-C is leaving the block). Without this
        the interpreter's exit waits for the tasks still running (a grid unit: a minute),
        whose results the driver would discard anyway: workers write nothing, so ending
        them loses nothing but that work."""
        pool = self._pool
        if hasattr(pool, "terminate_workers"):  # Python >= 3.14
            pool.terminate_workers()
            return
        procs = list((getattr(pool, "_processes", None) or {}).values())  # 3.11-3.13: no public way
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)

    def map(self, fn: Callable[[T], R], items: Iterable[T], *, spec: TaskSpec = TaskSpec(),
            ordered: bool = False, on_progress: Callable[[TaskCounts], None] | None = None,
            ) -> Iterator[tuple[T, R]]:
        """Run ``fn`` on every item, at most ``workers`` at a time (``spec`` is ignored: a
        task gets one worker's threads); yields ``(item, result)`` as tasks finish, or in
        the order of ``items`` with ``ordered``."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if self._pool is None:
            raise RuntimeError("use the executor as a context manager: with ProcessExecutor(n) as ex: ...")
        todo = list(items)
        counts = TaskCounts(total=len(todo))
        # Keep the queue short: a task submitted is a task a Ctrl-C cannot cancel cheaply.
        window = 2 * self.workers
        out: dict[Any, int] = {}
        waiting: dict[int, Any] = {}
        head = nxt = 0

        def report() -> None:
            counts.running = min(len(out), self.workers)
            counts.queued = len(out) - counts.running
            if on_progress is not None:
                on_progress(counts)

        try:
            while (head if ordered else counts.done) < len(todo):
                while nxt < len(todo) and ((nxt - head) if ordered else len(out)) < window:
                    out[self._pool.submit(_call, fn, todo[nxt])] = nxt
                    nxt += 1
                report()
                done, _ = wait(list(out), return_when=FIRST_COMPLETED)
                for fut in done:
                    i = out.pop(fut)
                    result = fut.result()  # a task's exception (an InputError too) reaches the driver
                    counts.done += 1
                    if ordered:
                        waiting[i] = result
                        while head in waiting:
                            report()
                            yield todo[head], waiting.pop(head)
                            head += 1
                    else:
                        report()
                        yield todo[i], result
        finally:
            for fut in out:
                fut.cancel()
