"""The decode loop: chunked prefill that compresses as it goes, then decoding that
compresses every N steps, on a stock transformers model (through :mod:`evictlab.kv.cache`).

Protocol (query-agnostic by default, docs/theory.md section 9):

1. The **context** is fed in chunks of ``chunk_size`` tokens. After each chunk, if the
   cache holds more than the budget, it is compressed to the budget: every cell is scored
   (the scorer sees the cell's keys and the context's queries: the last ``window`` of
   them, or, for scorers with ``uses_all_queries`` (H2O, Compactor, ExpectedAttention),
   every query processed since the previous compression), an
   allocator turns the budget into per-cell sizes, :func:`select_keep` picks the kept
   entries, and the store evicts the rest. So the cache never holds more than
   ``budget + chunk_size`` entries per cell (peak KV memory bounded).
2. The **question** is appended only after the context was compressed: no ranking ever
   sees it. With ``query_aware=True`` (a labelled option, to measure the margin) the
   question is appended before the last compression and its queries are in the window.
3. **Decoding** feeds the answer tokens (teacher forcing; the logits give perplexity, KL and
   top-1 agreement, and all-argmax-correct is exactly greedy exact match) or greedy argmax
   tokens; every ``compress_every`` steps the cache is compressed back to the budget.

The budget counts kept entries after a compression; between compressions a cell may hold
up to ``chunk_size`` (prefill) or ``question + compress_every`` (decoding) more. The paged
pool is sized to exactly that and raises :class:`BudgetExceededError` rather than grow.

Scorers are built with :func:`evictlab.methods.make_scorer` from the model's config (so
the RoPE-undoing scorers use the model's RoPE base). Scoring is done per (batch item, KV
head) cell, because after ragged eviction cells hold different keys at different positions
(``ScoreInputs.positions`` is one vector). The scorer state (``ScoreInputs.state``) is one
dict per (layer, batch item, KV head). Allocators receive per-layer scores
``(batch, kv_heads, S_l)`` padded with the float32 minimum past a shorter head's length,
plus ``lengths=`` (each cell's real length), so padding never counts as available keys.

Sliding-window layers (Gemma 3's ``"sliding_attention"`` layers, see :func:`layer_windows`):
a query at position ``t`` attends only keys with ``t - pos < window``. :func:`attach_model`
adds that bound to the mask of those layers (so a multi-token chunk is exact), and every
compression first drops, from the cells of those layers, the entries no later query can
attend (``pos <= next - window``: physically freed in the paged store, masked in the masked
one), so a sliding cell holds at most ``window - 1`` entries after a compression. The budget
is then spread by the allocator over the cells' real lengths: a sliding cell keeps
``min(window - 1, its size)`` and what it cannot hold goes to the other cells.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from types import SimpleNamespace
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from evictlab.errors import BudgetExceededError, InputError
from evictlab.kv.base import KVStore
from evictlab.kv.budget import Budget, ByteReport
from evictlab.kv.cache import EvictionCache, attach
from evictlab.kv.masked import MaskedKVStore
from evictlab.kv.paged import PagedKVStore

Mode = Literal["physical", "masked", "full"]

@dataclass
class DecodeConfig:
    """How one method runs through the loop.

    ``mode``: ``"physical"`` (paged store, evicted entries freed), ``"masked"`` (full tensors +
    keep mask: the audit of others), or ``"full"`` (no eviction, stock ``DynamicCache``; the
    reference). ``budget`` is required unless ``mode == "full"``.
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["budget"] = None if self.budget is None else {"unit": self.budget.unit, "value": self.budget.value}
        return d


@dataclass
class StepTrace:
    """Accounting after one forward (or compression) of the loop."""

    phase: str  # "prefill", "compress", "question", "decode"
    seen: int
    report: ByteReport
    rss: int


