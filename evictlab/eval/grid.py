"""Running a grid into a folder, cell by cell, resumably (:func:`run_grid`).

Layout of ``DIR`` (docs/evaluation.md):

    DIR/grid.json          the manifest: format version, the GridSpec, every cell's key,
                           the skipped combinations; written once the grid has passed the
                           checks that need its models (:func:`preflight`), never changed
    DIR/parts/<key>.parquet  one file per finished cell (atomic), rows of run_cell
    DIR/results.parquet    every part, in the grid's cell order (written when all are done)
    DIR/parts/<key>.trace.parquet, DIR/trace.parquet   with ``trace``: each evicting
                           cell's per-compression diagnostics, and all of them in order
    DIR/run_record.json    the run record (RunRecord), written last: marks a finished grid

Every Parquet file here carries its checksum (:func:`evictlab.io.write_checked_parquet`). The
parts are a part store (:mod:`evictlab.parts`, :func:`part_store`): a rerun with the same
grid resumes: cells whose part exists and is intact (checksum, columns, one row per example)
are not run again; a damaged part, or one without a checksum (an older evictlab), is named
in one warning line, discarded and run again. A different
grid into the same folder is refused (:class:`InputError` naming ``out``) with the fields
that differ. A grid refused by :func:`preflight` writes nothing (the corrected command
can use the same folder). One writer at a time (:func:`evictlab.io.exclusive_lock`). A killed run leaves
finished parts and at most a temporary file (removed on the next run), never a part or
``results.parquet`` that looks complete but is not.

Executors: ``map_cells(fn, cells)`` yields ``(cell, frame)`` for every cell as each
finishes (any order); the default runs them here, one after the other. With a remote
executor (``executor=``, ``eval run --executor ray``) every cell is one task
(:func:`run_cell_task`: :func:`evictlab.eval.runner.run_cell` on a worker, whose model and
full-cache references are cached per worker process), the checks that need the models
(:func:`preflight`) run as one task too (the driver needs no model and no GPU), and the
driver writes the parts, as here (``docs/cluster.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from evictlab.errors import CorruptFileError, InputError
from evictlab.eval.runner import RESULT_COLUMNS, check_context, check_lengths, load_cached, run_cell, run_cell_traced
from evictlab.eval.spec import GRID_VERSION, CellSpec, GridSpec

__all__ = ["CellTask", "CheckModels", "GridRun", "MapCells", "local_map", "preflight", "read_manifest", "remote_cells",
           "run_cell_task", "run_grid", "write_manifest"]

MANIFEST = "grid.json"
RESULTS = "results.parquet"
TRACE = "trace.parquet"
PARTS = "parts"

MapCells = Callable[[Callable[..., pl.DataFrame], list[CellSpec]], Iterable[tuple[CellSpec, pl.DataFrame]]]
"""``map_cells(run_cell, cells)`` -> ``(cell, frame)`` pairs as cells finish."""


@dataclass(frozen=True)
class GridRun:
    """What :func:`run_grid` did: the folder, the cells run now, resumed (already done)."""

    out: Path
    cells: int
    ran: int
    resumed: int
    results: Path


def local_map(progress: Callable[[int], None] | None = None) -> MapCells:
    """The local executor: cells one after the other in this process (``progress`` gets 1
    per example)."""

    def map_cells(fn: Callable[..., pl.DataFrame], cells: list[CellSpec]) -> Iterator[tuple[CellSpec, pl.DataFrame]]:
        for cell in cells:
            yield cell, fn(cell, progress)

    return map_cells


@dataclass(frozen=True)
class CellTask:
    """One remote task: ``cell`` on ``threads`` torch CPU threads."""

    cell: CellSpec
    threads: int


def run_cell_task(task: CellTask) -> Any:
    """:func:`~evictlab.eval.runner.run_cell` on a worker, with the task's torch threads
    (:func:`~evictlab.eval.runner.run_cell_traced` for a traced cell: ``(frame, trace)``)."""
    import torch

    torch.set_num_threads(task.threads)
    return run_cell_traced(task.cell) if _traced(task.cell) else run_cell(task.cell)


def preflight_task(task: tuple[GridSpec, list[CellSpec], int]) -> None:
    """:func:`preflight` on a worker (``(spec, cells, threads)``); its InputError reaches the driver."""
    import torch

    spec, cells, threads = task
    torch.set_num_threads(threads)
    preflight(spec, cells)


CheckModels = Callable[[GridSpec, list[CellSpec]], None]
"""``check_models(spec, cells)``: the checks that need the models (:func:`preflight`)."""


def remote_cells(executor: Any, threads: int, device: str,
                 on_progress: Callable[..., None] | None = None) -> tuple[MapCells, CheckModels]:
    """``(map_cells, check_models)`` over a remote executor (:mod:`evictlab.executor`): one
    task per cell with ``threads`` CPUs (1 if 0) and one GPU when ``device`` is CUDA, and
    :func:`preflight` as one task; ``on_progress`` gets the executor's task counts."""
    import contextlib

    from evictlab.executor import TaskSpec

    spec = TaskSpec(cpus=threads or 1, gpus=1 if device.startswith("cuda") else 0)

    def map_cells(fn: Callable[..., pl.DataFrame], cells: list[CellSpec]) -> Iterator[tuple[CellSpec, pl.DataFrame]]:
        if fn is not run_cell and fn is not run_cell_traced:
            raise ValueError("a remote executor runs run_cell (or run_cell_traced) only")
        tasks = [CellTask(c, threads or 1) for c in cells]
        with contextlib.closing(executor.map(run_cell_task, tasks, spec=spec, on_progress=on_progress)) as it:
            for task, frame in it:
                yield task.cell, frame

    def check_models(grid: GridSpec, cells: list[CellSpec]) -> None:
        list(executor.map(preflight_task, [(grid, cells, threads or 1)], spec=spec))

    return map_cells, check_models


