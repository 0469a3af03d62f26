"""Where allocations differ, per (layer, KV head): kept sizes against uniform and the asked
fact's entries kept, from a per-compression trace (:class:`evictlab.decode.trace.CompressionTrace`)."""

from __future__ import annotations

import os

import numpy as np
import polars as pl

from evictlab.plots.common import Figure, require, save, setup


def _grid(d: pl.DataFrame, value: str, layers: list[int], heads: list[int]) -> np.ndarray:
    grid = np.full((len(layers), len(heads)), np.nan)
    li, hi = {v: i for i, v in enumerate(layers)}, {v: i for i, v in enumerate(heads)}
    for layer, head, v in d.select("layer", "kv_head", value).iter_rows():
        if v is not None:
            grid[li[layer], hi[head]] = v
    return grid


def allocation_cells(trace: pl.DataFrame, out: str | os.PathLike[str], *, uniform: str,
                     phase: str = "prefill", title: str = "") -> Figure:
    """Two rows of heatmaps over (layer rows, KV-head columns), one column per method of the
    trace: top, the mean kept size minus the ``uniform`` method's (entries; same example and
    compression, then averaged over them); bottom, the share of the asked fact's entries the
    cell kept (``fact_kept / fact_held`` summed over examples; blank where no example's
    fact lies in the cell, or the trace has no facts). ``phase``: which compressions.

    ``trace``: :meth:`CompressionTrace.table` rows of several methods (column ``method``),
    with ``example`` and ``compression`` labels."""
    require(trace, ["method", "example", "compression", "phase", "layer", "kv_head", "kept", "fact_held",
                    "fact_kept"], "allocation cells")
    plt = setup()
    import seaborn as sns

    t = trace.filter(pl.col("phase") == phase)
    key = ["example", "compression", "layer", "kv_head"]
    if uniform not in t["method"].unique().to_list():
        from evictlab.errors import InputError

        raise InputError("uniform", f"no {phase} cells of {uniform!r} in the trace",
                         f"use one of {sorted(t['method'].unique().to_list())}")
    ref = t.filter(pl.col("method") == uniform).select(*key, pl.col("kept").alias("kept_uniform"))
    j = t.join(ref, on=key, how="inner").with_columns((pl.col("kept") - pl.col("kept_uniform")).alias("diff"))
    cells = (j.group_by("method", "layer", "kv_head", maintain_order=True)
             .agg(pl.col("diff").mean(),
                  (pl.col("fact_kept").sum() / pl.col("fact_held").sum()).alias("fact")))
    cells = cells.with_columns(pl.when(pl.col("fact").is_finite()).then(pl.col("fact")).otherwise(None))
    methods = t["method"].unique(maintain_order=True).to_list()
    layers = sorted(t["layer"].unique().to_list())
    heads = sorted(t["kv_head"].unique().to_list())
    span = float(np.nanmax(np.abs(cells["diff"].to_numpy()))) if cells.height else 1.0
    fig, axes = plt.subplots(2, len(methods), squeeze=False,
                             figsize=(1.0 + (0.6 + 0.3 * len(heads)) * len(methods), 1.6 + 0.36 * len(layers)))
    for k, m in enumerate(methods):
        d = cells.filter(pl.col("method") == m)
        last = k == len(methods) - 1
        sns.heatmap(_grid(d, "diff", layers, heads), ax=axes[0][k], cmap="coolwarm", center=0.0,
                    vmin=-span or -1.0, vmax=span or 1.0, xticklabels=heads, yticklabels=layers if k == 0 else False,
                    cbar=last, cbar_kws={"label": "kept - uniform (entries)"})
        sns.heatmap(_grid(d, "fact", layers, heads), ax=axes[1][k], cmap="viridis", vmin=0.0, vmax=1.0,
                    xticklabels=heads, yticklabels=layers if k == 0 else False, cbar=last,
                    cbar_kws={"label": "fact entries kept (share)"})
        # one line per part of SCORER+ALLOCATOR: a one-head model's columns are narrower than the name
        axes[0][k].set_title(m.replace("+", "\n+"), fontsize=7)
        for r in (0, 1):
            axes[r][k].set_xlabel("KV head" if r == 1 else "")
            axes[r][k].set_ylabel("layer" if k == 0 else "")
            axes[r][k].tick_params(labelsize=6)
    caption = (f"Per (layer, KV head), {phase} compressions. Top: mean kept size minus {uniform}'s in the same "
               "example and compression (entries). Bottom: share of the asked fact's entries held in the cell "
               "that it kept, pooled over examples (blank: no fact entry in the cell).")
    if title:
        fig.suptitle(title, fontsize=9)
    return save(fig, out, caption)


