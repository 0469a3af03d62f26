"""One cell of the evaluation grid -> one row per example (:func:`run_cell`).

A cell (:class:`~evictlab.eval.spec.CellSpec`) is self-contained: the function loads the
model (cached per process, :func:`load_cached`), builds the cell's seeded examples, runs the
full-cache reference for them if this process has not yet (cached per process,
:func:`full_reference`: a local run computes it once per (model, task, context); a remote
worker at most once per worker), runs the method through the decode loop and returns a
polars frame with the columns of :data:`RESULT_COLUMNS`. Same cell, same bits.

Metrics per example (teacher forcing over the answer tokens; natural logs):

- ``exact_match``: 1.0 iff every answer token is the argmax of its logits, which is exactly
  "greedy decoding reproduces the answer tokens" (the teacher-forced path *is* the greedy
  path while the argmaxes agree, compressions included); null for ``heldout_ppl``;
- ``answer_logprob``: sum over answer tokens of log p(token) (nats): ranks methods even
  where exact match is at a floor or a ceiling; ``answer_nll`` its per-token mean and
  ``ppl = exp(answer_nll)`` (the held-out perplexity on ``heldout_ppl``);
- ``kl``: mean over answer positions of KL(full cache || this cache), nats;
- ``top1_agreement``: share of answer positions where both caches' argmax agree.

Bytes (:class:`~evictlab.kv.budget.ByteReport`, whole store, one sequence):
``bytes_live`` (held K/V right after compressions, max over the run; the masked store holds
every entry appended), ``bytes_live_peak`` (max at any step: what the protocol needs;
query-aware holds the whole prefix before its compression), ``bytes_allocated`` (peak of
the store's buffers), ``bytes_index``, ``bytes_transient``, ``bytes_full`` (what a cache
without eviction holds at the end) and ``bytes_budget`` (the budget's analytic bytes). For
the full-cache rows every held/allocated column is ``bytes_full`` (the stock cache's
buffers are not measured).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl

from evictlab.errors import InputError
from evictlab.eval.spec import FULL, CellSpec
from evictlab.models.loading import clear_loaded, load_cached

__all__ = ["RESULT_COLUMNS", "FullReference", "check_context", "check_lengths", "clear_caches", "full_reference",
           "load_cached", "run_cell", "run_cell_traced"]

RESULT_COLUMNS: dict[str, Any] = {
    "cell": pl.Utf8, "model": pl.Utf8, "task": pl.Utf8, "context": pl.Int64, "method": pl.Utf8,
    "scorer": pl.Utf8, "allocator": pl.Utf8, "mode": pl.Utf8, "protocol": pl.Utf8,
    "budget": pl.Utf8, "budget_unit": pl.Utf8, "budget_value": pl.Int64,
    "scorer_params": pl.Utf8, "allocator_params": pl.Utf8,
    "chunk_size": pl.Int64, "compress_every": pl.Int64, "window": pl.Int64, "sinks": pl.Int64,
    "recent": pl.Int64, "block_size": pl.Int64, "device": pl.Utf8,
    "seed": pl.Int64, "example": pl.Int64, "example_seed": pl.Int64,
    "context_tokens": pl.Int64, "question_tokens": pl.Int64, "answer_tokens": pl.Int64,
    "exact_match": pl.Float64, "answer_logprob": pl.Float64, "answer_nll": pl.Float64, "ppl": pl.Float64,
    "kl": pl.Float64, "top1_agreement": pl.Float64,
    "budget_tokens": pl.Int64, "budget_effective_tokens": pl.Int64, "bytes_budget": pl.Int64,
    "bytes_live": pl.Int64, "bytes_live_peak": pl.Int64, "bytes_allocated": pl.Int64,
    "bytes_index": pl.Int64, "bytes_transient": pl.Int64, "bytes_full": pl.Int64,
    "compressions": pl.Int64, "wall_s": pl.Float64,
}
"""Columns of a cell's frame (and of ``results.parquet``), in order, with their dtypes."""


