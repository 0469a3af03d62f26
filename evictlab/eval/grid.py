"""Running a grid into a folder, unit by unit, resumably (:func:`run_grid`).

Layout of ``DIR`` (docs/evaluation.md):

    DIR/grid.json          the manifest: format version, the GridSpec, every cell's key,
                           every unit's key, the skipped combinations; written once the grid
                           has passed the checks that need its models (:func:`preflight`),
                           never changed
    DIR/parts/<key>.parquet  one file per finished unit (atomic): a one-pass grid's context
                           unit (one example of one (model, task, context): every cell's
                           rows for it, :func:`evictlab.eval.runner.run_context`), a chunked
                           grid's cell (:func:`evictlab.eval.runner.run_cell`)
    DIR/results.parquet    every row, sorted by the grid's cell order, then example, then
                           question (written when all units are done)
    DIR/parts/<key>.trace.parquet, DIR/trace.parquet   with ``trace``: each unit's
                           per-compression diagnostics, and all of them in unit order
    DIR/run_record.json    the run record (RunRecord), written last: marks a finished grid

Every Parquet file here carries its checksum (:func:`evictlab.io.write_checked_parquet`). The
parts are a part store (:mod:`evictlab.parts`, :func:`part_store`): a rerun with the same
grid resumes: units whose part exists and is intact (checksum, columns, the unit's cells and
examples, one row per question) are not run again; a damaged part, or one without a
checksum (an older evictlab), is named in one warning line, discarded and run again. A
different grid into the same folder is refused (:class:`InputError` naming ``out``) with the
fields that differ. A grid refused by :func:`preflight` writes nothing (the corrected command
can use the same folder). One writer at a time (:func:`evictlab.io.exclusive_lock`). A killed
run leaves finished parts and at most a temporary file (removed on the next run), never a
part or ``results.parquet`` that looks complete but is not.

Executors: ``map_cells(fn, units)`` yields ``(unit, frame)`` for every unit as each
finishes (any order); the default runs them here, one after the other. With another
executor (``executor=``: ``eval run --workers N``, local processes of one thread each, or
``--executor ray``) every unit is one task (:func:`run_cell_task`: the unit on a worker,
whose model, examples and references are cached per worker process), the checks that need
the models (:func:`preflight`) run as one task too (the driver needs no model and no GPU),
and the driver writes the parts, as here (``docs/cluster.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from evictlab.errors import CorruptFileError, InputError
from evictlab.eval.runner import RESULT_COLUMNS, check_context, check_lengths, load_cached, run_unit
from evictlab.eval.spec import GRID_VERSION, ONE_PASS, CellSpec, ContextUnit, GridSpec

__all__ = ["CellTask", "CheckModels", "ContextTask", "GridRun", "MapCells", "local_map", "preflight", "read_manifest",
           "remote_cells", "run_cell_task", "run_grid", "sort_results", "write_manifest"]

Unit = CellSpec | ContextUnit
"""A unit of work of a grid (:meth:`GridSpec.units`)."""

MANIFEST = "grid.json"
RESULTS = "results.parquet"
TRACE = "trace.parquet"
PARTS = "parts"

MapCells = Callable[[Callable[..., Any], list[Any]], Iterable[tuple[Any, Any]]]
"""``map_cells(fn, units)`` -> ``(unit, result)`` pairs as units finish; ``fn(unit, progress)``
returns the unit's frame (``(frame, trace)`` in a traced grid)."""


@dataclass(frozen=True)
class GridRun:
    """What :func:`run_grid` did: the folder, its cells and units (the cells of a chunked
    grid, the context units of a one-pass one), the units run now and resumed (already done)."""

    out: Path
    cells: int
    ran: int
    resumed: int
    results: Path
    units: int = 0


def local_map(progress: Callable[[int], None] | None = None) -> MapCells:
    """The local executor: units one after the other in this process (``progress`` gets 1
    per (cell, example) done)."""

    def map_cells(fn: Callable[..., Any], units: list[Any]) -> Iterator[tuple[Any, Any]]:
        for unit in units:
            yield unit, fn(unit, progress)

    return map_cells


