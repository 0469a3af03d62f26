"""Run records: what produced a result, written beside it so any number can be re-run.

A record holds the command line, git commit (and whether the tree was dirty), package
versions, model, seeds, config and wall time. It is JSON, written atomically.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evictlab.io import atomic_write_json

_PACKAGES = (
    "evictlab", "numpy", "scipy", "numba", "ortools", "torch", "polars", "scikit-learn",
    "seaborn", "transformers", "gguf", "accelerate",
)


def git_state(cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Current git commit and dirty flag of the evictlab checkout, or nulls outside git."""
    cwd = cwd or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=cwd, capture_output=True, text=True, check=True,
            ).stdout.strip()
        )
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape results."""
    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            out[name] = None
    return out


@dataclass
class RunRecord:
    """A record of one run; call :meth:`write` when the run finishes."""

    kind: str
    config: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    seed: int | None = None
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    started: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())
    _t0: float = field(default_factory=time.perf_counter, repr=False)

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "argv": self.argv,
            "started": self.started,
            "wall_time_s": round(time.perf_counter() - self._t0, 3),
            "git": git_state(),
            "packages": package_versions(),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "model": self.model,
            "seed": self.seed,
            "config": self.config,
            **extra,
        }

    def write(self, path: str | os.PathLike[str], **extra: Any) -> Path:
        """Write the record as JSON (atomically) and return its path."""
        path = Path(path)
        atomic_write_json(path, self.to_dict(**extra))
        return path