class _LRU:
    """A small thread-safe LRU map (model loads and full-cache references per process)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: OrderedDict[Any, Any] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        value = make()
        with self.lock:
            self.items[key] = value
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value

    def clear(self) -> None:
        with self.lock:
            self.items.clear()


_EXAMPLES = _LRU(16)
_REFERENCES = _LRU(2)  # full-cache logits over the answers: (n, T, vocab) floats each


def clear_caches() -> None:
    """Forget the cached models, examples and full-cache references of this process."""
    clear_loaded()
    for c in (_EXAMPLES, _REFERENCES):
        c.clear()


def cell_examples(cell: CellSpec, tokenizer: Any) -> list[Any]:
    """The seeded examples of ``cell`` (cached per process)."""
    from evictlab.tasks.examples import eval_examples

    key = (cell.model, cell.task, cell.context, cell.n, cell.seed, cell.target_tokens)
    return _EXAMPLES.get(key, lambda: eval_examples(cell.task, cell.n, cell.context, tokenizer, cell.seed,
                                                    target_tokens=cell.target_tokens))


def _max_positions(model: Any) -> int | None:
    from evictlab.models.geometry import text_config

    v = getattr(text_config(model), "max_position_embeddings", None)
    return int(v) if v else None


def check_context(cell: CellSpec, model: Any) -> None:
    """Refuse (field ``contexts``) a requested context at or beyond the model's positions,
    before any example of that length is built (building one costs time and memory)."""
    limit = _max_positions(model)
    if limit is not None and cell.context >= limit:
        raise InputError("contexts", f"{cell.context} tokens is at or beyond {cell.model}'s {limit} positions",
                         f"use contexts below {limit} tokens (the question and the answer need room too)")


def check_lengths(cell: CellSpec, model: Any, examples: list[Any]) -> None:
    """Refuse (field ``contexts``) an example longer than the model's positions."""
    limit = _max_positions(model)
    if limit is None:
        return
    for ex in examples:
        total = len(ex.context_ids) + len(ex.question_ids) + len(ex.answer_ids)
        if total > limit:
            raise InputError("contexts", f"{cell.task} at {cell.context} tokens makes a {total}-token example "
                             f"(context, question and answer), beyond {cell.model}'s {limit} positions",
                             f"use contexts up to about {limit - (total - cell.context)} tokens")


@dataclass
class FullReference:
    """The full cache on a cell's examples: per example the answer logits ``(T, vocab)``
    float32 (CPU), the decode output's byte count and wall time."""

    logits: list[Any]
    bytes_full: list[int]
    wall_s: list[float]


def full_reference(cell: CellSpec, progress: Callable[[int], None] | None = None) -> FullReference:
    """The full-cache run of ``cell``'s examples (cached per process by the full cell)."""
    full = cell.full_cell()

    def make() -> FullReference:
        import torch

        from evictlab.decode.loop import run_sequence
        from evictlab.kv.cache import register_ragged_attention

        lm, tok = load_cached(full.model, full.device, attn_implementation=register_ragged_attention())
        check_context(full, lm)
        examples = cell_examples(full, tok)
        check_lengths(full, lm, examples)
        cfg = full.decode_config()
        ref = FullReference([], [], [])
        dev = next(lm.parameters()).device
        for ex in examples:
            c, q, a = (torch.tensor([x], dtype=torch.long, device=dev)
                       for x in (ex.context_ids, ex.question_ids, ex.answer_ids))
            with torch.no_grad():
                out = run_sequence(lm, c, q, cfg, answer_ids=a, tokenizer=tok)
            ref.logits.append(out.logits[0].float().cpu())
            ref.bytes_full.append(int(out.bytes_full_cache))
            ref.wall_s.append(float(out.wall_s))
            if progress is not None and cell.is_full:
                progress(1)
        return ref

    return _REFERENCES.get(full, make)


def example_metrics(full_logits: Any, logits: Any, answer: Any, *, scored: bool = True) -> dict[str, float | None]:
    """The per-example metrics (module docstring) from answer logits ``(T, vocab)`` of the
    full cache and of this cache, and the answer ids ``(T,)``; ``scored=False``: no exact
    match (a perplexity window has no answer to match)."""
    from evictlab.decode.metrics import next_token_kl, token_nll, top1_agreement

    nll = token_nll(logits, answer)
    mean_nll = float(nll.mean())
    return {
        "exact_match": float(bool((logits.argmax(-1) == answer).all())) if scored else None,
        "answer_logprob": -float(nll.sum()),
        "answer_nll": mean_nll,
        "ppl": math.exp(mean_nll),
        "kl": next_token_kl(full_logits, logits).mean,
        "top1_agreement": top1_agreement(full_logits, logits),
    }


def _params_json(params: tuple[tuple[str, str], ...]) -> str:
    return json.dumps(dict(params), sort_keys=True)


def run_cell(cell: CellSpec, progress: Callable[[int], None] | None = None) -> pl.DataFrame:
    """Run one cell; one row per example (columns :data:`RESULT_COLUMNS`).

    ``progress`` (optional, not part of the work) is called with 1 after each example.
    Picklable input, polars output: a local loop or a remote executor can call it.
    """
    return _run_cell(cell, progress, None)