@dataclass
class DecodeOutput:
    """Result of :func:`run_sequence`.

    ``logits``: float32 ``(batch, T, vocab)``: row t predicts decode token t (row 0 comes from
    the last question position). ``tokens``: int64 ``(batch, T)`` the decode-phase tokens
    (the forced answer, or greedy argmax). ``trace``: one :class:`StepTrace` per phase step.
    ``budget_tokens``: kept entries per sequence (None in full mode).
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

    def peak(self, attr: str) -> int:
        """Max of ``ByteReport.<attr>`` over the trace (0 for full mode)."""
        return max((getattr(t.report, attr) for t in self.trace), default=0)

    def after_compression(self, attr: str) -> int:
        """Max of ``ByteReport.<attr>`` right after compressions (what the budget governs)."""
        return max((getattr(t.report, attr) for t in self.trace if t.phase == "compress"), default=0)


def _text_config(model: torch.nn.Module) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def model_geometry(model: torch.nn.Module) -> tuple[int, int, int, int, torch.dtype]:
    """``(n_layers, q_heads, kv_heads, head_dim, dtype)`` from a transformers model config.

    Raises :class:`InputError` for attention kinds the loop cannot make exact (see
    :func:`layer_windows`)."""
    cfg = _text_config(model)
    hq = cfg.num_attention_heads
    hk = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    layer_windows(model)  # validates the layer types
    return cfg.num_hidden_layers, hq, hk, d, next(model.parameters()).dtype


def layer_windows(model: torch.nn.Module) -> list[int | None]:
    """Per layer, the sliding window ``w`` of a sliding-attention layer (a query at position
    ``t`` attends keys with ``t - pos < w``, transformers' ``sliding_window_overlay``), or
    ``None`` for a full-attention layer.

    Read from the config's ``layer_types`` (Gemma 3, Qwen2: ``"sliding_attention"`` /
    ``"full_attention"``); a config without ``layer_types`` but with a ``sliding_window``
    (Mistral) slides on every layer. Other layer types (chunked, linear attention) and
    bidirectional attention are an :class:`InputError`.
    """
    cfg = _text_config(model)
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = list(getattr(cfg, "layer_types", None) or [])
    if getattr(cfg, "use_bidirectional_attention", False):
        raise InputError("model", "bidirectional attention is not causal decoding", "use a causal decoder model")
    if not types:
        slides = bool(window) and getattr(cfg, "use_sliding_window", True) is not False
        return [int(window) if slides else None] * n
    bad = sorted({t for t in types[:n] if t not in ("full_attention", "sliding_attention")})
    if bad or len(types) < n:
        raise InputError("model", f"layer types {bad or types} are not supported by the eviction loop",
                         "use a model whose layers are full_attention or sliding_attention")
    if "sliding_attention" in types[:n] and not window:
        raise InputError("model", "sliding_attention layers without a sliding_window in the config",
                         "set config.sliding_window")
    return [int(window) if t == "sliding_attention" else None for t in types[:n]]


@contextlib.contextmanager
def attach_model(model: torch.nn.Module, cache: EvictionCache,
                 windows: list[int | None] | None = None) -> Iterator[EvictionCache]:
    """:func:`evictlab.kv.cache.attach` plus the sliding window on sliding layers.

    ``attach``'s pre-hook replaces each layer's mask by a causal mask over the store's slot
    positions; on a layer with window ``w`` (``windows``, default :func:`layer_windows`) a
    second pre-hook, registered after it so it runs after it, also masks every slot with
    ``q_pos - slot_pos >= w``: the bound the model's own sliding mask applies, per query,
    which a chunk of several queries needs even after out-of-window entries were dropped.
    Hooks are removed on exit.
    """
    from evictlab.kv.cache import _attention_modules

    windows = layer_windows(model) if windows is None else windows
    with attach(model, cache):
        handles: list[Any] = []

        def window_hook(module: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            layer = module.layer_idx
            w = windows[layer]
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen = cache.layers[layer].seen
            q_pos = torch.arange(seen, seen + hidden.shape[1], device=hidden.device)
            slot_pos = cache.store.layout_positions(layer, q_pos).to(hidden.device)
            mask = kwargs.get("attention_mask")
            if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != slot_pos.shape[-1]:
                raise RuntimeError(f"layer {layer}: expected attach()'s (batch, q_heads, q_len, {slot_pos.shape[-1]}) "
                                   f"mask to add the sliding window to, got {type(mask).__name__}")
            far = slot_pos[:, :, None, :] <= (q_pos - w)[None, None, :, None]  # q_pos - slot_pos >= w
            far = far.repeat_interleave(mask.shape[1] // far.shape[1], dim=1)
            kwargs["attention_mask"] = mask.masked_fill(far, torch.finfo(mask.dtype).min)
            return args, kwargs

        try:
            for m in _attention_modules(model):
                if windows[m.layer_idx] is not None:
                    handles.append(m.register_forward_pre_hook(window_hook, with_kwargs=True))
            yield cache
        finally:
            for h in handles:
                h.remove()


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _scorer(cfg: DecodeConfig, model: torch.nn.Module) -> Any:
    """The scorer of ``cfg``, built by ``make_scorer`` from the model's (text) config, so
    scorers that undo RoPE get the model's RoPE base (scaled RoPE types are refused)."""
    return _layer_scorers(cfg, model)[0]


