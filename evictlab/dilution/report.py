"""The Markdown reports of ``evictlab dilution check`` and ``evictlab dilution sweep``."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import polars as pl

from evictlab.report import markdown as md

_DEFS = ("Definitions (docs/theory.md section 7; **ours** where marked there): U = the tokens of the facts the "
         "question asks for (labels recorded at capture), D = every other key the row sees; alpha = P(U); "
         "Delta = min useful logit - max distractor logit; for a kept set A: alpha_A = P(U n A) / P(A) (the "
         "renormalised softmax over A), rho = P(D n A) / P(D), error scaling (1 - alpha_A)/(1 - alpha); "
         "err = ||output - m_U||, the distance of the (forced) output from the useful keys' own output (ours).")


def _config_block(cfg: Any) -> str:
    return "```\n" + "\n".join(f"{k}: {v}" for k, v in sorted(asdict(cfg).items())) + "\n```"


def _method_table(table: pl.DataFrame) -> pl.DataFrame:
    vis = pl.col("useful_visible")
    table = table.with_columns(pl.when(pl.col("method") == "full").then(None).otherwise(pl.col("s")).alias("s"))
    return (table.filter(vis).group_by("method", "s").agg(
        pl.len().alias("rows"),
        pl.col("alpha").median().alias("alpha_median"),
        pl.col("alpha_kept").median().alias("alpha_A_median"),
        (pl.col("alpha_kept") >= pl.col("alpha") - 1e-12).mean().alias("share_alpha_A_ge_alpha"),
        pl.col("contains_useful").mean().alias("share_U_in_A"),
        pl.col("error_scaling").filter(pl.col("error_scaling").is_finite()).median().alias("error_scaling_median"),
        pl.col("err_ratio").filter(pl.col("err_ratio").is_finite()).median().alias("err_ratio_median"),
    ).sort("method", "s", nulls_last=False))


def check_report(out: Path, table: pl.DataFrame, heads: pl.DataFrame, checks: pl.DataFrame, cfg: Any,
                 store: Any) -> Path:
    """Write ``<out stem>.md`` and its figures (``<out stem>.figures/``); return the report path."""
    from evictlab.dilution.keptsets import KEPT_SET_NOTES
    from evictlab.plots.dilution import alpha_heatmap, bound_scatter, kept_gain

    figdir = out.with_name(f"{out.stem}.figures")
    figdir.mkdir(exist_ok=True)
    figs = []
    for fn, data, name in ((alpha_heatmap, heads, "alpha_by_head"), (bound_scatter, table, "alpha_vs_bound"),
                           (kept_gain, table, "kept_gain")):
        try:
            figs.append(fn(data, figdir / name))
        except Exception as exc:  # a figure with no data to show is skipped, the report says so
            if type(exc).__name__ != "InputError":
                raise
            figs.append(None)
    man = store.manifest
    full = table.filter(pl.col("method") == "full")
    vis = full.filter(pl.col("useful_visible"))
    report = out.with_name(f"{out.stem}.md")
    sections = [
        f"# Attention dilution check: {man['model']}",
        f"Dataset `{store.path}`: {store.n_rows} rows, {store.prompts.height} prompts, capture mode "
        f"**{man['capture_mode']}** (query-agnostic rows: queries inside the context, no question shown; "
        "query-aware rows: the question's own queries), weights as captured (registry models: Q4 GGUF, "
        "dequantised). Useful part of an asked fact: "
        f"`{cfg.useful}`. Rows whose useful keys are not visible (a fact after the query, or outside a sliding "
        f"window): {full.height - vis.height} of {full.height}; they have no alpha bound and are left out of medians.",
        _DEFS,
        "## Bound checks",
        "Every inequality of docs/theory.md section 7 on every row: `violations` counts rows where the "
        "assumptions hold and the inequality fails beyond the tolerance 1e-9 (there must be none); "
        "`violations_when_fails` counts failures where an assumption does not hold (allowed). Slack = how far "
        "inside the inequality (min, median, max over rows where it applies).",
        md.table(checks.select("check", "theorem", "statement", "assumption_holds", "violations", "assumption_fails",
                               "violations_when_fails", "slack_min", "slack_median", "slack_max"), digits=4),
        "## Useful mass per kept set",
        "Kept sets (s = keys kept per row): " + "; ".join(f"`{k}`: {v}" for k, v in KEPT_SET_NOTES.items()
                                                           if k in cfg.methods) + ".",
        md.table(_method_table(table), digits=4),
        "## Per layer and head (full cache, the 10 heads with the largest mean alpha)",
        md.table(heads.filter(pl.col("method") == "full").sort("alpha_mean", descending=True, nulls_last=True)
                 .head(10).select("layer", "q_head", "rows_useful_visible", "alpha_mean", "alpha_median",
                                  "margin_median", "mass_sink_mean", "mass_other_facts_mean"), digits=4),
        f"The full table per (layer, head, kept set, s) is `{out.stem}.heads.parquet`; every row is in `{out.name}`.",
        "## Figures",
        *[md.figure(f.png, f.caption, report.parent) if f else "(figure skipped: no rows to show)" for f in figs],
        "## Configuration",
        _config_block(cfg),
    ]
    return md.write(report, sections)


def sweep_report(out_dir: Path, summary: pl.DataFrame, verdict: pl.DataFrame, cfg: Any, figure: Any) -> Path:
    """Write ``DIR/report.md`` of a distractor sweep; return its path."""
    report = out_dir / "report.md"
    sections = [
        "# Attention dilution: the distractor sweep",
        ("Each example is a needle task (one asked needle) with k near-miss needles (other keys, other values) "
         "inserted into a noise haystack of fixed length; the context grows with k (distractor kind `near_miss`)."
         if cfg.kind == "near_miss" else
         "Each example is a needle task (one asked needle, no other needle) whose haystack grows by as many filler "
         "tokens as k near-miss needles would take (distractor kind `filler`: the same lengths, no near miss).") +
        f" Every method runs through the decode loop at the same kept-entry budget "
        f"**{cfg.budget}** (matched bytes; the paged store frees evicted entries), protocol **query-agnostic** "
        "(the context is compressed before the question is appended), then the answer is scored teacher-forced: "
        "exact match (greedy reproduces the answer tokens), answer log-probability (nats, sum over answer "
        "tokens). `oracle_labels` is an ORACLE: it keeps every token of the asked needle (it reads the labels) "
        "and otherwise the sinks and most recent keys. The full cache evicts nothing. Useful mass: the mean over "
        "layers and query heads of the last question token's attention on the asked needle's tokens, in the "
        "full-cache forward, renormalised over the keys each method kept after the context (alpha_A, "
        "docs/theory.md section 7).",
        "Weights: the registry models are Q4 GGUF checkpoints dequantised to float32.",
        "## Where eviction beats the full cache",
        "Per distractor count, each method is compared with the full cache on the same examples: the mean "
        "difference (method - full) of exact match and of answer log-probability, each with a 95% paired "
        "percentile-bootstrap interval over examples (the unit resampled is the example). Verdict `beats full` / "
        "`loses to full`: the exact-match interval excludes 0; otherwise `... (log-prob)`: the log-probability "
        "interval excludes 0; otherwise `tie`; with fewer than 5 examples `too few examples`. Rows marked "
        "`oracle` use information no real method has.",
        md.table(verdict, digits=3),
        "## Means per model, distractor count and method",
        md.table(summary, digits=3),
    ]
    if figure is not None:
        sections += ["## Figure", md.figure(figure.png, figure.caption, out_dir)]
    sections += ["## Configuration", _config_block(cfg)]
    return md.write(report, sections)