def part_path(out: Path, cell: CellSpec) -> Path:
    return out / PARTS / f"{cell.key}.parquet"


def trace_path(out: Path, cell: CellSpec) -> Path:
    """The per-compression diagnostics of a traced evicting cell."""
    return out / PARTS / f"{cell.key}.trace.parquet"


def _traced(cell: CellSpec) -> bool:
    return cell.trace and not cell.is_full


def read_manifest(out: Path) -> dict[str, Any]:
    """The manifest of a grid folder (:class:`CorruptFileError` if damaged)."""
    from evictlab.io import read_json

    return _checked_manifest(read_json(out / MANIFEST, f"delete {out} and run the grid again"), out)


def _checked_manifest(d: Any, out: Path) -> dict[str, Any]:
    if not isinstance(d, dict) or d.get("version") != GRID_VERSION or "spec" not in d:
        raise CorruptFileError(str(out / MANIFEST), f"is not a version-{GRID_VERSION} grid manifest",
                               "run the grid into a new folder with this version of evictlab")
    return d


def _manifest(spec: GridSpec) -> dict[str, Any]:
    """What ``grid.json`` holds: the format version, the grid, its cells' keys, the skips."""
    return {"version": GRID_VERSION, "spec": spec.to_dict(), "cells": [c.key for c in spec.cells()],
            "skipped": spec.skipped()}


def part_store(spec: GridSpec, out: Path, notify: Callable[[str], None] | None = None) -> Any:
    """The grid's part store (:class:`evictlab.parts.PartStore`): a part per cell in
    ``out/parts`` (``<key>.parquet``, with ``<key>.trace.parquet`` written first for a traced
    cell), ``grid.json`` as its manifest, compared field by field of the grid (a manifest
    written by an earlier version reads with the defaults of the fields it lacks). A results
    part must hold the grid's columns and one row per example. A cell's key names
    everything it is computed from, so parts without a manifest (copied in from another
    grid) are verified and used."""
    from evictlab.parts import PartStore

    cells = {c.key: c for c in spec.cells()}

    def differences(old: Any) -> list[str]:
        return spec.differences(GridSpec.from_dict(_checked_manifest(old, out)["spec"]))

    def check(key: str, df: pl.DataFrame) -> str | None:
        if list(df.columns) != list(RESULT_COLUMNS) or df.height != cells[key].n:
            return f"holds {df.height} rows with other columns than a cell of this grid writes"
        return None

    return PartStore(out / PARTS, _manifest(spec), {k: ("trace",) if _traced(c) else () for k, c in cells.items()},
                     field="out", manifest=out / MANIFEST, name=lambda key, side: f"{key}{'.' + side if side else ''}.parquet",
                     check=check, differences=differences, adopt=True, notify=notify)


def _check_folder(out: Path) -> None:
    """Refuse (field ``out``) a folder that is neither new nor empty nor a grid's."""
    if (out / MANIFEST).exists():
        return
    if out.exists() and any(p.name != PARTS for p in out.iterdir() if not p.name.startswith(".")):
        raise InputError("out", f"{out} exists and is not a grid folder", "choose a new or empty folder")


def write_manifest(spec: GridSpec, out: Path) -> None:
    """Create ``out`` (if needed), its parts folder and its manifest: the grid, its cells'
    keys, the skips."""
    part_store(spec, out).start()


