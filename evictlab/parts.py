"""Resumable runs: units of work kept as part files, collected into the output at the end.

One store serves ``evictlab solve`` (a part per chunk of rows), ``evictlab eval run`` (a part
per cell, and a trace part per traced cell) and ``evictlab dilution check|sweep`` (a part
per chunk of blocks, per run). It owns everything but the units themselves:

* **the job manifest** (``job.json`` in the parts folder, or a file the caller names, such
  as an eval grid's ``grid.json``): what the parts were computed with. A rerun with other
  settings is refused with one line naming what differs and the folder to delete
  (:meth:`PartStore.resume`); a folder holding parts but no manifest (a run killed while
  starting) is refused the same way, since its parts cannot be attributed to a job;
* **atomic part writes with their checksum**: every part is written by
  :func:`evictlab.io.write_checked_parquet`, whose SHA-256 of the file's own bytes sits in
  the file's footer, so the checksum can never be out of step with the part;
* **verification on resume**: before anything is computed, every part of the job is
  checked (checksum, readable, and the caller's own check of its content); a damaged one,
  or one without a checksum (an evictlab older than the checksums wrote it), is named in
  one warning line, deleted and computed again (:attr:`PartStore.discarded`);
* **the lock** against a second writer (:meth:`PartStore.lock`, i.e.
  :func:`evictlab.io.exclusive_lock`), refused at once with one line;
* **collecting** the parts in the caller's order of units (:meth:`PartStore.collect`), which
  the caller writes as its output (atomically, checksummed: :func:`evictlab.io.write_checked_parquet`);
* **what marks a finished run**: an output beside whose parts folder no parts folder is
  left (:meth:`PartStore.finished`); the folder goes last (:meth:`PartStore.remove`:
  renamed, then deleted, so a kill while deleting never leaves a half folder that looks
  resumable). An eval grid keeps its parts (its run record, written last, marks the end).

A caller keeps only what is its own: its unit keys, how a unit is computed, the job's
fields and, where it has one, a check of a part's content or its own comparison of jobs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from evictlab.errors import CorruptFileError, InputError
from evictlab.io import (
    atomic_write_json,
    exclusive_lock,
    read_checked_parquet,
    read_json,
    remove_temp_files,
    warn,
    write_checked_parquet,
)

__all__ = ["PartStore", "finished", "job_differences"]

_KEY = re.compile(r"^[A-Za-z0-9_.=+-]+$")
_FIX = "delete that part file and rerun the same command (the part is computed again)"


def finished(output: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether ``output`` is a finished run's: it exists and its parts ``folder`` is gone (an
    output with the folder still beside it was being written when the run stopped, and the
    rerun finishes it rather than refusing an existing output)."""
    folder = Path(folder)
    return Path(output).exists() and not folder.exists() and not _trash(folder).exists()


def _trash(folder: Path) -> Path:
    """Where :meth:`PartStore.remove` moves a parts folder before deleting it."""
    return folder.with_name(folder.name + ".removing")


