"""The evicting engine of the decode loop and its compression step.

:class:`EvictionRunner` holds one store (paged or masked) and its cache for a batch of
sequences; :meth:`EvictionRunner.compress` is the compression step: drop the out-of-window
entries of sliding layers, score every cell, let the allocator turn the budget into
per-cell sizes (:func:`~evictlab.methods.base.check_sizes` on the way out), select the kept
entries and evict the rest. The driver that calls its hooks is :mod:`evictlab.decode.loop`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from evictlab.decode.config import DecodeConfig
from evictlab.decode.extras import check_recon_tokenizer, recon_ids, tokens_out_tensor
from evictlab.errors import BudgetExceededError, InputError
from evictlab.kv.base import KVStore
from evictlab.kv.budget import ByteReport
from evictlab.kv.cache import EvictionCache, attach
from evictlab.kv.masked import MaskedKVStore
from evictlab.kv.paged import PagedKVStore
from evictlab.methods.base import AllocInputs, Phase, WindowProfile, check_sizes
from evictlab.models.geometry import model_geometry


#: Most tokens one model forward of the evicting engine processes (see ``EvictionRunner.forward``).
FORWARD_TOKENS = 1024


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


@dataclass(frozen=True)
class _Scored:
    """One compression's scoring of every cell (what the allocator and ``select_keep`` read):
    per layer the scores ``(batch, kv_heads, S_l)`` (float32 minimum past a cell's length)
    and the held positions ``(batch, kv_heads, S_l)``; the held lengths ``(n_layers,
    kv_heads)``; the observation window's profile (ContourKV online) or None; per layer the
    observation window's queries ``(batch, q_heads, w, d)`` and positions ``(w,)`` (for the
    window statistics and the trace)."""

    scores: tuple[torch.Tensor, ...]
    lengths: np.ndarray
    positions: tuple[torch.Tensor, ...]
    window: WindowProfile | None
    windows_q: list[tuple[torch.Tensor, torch.Tensor]]


class EvictionRunner:
    """The evicting engine: one store + cache for one batch of sequences, compressed to the
    budget by the scorer and the allocator.

    ``headroom_tokens_per_cell``: entries a cell may gain between compressions during the
    prefill (the store's initial headroom); ``total_tokens``: tokens the run feeds (clips
    the always-kept floor); ``max_cell_tokens``: per layer, the most entries one cell can
    ever hold (caps the paged pool; None = no cap); ``tokenizer``: for a reconstruction
    scorer's prompt (see :func:`run_sequence`); ``cache``: an unbound
    :class:`EvictionCache` to hold the store (the one a user handed to ``model.generate``,
    :mod:`evictlab.api`), else a new one.
    """

    def __init__(self, model: torch.nn.Module, cfg: DecodeConfig, batch: int, *, headroom_tokens_per_cell: int,
                 total_tokens: int, max_cell_tokens: list[int] | None = None, tokenizer: Any = None,
                 decode_headroom_tokens_per_cell: int | None = None, cache: EvictionCache | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.loop = cfg.loop
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
                                            max_cell_tokens=max_cell_tokens, block_size=cfg.loop.block_size,
                                            device=self.device)
        elif cfg.mode == "masked":
            cap = max(max_cell_tokens) if max_cell_tokens else min(total_tokens, 1024)
            store = MaskedKVStore(g.n_layers, batch, g.kv_heads, g.head_dim, dtype=g.dtype, device=self.device,
                                  initial_capacity=max(16, cap))
        else:
            raise InputError("mode", f"mode {cfg.mode!r} does not evict", "use physical or masked")
        self.store = store
        assert cfg.method is not None  # DecodeConfig refuses an evicting mode without one
        #: the method bound to this model (built once per config, bound once per geometry;
        #: the allocator has checked the model, e.g. refused a profile of another geometry)
        self.method = cfg.method.for_model(g)
        #: the scorer of each layer (one object for all layers unless RoPE differs by layer type)
        self.layer_scorers = list(self.method.layer_scorers)
        self.scorer = self.layer_scorers[0]
        self.allocator = self.method.allocator
        #: per-compression diagnostics (:class:`evictlab.decode.trace.CompressionTrace`), or None
        self.compression_trace: Any = None
        #: True: the scorer gets every query since its previous call (consumed by each
        #: compression); False: the last ``cfg.window`` queries (a sliding window).
        self.all_queries = self.method.all_queries
        #: the cache the model is called with: a new one, or ``cache`` (unbound, see
        #: :meth:`EvictionCache.bind`), which now holds this store
        self.cache = EvictionCache(store) if cache is None else cache.bind(store)
        self.cache.query_window = None if self.all_queries else cfg.loop.window
        self.states: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.extra_queries: dict[int, torch.Tensor] | None = None
        self.compressions = 0
        #: KVzip-style: reconstruction passes before each compression
        self.recon = self.method.reconstruction
        self.tokenizer = tokenizer
        if self.recon:
            check_recon_tokenizer(g, self.scorer, tokenizer)
        self._pending: list[torch.Tensor] = []  # chunks fed since the last reconstruction
        self.decode_headroom = decode_headroom_tokens_per_cell
        #: per layer, the kept positions right after the context (see DecodeOutput)
        self.context_kept: list[torch.Tensor] = []
        #: the first compression's scoring, shared by the arms of one prefilled context
        #: (:meth:`inject_context`; a dict owned by :class:`evictlab.decode.shared.SharedContext`)
        self.shared_scores: dict[Any, Any] | None = None

    # -- engine hooks (see _drive) ------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """The cache's hooks, then each scorer's own (``Scorer.attach``: TrimKV's gates)."""
        with attach_model(self.model, self.cache, self.windows), contextlib.ExitStack() as stack:
            for scorer in self.method.distinct_scorers():
                stack.enter_context(scorer.attach(self.model, self.cache))
            yield

    def forward(self, ids: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Feed ``ids`` ``(batch, q_len)`` through the model with the cache; returns the last
        ``keep`` positions' logits ``(batch, keep, vocab)`` (of the last piece).

        Inputs longer than :data:`FORWARD_TOKENS` go through the model in consecutive pieces
        of that many tokens with nothing evicted in between: the same attention (every piece
        attends to everything before it), so the same logits up to float rounding, with the
        model's activations bounded by one piece whatever the chunk (a one-pass prefill
        holds the whole context's K/V, never its whole activations). Compressions happen
        only where the protocol says (after ``chunk_size`` tokens)."""
        out = None
        for start in range(0, ids.shape[1], FORWARD_TOKENS):
            piece = ids[:, start:start + FORWARD_TOKENS]
            out = self.model(input_ids=piece, cache=self.cache, use_cache=True,
                             logits_to_keep=min(keep, piece.shape[1]))
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
            shared = self._share_key()
            if shared is not None and shared in self.shared_scores:
                # Another arm's scoring already saw this context's reconstruction: skip the
                # pass, but account for the index it would have grown (its entries are
                # discarded after the pass; the block table keeps its width).
                prompt = recon_ids(self.scorer, self._pending[0][:, :0], self.tokenizer).shape[1]
                held = max(int(self.store.lengths(l).max()) for l in range(self.n_layers))
                self.store.reserve_index(held + max(prompt + c.shape[1] for c in self._pending))
                self._pending = []
            elif self.live_per_sequence() > self.budget_tokens:
                # A compression follows: reconstruct every chunk fed since the last one,
                # one pass (prompt + chunk) per chunk, as KVzip chunks long contexts.
                passes = [self.reconstruction_queries(recon_ids(self.scorer, c, self.tokenizer))
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

    def inject_context(self, context: Any) -> None:
        """Hold a prefilled context (:class:`evictlab.decode.shared.SharedContext`) as if its
        tokens had just been fed in one chunk: every cell gets the context's keys and values
        (sliding layers too: their out-of-window entries are dropped by the compression that
        follows, as after a one-pass prefill), the layers' positions move past it, the
        queries are recorded as the forward would have recorded them (all of them, or the
        last ``window``), and scorers that read every forward (TrimKV's gates) get the
        context's hidden states. Then the driver calls
        :meth:`after_chunk` as after a one-pass prefill; its scoring is shared with the other
        arms of the same context (:attr:`shared_scores`)."""
        n = context.length
        for l in range(self.n_layers):
            k, v, pos = context.kv(l)
            self.store.append(l, k, v, pos)
            self.cache.layers[l].seen = n
            if self.cache.recording:
                q, qpos = context.queries(l, None if self.all_queries else self.loop.window)
                self.cache.record_queries(l, q, qpos)
        for scorer in self.method.distinct_scorers():
            scorer.record_context(self.model, self.cache, context.hidden_states())
        self.shared_scores = context.scores

    def snapshot(self) -> Any:
        """The run's state after the context (store, positions, recorded queries, scorer
        states): :meth:`restore` returns to it, so several questions can each be answered
        from their own copy of one compressed cache."""
        import copy

        return (self.store.clone(), [layer.seen for layer in self.cache.layers], dict(self.cache.queries),
                copy.deepcopy(self.states), self.compressions, self.extra_queries)

    def restore(self, snap: Any) -> None:
        """Return to a :meth:`snapshot` (the snapshot stays reusable)."""
        import copy

        store, seen, queries, states, compressions, extra = snap
        self.store = store.clone()
        self.cache.store = self.store
        for layer, s in zip(self.cache.layers, seen):
            layer.store = self.store
            layer.seen = s
        self.cache.queries.clear()
        self.cache.queries.update(queries)
        self.states = copy.deepcopy(states)
        self.compressions = compressions
        self.extra_queries = extra

    def after_decode_step(self, step: int, tokens: list[torch.Tensor]) -> str | None:
        """Every ``compress_every`` decode steps: (a reconstruction pass over the last
        ``window`` tokens, for KVzip) then compress."""
        if step % self.loop.compress_every:
            return None
        if self.recon:
            recent_ids = tokens_out_tensor(tokens, self.loop.window)
            self.extra_queries = self.reconstruction_queries(recon_ids(self.scorer, recent_ids, self.tokenizer))
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
        from evictlab.methods.base import select_keep_ordered

        sc = self._scored()
        lengths = sc.lengths
        g = self.geometry
        alloc_inputs = AllocInputs(
            sc.scores, lengths, np.minimum(self.floors, lengths), tuple(self.windows), self.budget_tokens,
            phase=phase, positions=sc.positions, next_position=self.cache.seen, head_dim=g.head_dim,
            dtype_bytes=g.dtype_bytes, geometry=g, sinks=self.loop.sinks, recent=self.loop.recent,
            window=sc.window)
        sizes = check_sizes(alloc_inputs, self.allocator.allocate(alloc_inputs), f"allocator {self.method.allocator_name!r}")
        sinks, recent = self.loop.sinks, self.loop.recent
        for l in range(self.n_layers):
            layer_scores = sc.scores[l]
            # Cells hold their entries in position order (a store invariant), so the kept
            # entries follow from scores alone; cells of equal length go in one call.
            if (lengths[l] == lengths[l, 0]).all():
                keep = select_keep_ordered(layer_scores[:, :, :int(lengths[l, 0])], sizes[l], sinks=sinks,
                                           recent=recent)
            else:
                keep = [[select_keep_ordered(layer_scores[b:b + 1, h:h + 1, :int(lengths[l, h])], [int(sizes[l, h])],
                                             sinks=sinks, recent=recent)[0][0] for h in range(self.kv_heads)]
                        for b in range(self.batch)]
            if self.compression_trace is not None:
                k, v, pos = self.store.gather(l)
                self.compression_trace.record(self.compressions, phase, self.cache.seen, l, k, v, pos, lengths[l], keep,
                                              *sc.windows_q[l], self.scaling)
            self.store.keep(l, keep)
        self.compressions += 1
        if self.live_per_sequence() > self.budget_tokens:
            raise BudgetExceededError(f"after compression {self.live_per_sequence()} entries are held per sequence, "
                                      f"above the budget of {self.budget_tokens}")

    def _share_key(self) -> tuple[Any, ...] | None:
        """The key under which this compression's scoring is shared with other arms of the
        same prefilled context (:attr:`shared_scores`), or None when it is not shareable:
        only the first compression of a run that was handed a prefilled context, whose
        inputs (held entries, recorded queries, reconstruction pass) depend only on that
        context and the scorer, not on the allocator, the budget or the store. The window
        statistics an allocator asks for are not part of the key: they are computed from
        the shared scoring on demand and shared under keys of their own (:meth:`_scored`),
        so the ContourKV variants of one scorer share its scoring and its reconstruction
        pass with the scorer's other arms."""
        if self.shared_scores is None or self.compressions or self.method.question_specific:
            return None  # (the ORACLEs' inputs are each question's own)
        return (tuple(repr(s) for s in self.layer_scorers), self.all_queries, self.loop.window,
                self.compression_trace is not None, self.batch, self.loop.sinks, self.loop.recent)

    def _scored(self) -> _Scored:
        """Every cell's scores at this compression, with the window statistics the
        allocator needs (shared between arms when :meth:`_share_key` allows: the scorers'
        states are copied, never shared).

        Shared, the ranked statistics are computed once per scoring with the forced-error
        curve included (the same prefix sums; the dropped-mass curve is the same bits
        either way), and an arm that does not ask for a statistic does not get it."""
        import copy

        profile, ranked_on, error_on = (self.method.window_profile, self.method.window_ranked,
                                        self.method.window_error)
        key = self._share_key()
        if key is not None and key in self.shared_scores:
            sc, states = self.shared_scores[key]
            self.states = copy.deepcopy(states)
            for l in range(self.n_layers):  # consume the queries as scoring them would have
                self.cache.take_queries(l, consume=self.all_queries)
        else:
            sc = self._score_cells()
            if key is not None:
                self.shared_scores[key] = (sc, copy.deepcopy(self.states))
        if not profile:
            return sc
        if key is None:
            window = self._window_profile(sc, ranked_on, error_on)
        else:
            wkey = (key, "window", ranked_on)
            if wkey not in self.shared_scores:
                self.shared_scores[wkey] = self._window_profile(sc, ranked_on, ranked_on)
            window = self.shared_scores[wkey]
            if window.error is not None and not error_on:
                window = replace(window, error=None)
        return replace(sc, window=window)

    def _score_cells(self) -> _Scored:
        """Score every held entry of every cell with the layer's scorer (module docstring);
        the window statistics are :meth:`_window_profile`'s (``window`` is None here)."""
        from evictlab.methods.base import ScoreInputs

        rep = self.q_heads // self.kv_heads
        layer_scores: list[torch.Tensor] = []
        cell_pos: list[torch.Tensor] = []
        lengths = np.zeros((self.n_layers, self.kv_heads), dtype=np.int64)
        fill = -torch.finfo(torch.float32).max
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
            # The observation window (the scorers' last `window` queries): for the window
            # statistics (ContourKV online) and the trace. Views, nothing computed.
            windows_q.append((q[:, :, -self.loop.window:], qpos[-self.loop.window:]))
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
            scorer = self.layer_scorers[l]
            outs = scorer.score_cells(inputs)  # the same scores as score() per cell, maybe in fewer calls
            for i, out in enumerate(outs):
                b, h = divmod(i, self.kv_heads)
                sc[b, h, :int(lens[b, h])] = out.reshape(-1).float()
            layer_scores.append(sc)
            cell_pos.append(pos)
        return _Scored(tuple(layer_scores), lengths, tuple(cell_pos), None, windows_q)

    def _window_profile(self, sc: _Scored, ranked_on: bool, error_on: bool) -> WindowProfile:
        """The observation window's statistics of every held cell (:class:`WindowProfile`):
        the per-query tails and entropies always; along the scorer's keep order of ``sc``
        the dropped mass with ``ranked_on`` and the forced error with ``error_on``. Reads
        the cells as :meth:`_score_cells` saw them (nothing is evicted in between)."""
        from evictlab.contour.profile import ranked_window_stats, window_stats
        from evictlab.methods.base import keep_order

        rep = self.q_heads // self.kv_heads
        tails: list[np.ndarray] = []
        ranked: list[np.ndarray] = []
        errors: list[np.ndarray] = []
        entropy = np.zeros((self.batch, self.n_layers, self.kv_heads))
        for l in range(self.n_layers):
            cells, pos = self.store.live_cells(l)
            lens = self.store.lengths(l)
            obs_q, obs_pos = sc.windows_q[l]
            width = pos.shape[2] + 1
            tails.append(np.zeros((self.batch, self.kv_heads, width)))
            ranked.append(np.zeros((self.batch, self.kv_heads, width)))
            errors.append(np.zeros((self.batch, self.kv_heads, width)))
            for b in range(self.batch):
                for h in range(self.kv_heads):
                    n = int(lens[b, h])
                    cell = cells[b][h]
                    group_q = obs_q[b, h * rep:(h + 1) * rep]
                    tails[l][b, h, :n + 1], entropy[b, l, h] = window_stats(
                        group_q, cell.k, self.scaling, obs_pos, cell.pos)
                    if ranked_on:  # the window's statistics along the order select_keep keeps
                        order = keep_order(sc.scores[l][b, h, :n], sinks=self.loop.sinks, recent=self.loop.recent)
                        d, e = ranked_window_stats(group_q, cell.k, cell.v if error_on else None,
                                                   self.scaling, obs_pos, cell.pos, order)
                        ranked[l][b, h, :n + 1] = d
                        if e is not None:
                            errors[l][b, h, :n + 1] = e
        return WindowProfile(tuple(tails), entropy, tuple(ranked) if ranked_on else None,
                             tuple(errors) if error_on else None)

    def reconstruction_queries(self, ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """KVzip-style: feed ``ids`` after the cache, record its queries, then drop its entries.

        ``ids`` is a reconstruction pass (KVzip: its "repeat" prompt, then context tokens
        again; see :func:`recon_ids`), appended at positions after every held key; its
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