@dataclass(frozen=True)
class CellTask:
    """One task of a chunked grid: ``cell`` on ``threads`` torch CPU threads."""

    cell: CellSpec
    threads: int

    @property
    def unit(self) -> CellSpec:
        return self.cell


@dataclass(frozen=True)
class ContextTask:
    """One task of a one-pass grid: the context ``unit`` on ``threads`` torch CPU threads."""

    unit: ContextUnit
    threads: int


def run_cell_task(task: CellTask | ContextTask) -> Any:
    """The task's unit on a worker (:func:`~evictlab.eval.runner.run_unit`), with the task's
    torch threads (``(frame, trace)`` for a traced unit)."""
    import torch

    torch.set_num_threads(task.threads)
    return run_unit(task.unit, None, _traced(task.unit))


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
    """``(map_cells, check_models)`` over another executor (:mod:`evictlab.executor`: Ray, or
    :class:`~evictlab.executor.processes.ProcessExecutor`): one task per unit with
    ``threads`` CPUs (1 if 0) and one GPU when ``device`` is CUDA, and
    :func:`preflight` as one task; ``on_progress`` gets the executor's task counts."""
    import contextlib

    from evictlab.executor import TaskSpec

    spec = TaskSpec(cpus=threads or 1, gpus=1 if device.startswith("cuda") else 0)

    def map_cells(fn: Callable[..., Any], units: list[Any]) -> Iterator[tuple[Any, Any]]:
        if fn is not _run_unit:
            raise ValueError("a remote executor runs the grid's units only")
        tasks = [ContextTask(u, threads or 1) if isinstance(u, ContextUnit) else CellTask(u, threads or 1)
                 for u in units]
        with contextlib.closing(executor.map(run_cell_task, tasks, spec=spec, on_progress=on_progress)) as it:
            for task, frame in it:
                yield task.unit, frame

    def check_models(grid: GridSpec, cells: list[CellSpec]) -> None:
        list(executor.map(preflight_task, [(grid, cells, threads or 1)], spec=spec))

    return map_cells, check_models


def part_path(out: Path, unit: Unit) -> Path:
    return out / PARTS / f"{unit.key}.parquet"


def trace_path(out: Path, unit: Unit) -> Path:
    """The per-compression diagnostics of a traced unit (a context unit, an evicting cell)."""
    return out / PARTS / f"{unit.key}.trace.parquet"


def _traced(unit: Unit) -> bool:
    if isinstance(unit, ContextUnit):
        return any(c.trace for c in unit.evicting)
    return unit.trace and not unit.is_full


def _run_unit(unit: Unit, progress: Callable[[int], None] | None = None) -> Any:
    """What a grid runs per unit (:func:`~evictlab.eval.runner.run_unit`, traced as the grid is)."""
    return run_unit(unit, progress, _traced(unit))


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
    """What ``grid.json`` holds: the format version, the grid, its cells' and units' keys, the skips."""
    return {"version": GRID_VERSION, "spec": spec.to_dict(), "cells": [c.key for c in spec.cells()],
            "units": [u.key for u in spec.units()], "skipped": spec.skipped()}


def part_store(spec: GridSpec, out: Path, notify: Callable[[str], None] | None = None) -> Any:
    """The grid's part store (:class:`evictlab.parts.PartStore`): a part per unit in
    ``out/parts`` (``<key>.parquet``, with ``<key>.trace.parquet`` written first for a traced
    unit), ``grid.json`` as its manifest, compared field by field of the grid (a manifest
    written by an earlier version reads with the defaults of the fields it lacks). A results
    part must hold the grid's columns, the unit's cells and examples, each with the same
    questions, one row each. A unit's key names everything it is computed from, so parts
    without a manifest (copied in from another grid) are verified and used."""
    from evictlab.parts import PartStore

    units = {u.key: u for u in spec.units()}

    def differences(old: Any) -> list[str]:
        return spec.differences(GridSpec.from_dict(_checked_manifest(old, out)["spec"]))

    def check(key: str, df: pl.DataFrame) -> str | None:
        return _content_problem(units[key], df)

    return PartStore(out / PARTS, _manifest(spec), {k: ("trace",) if _traced(u) else () for k, u in units.items()},
                     field="out", manifest=out / MANIFEST, name=lambda key, side: f"{key}{'.' + side if side else ''}.parquet",
                     check=check, differences=differences, adopt=True, notify=notify)


