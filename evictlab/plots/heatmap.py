"""Per-(layer, head) heatmaps of the median gap closed."""

from __future__ import annotations

import os

import numpy as np
import polars as pl

from evictlab.plots.common import Figure, require, save, setup


def gap_heatmap(cells: pl.DataFrame, out: str | os.PathLike[str], model: str,
                value: str = "gap_closed_median") -> Figure:
    """Heatmap of ``value`` over (layer rows, query-head columns), one panel per s, for one model.

    ``cells``: the per-(model, s, layer, head) summary of :func:`evictlab.stats.ceilings.summarize`.
    """
    require(cells, ["model", "s", "layer", "head", value], "gap heatmap")
    plt = setup()
    import seaborn as sns

    d = cells.filter(pl.col("model") == model)
    if d.height == 0:
        from evictlab.errors import InputError

        raise InputError("model", f"no cells for model {model!r}", f"use one of {cells['model'].unique().to_list()}")
    budgets = sorted(d["s"].unique().to_list())
    layers = sorted(d["layer"].unique().to_list())
    heads = sorted(d["head"].unique().to_list())
    vmax = float(np.nanmax(d[value].to_numpy())) if d.height else 1.0
    fig, axes = plt.subplots(1, len(budgets), figsize=(1.2 + 0.35 * len(heads) * len(budgets) + 1.2 * len(budgets),
                                                        1.2 + 0.22 * len(layers)), squeeze=False)
    for k, (ax, s) in enumerate(zip(axes[0], budgets)):
        sub = d.filter(pl.col("s") == s)
        grid = np.full((len(layers), len(heads)), np.nan)
        li = {v: i for i, v in enumerate(layers)}
        hi = {v: i for i, v in enumerate(heads)}
        for layer, head, v in sub.select("layer", "head", value).iter_rows():
            grid[li[layer], hi[head]] = v
        sns.heatmap(grid, ax=ax, cmap="magma", vmin=0.0, vmax=vmax if vmax > 0 else 1.0,
                    xticklabels=heads, yticklabels=layers, cbar=(k == len(budgets) - 1),
                    cbar_kws={"label": "median gap closed (fraction)"})
        ax.set_xlabel("query head")
        ax.set_ylabel("layer" if k == 0 else "")
        ax.set_title(f"s = {s}", fontsize=9)
    caption = (f"{model}: median gap closed g(s) = (e(T_s) - ES_hat(s))/e(T_s) per (layer, query head), one panel "
               "per budget s; rows with e(T_s) = 0 excluded. Blank cells have no rows.")
    fig.suptitle(f"Gap closed per layer and head ({model})", fontsize=10)
    return save(fig, out, caption)
