"""Fault injection for executor tests: a worker that dies in the middle of its first attempt.

Pass ``RayExecutor(wrap=KillOnce(marker_dir))``: the first attempt of every task whose item
``KillOnce.select`` accepts (default: all) creates a marker file and kills its own worker
process with SIGKILL (no Python cleanup, as when a node's OOM killer or a preempted machine
takes it), so the driver sees a lost worker and must resubmit the task; the second attempt
finds the marker and runs normally.
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class KillOnce:
    """``wrap(fn, item)`` for :class:`~evictlab.executor.ray_backend.RayExecutor`: SIGKILL the
    worker on the first attempt of each selected item (markers in ``marker_dir``, which every
    worker must see: a local folder in a one-machine test)."""

    marker_dir: str
    select: Callable[[Any], bool] | None = None

    def __call__(self, fn: Callable[[Any], Any], item: Any) -> Any:
        if self.select is None or self.select(item):
            marker = Path(self.marker_dir) / hashlib.sha256(repr(item).encode()).hexdigest()[:16]
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass  # a later attempt: run normally
            else:
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)
        return fn(item)


def killed_count(marker_dir: str | Path) -> int:
    """How many workers :class:`KillOnce` killed (markers written)."""
    return sum(1 for _ in Path(marker_dir).iterdir())