def _content_problem(unit: Unit, df: pl.DataFrame) -> str | None:
    """Why ``df`` is not what ``unit`` computes (None: it is): the grid's columns, every cell
    of the unit with its examples, the same questions for each cell of an example, one row
    per (cell, example, question)."""
    if list(df.columns) != list(RESULT_COLUMNS):
        return "holds other columns than a unit of this grid writes"
    cells = [c.key for c in unit.cells] if isinstance(unit, ContextUnit) else [unit.key]
    examples = [unit.example] if isinstance(unit, ContextUnit) else list(range(unit.n))
    if df.height == 0 or sorted(set(df["cell"].to_list())) != sorted(cells):
        return "holds other cells than this unit computes"
    if df.select("cell", "example", "question").is_duplicated().any():
        return "holds a (cell, example, question) twice"
    per = df.group_by("cell", "example").agg(pl.col("question").sort(), pl.col("questions").first())
    if per.height != len(cells) * len(examples) or sorted(set(per["example"].to_list())) != examples:
        return f"holds other examples than {examples}"
    for qs, k in zip(per["question"].to_list(), per["questions"].to_list()):
        if qs != list(range(k)):
            return "holds another set of questions than each example asks"
    asked = per.group_by("example").agg(pl.col("questions").n_unique().alias("k"))
    if (asked["k"] != 1).any():
        return "holds other questions for one cell than for another"
    return None


def sort_results(spec: GridSpec, results: pl.DataFrame) -> pl.DataFrame:
    """``results`` sorted by the grid's cell order, then example, then question."""
    if results.height == 0:
        return results
    order = {c.key: i for i, c in enumerate(spec.cells())}
    return (results.with_columns(pl.col("cell").replace_strict(order, return_dtype=pl.Int64).alias("_order"))
            .sort(["_order", "example", "question"], maintain_order=True).drop("_order"))


@dataclass(frozen=True)
class PartialResults:
    """What a one-pass grid that is still running (or was stopped) has computed so far
    (:func:`partial_results`): ``results`` holds examples ``0 .. examples - 1`` of every cell
    (each complete in every (model, task, context)), ``units_done`` of ``units`` parts exist."""

    results: pl.DataFrame
    examples: int
    n: int
    units_done: int
    units: int

    def describe(self) -> str:
        """One line for a report: what the partial tables hold."""
        return (f"PARTIAL: the grid is not finished ({self.units_done} of {self.units} context units done); "
                f"these tables hold examples 0-{self.examples - 1} of every cell ({self.examples} of n = {self.n} "
                "contexts each), the same contexts for every arm")


def partial_results(spec: GridSpec, out: Path) -> PartialResults:
    """The rows of a one-pass grid's first complete examples, read while it runs or after it
    stopped (nothing is written or deleted; a part is written atomically, so one that exists
    is whole; each is checksum-verified and checked against its unit).

    The units run example by example (:meth:`GridSpec.units`), so the longest prefix of
    example numbers done in every (model, task, context) is what a partial table can hold
    with every arm compared on the same contexts. :class:`InputError` (field ``GRID``) for
    a chunked grid (its units are cells, not examples) and when no example is complete."""
    if spec.prefill != ONE_PASS:
        raise InputError("GRID", "a chunked grid's parts are whole cells, not examples",
                         "wait for the grid to finish, then run `evictlab eval compare` without --partial")
    store = part_store(spec, out)
    units = spec.units()
    done = {u.key for u in units if store.path(u.key).is_file()}
    k = 0
    while k < spec.n and all(u.key in done for u in units if u.example == k):
        k += 1
    if k == 0:
        raise InputError("GRID", f"no example of {out} is done in every (model, task, context) yet "
                         f"({len(done)} of {len(units)} context units done)",
                         "wait until the grid's first example is done everywhere, then rerun")
    frames = []
    for u in units:
        if u.example >= k:
            continue
        df = store.read(u.key)
        why = _content_problem(u, df)
        if why is not None:
            raise CorruptFileError(str(store.path(u.key)), why, "delete that part file and rerun `evictlab eval run`")
        frames.append(df)
    results = sort_results(spec, pl.concat(frames, how="diagonal_relaxed"))
    return PartialResults(results, k, spec.n, len(done), len(units))


