"""Attention over a ragged store, in plain torch (any device), plus a forced-weight reference.

Forced weights: attention restricted to a kept set A renormalises the softmax over A,
``m_A = sum_{i in A} p_i v_i / P(A)``. Softmax over only the kept logits is exactly that,
so ragged attention with masked padding computes forced-weight outputs for every head.
"""

from __future__ import annotations

import torch

from evictlab.kv.base import KVStore


def position_mask(slot_pos: torch.Tensor, q_pos: torch.Tensor, n_rep: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask from slot positions.

    ``slot_pos``: int64 ``(batch, kv_heads, S)``, ``-1`` for padding or masked entries.
    ``q_pos``: int64 ``(q_len,)`` absolute positions of the queries. ``n_rep`` = query heads
    per KV head. Returns ``(batch, kv_heads * n_rep, q_len, S)`` in ``dtype``: 0 where the
    slot is valid and not in the query's future, the dtype's minimum elsewhere (the value
    transformers uses, so a fully masked row cannot produce NaN).
    """
    ok = (slot_pos[:, :, None, :] >= 0) & (slot_pos[:, :, None, :] <= q_pos.to(slot_pos.device)[None, None, :, None])
    mask = torch.zeros(ok.shape, dtype=dtype, device=slot_pos.device)
    mask.masked_fill_(~ok, torch.finfo(dtype).min)
    return mask.repeat_interleave(n_rep, dim=1) if n_rep > 1 else mask


def grouped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Softmax attention of GQA query groups over per-KV-head padded keys.

    ``query`` ``(batch, q_heads, q_len, d)``; ``keys``/``values`` ``(batch, kv_heads, S, d)``;
    ``slot_pos`` int64 ``(batch, kv_heads, S)`` (``-1`` = not attendable); ``q_pos`` ``(q_len,)``.
    Returns ``(batch, q_heads, q_len, d)``. Query heads are folded into their KV group
    (``(batch, kv_heads, n_rep * q_len, d)``) so K/V are never repeated per query head.
    Logits and softmax are computed in float32.
    """
    b, hq, q, d = query.shape
    hk = keys.shape[1]
    rep = hq // hk
    qg = query.reshape(b, hk, rep * q, d).float()
    logits = torch.matmul(qg, keys.float().transpose(-1, -2)) * scaling  # (b, hk, rep*q, S)
    ok = (slot_pos[:, :, None, :] >= 0) & (slot_pos[:, :, None, :] <= q_pos.repeat(rep)[None, None, :, None])
    logits = logits.masked_fill(~ok, float("-inf"))
    w = torch.softmax(logits, dim=-1)
    out = torch.matmul(w, values.float())
    return out.reshape(b, hq, q, d).to(query.dtype)


def ragged_attention(
    store: KVStore, layer: int, query: torch.Tensor, q_pos: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of ``query`` ``(batch, q_heads, q_len, d)`` over the live entries of ``layer``.

    Reads each cell's own entries (ragged lengths) through one block-wise gather, then
    :func:`grouped_attention`. Equals dense attention restricted to the kept entries with
    renormalised (forced) weights.
    """
    # The paged store can gather into its reusable scratch buffer (consumed right here).
    gather = getattr(store, "gather_view", store.gather)
    k, v, pos = gather(layer)
    return grouped_attention(query, k, v, pos, q_pos, scaling)


def forced_attention_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Obviously correct forced-weight attention for ONE head and ONE query (float64).

    ``query`` ``(d,)``, ``keys``/``values`` ``(n, d)`` (the full dense cache), ``kept`` int64
    indices of the kept set A. Computes dense weights p over all n keys, then
    ``sum_{i in A} p_i v_i / sum_{i in A} p_i``.
    """
    logits = (keys.double() @ query.double()) * scaling
    p = torch.softmax(logits, dim=0)
    pa = p[kept]
    return (pa[:, None] * values.double()[kept]).sum(0) / pa.sum()
