"""The evaluation grid's units of work -> one row per (cell, example, question).

Two paths, one per prefill (:data:`evictlab.eval.spec.PREFILLS`):

- ``one-pass`` (the default): :func:`run_context` takes a
  :class:`~evictlab.eval.spec.ContextUnit` (one example of one (model, task, context) and
  every cell of it), prefills the context once
  (:meth:`evictlab.decode.shared.SharedContext.prefill`), answers every question with the
  full cache (:func:`~evictlab.decode.shared.answer_full`: the reference for KL and top-1
  agreement) and then runs every evicting arm from that prefill
  (:func:`~evictlab.decode.shared.answer_arm`): query-agnostic arms compress once and
  answer every question from a copy of the compressed cache; query-aware arms (and the
  question-specific ORACLEs) compress once per question, the query-aware ones from the
  context extended by the question but its last token, built once per question and shared
  by those arms. :func:`run_cell` on a one-pass cell runs it the same way, alone, example
  by example: the same rows, the same bits.
- ``chunked``: :func:`run_cell` is the per-arm path: the cell's own chunked prefill through
  the decode loop (:func:`~evictlab.decode.loop.run_sequence`), once per question, against
  a full-cache reference computed the same way (cached per process, :func:`full_reference`).

Both are self-contained: they load the model (cached per process, :func:`load_cached`) and
build the seeded examples (cached per process), and return a polars frame with the columns
of :data:`RESULT_COLUMNS`. Same unit, same bits. Each context answers its first
``questions`` questions (all when None; a context that asks fewer answers all it asks):
``question`` is the question's number, ``questions`` how many of its context were answered.

Wall time (``wall_s``, seconds): a chunked row's is its whole run (prefill, compressions,
question and answer); a one-pass row's is what its arm did on its own: building its store
from the shared prefill, its compressions and its answer (a query-agnostic arm's shared
compression split evenly over its questions); the full row's, the question and answer from
a copy of the stock cache. ``prefill_s`` is the shared pass that one-pass row started from
(the context's prefill, the same on every row of a context, plus a query-aware row's
question prefix, shared by the query-aware arms of that question); null on chunked rows
(their prefill is in ``wall_s``). A one-pass context costs its ``prefill_s`` once plus the
``wall_s`` of its rows.

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
from evictlab.eval.spec import ONE_PASS, CellSpec, ContextUnit
from evictlab.models.loading import clear_loaded, load_cached

__all__ = ["RESULT_COLUMNS", "FullReference", "check_context", "check_lengths", "clear_caches", "full_reference",
           "load_cached", "run_cell", "run_cell_traced", "run_context", "run_context_traced", "run_unit"]

RESULT_COLUMNS: dict[str, Any] = {
    "cell": pl.Utf8, "model": pl.Utf8, "task": pl.Utf8, "context": pl.Int64, "method": pl.Utf8,
    "scorer": pl.Utf8, "allocator": pl.Utf8, "mode": pl.Utf8, "protocol": pl.Utf8, "prefill": pl.Utf8,
    "budget": pl.Utf8, "budget_unit": pl.Utf8, "budget_value": pl.Int64,
    "scorer_params": pl.Utf8, "allocator_params": pl.Utf8,
    "chunk_size": pl.Int64, "compress_every": pl.Int64, "window": pl.Int64, "sinks": pl.Int64,
    "recent": pl.Int64, "block_size": pl.Int64, "device": pl.Utf8,
    "seed": pl.Int64, "example": pl.Int64, "example_seed": pl.Int64, "question": pl.Int64, "questions": pl.Int64,
    "context_tokens": pl.Int64, "question_tokens": pl.Int64, "answer_tokens": pl.Int64,
    "exact_match": pl.Float64, "answer_logprob": pl.Float64, "answer_nll": pl.Float64, "ppl": pl.Float64,
    "kl": pl.Float64, "top1_agreement": pl.Float64,
    "budget_tokens": pl.Int64, "budget_effective_tokens": pl.Int64, "bytes_budget": pl.Int64,
    "bytes_live": pl.Int64, "bytes_live_peak": pl.Int64, "bytes_allocated": pl.Int64,
    "bytes_index": pl.Int64, "bytes_transient": pl.Int64, "bytes_full": pl.Int64,
    "compressions": pl.Int64, "wall_s": pl.Float64, "prefill_s": pl.Float64,
}
"""Columns of a unit's frame (and of ``results.parquet``), in order, with their dtypes:
one row per (cell, example, question); ``chunk_size`` is null on one-pass rows."""


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
_REFERENCES = _LRU(2)  # full-cache logits over the answers: (n, questions, T, vocab) floats each


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


def questions_of(cell: CellSpec, example: Any) -> tuple[Any, ...]:
    """The questions of ``example`` that ``cell`` answers: its first ``cell.questions``
    (every one when None, or when it asks fewer), each a
    :class:`~evictlab.tasks.examples.PromptQuestion`."""
    qs = tuple(example.questions)
    return qs if cell.questions is None else qs[:cell.questions]


def check_lengths(cell: CellSpec, model: Any, examples: list[Any]) -> None:
    """Refuse (field ``contexts``) an example longer than the model's positions (its
    context with its longest question and answer)."""
    limit = _max_positions(model)
    if limit is None:
        return
    for ex in examples:
        total = len(ex.context_ids) + max(len(q.question_ids) + len(q.answer_ids) for q in questions_of(cell, ex))
        if total > limit:
            raise InputError("contexts", f"{cell.task} at {cell.context} tokens makes a {total}-token example "
                             f"(context, question and answer), beyond {cell.model}'s {limit} positions",
                             f"use contexts up to about {limit - (total - cell.context)} tokens")


@dataclass
class FullReference:
    """The full cache on a chunked cell's examples (the per-arm path): per example, per
    question, the answer logits ``(T, vocab)`` float32 (CPU), the decode output's byte
    count and wall time."""

    logits: list[list[Any]]
    bytes_full: list[list[int]]
    wall_s: list[list[float]]


def full_reference(cell: CellSpec, progress: Callable[[int], None] | None = None) -> FullReference:
    """The full-cache run of ``cell``'s examples through the decode loop, every question
    (cached per process by the full cell)."""
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
            c = torch.tensor([ex.context_ids], dtype=torch.long, device=dev)
            logits, nbytes, walls = [], [], []
            for pq in questions_of(full, ex):
                q, a = (torch.tensor([x], dtype=torch.long, device=dev) for x in (pq.question_ids, pq.answer_ids))
                with torch.no_grad():
                    out = run_sequence(lm, c, q, cfg, answer_ids=a, tokenizer=tok)
                logits.append(out.logits[0].float().cpu())
                nbytes.append(int(out.bytes_full_cache))
                walls.append(float(out.wall_s))
            ref.logits.append(logits)
            ref.bytes_full.append(nbytes)
            ref.wall_s.append(walls)
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


def _common(cell: CellSpec) -> dict[str, Any]:
    """The columns every row of ``cell`` shares."""
    from evictlab.kv.budget import Budget

    budget = Budget.parse(cell.budget) if cell.budget else None
    return {
        "cell": cell.key, "model": cell.model, "task": cell.task, "context": cell.context, "method": cell.method,
        "scorer": cell.scorer, "allocator": ("uniform" if cell.mode == "uniform" else cell.allocator),
        "mode": cell.mode, "protocol": cell.protocol, "prefill": cell.prefill, "budget": cell.budget,
        "budget_unit": budget.unit if budget else None, "budget_value": budget.value if budget else None,
        "scorer_params": _params_json(cell.scorer_params),
        "allocator_params": _params_json(() if cell.mode == "uniform" else cell.allocator_params),
        "chunk_size": None if cell.prefill == ONE_PASS else cell.loop.chunk_size,
        "compress_every": cell.loop.compress_every, "window": cell.loop.window, "sinks": cell.loop.sinks,
        "recent": cell.loop.recent, "block_size": cell.loop.block_size, "device": cell.device, "seed": cell.seed,
    }


def _row(cell: CellSpec, ex: Any, number: int, asked: int, pq: Any) -> dict[str, Any]:
    return {**_common(cell), "example": ex.index, "example_seed": ex.seed, "question": number, "questions": asked,
            "context_tokens": len(ex.context_ids), "question_tokens": len(pq.question_ids),
            "answer_tokens": len(pq.answer_ids)}


def _full_fields(full_bytes: int, wall: float, prefill_s: float | None) -> dict[str, Any]:
    """The byte and time columns of a full-cache row (every held/allocated column is the
    full cache's bytes: the stock cache's buffers are not measured)."""
    return dict(budget_tokens=None, budget_effective_tokens=None, bytes_budget=None, bytes_live=full_bytes,
                bytes_live_peak=full_bytes, bytes_allocated=full_bytes, bytes_index=0, bytes_transient=0,
                bytes_full=full_bytes, compressions=0, wall_s=wall, prefill_s=prefill_s)


def _arm_fields(out: Any, g: Any, wall: float, prefill_s: float | None) -> dict[str, Any]:
    """The byte and time columns of an evicting row from its :class:`DecodeOutput`."""
    from evictlab.kv.budget import kv_bytes

    btok = out.budget_tokens
    return dict(
        budget_tokens=btok, budget_effective_tokens=out.budget_effective_tokens,
        bytes_budget=None if btok is None else kv_bytes(btok, g.head_dim, g.dtype),
        bytes_live=out.after_compression("bytes_live") or out.peak("bytes_live"),
        bytes_live_peak=out.peak("bytes_live"), bytes_allocated=out.peak("bytes_allocated"),
        bytes_index=out.peak("bytes_index"), bytes_transient=out.peak("bytes_transient"),
        bytes_full=out.bytes_full_cache, compressions=out.compressions, wall_s=wall, prefill_s=prefill_s)


def _trace_labels(tracer: Any, cell: CellSpec, ex: Any, **extra: Any) -> None:
    """Label the trace's next records with ``cell``'s and ``ex``'s columns (``extra``: more
    labels, e.g. ``question``, and ``facts`` for ``fact_held`` / ``fact_kept``)."""
    if tracer is not None:
        tracer.label(cell=cell.key, model=cell.model, task=cell.task, context=cell.context, method=cell.method,
                     mode=cell.mode, protocol=cell.protocol, budget=cell.budget, example=ex.index, **extra)


def question_facts(ex: Any, tokenizer: Any, count: int) -> list[Any]:
    """Per question ``0..count-1`` of ``ex`` the token positions (int64 array) of the facts
    it asks for, or None where it asks for none (a ``heldout_ppl`` window): what a traced
    unit's ``fact_held`` / ``fact_kept`` count (:func:`evictlab.tasks.examples.useful_spec`)."""
    from evictlab.decode.trace import fact_positions
    from evictlab.tasks.examples import useful_spec

    return [fact_positions(useful_spec(ex, tokenizer, question=i)) for i in range(count)]


