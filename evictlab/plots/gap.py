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


#: The paper's reported range of the median gap closed over s = 4..32.
PAPER_GAP = (0.021, 0.047)


def gap_closed_medians(summary: pl.DataFrame, out: str | os.PathLike[str], dpi: int = 130) -> Figure:
    """Median gap closed g(s) against s per model (and pooled), with their intervals, and the paper's range.

    ``summary``: per-(model, s) rows of :func:`evictlab.stats.ceilings.summarize` (pooled rows
    from ``summarize_pooled`` may be appended); the bars are the table's intervals, whose
    design the ``interval`` column names.
    """
    require(summary, ["model", "s", "gap_closed_median", "gap_closed_median_lo", "gap_closed_median_hi"],
            "gap-closed medians figure")
    plt = setup()
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    palette = sns.color_palette("deep")
    ax.axhspan(*PAPER_GAP, color="0.85", zorder=0, label="paper: 0.021-0.047 (5 models pooled)")
    models = sorted(summary["model"].unique().to_list(), key=lambda m: (m.startswith("pooled"), m))
    n = len(models)
    for i, m in enumerate(models):
        sub = summary.filter(pl.col("model") == m).sort("s")
        s = sub["s"].to_numpy().astype(float) * 2 ** (0.06 * (i - (n - 1) / 2))  # dodge on the log axis
        med = sub["gap_closed_median"].to_numpy()
        lo, hi = sub["gap_closed_median_lo"].to_numpy(), sub["gap_closed_median_hi"].to_numpy()
        pooled = m.startswith("pooled")
        ax.errorbar(s, med, yerr=[med - lo, hi - med], fmt="D--" if pooled else "o-", capsize=3,
                    color="k" if pooled else palette[i % 10], label=m, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(summary["s"].unique().to_list()))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("budget s (keys kept per row)")
    ax.set_ylabel("median gap closed g(s)")
    ax.set_ylim(bottom=0)
    ax.set_title("Selection ceiling: how much of e(T_s) the best subset removes", fontsize=9)
    ax.legend(fontsize=7)
    caption = ("Median gap closed g(s) = (e(T_s) - ES_hat(s)) / e(T_s) per model and budget (ES_hat over the "
               "candidate pool C_s(2, 2), ours), with 95% percentile intervals from a cluster bootstrap over "
               "prompts (pooled: models, then prompts, then rows); grey band: the paper's range.")
    return save(fig, out, caption, dpi=dpi)
