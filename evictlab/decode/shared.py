"""One prefill per context, shared by every arm, and several questions per context.

Under the one-pass prefill (the whole context is fed, then compressed once, then the
question is appended: kvpress's pipeline) nothing before the compression depends on the
method: the context's keys, values and queries are the same for every scorer, allocator,
budget and store. :class:`SharedContext` runs that prefill once, through the stock
``DynamicCache`` (the full cache's own path: one causal call per layer; every entry kept,
sliding layers included, as the evicting engine holds them before compressing), recording what
the scorers read: every layer's post-RoPE queries (rotated lazily, only the part a scorer
reads), and, when an arm needs them, the attention modules' input hidden states (TrimKV's
gates). Each *arm* (one :class:`~evictlab.decode.loop.DecodeConfig`: scorer, allocator,
budget, store) then starts from it (:meth:`EvictionRunner.inject_context`: the store gets
the context's entries as if fed in one chunk), compresses with the loop's own code
(:meth:`EvictionRunner.compress`: the first compression's *scoring* is shared by every arm
with the same scorer, since it reads only the context), and answers.

Questions (:class:`QA`): a context may be asked several; under the query-agnostic protocol
each is answered from its own copy of the one compressed cache
(:meth:`EvictionRunner.snapshot` / ``restore``), which is what query-agnostic compression
is for. Teacher-forced answers that end before the first decode compression go through the
model in one forward with the question (:func:`evictlab.decode.loop.answer`).

Protocols:

- ``query-agnostic`` (the default): prefill, compress, then every question;
- ``query-aware``: per question, the shared prefill is extended by the question but its
  last token (:meth:`SharedContext.extended`: a copy of the stock cache plus that forward),
  then compressed, then the last question token and the answer go through the compressed
  cache: the loop's query-aware protocol with a one-pass prefix;
- question-specific scorers (the ORACLE, ``needs={"future"}``: the true future queries of
  each question) compress once per question, from the shared prefill.

What is the same as running each arm alone with ``run_sequence`` and a chunk as long as the
context (the per-arm path): the kept entries, and the logits up to float rounding (the
prefill here is one causal call instead of the evicting engine's pieces; tests check both
on every registered scorer and allocator). The chunked protocol (compress every
``chunk_size`` tokens) depends on the method from the first chunk on and keeps the per-arm
path.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import DecodeOutput, StepTrace, _evicting_engine, _rss, answer
from evictlab.errors import InputError
from evictlab.kv.budget import kv_bytes
from evictlab.kv.cache import query_source_hooks, rotated_queries
from evictlab.models.geometry import ModelGeometry, model_geometry
from evictlab.models.sites import AttentionSite, find_attention_sites

__all__ = ["QA", "SharedContext", "answer_arm", "answer_full"]


@dataclass(frozen=True)
class QA:
    """One question of a context: ``question_ids`` (fed after the context) and the
    ``answer_ids`` teacher-forced after it."""

    question_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]


class SharedContext:
    """A context prefilled once (module docstring); build it with :meth:`prefill`.

    Holds the stock cache after the context (``cache``), per layer the pre-RoPE queries
    ``(1, q_heads, n, d)`` and the RoPE tables of their positions, optionally the attention
    modules' input hidden states ``(1, n, hidden)``, and :attr:`scores`, the shared first
    compressions (filled by the arms). Batch size 1.
    """

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, cache: Any, queries: list[torch.Tensor],
                 rope: list[Any], hidden: list[torch.Tensor] | None, sites: list[AttentionSite]) -> None:
        self.model = model
        self.ids = ids
        self.cache = cache
        self._q = queries
        self._rope = rope
        self._hidden = hidden
        self._sites = sites
        self.geometry: ModelGeometry = model_geometry(model)
        #: the first compression's scoring per scorer (see EvictionRunner.inject_context)
        self.scores: dict[Any, Any] = {}
        self.prefill_s = 0.0

    @property
    def length(self) -> int:
        """Tokens of the context (the next token's position)."""
        return int(self.ids.shape[1])

    @classmethod
    def prefill(cls, model: torch.nn.Module, ids: torch.Tensor, *, hidden: bool = False) -> SharedContext:
        """Feed ``ids`` ``(1, n)`` through ``model`` with the stock ``DynamicCache``, recording
        the queries (and, with ``hidden``, the attention modules' input hidden states)."""
        from transformers import DynamicCache

        if ids.ndim != 2 or ids.shape[0] != 1:
            raise InputError("context_ids", f"shape {tuple(ids.shape)}", "pass one sequence, (1, n)")
        t0 = time.perf_counter()
        # A cache without the model's config keeps every entry on every layer (the model's
        # own mask still bounds sliding layers): an arm's store gets exactly what the
        # evicting engine would have appended before its first compression.
        out = cls._forward(model, DynamicCache(), ids, hidden)
        out.prefill_s = time.perf_counter() - t0
        return out

    @classmethod
    def _forward(cls, model: torch.nn.Module, cache: Any, ids: torch.Tensor, hidden: bool,
                 before: SharedContext | None = None) -> SharedContext:
        sites = find_attention_sites(model)
        n_layers = len(sites)
        queries: list[Any] = [None] * n_layers
        rope: list[Any] = [None] * n_layers
        states: list[Any] = [None] * n_layers

        def on_query(site: AttentionSite, out: torch.Tensor, inp: Any, pe: Any) -> None:
            # Pre-RoPE queries and their (cos, sin): rotated only where a scorer reads them.
            queries[site.layer] = rotated_queries(site, out, inp, None)
            rope[site.layer] = pe

        handles = []
        if hidden:
            def make(site: AttentionSite):  # noqa: ANN202 - closure over the site
                def pre(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                    states[site.layer] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                return pre
            handles = [s.module.register_forward_pre_hook(make(s), with_kwargs=True) for s in sites]
        try:
            with torch.no_grad(), query_source_hooks(model, on_query):
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
        if before is not None:
            queries = [torch.cat([a, b], 2) for a, b in zip(before._q, queries)]
            rope = [None if a is None else tuple(torch.cat([x, y], 1) for x, y in zip(a, b))
                    for a, b in zip(before._rope, rope)]
            if hidden and before._hidden is not None:
                states = [torch.cat([a, b], 1) for a, b in zip(before._hidden, states)]
            ids = torch.cat([before.ids, ids], 1)
        return cls(model, ids, cache, queries, rope, states if hidden else None, sites)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's keys and values ``(1, kv_heads, n, d)`` of every context token and
        their positions ``(n,)`` (host int64), sliding layers included (their out-of-window
        entries are dropped by the arm's first compression, as the evicting engine does)."""
        lay = self.cache.layers[layer]
        return lay.keys, lay.values, torch.arange(self.length)

    def queries(self, layer: int, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE queries ``(1, q_heads, k, d)`` of the last ``last`` context tokens
        (all when None) and their positions ``(k,)``: what the attention function saw."""
        q, pe = self._q[layer], self._rope[layer]
        k = q.shape[2] if last is None else min(int(last), q.shape[2])
        q = q[:, :, q.shape[2] - k:]
        if pe is not None:
            cos, sin = (t[:, t.shape[1] - k:] for t in pe)
            q, _ = self._sites[layer].rope(q, q, cos, sin)
        return q, torch.arange(self.length - k, self.length, device=q.device)

    def hidden_states(self) -> list[torch.Tensor] | None:
        """Per layer the attention module's input ``(1, n, hidden)``, when recorded."""
        return self._hidden

    def extended(self, ids: torch.Tensor) -> SharedContext:
        """This context followed by ``ids`` ``(1, m)``: a copy of the stock cache plus one
        forward (this context is unchanged); its own :attr:`scores`."""
        cache = copy.deepcopy(self.cache)
        return self._forward(self.model, cache, ids, self._hidden is not None, before=self)

    def full_answer(self, question: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
        """Full-cache logits ``(1, T, vocab)`` (float32) of a teacher-forced answer: row
        ``t`` predicts answer token ``t`` (row 0 from the question's last position), from a
        copy of the stock cache, so the context serves the next question unchanged."""
        cache = copy.deepcopy(self.cache)
        T = answer_ids.shape[1]
        ids = torch.cat([question, answer_ids[:, :T - 1]], 1)
        with torch.no_grad():
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=T)
        return out.logits.float()

    def future_queries(self, qa_ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """The true future queries (the ORACLE's): per layer the post-RoPE queries
        ``(1, q_heads, m, d)`` of the ``m`` tokens ``qa_ids`` (question and answer) that
        follow this context in a dense pass."""
        ext = self.extended(qa_ids)
        m = qa_ids.shape[1]
        return {l: ext.queries(l, m)[0] for l in range(self.geometry.n_layers)}


def answer_full(ctx: SharedContext, qas: Sequence[QA]) -> list[DecodeOutput]:
    """The full cache on every question of ``ctx`` (one :class:`DecodeOutput` each; no
    trace, nothing evicted)."""
    g = ctx.geometry
    dev = ctx.ids.device
    outs = []
    for qa in qas:
        t0 = time.perf_counter()
        q = torch.tensor([qa.question_ids], dtype=torch.long, device=dev)
        a = torch.tensor([qa.answer_ids], dtype=torch.long, device=dev)
        logits = ctx.full_answer(q, a)
        wall = time.perf_counter() - t0
        # the last answer token is never fed: the cache ends holding all but it (as run_sequence)
        total = ctx.length + q.shape[1] + a.shape[1] - 1
        outs.append(DecodeOutput(logits, a, [], None, kv_bytes(g.full_cache_tokens(total), g.head_dim, g.dtype),
                                 _rss(), wall, 0, wall))
    return outs


def answer_arm(ctx: SharedContext, cfg: DecodeConfig, qas: Sequence[QA], *, tokenizer: Any = None,
               protocol: str = "query-agnostic", extended: Callable[[QA], SharedContext] | None = None,
               compression_trace: Any = None, numbers: Sequence[int] | None = None,
               question_facts: Sequence[Any] | None = None) -> list[DecodeOutput]:
    """One arm (``cfg``: physical or masked, any scorer and allocator) on every question of
    ``ctx``, under the one-pass ``protocol`` (module docstring). Returns one
    :class:`DecodeOutput` per question, as :func:`~evictlab.decode.loop.run_sequence` with
    a chunk as long as the prefix would (its trace starts with the prefilled context).

    ``extended(qa)``: the query-aware prefix of a question (the context and the question
    but its last token), shared by the arms of one question; default: built here.
    ``compression_trace``: a :class:`~evictlab.decode.trace.CompressionTrace` recording every
    compression, its labels (:meth:`~evictlab.decode.trace.CompressionTrace.label`, set by
    the caller) extended by ``question``: the question's number (``numbers[i]`` for
    ``qas[i]``, default ``i``), or None for the context's compression that every question
    shares (query-agnostic, not question-specific). ``question_facts``: per question (aligned
    with ``qas``) the token positions of the facts it asks for (int array, or None: none),
    labelling that question's compressions' ``fact_held`` / ``fact_kept``; the shared
    compression gets the union of them. Default: the facts the caller labelled the trace with.
    """
    if cfg.mode == "full":
        raise InputError("mode", "the full cache is answer_full's", "pass an evicting mode (physical or masked)")
    if not qas:
        raise InputError("questions", "no questions", "pass at least one QA")
    aware = protocol == "query-aware"
    if aware != cfg.query_aware:
        cfg = replace(cfg, query_aware=aware)
    g = ctx.geometry
    dev = ctx.ids.device
    n = ctx.length
    # One pass: the chunk covers the whole prefix, so the store is sized for it (the
    # per-arm path's one-pass sizing) and nothing is compressed before it is complete.
    prefix = n + max(len(qa.question_ids) for qa in qas)
    one_pass = replace(cfg, loop=replace(cfg.loop, chunk_size=max(cfg.loop.chunk_size, prefix)))
    longest_q = torch.tensor([max((qa.question_ids for qa in qas), key=len)], dtype=torch.long, device=dev)
    longest_a = torch.tensor([max((qa.answer_ids for qa in qas), key=len)], dtype=torch.long, device=dev)
    method = cfg.method
    assert method is not None  # an evicting config carries its method
    per_question = aware or method.question_specific
    numbers = list(range(len(qas))) if numbers is None else list(numbers)
    if len(numbers) != len(qas):
        raise ValueError(f"{len(numbers)} question numbers for {len(qas)} questions")
    labels = dict(compression_trace.labels) if compression_trace is not None else {}
    facts = compression_trace.facts if compression_trace is not None else None
    if question_facts is not None:
        if len(question_facts) != len(qas):
            raise ValueError(f"{len(question_facts)} question facts for {len(qas)} questions")
        known = [f for f in question_facts if f is not None]
        facts = np.unique(np.concatenate(known)) if known else None

    def label(index: int | None) -> None:
        """Label the compressions that follow: question ``qas[index]``'s, or (None) the shared one."""
        if compression_trace is not None:  # the caller's labels stay (one context, its labels)
            f = facts if index is None or question_facts is None else question_facts[index]
            compression_trace.label(facts=f, **labels, question=None if index is None else numbers[index])

    def tensors(qa: QA) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([qa.question_ids], dtype=torch.long, device=dev),
                torch.tensor([qa.answer_ids], dtype=torch.long, device=dev))

    def build(qa: QA | None) -> Any:
        q, a = tensors(qa) if qa is not None else (longest_q, longest_a)
        future = None
        if qa is not None and method.future:
            future = lambda: ctx.future_queries(torch.cat([q, a], 1))  # noqa: E731
        return _evicting_engine(ctx.model, one_pass, ctx.ids, q if qa is not None else longest_q,
                                a if qa is not None else longest_a, a.shape[1] if qa is not None else longest_a.shape[1],
                                g, tokenizer, future)

    outs: list[DecodeOutput] = []
    if not per_question:
        t0 = time.perf_counter()
        runner = build(None)
        runner.compression_trace = compression_trace
        label(None)
        trace: list[StepTrace] = []
        peak = [_rss()]

        def note(phase: str, into: list[StepTrace] = trace) -> None:
            r = _rss()
            peak[0] = max(peak[0], r)
            into.append(StepTrace(phase, runner.cache.seen, runner.report(), r))

        with torch.no_grad(), runner.session():
            runner.inject_context(ctx)
            note("prefill")
            phase = runner.after_chunk(ctx.ids, "prefill")
            if phase:
                note(phase)
            phase = runner.end_context()
            if phase:
                note(phase)
            shared_s = time.perf_counter() - t0
            snap = runner.snapshot()
            for i, qa in enumerate(qas):
                t1 = time.perf_counter()
                if i:
                    runner.restore(snap)
                label(i)
                q, a = tensors(qa)
                own = list(trace)
                logits, tokens, t_dec = answer(runner, q, a, a.shape[1], compress_every=cfg.loop.compress_every,
                                               tick=lambda _k: None, note=lambda p: note(p, own))
                now = time.perf_counter()
                outs.append(_output(runner, g, n, q, a, logits, tokens, own, peak[0],
                                    shared_s / len(qas) + now - t1, now - t_dec))
        return outs
    for index, qa in enumerate(qas):
        t0 = time.perf_counter()
        q, a = tensors(qa)
        base = (extended(qa) if extended is not None else ctx.extended(q[:, :-1])) if aware else ctx
        runner = build(qa)
        runner.compression_trace = compression_trace
        label(index)
        own: list[StepTrace] = []
        peak = [_rss()]

        def note(phase: str) -> None:
            r = _rss()
            peak[0] = max(peak[0], r)
            own.append(StepTrace(phase, runner.cache.seen, runner.report(), r))

        with torch.no_grad(), runner.session():
            runner.inject_context(base)
            note("prefill")
            phase = runner.after_chunk(base.ids, "question" if aware else "prefill")
            if phase:
                note(phase)
            phase = runner.end_context()
            if phase:
                note(phase)
            rest = q[:, -1:] if aware else q
            logits, tokens, t_dec = answer(runner, rest, a, a.shape[1], compress_every=cfg.loop.compress_every,
                                           tick=lambda _k: None, note=note)
        now = time.perf_counter()
        outs.append(_output(runner, g, n, q, a, logits, tokens, own, peak[0], now - t0, now - t_dec))
    return outs


def _output(runner: Any, g: ModelGeometry, n: int, q: torch.Tensor, a: torch.Tensor, logits: list[torch.Tensor],
            tokens: list[torch.Tensor], trace: list[StepTrace], peak: int, wall: float, decode_s: float) -> DecodeOutput:
    full_tokens = g.full_cache_tokens(n + q.shape[1] + a.shape[1] - 1)  # the last answer token is never fed
    budget = runner.budget_tokens
    return DecodeOutput(torch.stack(logits, 1), torch.stack(tokens, 1), trace, budget,
                        kv_bytes(full_tokens, g.head_dim, g.dtype), peak, wall, runner.compressions, decode_s,
                        list(runner.context_kept), None if budget is None else min(budget, full_tokens))
