"""Gap-closed distributions per budget s and model (empirical CDFs)."""

from __future__ import annotations

import os

import polars as pl

from evictlab.plots.common import Figure, require, save, setup


def gap_closed_ecdf(results: pl.DataFrame, out: str | os.PathLike[str]) -> Figure:
    """ECDF of the gap closed g(s), one panel per model, one line per budget s.

    ``results``: prepared solver results (rows with e(T_s) = 0 are left out and counted in
    the caption, since g is 0/0 there).
    """
    require(results, ["model", "s", "gap_closed", "e_top_zero"], "gap-closed figure")
    plt = setup()
    import seaborn as sns

    zero = int(results["e_top_zero"].sum())
    d = results.filter(~pl.col("e_top_zero") & pl.col("gap_closed").is_not_null() & pl.col("gap_closed").is_finite())
    models = sorted(d["model"].unique().to_list())
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.6), squeeze=False, sharey=True)
    for ax, m in zip(axes[0], models):
        sub = d.filter(pl.col("model") == m).select("s", "gap_closed").to_pandas()
        sub["s"] = sub["s"].astype(str)
        order = sorted(sub["s"].unique(), key=int)
        sns.ecdfplot(data=sub, x="gap_closed", hue="s", hue_order=order, ax=ax, palette="viridis")
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.set_xlim(0, 1)
        ax.set_xlabel("gap closed g(s) (fraction of e(T_s), unitless)")
        ax.set_ylabel("fraction of rows with gap closed <= x")
        ax.set_title(f"{m}: {sub.shape[0]:,} (row, s) pairs")
    caption = ("Empirical CDF of the gap closed g(s) = (e(T_s) - ES_hat(s)) / e(T_s): the share of the "
               "top-mass error that the best s-subset of the candidate pool removes (ES_hat over C_s(2, 2), ours). "
               f"Symlog x axis (linear below 1e-3). {zero} pairs with e(T_s) = 0 are excluded (g undefined).")
    fig.suptitle("Selection ceiling: gap closed by the pool optimum", fontsize=10)
    return save(fig, out, caption)
