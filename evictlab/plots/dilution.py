"""Dilution figures: useful mass per layer and head, the bounds, kept sets, and the distractor sweep.

Inputs are the tables of :mod:`evictlab.dilution.check` (one row per (row, kept set, s)) and
:mod:`evictlab.dilution.sweep` (one row per (model, distractors, method, example)).
"""

from __future__ import annotations

import os

import numpy as np
import polars as pl

from evictlab.plots.common import Figure, require, save, setup


def alpha_heatmap(heads: pl.DataFrame, out: str | os.PathLike[str]) -> Figure:
    """Mean useful mass alpha of the full cache per (layer, query head) (rows whose useful
    keys are visible)."""
    require(heads, ["layer", "q_head", "method", "alpha_mean"], "dilution heatmap")
    d = heads.filter(pl.col("method") == "full")
    require(d, ["layer"], "dilution heatmap (full-cache rows)")
    plt = setup()
    import seaborn as sns

    grid = d.pivot(on="q_head", index="layer", values="alpha_mean", aggregate_function="mean").sort("layer")
    cols = sorted(c for c in grid.columns if c != "layer")
    mat = grid.select(cols).to_numpy().astype(float)
    fig, ax = plt.subplots(figsize=(1.2 + 0.45 * len(cols), 1.0 + 0.22 * grid.height))
    sns.heatmap(mat, ax=ax, cmap="viridis", vmin=0, cbar_kws={"label": "mean alpha = P(U)"},
                xticklabels=cols, yticklabels=grid["layer"].to_list())
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title("useful mass of the full cache")
    caption = ("Mean useful mass alpha = P(U) (attention on the asked facts' tokens) per layer and query head, "
               "full cache, over rows whose useful keys are visible.")
    return save(fig, out, caption)


def bound_scatter(table: pl.DataFrame, out: str | os.PathLike[str], max_points: int = 20000) -> Figure:
    """alpha against its two lower bounds of Theorem 1 (full-cache rows): every point lies on
    or above the diagonal when the theorem holds."""
    require(table, ["method", "alpha", "bound_margin", "bound_mean"], "bound figure")
    d = table.filter((pl.col("method") == "full") & pl.col("bound_margin").is_not_nan())
    require(d, ["alpha"], "bound figure (rows with useful and distractor keys)")
    if d.height > max_points:
        d = d.sample(max_points, seed=0)
    plt = setup()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True)
    for ax, col, title in ((axes[0], "bound_margin", "margin bound (min l_U - max l_D)"),
                           (axes[1], "bound_mean", "Jensen bound (mean l_U - max l_D)")):
        x = np.clip(d[col].to_numpy(), 1e-300, 1)
        y = np.clip(d["alpha"].to_numpy(), 1e-300, 1)
        ax.scatter(x, y, s=3, alpha=0.3, color="#4c72b0", rasterized=True)
        lo = max(1e-300, float(min(x.min(), y.min())))
        ax.plot([lo, 1], [lo, 1], "k--", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(title)
        ax.set_title(f"{d.height} rows")
    axes[0].set_ylabel("alpha = P(U)")
    caption = ("Useful mass alpha against the lower bounds 1/(1 + (|D|/|U|) e^-Delta) of Theorem 1 "
               "(docs/theory.md section 7), log scales; the dashed line is equality. Points below it "
               "would be violations.")
    return save(fig, out, caption)


def kept_gain(table: pl.DataFrame, out: str | os.PathLike[str]) -> Figure:
    """log2(alpha_A / alpha) per kept set and budget: above 0, eviction raised the useful mass."""
    require(table, ["method", "s", "alpha", "alpha_kept", "useful_visible"], "kept-set figure")
    d = table.filter((pl.col("method") != "full") & pl.col("useful_visible") & (pl.col("alpha") > 0)
                     & pl.col("alpha_kept").is_not_nan())
    require(d, ["alpha"], "kept-set figure (kept sets of rows with visible useful keys)")
    d = d.with_columns((pl.col("alpha_kept").clip(1e-30) / pl.col("alpha")).log(2).alias("log2 gain"),
                       pl.col("s").cast(pl.Utf8).alias("s"))
    plt = setup()
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(8, 4.2))
    sns.boxplot(d.to_pandas(), x="method", y="log2 gain", hue="s", ax=ax, showfliers=False)
    ax.axhline(0, color="k", lw=1, ls="--")
    ax.set_ylabel("log2(alpha_A / alpha)")
    ax.set_title("useful mass after renormalisation over the kept set A")
    caption = ("log2 of alpha_A / alpha per kept set and budget s (boxes: quartiles, whiskers 1.5 IQR, outliers "
               "hidden). Above 0 the kept set raised the useful mass; it must when A holds every useful key "
               "(Theorem 2). top_mass is an oracle for the row (its own attention).")
    return save(fig, out, caption)


def sweep_lines(summary: pl.DataFrame, out: str | os.PathLike[str]) -> Figure:
    """Accuracy, answer log-probability and useful mass against the number of distractors,
    one line per method, one row of panels per model."""
    cols = ["model", "distractors", "method", "exact_match", "answer_logprob", "useful_mass"]
    require(summary, cols, "sweep figure")
    plt = setup()
    import seaborn as sns

    models = summary["model"].unique(maintain_order=True).to_list()
    fig, axes = plt.subplots(len(models), 3, figsize=(13, 3.4 * len(models)), squeeze=False)
    pdf = summary.with_columns(pl.col("distractors").cast(pl.Float64)).to_pandas()
    for i, m in enumerate(models):
        dm = pdf[pdf["model"] == m]
        for j, (col, label) in enumerate((("exact_match", "exact match"), ("answer_logprob", "answer log-prob (nats)"),
                                          ("useful_mass", "useful mass (last question token)"))):
            ax = axes[i][j]
            sns.lineplot(dm, x="distractors", y=col, hue="method", marker="o", ax=ax, legend=(i == 0 and j == 2))
            ax.set_xscale("symlog", linthresh=1)
            ax.set_title(f"{m}: {label}")
            ax.set_ylabel(label)
    if axes[0][2].get_legend() is not None:
        axes[0][2].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, title="method")
    caption = ("Per distractor count (near-miss needles: other keys, other values), mean over examples: exact "
               "match, answer log-probability under teacher forcing (nats), and the useful mass of the last "
               "question token over the cache each method kept (mean over layers and heads; full cache: alpha). "
               "All methods at the same kept-entry budget; oracle_labels is an ORACLE (it uses the labels).")
    return save(fig, out, caption)
