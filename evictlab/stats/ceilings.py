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

from typing import Sequence

import numpy as np
import polars as pl

from evictlab.stats.bootstrap import Estimate, bootstrap_mean, bootstrap_median
from evictlab.stats.results import ABS_TOL, REL_TOL

DEFAULT_THRESHOLD = 1.11

#: Grouping levels reported by :func:`summarize_all`.
LEVELS: dict[str, tuple[str, ...]] = {
    "model_s": ("model", "s"),
    "model_s_layer": ("model", "s", "layer"),
    "model_s_layer_head": ("model", "s", "layer", "head"),
}


def _est_cols(prefix: str, e: Estimate) -> dict[str, float]:
    return {prefix: e.value, f"{prefix}_lo": e.lo, f"{prefix}_hi": e.hi}


def _finite(a: np.ndarray) -> np.ndarray:
    return a[np.isfinite(a)]


def summarize(
    df: pl.DataFrame,
    by: Sequence[str] = ("model", "s"),
    *,
    seed: int = 0,
    n_boot: int = 1000,
    level: float = 0.95,
    threshold: float = DEFAULT_THRESHOLD,
) -> pl.DataFrame:
    """Summary statistics per group of a prepared results table (see module docstring).

    ``df`` must come from :func:`evictlab.stats.results.prepare` (or ``load_results``).
    The bootstrap for each group and statistic is seeded by ``seed`` and the group's key,
    so results do not depend on group order.
    """
    by = list(by)
    has_cert = "es_cert" in df.columns
    out: list[dict[str, object]] = []
    for key, g in sorted(df.group_by(by), key=lambda kv: kv[0]):
        keyd = dict(zip(by, key))
        tag = "|".join(f"{k}={v}" for k, v in keyd.items())
        zero = (g["e_top_zero"].to_numpy() | (g["e_top"].to_numpy() <= 0.0))
        nz = g.filter(pl.Series(~zero))
        row: dict[str, object] = {**keyd, "rows": g.height, "rows_e_top_zero": int(zero.sum()),
                                  "rows_used": nz.height}
        gap = _finite(nz["gap_closed"].cast(pl.Float64).to_numpy())
        row.update(_est_cols("gap_closed_median", bootstrap_median(gap, seed=seed, key=tag + "|gap", n_boot=n_boot, level=level)))
        qs = np.quantile(gap, [0.1, 0.25, 0.75, 0.9]) if gap.size else [np.nan] * 4
        row.update({"gap_closed_q10": qs[0], "gap_closed_q25": qs[1], "gap_closed_q75": qs[2],
                    "gap_closed_q90": qs[3],
                    "gap_closed_mean": float(gap.mean()) if gap.size else float("nan")})
        kap = _finite(nz["kappa_hat"].cast(pl.Float64).to_numpy())
        row.update(_est_cols("kappa_hat_median", bootstrap_median(kap, seed=seed, key=tag + "|kappa", n_boot=n_boot, level=level)))
        row.update(_est_cols("frac_significant", bootstrap_mean((kap > threshold).astype(float), seed=seed, key=tag + "|sig", n_boot=n_boot, level=level)))
        nonfinite = 0
        for name in ("pi_top", "pi_opt"):
            raw = nz[name].cast(pl.Float64).to_numpy()
            fin = _finite(raw)
            nonfinite += raw.size - fin.size
            row.update(_est_cols(f"{name}_median", bootstrap_median(fin, seed=seed, key=f"{tag}|{name}", n_boot=n_boot, level=level)))
        row["pi_nonfinite"] = nonfinite
        bal = _finite(nz["bal_gap_closed"].cast(pl.Float64).to_numpy())
        row.update(_est_cols("bal_gap_closed_median", bootstrap_median(bal, seed=seed, key=tag + "|bal", n_boot=n_boot, level=level)))
        reach = nz["bal_reaches_opt"].to_numpy().astype(float)
        row.update(_est_cols("bal_reaches_opt_frac", bootstrap_mean(reach, seed=seed, key=tag + "|reach", n_boot=n_boot, level=level)))
        if has_cert:
            cert = g.filter(pl.col("es_cert").is_not_null() & pl.col("es_cert").is_finite())
            if "cert_status" in cert.columns:
                cert = cert.filter(pl.col("cert_status").cast(pl.Utf8).str.to_lowercase().is_in(["optimal", "certified", "proved", "ok"]))
            es_hat = cert["es_hat"].to_numpy()
            es_cert = cert["es_cert"].cast(pl.Float64).to_numpy()
            beats = es_cert < es_hat - np.maximum(np.abs(es_hat) * REL_TOL, ABS_TOL)
            row["rows_certified"] = cert.height
            row.update(_est_cols("cert_beats_pool_frac", bootstrap_mean(beats.astype(float), seed=seed, key=tag + "|cert", n_boot=n_boot, level=level)))
        out.append(row)
    return pl.DataFrame(out)


def summarize_all(
    df: pl.DataFrame, *, seed: int = 0, n_boot: int = 1000, n_boot_cells: int = 200,
    level: float = 0.95, threshold: float = DEFAULT_THRESHOLD,
) -> dict[str, pl.DataFrame]:
    """The three standard summaries: per (model, s), per layer, per (layer, head).

    The per-cell levels use ``n_boot_cells`` resamples (there are hundreds of cells).
    """
    res: dict[str, pl.DataFrame] = {}
    for name, by in LEVELS.items():
        nb = n_boot if name == "model_s" else n_boot_cells
        res[name] = summarize(df, by, seed=seed, n_boot=nb, level=level, threshold=threshold)
    return res
