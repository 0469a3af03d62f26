"""Resumable outputs: units of work written as part files, collected at the end.

A run writing ``OUT`` keeps its finished units in ``OUT.parts/`` (beside ``OUT``): one
Parquet file per unit (``part-<key>.parquet``, written atomically with its checksum in its
own footer, :func:`evictlab.io.write_checked_parquet`) and the run's settings in
``job.json``. A rerun with the same settings first checks every part there: an intact one
is kept, a damaged one (or one without a checksum, from an older evictlab) is named in one
warning line, deleted and recomputed; a rerun with other settings is refused (the fix
names the folder to delete). When every unit is done the parts are concatenated into
``OUT`` (atomically) and, once the run's last file is written, the folder is removed, so an
interrupted run never leaves an ``OUT`` that looks finished without its parts beside it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from evictlab.errors import CorruptFileError, InputError
from evictlab.io import atomic_write_json, read_checked_parquet, read_json, warn, write_checked_parquet

_KEY = re.compile(r"^[A-Za-z0-9_.=+-]+$")
_PART = re.compile(r"^part-(?P<key>[A-Za-z0-9_.=+-]+)\.parquet$")
_FIX = "delete that part file and rerun the same command (the part is recomputed)"


class PartStore:
    """The parts folder of one output (see the module docstring)."""

    def __init__(self, folder: Path, job: dict[str, Any], option: str = "--out",
                 notify: Callable[[str], None] | None = None) -> None:
        self.dir = Path(folder)
        self.job = json.loads(json.dumps(job, sort_keys=True, default=str))
        self.option = option
        self.notify = notify or warn
        self._done: set[str] = set()

    def open(self) -> PartStore:
        """Create the folder (or check that it belongs to the same job) and check every part
        already there (a damaged one is reported, deleted and recomputed)."""
        shutil.rmtree(self._trash(), ignore_errors=True)  # left by a run killed while removing its parts
        job_file = self.dir / "job.json"
        if job_file.is_file():
            old = read_json(job_file, f"delete {self.dir}")
            if old != self.job:
                diff = sorted(k for k in set(old) | set(self.job) if old.get(k) != self.job.get(k))
                raise InputError(self.option, f"{self.dir} holds the parts of a run with other settings "
                                 f"({', '.join(diff[:3])} differ)",
                                 f"rerun with the same options to resume it, or delete {self.dir} to start over")
            for f in sorted(self.dir.iterdir()):
                m = _PART.match(f.name)
                if m is None:
                    continue
                try:
                    read_checked_parquet(f, _FIX, legacy="refuse")
                except CorruptFileError as exc:
                    f.unlink()
                    self.notify(f"discarded the damaged part file {f} ({exc.problem}); it is recomputed")
                    continue
                self._done.add(m["key"])
        else:
            self.dir.mkdir(exist_ok=True)
            atomic_write_json(job_file, self.job)
        return self

    def path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"part key {key!r} is not file-name safe")
        return self.dir / f"part-{key}.parquet"

    def done(self, key: str) -> bool:
        """Whether unit ``key`` has an intact part (checked by :meth:`open`, or written since)."""
        return key in self._done and self.path(key).is_file()

    def write(self, key: str, df: pl.DataFrame) -> None:
        """Write unit ``key``'s rows (atomically, with their checksum)."""
        write_checked_parquet(df, self.path(key))
        self._done.add(key)

    def read(self, key: str) -> pl.DataFrame:
        return read_checked_parquet(self.path(key), _FIX, legacy="refuse")

    def collect(self, keys: list[str]) -> pl.DataFrame:
        """Every unit's rows, in the order of ``keys`` (all must be done)."""
        frames = [self.read(k) for k in keys]
        frames = [f for f in frames if f.height]
        return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()

    def _trash(self) -> Path:
        return self.dir.with_name(self.dir.name + ".removing")

    def remove(self) -> None:
        """Remove the folder: renamed first (atomic), so a kill while deleting never leaves a
        half-deleted parts folder that a rerun would take for a resumable one."""
        if self.dir.exists():
            shutil.rmtree(self._trash(), ignore_errors=True)
            os.replace(self.dir, self._trash())
        shutil.rmtree(self._trash(), ignore_errors=True)
