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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from evictlab.errors import BudgetExceededError, InputError
from evictlab.kv.base import KVStore
from evictlab.kv.budget import Budget, ByteReport, kv_bytes
from evictlab.kv.cache import EvictionCache, attach
from evictlab.kv.masked import MaskedKVStore
from evictlab.kv.paged import PagedKVStore
from evictlab.methods.base import AllocInputs, Allocator, Phase, Scorer, WindowProfile, check_sizes
from evictlab.models.geometry import ModelGeometry, model_geometry

#: Most tokens one model forward of the evicting engine processes (see ``EvictionRunner.forward``).
FORWARD_TOKENS = 1024

Mode = Literal["physical", "masked", "full"]
MODES: tuple[str, ...] = ("physical", "masked", "full")
ProtocolName = Literal["query-agnostic", "query-aware"]
PROTOCOLS: tuple[str, ...] = ("query-agnostic", "query-aware")
"""The two protocols (module docstring, point 2); ``DecodeConfig.protocol`` names a run's."""


@dataclass
class DecodeConfig:
    """How one method runs through the loop.

    ``mode``: ``"physical"`` (paged store, evicted entries freed), ``"masked"`` (full tensors +
    keep mask: the audit of others), or ``"full"`` (no eviction, stock ``DynamicCache``; the
    reference). ``budget`` is required unless ``mode == "full"``. ``scorer_params`` and
    ``allocator_params`` are the method's parameters (strings from the command line are
    typed by the method's dataclass fields, see :mod:`evictlab.methods.params`).

    Validated on construction (:class:`InputError` with the field's name): the mode, the
    sizes, and the method (names and parameters, by building it once).
    """

    mode: Mode = "physical"
    budget: Budget | None = None
    scorer: str = "snapkv"
    scorer_params: dict[str, Any] = field(default_factory=dict)
    allocator: str = "uniform"
    allocator_params: dict[str, Any] = field(default_factory=dict)
    sinks: int = 4
    recent: int = 16
    chunk_size: int = 256
    compress_every: int = 16
    window: int = 32
    block_size: int = 16
    query_aware: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError("mode", f"unknown mode {self.mode!r}", "use physical, masked or full")
        for name in ("chunk_size", "compress_every", "window", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise InputError(name, f"must be positive, got {getattr(self, name)}", "pass a positive integer")
        for name in ("sinks", "recent"):
            if int(getattr(self, name)) < 0:
                raise InputError(name, f"must be >= 0, got {getattr(self, name)}", "pass 0 or more")
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise InputError("budget", f"{self.budget!r} is not a Budget", "pass Budget.parse('64') or similar")
        # Build the method once: unknown names/parameters and bad values fail here, and the
        # parameters are kept typed (what the run record shows).
        scorer = self.build_scorers(None)[0]
        self.scorer_params = {k: getattr(scorer, k) for k in self.scorer_params}
        allocator = self.build_allocator()
        self.allocator_params = {k: getattr(allocator, k) for k in self.allocator_params}

    @property
    def protocol(self) -> str:
        """``"query-aware"`` or ``"query-agnostic"`` (see :data:`PROTOCOLS`)."""
        return PROTOCOLS[1] if self.query_aware else PROTOCOLS[0]

    @property
    def method(self) -> str:
        """The method spec: ``scorer+allocator`` (``scorer`` alone for uniform)."""
        return self.scorer if self.allocator == "uniform" else f"{self.scorer}+{self.allocator}"

    def build_scorers(self, geometry: ModelGeometry | None) -> list[Scorer]:
        """One scorer per layer (one object for all layers, or, for scorers that undo RoPE,
        one per distinct RoPE base; with ``geometry=None`` one scorer with the dataclass
        defaults). An explicit ``rope_theta`` wins."""
        from evictlab.methods import make_scorer

        if geometry is None:
            return [make_scorer(self.scorer, **self.scorer_params)]
        from evictlab.methods.params import settable_params
        from evictlab.methods.registry import REGISTRY

        if "rope_theta" not in settable_params(REGISTRY[self.scorer]):  # one object for every layer
            return [make_scorer(self.scorer, **self.scorer_params)] * geometry.n_layers
        by_rope: dict[Any, Scorer] = {}
        for r in geometry.rope:
            if r not in by_rope:
                by_rope[r] = make_scorer(self.scorer, rope=r, **self.scorer_params)
        return [by_rope[r] for r in geometry.rope]

    def floors(self, geometry: ModelGeometry, total_tokens: int) -> np.ndarray:
        """int64 ``(n_layers, kv_heads)``: the entries ``select_keep`` always keeps per cell
        (sinks + recent), clipped to ``total_tokens`` and to ``window - 1`` on sliding
        layers (a sliding cell never holds more after a compression)."""
        keep = self.sinks + self.recent
        return np.array([[min(keep, total_tokens, w - 1 if w else total_tokens)] * geometry.kv_heads
                         for w in geometry.windows], dtype=np.int64)

    def budget_tokens(self, geometry: ModelGeometry, total_tokens: int) -> int:
        """Kept entries per sequence for ``geometry``; :class:`InputError` (field ``budget``)
        when there is no budget or it is below the summed always-kept floors."""
        if self.budget is None:
            raise InputError("budget", "a budget is required in physical and masked modes", "pass a budget")
        tokens = self.budget.total_tokens(geometry.n_layers, geometry.kv_heads, geometry.head_dim, geometry.dtype)
        floor_total = int(self.floors(geometry, total_tokens).sum())
        if tokens < floor_total:
            raise InputError("budget", f"{tokens} kept tokens per sequence is below the {floor_total} always-kept "
                             f"sinks + recent entries ({geometry.cells} cells)", "raise the budget or lower sinks/recent")
        return tokens

    def build_allocator(self) -> Allocator:
        from evictlab.methods import make_allocator

        return make_allocator(self.allocator, **self.allocator_params)

    @property
    def needs_labels(self) -> bool:
        """Whether the scorer reads the task's labels (``oracle_labels``: they are passed per
        example by :meth:`with_labels`)."""
        return self.mode != "full" and "labels" in getattr(self.build_scorers(None)[0], "needs", ())

    def with_labels(self, useful: Callable[[], str | None]) -> DecodeConfig:
        """This config for one example: a scorer that reads the task's labels gets them as
        its ``useful`` parameter (``useful()``: the example's asked-fact token spans, e.g.
        :func:`evictlab.decode.tasks.useful_spec`, called only then); any other config is
        returned as is. :class:`InputError` (field ``task``) when the scorer needs labels and
        the example has none, (field ``scorer_param``) when ``useful`` was set by hand: the
        labels are the task's, never a default."""
        if not self.needs_labels:
            return self
        if "useful" in self.scorer_params:
            raise InputError("scorer_param", f"{self.scorer}'s useful keys are the task's fact labels, set per "
                             "example", "drop useful=... from the scorer parameters")
        spans = useful()
        if spans is None:
            raise InputError("task", f"{self.scorer} reads the task's fact labels and this example has none",
                             "use a task with facts (needle, multi_key, ...) or another method")
        return replace(self, scorer_params={**self.scorer_params, "useful": spans})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["budget"] = None if self.budget is None else {"unit": self.budget.unit, "value": self.budget.value}
        for key in ("scorer_params", "allocator_params"):
            d[key] = {k: str(v) if isinstance(v, Path) else v for k, v in d[key].items()}
        return d


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


@contextlib.contextmanager
def attach_model(model: torch.nn.Module, cache: EvictionCache,
                 windows: list[int | None] | tuple[int | None, ...] | None = None) -> Iterator[EvictionCache]:
    """:func:`evictlab.kv.cache.attach` with the model's sliding windows.

    On a layer with window ``w`` (``windows``, default the model's
    :attr:`ModelGeometry.windows`) a query at ``q_pos`` attends only slots with
    ``q_pos - slot_pos < w``: the bound the model's own sliding mask applies, per query,
    which a chunk of several queries needs even after out-of-window entries were dropped
    (ragged attention applies it itself; the rectangular path adds it to the mask). Hooks
    are removed on exit.
    """
    windows = model_geometry(model).windows if windows is None else windows
    with attach(model, cache, windows):
        yield cache


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


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
    def forward(self, ids: torch.Tensor) -> torch.Tensor: ...
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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits

    def report(self) -> ByteReport | None:
        return None

    def after_chunk(self, chunk: torch.Tensor, phase: Phase, compress: bool = True) -> str | None:
        return None

    def end_context(self) -> str | None:
        return None

    def after_decode_step(self, step: int, tokens: list[torch.Tensor]) -> str | None:
        return None


class EvictionRunner:
    """The evicting engine: one store + cache for one batch of sequences, compressed to the
    budget by the scorer and the allocator.

    ``headroom_tokens_per_cell``: entries a cell may gain between compressions during the
    prefill (the store's initial headroom); ``total_tokens``: tokens the run feeds (clips
    the always-kept floor); ``max_cell_tokens``: per layer, the most entries one cell can
    ever hold (caps the paged pool; None = no cap); ``tokenizer``: for a reconstruction
    scorer's prompt (see :func:`run_sequence`).
    """

    def __init__(self, model: torch.nn.Module, cfg: DecodeConfig, batch: int, *, headroom_tokens_per_cell: int,
                 total_tokens: int, max_cell_tokens: list[int] | None = None,
                 layer_scorers: list[Scorer] | None = None, tokenizer: Any = None,
                 decode_headroom_tokens_per_cell: int | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.batch = batch
        self.geometry = g = model_geometry(model)
        self.n_layers, self.q_heads, self.kv_heads, self.head_dim, self.dtype = (
            g.n_layers, g.q_heads, g.kv_heads, g.head_dim, g.dtype)
        #: per layer: the sliding window, or None (full attention)
        self.windows = list(g.windows)
        self.device = next(model.parameters()).device
        self.scaling = g.scaling
        self.budget_tokens = cfg.budget_tokens(g, total_tokens)
        self.floors = cfg.floors(g, total_tokens)
        store: KVStore
        if cfg.mode == "physical":
            store = PagedKVStore.for_budget(g, batch, kept_tokens=self.budget_tokens,
                                            headroom_tokens_per_cell=headroom_tokens_per_cell,
                                            max_cell_tokens=max_cell_tokens, block_size=cfg.block_size,
                                            device=self.device)
        elif cfg.mode == "masked":
            cap = max(max_cell_tokens) if max_cell_tokens else min(total_tokens, 1024)
            store = MaskedKVStore(g.n_layers, batch, g.kv_heads, g.head_dim, dtype=g.dtype, device=self.device,
                                  initial_capacity=max(16, cap))
        else:
            raise InputError("mode", f"mode {cfg.mode!r} does not evict", "use physical or masked")
        self.store = store
        #: the scorer of each layer (one object for all layers unless RoPE differs by layer type)
        self.layer_scorers = list(layer_scorers) if layer_scorers is not None else cfg.build_scorers(g)
        self.scorer = self.layer_scorers[0]
        self.allocator = cfg.build_allocator()
        self.allocator.check(g)  # e.g. a fitted profile of another model: refused before the run
        #: per-compression diagnostics (:class:`evictlab.decode.trace.CompressionTrace`), or None
        self.compression_trace: Any = None
        #: True: the scorer gets every query since its previous call (consumed by each
        #: compression); False: the last ``cfg.window`` queries (a sliding window).
        self.all_queries = bool(getattr(self.scorer, "uses_all_queries", False))
        self.cache = EvictionCache(store)
        self.cache.query_window = None if self.all_queries else cfg.window
        self.states: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.extra_queries: dict[int, torch.Tensor] | None = None
        self.compressions = 0
        needs = getattr(self.scorer, "needs", frozenset())
        #: KVzip-style: reconstruction passes before each compression
        self.recon = "reconstruction" in needs
        self.tokenizer = tokenizer
        if self.recon:
            _check_recon_tokenizer(g, self.scorer, tokenizer)
        self._pending: list[torch.Tensor] = []  # chunks fed since the last reconstruction
        self.decode_headroom = decode_headroom_tokens_per_cell
        #: per layer, the kept positions right after the context (see DecodeOutput)
        self.context_kept: list[torch.Tensor] = []

    # -- engine hooks (see _drive) ------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """The cache's hooks, then each scorer's own (``Scorer.attach``: TrimKV's gates)."""
        with attach_model(self.model, self.cache, self.windows), contextlib.ExitStack() as stack:
            for scorer in {id(s): s for s in self.layer_scorers}.values():
                if hasattr(scorer, "attach"):
                    stack.enter_context(scorer.attach(self.model, self.cache))
            yield

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` ``(batch, q_len)`` through the model with the cache; returns the last
        position's logits ``(batch, 1, vocab)``.

        Inputs longer than :data:`FORWARD_TOKENS` go through the model in consecutive pieces
        of that many tokens with nothing evicted in between: the same attention (every piece
        attends to everything before it), so the same logits up to float rounding, with the
        model's activations bounded by one piece whatever the chunk (a one-pass prefill
        holds the whole context's K/V, never its whole activations). Compressions happen
        only where the protocol says (after ``chunk_size`` tokens)."""
        out = None
        for start in range(0, ids.shape[1], FORWARD_TOKENS):
            out = self.model(input_ids=ids[:, start:start + FORWARD_TOKENS], cache=self.cache, use_cache=True,
                             logits_to_keep=1)
        assert out is not None
        return out.logits

    def report(self) -> ByteReport | None:
        return self.store.bytes()

    def after_chunk(self, chunk: torch.Tensor, phase: Phase, compress: bool = True) -> str | None:
        """After a prefill chunk: reconstruction passes if a compression follows, then compress.

        ``compress=False`` (query-aware chunks before the question is in view): no ranking
        runs; only the out-of-window entries of sliding layers are dropped (trace phase
        ``"window"``), and the chunk waits for the next reconstruction pass."""
        if self.recon:
            self._pending.append(chunk)
        if not compress:
            return "window" if self.drop_out_of_window() else None
        if self.recon:
            if self.live_per_sequence() > self.budget_tokens:
                # A compression follows: reconstruct every chunk fed since the last one,
                # one pass (prompt + chunk) per chunk, as KVzip chunks long contexts.
                passes = [self.reconstruction_queries(_recon_ids(self.scorer, c, self.tokenizer))
                          for c in self._pending]
                self.extra_queries = {l: torch.cat([p[l] for p in passes], 2) for l in range(self.n_layers)}
                self._pending = []
        self.compress(phase)
        return "compress"

    def end_context(self) -> str | None:
        """After the context: record the kept positions; the paged pool drops its prefill
        headroom and keeps the decode headroom."""
        resized = None
        if isinstance(self.store, PagedKVStore) and self.decode_headroom is not None:
            self.store.reserve_headroom(self.decode_headroom)
            resized = "resize"
        self.context_kept = [self.store.gather(l)[2].cpu() for l in range(self.n_layers)]
        return resized

    def after_decode_step(self, step: int, tokens: list[torch.Tensor]) -> str | None:
        """Every ``compress_every`` decode steps: (a reconstruction pass over the last
        ``window`` tokens, for KVzip) then compress."""
        if step % self.cfg.compress_every:
            return None
        if self.recon:
            recent_ids = tokens_out_tensor(tokens, self.cfg.window)
            self.extra_queries = self.reconstruction_queries(_recon_ids(self.scorer, recent_ids, self.tokenizer))
        self.compress("decode")
        return "compress"

    # -- compression ---------------------------------------------------------------------
    def live_per_sequence(self) -> int:
        return self.store.total_live() // self.batch

    def drop_out_of_window(self) -> int:
        """On sliding layers, evict the entries no later query can attend; returns how many.

        The next query of layer ``l`` is at position ``seen_l`` and attends keys with
        ``pos > seen_l - window`` only, and later queries even fewer: every entry with
        ``pos <= seen_l - window`` is dead for good. Entries are in position order, so
        they are a prefix of each cell. Physical store: freed; masked store: masked (held).
        """
        dropped = 0
        for l, w in enumerate(self.windows):
            if w is None:
                continue
            limit = self.cache.layers[l].seen - w
            if limit < 0:
                continue
            pos = self.store.layout_positions(l, torch.empty(0, dtype=torch.int64, device=self.device))
            dead = ((pos >= 0) & (pos <= limit)).sum(-1).cpu()  # (batch, kv_heads)
            if not bool((dead > 0).any()):
                continue
            lens = self.store.lengths(l)
            self.store.keep(l, [[torch.arange(int(dead[b, h]), int(lens[b, h])) for h in range(self.kv_heads)]
                                for b in range(self.batch)])
            dropped += int(dead.sum())
        return dropped

    def compress(self, phase: Phase = "prefill") -> None:
        """Drop out-of-window entries of sliding layers (:meth:`drop_out_of_window`), then
        bring every sequence down to ``budget_tokens`` kept entries (no-op if under)."""
        self.drop_out_of_window()
        if self.live_per_sequence() <= self.budget_tokens:
            return
        from evictlab.methods.base import ScoreInputs, select_keep_ordered

        rep = self.q_heads // self.kv_heads
        layer_scores: list[torch.Tensor] = []
        cell_pos: list[torch.Tensor] = []
        lengths = np.zeros((self.n_layers, self.kv_heads), dtype=np.int64)
        fill = -torch.finfo(torch.float32).max
        # The observation window (the scorers' last `window` queries), for an allocator that
        # measures it (ContourKV online) and for the trace; nothing is computed otherwise.
        profile = "window_profile" in self.allocator.needs
        if profile:
            from evictlab.contour.profile import window_stats
        tails: list[np.ndarray] = []
        entropy = np.zeros((self.batch, self.n_layers, self.kv_heads))
        windows_q: list[tuple[torch.Tensor, torch.Tensor]] = []
        for l in range(self.n_layers):
            cells, pos = self.store.live_cells(l)  # per-cell views (paged: no copy) + padded positions
            lens = self.store.lengths(l)
            if not bool((lens == lens[0:1]).all()):
                raise RuntimeError("cells of one KV head differ in length across the batch")
            lengths[l] = lens[0].numpy()
            rec = self.cache.take_queries(l, consume=self.all_queries)
            if rec is None:
                raise RuntimeError(f"no queries recorded for layer {l}; run a forward inside attach() first")
            q, qpos = rec
            obs_q, obs_pos = q[:, :, -self.cfg.window:], qpos[-self.cfg.window:]
            if self.compression_trace is not None:
                windows_q.append((obs_q, obs_pos))
            if profile:
                tails.append(np.zeros((self.batch, self.kv_heads, pos.shape[2] + 1)))
            sc = torch.full((self.batch, self.kv_heads, pos.shape[2]), fill, dtype=torch.float32, device=pos.device)
            inputs: list[ScoreInputs] = []
            for b in range(self.batch):
                for h in range(self.kv_heads):
                    extra = None
                    if self.extra_queries is not None:
                        extra = self.extra_queries[l][b:b + 1, h * rep:(h + 1) * rep]
                    cell = cells[b][h]
                    inputs.append(ScoreInputs(
                        layer=l, n_layers=self.n_layers,
                        keys=cell.k[None, None], values=cell.v[None, None], positions=cell.pos,
                        queries=q[b:b + 1, h * rep:(h + 1) * rep], q_positions=qpos, scaling=self.scaling,
                        extra_queries=extra, state=self.states.setdefault((l, b, h), {}), cell=(b, h),
                    ))
                    if profile:
                        tails[l][b, h, :int(lens[b, h]) + 1], entropy[b, l, h] = window_stats(
                            obs_q[b, h * rep:(h + 1) * rep], cell.k, self.scaling, obs_pos, cell.pos)
            scorer = self.layer_scorers[l]
            many = getattr(scorer, "score_cells", None)  # the same scores in fewer calls, when offered
            outs = many(inputs) if many is not None else [scorer.score(x) for x in inputs]
            for i, out in enumerate(outs):
                b, h = divmod(i, self.kv_heads)
                sc[b, h, :int(lens[b, h])] = out.reshape(-1).float()
            layer_scores.append(sc)
            cell_pos.append(pos)
        g = self.geometry
        alloc_inputs = AllocInputs(
            tuple(layer_scores), lengths, np.minimum(self.floors, lengths), tuple(self.windows), self.budget_tokens,
            phase=phase, positions=tuple(cell_pos), next_position=self.cache.seen, head_dim=g.head_dim,
            dtype_bytes=g.dtype_bytes, geometry=g, sinks=self.cfg.sinks, recent=self.cfg.recent,
            window=WindowProfile(tuple(tails), entropy) if profile else None)
        sizes = check_sizes(alloc_inputs, self.allocator.allocate(alloc_inputs), f"allocator {self.cfg.allocator!r}")
        sinks, recent = self.cfg.sinks, self.cfg.recent
        for l in range(self.n_layers):
            # Cells hold their entries in position order (a store invariant), so the kept
            # entries follow from scores alone; cells of equal length go in one call.
            if (lengths[l] == lengths[l, 0]).all():
                keep = select_keep_ordered(layer_scores[l][:, :, :int(lengths[l, 0])], sizes[l], sinks=sinks,
                                           recent=recent)
            else:
                keep = [[select_keep_ordered(layer_scores[l][b:b + 1, h:h + 1, :int(lengths[l, h])], [int(sizes[l, h])],
                                             sinks=sinks, recent=recent)[0][0] for h in range(self.kv_heads)]
                        for b in range(self.batch)]
            if self.compression_trace is not None:
                k, v, pos = self.store.gather(l)
                self.compression_trace.record(self.compressions, phase, self.cache.seen, l, k, v, pos, lengths[l], keep,
                                              *windows_q[l], self.scaling)
            self.store.keep(l, keep)
        self.compressions += 1
        if self.live_per_sequence() > self.budget_tokens:
            raise BudgetExceededError(f"after compression {self.live_per_sequence()} entries are held per sequence, "
                                      f"above the budget of {self.budget_tokens}")

    def reconstruction_queries(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """KVzip-style: feed ``ids`` after the cache, record its queries, then drop its entries.

        ``ids`` is a reconstruction pass (KVzip: its "repeat" prompt, then context tokens
        again; see :func:`_recon_ids`), appended at positions after every held key; its
        post-RoPE queries are returned per layer ``(batch, q_heads, q_len, d)``, and the
        appended entries are discarded again (:meth:`KVStore.discard_recent`: freed in the
        paged store, and not part of the audited cache in the masked one), so the pass leaves
        the cache and the position counter as they were.
        """
        saved_window = self.cache.query_window
        saved = dict(self.cache.queries)
        self.cache.queries.clear()
        self.cache.query_window = ids.shape[1]
        self.forward(ids)
        out = {l: self.cache.queries[l][0] for l in range(self.n_layers)}
        q_len = ids.shape[1]
        for l in range(self.n_layers):
            self.store.discard_recent(l, q_len)
            self.cache.layers[l].seen -= q_len
        self.cache.queries.clear()
        self.cache.queries.update(saved)
        self.cache.query_window = saved_window
        return out


def _oracle_queries(model: torch.nn.Module, ids: torch.Tensor, n_future: int) -> dict[int, torch.Tensor]:
    """True future queries (labelled oracle): the last ``n_future`` positions of a dense pass."""
    g = model_geometry(model)
    store = MaskedKVStore(g.n_layers, ids.shape[0], g.kv_heads, g.head_dim, dtype=g.dtype, device=ids.device,
                          initial_capacity=ids.shape[1])
    cache = EvictionCache(store)
    cache.query_window = n_future
    with attach_model(model, cache, g.windows):
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return {l: cache.queries[l][0] for l in range(g.n_layers)}


def _drive(engine: Engine, context_ids: torch.Tensor, question_ids: torch.Tensor, answer_ids: torch.Tensor | None,
           steps: int, chunk_size: int, query_aware: bool, tick: Callable[[int], None],
           note: Callable[[str], None]) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """The protocol, for every engine: the chunked prefix, the rest of the question, then
    ``steps`` decode steps. Returns per-step logits and tokens and the decode phase's start
    time. Each forward and each engine hook is recorded by ``note``.

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
    tiny test models (ids = UTF-8 bytes), as in :func:`evictlab.decode.tasks.encode_text`.
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
    trace: list[StepTrace] = []
    tick = progress or (lambda _k: None)

    engine: Engine
    if cfg.mode == "full":
        engine, query_aware = FullCache(model), False
    else:
        runner = _evicting_engine(model, cfg, context_ids, question_ids, answer_ids, T, g, tokenizer)
        runner.compression_trace = compression_trace
        engine, query_aware = runner, cfg.query_aware

    def note(phase: str) -> None:
        nonlocal peak
        r = _rss()
        peak = max(peak, r)
        report = engine.report()
        if report is not None:
            trace.append(StepTrace(phase, engine.cache.seen, report, r))

    with torch.no_grad(), engine.session():
        logits_out, tokens_out, t_dec = _drive(engine, context_ids, question_ids, answer_ids, T, cfg.chunk_size,
                                               query_aware, tick, note)
    budget = engine.budget_tokens
    return DecodeOutput(torch.stack(logits_out, 1), torch.stack(tokens_out, 1), trace, budget, bytes_full, peak,
                        time.perf_counter() - t0, engine.compressions, time.perf_counter() - t_dec,
                        list(engine.context_kept), None if budget is None else min(budget, full_tokens))


def _evicting_engine(model: torch.nn.Module, cfg: DecodeConfig, context_ids: torch.Tensor,
                     question_ids: torch.Tensor, answer_ids: torch.Tensor | None, T: int, g: ModelGeometry,
                     tokenizer: Any) -> EvictionRunner:
    """An :class:`EvictionRunner` whose store is sized, in tokens, by what this run feeds.

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
    scorers = cfg.build_scorers(g)
    needs = getattr(scorers[0], "needs", frozenset())
    if "labels" in needs and getattr(scorers[0], "spans", None) is None:
        raise InputError("method", f"{cfg.scorer} reads the task's fact labels and none were passed",
                         "run it through a command that passes them (decode, audit, eval run, dilution sweep: "
                         "DecodeConfig.with_labels)")
    recon = "reconstruction" in needs
    prompt_len = 0
    if recon:
        _check_recon_tokenizer(g, scorers[0], tokenizer)
        prompt_len = _recon_ids(scorers[0], context_ids[:, :0], tokenizer).shape[1]
    prefill_fed = n + (m - 1 if cfg.query_aware else 0)
    chunk = min(cfg.chunk_size, prefill_fed)
    recon_head = chunk + prompt_len if recon else 0
    prefill_head = (prefill_fed if cfg.query_aware else chunk) + recon_head
    decode_steps = min(cfg.compress_every, T - 1)
    decode_recon = recon and T - 1 >= cfg.compress_every
    decode_head = (1 if cfg.query_aware else m) + decode_steps + (cfg.window + prompt_len if decode_recon else 0)
    fed = n + m + T - 1
    recon_pass = prompt_len + max(chunk, min(cfg.window, T)) if recon else 0
    slide_head = max(chunk + recon_head, decode_head)
    max_cell = [fed + recon_pass if w is None else min(fed + recon_pass, w - 1 + slide_head) for w in g.windows]
    runner = EvictionRunner(model, cfg, b, headroom_tokens_per_cell=prefill_head, total_tokens=n + m + T,
                            max_cell_tokens=max_cell, layer_scorers=scorers, tokenizer=tokenizer,
                            decode_headroom_tokens_per_cell=decode_head)
    if "future" in needs:
        if answer_ids is None:
            raise InputError("method", "the oracle needs the true future tokens", "run it teacher-forced (with an answer)")
        with torch.no_grad():
            runner.extra_queries = _oracle_queries(model, torch.cat([context_ids, question_ids, answer_ids], 1), m + T)
    return runner


def tokens_out_tensor(tokens: list[torch.Tensor], window: int) -> torch.Tensor:
    """The last ``window`` decoded tokens as ``(batch, <=window)`` (for a reconstruction pass)."""
    return torch.stack(tokens[-window:], 1)


class _PromptEncoder:
    """``encode(text, add_special_tokens=...)`` over any tokenizer the loop accepts: a Hugging
    Face tokenizer, a callable stand-in (``ByteTokenizer``), or ``None`` (byte vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        from evictlab.decode.tasks import encode_text

        return encode_text(self.tokenizer, text, special=add_special_tokens)


def _check_recon_tokenizer(geometry: ModelGeometry, scorer: Any, tokenizer: Any) -> None:
    """Without a tokenizer the reconstruction prompt is UTF-8 bytes: only right for a byte vocab."""
    if tokenizer is not None or getattr(scorer, "reconstruction_ids", None) is None:
        return
    if geometry.vocab_size != 256:
        raise InputError("tokenizer", f"{getattr(scorer, 'name', 'the scorer')}'s reconstruction prompt needs the "
                         f"model's tokenizer (None means the 256-token byte vocabulary of the tiny test models, "
                         f"this model has {geometry.vocab_size or '?'} tokens)",
                         "pass tokenizer=... to run_sequence / run_audit")


def _recon_ids(scorer: Any, chunk: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """Token ids ``(batch, p + n)`` of a reconstruction pass over ``chunk`` ``(batch, n)``.

    A scorer with ``reconstruction_ids(chunk, tokenizer)`` (KVzip: its "repeat the previous
    context" prompt, then the chunk) builds them, with the prompt tokenised by ``tokenizer``
    (``None``: UTF-8 bytes, the tiny models' vocabulary); otherwise the chunk alone is re-fed.
    """
    build = getattr(scorer, "reconstruction_ids", None)
    if build is None:
        return chunk
    return build(chunk, _PromptEncoder(tokenizer))
