"""Where the tasks of ``capture``, ``solve`` and ``eval run`` run: here, or on a Ray cluster.

A command cuts its work into independent, picklable tasks (a group of prompts, a part of
rows, a grid cell) and hands them to an executor's ``map``; the driver (the process that
runs the command) receives each task's result and alone writes the output, atomically, as
the local run does. So a task that dies never leaves a file behind, and the same tasks give
the same bits on either executor.

- :mod:`evictlab.executor.base`: :class:`TaskSpec` (a task's resources), :class:`TaskCounts`
  (progress), :class:`LocalExecutor`, :func:`task_bar`.
- :mod:`evictlab.executor.factory`: :func:`make_executor` and :func:`check_executor` (the
  ``--executor`` / ``--address`` options).
- :mod:`evictlab.executor.ray_backend`: :class:`RayExecutor` (Ray tasks and ``ray.wait``;
  Ray is the optional extra ``evictlab[ray]``) and :func:`connect` (``--address``).
- :mod:`evictlab.executor.testing`: fault injection for tests (a task whose worker is
  killed on its first attempt).
"""

from evictlab.executor.base import Executor, LocalExecutor, TaskCounts, TaskFailedError, TaskSpec, task_bar
from evictlab.executor.factory import EXECUTORS, check_executor, make_executor

__all__ = ["EXECUTORS", "Executor", "LocalExecutor", "TaskCounts", "TaskFailedError", "TaskSpec", "check_executor",
           "make_executor", "task_bar"]
