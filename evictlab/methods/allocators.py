"""Allocators: pure functions from per-cell statistics and a budget to per-cell sizes.

A cell is one (layer, KV head). Every allocator has the signature

    allocate(cell_scores, budget_tokens, n_layers, kv_heads, *, floor, **params)
        -> np.ndarray int64 (n_layers, kv_heads)

and guarantees, for a feasible budget, ``sizes.sum() == budget_tokens`` and
``min(floor, length_c) <= sizes[c] <= length_c`` where ``length_c`` is the number of keys the
cell holds: the last axis of its scores, or ``lengths[l, h]`` when the caller passes
``lengths=`` (int ``(n_layers, kv_heads)``; then only the first ``lengths[l, h]`` entries of a
cell's scores are real, the rest padding, as the decode loop pads ragged heads). ``floor``
is the keys :func:`select_keep` always keeps (sinks + recency window). Budgets below the
total floor or above the total length raise :class:`InputError`.

``cell_scores`` is a list of ``n_layers`` tensors ``(b, hk, s_l)`` or ``(hk, s_l)`` (layers may
hold different lengths), or one array ``(n_layers, hk, s)``. Uniform and PyramidKV read only
its shape (the lengths); AdaKV reads the values. With ``b > 1`` the scores are averaged over
the batch, because the store keeps one size per cell for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from evictlab.errors import InputError

__all__ = ["adakv", "pyramidkv", "uniform", "cell_lengths"]

CellScores = Sequence[torch.Tensor] | Sequence[np.ndarray] | np.ndarray


def _as_layer_arrays(cell_scores: CellScores, n_layers: int, kv_heads: int) -> list[np.ndarray]:
    """Normalise to ``n_layers`` float64 arrays ``(kv_heads, s_l)`` (batch-averaged)."""
    layers = [cell_scores[i] for i in range(len(cell_scores))]
    if len(layers) != n_layers:
        raise InputError("cell_scores", f"{len(layers)} layers given, n_layers={n_layers}",
                         "pass one score tensor per layer")
    out = []
    for i, x in enumerate(layers):
        a = x.detach().to("cpu", torch.float64).numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)
        if a.ndim == 3:
            a = a.mean(axis=0)
        if a.ndim != 2 or a.shape[0] != kv_heads:
            raise InputError(f"cell_scores[{i}]", f"shape {a.shape}, expected (batch, {kv_heads}, seq) "
                             f"or ({kv_heads}, seq)", "pass per-KV-head scores (combine GQA groups first)")
        if np.isnan(a).any():
            raise InputError(f"cell_scores[{i}]", "contains NaN", "fix the scorer")
        out.append(a)
    return out


def cell_lengths(cell_scores: CellScores, n_layers: int, kv_heads: int) -> np.ndarray:
    """int64 ``(n_layers, kv_heads)`` available keys per cell (the scores' last axis)."""
    layers = _as_layer_arrays(cell_scores, n_layers, kv_heads)
    return np.array([[a.shape[1]] * kv_heads for a in layers], dtype=np.int64)


def _check_budget(budget: int, floors: np.ndarray, lengths: np.ndarray, floor: int) -> None:
    if budget < floors.sum():
        raise InputError("budget_tokens", f"{budget} is below the total floor {int(floors.sum())} "
                         f"({floors.size} cells x min(floor={floor}, length))",
                         "raise the budget or lower sinks/recent")
    if budget > lengths.sum():
        raise InputError("budget_tokens", f"{budget} is above the {int(lengths.sum())} keys held",
                         "use a budget at most the cache size (or skip compression)")


def _fit(weights: np.ndarray, budget: int, floors: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Integer sizes ``floors + extra`` summing to ``budget``, extra proportional to weights.

    The extra ``E = budget - floors.sum()`` tokens are apportioned by the Sainte-Lague
    (Webster) divisor method: the ``k``-th extra token of cell ``c`` has priority
    ``w_c / (k + 0.5)`` and the ``E`` highest priorities win (ties: lower flat cell index,
    then lower ``k``), with at most ``caps_c - floors_c`` tokens per cell. A capped cell's
    surplus therefore goes to the others, and since the winners for ``E + 1`` contain those
    for ``E``, no cell ever shrinks when the budget grows (no Alabama paradox, unlike
    largest-remainder rounding). One candidate per held key: cheap next to the keys.
    """
    w = np.maximum(weights.astype(np.float64).ravel(), 0.0)
    lo = floors.astype(np.int64).ravel()
    room = caps.astype(np.int64).ravel() - lo
    extra = int(budget - lo.sum())
    cell = np.repeat(np.arange(w.size), room)
    k = np.arange(cell.size) - np.repeat(np.cumsum(room) - room, room)  # 0..room_c-1 per cell
    prio = w[cell] / (k + 0.5)
    winners = np.lexsort((k, cell, -prio))[:extra]
    return (lo + np.bincount(cell[winners], minlength=w.size)).reshape(weights.shape)


def _floors_lengths(
    cell_scores: CellScores, n_layers: int, kv_heads: int, floor: int, lengths: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """Per-cell floors ``min(floor, length)`` and lengths, both int64 ``(n_layers, kv_heads)``."""
    if floor < 0:
        raise InputError("floor", f"{floor} is negative", "pass sinks + recent >= 0")
    full = cell_lengths(cell_scores, n_layers, kv_heads)
    if lengths is None:
        lengths = full
    else:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.shape != full.shape or (lengths < 0).any() or (lengths > full).any():
            raise InputError("lengths", f"shape {lengths.shape} or values outside [0, score length]",
                             f"pass int ({n_layers}, {kv_heads}) lengths no longer than each cell's scores")
    return np.minimum(floor, lengths), lengths


def uniform(
    cell_scores: CellScores, budget_tokens: int, n_layers: int, kv_heads: int, *, floor: int,
    lengths: np.ndarray | None = None,
) -> np.ndarray:
    """The same number of kept tokens in every cell: ``budget / (n_layers * kv_heads)``.

    Every cell first gets ``min(floor, length)``; the rest is shared equally, the remainder
    one token each to the first cells (layer-major order); a cell shorter than its share
    keeps everything and its surplus is shared by the others. Reads only the scores' shape.
    """
    floors, lengths = _floors_lengths(cell_scores, n_layers, kv_heads, floor, lengths)
    _check_budget(budget_tokens, floors, lengths, floor)
    # With equal floors, sharing the extra above the floor equally is the equal split.
    return _fit(np.ones((n_layers, kv_heads)), budget_tokens, floors, lengths)


def pyramid_weights(n_layers: int, beta: float) -> np.ndarray:
    """PyramidKV's per-layer shares, mean 1, decreasing linearly with depth.

    Layer 0 gets ``2 - 1/beta``, the last layer ``1/beta``; in between linearly. So a layer's
    extra budget is ``a * w_l`` with ``a`` the average, the PyramidKV schedule
    ``max = 2a - a/beta``, ``min = a/beta`` (Cai et al., 2024, with ``beta=20`` by default).
    """
    if n_layers == 1:
        return np.ones(1)
    lo, hi = 1.0 / beta, 2.0 - 1.0 / beta
    return hi - (hi - lo) * np.arange(n_layers) / (n_layers - 1)


def pyramidkv(
    cell_scores: CellScores, budget_tokens: int, n_layers: int, kv_heads: int, *, floor: int, beta: float = 20.0,
    lengths: np.ndarray | None = None,
) -> np.ndarray:
    """PyramidKV: more budget in lower layers, linearly decreasing with depth.

    Each cell keeps its floor; the extra ``E = budget - total floor`` is split over layers in
    proportion to :func:`pyramid_weights` (``w_0 = 2 - 1/beta`` down to ``w_{L-1} = 1/beta``,
    mean 1), and within a layer equally over its KV heads, rounded by the Sainte-Lague
    divisor method (:func:`_fit`; a capped cell's surplus goes to the others). ``beta >= 1``;
    ``beta = 1`` is uniform-above-floor. Reads only shapes.
    """
    if beta < 1:
        raise InputError("beta", f"{beta} < 1", "use beta >= 1 (20 in PyramidKV)")
    floors, lengths = _floors_lengths(cell_scores, n_layers, kv_heads, floor, lengths)
    _check_budget(budget_tokens, floors, lengths, floor)
    w = np.repeat(pyramid_weights(n_layers, beta)[:, None], kv_heads, axis=1)
    return _fit(w, budget_tokens, floors, lengths)


def adakv(
    cell_scores: CellScores, budget_tokens: int, n_layers: int, kv_heads: int, *, floor: int, alpha: float = 0.2,
    lengths: np.ndarray | None = None,
) -> np.ndarray:
    """AdaKV: within each layer, heads compete for the layer's budget by their scores.

    1. Layers get equal budgets ``B_l`` (as :func:`uniform` at layer granularity).
    2. Safeguard: head ``h`` of layer ``l`` first gets ``s_h = min(len_h, max(floor_h,
       floor(alpha * B_l / hk)))`` slots, taken by its own top-``s_h`` scores.
    3. The remaining ``B_l - sum_h s_h`` slots go to the layer's highest scores among all
       heads' non-safeguarded keys (one global top-k over the layer); a head's size is its
       safeguard plus its count in that top-k.

    This is AdaKV (Feng et al., 2024) with ``alpha`` its safeguard fraction (0.2 there).
    Scores must be comparable across heads (attention probabilities are). Ties go to the
    later key, then the lower head. The floor counts the head's top scores, not literally its
    sink/recent keys, because an allocator sees no positions: sizes are exact, the choice of
    keys is :func:`select_keep`'s.
    """
    if not 0.0 <= alpha <= 1.0:
        raise InputError("alpha", f"{alpha} is outside [0, 1]", "use a fraction, e.g. 0.2")
    layers = _as_layer_arrays(cell_scores, n_layers, kv_heads)
    floors, lengths = _floors_lengths(cell_scores, n_layers, kv_heads, floor, lengths)
    _check_budget(budget_tokens, floors, lengths, floor)
    layer_budget = _fit(np.ones((n_layers, 1)), budget_tokens, floors.sum(1, keepdims=True),
                        lengths.sum(1, keepdims=True))[:, 0]
    sizes = np.zeros((n_layers, kv_heads), dtype=np.int64)
    for l, sc in enumerate(layers):
        b_l = int(layer_budget[l])
        safe = np.minimum(lengths[l], np.maximum(floors[l], int(alpha * b_l / kv_heads)))
        seq = sc.shape[1]
        valid = np.arange(seq)[None, :] < lengths[l][:, None]  # padding past a head's length
        sc = np.where(valid, sc, -np.inf)
        # Per head, rank keys by (score desc, later first); the first safe[h] are reserved.
        rank_order = np.lexsort((-np.arange(seq)[None, :].repeat(kv_heads, 0), -sc), axis=1)
        open_mask = valid.copy()
        for h in range(kv_heads):
            open_mask[h, rank_order[h, : safe[h]]] = False
        rest = b_l - int(safe.sum())
        heads, keys = np.nonzero(open_mask)
        vals = sc[heads, keys]
        # Global top-`rest`: score desc, then later key, then lower head.
        order = np.lexsort((heads, -keys, -vals))[:rest]
        sizes[l] = safe + np.bincount(heads[order], minlength=kv_heads)
    return sizes
