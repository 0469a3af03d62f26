"""The task suite: the families, models and contexts the evaluation grid defaults to, and
which of their cells are kept (ours).

A cell is one (model, task, context). The suite keeps a cell only where the full cache
(no eviction) answers at least :data:`KEEP_ACCURACY` of its questions, because a method can
only be shown to lose accuracy where there is accuracy to lose; the other cells are
reported, labelled as floors (:func:`label_floors`). The full cache's accuracy per cell,
with its prompt-clustered bootstrap interval, comes from ``benchmarks/task_floor.py``
(docs/evaluation.md, "The task suite"); this module only applies the rule to that table,
so it needs no model.

The measured tables are shipped in ``data/task_floor/<model>/floor.parquet`` (one per model,
with the run's record and rows beside it); :func:`shipped_floors` reads them and
:func:`suite_grid` turns them into the grid's ``tasks = ["suite"]``: the suite's tasks, with
every floor cell of the asked models and contexts left out and named, with its accuracy, as
not run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from evictlab.errors import InputError

__all__ = ["FLOOR_COLUMNS", "FLOOR_DIR", "KEEP_ACCURACY", "SUITE", "SUITE_CONTEXTS", "SUITE_MODELS", "SUITE_TASKS",
           "floor_reason", "kept_cells", "label_floors", "shipped_floors", "suite_grid", "suite_tasks"]

#: The registry models the suite is chosen for.
SUITE_MODELS: tuple[str, ...] = ("smollm2-135m", "gemma3-270m")
#: Context lengths (tokens) the suite is chosen for.
SUITE_CONTEXTS: tuple[int, ...] = (1024, 2048, 4096)
#: The task families of the suite: the candidates the n = 4 probe at 1k left, and ``facts_word``
#: (added 2026-12-06: the first several-questions family both models answer; docs/evaluation.md,
#: "The task suite"); which of their cells are kept is measured in data/task_floor (suite_grid).
SUITE_TASKS: tuple[str, ...] = ("needle", "needle_word", "multi_key", "keys_number", "keys_tagged",
                                "keys_number_prose", "facts_word")
#: A cell is kept when the full cache's accuracy (exact match, the point estimate) is at least this.
KEEP_ACCURACY = 0.8
#: The ``tasks`` entry that stands for the suite (:func:`suite_grid`).
SUITE = "suite"
#: Where the measured floor tables are shipped (the repository's ``data/task_floor/``).
FLOOR_DIR = Path(__file__).resolve().parents[2] / "data" / "task_floor"
#: The columns :func:`label_floors` needs: the cell, the full cache's accuracy and its interval.
FLOOR_COLUMNS: tuple[str, ...] = ("model", "task", "context", "accuracy", "lo", "hi")


def label_floors(table: pl.DataFrame, keep: float = KEEP_ACCURACY) -> pl.DataFrame:
    """``table`` (one row per (model, task, context) with the full cache's ``accuracy`` in
    [0, 1] and its interval ``lo``/``hi``; other columns kept) with two columns added:
    ``kept`` (``accuracy >= keep``) and ``label`` (``"kept"`` or ``"floor"``), in the
    table's order. A missing column, a repeated cell, or an accuracy outside [0, 1] or null
    is an InputError naming it."""
    missing = [c for c in FLOOR_COLUMNS if c not in table.columns]
    if missing:
        raise InputError("table", f"missing column(s) {missing}",
                         f"pass one row per cell with the columns {', '.join(FLOOR_COLUMNS)}")
    if not 0.0 <= keep <= 1.0:
        raise InputError("keep", f"{keep} is not an accuracy", "use a value in [0, 1]")
    dup = table.group_by(["model", "task", "context"]).len().filter(pl.col("len") > 1)
    if dup.height:
        r = dup.row(0, named=True)
        raise InputError("table", f"cell ({r['model']}, {r['task']}, {r['context']}) appears {r['len']} times",
                         "pass one row per (model, task, context)")
    acc = table["accuracy"].cast(pl.Float64)
    bad = acc.is_null() | acc.is_nan() | (acc < 0) | (acc > 1)
    if bad.any():
        r = table.filter(bad).row(0, named=True)
        raise InputError("table", f"accuracy {r['accuracy']!r} of ({r['model']}, {r['task']}, {r['context']}) "
                         "is not in [0, 1]", "pass exact-match accuracies as fractions")
    kept = acc >= keep
    return table.with_columns(kept=kept, label=pl.when(kept).then(pl.lit("kept")).otherwise(pl.lit("floor")))


def kept_cells(table: pl.DataFrame, keep: float = KEEP_ACCURACY) -> list[tuple[str, str, int]]:
    """The ``(model, task, context)`` cells of ``table`` that :func:`label_floors` keeps, in order."""
    t = label_floors(table, keep).filter(pl.col("kept"))
    return [(str(m), str(k), int(c)) for m, k, c in t.select("model", "task", "context").iter_rows()]


def suite_tasks(table: pl.DataFrame, keep: float = KEEP_ACCURACY,
                models: Sequence[str] = SUITE_MODELS) -> list[str]:
    """The tasks of ``table`` kept in at least one cell of every model of ``models`` (those
    that can discriminate on all of them), in the table's order."""
    t = label_floors(table, keep)
    out = []
    for task in t["task"].unique(maintain_order=True).to_list():
        g = t.filter(pl.col("task") == task)
        if all(g.filter((pl.col("model") == m) & pl.col("kept")).height for m in models):
            out.append(str(task))
    return out


