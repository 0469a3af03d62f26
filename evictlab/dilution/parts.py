"""Resumable outputs: units of work written as part files, collected at the end.

A run writing ``OUT`` keeps its finished units in ``OUT.parts/`` (beside ``OUT``): one
Parquet file per unit (``part-<key>.parquet``, written atomically), their SHA-256 in
``checksums.json`` and the run's settings in ``job.json``. A rerun with the same settings
skips every unit whose part is present and intact (a damaged part is recomputed); a rerun
with other settings is refused (the fix names the folder to delete). When every unit is
done the parts are concatenated into ``OUT`` (atomically) and the folder is removed, so an
interrupted run never leaves an ``OUT`` that looks finished.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import polars as pl

from evictlab.errors import InputError
from evictlab.io import atomic_path, atomic_write_json, read_json, sha256_file

_KEY = re.compile(r"^[A-Za-z0-9_.=+-]+$")


class PartStore:
    """The parts folder of one output (see the module docstring)."""

    def __init__(self, folder: Path, job: dict[str, Any], option: str = "--out") -> None:
        self.dir = Path(folder)
        self.job = json.loads(json.dumps(job, sort_keys=True, default=str))
        self.option = option
        self._sums: dict[str, str] = {}

    def open(self) -> PartStore:
        """Create the folder (or check that it belongs to the same job) and load the checksums."""
        job_file = self.dir / "job.json"
        if job_file.is_file():
            old = read_json(job_file, f"delete {self.dir}")
            if old != self.job:
                diff = sorted(k for k in set(old) | set(self.job) if old.get(k) != self.job.get(k))
                raise InputError(self.option, f"{self.dir} holds the parts of a run with other settings "
                                 f"({', '.join(diff[:3])} differ)",
                                 f"rerun with the same options to resume it, or delete {self.dir} to start over")
            sums = self.dir / "checksums.json"
            self._sums = read_json(sums, f"delete {self.dir}") if sums.is_file() else {}
        else:
            self.dir.mkdir(exist_ok=True)
            atomic_write_json(job_file, self.job)
        return self

    def path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"part key {key!r} is not file-name safe")
        return self.dir / f"part-{key}.parquet"

    def done(self, key: str) -> bool:
        """Whether unit ``key`` has an intact part (its file exists with the recorded SHA-256)."""
        p = self.path(key)
        return key in self._sums and p.is_file() and sha256_file(p) == self._sums[key]

    def write(self, key: str, df: pl.DataFrame) -> None:
        """Write unit ``key``'s rows (atomically), then record its checksum."""
        with atomic_path(self.path(key), suffix=".parquet") as tmp:
            df.write_parquet(tmp)
        self._sums[key] = sha256_file(self.path(key))
        atomic_write_json(self.dir / "checksums.json", self._sums)

    def read(self, key: str) -> pl.DataFrame:
        return pl.read_parquet(self.path(key))

    def collect(self, keys: list[str]) -> pl.DataFrame:
        """Every unit's rows, in the order of ``keys`` (all must be done)."""
        frames = [self.read(k) for k in keys]
        frames = [f for f in frames if f.height]
        return pl.concat(frames, how="diagonal_relaxed") if frames else pl.DataFrame()

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
