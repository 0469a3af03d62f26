"""The free-weight ablation re-solve: e(T_s) and its alternative free-weight errors, from the rows.

For a seeded sample of rows of a row dataset (stratified by prompt), every (row, s) of the
solver results gets e(T_s) recomputed and the errors of the labelled free-weight
definitions (docs/theory.md, section 3) solved exactly by :mod:`evictlab.core.reference`:
the affine hull, the cone of the kept values (scipy's NNLS) and the span.
:func:`evictlab.stats.penalty.penalty_table` summarises the output.
"""

from __future__ import annotations

import math
import os

import numpy as np
import polars as pl

from evictlab.errors import CorruptFileError, InputError


def _sample_rows(meta: pl.DataFrame, max_rows: int | None, seed: int) -> np.ndarray:
    """Row ids: all, or up to ``max_rows`` drawn evenly over prompts (seeded per prompt)."""
    ids = meta["row_id"].to_numpy()
    if max_rows is None or ids.size <= max_rows:
        return np.sort(ids)
    prompts = sorted(meta["prompt_id"].unique().to_list())
    per = max(1, math.ceil(max_rows / len(prompts)))
    out = []
    for pid in prompts:
        pool = meta.filter(pl.col("prompt_id") == pid)["row_id"].to_numpy()
        rng = np.random.default_rng([int(seed), int(pid), 31])
        out.append(np.sort(rng.choice(pool, size=min(per, pool.size), replace=False)))
    return np.concatenate(out)


def _nonneg(p: np.ndarray, v: np.ndarray, kept: np.ndarray) -> float:
    """e_nn by scipy's NNLS (compiled; the numpy reference :func:`evictlab.core.reference.nonneg_error`
    is tested equal to it): distance from mu to the cone of the kept values."""
    from scipy.optimize import nnls

    p_n = p / p.sum()
    return float(nnls(v[kept].T, p_n @ v, maxiter=50 * (len(kept) + 5))[1])


def ablation_rows(rows_path: str | os.PathLike[str], results: pl.DataFrame, *, model: str | None = None,
                  max_rows: int | None = 600, seed: int = 0) -> pl.DataFrame:
    """Per (row, s) of a sample of ``rows_path``: e(T_s) and its free-weight alternatives.

    ``results``: the solver results of those rows (a prepared table; ``model`` selects one
    model's rows). The rows are a seeded sample of at most ``max_rows`` rows spread evenly
    over prompts (None: all). e(T_s) is recomputed from the rows and must equal the
    results' ``e_top`` (else the rows and results do not belong together: CorruptFileError).
    Columns: ``model, row_id, prompt_id, s, head_dim, e_top, e_hull, e_aff, e_nn, e_ls``.
    """
    from evictlab.core import reference as R
    from evictlab.rows import RowStore

    store = RowStore.open(rows_path)
    res = results if model is None else results.filter(pl.col("model") == model)
    if res.height == 0:
        raise InputError("results", f"no rows of model {model!r}", "pass the results of these rows")
    ids = _sample_rows(store.meta.filter(pl.col("row_id").is_in(res["row_id"].unique().implode())), max_rows, seed)
    budgets = sorted(int(s) for s in res["s"].unique().to_list())
    batch = store.get_rows(ids)
    out: dict[str, list[float | int]] = {k: [] for k in ("row_id", "s", "e_ref", "e_aff", "e_nn", "e_ls")}
    for i, rid in enumerate(batch.meta["row_id"].to_list()):
        p, v = batch.row(i)
        for s in budgets:
            if s >= p.shape[0]:
                continue
            kept = R.top_mass_set(p, s)
            out["row_id"].append(int(rid))
            out["s"].append(s)
            out["e_ref"].append(R.forced_error(p, v, kept))
            out["e_aff"].append(R.affine_error(p, v, kept))
            out["e_nn"].append(_nonneg(p, v, kept))
            out["e_ls"].append(R.least_squares_error(p, v, kept))
    abl = pl.DataFrame(out, schema={"row_id": pl.Int64, "s": pl.Int64, "e_ref": pl.Float64, "e_aff": pl.Float64,
                                    "e_nn": pl.Float64, "e_ls": pl.Float64})
    cols = ["model", "row_id", "prompt_id", "s", "e_top", "e_free_top"]
    joined = abl.join(res.select(cols), on=["row_id", "s"], how="inner")
    if joined.height != abl.height:
        raise CorruptFileError(str(rows_path), f"{abl.height - joined.height} (row, s) pairs have no solver result",
                               "pass the results solved from these rows")
    bad = (joined["e_ref"] - joined["e_top"]).abs() > 1e-6 * (1.0 + joined["e_top"].abs())
    if bad.any():
        raise CorruptFileError(str(rows_path), f"e(T_s) recomputed from the rows differs from the results' e_top in "
                               f"{int(bad.sum())} pairs", "pass the rows these results were solved from")
    return joined.select("model", "row_id", "prompt_id", "s", pl.lit(store.head_dim).alias("head_dim"), "e_top",
                         pl.col("e_free_top").alias("e_hull"), "e_aff", "e_nn", "e_ls")
