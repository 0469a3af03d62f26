"""The masked-vs-physical audit: each method at the same nominal budget, side by side.

For every (method, budget) the same examples run twice through :func:`run_sequence`:
``mode="masked"`` (full K/V + keep mask, as kvpress applies per-head budgets) and
``mode="physical"`` (the paged store that frees evicted entries). Both keep exactly the
same entries, so their accuracy/KL agree; their bytes do not. A ``mode="full"`` row (no
eviction, stock ``DynamicCache``) is the reference for KL and top-1 agreement.

One row per (method, mode, budget) with:

- ``method`` (``scorer`` or ``scorer+allocator``), ``scorer``, ``allocator``, ``mode``;
- ``budget_tokens`` (kept entries per sequence, summed over cells), ``budget_per_cell``,
  ``bytes_budget`` (analytic: budget_tokens x 2 x head_dim x dtype size);
- ``bytes_live``: K/V bytes held right after compressions (max over the run); for the
  masked store this is every entry appended so far (masking frees nothing);
- ``bytes_live_peak``: the same, maximum at any step (includes the question/answer tokens
  and the prefill chunk between compressions);
- ``bytes_allocated``: peak bytes of the store's K/V buffers (paged pool capacity incl.
  free pages and headroom; masked buffers incl. unused capacity);
- ``bytes_index``: index overhead (block tables, positions, masks), peak;
- ``bytes_transient``: the paged store's reusable gather buffer (one layer), peak;
- ``bytes_full_cache``: the full cache of the longest sequence (context+question+answer);
- ``freed_fraction``: share of appended K/V entries no longer held, at the last compression
  (``1 - held / appended``); exactly 0 for masked (masking frees nothing);
- ``peak_rss``, ``peak_rss_delta``: process resident memory (psutil), peak during the run
  and its rise over the run's start (same process for every run: read with care);
- task metrics (means over examples): ``exact_match`` (greedy decoding reproduces the
  answer tokens exactly: computed teacher-forced, all argmax right), ``kl`` (next-token
  KL(full || compressed), nats), ``top1_agreement``, ``answer_ppl``; ``n_examples``,
  ``wall_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import polars as pl
import torch

from evictlab.decode.loop import DecodeConfig, DecodeOutput, model_geometry, run_sequence
from evictlab.errors import InputError
from evictlab.kv.budget import Budget, kv_bytes


@dataclass(frozen=True)
class Example:
    """One audit example: token ids of context, question and answer (lists of ints)."""

    task: str
    context_ids: list[int]
    question_ids: list[int]
    answer_ids: list[int]


def parse_method(spec: str) -> tuple[str, str]:
    """``"snapkv"`` -> ``("snapkv", "uniform")``; ``"snapkv+adakv"`` -> ``("snapkv", "adakv")``."""
    from evictlab.methods import ALLOCATORS, REGISTRY

    scorer, _, alloc = spec.partition("+")
    alloc = alloc or "uniform"
    if scorer not in REGISTRY:
        raise InputError("--methods", f"unknown scorer {scorer!r}", f"use one of {sorted(REGISTRY)}")
    if alloc not in ALLOCATORS:
        raise InputError("--methods", f"unknown allocator {alloc!r}", f"use one of {sorted(ALLOCATORS)}")
    return scorer, alloc


def task_examples(tokenizer: Any, tasks: Sequence[str], n: int, context_tokens: int, seed: int) -> list[Example]:
    """Seeded synthetic examples (query-agnostic split of context and question)."""
    from evictlab.decode.tasks import encode_text, task_suite

    out = []
    for p in task_suite(list(tasks), n, context_tokens, tokenizer, seed):
        ans = encode_text(tokenizer, " " + p.answer, special=False)
        out.append(Example(p.task, p.context_ids, p.question_ids, ans))
    return out


def _metrics(full: DecodeOutput, out: DecodeOutput, answer: torch.Tensor) -> dict[str, float]:
    from evictlab.decode.metrics import next_token_kl, perplexity, top1_agreement

    return {
        "exact_match": float(bool((out.logits.argmax(-1) == answer).all())),
        "kl": next_token_kl(full.logits, out.logits).mean,
        "top1_agreement": top1_agreement(full.logits, out.logits),
        "answer_ppl": perplexity(out.logits, answer),
    }


def run_audit(
    model: torch.nn.Module,
    examples: Sequence[Example],
    methods: Sequence[str],
    budgets: Sequence[Budget],
    *,
    base: DecodeConfig | None = None,
    modes: Sequence[str] = ("masked", "physical"),
    tokenizer: Any = None,
    progress: Callable[[str], None] | None = None,
) -> pl.DataFrame:
    """Run every (method, budget, mode) on ``examples``; return one row per combination
    (plus one ``mode="full"`` reference row). See the module docstring for the columns."""
    if not examples:
        raise InputError("--n", "no examples", "use at least one example")
    base = base or DecodeConfig()
    device = next(model.parameters()).device
    n_layers, _, hk, d, dtype = model_geometry(model)
    say = progress or (lambda _m: None)

    def tensors(ex: Example) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor([x], dtype=torch.long, device=device)
        return t(ex.context_ids), t(ex.question_ids), t(ex.answer_ids)

    say("full cache reference")
    fulls = [run_sequence(model, *tensors(ex)[:2], replace(base, mode="full"), answer_ids=tensors(ex)[2])
             for ex in examples]
    full_bytes = max(f.bytes_full_cache for f in fulls)
    rows: list[dict[str, Any]] = [{
        "method": "full", "scorer": "none", "allocator": "none", "mode": "full",
        "budget_tokens": None, "budget_per_cell": None, "bytes_budget": None,
        "bytes_live": full_bytes, "bytes_live_peak": full_bytes, "bytes_allocated": full_bytes,
        "bytes_index": 0, "bytes_transient": 0, "bytes_full_cache": full_bytes, "freed_fraction": 0.0,
        "peak_rss": max(f.peak_rss for f in fulls), "peak_rss_delta": None,
        "exact_match": sum(_metrics(f, f, tensors(ex)[2])["exact_match"] for f, ex in zip(fulls, examples)) / len(fulls),
        "kl": 0.0, "top1_agreement": 1.0,
        "answer_ppl": sum(_metrics(f, f, tensors(ex)[2])["answer_ppl"] for f, ex in zip(fulls, examples)) / len(fulls),
        "n_examples": len(examples), "wall_s": sum(f.wall_s for f in fulls),
    }]
    for spec in methods:
        scorer, alloc = parse_method(spec)
        for budget in budgets:
            for mode in modes:
                if mode not in ("masked", "physical"):
                    raise InputError("--modes", f"unknown mode {mode!r}", "use masked and/or physical")
                say(f"{spec} {mode} budget={budget.value} {budget.unit}")
                cfg = replace(base, mode=mode, budget=budget, scorer=scorer, allocator=alloc)
                outs, mets = [], []
                for ex, full in zip(examples, fulls):
                    c, q, a = tensors(ex)
                    rss_before = _rss()
                    out = run_sequence(model, c, q, cfg, answer_ids=a, tokenizer=tokenizer)
                    outs.append((out, rss_before))
                    mets.append(_metrics(full, out, a))
                btok = outs[0][0].budget_tokens
                live = max(o.after_compression("bytes_live") or o.peak("bytes_live") for o, _ in outs)
                rows.append({
                    "method": spec, "scorer": scorer, "allocator": alloc, "mode": mode,
                    "budget_tokens": btok, "budget_per_cell": btok / (n_layers * hk),
                    "bytes_budget": kv_bytes(btok, d, dtype),
                    "bytes_live": live,
                    "bytes_live_peak": max(o.peak("bytes_live") for o, _ in outs),
                    "bytes_allocated": max(o.peak("bytes_allocated") for o, _ in outs),
                    "bytes_index": max(o.peak("bytes_index") for o, _ in outs),
                    "bytes_transient": max(o.peak("bytes_transient") for o, _ in outs),
                    "bytes_full_cache": full_bytes,
                    "freed_fraction": min(_freed_fraction(o, n_layers * hk) for o, _ in outs),
                    "peak_rss": max(o.peak_rss for o, _ in outs),
                    "peak_rss_delta": max(o.peak_rss - r for o, r in outs),
                    **{k: sum(m[k] for m in mets) / len(mets) for k in mets[0]},
                    "n_examples": len(examples), "wall_s": sum(o.wall_s for o, _ in outs),
                })
    return pl.DataFrame(rows, infer_schema_length=None)


def _freed_fraction(out: DecodeOutput, cells: int) -> float:
    """Share of the K/V entries appended so far that the store no longer holds, at the last
    compression: ``1 - held_tokens / (seen x cells x batch)``. Exactly 0 for the masked
    store (it holds every appended entry), whatever its keep mask says."""
    comp = [t for t in out.trace if t.phase == "compress"]
    if not comp:
        return 0.0
    last = comp[-1]
    batch = out.logits.shape[0]
    return 1.0 - last.report.held_tokens / (last.seen * cells * batch)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def audit_figure(df: pl.DataFrame, path_stem: str | Path) -> list[Path]:
    """Two panels from the audit table: K/V bytes held (live) and next-token KL, by method
    and mode. Writes ``<stem>.png`` and ``<stem>.pdf`` atomically; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    from evictlab.io import atomic_path

    d = df.filter(pl.col("mode") != "full").with_columns(
        (pl.col("bytes_live") / 2**20).alias("MiB held (K/V)"),
        (pl.col("method") + " @" + pl.col("budget_per_cell").round(0).cast(pl.Int64).cast(pl.Utf8)).alias("method @ budget/cell"),
    ).to_pandas()
    full_mib = float(df["bytes_full_cache"].max()) / 2**20
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 * max(4, d["method @ budget/cell"].nunique()) + 1.5))
    sns.barplot(d, y="method @ budget/cell", x="MiB held (K/V)", hue="mode", ax=axes[0],
                hue_order=["masked", "physical"], palette={"masked": "#c44e52", "physical": "#4c72b0"})
    axes[0].axvline(full_mib, color="k", ls="--", lw=1, label="full cache")
    axes[0].set_title("K/V bytes held after compression")
    axes[0].legend(loc="lower right", fontsize=8)
    sns.barplot(d, y="method @ budget/cell", x="kl", hue="mode", ax=axes[1], hue_order=["masked", "physical"],
                palette={"masked": "#c44e52", "physical": "#4c72b0"})
    axes[1].set_title("next-token KL to the full cache")
    axes[1].set_xlabel("KL(full || compressed), nats")
    axes[1].set_ylabel("")
    fig.tight_layout()
    paths = []
    for ext in ("png", "pdf"):
        dest = Path(f"{path_stem}.{ext}")
        with atomic_path(dest, suffix=f".{ext}") as tmp:
            fig.savefig(tmp, format=ext, dpi=150)
        paths.append(dest)
    plt.close(fig)
    return paths


