"""The decode loop: chunked prefill that compresses as it goes, then decoding that
compresses every N steps, on a stock transformers model (through :mod:`evictlab.kv.cache`).

Protocol (query-agnostic by default, docs/theory.md section 9):

1. The **context** is fed in chunks of ``chunk_size`` tokens. After each chunk, if the
   cache holds more than the budget, it is compressed to the budget: every cell is scored
   (the scorer sees the cell's keys and the context's queries: the last ``window`` of
   them, or, for scorers with ``uses_all_queries`` (H2O, Compactor, ExpectedAttention),
   every query processed since the previous compression), the allocator turns the budget
   into per-cell sizes (:class:`~evictlab.methods.base.AllocInputs` in,
   :func:`~evictlab.methods.base.check_sizes` on the way out), :func:`select_keep` picks
   the kept entries, and the store evicts the rest. So the cache never holds more than
   ``budget + chunk_size`` entries per cell (peak KV memory bounded).
2. The **protocol** (:data:`PROTOCOLS`) decides when the question arrives.
   ``query-agnostic`` (default): the question is appended only after the context was
   compressed, so no ranking that evicts context entries sees it. ``query-aware``
   (``query_aware=True``, a labelled option, to measure the margin): nothing is compressed
   before the question is in the scorer's view, whatever the chunk size: the context and
   the question *except its last token* are fed in chunks without any compression (only
   the out-of-window entries of sliding layers, which no ranking chooses, are dropped),
   then one compression runs (its queries include the question's), then the question's
   last token is fed through the compressed cache, so every answer logit comes from the
   compressed cache. The price is memory: a query-aware run holds the whole context and
   question before its first compression (``DecodeOutput.peak("bytes_live")``), a
   query-agnostic one at most the budget plus one chunk.
3. **Decoding** feeds the answer tokens (teacher forcing; the logits give perplexity, KL and
   top-1 agreement, and all-argmax-correct is exactly greedy exact match) or greedy argmax
   tokens; every ``compress_every`` steps the cache is compressed back to the budget.

One driver (:func:`_drive`) runs these steps for every mode: an *engine* does the forwards
and, when it evicts, the compressions. ``mode="full"`` is the reference (:class:`FullCache`:
the stock ``DynamicCache``, nothing evicted, exactly the model's own output);
``"physical"`` and ``"masked"`` are :class:`EvictionRunner` over a paged or a masked store.

The budget counts kept entries after a compression; between compressions a cell may hold
up to one prefill chunk (never more than the context fed) or ``question + compress_every``
(decoding) more. The paged pool is sized in tokens by
:meth:`~evictlab.kv.paged.PagedKVStore.for_budget` (the budget plus that headroom, capped
by what the run can ever hold, so a budget above the context allocates no more than the
full cache plus one partial page per cell) and raises :class:`BudgetExceededError` rather
than grow. ``DecodeOutput.budget_effective_tokens`` states the budget that can bind:
``min(budget, full cache)``.

Scorers are built with :func:`evictlab.methods.make_scorer` per layer from the model's
:class:`~evictlab.models.geometry.ModelGeometry` (so the RoPE-undoing scorers use each
layer's RoPE base). Scoring is done per (batch item, KV head) cell, because after ragged
eviction cells hold different keys at different positions (``ScoreInputs.positions`` is one
vector). The scorer state (``ScoreInputs.state``) is one dict per (layer, batch item, KV
head). Allocators receive per-layer scores ``(batch, kv_heads, S_l)`` padded with the
float32 minimum past a shorter head's length, with each cell's real length, so padding
never counts as available keys.

Sliding-window layers (Gemma 3's ``"sliding_attention"`` layers,
:attr:`ModelGeometry.windows`): a query at position ``t`` attends only keys with
``t - pos < window``. :func:`attach_model` adds that bound to the mask of those layers (so a
multi-token chunk is exact), and every compression first drops, from the cells of those
layers, the entries no later query can attend (``pos <= next - window``: physically freed in
the paged store, masked in the masked one), so a sliding cell holds at most ``window - 1``
entries after a compression. The budget is then spread by the allocator over the cells'
real lengths: a sliding cell keeps ``min(window - 1, its size)`` and what it cannot hold
goes to the other cells.

Errors on user input are :class:`InputError` with neutral field names (``method``,
``scorer``, ``allocator``, ``scorer_param``, ``allocator_param``, ``budget``, ``mode``,
``chunk_size``, ...); the ``decode`` and ``audit`` commands report them under their own
option names.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from evictlab.decode.compress import EvictionRunner
from evictlab.decode.config import DecodeConfig
from evictlab.decode.extras import check_recon_tokenizer, oracle_queries, recon_ids
from evictlab.errors import InputError
from evictlab.kv.budget import ByteReport, kv_bytes
from evictlab.methods.base import Phase
from evictlab.models.geometry import ModelGeometry, model_geometry

@dataclass
class StepTrace:
    """Accounting after one forward (or compression) of the loop."""

    phase: str  # "prefill", "compress", "window" (sliding drop only), "resize", "question", "decode"
    seen: int
    report: ByteReport
    rss: int


@dataclass
class DecodeOutput:
    """Result of :func:`run_sequence`.

    ``logits``: float32 ``(batch, T, vocab)``: row t predicts decode token t (row 0 comes from
    the last question position). ``tokens``: int64 ``(batch, T)`` the decode-phase tokens
    (the forced answer, or greedy argmax). ``trace``: one :class:`StepTrace` per phase step
    (empty in full mode). ``budget_tokens``: kept entries per sequence (None in full mode);
    ``budget_effective_tokens``: ``min(budget_tokens, entries a cache without eviction
    holds at the end)``: when it is below ``budget_tokens`` the budget is above the full
    cache and nothing is evicted (sliding layers still drop out-of-window entries).
    """

    logits: torch.Tensor
    tokens: torch.Tensor
    trace: list[StepTrace]
    budget_tokens: int | None
    bytes_full_cache: int
    peak_rss: int
    wall_s: float
    compressions: int
    decode_s: float = 0.0  # wall time of the decode phase (T - 1 forwards and its compressions)
    #: per layer, the kept positions ``(batch, kv_heads, S)`` (-1 = padding) right after the
    #: context phase, before the question (query-agnostic) is appended; empty in full mode.
    context_kept: list[torch.Tensor] = field(default_factory=list)
    budget_effective_tokens: int | None = None

    def peak(self, attr: str) -> int:
        """Max of ``ByteReport.<attr>`` over the trace (0 for full mode)."""
        return max((getattr(t.report, attr) for t in self.trace), default=0)

    def after_compression(self, attr: str) -> int:
        """Max of ``ByteReport.<attr>`` right after compressions (what the budget governs)."""
        return max((getattr(t.report, attr) for t in self.trace if t.phase == "compress"), default=0)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


class StepRecorder:
    """The loop's accounting: :meth:`note` (the driver's ``note``) appends one
    :class:`StepTrace` (the phase, tokens seen, the store's :class:`ByteReport`, the
    process's RSS) after each forward or compression of ``engine``, and keeps the peak RSS
    (bytes). An engine without a store to account (the full-cache reference) records no
    steps. Shared by :func:`run_sequence` and :mod:`evictlab.api`'s cache."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine
        self.trace: list[StepTrace] = []
        self.peak_rss = _rss()

    def note(self, phase: str) -> None:
        assert self.engine is not None
        r = _rss()
        self.peak_rss = max(self.peak_rss, r)
        report = self.engine.report()
        if report is not None:
            self.trace.append(StepTrace(phase, self.engine.cache.seen, report, r))


# --------------------------------------------------------------------------- engines


class Engine(Protocol):
    """What the driver (:func:`_drive`) needs from a run: forwards through one cache, and
    hooks that may compress it. Each hook returns the trace phase to record after it
    (``"compress"``, ``"resize"``), or None. ``report`` gives the store's bytes (None: no
    store to account, the full-cache reference). ``forward`` returns only the last
    position's logits ``(batch, 1, vocab)`` (``logits_to_keep=1``): the driver reads nothing
    else, and a chunk's full logits would cost ``chunk x vocab`` floats and the head's matmul."""

    cache: Any
    compressions: int
    budget_tokens: int | None  # kept entries per sequence (None: nothing is evicted)
    context_kept: list[torch.Tensor]  # see DecodeOutput.context_kept

    def session(self) -> contextlib.AbstractContextManager[None]: ...
    def forward(self, ids: torch.Tensor, keep: int = 1) -> torch.Tensor: ...
    def report(self) -> ByteReport | None: ...
    def after_chunk(self, chunk: torch.Tensor, phase: Phase, compress: bool = True) -> str | None: ...
    def end_context(self) -> str | None: ...
    def after_decode_step(self, step: int, tokens: list[torch.Tensor]) -> str | None: ...


class FullCache:
    """The reference engine: the stock ``DynamicCache`` (sliding layers keep their window,
    as transformers does), no hooks, nothing evicted: exactly the model's own output."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.compressions = 0
        self.budget_tokens: int | None = None
        self.context_kept: list[torch.Tensor] = []

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        yield

    def forward(self, ids: torch.Tensor, keep: int = 1) -> torch.Tensor:
        return self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep).logits

    def report(self) -> ByteReport | None:
        return None

    def after_chunk(self, chunk: torch.Tensor, phase: Phase, compress: bool = True) -> str | None:
        return None

    def end_context(self) -> str | None:
        return None

    def after_decode_step(self, step: int, tokens: list[torch.Tensor]) -> str | None:
        return None


def _drive(engine: Engine, context_ids: torch.Tensor, question_ids: torch.Tensor, answer_ids: torch.Tensor | None,
           steps: int, chunk_size: int, query_aware: bool, tick: Callable[[int], None],
           note: Callable[[str], None]) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """The protocol, for every engine: the chunked prefix (:func:`feed_prefix`), the rest of
    the question, then ``steps`` decode steps (:func:`answer`). Returns per-step logits and
    tokens and the decode phase's start time. Each forward and each engine hook is recorded
    by ``note``."""
    rest = feed_prefix(engine, context_ids, question_ids, chunk_size, query_aware, tick, note)
    return answer(engine, rest, answer_ids, steps, compress_every=None, tick=tick, note=note)


def feed_prefix(engine: Engine, context_ids: torch.Tensor, question_ids: torch.Tensor, chunk_size: int,
                query_aware: bool, tick: Callable[[int], None], note: Callable[[str], None]) -> torch.Tensor:
    """The protocol's prefix: feed it in chunks of ``chunk_size`` tokens, compressing where
    the protocol says, then end the context (:meth:`Engine.end_context`). Returns the
    tokens still to feed before decoding, ``(batch, r)``, through the compressed cache:
    the question (query-agnostic) or its last token (query-aware). Used by the driver and by
    :mod:`evictlab.api`'s cache inside a stock ``model.generate``.

    Query-agnostic: prefix = the context, compressed after every chunk; then the whole
    question. Query-aware: prefix = the context and the question but its last token, with
    no compression before the prefix's last chunk (so the compression that fixes the kept
    set has the question's queries in view, for any ``chunk_size``); then the last question
    token, through the compressed cache."""
    n = context_ids.shape[1]
    if query_aware:
        if question_ids.shape[1] < 2:
            raise InputError("question_ids", f"a query-aware run needs a question of at least 2 tokens, got "
                             f"{question_ids.shape[1]} (the ranking sees all but the last, which is fed through "
                             "the compressed cache)", "use the query-agnostic protocol for this prompt")
        prefix = torch.cat([context_ids, question_ids[:, :-1]], 1)
        rest = question_ids[:, -1:]
    else:
        prefix, rest = context_ids, question_ids
    for start in range(0, prefix.shape[1], chunk_size):
        chunk = prefix[:, start:start + chunk_size]
        engine.forward(chunk)
        note("prefill")
        final = start + chunk.shape[1] >= prefix.shape[1]
        phase = engine.after_chunk(chunk, "question" if start + chunk.shape[1] > n else "prefill",
                                   compress=final or not query_aware)
        if phase:
            note(phase)
        tick(chunk.shape[1])
    phase = engine.end_context()
    if phase:
        note(phase)
    return rest


def answer(engine: Engine, rest: torch.Tensor, answer_ids: torch.Tensor | None, steps: int, *,
           compress_every: int | None, tick: Callable[[int], None],
           note: Callable[[str], None]) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """After the context: feed ``rest`` (the question, or its last token), then ``steps``
    decode steps (teacher-forced on ``answer_ids`` or greedy), compressing where the engine
    says. Returns per-step logits and tokens and the decode phase's start time.

    ``compress_every``: when given and a teacher-forced answer ends before the first decode
    compression (``steps - 1 < compress_every``), ``rest`` and the answer go through the
    model in one forward, which reads the last ``steps`` positions' logits: the same
    attention over the same cache, so the same logits up to float rounding, in one call
    instead of ``steps`` (the evaluation engine's path, :mod:`evictlab.decode.shared`).
    """
    if compress_every is not None and answer_ids is not None and steps - 1 < compress_every:
        ids = torch.cat([rest, answer_ids[:, :steps - 1]], 1)
        t_dec = time.perf_counter()
        logits = engine.forward(ids, keep=steps)
        note("decode")
        tick(ids.shape[1])
        return ([logits[:, t].float() for t in range(steps)], [answer_ids[:, t] for t in range(steps)], t_dec)
    last = engine.forward(rest)[:, -1]
    note("question")
    tick(rest.shape[1])
    logits_out: list[torch.Tensor] = []
    tokens_out: list[torch.Tensor] = []
    t_dec = time.perf_counter()
    for t in range(steps):
        logits_out.append(last.float())
        tok = answer_ids[:, t] if answer_ids is not None else last.argmax(-1)
        tokens_out.append(tok)
        if t + 1 < steps:
            last = engine.forward(tok[:, None])[:, -1]
            note("decode")
            phase = engine.after_decode_step(t + 1, tokens_out)
            if phase:
                note(phase)
        tick(1)
    return logits_out, tokens_out, t_dec


def run_sequence(
    model: torch.nn.Module,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor,
    cfg: DecodeConfig,
    *,
    answer_ids: torch.Tensor | None = None,
    max_new_tokens: int = 0,
    progress: Callable[[int], None] | None = None,
    tokenizer: Any = None,
    compression_trace: Any = None,
) -> DecodeOutput:
    """Run the protocol on a batch and return the decode-phase logits and accounting.

    ``context_ids`` ``(batch, n)``, ``question_ids`` ``(batch, m)``, ``answer_ids``
    ``(batch, a)`` or None. With ``answer_ids`` the decode phase is teacher-forced over the
    answer (``T = a``); otherwise it is greedy for ``max_new_tokens`` steps. ``progress`` is
    called with the number of tokens processed after each forward. ``tokenizer`` is used
    only by scorers with a ``reconstruction_ids(chunk, tokenizer)`` method (KVzip: its
    "repeat the context" prompt before the chunk); ``None`` means the byte vocabulary of the
    tiny test models (ids = UTF-8 bytes), as in :func:`evictlab.tasks.examples.encode_text`.
    ``compression_trace``: a :class:`~evictlab.decode.trace.CompressionTrace` that records every
    compression, per layer, before the store evicts (off by default: nothing is computed).
    """
    t0 = time.perf_counter()
    peak = _rss()
    b, n = context_ids.shape
    m = question_ids.shape[1]
    T = answer_ids.shape[1] if answer_ids is not None else max_new_tokens
    if T <= 0:
        raise InputError("answer_ids", "nothing to decode", "pass answer_ids or max_new_tokens > 0")
    g = model_geometry(model)
    total = n + m + T
    # What a cache without eviction holds at the end: every entry fed on full-attention
    # layers, the last window - 1 on sliding ones (transformers' DynamicSlidingWindowLayer,
    # used by mode="full", keeps exactly that). The last decode token is never fed (its
    # logits are the run's last output), so the cache ends holding total - 1 tokens.
    full_tokens = g.full_cache_tokens(total - 1)
    bytes_full = kv_bytes(full_tokens * b, g.head_dim, g.dtype)
    tick = progress or (lambda _k: None)
    steps = StepRecorder()

    engine: Engine
    if cfg.mode == "full":
        engine, query_aware = FullCache(model), False
    else:
        runner = _evicting_engine(model, cfg, context_ids, question_ids, answer_ids, T, g, tokenizer)
        runner.compression_trace = compression_trace
        engine, query_aware = runner, cfg.query_aware

    steps.engine = engine
    with torch.no_grad(), engine.session():
        logits_out, tokens_out, t_dec = _drive(engine, context_ids, question_ids, answer_ids, T, cfg.loop.chunk_size,
                                               query_aware, tick, steps.note)
    budget = engine.budget_tokens
    peak = max(peak, steps.peak_rss)
    return DecodeOutput(torch.stack(logits_out, 1), torch.stack(tokens_out, 1), steps.trace, budget, bytes_full, peak,
                        time.perf_counter() - t0, engine.compressions, time.perf_counter() - t_dec,
                        list(engine.context_kept), None if budget is None else min(budget, full_tokens))


def _evicting_engine(model: torch.nn.Module, cfg: DecodeConfig, context_ids: torch.Tensor,
                     question_ids: torch.Tensor, answer_ids: torch.Tensor | None, T: int | None, g: ModelGeometry,
                     tokenizer: Any, future: Callable[[], dict[int, torch.Tensor]] | None = None,
                     cache: Any = None) -> EvictionRunner:
    """An :class:`EvictionRunner` whose store is sized, in tokens, by what this run feeds.

    ``T``: the decode steps, or None when they are not known in advance (a stock
    ``model.generate`` through :mod:`evictlab.api`): the decode headroom is then a whole
    ``compress_every`` interval, the full-attention cells are not capped by what is fed,
    and the always-kept floors are clipped to the prompt plus one interval. ``cache``: an
    unbound :class:`~evictlab.kv.cache.EvictionCache` that holds the store (see
    :class:`EvictionRunner`).

    Headroom per cell between compressions: a prefill chunk, never more than the context
    fed (query-aware: the whole prefix, context and question but its last token, since
    nothing is compressed before it; plus, around a reconstruction pass, its prompt and a
    chunk again); after the context, the rest of the question plus the decode steps before
    the next compression (plus a decode-time reconstruction pass: prompt + the last
    ``window`` tokens). A cell never holds more than the tokens fed (plus one reconstruction
    pass), or, on a sliding layer, ``window - 1`` plus one chunk or the decode headroom
    (out-of-window entries are dropped after every chunk in both protocols): that caps the
    pool.
    """
    b, n = context_ids.shape
    m = question_ids.shape[1]
    assert cfg.method is not None  # an evicting config carries its method
    method = cfg.method.for_model(g)
    if method.labels and method.scorer_params.get("useful") is None:
        raise InputError("method", f"{method.scorer_name} reads the task's fact labels and none were passed",
                         "run it through a command that passes them (decode, audit, eval run, dilution sweep: "
                         "DecodeConfig.with_labels)")
    loop = cfg.loop
    recon = method.reconstruction
    prompt_len = 0
    if recon:
        check_recon_tokenizer(g, method.scorer, tokenizer)
        prompt_len = recon_ids(method.scorer, context_ids[:, :0], tokenizer).shape[1]
    prefill_fed = n + (m - 1 if cfg.query_aware else 0)
    chunk = min(loop.chunk_size, prefill_fed)
    recon_head = chunk + prompt_len if recon else 0
    prefill_head = (prefill_fed if cfg.query_aware else chunk) + recon_head
    open_ended = T is None
    steps = loop.compress_every + 1 if T is None else T
    decode_steps = min(loop.compress_every, steps - 1)
    decode_recon = recon and steps - 1 >= loop.compress_every
    decode_head = (1 if cfg.query_aware else m) + decode_steps + (loop.window + prompt_len if decode_recon else 0)
    fed = n + m + steps - 1
    recon_pass = prompt_len + max(chunk, min(loop.window, steps)) if recon else 0
    slide_head = max(chunk + recon_head, decode_head)
    max_cell = None if open_ended else [
        fed + recon_pass if w is None else min(fed + recon_pass, w - 1 + slide_head) for w in g.windows]
    runner = EvictionRunner(model, cfg, b, headroom_tokens_per_cell=prefill_head, total_tokens=n + m + steps,
                            max_cell_tokens=max_cell, tokenizer=tokenizer, decode_headroom_tokens_per_cell=decode_head,
                            cache=cache)
    if method.future:
        if answer_ids is None:
            raise InputError("method", "the oracle needs the true future tokens", "run it teacher-forced (with an answer)")
        with torch.no_grad():
            runner.extra_queries = (future() if future is not None else
                                    oracle_queries(model, torch.cat([context_ids, question_ids, answer_ids], 1), m + T))
    return runner
