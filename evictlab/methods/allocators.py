"""Allocators: small frozen dataclasses that turn per-cell scores and a budget into sizes.

A cell is one (layer, KV head). Every allocator is an :class:`~evictlab.methods.base.Allocator`
with validated parameters and one ``allocate(inputs: AllocInputs) -> sizes``, int64
``(n_layers, kv_heads)``, obeying the one allocation rule (checked by the decode loop with
:func:`~evictlab.methods.base.check_sizes`): the sizes sum exactly to ``inputs.target``
(the budget, or everything held when that is less) and ``floors <= sizes <= lengths`` in
every cell, where ``lengths`` are the entries each cell holds and ``floors`` the entries
:func:`~evictlab.methods.base.select_keep` always keeps (sinks + recency window, clipped).

Uniform and PyramidKV read only the lengths and floors; AdaKV and Global read the scores.
With ``batch > 1`` the scores are averaged over the batch, because the store keeps one size
per cell for the whole batch. Integer rounding is :func:`fit` (Sainte-Lague), shared by all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from evictlab.errors import InputError
from evictlab.methods.base import AllocInputs, Allocator, check_number

__all__ = ["AdaKV", "Global", "PyramidKV", "Uniform", "fit", "pyramid_weights"]


def fit(weights: np.ndarray, budget: int, floors: np.ndarray, caps: np.ndarray) -> np.ndarray:
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


@dataclass(frozen=True)
class Uniform(Allocator):
    """The same number of kept entries in every cell: ``budget / (n_layers * kv_heads)``.

    Every cell first gets its floor; the rest is shared equally, the remainder one entry
    each to the first cells (layer-major order); a cell shorter than its share keeps
    everything and its surplus is shared by the others. Reads only lengths and floors.
    """

    name: ClassVar[str] = "uniform"

    def allocate(self, inputs: AllocInputs) -> np.ndarray:
        # With equal floors, sharing the extra above the floor equally is the equal split.
        return fit(np.ones((inputs.n_layers, inputs.kv_heads)), inputs.target, inputs.floors, inputs.lengths)


@dataclass(frozen=True)
class PyramidKV(Allocator):
    """PyramidKV: more budget in lower layers, linearly decreasing with depth.

    Each cell keeps its floor; the extra ``E = target - total floor`` is split over layers in
    proportion to :func:`pyramid_weights` (``w_0 = 2 - 1/beta`` down to ``w_{L-1} = 1/beta``,
    mean 1), and within a layer equally over its KV heads, rounded by the Sainte-Lague
    divisor method (:func:`fit`; a capped cell's surplus goes to the others). ``beta >= 1``;
    ``beta = 1`` is uniform-above-floor. Reads only lengths and floors.
    """

    beta: float = 20.0
    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self) -> None:
        if check_number(self.beta, "beta") < 1:
            raise InputError("beta", f"{self.beta} < 1", "use beta >= 1 (20 in PyramidKV)")

    def allocate(self, inputs: AllocInputs) -> np.ndarray:
        w = np.repeat(pyramid_weights(inputs.n_layers, self.beta)[:, None], inputs.kv_heads, axis=1)
        return fit(w, inputs.target, inputs.floors, inputs.lengths)


@dataclass(frozen=True)
class AdaKV(Allocator):
    """AdaKV: within each layer, heads compete for the layer's budget by their scores.

    1. Layers get equal budgets ``B_l`` (as :class:`Uniform` at layer granularity).
    2. Safeguard: head ``h`` of layer ``l`` first gets ``s_h = min(len_h, max(floor_h,
       floor(alpha * B_l / hk)))`` slots, taken by its own top-``s_h`` scores.
    3. The remaining ``B_l - sum_h s_h`` slots go to the layer's highest scores among all
       heads' non-safeguarded keys (one global top-k over the layer); a head's size is its
       safeguard plus its count in that top-k.

    This is AdaKV (Feng et al., 2024) with ``alpha`` its safeguard fraction (0.2 there).
    Scores must be comparable across heads (attention probabilities are). Ties go to the
    later key, then the lower head. The floor counts the head's top scores, not literally its
    sink/recent keys, because sizes are exact and the choice of keys is
    :func:`~evictlab.methods.base.select_keep`'s.
    """

    alpha: float = 0.2
    name: ClassVar[str] = "adakv"

    def __post_init__(self) -> None:
        if not 0.0 <= check_number(self.alpha, "alpha") <= 1.0:
            raise InputError("alpha", f"{self.alpha} is outside [0, 1]", "use a fraction, e.g. 0.2")

    def allocate(self, inputs: AllocInputs) -> np.ndarray:
        layers = inputs.layer_scores()
        floors, lengths, kv_heads = inputs.floors, inputs.lengths, inputs.kv_heads
        layer_budget = fit(np.ones((inputs.n_layers, 1)), inputs.target, floors.sum(1, keepdims=True),
                           lengths.sum(1, keepdims=True))[:, 0]
        sizes = np.zeros((inputs.n_layers, kv_heads), dtype=np.int64)
        for l, sc in enumerate(layers):
            b_l = int(layer_budget[l])
            safe = np.minimum(lengths[l], np.maximum(floors[l], int(self.alpha * b_l / kv_heads)))
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


@dataclass(frozen=True)
class Global(Allocator):
    """DBTrimKV's single global budget: one ranking of every held entry of every cell.

    The kept set, built entry by entry (``target`` entries in all):

    1. every cell's always-kept entries: its sinks and recency window when the inputs name
       them (``AllocInputs.sinks``/``recent``, as the decode loop does), else its floor
       counted as the cell's top scores (hand-made inputs, AdaKV's convention);
    2. each cell topped up to ``min_per_head`` entries (clipped to its length) with its
       best other entries;
    3. the remaining ``target - (1 + 2)`` slots: the highest scores among all other entries
       of all layers and KV heads, in one ranking.

    A cell's size is its count in that set, so per-head lengths vary freely; with the
    sizes, :func:`~evictlab.methods.base.select_keep` keeps exactly that set (it keeps the
    same always-kept entries and orders the rest of a cell the same way). Order of the
    ranking: higher score, then the more recent entry (larger position; the index when the
    inputs carry no positions), then the lower cell (layer-major). ``min_per_head = 0``
    (default) is the pure global ranking; a total of ``min_per_head`` over cells above the
    budget is an :class:`InputError`.

    The scores must be comparable across layers and heads: TrimKV's ``(t - i) log beta``
    from gates with a shared final projection is (that is its design); attention
    probabilities are not in general (each layer's softmax has its own temperature and
    entropy). See docs/methods.md for the list.
    """

    min_per_head: int = 0
    name: ClassVar[str] = "global"

    def __post_init__(self) -> None:
        if isinstance(self.min_per_head, bool) or not isinstance(self.min_per_head, int) or self.min_per_head < 0:
            raise InputError("min_per_head", f"{self.min_per_head!r} is not an integer >= 0",
                             "use 0 (pure global ranking) or a per-head minimum")

    def allocate(self, inputs: AllocInputs) -> np.ndarray:
        layers = inputs.layer_scores()
        lengths = inputs.lengths
        n_layers, kv_heads = lengths.shape
        known = inputs.sinks is not None and inputs.recent is not None
        forced = np.minimum(lengths, int(inputs.sinks) + int(inputs.recent)) if known else np.zeros_like(lengths)
        base = np.maximum(np.maximum(inputs.floors, forced), np.minimum(self.min_per_head, lengths))
        if int(base.sum()) > inputs.target:
            raise InputError("allocator_param", f"global parameter min_per_head={self.min_per_head}: the per-head "
                             f"minimum and always-kept entries need {int(base.sum())} entries, the budget is "
                             f"{inputs.target}", "lower min_per_head or raise the budget")
        cand_score, cand_pos, cand_cell = [], [], []
        for l, sc in enumerate(layers):
            pos_l = None if inputs.positions is None else inputs.positions[l][0].to("cpu").numpy()
            for h in range(kv_heads):
                n = int(lengths[l, h])
                idx = np.arange(n)
                pos = idx if pos_l is None else pos_l[h, :n]
                free = np.ones(n, dtype=bool)
                if known:  # the first `sinks` and last `recent` entries are kept whatever their scores
                    lo = min(int(inputs.sinks), n)
                    free = (idx >= lo) & (idx < max(lo, n - int(inputs.recent)))
                order = idx[free][np.lexsort((-pos[free], -sc[h, :n][free]))]  # best first
                rest = order[int(base[l, h] - forced[l, h]):]
                cand_score.append(sc[h, rest])
                cand_pos.append(pos[rest])
                cand_cell.append(np.full(rest.size, l * kv_heads + h))
        score, pos, cell = (np.concatenate(x) if x else np.zeros(0) for x in (cand_score, cand_pos, cand_cell))
        winners = np.lexsort((cell, -pos, -score))[: inputs.target - int(base.sum())]
        extra = np.bincount(cell[winners].astype(np.int64), minlength=n_layers * kv_heads)
        return (base + extra.reshape(n_layers, kv_heads)).astype(np.int64)