def preflight(spec: GridSpec, cells: list[CellSpec]) -> None:
    """Checks that need each model (loaded once, cached for the run): every budget against
    its geometry (below the always-kept floors, or at or above the full cache of the
    context: nothing to evict), every allocator against it (a ContourKV profile fitted on
    another model) and every example's length against the model's positions.
    :class:`InputError` (fields ``budgets``, ``contexts``, ``allocator_param``) before any
    cell runs and before anything is written."""
    from evictlab.eval.runner import cell_examples
    from evictlab.kv.budget import Budget
    from evictlab.kv.cache import register_ragged_attention
    from evictlab.models.geometry import model_geometry

    checked: set[tuple[Any, ...]] = set()
    for cell in cells:
        lm, tok = load_cached(cell.model, cell.device, attn_implementation=register_ragged_attention())
        ex_key = (cell.model, cell.task, cell.context)
        if ex_key not in checked:
            checked.add(ex_key)
            check_context(cell, lm)
            check_lengths(cell, lm, cell_examples(cell, tok))
        if cell.is_full or (cell.model, cell.context, cell.budget, cell.method, cell.mode) in checked:
            continue
        checked.add((cell.model, cell.context, cell.budget, cell.method, cell.mode))
        g = model_geometry(lm)
        cfg = cell.decode_config()
        try:
            tokens = cfg.budget_tokens(g, cell.context)
        except InputError as exc:
            raise InputError("budgets", f"{cell.budget} on {cell.model}: {exc.problem}", exc.fix) from None
        assert cfg.method is not None
        cfg.method.for_model(g)  # the allocator checks the model (e.g. a ContourKV profile of another geometry)
        full = g.full_cache_tokens(cell.context)
        if tokens >= full:
            raise InputError("budgets", f"{cell.budget} is {tokens} kept entries on {cell.model}, at or above the "
                             f"{full} entries of a full cache of the {cell.context}-token context: nothing would be "
                             "evicted", f"use budgets below {Budget('total_tokens', full).value}total for this context")


def run_grid(spec: GridSpec, out: str | Path, *, map_cells: MapCells | None = None,
             progress: Callable[[int], None] | None = None, on_start: Callable[[int, int], None] | None = None,
             record: Any = None, check_models: CheckModels | None = None,
             notify: Callable[[str], None] | None = None) -> GridRun:
    """Run (or resume) ``spec`` into the folder ``out``; see the module docstring.

    ``progress`` gets 1 per finished example (local executor); ``on_start(total_examples,
    done_examples)`` is called once the pending work is known; ``record`` is a
    :class:`~evictlab.record.RunRecord` written as ``run_record.json`` at the end;
    ``check_models`` replaces :func:`preflight` (a remote executor's, :func:`remote_cells`);
    ``notify`` gets one-line warnings (a damaged part discarded; default: stderr).
    """
    from evictlab.io import check_output_path, write_checked_parquet
    from evictlab.record import record_path

    out = check_output_path(out, "out", directory=True)
    cells = spec.cells()
    check = check_models or preflight
    parts = part_store(spec, out, notify)
    with parts.lock(out, "--out"):  # the option is named in the fix text too
        _check_folder(out)
        resume = parts.resume()  # a different grid is refused; every part there is verified first
        if not resume:
            # A grid refused by the checks that need the models leaves nothing behind, so the
            # corrected command can reuse the same --out.
            check(spec, cells)
        parts.start()
        todo = set(parts.pending())
        pending = [c for c in cells if c.key in todo]
        done = len(cells) - len(pending)
        if resume and pending:
            check(spec, pending)
        if on_start is not None:
            on_start(len(cells) * spec.n, done * spec.n)
        mapper = map_cells or local_map(progress)
        for cell, frame in mapper(run_cell_traced if spec.trace else run_cell, pending):
            sides = {}
            if isinstance(frame, tuple):  # run_cell_traced: (results, trace)
                frame, trace = frame
                if _traced(cell):
                    sides["trace"] = trace
            if list(frame.columns) != list(RESULT_COLUMNS) or frame.height != cell.n:
                raise RuntimeError(f"cell {cell.key} returned {frame.height} rows with columns {frame.columns}")
            parts.write(cell.key, frame, sides)
        results = parts.collect(empty=pl.DataFrame(schema=RESULT_COLUMNS))
        if spec.trace:
            write_checked_parquet(parts.collect("trace"), out / TRACE)
        write_checked_parquet(results, out / RESULTS)
        if record is not None:
            record.write(record_path(out, folder=True), outputs=[str(out / RESULTS)], cells=len(cells), ran=len(pending),
                         resumed=done, rows=results.height)
    return GridRun(out, len(cells), len(pending), done, out / RESULTS)