def verdict_forest(summary: pl.DataFrame, out: str | os.PathLike[str], *, baseline: str = "uniform") -> Figure:
    """Each ContourKV variant's mean exact-match difference against ``baseline`` (points per
    answer, ContourKV minus baseline) with its 95% interval: the pooled row, then one panel per
    model (both scorers) and per model x scorer (the ``model=M`` and ``model=M,scorer=S``
    splits of :func:`evictlab.eval.claims.contour.contour_summary`, where present). Filled markers: the
    configuration-level verdict is clear more often won than lost (more clear wins than
    clear losses); hollow: not.

    ``summary``: the glance table (``variant``, ``baseline``, ``split``, ``d_em``, ``d_em_lo``,
    ``d_em_hi``, ``clear_wins``, ``clear_losses``)."""
    require(summary, ["variant", "baseline", "split", "d_em", "d_em_lo", "d_em_hi", "clear_wins", "clear_losses"],
            "verdict forest")
    s = summary.filter(pl.col("baseline") == baseline)
    if s.height == 0:
        from evictlab.errors import InputError

        raise InputError("baseline", f"no ContourKV comparison against {baseline!r} in the summary",
                         f"use one of {sorted(summary['baseline'].unique().to_list())}")
    present = s["split"].unique().to_list()
    models = sorted(sp for sp in present if sp.startswith("model=") and "," not in sp)
    crossed = sorted(sp for sp in present if sp.startswith("model=") and ",scorer=" in sp)
    splits = ["all", *models, *crossed]
    variants = s["variant"].unique(maintain_order=True).to_list()
    plt = setup()
    cols = min(len(splits), 3)
    rows = -(-len(splits) // cols)
    # Each row of panels needs room for its title, ticks and x label beside its variants: with
    # one variant a shared 0.9 inches let every row's title cover the x axis of the row above.
    fig, axes = plt.subplots(rows, cols, squeeze=False, sharey=True,
                             figsize=(3.4 * cols, rows * (0.95 + 0.32 * len(variants))))
    ypos = {v: i for i, v in enumerate(variants)}
    for k, sp in enumerate(splits):
        ax = axes[k // cols][k % cols]
        d = s.filter(pl.col("split") == sp)
        for r in d.iter_rows(named=True):
            y = ypos[r["variant"]]
            ax.plot([r["d_em_lo"], r["d_em_hi"]], [y, y], color="0.3", lw=1.2)
            clear = r["clear_wins"] > r["clear_losses"]
            ax.plot([r["d_em"]], [y], "o", ms=5, color="C0" if r["d_em"] >= 0 else "C3",
                    mfc=None if clear else "white")
        ax.axvline(0.0, color="k", lw=0.8, ls="--")
        title = "pooled" if sp == "all" else sp.replace("model=", "").replace(",scorer=", ", ")
        ax.set_title(title if "," in sp or sp == "all" else f"{title}, both scorers", fontsize=8)
        ax.set_yticks(range(len(variants)), variants, fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlabel(f"exact match minus {baseline} (points)", fontsize=7)
    for k in range(len(splits), rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    axes[0][0].invert_yaxis()
    caption = (f"Mean exact-match difference per answer against {baseline} sizes (same scorer, physical, matched "
               "bytes), with 95% percentile bootstrap intervals over prompts; pooled, per model, per model x scorer. "
               "Filled: more clear configuration wins than clear losses.")
    return save(fig, out, caption)
