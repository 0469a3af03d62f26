"""The Markdown report of a masked-vs-physical audit (:mod:`evictlab.decode.audit`)."""

from __future__ import annotations

from typing import Any

import polars as pl

from evictlab.report.markdown import table

COLUMNS = ["method", "mode", "budget_per_cell", "budget_tokens", "budget_effective_tokens", "bytes_budget",
           "bytes_live", "bytes_allocated", "bytes_full_cache", "freed_fraction", "peak_rss", "exact_match", "kl",
           "top1_agreement"]


def audit_markdown(df: pl.DataFrame, *, model: str, config: dict[str, Any], figure: str | None) -> str:
    """A Markdown report of the audit table (masked entries are never counted as freed)."""
    cols = [c for c in COLUMNS if c in df.columns]
    lines = [
        f"# Masked vs physical KV eviction audit: {model}",
        "",
        "Each method runs at the same nominal budget twice: **masked** (full K/V tensors plus a keep",
        "mask, the way kvpress applies per-head budgets) and **physical** (evictlab's paged store with",
        "one block-table row per (layer, KV head); evicted entries are freed). Both attend to exactly",
        "the same kept entries, so accuracy and KL agree; the bytes do not. A masked entry is never",
        "counted as freed: the masked store's `bytes_live` is every K/V byte it still holds.",
        "",
        "Budgets count *kept* entries after a compression, summed over cells (a cell = one layer x KV",
        "head); bytes = kept x 2 x head_dim x dtype size; index overhead is in `bytes_index`.",
        "`budget_effective_tokens` = min(budget, the full cache's entries): below `budget_tokens` the",
        "budget is above the full cache and nothing is evicted. Method parameters are in the",
        "`scorer_params` / `allocator_params` columns of the table.",
        "Protocol: query-agnostic unless `query_aware` is true below (the context is compressed before",
        "the question is appended). `exact_match` = greedy decoding reproduces the answer tokens",
        "exactly (computed teacher-forced); `kl` = next-token KL(full || compressed) over the answer",
        "tokens, nats. Model weights may be quantised (Q4 GGUF for the registry models): this does",
        "not change the comparison. `peak_rss` is one process's resident memory (all runs share it).",
        "",
        table(df.select(cols), digits=4),
        "",
        "## Configuration",
        "",
        "```",
        *(f"{k}: {v}" for k, v in sorted(config.items())),
        "```",
        "",
    ]
    if figure:
        lines += [f"![audit]({figure})", ""]
    return "\n".join(lines)