def job_differences(old: Any, new: Any, path: str = "") -> list[str]:
    """``"field OLD there, NEW now"`` for every leaf where two job manifests differ (nested
    dicts are walked, their fields named with dots: ``config.budgets``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            sub = f"{path}.{k}" if path else str(k)
            if k not in old:
                out.append(f"{sub} absent there, {_short(new[k])} now")
            elif k not in new:
                out.append(f"{sub} {_short(old[k])} there, absent now")
            else:
                out += job_differences(old[k], new[k], sub)
        return out
    return [] if old == new else [f"{path or 'the job'} {_short(old)} there, {_short(new)} now"]


def _json(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` as it reads back from JSON (tuples become lists, keys sorted)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _short(v: Any, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class PartStore:
    """The parts folder of one resumable run (the module docstring).

    Args:
        folder: where the parts go (``OUT.parts`` beside an output file, ``DIR/parts``).
        job: what the parts are computed with (JSON-able; compared on resume).
        info: more fields for the manifest that a resume does not compare (e.g. where the
            input was read: a moved dataset with the same content still resumes).
        units: the job's unit keys in the output's order, each with the names of its side
            parts (``{key: ("trace",)}``: written before the unit's main part, collected
            on their own); a plain sequence of keys when no unit has a side part.
        field: the option (or neutral field) a refusal names, e.g. ``"--out"``.
        manifest: the job manifest's path (default ``folder/job.json``).
        name: a part's file name from its key and side (``""`` for the main part),
            default ``part-<key>.parquet`` / ``part-<key>.<side>.parquet``.
        check: the caller's check of an intact part's content, ``check(key, frame)`` ->
            None if it holds what the unit computes, else why not (in words).
        differences: the caller's comparison of the manifest on disk with ``job``
            (a list of what differs, in words; default :func:`job_differences`).
        restart_option: the option that discards the parts of another job (``--restart``),
            named in the refusal, if the command has one.
        adopt: parts in a folder without a manifest are verified and used (units whose
            keys name everything they are computed from, such as an eval cell's), rather
            than refused as parts of an unknown job.
        notify: receives each one-line warning (default: stderr).
    """

    def __init__(self, folder: str | os.PathLike[str], job: Mapping[str, Any],
                 units: Mapping[str, Sequence[str]] | Sequence[str], *, info: Mapping[str, Any] | None = None,
                 field: str = "--out",
                 manifest: str | os.PathLike[str] | None = None,
                 name: Callable[[str, str], str] | None = None,
                 check: Callable[[str, pl.DataFrame], str | None] | None = None,
                 differences: Callable[[Any], list[str]] | None = None,
                 restart_option: str | None = None, adopt: bool = False,
                 notify: Callable[[str], None] | None = None) -> None:
        self.dir = Path(folder)
        self.job = _json(job)
        self.info = _json(info or {})
        self.units = ({k: tuple(v) for k, v in units.items()} if isinstance(units, Mapping)
                      else {k: () for k in units})
        for key in self.units:
            if not _KEY.match(key):
                raise ValueError(f"part key {key!r} is not file-name safe")
        self.field = field
        self.manifest = Path(manifest) if manifest is not None else self.dir / "job.json"
        self._name = name or (lambda key, side: f"part-{key}{'.' + side if side else ''}.parquet")
        self._check = check
        self._differences = differences or self._job_differences
        self.restart_option = restart_option
        self.adopt = adopt
        self.notify = notify or warn
        self._done: set[str] = set()
        #: File names of the damaged parts found by :meth:`resume` (deleted, computed again).
        self.discarded: list[str] = []

    def _job_differences(self, old: Any) -> list[str]:
        if not isinstance(old, dict):
            return [f"its {self.manifest.name} is not a job manifest"]
        return job_differences({k: v for k, v in old.items() if k not in self.info}, self.job)

    # ---------------------------------------------------------------- paths and locks

    def path(self, key: str, side: str = "") -> Path:
        """The file of unit ``key``'s main part (``side=""``) or of its side part ``side``."""
        return self.dir / self._name(key, side)

    def lock(self, target: str | os.PathLike[str], option: str | None = None) -> Any:
        """The write lock of the run's output ``target`` (one writer at a time, a second
        refused at once naming ``option``, default :attr:`field`): ``with store.lock(out): ...``."""
        return exclusive_lock(target, option or self.field)

    def finished(self, output: str | os.PathLike[str]) -> bool:
        """:func:`finished` for this store's folder."""
        return finished(output, self.dir)

    # ---------------------------------------------------------------- opening

    def open(self, restart: bool = False) -> PartStore:
        """:meth:`resume` (or start) the run and write its manifest: the usual first call."""
        self.resume(restart)
        self.start()
        return self

    def resume(self, restart: bool = False) -> bool:
        """Check the folder against the job before any unit is computed. True: it holds this
        job's manifest (its parts are verified, the damaged ones discarded); False: a new
        run. Another job's parts, or parts without a manifest, are refused
        (:class:`InputError` on :attr:`field`) unless ``restart`` (they are deleted)."""
        shutil.rmtree(self._trash(), ignore_errors=True)  # left by a run killed while removing its parts
        if self.dir.exists() and not self.dir.is_dir():
            raise InputError(self.field, f"{self.dir} (where the part files go) is a file",
                             f"remove it or choose another {self.field}")
        why = self._mismatch()
        if why is not None:
            if not restart:
                # the folder that holds the manifest and the parts: deleting it starts over
                root = self.dir if self.manifest.parent == self.dir else self.manifest.parent
                fix = f"rerun with the options recorded in {self.manifest.name} to resume, or delete {root}"
                if self.restart_option:
                    fix += f" (or pass {self.restart_option}) to discard them and start over"
                else:
                    fix += " to start over"
                raise InputError(self.field, f"{root} holds the parts of a run with other settings: {why}", fix)
            shutil.rmtree(self.dir)
            if self.manifest.parent != self.dir:
                self.manifest.unlink(missing_ok=True)
        resumed = self.manifest.is_file()
        if self.dir.is_dir() and (resumed or self.adopt):
            remove_temp_files(self.dir, tuple(self._file_names()))
            self._verify()
        return resumed

    def start(self) -> None:
        """Create the folder and write the manifest (once; a resumed run keeps its own)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.manifest.is_file():
            atomic_write_json(self.manifest, {**self.job, **self.info})

    def _mismatch(self) -> str | None:
        """Why the folder cannot be resumed by this job (None: it can, or there is nothing)."""
        if self.manifest.is_file():
            try:
                old = read_json(self.manifest, f"delete {self.dir}")
            except CorruptFileError:
                return f"its {self.manifest.name} is damaged"
            diff = self._differences(old)
            return "; ".join(diff) if diff else None
        if not self.adopt and self.dir.is_dir() and any(f.name.endswith(".parquet") for f in self.dir.iterdir()):
            return f"it has no {self.manifest.name} (left by a run that was stopped while starting)"
        return None

    def _file_names(self) -> list[str]:
        names = [self.manifest.name] if self.manifest.parent == self.dir else []
        for key, sides in self.units.items():
            names += [self._name(key, s) for s in (*sides, "")]
        return names

    def _verify(self) -> None:
        """Check every part of the job (checksum, readable, the caller's check); a unit with a
        damaged file loses all its files and is computed again."""
        for key, sides in self.units.items():
            files = [self.path(key, s) for s in (*sides, "")]
            if not files[-1].exists():
                continue
            why = None
            for f in files:
                why = self._damage(key, f, is_main=f == files[-1])
                if why is not None:
                    self.notify(f"discarded the damaged part file {f} ({why}); it is recomputed")
                    self.discarded.append(f.name)
                    break
            if why is None:
                self._done.add(key)
            else:
                for f in files:
                    f.unlink(missing_ok=True)

    def _damage(self, key: str, f: Path, is_main: bool) -> str | None:
        if not f.is_file():
            return "missing"
        try:
            df = read_checked_parquet(f, _FIX, legacy="refuse")  # a part without a checksum is refused
        except CorruptFileError as exc:
            return exc.problem
        return self._check(key, df) if is_main and self._check is not None else None

    # ---------------------------------------------------------------- units

    def done(self, key: str) -> bool:
        """Whether unit ``key`` has intact parts (verified by :meth:`resume`, or written since)."""
        return key in self._done and self.path(key).is_file()

    def pending(self) -> list[str]:
        """The units still to compute, in the output's order."""
        return [k for k in self.units if not self.done(k)]

    def write(self, key: str, df: pl.DataFrame, sides: Mapping[str, pl.DataFrame] | None = None) -> None:
        """Write unit ``key``: its side parts first, then its main part (each atomically, with
        its checksum); the unit is done once the main part is there."""
        for side, frame in (sides or {}).items():
            write_checked_parquet(frame, self.path(key, side))
        write_checked_parquet(df, self.path(key))
        self._done.add(key)

    def read(self, key: str, side: str = "") -> pl.DataFrame:
        """A part, its checksum verified (:class:`CorruptFileError` naming it if damaged)."""
        return read_checked_parquet(self.path(key, side), _FIX, legacy="refuse")

    def collect(self, side: str = "", empty: pl.DataFrame | None = None) -> pl.DataFrame:
        """Every unit's part (``side``: their side parts) in the order of the units, as one
        frame; empty parts add nothing, and no rows at all gives ``empty`` (default a frame
        without columns). Every unit must be done."""
        keys = [k for k, sides in self.units.items() if not side or side in sides]
        frames = [f for f in (self.read(k, side) for k in keys) if f.height]
        if not frames:
            return empty if empty is not None else pl.DataFrame()
        return pl.concat(frames, how="diagonal_relaxed")

    # ---------------------------------------------------------------- the end

    def _trash(self) -> Path:
        return _trash(self.dir)

    def remove(self) -> None:
        """Remove the parts folder, the last step of a finished run: renamed first (atomic),
        then deleted, so a kill while deleting never leaves a half-deleted folder that a
        rerun would take for a resumable one."""
        if self.dir.exists():
            shutil.rmtree(self._trash(), ignore_errors=True)
            os.replace(self.dir, self._trash())
        shutil.rmtree(self._trash(), ignore_errors=True)
