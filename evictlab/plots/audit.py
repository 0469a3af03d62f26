"""The masked-vs-physical audit: K/V bytes held and next-token KL, by method and mode."""

from __future__ import annotations

import os

import polars as pl

from evictlab.plots.common import Figure, require, save, setup

_PALETTE = {"masked": "#c44e52", "physical": "#4c72b0"}


def audit_bars(audit: pl.DataFrame, out: str | os.PathLike[str]) -> Figure:
    """Two panels from the audit table (one row per method x mode x budget, see
    :mod:`evictlab.decode.audit`): K/V bytes held after compression (MiB, the full cache
    dashed) and next-token KL(full || compressed) (nats), one bar per mode."""
    require(audit, ["method", "mode", "budget_per_cell", "bytes_live", "bytes_full_cache", "kl"], "audit figure")
    d = audit.filter(pl.col("mode") != "full")
    require(d, ["mode"], "audit figure (masked/physical rows)")
    plt = setup()
    import seaborn as sns

    label = "method @ budget/cell"
    pdf = d.with_columns(
        (pl.col("bytes_live") / 2**20).alias("MiB held (K/V)"),
        (pl.col("method") + " @" + pl.col("budget_per_cell").round(0).cast(pl.Int64).cast(pl.Utf8)).alias(label),
    ).to_pandas()
    full_mib = float(audit["bytes_full_cache"].max()) / 2**20
    modes = [m for m in ("masked", "physical") if m in set(pdf["mode"])]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * max(4, pdf[label].nunique()) + 1.5))
    sns.barplot(pdf, y=label, x="MiB held (K/V)", hue="mode", ax=axes[0], hue_order=modes, palette=_PALETTE)
    axes[0].axvline(full_mib, color="k", ls="--", lw=1, label="full cache")
    axes[0].set_title("K/V bytes held after compression")
    sns.barplot(pdf, y=label, x="kl", hue="mode", ax=axes[1], hue_order=modes, palette=_PALETTE)
    axes[1].get_legend().remove()
    # One legend for both panels, outside the bars (right of the KL panel).
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].get_legend().remove()
    axes[1].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, title="mode")
    axes[1].set_title("next-token KL to the full cache")
    axes[1].set_xlabel("KL(full || compressed), nats")
    axes[1].set_ylabel("")
    caption = ("Left: K/V bytes held right after compressions (masked: every appended entry, since masking "
               "frees nothing; physical: the kept entries), the full cache dashed. Right: mean next-token "
               "KL(full || compressed) over the answer tokens, nats. Same kept entries in both modes.")
    return save(fig, out, caption, dpi=150)
