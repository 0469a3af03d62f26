"""Selection ceilings and forced-weight penalties, per (model, s) or finer groups.

One output row per group, named columns (see :data:`SUMMARY_COLUMNS` in docs/statistics.md):

- ``gap_closed`` g(s) = (e(T_s) - ES_hat(s)) / e(T_s): median with a bootstrap CI, and the
  10/25/75/90 % quantiles (the distribution);
- ``kappa_hat`` = e(T_s)/max(ES_hat, eps): median with CI, and the fraction above the
  significance threshold (default 1.11);
- ``pi_top`` = e(T_s)/e_free(T_s) and ``pi_opt`` = e(A*)/e_free(A*): medians with CIs
  (the forced-weight penalty pi(s) at T_s and at the argmin); non-finite ratios (e_free = 0)
  are counted in ``pi_nonfinite`` and excluded from the median;
- the balancing selector: median gap closed with CI, and the fraction of rows where it
  reaches ES_hat;
- with certified optima (``es_cert``): rows certified, and the fraction where the certified
  optimum is strictly below the pool optimum (the pool missed the global optimum).

Rows with e(T_s) = 0 are excluded from every ratio and counted in ``rows_e_top_zero``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import polars as pl

from evictlab.stats.bootstrap import Design, Estimate, Mean, Median, bootstrap, icc_oneway, rank_icc
from evictlab.stats.results import ABS_TOL, REL_TOL

DEFAULT_THRESHOLD = 1.11

#: Grouping levels reported by :func:`summarize_all`.
LEVELS: dict[str, tuple[str, ...]] = {
    "model_s": ("model", "s"),
    "model_s_layer": ("model", "s", "layer"),
    "model_s_layer_head": ("model", "s", "layer", "head"),
}
#: Cluster levels of the resampling design, outermost first (columns of the results table):
#: models, then prompts within a model, then attention rows within a prompt (one row has an
#: observation per budget s). Levels that are constant within a group drop out.
CLUSTER_LEVELS: tuple[str, ...] = ("model", "prompt_id", "row_id")
_LEVEL_NAMES = {"model": "model", "prompt_id": "prompt", "row_id": "row"}
#: Statistics that also get the row bootstrap as a comparison (``compare_rows``).
COMPARED = ("gap_closed_median", "frac_significant", "pi_top_median")
#: The statistics of a summary row: column prefix -> (source column, kind). ``median``
#: statistics use finite values only; the ICC of a median is the rank ICC.
STATISTICS: dict[str, tuple[str, str]] = {
    "gap_closed_median": ("gap_closed", "median"),
    "kappa_hat_median": ("kappa_hat", "median"),
    "frac_significant": ("kappa_hat", "significant"),
    "pi_top_median": ("pi_top", "median"),
    "pi_opt_median": ("pi_opt", "median"),
    "bal_gap_closed_median": ("bal_gap_closed", "median"),
    "bal_reaches_opt_frac": ("bal_reaches_opt", "fraction"),
}


def _est_cols(prefix: str, e: Estimate) -> dict[str, float]:
    return {prefix: e.value, f"{prefix}_lo": e.lo, f"{prefix}_hi": e.hi}


def _finite(a: np.ndarray) -> np.ndarray:
    return a[np.isfinite(a)]


@dataclass(frozen=True)
class Clusters:
    """The cluster levels of a whole results table, coded once (see :data:`CLUSTER_LEVELS`).

    ``codes[k]``: int64 per observation, nested-unique (prompt 0 of two models gets two
    codes); ``prompt``: the code of (model, prompt) per observation, for the ICC (None
    without a ``prompt_id`` column).
    """

    names: tuple[str, ...]
    codes: tuple[np.ndarray, ...]
    prompt: np.ndarray | None

    @classmethod
    def of(cls, df: pl.DataFrame, levels: Sequence[str] | None = CLUSTER_LEVELS) -> "Clusters":
        cols = [c for c in (levels or ()) if c in df.columns]
        if not cols or df.height == 0:
            return cls((), (), None)
        d = Design.nested([df[c].to_numpy() for c in cols], [_LEVEL_NAMES.get(c, c) for c in cols])
        prompt = None
        if "prompt_id" in cols:
            prompt = d.codes[cols.index("prompt_id")]
        return cls(d.names, d.codes, prompt)

    def design(self, idx: np.ndarray) -> Design:
        """The design of the observations ``idx``: levels constant on them dropped (resampling
        one cluster out of one changes nothing), except the prompt level, kept so that a group
        from a single prompt is labelled as such; the innermost level always stays."""
        idx = np.asarray(idx, dtype=np.int64)
        if not self.codes or idx.size == 0:
            return Design.rows(idx.size)
        codes, names = [], []
        last = len(self.codes) - 1
        for k, (c, name) in enumerate(zip(self.codes, self.names)):
            sub = c[idx]
            if name != "prompt" and k != last and sub.min() == sub.max():
                continue
            codes.append(sub)
            names.append(name)
        # a drawn attention row brings all its observations (one per budget s), never a resample of them
        return Design.from_codes(codes, names, whole_leaves=names[-1] == "row")


def design_for(df: pl.DataFrame, levels: Sequence[str] | None = CLUSTER_LEVELS) -> Design:
    """The resampling design of one group of a results table (see :meth:`Clusters.design`).

    ``levels=None``, or no such column: the row bootstrap.
    """
    return Clusters.of(df, levels).design(np.arange(df.height))


def _stats(cols: dict[str, np.ndarray], idx: np.ndarray, threshold: float
           ) -> tuple[dict[str, object], dict[str, np.ndarray], int]:
    """The :data:`STATISTICS` of the observations ``idx`` (rows with e_top > 0): Stat objects,
    per-row values for the ICC, and the count of non-finite pi ratios."""
    stats: dict[str, object] = {}
    values: dict[str, np.ndarray] = {}
    nonfinite = 0
    for prefix, (col, kind) in STATISTICS.items():
        raw = cols[col][idx]
        fin = np.isfinite(raw)
        if col in ("pi_top", "pi_opt"):
            nonfinite += int((~fin).sum())
        if kind == "median":
            stats[prefix] = Median(np.where(fin, raw, 0.0), fin)
            values[prefix] = raw
        elif kind == "significant":
            ind = (raw > threshold).astype(float)
            stats[prefix] = Mean(ind, fin)
            values[prefix] = np.where(fin, ind, np.nan)
        else:
            stats[prefix] = Mean(raw)
            values[prefix] = raw
    return stats, values, nonfinite


def group_indices(df: pl.DataFrame, by: Sequence[str]) -> list[tuple[tuple[object, ...], np.ndarray]]:
    """``[(key, row indices)]`` of ``df`` grouped by ``by``, sorted by key."""
    g = df.select(*by).with_row_index("_i").group_by(list(by)).agg(pl.col("_i")).sort(list(by))
    return [(tuple(r[c] for c in by), np.asarray(r["_i"], dtype=np.int64)) for r in g.iter_rows(named=True)]


def summarize(
    df: pl.DataFrame,
    by: Sequence[str] = ("model", "s"),
    *,
    seed: int = 0,
    n_boot: int = 1000,
    level: float = 0.95,
    threshold: float = DEFAULT_THRESHOLD,
    clusters: Sequence[str] | None = CLUSTER_LEVELS,
    compare_rows: bool = False,
) -> pl.DataFrame:
    """Summary statistics per group of a prepared results table (see module docstring).

    ``df`` must come from :func:`evictlab.stats.results.prepare` (or ``load_results``).
    Intervals resample the design of :meth:`Clusters.design` (``clusters`` levels; None = row
    bootstrap), one set of replicates per group shared by all its statistics, seeded by
    ``seed`` and the group's key, so results do not depend on group order. Per group:
    ``interval`` (the design, in words), ``prompts`` (prompt clusters), and for each
    statistic ``<stat>_icc``, the share of its per-row variation between prompts
    (:func:`evictlab.stats.bootstrap.icc_oneway`; rank ICC for medians). With
    ``compare_rows`` also ``<stat>_row_lo`` / ``_row_hi`` for the :data:`COMPARED` statistics:
    the row bootstrap, for comparison.
    """
    by = list(by)
    cl = Clusters.of(df, clusters)
    cols = {c: df[c].cast(pl.Float64).to_numpy() for c in {c for c, _ in STATISTICS.values()} | {"e_top", "es_hat"}}
    zero_all = df["e_top_zero"].to_numpy() | (cols["e_top"] <= 0.0)
    has_cert = "es_cert" in df.columns
    if has_cert:
        es_cert = df["es_cert"].cast(pl.Float64).to_numpy()
        cert_ok = np.isfinite(es_cert)  # null -> NaN
        if "cert_status" in df.columns:
            status = df["cert_status"].cast(pl.Utf8).str.to_lowercase().fill_null("").to_numpy()
            cert_ok &= np.isin(status, ["optimal", "certified", "proved", "ok"])
    out: list[dict[str, object]] = []
    for key, idx in group_indices(df, by):
        keyd = dict(zip(by, key))
        tag = "|".join(f"{k}={v}" for k, v in keyd.items())
        zero = zero_all[idx]
        nz = idx[~zero]
        design = cl.design(nz)
        groups = cl.prompt[nz] if cl.prompt is not None else None
        row: dict[str, object] = {**keyd, "rows": idx.size, "rows_e_top_zero": int(zero.sum()),
                                  "rows_used": nz.size,
                                  "prompts": int(np.unique(groups).size) if groups is not None else 0,
                                  "interval": design.describe()}
        stats, values, nonfinite = _stats(cols, nz, threshold)
        est = bootstrap(stats, design, seed=seed, key=tag, n_boot=n_boot, level=level)  # type: ignore[arg-type]
        for prefix, e in est.items():
            row.update(_est_cols(prefix, e))
            v = values[prefix]
            fin = np.isfinite(v)
            if groups is None:
                row[f"{prefix}_icc"] = float("nan")
            elif STATISTICS[prefix][1] == "median":
                row[f"{prefix}_icc"] = rank_icc(v[fin], groups[fin])
            else:
                row[f"{prefix}_icc"] = icc_oneway(v[fin], groups[fin])
        if compare_rows:
            compared = {k: stats[k] for k in COMPARED}
            est_r = bootstrap(compared, Design.rows(nz.size), seed=seed, key=tag + "|rows", n_boot=n_boot,  # type: ignore[arg-type]
                              level=level)
            for prefix, e in est_r.items():
                row.update({f"{prefix}_row_lo": e.lo, f"{prefix}_row_hi": e.hi})
        gap = _finite(cols["gap_closed"][nz])
        qs = np.quantile(gap, [0.1, 0.25, 0.75, 0.9]) if gap.size else [np.nan] * 4
        row.update({"gap_closed_q10": qs[0], "gap_closed_q25": qs[1], "gap_closed_q75": qs[2],
                    "gap_closed_q90": qs[3],
                    "gap_closed_mean": float(gap.mean()) if gap.size else float("nan")})
        row["pi_nonfinite"] = nonfinite
        if has_cert:
            ci = idx[cert_ok[idx]]
            es_hat = cols["es_hat"][ci]
            beats = (es_cert[ci] < es_hat - np.maximum(np.abs(es_hat) * REL_TOL, ABS_TOL)).astype(float)
            row["rows_certified"] = ci.size
            cdesign = cl.design(ci)
            ce = bootstrap({"c": Mean(beats)}, cdesign, seed=seed, key=tag + "|cert", n_boot=n_boot, level=level)["c"]
            row.update(_est_cols("cert_beats_pool_frac", ce))
            row["cert_beats_pool_frac_icc"] = (icc_oneway(beats, cl.prompt[ci]) if cl.prompt is not None
                                               else float("nan"))
            row["cert_interval"] = ce.method
        out.append(row)
    return pl.DataFrame(out)


def summarize_all(
    df: pl.DataFrame, *, seed: int = 0, n_boot: int = 1000, n_boot_cells: int = 200,
    level: float = 0.95, threshold: float = DEFAULT_THRESHOLD, clusters: Sequence[str] | None = CLUSTER_LEVELS,
) -> dict[str, pl.DataFrame]:
    """The standard summaries: per (model, s) (with the row bootstrap as a comparison), per
    layer, per (layer, head), and, when the table holds several models, ``pooled_s``: all
    models' rows pooled per s, resampling models, then prompts, then rows (``model`` column
    ``pooled (A + B)``).

    The per-cell levels use ``n_boot_cells`` resamples (there are hundreds of cells).
    """
    res: dict[str, pl.DataFrame] = {}
    for name, by in LEVELS.items():
        nb = n_boot if name == "model_s" else n_boot_cells
        res[name] = summarize(df, by, seed=seed, n_boot=nb, level=level, threshold=threshold, clusters=clusters,
                              compare_rows=name == "model_s")
    pooled = summarize_pooled(df, seed=seed, n_boot=n_boot, level=level, threshold=threshold, clusters=clusters)
    if pooled is not None:
        res["pooled_s"] = pooled
    return res


def summarize_pooled(df: pl.DataFrame, **kwargs: object) -> pl.DataFrame | None:
    """Per s, all models' rows pooled (models, then prompts, then rows resampled), with the row
    bootstrap as comparison; ``model`` = ``pooled (A + B)``. None for a single model.
    ``kwargs``: those of :func:`summarize`."""
    models = sorted(df["model"].unique().to_list())
    if len(models) < 2:
        return None
    pooled = summarize(df, ("s",), compare_rows=True, **kwargs)  # type: ignore[arg-type]
    return pooled.select(pl.lit(pooled_name(models)).alias("model"), pl.all())


def pooled_name(models: Sequence[str]) -> str:
    """The ``model`` label of rows pooled over ``models``."""
    return f"pooled ({' + '.join(sorted(models))})"