def run_unit(unit: CellSpec | ContextUnit, progress: Callable[[int], None] | None = None,
             trace: bool = False) -> Any:
    """Run one unit of a grid (:meth:`~evictlab.eval.spec.GridSpec.units`): a
    :class:`ContextUnit` (:func:`run_context`) or a cell (:func:`run_cell`); with ``trace``
    ``(frame, trace)`` (:func:`run_context_traced`, :func:`run_cell_traced`)."""
    if isinstance(unit, ContextUnit):
        return run_context_traced(unit, progress) if trace else run_context(unit, progress)
    return run_cell_traced(unit, progress) if trace else run_cell(unit, progress)


def run_context(unit: ContextUnit, progress: Callable[[int], None] | None = None) -> pl.DataFrame:
    """One context unit (module docstring): one row per (cell, question) of its example,
    cells in the unit's order, questions in order. ``progress`` gets 1 per cell done."""
    return _run_context(unit, progress, None)


def run_context_traced(unit: ContextUnit, progress: Callable[[int], None] | None = None
                       ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """:func:`run_context` plus the per-compression diagnostics of every evicting cell (as
    :func:`run_cell_traced`'s, with ``question``: the question's number, or null for the
    context's compression that a query-agnostic arm's questions share, whose ``fact_held`` /
    ``fact_kept`` count the facts of every question answered)."""
    from evictlab.decode.trace import CompressionTrace

    tracer = CompressionTrace()
    frame = _run_context(unit, progress, tracer)
    return frame, tracer.table()


def _run_context(unit: ContextUnit, progress: Callable[[int], None] | None, tracer: Any,
                 only: CellSpec | None = None) -> pl.DataFrame:
    import torch

    from evictlab.decode.shared import QA, SharedContext, answer_arm, answer_full
    from evictlab.kv.cache import register_ragged_attention
    from evictlab.models.geometry import model_geometry
    from evictlab.tasks.examples import HELDOUT_PPL, useful_spec

    full = unit.full
    lm, tok = load_cached(full.model, full.device, attn_implementation=register_ragged_attention())
    check_context(full, lm)
    ex = cell_examples(full, tok)[unit.example]
    g = model_geometry(lm)
    dev = next(lm.parameters()).device
    scored = full.task != HELDOUT_PPL
    pqs = questions_of(full, ex)
    qas = [QA(tuple(pq.question_ids), tuple(pq.answer_ids)) for pq in pqs]
    answers = [torch.tensor(pq.answer_ids, dtype=torch.long) for pq in pqs]
    cfgs = {c: c.decode_config() for c in unit.evicting}
    hidden = any(cfg.method is not None and cfg.method.gates for cfg in cfgs.values())
    with torch.no_grad():
        ctx = SharedContext.prefill(lm, torch.tensor([ex.context_ids], dtype=torch.long, device=dev), hidden=hidden)
        fulls = answer_full(ctx, qas)
    prefill_s = ctx.prefill_s
    ref = [o.logits[0].float().cpu() for o in fulls]
    rows: dict[tuple[int, int], dict[str, Any]] = {}  # (cell position, question) -> row
    order = {c: i for i, c in enumerate(unit.cells)}
    if only is None or only.is_full:
        for i, (pq, o) in enumerate(zip(pqs, fulls)):
            row = _row(full, ex, i, len(pqs), pq)
            row.update(example_metrics(ref[i], ref[i], answers[i], scored=scored))
            row.update(_full_fields(int(o.bytes_full_cache), float(o.wall_s), prefill_s))
            rows[(0, i)] = row
        if progress is not None:
            progress(1)

    def record(cell: CellSpec, i: int, out: Any, shared_s: float) -> None:
        row = _row(cell, ex, i, len(pqs), pqs[i])
        row.update(example_metrics(ref[i], out.logits[0].float().cpu(), answers[i], scored=scored))
        row.update(_arm_fields(out, g, float(out.wall_s), shared_s))
        rows[(order[cell], i)] = row

    def labelled(cfg: Any, i: int) -> Any:  # oracle_labels: question i's labels
        return cfg.with_labels(lambda: useful_spec(ex, tok, question=i))

    arms = [c for c in unit.evicting if only is None or c == only]
    # traced: each question's fact positions (fact_held / fact_kept), where the example has labels
    qfacts = question_facts(ex, tok, len(pqs)) if tracer is not None else None

    def facts_of(i: int | None = None) -> list[Any] | None:
        return None if qfacts is None else (qfacts if i is None else [qfacts[i]])

    with torch.no_grad():
        for cell in (c for c in arms if c.protocol != "query-aware"):
            cfg = cfgs[cell]
            _trace_labels(tracer, cell, ex)
            if cfg.needs_labels:  # each question its own labels, its own compression
                outs = [answer_arm(ctx, labelled(cfg, i), [qa], tokenizer=tok, protocol=cell.protocol,
                                   compression_trace=tracer, numbers=[i], question_facts=facts_of(i))[0]
                        for i, qa in enumerate(qas)]
            else:
                outs = answer_arm(ctx, cfg, qas, tokenizer=tok, protocol=cell.protocol, compression_trace=tracer,
                                  question_facts=facts_of())
            for i, out in enumerate(outs):
                record(cell, i, out, prefill_s)
            if progress is not None:
                progress(1)
        aware = [c for c in arms if c.protocol == "query-aware"]
        for i, qa in enumerate(qas if aware else []):
            t0 = time.perf_counter()
            prefix = ctx.extended(torch.tensor([qa.question_ids[:-1]], dtype=torch.long, device=dev))
            prefix_s = time.perf_counter() - t0
            for cell in aware:
                _trace_labels(tracer, cell, ex)
                (out,) = answer_arm(ctx, labelled(cfgs[cell], i), [qa], tokenizer=tok, protocol=cell.protocol,
                                    extended=lambda _qa: prefix, compression_trace=tracer, numbers=[i],
                                    question_facts=facts_of(i))
                record(cell, i, out, prefill_s + prefix_s)
            del prefix
        if progress is not None and aware:
            progress(len(aware))
    return pl.DataFrame([rows[k] for k in sorted(rows)], schema=RESULT_COLUMNS)


def run_cell(cell: CellSpec, progress: Callable[[int], None] | None = None) -> pl.DataFrame:
    """Run one cell; one row per (example, question) (columns :data:`RESULT_COLUMNS`): a
    chunked cell through its own per-arm path, a one-pass cell from one prefill per example
    (the rows a one-pass grid's context units give it, bit for bit).

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
    ``protocol``, ``budget``, ``example``, ``question``; ``fact_held`` / ``fact_kept`` count
    the entries at the positions of the facts the question asks for (the example's labels;
    null where it has none, as ``heldout_ppl``). The full cell compresses nothing: empty
    trace."""
    from evictlab.decode.trace import CompressionTrace

    tracer = None if cell.is_full else CompressionTrace()
    frame = _run_cell(cell, progress, tracer)
    return frame, (pl.DataFrame() if tracer is None else tracer.table())


def _run_cell(cell: CellSpec, progress: Callable[[int], None] | None, tracer: Any) -> pl.DataFrame:
    if cell.prefill == ONE_PASS:
        unit_cells = (cell,) if cell.is_full else (cell.full_cell(), cell)
        frames = []
        for i in range(cell.n):
            frames.append(_run_context(ContextUnit(unit_cells, i), None, tracer, only=cell))
            if progress is not None:
                progress(1)
        return pl.concat(frames)
    import torch

    from evictlab.decode.loop import run_sequence
    from evictlab.kv.cache import register_ragged_attention
    from evictlab.models.geometry import model_geometry
    from evictlab.tasks.examples import HELDOUT_PPL, useful_spec

    lm, tok = load_cached(cell.model, cell.device, attn_implementation=register_ragged_attention())
    check_context(cell, lm)
    examples = cell_examples(cell, tok)
    ref = full_reference(cell, progress)
    g = model_geometry(lm)
    dev = next(lm.parameters()).device
    scored = cell.task != HELDOUT_PPL
    cfg = None if cell.is_full else cell.decode_config()
    rows: list[dict[str, Any]] = []
    for e, ex in enumerate(examples):
        pqs = questions_of(cell, ex)
        c = torch.tensor([ex.context_ids], dtype=torch.long, device=dev)
        for i, pq in enumerate(pqs):
            a = torch.tensor(pq.answer_ids, dtype=torch.long)
            row = _row(cell, ex, i, len(pqs), pq)
            if cfg is None:
                row.update(example_metrics(ref.logits[e][i], ref.logits[e][i], a, scored=scored))
                row.update(_full_fields(ref.bytes_full[e][i], ref.wall_s[e][i], None))
            else:
                q, ad = (torch.tensor([x], dtype=torch.long, device=dev) for x in (pq.question_ids, pq.answer_ids))
                facts = lambda: useful_spec(ex, tok, question=i)  # noqa: E731 - the labels, computed when read
                _trace_labels(tracer, cell, ex, question=i, facts=facts)  # fact_held / fact_kept: question i's
                t0 = time.perf_counter()
                ex_cfg = cfg.with_labels(facts)  # oracle_labels: its labels
                with torch.no_grad():
                    out = run_sequence(lm, c, q, ex_cfg, answer_ids=ad, tokenizer=tok, compression_trace=tracer)
                wall = time.perf_counter() - t0
                row.update(example_metrics(ref.logits[e][i], out.logits[0].float().cpu(), a, scored=scored))
                row.update(_arm_fields(out, g, wall, None))
            rows.append(row)
        if progress is not None and cfg is not None:
            progress(1)
    return pl.DataFrame(rows, schema=RESULT_COLUMNS)