def run_cell_traced(cell: CellSpec, progress: Callable[[int], None] | None = None
                    ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """:func:`run_cell` plus the per-compression diagnostics of every example
    (:class:`~evictlab.decode.trace.CompressionTrace`: one row per (compression, layer, KV
    head) with kept and held entries, the observation window's dropped mass, e(A), e(T_s)
    and ES_hat), labelled ``cell``, ``model``, ``task``, ``context``, ``method``, ``mode``,
    ``protocol``, ``budget``, ``example``. The full cell compresses nothing: empty trace."""
    from evictlab.decode.trace import CompressionTrace

    tracer = None if cell.is_full else CompressionTrace()
    frame = _run_cell(cell, progress, tracer)
    return frame, (pl.DataFrame() if tracer is None else tracer.table())


def _run_cell(cell: CellSpec, progress: Callable[[int], None] | None, tracer: Any) -> pl.DataFrame:
    import torch

    from evictlab.decode.loop import run_sequence
    from evictlab.tasks.examples import HELDOUT_PPL, useful_spec
    from evictlab.kv.budget import Budget, kv_bytes
    from evictlab.kv.cache import register_ragged_attention
    from evictlab.models.geometry import model_geometry

    lm, tok = load_cached(cell.model, cell.device, attn_implementation=register_ragged_attention())
    check_context(cell, lm)
    examples = cell_examples(cell, tok)
    ref = full_reference(cell, progress)
    g = model_geometry(lm)
    dev = next(lm.parameters()).device
    budget = Budget.parse(cell.budget) if cell.budget else None
    common = {
        "cell": cell.key, "model": cell.model, "task": cell.task, "context": cell.context, "method": cell.method,
        "scorer": cell.scorer, "allocator": ("uniform" if cell.mode == "uniform" else cell.allocator),
        "mode": cell.mode, "protocol": cell.protocol, "budget": cell.budget,
        "budget_unit": budget.unit if budget else None, "budget_value": budget.value if budget else None,
        "scorer_params": _params_json(cell.scorer_params),
        "allocator_params": _params_json(() if cell.mode == "uniform" else cell.allocator_params),
        "chunk_size": cell.loop.chunk_size, "compress_every": cell.loop.compress_every,
        "window": cell.loop.window, "sinks": cell.loop.sinks, "recent": cell.loop.recent,
        "block_size": cell.loop.block_size, "device": cell.device, "seed": cell.seed,
    }
    cfg = None if cell.is_full else cell.decode_config()
    rows: list[dict[str, Any]] = []
    for i, ex in enumerate(examples):
        a = torch.tensor(ex.answer_ids, dtype=torch.long)
        row = {**common, "example": ex.index, "example_seed": ex.seed, "context_tokens": len(ex.context_ids),
               "question_tokens": len(ex.question_ids), "answer_tokens": len(ex.answer_ids)}
        if cfg is None:
            full_bytes = ref.bytes_full[i]
            row.update(example_metrics(ref.logits[i], ref.logits[i], a, scored=cell.task != HELDOUT_PPL))
            row.update(budget_tokens=None, budget_effective_tokens=None, bytes_budget=None, bytes_live=full_bytes,
                       bytes_live_peak=full_bytes, bytes_allocated=full_bytes, bytes_index=0, bytes_transient=0,
                       bytes_full=full_bytes, compressions=0, wall_s=ref.wall_s[i])
        else:
            c, q, ad = (torch.tensor([x], dtype=torch.long, device=dev)
                        for x in (ex.context_ids, ex.question_ids, ex.answer_ids))
            if tracer is not None:
                tracer.label(cell=cell.key, model=cell.model, task=cell.task, context=cell.context,
                             method=cell.method, mode=cell.mode, protocol=cell.protocol, budget=cell.budget,
                             example=ex.index)
            t0 = time.perf_counter()
            ex_cfg = cfg.with_labels(lambda: useful_spec(ex, tok))  # oracle_labels: this example's labels
            with torch.no_grad():
                out = run_sequence(lm, c, q, ex_cfg, answer_ids=ad, tokenizer=tok, compression_trace=tracer)
            wall = time.perf_counter() - t0
            row.update(example_metrics(ref.logits[i], out.logits[0].float().cpu(), a,
                                       scored=cell.task != HELDOUT_PPL))
            btok = out.budget_tokens
            row.update(
                budget_tokens=btok, budget_effective_tokens=out.budget_effective_tokens,
                bytes_budget=None if btok is None else kv_bytes(btok, g.head_dim, g.dtype),
                bytes_live=out.after_compression("bytes_live") or out.peak("bytes_live"),
                bytes_live_peak=out.peak("bytes_live"), bytes_allocated=out.peak("bytes_allocated"),
                bytes_index=out.peak("bytes_index"), bytes_transient=out.peak("bytes_transient"),
                bytes_full=out.bytes_full_cache, compressions=out.compressions, wall_s=wall)
            if progress is not None:
                progress(1)
        rows.append(row)
    return pl.DataFrame(rows, schema=RESULT_COLUMNS)