def _check_folder(out: Path) -> None:
    """Refuse (field ``out``) a folder that is neither new nor empty nor a grid's."""
    if (out / MANIFEST).exists():
        return
    other = sorted(p.name for p in out.iterdir() if p.name != PARTS and not p.name.startswith(".")) if out.exists() else []
    if other:
        # Parts alone are adopted (a grid committed part-way is resumed from its parts/);
        # anything else beside them, a note included, could pass for another grid's output.
        shown = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
        raise InputError("out", f"{out} exists and is not a grid folder (no {MANIFEST}; it holds {shown})",
                         f"choose a new or empty folder, or one holding only the {PARTS}/ of this grid")


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
        cfg.method.check_weights(lm)  # gates=default: shipped gates for these weights
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

    ``progress`` gets 1 per finished (cell, example) (local executor); ``on_start(total,
    done)`` is called once the pending work is known, in (cell, example) pairs; ``record`` is a
    :class:`~evictlab.record.RunRecord` written as ``run_record.json`` at the end;
    ``check_models`` replaces :func:`preflight` (a remote executor's, :func:`remote_cells`);
    ``notify`` gets one-line warnings (a damaged part discarded; default: stderr).
    """
    from evictlab.io import check_output_path, write_checked_parquet
    from evictlab.record import record_path

    out = check_output_path(out, "out", directory=True)
    cells = spec.cells()
    units = spec.units()
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
        pending = [u for u in units if u.key in todo]
        done = len(units) - len(pending)
        if resume and pending:
            check(spec, _cells_of(pending))
        if on_start is not None:
            on_start(sum(_pairs(u) for u in units), sum(_pairs(u) for u in units if u.key not in todo))
        mapper = map_cells or local_map(progress)
        for unit, frame in mapper(_run_unit, pending):
            sides = {}
            if isinstance(frame, tuple):  # traced: (results, trace)
                frame, trace = frame
                if _traced(unit):
                    sides["trace"] = trace
            why = _content_problem(unit, frame)
            if why is not None:
                raise RuntimeError(f"unit {unit.key} returned {frame.height} rows that are not its own: {why}")
            parts.write(unit.key, frame, sides)
        results = sort_results(spec, parts.collect(empty=pl.DataFrame(schema=RESULT_COLUMNS)))
        if spec.trace:
            write_checked_parquet(parts.collect("trace"), out / TRACE)
        write_checked_parquet(results, out / RESULTS)
        if record is not None:
            record.write(record_path(out, folder=True), outputs=[str(out / RESULTS)], cells=len(cells),
                         units=len(units), ran=len(pending), resumed=done, rows=results.height)
    return GridRun(out, len(cells), len(pending), done, out / RESULTS, len(units))


def _pairs(unit: Unit) -> int:
    """The (cell, example) pairs of a unit (the progress count)."""
    return len(unit.cells) if isinstance(unit, ContextUnit) else unit.n


def _cells_of(units: list[Any]) -> list[CellSpec]:
    """The cells of ``units``, each once, in order."""
    out: dict[str, CellSpec] = {}
    for u in units:
        for c in (u.cells if isinstance(u, ContextUnit) else (u,)):
            out.setdefault(c.key, c)
    return list(out.values())
