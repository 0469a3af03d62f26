"""The contract between eviction methods and the KV store / decode loop.

A *scorer* looks at one layer's held keys (and the queries that just attended to them) and
returns one importance score per (batch item, KV head, key): higher = keep. An *allocator*
turns per-cell statistics into a number of kept tokens per cell, where a cell is one
(layer, KV head). :func:`select_keep` turns scores and sizes into kept indices.

GQA: storage is per KV head, so the ``q_heads // kv_heads`` query heads of a group share one
kept set. Every scorer reduces its per-query-head statistics to one score per KV head and
documents how (:func:`combine_groups` does the reduction; the default is the mean of the
per-head attention probabilities).

Tensor shapes used throughout (``b`` batch, ``hq`` query heads, ``hk`` KV heads, ``s`` held
keys, ``q`` queries, ``d`` head dim):

    keys, values  (b, hk, s, d)      queries (b, hq, q, d)      scores (b, hk, s)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from evictlab.errors import InputError

__all__ = [
    "Allocator",
    "ScoreInputs",
    "Scorer",
    "attention_probs",
    "combine_groups",
    "select_keep",
]


@dataclass
class ScoreInputs:
    """Everything a scorer may use for ONE layer at one compression call.

    Query-agnostic by construction: ``queries`` are those of the chunk just processed (the
    context), never the question. ``extra_queries`` is the one labelled exception: the
    queries of a KVzip reconstruction pass (``needs={"reconstruction"}``) or the true future
    queries for the oracle (``needs={"future"}``).

    Attributes:
        layer: index of this layer, ``0 <= layer < n_layers``.
        n_layers: number of layers of the model.
        keys: ``(b, hk, s, d)`` post-RoPE keys currently held for this layer.
        values: ``(b, hk, s, d)`` the matching values.
        positions: ``(s,)`` int64 absolute token positions of those keys.
        queries: ``(b, hq, q, d)`` post-RoPE queries of the chunk just processed; the
            observation window is its tail.
        q_positions: ``(q,)`` int64 absolute positions of those queries.
        scaling: the attention module's logit scale (usually ``d ** -0.5``).
        extra_queries: ``(b, hq, m, d)`` or None; reconstruction-pass or future queries,
            all at positions after every held key.
        state: per-layer persistent scorer state (e.g. H2O's accumulated attention), owned
            by the decode loop and passed back unchanged on the next call for this layer.
    """

    layer: int
    n_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    q_positions: torch.Tensor
    scaling: float
    extra_queries: torch.Tensor | None = None
    state: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Scorer(Protocol):
    """A key-importance method: ``score(inputs) -> (b, hk, s)`` float32, higher = keep.

    ``needs`` names the extra inputs the decode loop must provide: ``"reconstruction"``
    (KVzip: run a context-reconstruction pass and pass its queries as ``extra_queries``) or
    ``"future"`` (oracle: pass the true future queries). Empty for query-agnostic methods.

    Optional class attribute ``uses_all_queries: ClassVar[bool]`` (absent = False): when
    True the decode loop passes as ``queries`` every query processed since this scorer's
    previous call for the layer (H2O accumulates them; Compactor and ExpectedAttention use
    the whole chunk); otherwise only the last ``DecodeConfig.window`` queries (SnapKV's
    observation window).
    """

    name: str
    needs: frozenset[str]

    def score(self, inputs: ScoreInputs) -> torch.Tensor: ...


Allocator = Callable[..., np.ndarray]
"""``allocate(cell_scores, budget_tokens, n_layers, kv_heads, *, floor, **params)``.

``cell_scores``: a list of ``n_layers`` tensors ``(b, hk, s_l)`` (or ``(hk, s_l)``), or an
array ``(n_layers, hk, s)``. Returns int64 ``(n_layers, kv_heads)`` kept tokens per cell,
summing exactly to ``budget_tokens``, each ``>= min(floor, length)`` and ``<= length`` (the
cell's available keys, the last axis of its scores). See :mod:`evictlab.methods.allocators`.
"""


def combine_groups(x: torch.Tensor, kv_heads: int, how: Literal["mean", "max"] = "mean") -> torch.Tensor:
    """Reduce per-query-head statistics to per-KV-head ones.

    Args:
        x: ``(b, hq, ...)``; query heads ``g*j .. g*j + g - 1`` (``g = hq // kv_heads``) form
            KV head ``j``'s group, the layout of Hugging Face's ``repeat_kv``.
        kv_heads: number of KV heads ``hk``; must divide ``hq``.
        how: ``"mean"`` or ``"max"`` over the ``g`` heads of a group.

    Returns:
        ``(b, hk, ...)``.
    """
    b, hq = x.shape[0], x.shape[1]
    if hq % kv_heads != 0:
        raise InputError("queries", f"{hq} query heads are not a multiple of {kv_heads} KV heads",
                         "pass the model's num_attention_heads and num_key_value_heads")
    grouped = x.reshape(b, kv_heads, hq // kv_heads, *x.shape[2:])
    return grouped.mean(dim=2) if how == "mean" else grouped.amax(dim=2)


def attention_probs(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of every query head over the held keys of its KV head.

    Args:
        queries: ``(b, hq, q, d)``.
        keys: ``(b, hk, s, d)``; ``hk`` divides ``hq``.
        scaling: logit scale.
        q_positions, k_positions: ``(q,)`` and ``(s,)`` int64; when both are given the mask
            is causal (a query sees keys at positions ``<=`` its own). A query that sees no
            key gets an all-zero row.

    Returns:
        ``(b, hq, q, s)`` float32 probabilities (computed in float32 whatever the input).
    """
    b, hq, q, d = queries.shape
    hk = keys.shape[1]
    g = hq // hk
    qg = queries.float().reshape(b, hk, g, q, d)
    logits = torch.einsum("bhgqd,bhsd->bhgqs", qg, keys.float()) * scaling
    if q_positions is not None and k_positions is not None:
        visible = k_positions.to(queries.device)[None, :] <= q_positions.to(queries.device)[:, None]
        logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # A fully masked row is NaN after softmax; it received no attention, so it contributes 0.
    probs = torch.nan_to_num(probs, nan=0.0)
    return probs.reshape(b, hq, q, -1)


def select_keep(
    scores: torch.Tensor,
    sizes: torch.Tensor | np.ndarray | list[int],
    positions: torch.Tensor,
    *,
    sinks: int,
    recent: int,
) -> list[list[torch.Tensor]]:
    """Kept key indices per batch item and KV head.

    For KV head ``h`` the kept set has ``min(sizes[h], s)`` keys: first the ``sinks`` keys
    with the smallest positions and the ``recent`` keys with the largest positions (always
    kept), then the highest scores among the rest. Equal scores prefer the more recent key
    (larger position), and equal positions the larger index, so the result is deterministic.

    Args:
        scores: ``(b, hk, s)``, higher = keep; NaN is rejected.
        sizes: ``(hk,)`` int, kept tokens per KV head (the allocator's row for this layer).
        positions: ``(s,)`` int64 absolute positions of the keys.
        sinks: number of attention-sink tokens always kept.
        recent: size of the recency window always kept.

    Returns:
        ``keep[i][h]``: int64 tensor of sorted indices into the ``s`` axis, on ``scores``'
        device.

    Raises:
        InputError: when a size is below the forced ``sinks + recent`` keys (clipped to
            ``s``), or the shapes disagree.
    """
    if scores.ndim != 3:
        raise InputError("scores", f"expected (batch, kv_heads, seq), got shape {tuple(scores.shape)}",
                         "pass one score per batch item, KV head and held key")
    b, hk, s = scores.shape
    sizes_t = torch.as_tensor(np.asarray(sizes, dtype=np.int64)).reshape(-1)
    if sizes_t.numel() != hk:
        raise InputError("sizes", f"{sizes_t.numel()} sizes for {hk} KV heads", "pass one size per KV head")
    if positions.shape != (s,):
        raise InputError("positions", f"shape {tuple(positions.shape)} for {s} keys", "pass (seq,) positions")
    if torch.isnan(scores).any():
        raise InputError("scores", "contains NaN", "fix the scorer; scores must be finite or +-inf")
    device = scores.device
    pos = positions.to(device)
    n_forced = min(s, sinks + recent)
    if (sizes_t < n_forced).any():
        raise InputError("sizes", f"a head's size {int(sizes_t.min())} is below the {n_forced} "
                         f"always-kept keys (sinks={sinks}, recent={recent})",
                         "raise the budget or lower --sinks/--recent (allocators take floor=sinks+recent)")
    # Rank keys by position once: the sinks are the oldest, the window the newest.
    by_pos = torch.argsort(pos, stable=True)
    forced = torch.zeros(s, dtype=torch.bool, device=device)
    forced[by_pos[: min(sinks, s)]] = True
    if recent > 0:
        forced[by_pos[max(0, s - recent):]] = True
    # Tie-break order: larger position first, then larger index (a total order on keys).
    recency_order = torch.argsort(pos * (s + 1) + torch.arange(s, device=device), descending=True)
    keep: list[list[torch.Tensor]] = []
    for i in range(b):
        per_head = []
        for h in range(hk):
            k = min(int(sizes_t[h]), s)
            sc = scores[i, h, recency_order].float()
            # Two stable sorts give the lexicographic order (forced, score, recency): a
            # +inf score never outranks a forced key, and ties keep the recency order.
            by_score = torch.sort(sc, descending=True, stable=True).indices
            is_forced = forced[recency_order][by_score].to(torch.int8)
            order = by_score[torch.sort(is_forced, descending=True, stable=True).indices]
            chosen = recency_order[order[:k]]
            per_head.append(torch.sort(chosen).values)
        keep.append(per_head)
    return keep