def audit_markdown(df: pl.DataFrame, *, model: str, config: dict[str, Any], figure: str | None) -> str:
    """A Markdown report of the audit table (masked entries are never counted as freed)."""
    cols = ["method", "mode", "budget_per_cell", "budget_tokens", "bytes_budget", "bytes_live", "bytes_allocated",
            "bytes_full_cache", "freed_fraction", "peak_rss", "exact_match", "kl", "top1_agreement"]
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
        "Protocol: query-agnostic unless `query_aware` is true below (the context is compressed before",
        "the question is appended). `exact_match` = greedy decoding reproduces the answer tokens",
        "exactly (computed teacher-forced); `kl` = next-token KL(full || compressed) over the answer",
        "tokens, nats. Model weights may be quantised (Q4 GGUF for the registry models): this does",
        "not change the comparison. `peak_rss` is one process's resident memory (all runs share it).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in df.iter_rows(named=True):
        cells = []
        for c in cols:
            v = r.get(c)
            if v is None:
                cells.append("")
            elif isinstance(v, float):
                cells.append(f"{v:.4g}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Configuration", "", "```", *(f"{k}: {v}" for k, v in sorted(config.items())), "```", ""]
    if figure:
        lines += [f"![audit]({figure})", ""]
    return "\n".join(lines)
