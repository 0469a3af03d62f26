"""The forced-weight penalty pi(s) against the budget s."""

from __future__ import annotations

import os

import polars as pl

from evictlab.plots.common import Figure, require, save, setup

#: The paper's reported endpoints of pi(s) ("Trust the Mass": 1.07 at s = 4, 1.79 at s = 32).
PAPER_PI = {4: 1.07, 32: 1.79}


def penalty_curve(summary: pl.DataFrame, out: str | os.PathLike[str]) -> Figure:
    """Median pi(s) at T_s and at the argmin with bootstrap 95% CIs, per model, and the paper's values.

    ``summary``: the per-(model, s) table of :func:`evictlab.stats.ceilings.summarize`.
    """
    cols = ["model", "s", "pi_top_median", "pi_top_median_lo", "pi_top_median_hi",
            "pi_opt_median", "pi_opt_median_lo", "pi_opt_median_hi"]
    require(summary, cols, "pi(s) figure")
    plt = setup()
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(5.4, 3.8))
    palette = sns.color_palette("deep")
    for i, m in enumerate(sorted(summary["model"].unique().to_list())):
        sub = summary.filter(pl.col("model") == m).sort("s")
        s = sub["s"].to_numpy()
        for j, (which, ls, label) in enumerate((("pi_top", "-", "at T_s"), ("pi_opt", "--", "at argmin"))):
            med = sub[f"{which}_median"].to_numpy()
            lo, hi = sub[f"{which}_median_lo"].to_numpy(), sub[f"{which}_median_hi"].to_numpy()
            ax.errorbar(s, med, yerr=[med - lo, hi - med], fmt="o" + ls, color=palette[i % 10], capsize=3,
                        alpha=1.0 if j == 0 else 0.7, label=f"{m}, {label}")
    ax.plot(list(PAPER_PI), list(PAPER_PI.values()), "k*", markersize=11, label="paper (Trust the Mass)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(summary["s"].unique().to_list()))
    ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("budget s (keys kept)")
    ax.set_ylabel("pi(s) = median e(A)/e_free(A) (ratio)")
    ax.set_title("Forced-weight penalty pi(s)", fontsize=10)
    ax.legend(fontsize=7)
    caption = ("pi(s) = median over rows of e(A)/e_free(A), the forced (renormalised) error over the free-weight "
               "error (distance from mu to the convex hull of the kept values; ours), at A = T_s (solid) and at the "
               "pool argmin (dashed); bars are 95% percentile intervals of the median from a cluster bootstrap over prompts "
               "(the summary table's `interval` column names the design); stars are the paper's "
               "reported values. Rows with e(T_s) = 0 or e_free = 0 are excluded and counted in the tables.")
    return save(fig, out, caption)


def penalty_vs_head_dim(table: pl.DataFrame, out: str | os.PathLike[str], paper_head_dim: int = 128) -> Figure:
    """pi against s / head_dim per model, one line per free-weight definition, and the paper's points.

    ``table``: :func:`evictlab.stats.penalty.penalty_table` (columns model, s_over_d,
    definition, pi, pi_lo, pi_hi).
    """
    require(table, ["model", "s", "s_over_d", "definition", "pi", "pi_lo", "pi_hi"], "pi vs s/d figure")
    plt = setup()
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    palette = sns.color_palette("deep")
    styles = {"hull": ("o", "-", 1.0), "hull, ratio of medians": ("s", ":", 0.6), "affine": ("^", "--", 0.6),
              "nonneg": ("v", "-.", 0.6), "ls": ("x", ":", 0.5)}
    for i, m in enumerate(sorted(table["model"].unique().to_list())):
        for name, (marker, ls, alpha) in styles.items():
            sub = table.filter((pl.col("model") == m) & (pl.col("definition") == name)).sort("s_over_d")
            if sub.height == 0:
                continue
            x, y = sub["s_over_d"].to_numpy(), sub["pi"].to_numpy()
            lo, hi = sub["pi_lo"].to_numpy(), sub["pi_hi"].to_numpy()
            ax.errorbar(x, y, yerr=[y - lo, hi - y] if name == "hull" else None, marker=marker, linestyle=ls,
                        color=palette[i % 10], alpha=alpha, capsize=3, markersize=4,
                        label=f"{m} (d={int(sub['head_dim'][0])}), {name}")
    ax.plot([s / paper_head_dim for s in PAPER_PI], list(PAPER_PI.values()), "k*", markersize=11,
            label=f"paper (d={paper_head_dim})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("s / head_dim (kept keys per head dimension)")
    ax.set_ylabel("pi at T_s (ratio)")
    ax.set_title("Forced-weight penalty against s / head_dim", fontsize=10)
    ax.legend(fontsize=6, ncol=2)
    caption = ("pi at T_s against s / head_dim, per model (colour) and free-weight definition (line style): hull "
               "(default, ours: distance to the convex hull; bars = 95% prompt-clustered bootstrap CIs), ratio of "
               "medians, affine hull, non-negative cone, unconstrained span (labelled ablations, ours). Stars: the "
               "paper's values at s = 4 and 32 on head dim 128. If pi depended on s / head_dim alone, the models' "
               "solid lines would coincide.")
    return save(fig, out, caption)
