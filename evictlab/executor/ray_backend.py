"""The Ray executor: one Ray task per item, results collected with ``ray.wait``.

Nothing here schedules: Ray places the tasks. The driver only keeps a bounded number of
tasks submitted (twice the cluster's slots for the task's resources, so results do not pile
up in the driver's memory), receives results as they finish, and resubmits a task whose
worker or node died (``retries`` times; Ray's own ``max_retries`` is 0 so every lost
attempt is counted in :class:`~evictlab.executor.base.TaskCounts`). An exception raised by
the task's own code (an :class:`~evictlab.errors.InputError`, a capture mismatch, a bug) is
not retried: the other tasks are cancelled and the exception is raised in the driver as if
the task had run here.

``--address``: omitted -> the cluster named by ``RAY_ADDRESS`` if set, else a local Ray
instance started for this run (all cores; shut down at the end); ``auto`` -> the cluster
this machine belongs to (``ray start`` ran here); ``HOST:PORT`` -> the head node's GCS
(``ray start --head`` prints it; port 6379 by default); ``ray://HOST:PORT`` -> Ray Client
(port 10001). A process already connected to Ray (``ray.init`` was called, e.g. by a test
session or a notebook) keeps its connection.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from evictlab.errors import EvictlabError, InputError
from evictlab.executor.base import TaskCounts, TaskFailedError, TaskSpec

T = TypeVar("T")
R = TypeVar("R")

_ADDRESS = re.compile(r"(?P<client>ray://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})")
_ADDRESS_FIX = ("pass HOST:PORT of the head node (`ray start --head` prints it; port 6379 by default), "
                "ray://HOST:10001 for Ray Client, or auto; omit --address to start a local Ray instance")
#: Seconds to wait for a TCP connection to ``--address`` before refusing it.
PROBE_TIMEOUT_S = 3.0


def import_ray() -> Any:
    """The ``ray`` module, or the InputError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise InputError("--executor", "ray is not installed",
                         "pip install 'evictlab[ray]' (Ray 2.x), or use --executor local") from None
    return ray


def check_address(address: str) -> str:
    """``address`` if it is ``auto`` or a reachable ``[ray://]HOST:PORT``; else InputError.

    Reachability is a plain TCP connection (``PROBE_TIMEOUT_S``), so a wrong host or port is
    refused in seconds instead of waiting for Ray's own connection timeouts.
    """
    address = address.strip()
    if address == "auto":
        return address
    m = _ADDRESS.fullmatch(address)
    if m is None:
        raise InputError("--address", f"{address!r} is not a Ray address", _ADDRESS_FIX)
    host, port = m["host"].strip("[]"), int(m["port"])
    if not 1 <= port <= 65535:
        raise InputError("--address", f"port {port} is outside 1-65535", _ADDRESS_FIX)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise InputError("--address", f"nothing answers at {host}:{port} ({why})",
                         "start the cluster (`ray start --head` on the head node) and pass the address it "
                         "prints, or omit --address to start a local Ray instance") from None
    return address


def target_address(address: str | None) -> str | None:
    """The cluster to join: ``--address``, else ``RAY_ADDRESS``, checked (None: start a
    local instance)."""
    target = address if address is not None else os.environ.get("RAY_ADDRESS")
    return check_address(target) if target else None


