"""Run records: what produced a result, written beside it so any number can be re-run.

A record holds the command line, git commit (and whether the tree was dirty), package
versions, model, seeds, config and wall time. It is JSON, written atomically.

``version_drift`` lists every installed package whose version differs from the pin in the
top-level ``constraints.txt`` (the versions the test suite last passed with):
``{name: {"installed": ..., "pinned": ...}}``, empty when everything matches, null when
there is no constraints file (evictlab installed without its source tree).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import os
import platform
import re
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

#: The one name of a run record: ``run_record.json`` inside an output folder, or
#: ``<output stem>.run_record.json`` beside an output file (see :func:`record_path`).
RECORD_NAME = "run_record.json"

#: The pinned versions, at the top of the source tree (see README, "Install").
CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


def record_path(output: str | os.PathLike[str], *, folder: bool = False) -> Path:
    """Where the run record of ``output`` goes, the same rule for every command.

    ``folder=True`` (the output is a directory, e.g. a row dataset or ``runs/demo``):
    ``output/run_record.json``. Otherwise (a file): beside it, ``<stem>.run_record.json``
    (``results.parquet`` -> ``results.run_record.json``).
    """
    output = Path(output)
    return output / RECORD_NAME if folder else output.with_name(f"{output.stem}.{RECORD_NAME}")


def git_state(cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Current git commit and dirty flag of the evictlab checkout, or nulls outside git."""
    cwd = cwd or Path(__file__).resolve().parents[1]
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


def _canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503: case and -_. runs folded)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _public(version: str) -> str:
    """The version without a local label: torch 2.13.0+cpu is the 2.13.0 release."""
    return version.split("+", 1)[0]


def read_constraints(path: str | os.PathLike[str] | None = None) -> dict[str, str] | None:
    """``{canonical name: pinned version}`` from a pip constraints file, or None if it is absent."""
    path = Path(path) if path is not None else CONSTRAINTS
    if not path.is_file():
        return None
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()
        name, sep, version = line.partition("==")
        if sep and name.strip() and version.strip():
            pins[_canonical(name.split("[", 1)[0].strip())] = version.strip()
    return pins


def installed_versions() -> dict[str, str]:
    """``{canonical name: version}`` of every distribution importable here."""
    out: dict[str, str] = {}
    for dist in _md.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(_canonical(name), dist.version)
    return out


def version_drift(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, str]] | None:
    """Installed packages whose version differs from ``constraints.txt`` (None: no such file).

    Only installed packages are compared (a pinned package that is not installed, such as a
    test-only one, is not drift); local labels (``+cpu``) are ignored.
    """
    pins = read_constraints(path)
    if pins is None:
        return None
    installed = installed_versions()
    return {name: {"installed": installed[name], "pinned": pinned}
            for name, pinned in sorted(pins.items())
            if name in installed and _public(installed[name]) != _public(pinned)}


def drift_lines(drift: dict[str, dict[str, str]] | None) -> list[str]:
    """Human-readable lines for a report or a terminal (empty when nothing drifted)."""
    if not drift:
        return []
    return [f"{name} {v['installed']} installed, {v['pinned']} pinned in constraints.txt"
            for name, v in drift.items()]


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
    # the code that ran is the checkout at the start: a commit made during a long run is not it
    _git: dict[str, Any] = field(default_factory=lambda: git_state(), repr=False)

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "argv": self.argv,
            "started": self.started,
            "wall_time_s": round(time.perf_counter() - self._t0, 3),
            "git": self._git,
            **({"git_at_end": end} if (end := git_state()) != self._git else {}),
            "packages": package_versions(),
            "version_drift": version_drift(),
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
