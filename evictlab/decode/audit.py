"""The masked-vs-physical audit: each method at the same nominal budget, side by side.

For every (method, budget) the same examples run twice through :func:`run_sequence`:
``mode="masked"`` (full K/V + keep mask, as kvpress applies per-head budgets) and
``mode="physical"`` (the paged store that frees evicted entries). Both keep exactly the
same entries, so their accuracy/KL agree; their bytes do not. A ``mode="full"`` row (no
eviction, stock ``DynamicCache``) is the reference for KL and top-1 agreement.

One row per (method, mode, budget) with:

- ``method`` (``scorer`` or ``scorer+allocator``), ``scorer``, ``allocator``, ``mode``,
  ``scorer_params`` / ``allocator_params`` (JSON of the parameters given), ``protocol``
  (``query-agnostic`` or ``query-aware``), ``chunk_size``;
- ``budget_unit`` and ``budget_value`` (as given), ``budget_tokens`` (kept entries per
  sequence, summed over cells), ``budget_per_cell``, ``budget_effective_tokens``
  (``min(budget_tokens, the full cache's entries)``: when smaller than ``budget_tokens`` the
  budget is above the full cache and nothing is evicted), ``bytes_budget`` (analytic:
  budget_tokens x 2 x head_dim x dtype size);
- ``bytes_live``: K/V bytes held right after compressions (max over the run); for the
  masked store this is every entry appended so far (masking frees nothing);
- ``bytes_live_peak``: the same, maximum at any step (includes the question/answer tokens
  and the prefill chunk between compressions);
- ``bytes_allocated``: peak bytes of the store's K/V buffers (paged pool capacity incl.
  free pages and headroom; masked buffers incl. unused capacity);
- ``bytes_index``: index overhead (block tables, positions, masks), peak;
- ``bytes_transient``: the paged store's reusable gather buffer (one layer), peak;
- ``bytes_full_cache``: the full cache of the longest sequence at its end (context + question +
  answer but its last token, which is never fed: what a cache without eviction holds);
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

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl
import torch

from evictlab.decode.config import DecodeConfig, LoopSettings
from evictlab.decode.loop import DecodeOutput, run_sequence
from evictlab.errors import InputError, refuse_duplicates
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.methods import build_method, canonical_method, parse_method
from evictlab.methods.registry import route_params
from evictlab.models.geometry import model_geometry


@dataclass(frozen=True)
class Example:
    """One audit example: token ids of context, question and answer (lists of ints), and
    ``useful``: its labels for ``oracle_labels`` (:func:`evictlab.tasks.examples.useful_spec`;
    None: the example has none, and a method that reads them is refused)."""

    task: str
    context_ids: list[int]
    question_ids: list[int]
    answer_ids: list[int]
    useful: Callable[[], str | None] | None = None


def task_examples(tokenizer: Any, tasks: Sequence[str], n: int, context_tokens: int, seed: int) -> list[Example]:
    """Seeded synthetic examples (query-agnostic split of context and question)."""
    from functools import partial

    from evictlab.tasks.examples import encode_text, task_suite, useful_spec

    out = []
    for p in task_suite(list(tasks), n, context_tokens, tokenizer, seed):
        ans = encode_text(tokenizer, " " + p.answer, special=False)
        out.append(Example(p.task, p.context_ids, p.question_ids, ans, partial(useful_spec, p, tokenizer)))
    return out


def audit_configs(
    methods: Sequence[str],
    budgets: Sequence[Budget],
    *,
    loop: LoopSettings | None = None,
    query_aware: bool = False,
    modes: Sequence[str] = ("masked", "physical"),
    scorer_params: Mapping[str, Any] | None = None,
    allocator_params: Mapping[str, Any] | None = None,
) -> list[tuple[str, DecodeConfig]]:
    """Every ``(method spec, config)`` of an audit (the spec canonical: ``snapkv+uniform`` is
    ``snapkv``, bracket parameters sorted), validated before anything runs; each
    method is built once (:func:`~evictlab.methods.build_method`) and shared by its
    budgets and modes.

    Refuses (:class:`InputError`, neutral fields ``method``, ``budget``, ``mode``,
    ``scorer_param``, ``allocator_param``): no method, no budget, an unknown or repeated
    method, budget or mode, and parameters no chosen method has or with bad values
    (``k=v`` goes to every chosen scorer/allocator with a parameter ``k``, ``name.k=v`` to
    that one; see :func:`evictlab.methods.registry.route_params`).
    """
    loop = loop or LoopSettings()
    if not methods:
        raise InputError("method", "no method given", "name at least one scorer or scorer+allocator")
    if not budgets:
        raise InputError("budget", "no budget given", "give at least one budget")
    if not modes:
        raise InputError("mode", "no mode given", "use masked and/or physical")
    bad = [m for m in modes if m not in ("masked", "physical")]
    if bad:
        raise InputError("mode", f"unknown mode {bad[0]!r}", "use masked and/or physical")
    refuse_duplicates([canonical_method(m) for m in methods], "method", "method")
    refuse_duplicates([f"{b.value} {b.unit}" for b in budgets], "budget", "budget")
    refuse_duplicates(list(modes), "mode", "mode")
    parsed = [(canonical_method(spec), *parse_method(spec)) for spec in methods]
    sp = route_params(scorer_params or {}, [s for _, s, _ in parsed], "scorer")
    ap = route_params(allocator_params or {}, [a for _, _, a in parsed], "allocator")
    out = []
    for spec, scorer, alloc in parsed:
        method = build_method(spec, sp[scorer], ap[alloc])
        for budget in budgets:
            for mode in modes:
                out.append((spec, DecodeConfig(mode=mode, budget=budget, method=method, loop=loop,  # type: ignore[arg-type]
                                               query_aware=query_aware)))
    return out


def _metrics(full: DecodeOutput, out: DecodeOutput, answer: torch.Tensor) -> dict[str, float]:
    from evictlab.decode.metrics import next_token_kl, perplexity, top1_agreement

    return {
        "exact_match": float(bool((out.logits.argmax(-1) == answer).all())),
        "kl": next_token_kl(full.logits, out.logits).mean,
        "top1_agreement": top1_agreement(full.logits, out.logits),
        "answer_ppl": perplexity(out.logits, answer),
    }


def _params_json(params: Mapping[str, Any]) -> str:
    return json.dumps({k: str(v) if not isinstance(v, (int, float, bool, str, type(None))) else v
                       for k, v in sorted(params.items())})


def run_audit(
    model: torch.nn.Module,
    examples: Sequence[Example],
    configs: Sequence[tuple[str, DecodeConfig]],
    *,
    loop: LoopSettings | None = None,
    tokenizer: Any = None,
    progress: Callable[[str], None] | None = None,
    compression_trace: Any = None,
) -> pl.DataFrame:
    """Run every ``(method spec, config)`` of :func:`audit_configs` on ``examples``; return
    one row per combination (plus one ``mode="full"`` reference row with ``loop``). See the
    module docstring for the columns. ``compression_trace``: a
    :class:`~evictlab.decode.trace.CompressionTrace` that records every compression of every
    run, labelled by method, mode, budget, task and example.

    Every budget is checked against the model's always-kept floor, and every method against
    the model (e.g. a ContourKV profile of another model), before the first run.
    """
    if not examples:
        raise InputError("n", "no examples", "use at least one example")
    if not configs:
        raise InputError("method", "no method given", "name at least one scorer or scorer+allocator")
    loop = loop or configs[0][1].loop
    device = next(model.parameters()).device
    g = model_geometry(model)
    cells = g.n_layers * g.kv_heads
    shortest = min(len(ex.context_ids) + len(ex.question_ids) + len(ex.answer_ids) for ex in examples)
    for _, cfg in configs:
        cfg.budget_tokens(g, shortest)  # below the floor: refused before anything runs
        assert cfg.method is not None
        cfg.method.for_model(g)  # e.g. a ContourKV profile of another model (bound once, reused by the runs)
    say = progress or (lambda _m: None)

    def tensors(ex: Example) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor([x], dtype=torch.long, device=device)
        return t(ex.context_ids), t(ex.question_ids), t(ex.answer_ids)

    protocol = configs[0][1].protocol
    common = {"protocol": protocol, "chunk_size": loop.chunk_size}
    say("full cache reference")
    full_cfg = DecodeConfig(mode="full", loop=loop)
    fulls = [run_sequence(model, *tensors(ex)[:2], full_cfg, answer_ids=tensors(ex)[2]) for ex in examples]
    full_bytes = max(f.bytes_full_cache for f in fulls)
    full_mets = [_metrics(f, f, tensors(ex)[2]) for f, ex in zip(fulls, examples)]
    rows: list[dict[str, Any]] = [{
        "method": "full", "scorer": "none", "allocator": "none", "mode": "full", "scorer_params": "{}",
        "allocator_params": "{}", **common, "budget_unit": None, "budget_value": None,
        "budget_tokens": None, "budget_per_cell": None, "budget_effective_tokens": None, "bytes_budget": None,
        "bytes_live": full_bytes, "bytes_live_peak": full_bytes, "bytes_allocated": full_bytes,
        "bytes_index": 0, "bytes_transient": 0, "bytes_full_cache": full_bytes, "freed_fraction": 0.0,
        "peak_rss": max(f.peak_rss for f in fulls), "peak_rss_delta": None,
        "exact_match": sum(m["exact_match"] for m in full_mets) / len(fulls),
        "kl": 0.0, "top1_agreement": 1.0,
        "answer_ppl": sum(m["answer_ppl"] for m in full_mets) / len(fulls),
        "n_examples": len(examples), "wall_s": sum(f.wall_s for f in fulls),
    }]
    for spec, cfg in configs:
        budget = cfg.budget
        assert budget is not None
        say(f"{spec} {cfg.mode} budget={budget.value} {budget.unit}")
        outs, mets = [], []
        for i, (ex, full) in enumerate(zip(examples, fulls)):
            c, q, a = tensors(ex)
            if compression_trace is not None:
                compression_trace.label(facts=ex.useful, method=spec, mode=cfg.mode, budget_unit=budget.unit,
                                        budget_value=budget.value, protocol=protocol, task=ex.task, example=i)
            rss_before = _rss()
            out = run_sequence(model, c, q, cfg.with_labels(ex.useful or (lambda: None)), answer_ids=a,
                               tokenizer=tokenizer, compression_trace=compression_trace)
            outs.append((out, rss_before))
            mets.append(_metrics(full, out, a))
        btok = outs[0][0].budget_tokens
        live = max(o.after_compression("bytes_live") or o.peak("bytes_live") for o, _ in outs)
        rows.append({
            "method": spec, "scorer": cfg.method.scorer_name, "allocator": cfg.method.allocator_name, "mode": cfg.mode,
            "scorer_params": _params_json(cfg.method.scorer_params),
            "allocator_params": _params_json(cfg.method.allocator_params),
            **common, "budget_unit": budget.unit, "budget_value": budget.value,
            "budget_tokens": btok, "budget_per_cell": btok / cells,
            "budget_effective_tokens": max(o.budget_effective_tokens for o, _ in outs),
            "bytes_budget": kv_bytes(btok, g.head_dim, g.dtype),
            "bytes_live": live,
            "bytes_live_peak": max(o.peak("bytes_live") for o, _ in outs),
            "bytes_allocated": max(o.peak("bytes_allocated") for o, _ in outs),
            "bytes_index": max(o.peak("bytes_index") for o, _ in outs),
            "bytes_transient": max(o.peak("bytes_transient") for o, _ in outs),
            "bytes_full_cache": full_bytes,
            "freed_fraction": min(_freed_fraction(o, cells) for o, _ in outs),
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
