"""What the evaluation claims share: pairing two arms on the same examples, the pooled
interval (the resampling engine, :mod:`evictlab.stats.bootstrap`), the "paper vs ours"
verdict (:func:`evictlab.stats.claims.versus`, the one vocabulary) and the fields of a claim row.

Answers are paired by (example, question) (:data:`evictlab.eval.compare.PAIR_ON`; a frame
without the question columns has one question per example,
:func:`~evictlab.eval.compare.with_question_columns`), and arms only within one prefill.
Each claim row pools every (task, context, budget) comparison of one (model, method): the
mean difference with a 95% percentile-bootstrap interval that resamples whole contexts (a
context = one (task, context length, example index), with all its questions and budgets),
and the range of the per-comparison means (each with its own whole-context interval). Our numbers are never adjusted to agree; small models sit at floors,
so the full cache's accuracy is printed beside each (docs/evaluation.md).

A claim recognises a scorer or allocator family by its registry name (:func:`family`): an arm
with bracket parameters (``snapkv[window=64]``, ``snapkv+contourkv[ranking=query]``) belongs
to its family and stays an arm of its own (its ``method``, ``scorer`` and ``allocator`` texts
keep the brackets).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from evictlab.eval.compare import PAIR_ON, context_design, with_question_columns
from evictlab.methods.registry import base_name
from evictlab.report.markdown import ci
from evictlab.stats.bootstrap import Design, bootstrap_mean
from evictlab.stats.claims import versus, weights_for

__all__ = ["INTERVAL", "PAIR_ON", "claim_fields", "contexts", "detail_table", "family", "full_em", "full_note", "paired", "points_text", "pooled_mean",
           "versus", "with_question_columns"]

INTERVAL = ("95% percentile bootstrap, resampling whole contexts (one task, context length and example index, with "
            "all its questions and budgets); answers paired across the two arms by (example, question)")
"""How the claim rows' intervals were resampled (the ``interval`` column)."""


def family(column: str) -> pl.Expr:
    """The registry names of a ``scorer`` / ``allocator`` column
    (:func:`evictlab.methods.registry.base_name`: ``trimkv[gates=x]`` -> ``trimkv``): what a
    claim tests family membership on (``family("allocator").is_in(CONTOUR_ALLOCATORS)``)."""
    return pl.col(column).map_elements(base_name, return_dtype=pl.Utf8)


def paired(results: pl.DataFrame, on: list[str], a: pl.Expr, b: pl.Expr) -> pl.DataFrame:
    """Rows of arm ``a`` joined with arm ``b`` on ``on`` + (example, question) (suffix ``_b``);
    ``results`` gets the question columns where it lacks them (:func:`with_question_columns`)."""
    results = with_question_columns(results)
    return results.filter(a).join(results.filter(b), on=[*on, *PAIR_ON], suffix="_b", how="inner")


def full_em(results: pl.DataFrame) -> pl.DataFrame:
    """The full cache's exact match per (model, task, context), column ``full_em``."""
    return (results.filter(pl.col("method") == "full").group_by(["model", "task", "context"])
            .agg(full_em=pl.col("exact_match").mean()))


def pooled_mean(rows: pl.DataFrame, diff: str, key: str, seed: int, n_boot: int) -> tuple[float, float, float]:
    """Mean of ``diff`` in points with its bootstrap interval, resampling whole contexts (one
    task, context length and example index, each with all its rows: questions and budgets)
    across every comparison of ``rows``."""
    clusters = rows.select(pl.format("{}|{}|{}", "task", "context", "example")).to_series().to_numpy()
    e = bootstrap_mean(rows[diff].to_numpy() * 100.0, seed=seed, key=key, n_boot=n_boot,
                       clusters=Design.whole_clusters(clusters, "context"))
    return e.value, e.lo, e.hi


def detail_table(j: pl.DataFrame, on: list[str], name: str, stats: Any, results: pl.DataFrame, seed: int,
            n_boot: int) -> pl.DataFrame:
    """One row per comparison (``on``): the mean of ``d`` in points as ``name`` with its
    whole-context bootstrap interval, ``n`` paired answers from ``contexts`` contexts,
    ``stats(group)``, and the full cache's exact match."""
    rows = []
    for k, g in j.group_by(on, maintain_order=True):
        ex = g["example"].to_numpy()
        e = bootstrap_mean(g["d"].to_numpy() * 100.0, seed=seed, key="|".join(map(str, k)), n_boot=n_boot,
                           clusters=context_design(ex))
        rows.append({**dict(zip(on, k)), "n": g.height, "contexts": int(np.unique(ex).size), name: e.value,
                     f"{name}_lo": e.lo, f"{name}_hi": e.hi, **stats(g)})
    return pl.DataFrame(rows).join(full_em(results), on=["model", "task", "context"], how="left")


def claim_fields(model: str, g: pl.DataFrame, detail: pl.DataFrame) -> dict[str, str]:
    """The model, rows and budgets fields of a claim row."""
    return {"model": f"{model} ({weights_for(model, 'weights as loaded')})",
            "rows": f"{g.height} paired answers ({contexts(g)} contexts), {detail.height} "
                    f"comparison{'s' if detail.height != 1 else ''} ({', '.join(sorted(set(detail['task'])))})",
            "budgets": ", ".join(dict.fromkeys(detail["budget"].to_list()))}


def contexts(rows: pl.DataFrame) -> int:
    """Distinct contexts (model, task, context length, example index) among ``rows``."""
    return rows.select("model", "task", "context", "example").unique().height


def full_note(detail: pl.DataFrame) -> str:
    """The full cache's exact match over the comparisons' (task, context): a floor is said."""
    em = detail["full_em"].drop_nulls()
    if em.len() == 0:
        return "full cache exact match n/a"
    lo, hi = float(em.min()), float(em.max())
    note = f"full cache exact match {lo:.2f}-{hi:.2f}"
    return note + (" (at the floor: not readable as a method effect)" if hi <= 0.1 else "")


def points_text(v: float, lo: float, hi: float) -> str:
    """``+v [+lo, +hi] points`` (``n/a`` without data)."""
    return ci(v, lo, hi, 1, signed=True, unit=" points")