def connect(target: str | None) -> bool:
    """Connect this process to Ray at ``target`` (from :func:`target_address`; see the
    module docstring); True if this call started or joined Ray (so the caller shuts it
    down), False if the process was connected already."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if not target:
        kwargs.update(address="local", include_dashboard=False)
    else:
        kwargs.update(address=target)
    try:
        ray.init(**kwargs)
    except Exception as exc:  # noqa: BLE001 -- Ray raises ConnectionError, RuntimeError, ValueError...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not target:
            raise InputError("--address", f"could not start a local Ray instance: {first}",
                             "rerun (a machine under heavy load can delay Ray's start-up), or start Ray "
                             "yourself (`ray start --head`) and pass --address auto") from None
        raise InputError("--address", f"could not connect to Ray at {target}: {first}",
                         "check that the cluster runs the same Ray and Python versions as this machine; "
                         + _ADDRESS_FIX) from None
    return True


def _run_task(fn: Callable[[Any], Any], item: Any, wrap: Callable[..., Any] | None) -> Any:
    """What a Ray worker runs: ``fn(item)`` (or ``wrap(fn, item)``, fault injection in tests)."""
    return fn(item) if wrap is None else wrap(fn, item)


class RayExecutor:
    """Tasks on a Ray cluster (see the module docstring).

    ``retries``: how often a task is resubmitted after its worker or node died;
    ``wrap``: an optional picklable ``wrap(fn, item)`` run on the worker instead of
    ``fn(item)`` (tests inject faults with it, :mod:`evictlab.executor.testing`).
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, retries: int = 3,
                 wrap: Callable[..., Any] | None = None) -> None:
        if not isinstance(retries, int) or retries < 0:
            raise InputError("retries", f"must be an integer >= 0, got {retries!r}", "pass e.g. 3")
        self.ray = import_ray()
        self.retries = retries
        self.wrap = wrap
        self.target = target_address(address)  # refused now if unreachable
        self._owns: bool | None = None          # None: not connected yet (at the first map)
        self._slots_at = (-1.0, 1)

    def connect(self) -> None:
        """Join (or start) the cluster, once; the first :meth:`map` calls it, so commands
        refuse bad input before a local Ray instance spends seconds starting."""
        if self._owns is None:
            self._owns = connect(self.target)

    # -- cluster capacity -----------------------------------------------------------------

    def check_spec(self, spec: TaskSpec) -> None:
        """InputError when no node of the cluster can ever run a task of ``spec``."""
        nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        if spec.gpus > 0 and not any(r.get("GPU", 0) >= spec.gpus for r in nodes):
            raise InputError("--device", f"each task asks for {spec.gpus:g} GPU, but no node of the Ray cluster has one",
                             "add GPU nodes to the cluster, or use --device cpu")
        best = max((r.get("CPU", 0) for r in nodes), default=0)
        if spec.cpus > best:
            raise InputError("--threads", f"each task asks for {spec.cpus:g} CPUs, but the largest node of the Ray "
                             f"cluster has {best:g}", f"use --threads {int(best) or 1} or fewer")

    def slots(self, spec: TaskSpec) -> int:
        """How many tasks of ``spec`` the whole cluster runs at once (refreshed every 2 s,
        so nodes that join or leave are seen)."""
        now = time.monotonic()
        if now - self._slots_at[0] > 2.0:
            res = self.ray.cluster_resources()
            n = res.get("GPU", 0) / spec.gpus if spec.gpus > 0 else res.get("CPU", 0) / max(spec.cpus, 1e-9)
            self._slots_at = (now, max(1, int(n)))
        return self._slots_at[1]

    # -- map --------------------------------------------------------------------------------

    def map(self, fn: Callable[[T], R], items: Iterable[T], *, spec: TaskSpec = TaskSpec(),
            ordered: bool = False, on_progress: Callable[[TaskCounts], None] | None = None,
            ) -> Iterator[tuple[T, R]]:
        ray = self.ray
        from ray.exceptions import RayError, RayTaskError, TaskCancelledError

        todo = list(items)
        self.connect()
        self.check_spec(spec)
        remote = ray.remote(_run_task).options(num_cpus=spec.cpus, num_gpus=spec.gpus, max_retries=0)
        counts = TaskCounts(total=len(todo))
        out: dict[Any, int] = {}          # submitted ref -> item index
        lost = [0] * len(todo)            # attempts lost per item
        waiting: dict[int, Any] = {}      # ordered: results not yet yielded
        head = nxt = 0                    # ordered: next index to yield; next index to submit

        def report() -> None:
            slots = self.slots(spec)
            counts.running = min(len(out), slots)
            counts.queued = len(out) - counts.running
            if on_progress is not None:
                on_progress(counts)

        def submit(i: int) -> None:
            out[remote.remote(fn, todo[i], self.wrap)] = i

        try:
            while (head if ordered else counts.done) < len(todo):
                window = 2 * self.slots(spec)
                while nxt < len(todo) and ((nxt - head) if ordered else len(out)) < window:
                    submit(nxt)
                    nxt += 1
                report()
                ready, _ = ray.wait(list(out), num_returns=1)
                for ref in ready:
                    i = out.pop(ref)
                    try:
                        result = ray.get(ref)
                    except RayTaskError as exc:
                        cause = getattr(exc, "cause", None)
                        if isinstance(cause, EvictlabError):
                            raise cause from None
                        raise
                    except TaskCancelledError:
                        raise
                    except RayError as exc:  # the worker or its node died: run the task again
                        counts.failed += 1
                        lost[i] += 1
                        if lost[i] > self.retries:
                            raise TaskFailedError(
                                f"task {i} of {len(todo)} lost its worker {lost[i]} times (last: "
                                f"{type(exc).__name__}); the driver kept every finished result, rerun the "
                                "same command to resume") from None
                        submit(i)
                        continue
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
            report()
        finally:
            # Cancel only what has not finished: force-cancelling a task as it completes can
            # crash the driver inside Ray ("Check failed: it != submissible_tasks_.end() Tried to
            # complete task that was not pending", seen once in this suite with Ray 2.60; the
            # cancel/complete race of ray-project/ray#54846). This narrows the window; Ray owns
            # the rest of the race.
            if out:
                finished, _ = ray.wait(list(out), num_returns=len(out), timeout=0, fetch_local=False)
                for ref in set(out) - set(finished):
                    ray.cancel(ref, force=True)

    def close(self) -> None:
        """Shut Ray down if this executor started or joined it."""
        if self._owns and self.ray.is_initialized():
            self.ray.shutdown()
        self._owns = None

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
