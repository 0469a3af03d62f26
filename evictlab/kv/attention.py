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

    Equals dense attention restricted to the kept entries with renormalised (forced)
    weights. A store with ``cell_views`` (the paged store) is read cell by cell: each
    GQA group's query heads, folded into one ``(n_rep * q_len, d)`` matrix, attend to
    their cell's own ``n`` entries, which are zero-copy views of the pool when the cell's
    blocks are contiguous (:meth:`PagedKVStore.cell_views`); no padding, no layer gather.
    Other stores go through one gather and :func:`grouped_attention`.
    """
    views_fn = getattr(store, "cell_views", None)
    if views_fn is None:
        k, v, pos = store.gather(layer)
        return grouped_attention(query, k, v, pos, q_pos, scaling)
    return _cellwise_attention(views_fn(layer), query, q_pos, scaling)


def _cellwise_attention(views, query: torch.Tensor, q_pos: torch.Tensor, scaling: float) -> torch.Tensor:
    b, hq, q, d = query.shape
    hk = len(views[0])
    rep = hq // hk
    # One (n_rep * q_len, d) query matrix per cell, pre-scaled (views of one tensor).
    qcells = (query.reshape(b * hk, rep * q, d).float() * scaling).unbind(0)
    q_min = int(q_pos.min()) if q_pos.numel() else 0
    qp = None
    outs = []
    for i, cv in enumerate(c for row in views for c in row):
        if cv.k.shape[0] == 0:  # softmax over an empty set (NaN, as grouped_attention)
            outs.append(torch.full((rep * q, d), float("nan"), device=query.device))
            continue
        k, v = (cv.k, cv.v) if cv.k.dtype == torch.float32 else (cv.k.float(), cv.v.float())
        logits = torch.nn.functional.linear(qcells[i], k)  # (n_rep * q_len, n)
        if cv.last > q_min:  # some key lies in some query's future: causal mask needed
            if qp is None:
                qp = q_pos.to(query.device).repeat(rep)
            logits = logits.masked_fill(cv.pos[None, :] > qp[:, None], float("-inf"))
        outs.append(torch.mm(torch.softmax(logits, dim=-1), v))
    return torch.stack(outs).reshape(b, hq, q, d).to(query.dtype)


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
