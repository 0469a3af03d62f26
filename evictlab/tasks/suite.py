"""The task suite: the families, models and contexts the evaluation grid defaults to, and
which of their cells are kept (ours).

A cell is one (model, task, context). The suite keeps a cell only where the full cache
(no eviction) answers at least :data:`KEEP_ACCURACY` of its questions, because a method can
only be shown to lose accuracy where there is accuracy to lose; the other cells are
reported, labelled as floors (:func:`label_floors`). The full cache's accuracy per cell,
with its prompt-clustered bootstrap interval, comes from ``benchmarks/task_floor.py``
(docs/evaluation.md, "The task suite"); this module only applies the rule to that table,
so it needs no model.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from evictlab.errors import InputError

__all__ = ["FLOOR_COLUMNS", "KEEP_ACCURACY", "SUITE_CONTEXTS", "SUITE_MODELS", "SUITE_TASKS", "kept_cells",
           "label_floors", "suite_tasks"]

#: The registry models the suite is chosen for.
SUITE_MODELS: tuple[str, ...] = ("smollm2-135m", "gemma3-270m")
#: Context lengths (tokens) the suite is chosen for.
SUITE_CONTEXTS: tuple[int, ...] = (1024, 2048, 4096)
#: The task families of the suite: the candidates the n = 4 probe at 1k left (docs/evaluation.md,
#: "The task suite"); the full-size task_floor run decides which cells are kept.
SUITE_TASKS: tuple[str, ...] = ("needle", "needle_word", "multi_key", "keys_number", "keys_tagged",
                                "keys_number_prose")
#: A cell is kept when the full cache's accuracy (exact match, the point estimate) is at least this.
KEEP_ACCURACY = 0.8
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