def shipped_floors(folder: Path = FLOOR_DIR) -> pl.DataFrame:
    """Every ``<model>/floor.parquet`` under ``folder`` (the tables ``benchmarks/task_floor.py``
    writes), checksums verified, concatenated and labelled (:func:`label_floors`). An empty
    frame with :data:`FLOOR_COLUMNS` when none is shipped."""
    from evictlab.io import read_checked_parquet

    paths = sorted(folder.glob("*/floor.parquet")) if folder.is_dir() else []
    if not paths:
        return pl.DataFrame(schema={"model": pl.String, "task": pl.String, "context": pl.Int64,
                                    "accuracy": pl.Float64, "lo": pl.Float64, "hi": pl.Float64})
    frames = [read_checked_parquet(p, "restore it from git (git checkout -- data/task_floor)") for p in paths]
    try:
        return label_floors(pl.concat(frames, how="diagonal_relaxed"))
    except InputError as exc:  # e.g. a cell measured in two folders: name the folder, not a frame
        raise InputError("tasks", f"the floor tables in {folder} do not add up: {exc.problem}",
                         f"keep one measurement of each cell under {folder}") from None


def floor_reason(row: dict[str, object], keep: float = KEEP_ACCURACY) -> str:
    """The line that says why a floor cell is not run: its full-cache accuracy and interval."""
    return (f"floor: the full cache answers {float(row['accuracy']):.2f} "  # type: ignore[arg-type]
            f"[{float(row['lo']):.2f}, {float(row['hi']):.2f}] of its questions, "  # type: ignore[arg-type]
            f"below the suite's {keep}")


def suite_grid(tasks: Sequence[str], models: Sequence[str], contexts: Sequence[int],
               table: pl.DataFrame | None = None,
               keep: float = KEEP_ACCURACY) -> tuple[list[str], list[tuple[str, str, int, str]]]:
    """``tasks`` with :data:`SUITE` replaced by :data:`SUITE_TASKS` (in place), and the
    ``(model, task, context, reason)`` cells of the suite's tasks that are floors in
    ``table`` (default :func:`shipped_floors`) for these ``models`` and ``contexts``.

    Without :data:`SUITE` in ``tasks`` the tasks come back unchanged and nothing is left
    out (named tasks are run as asked). A suite cell the table does not hold (a model or a
    context length nobody measured) is an InputError on ``tasks`` that says how to measure
    it; so is a grid in which every suite cell is a floor."""
    if SUITE not in tasks:
        return list(tasks), []
    if list(tasks).count(SUITE) > 1:
        raise InputError("tasks", f"{SUITE!r} is named twice", f"name {SUITE!r} once")
    named = [t for t in tasks if t != SUITE]
    both = [t for t in named if t in SUITE_TASKS]
    if both:
        raise InputError("tasks", f"{both[0]!r} is already one of the suite's tasks ({', '.join(SUITE_TASKS)})",
                         f"drop {both[0]!r} or {SUITE!r}")
    i = list(tasks).index(SUITE)
    expanded = [*tasks[:i], *SUITE_TASKS, *tasks[i + 1:]]
    t = label_floors(table) if table is not None else shipped_floors()
    by_cell = {(r["model"], r["task"], int(r["context"])): r for r in t.to_dicts()}
    floors: list[tuple[str, str, int, str]] = []
    for m in models:
        for task in SUITE_TASKS:
            for c in contexts:
                r = by_cell.get((m, task, int(c)))
                if r is None:
                    raise InputError("tasks", f"the suite has no full-cache measurement for ({m}, {task}, {c} "
                                     "tokens)", f"measure it: python benchmarks/task_floor.py --models {m} "
                                     f"--contexts {c} --out data/task_floor/{Path(m).name}-{c} (docs/evaluation.md), "
                                     "or name the tasks instead of 'suite'")
                if float(r["accuracy"]) < keep:
                    floors.append((m, task, int(c), floor_reason(r, keep)))
    if len(floors) == len(models) * len(SUITE_TASKS) * len(contexts) and not named:
        raise InputError("tasks", "every cell of the suite is a floor for these models and context lengths "
                         f"(the full cache scores below {keep} everywhere)", "use shorter contexts, or name the tasks")
    return expanded, floors
