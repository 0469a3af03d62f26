"""ROC curves of the significant-gap predictors, AUC in the legend."""

from __future__ import annotations

import os

import numpy as np
import polars as pl

from evictlab.plots.common import Figure, require, save, setup


def roc_points(y: np.ndarray, score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(false-positive rate, true-positive rate) of the ROC curve of ``score`` for labels ``y``."""
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(np.asarray(y, dtype=bool), np.asarray(score, dtype=float))
    return fpr, tpr


def roc_table(scored: pl.DataFrame, max_points: int = 400) -> pl.DataFrame:
    """ROC points per (predictor, model, s) from a table with columns predictor, model, s, y, score.

    Curves are thinned to at most ``max_points`` points (evenly in index) for plotting.
    """
    require(scored, ["predictor", "model", "s", "y", "score"], "ROC table")
    from evictlab.stats.bootstrap import roc_auc

    parts = []
    for (pred, model, s), g in sorted(scored.group_by(["predictor", "model", "s"]), key=lambda kv: tuple(map(str, kv[0]))):
        y, sc = g["y"].to_numpy().astype(bool), g["score"].to_numpy()
        if y.all() or not y.any():
            continue
        fpr, tpr = roc_points(y, sc)
        if fpr.size > max_points:
            keep = np.unique(np.linspace(0, fpr.size - 1, max_points).round().astype(int))
            fpr, tpr = fpr[keep], tpr[keep]
        parts.append(pl.DataFrame({"predictor": pred, "model": model, "s": str(s), "fpr": fpr, "tpr": tpr,
                                   "auc": roc_auc(y, sc)}))
    if not parts:
        from evictlab.errors import InputError

        raise InputError("ROC table", "no group has both classes", "use more rows or another threshold")
    return pl.concat(parts)


def roc_curves(points: pl.DataFrame, out: str | os.PathLike[str], threshold: float = 1.11) -> Figure:
    """One panel per (predictor, model), one curve per budget s; AUC in the legend."""
    require(points, ["predictor", "model", "s", "fpr", "tpr", "auc"], "ROC figure")
    plt = setup()
    import seaborn as sns

    panels = sorted({(p, m) for p, m in points.select("predictor", "model").unique().iter_rows()})
    ncol = min(3, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.0 * ncol, 3.7 * nrow), squeeze=False)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    for ax, (pred, model) in zip(axes.ravel(), panels):
        sub = points.filter((pl.col("predictor") == pred) & (pl.col("model") == model))
        budgets = sorted(sub["s"].unique().to_list(), key=lambda v: (not v.isdigit(), int(v) if v.isdigit() else 0))
        colors = sns.color_palette("viridis", len(budgets))
        for c, s in zip(colors, budgets):
            g = sub.filter(pl.col("s") == s)
            ax.plot(g["fpr"], g["tpr"], color=c, label=f"s={s}: AUC {g['auc'][0]:.3f}")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
        ax.set_xlabel("false-positive rate (fraction)")
        ax.set_ylabel("true-positive rate (fraction)")
        ax.set_title(f"{pred} on {model}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    caption = (f"ROC curves for predicting a significant gap, kappa_hat = e(T_s)/ES_hat(s) > {threshold}, from "
               "each predictor's score (dropped mass m_s = D(T_s) alone, or a calibrated logistic regression). "
               "Fitted predictors are evaluated on held-out rows or on another model (transfer).")
    return save(fig, out, caption)