def _layer_scorers(cfg: DecodeConfig, model: torch.nn.Module) -> list[Any]:
    """One scorer per layer, built by ``make_scorer`` from the model's (text) config.

    Usually the same object for every layer. A config whose ``rope_parameters`` are given
    per layer type (Gemma 3: base 10000 on sliding layers, 1e6 on full ones) gets one scorer
    per layer type, each with its type's RoPE base (an explicit ``rope_theta`` wins).
    """
    from evictlab.methods import REGISTRY, make_scorer

    if cfg.scorer not in REGISTRY:
        raise InputError("--method", f"unknown scorer {cfg.scorer!r}", f"use one of {sorted(REGISTRY)}")
    config = _text_config(model)
    n = config.num_hidden_layers
    rp = getattr(config, "rope_parameters", None)
    types = list(getattr(config, "layer_types", None) or [])[:n]
    if (isinstance(rp, dict) and len(types) == n and "rope_theta" not in rp
            and all(isinstance(rp.get(t), dict) for t in types)):
        by_type = {t: make_scorer(cfg.scorer, SimpleNamespace(rope_parameters=rp[t]), **dict(cfg.scorer_params))
                   for t in dict.fromkeys(types)}
        return [by_type[t] for t in types]
    return [make_scorer(cfg.scorer, config, **dict(cfg.scorer_params))] * n


def _allocator(cfg: DecodeConfig) -> Callable[..., np.ndarray]:
    from evictlab.methods import ALLOCATORS

    if cfg.allocator not in ALLOCATORS:
        raise InputError("--allocator", f"unknown allocator {cfg.allocator!r}", f"use one of {sorted(ALLOCATORS)}")
    return ALLOCATORS[cfg.allocator]


