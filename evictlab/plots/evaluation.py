"""Figures of the evaluation grid: win / tie / loss bars per method pair, accuracy vs bytes."""

from __future__ import annotations

import os

import polars as pl

from evictlab.plots.common import Figure, require, save, setup

_WTL = (("wins", "#55a868"), ("ties", "#b0b0b0"), ("losses", "#c44e52"))


def wtl_bars(pairs: pl.DataFrame, out: str | os.PathLike[str], kind: str = "method") -> Figure:
    """Stacked horizontal bars, one per (pair, mode, protocol, model, context): the share of
    examples arm A wins, ties and loses (the per-example tie rule of the table); one panel
    per (task, budget). ``pairs``: :func:`evictlab.eval.compare.compare`'s table."""
    require(pairs, ["kind", "task", "budget", "a_method", "b_method", "a_mode", "protocol", "wins", "ties", "losses"],
            "win/tie/loss figure")
    p = pairs.filter(pl.col("kind") == kind)
    require(p, ["kind"], f"win/tie/loss figure ({kind} pairs)")
    p = p.with_columns(label=pl.format("{} vs {} [{}, {}, {}, {}]", "a_method", "b_method", "a_mode", "protocol",
                                       "model", "context"))
    tasks = list(dict.fromkeys(p["task"].to_list()))
    budgets = list(dict.fromkeys(p["budget"].to_list()))
    labels = list(dict.fromkeys(p["label"].to_list()))
    plt = setup()
    fig, axes = plt.subplots(len(tasks), len(budgets), squeeze=False, sharey=True, sharex=True,
                             figsize=(3.2 * len(budgets) + 4, 0.28 * len(labels) * len(tasks) + 1.6))
    for i, task in enumerate(tasks):
        for j, budget in enumerate(budgets):
            ax = axes[i][j]
            d = {r["label"]: r for r in p.filter((pl.col("task") == task) & (pl.col("budget") == budget)).to_dicts()}
            left = [0.0] * len(labels)
            for col, color in _WTL:
                vals = [d[lab][col] / max(1, d[lab]["n"]) if lab in d else 0.0 for lab in labels]
                ax.barh(range(len(labels)), vals, left=left, color=color, label=col if i == j == 0 else None)
                left = [a + b for a, b in zip(left, vals)]
            ax.set_title(f"{task} @ {budget}", fontsize=8)
            ax.set_xlim(0, 1)
            ax.set_yticks(range(len(labels)))
            ax.set_yticklabels(labels, fontsize=6)
            ax.invert_yaxis()
            if i == len(tasks) - 1:
                ax.set_xlabel("share of examples")
    axes[0][0].legend(loc="upper center", bbox_to_anchor=(0.5, 1.0 + 0.6 / max(1, len(labels))), fontsize=6,
                      ncol=3, frameon=False)
    rule = p["rule"][0] if p.height else ""
    caption = (f"Paired comparisons ({kind} pairs): share of examples where the first arm wins (green), ties "
               f"(grey) or loses (red) against the second, per task and budget. Rule: {rule}.")
    return save(fig, out, caption)


def accuracy_vs_bytes(results: pl.DataFrame, out: str | os.PathLike[str]) -> Figure:
    """Mean exact match (answer log-probability for ``heldout_ppl``) against K/V bytes held
    after compression (MiB), one point per (method, mode, budget), one panel per (task,
    model, context, protocol); the full cache's accuracy as a dashed line at its bytes."""
    require(results, ["model", "task", "context", "method", "mode", "protocol", "budget", "exact_match",
                      "answer_logprob", "bytes_live"], "accuracy figure")
    y = pl.when(pl.col("task") == "heldout_ppl").then(pl.col("answer_logprob")).otherwise(pl.col("exact_match"))
    agg = (results.with_columns(y=y).group_by(["model", "task", "context", "method", "mode", "protocol", "budget"],
                                               maintain_order=True)
           .agg(pl.col("y").mean(), (pl.col("bytes_live").mean() / 2**20).alias("mib")))
    full = agg.filter(pl.col("method") == "full")
    ev = agg.filter(pl.col("method") != "full")
    require(ev, ["method"], "accuracy figure (evicting rows)")
    panels = ev.select("task", "model", "context", "protocol").unique(maintain_order=True).to_dicts()
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    plt = setup()
    import seaborn as sns

    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(3.6 * cols + 2.0, 3.0 * rows))
    methods = list(dict.fromkeys(ev["method"].to_list()))
    for k, panel in enumerate(panels):
        ax = axes[k // cols][k % cols]
        d = ev.filter(pl.all_horizontal(pl.col(c) == v for c, v in panel.items())).to_pandas()
        sns.scatterplot(d, x="mib", y="y", hue="method", style="mode", hue_order=methods, ax=ax, s=40,
                        legend=k == 0)
        f = full.filter((pl.col("task") == panel["task"]) & (pl.col("model") == panel["model"])
                        & (pl.col("context") == panel["context"]))
        if f.height:
            ax.axhline(float(f["y"][0]), color="k", ls="--", lw=1)
            ax.axvline(float(f["mib"][0]), color="k", ls=":", lw=0.8)
        ax.set_title(f"{panel['task']} | {panel['model']} | {panel['context']} | {panel['protocol']}", fontsize=7)
        ax.set_xlabel("MiB held after compression")
        ax.set_ylabel("answer log-prob (nats)" if panel["task"] == "heldout_ppl" else "exact match")
    for k in range(len(panels), rows * cols):
        axes[k // cols][k % cols].axis("off")
    if panels:
        handles, labels = axes[0][0].get_legend_handles_labels()
        if axes[0][0].get_legend():
            axes[0][0].get_legend().remove()
        # outside the panels, right of the first row (tight_layout makes room for it)
        axes[0][cols - 1].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7)
    caption = ("Mean exact match (heldout_ppl: answer log-probability, nats) against the K/V bytes held right "
               "after compressions, per method (colour) and mode (marker); the full cache's accuracy dashed, its "
               "bytes dotted. Masked points sit at the full cache's bytes: masking frees nothing.")
    return save(fig, out, caption)
