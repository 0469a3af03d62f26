"""Dropped mass against kappa-hat, per budget."""

from __future__ import annotations

import os

import numpy as np
import polars as pl

from evictlab.plots.common import Figure, require, save, setup


def mass_vs_kappa(results: pl.DataFrame, out: str | os.PathLike[str], threshold: float = 1.11,
                  max_points: int = 8_000, seed: int = 0) -> Figure:
    """Scatter of dropped mass m_s (x) against kappa_hat (log y), one panel per s, hue = model.

    At most ``max_points`` pairs per panel are drawn (a seeded subsample, stated in the caption).
    """
    require(results, ["model", "s", "dropped_mass", "kappa_hat", "e_top_zero"], "mass-kappa figure")
    plt = setup()
    import seaborn as sns

    d = results.filter(~pl.col("e_top_zero") & pl.col("kappa_hat").is_finite() & (pl.col("kappa_hat") > 0)
                        & (pl.col("dropped_mass") > 0))
    budgets = sorted(d["s"].unique().to_list())
    fig, axes = plt.subplots(1, len(budgets), figsize=(3.4 * len(budgets), 3.4), squeeze=False, sharey=True)
    rng = np.random.default_rng(seed)
    models = sorted(d["model"].unique().to_list())
    palette = sns.color_palette("deep", len(models))
    sampled = False
    for ax, s in zip(axes[0], budgets):
        sub = d.filter(pl.col("s") == s)
        if sub.height > max_points:
            sub = sub[np.sort(rng.choice(sub.height, max_points, replace=False))]
            sampled = True
        for c, m in zip(palette, models):
            g = sub.filter(pl.col("model") == m)
            ax.scatter(g["dropped_mass"].to_numpy(), g["kappa_hat"].to_numpy(), s=4, alpha=0.35, color=c,
                       linewidths=0, rasterized=True, label=m)
        if s == budgets[-1]:
            ax.legend(fontsize=7, markerscale=3, loc="upper left")
        ax.axhline(threshold, color="crimson", lw=1, ls="--")
        ax.set_yscale("log")
        ax.set_xscale("log")
        ax.set_xlabel("dropped mass m_s = D(T_s) (probability)")
        ax.set_ylabel("kappa_hat = e(T_s)/ES_hat(s) (ratio)")
        ax.set_title(f"s = {s}", fontsize=9)
    caption = (f"Each point is one (row, s) pair; red dashed line: the significance threshold kappa_hat = {threshold}. "
               "Log-log axes. Pairs with e(T_s) = 0 excluded."
               + (f" A seeded subsample of {max_points:,} pairs per panel is drawn." if sampled else ""))
    fig.suptitle("Dropped mass against the selection gap kappa_hat", fontsize=10)
    return save(fig, out, caption)