class EvictionRunner:
    """Owns one store + cache for one batch of sequences and runs the protocol on it."""

    def __init__(self, model: torch.nn.Module, cfg: DecodeConfig, batch: int, *, capacity_tokens_per_cell: int,
                 total_tokens: int, scorer: Any = None, layer_scorers: list[Any] | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.batch = batch
        self.n_layers, self.q_heads, self.kv_heads, self.head_dim, self.dtype = model_geometry(model)
        #: per layer: the sliding window, or None (full attention)
        self.windows = layer_windows(model)
        self.device = next(model.parameters()).device
        self.scaling = float(self.head_dim) ** -0.5
        mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
        if mods:
            self.scaling = float(mods[0].scaling)
        if cfg.budget is None:
            raise InputError("--budget", "a budget is required in physical and masked modes", "pass --budget")
        self.budget_tokens = cfg.budget.total_tokens(self.n_layers, self.kv_heads, self.head_dim, self.dtype)
        cells = self.n_layers * self.kv_heads
        # A sliding cell never holds more than window - 1 entries after a compression.
        floor_total = self.kv_heads * sum(min(cfg.sinks + cfg.recent, total_tokens, w - 1 if w else total_tokens)
                                          for w in self.windows)
        if self.budget_tokens < floor_total:
            raise InputError("--budget", f"{self.budget_tokens} kept tokens per sequence is below the "
                             f"{floor_total} always-kept sinks + recent entries ({cells} cells)",
                             "raise the budget or lower --sinks/--recent")
        store: KVStore
        if cfg.mode == "physical":
            bs = cfg.block_size
            blocks = (math.ceil(self.budget_tokens * batch / bs) + cells * batch
                      + cells * batch * math.ceil(capacity_tokens_per_cell / bs))
            store = PagedKVStore(self.n_layers, batch, self.kv_heads, self.head_dim, capacity_blocks=blocks,
                                 block_size=bs, dtype=self.dtype, device=self.device)
        elif cfg.mode == "masked":
            store = MaskedKVStore(self.n_layers, batch, self.kv_heads, self.head_dim, dtype=self.dtype,
                                  device=self.device, initial_capacity=max(16, min(total_tokens, 1024)))
        else:
            raise InputError("mode", f"unknown mode {cfg.mode!r}", "use physical, masked or full")
        self.store = store
        if layer_scorers is None:
            layer_scorers = [scorer] * self.n_layers if scorer is not None else _layer_scorers(cfg, model)
        #: the scorer of each layer (one object for all layers unless RoPE differs by layer type)
        self.layer_scorers = list(layer_scorers)
        self.scorer = self.layer_scorers[0]
        #: True: the scorer gets every query since its previous call (consumed by each
        #: compression); False: the last ``cfg.window`` queries (a sliding window).
        self.all_queries = bool(getattr(self.scorer, "uses_all_queries", False))
        self.cache = EvictionCache(store)
        self.cache.query_window = None if self.all_queries else cfg.window
        self.allocate = _allocator(cfg)
        self.states: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.extra_queries: dict[int, torch.Tensor] | None = None
        self.compressions = 0

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

    def compress(self) -> None:
        """Drop out-of-window entries of sliding layers (:meth:`drop_out_of_window`), then
        bring every sequence down to ``budget_tokens`` kept entries (no-op if under)."""
        self.drop_out_of_window()
        if self.live_per_sequence() <= self.budget_tokens:
            return
        from evictlab.methods.base import ScoreInputs, select_keep

        rep = self.q_heads // self.kv_heads
        layer_scores: list[torch.Tensor] = []
        cell_pos: list[torch.Tensor] = []
        lengths = np.zeros((self.n_layers, self.kv_heads), dtype=np.int64)
        fill = -torch.finfo(torch.float32).max
        for l in range(self.n_layers):
            k, v, pos = self.store.gather(l)
            lens = self.store.lengths(l)
            if not bool((lens == lens[0:1]).all()):
                raise RuntimeError("cells of one KV head differ in length across the batch")
            lengths[l] = lens[0].numpy()
            rec = self.cache.take_queries(l, consume=self.all_queries)
            if rec is None:
                raise RuntimeError(f"no queries recorded for layer {l}; run a forward inside attach() first")
            q, qpos = rec
            sc = torch.full((self.batch, self.kv_heads, k.shape[2]), fill, dtype=torch.float32, device=k.device)
            for b in range(self.batch):
                for h in range(self.kv_heads):
                    n = int(lens[b, h])
                    extra = None
                    if self.extra_queries is not None:
                        extra = self.extra_queries[l][b:b + 1, h * rep:(h + 1) * rep]
                    inputs = ScoreInputs(
                        layer=l, n_layers=self.n_layers,
                        keys=k[b:b + 1, h:h + 1, :n], values=v[b:b + 1, h:h + 1, :n], positions=pos[b, h, :n],
                        queries=q[b:b + 1, h * rep:(h + 1) * rep], q_positions=qpos, scaling=self.scaling,
                        extra_queries=extra, state=self.states.setdefault((l, b, h), {}),
                    )
                    out = self.layer_scorers[l].score(inputs)
                    sc[b, h, :n] = out.reshape(-1).float()
            layer_scores.append(sc)
            cell_pos.append(pos)
        floor = self.cfg.sinks + self.cfg.recent
        sizes = np.asarray(self.allocate(layer_scores, self.budget_tokens, self.n_layers, self.kv_heads, floor=floor,
                                         lengths=lengths, **self.cfg.allocator_params), dtype=np.int64)
        if sizes.shape != lengths.shape or (sizes > lengths).any() or int(sizes.sum()) != self.budget_tokens:
            raise RuntimeError(f"allocator {self.cfg.allocator!r} returned sizes (sum {int(sizes.sum())}) that do not "
                               f"sum to the budget {self.budget_tokens} within the cells' lengths")
        for l in range(self.n_layers):
            keep: list[list[torch.Tensor]] = []
            for b in range(self.batch):
                row = []
                for h in range(self.kv_heads):
                    n = int(lengths[l, h])
                    sel = select_keep(layer_scores[l][b:b + 1, h:h + 1, :n], [int(sizes[l, h])], cell_pos[l][b, h, :n],
                                      sinks=self.cfg.sinks, recent=self.cfg.recent)
                    row.append(sel[0][0])
                keep.append(row)
            self.store.keep(l, keep)
        self.compressions += 1
        if self.live_per_sequence() > self.budget_tokens:
            raise BudgetExceededError(f"after compression {self.live_per_sequence()} entries are held per sequence, "
                                      f"above the budget of {self.budget_tokens}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """One forward of ``ids`` ``(batch, q_len)`` through the model with the cache; returns logits."""
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True)
        return out.logits

    def reconstruction_queries(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """KVzip-style: feed ``ids`` after the cache, record its queries, then drop its entries.

        ``ids`` is a reconstruction pass (KVzip: its "repeat" prompt, then context tokens
        again; see :func:`_recon_ids`), appended at positions after every held key; its
        post-RoPE queries are returned per layer ``(batch, q_heads, q_len, d)``, and the
        appended entries are removed again (:meth:`keep` on the physical store frees their
        blocks), so the pass leaves the cache and the position counter as they were.
        """
        saved_window = self.cache.query_window
        saved = dict(self.cache.queries)
        self.cache.queries.clear()
        self.cache.query_window = ids.shape[1]
        self.forward(ids)
        out = {l: self.cache.queries[l][0] for l in range(self.n_layers)}
        q_len = ids.shape[1]
        for l in range(self.n_layers):
            lens = self.store.lengths(l)
            keep = [[torch.arange(int(lens[b, h]) - q_len) for h in range(self.kv_heads)] for b in range(self.batch)]
            self.store.keep(l, keep)
            self.cache.layers[l].seen -= q_len
        if isinstance(self.store, MaskedKVStore):
            # Masked entries of a scoring pass are not part of the cache being audited.
            for l in range(self.n_layers):
                self.store.n[l] -= q_len
        self.cache.queries.clear()
        self.cache.queries.update(saved)
        self.cache.query_window = saved_window
        return out


def _oracle_queries(model: torch.nn.Module, ids: torch.Tensor, n_future: int, window: int) -> dict[int, torch.Tensor]:
    """True future queries (labelled oracle): the last ``n_future`` positions of a dense pass."""
    n_layers, _, hk, d, dtype = model_geometry(model)
    store = MaskedKVStore(n_layers, ids.shape[0], hk, d, dtype=dtype, device=ids.device, initial_capacity=ids.shape[1])
    cache = EvictionCache(store)
    cache.query_window = n_future
    with attach_model(model, cache):
        model(input_ids=ids, cache=cache, use_cache=True)
    return {l: cache.queries[l][0] for l in range(n_layers)}


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
) -> DecodeOutput:
    """Run the protocol on a batch and return the decode-phase logits and accounting.

    ``context_ids`` ``(batch, n)``, ``question_ids`` ``(batch, m)``, ``answer_ids``
    ``(batch, a)`` or None. With ``answer_ids`` the decode phase is teacher-forced over the
    answer (``T = a``); otherwise it is greedy for ``max_new_tokens`` steps. ``progress`` is
    called with the number of tokens processed after each forward. ``tokenizer`` is used
    only by scorers with a ``reconstruction_ids(chunk, tokenizer)`` method (KVzip: its
    "repeat the context" prompt before the chunk); ``None`` means the byte vocabulary of the
    tiny test models (ids = UTF-8 bytes), as in :func:`evictlab.decode.tasks.encode_text`.
    """
    t0 = time.perf_counter()
    rss0 = _rss()
    peak = rss0
    b, n = context_ids.shape
    m = question_ids.shape[1]
    T = answer_ids.shape[1] if answer_ids is not None else max_new_tokens
    if T <= 0:
        raise InputError("answer_ids", "nothing to decode", "pass answer_ids or max_new_tokens > 0")
    n_layers, _, hk, d, dtype = model_geometry(model)
    from evictlab.kv.budget import kv_bytes

    total = n + m + T
    # What a cache without eviction holds at the end: every entry on full-attention layers,
    # the last window - 1 on sliding ones (transformers' DynamicSlidingWindowLayer, used by
    # mode="full", keeps exactly that).
    held_full = sum(min(total, w - 1) if w else total for w in layer_windows(model))
    bytes_full = kv_bytes(held_full * hk * b, d, dtype)
    trace: list[StepTrace] = []
    logits_out: list[torch.Tensor] = []
    tokens_out: list[torch.Tensor] = []
    tick = progress or (lambda _k: None)

    if cfg.mode == "full":
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            for start in range(0, n, cfg.chunk_size):
                model(input_ids=context_ids[:, start:start + cfg.chunk_size], cache=cache, use_cache=True)
                tick(min(cfg.chunk_size, n - start))
            last = model(input_ids=question_ids, cache=cache, use_cache=True).logits[:, -1]
            tick(m)
            peak = max(peak, _rss())
            t_dec = time.perf_counter()
            for t in range(T):
                logits_out.append(last.float())
                tok = answer_ids[:, t] if answer_ids is not None else last.argmax(-1)
                tokens_out.append(tok)
                if t + 1 < T:
                    last = model(input_ids=tok[:, None], cache=cache, use_cache=True).logits[:, -1]
                peak = max(peak, _rss())
                tick(1)
        return DecodeOutput(torch.stack(logits_out, 1), torch.stack(tokens_out, 1), trace, None, bytes_full,
                            peak, time.perf_counter() - t0, 0, time.perf_counter() - t_dec)

    scorers = _layer_scorers(cfg, model)
    scorer = scorers[0]
    recon = "reconstruction" in getattr(scorer, "needs", frozenset())
    future = "future" in getattr(scorer, "needs", frozenset())
    prompt_len = 0
    if recon:
        _check_recon_tokenizer(model, scorer, tokenizer)
        prompt_len = _recon_ids(scorer, context_ids[:, :0], tokenizer).shape[1]
    # Headroom per cell between compressions: a prefill chunk (plus, during a reconstruction
    # pass, its prompt and a chunk again), or the question plus the decode steps before the
    # next compression.
    recon_head = cfg.chunk_size + prompt_len if recon else 0
    head = max(cfg.chunk_size + recon_head, m + cfg.compress_every + (cfg.chunk_size if cfg.query_aware else 0))
    runner = EvictionRunner(model, cfg, b, capacity_tokens_per_cell=head, total_tokens=total, layer_scorers=scorers)
    if future:
        if answer_ids is None:
            raise InputError("--method", "the oracle needs the true future tokens", "run it teacher-forced (with an answer)")
        full_ids = torch.cat([context_ids, question_ids, answer_ids], 1)
        with torch.no_grad():
            runner.extra_queries = _oracle_queries(model, full_ids, m + T, cfg.window)

    def note(phase: str) -> None:
        nonlocal peak
        r = _rss()
        peak = max(peak, r)
        trace.append(StepTrace(phase, runner.cache.seen, runner.store.bytes(), r))

    with torch.no_grad(), attach_model(model, runner.cache, runner.windows):
        # 1. Context, chunk by chunk, compressing as it goes.
        ctx = context_ids if not cfg.query_aware else torch.cat([context_ids, question_ids], 1)
        pending: list[torch.Tensor] = []  # chunks not yet reconstructed (KVzip)
        for start in range(0, ctx.shape[1], cfg.chunk_size):
            chunk = ctx[:, start:start + cfg.chunk_size]
            last = runner.forward(chunk)[:, -1]
            note("prefill")
            if recon:
                pending.append(chunk)
                if runner.live_per_sequence() > runner.budget_tokens:
                    # A compression follows: reconstruct every chunk fed since the last one,
                    # one pass (prompt + chunk) per chunk, as KVzip chunks long contexts.
                    passes = [runner.reconstruction_queries(_recon_ids(scorer, c, tokenizer)) for c in pending]
                    runner.extra_queries = {l: torch.cat([p[l] for p in passes], 2) for l in range(runner.n_layers)}
                    pending = []
            runner.compress()
            note("compress")
            tick(chunk.shape[1])
        if isinstance(runner.store, PagedKVStore):
            # Release the prefill headroom: the pool becomes the budget (plus one partial
            # page per cell) plus the decode headroom.
            cells = runner.n_layers * runner.kv_heads * b
            dec_head = (0 if cfg.query_aware else m) + cfg.compress_every
            if recon:  # a decode-time reconstruction pass: prompt + the last `window` tokens
                dec_head += cfg.window + prompt_len
            budget_blocks = math.ceil(runner.budget_tokens * b / cfg.block_size) + cells
            runner.store.resize(max(runner.store.blocks_in_use, budget_blocks) + cells * math.ceil(dec_head / cfg.block_size))
            note("resize")
        context_kept = [runner.store.gather(l)[2].cpu() for l in range(runner.n_layers)]
        # 2. The question, after the context was compressed (query-agnostic).
        if not cfg.query_aware:
            last = runner.forward(question_ids)[:, -1]
            note("question")
            tick(m)
        # 3. Decoding, compressing every `compress_every` steps.
        t_dec = time.perf_counter()
        for t in range(T):
            logits_out.append(last.float())
            tok = answer_ids[:, t] if answer_ids is not None else last.argmax(-1)
            tokens_out.append(tok)
            if t + 1 < T:
                last = runner.forward(tok[:, None])[:, -1]
                note("decode")
                if (t + 1) % cfg.compress_every == 0:
                    if recon:
                        recent_ids = tokens_out_tensor(tokens_out, cfg.window)
                        runner.extra_queries = runner.reconstruction_queries(_recon_ids(scorer, recent_ids, tokenizer))
                    runner.compress()
                    note("compress")
            tick(1)
    return DecodeOutput(torch.stack(logits_out, 1), torch.stack(tokens_out, 1), trace, runner.budget_tokens,
                        bytes_full, peak, time.perf_counter() - t0, runner.compressions, time.perf_counter() - t_dec,
                        context_kept)


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


def _check_recon_tokenizer(model: torch.nn.Module, scorer: Any, tokenizer: Any) -> None:
    """Without a tokenizer the reconstruction prompt is UTF-8 bytes: only right for a byte vocab."""
    if tokenizer is not None or getattr(scorer, "reconstruction_ids", None) is None:
        return
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "vocab_size", None) != 256:
        raise InputError("tokenizer", f"{getattr(scorer, 'name', 'the scorer')}'s reconstruction prompt needs the "
                         f"model's tokenizer (None means the 256-token byte vocabulary of the tiny test models, "
                         f"this model has {getattr(cfg, 'vocab_size', '?')} tokens)",
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
