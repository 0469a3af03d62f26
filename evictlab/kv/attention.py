"""Attention over a ragged store, in plain torch (any device), plus a forced-weight reference.

Forced weights: attention restricted to a kept set A renormalises the softmax over A,
``m_A = sum_{i in A} p_i v_i / P(A)``. Softmax over only the kept logits is exactly that,
so ragged attention with masked padding computes forced-weight outputs for every head.
"""

from __future__ import annotations

from typing import Literal

import torch

from evictlab.errors import InputError
from evictlab.kv.base import CellView, KVStore, LayerView


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


#: Query rows per attention call on a masked path: bounds the mask (``tile x n`` booleans)
#: and, if a kernel materialises it, the score matrix (``n_rep x tile x n``), whatever the
#: chunk size; a one-pass prefill of a long context never builds a ``q_len x n`` matrix.
QUERY_TILE = 512


def ragged_attention(
    store: KVStore, layer: int, query: torch.Tensor, q_pos: torch.Tensor, scaling: float,
    window: int | None = None, *, own_keys: bool = False, tile: int = QUERY_TILE,
) -> torch.Tensor:
    """Attention of ``query`` ``(batch, q_heads, q_len, d)`` over the entries of ``layer``.

    ``q_pos``: int64 ``(q_len,)`` ascending absolute positions of the queries (host tensor
    preferred: no device sync). A key is attended iff its position is ``>= 0``, ``<=`` the
    query's and, with a sliding ``window``, ``> q_pos - window``. Equals dense attention
    restricted to the kept entries with renormalised (forced) weights. ``own_keys=True``
    promises that the last ``q_len`` entries of every cell are the queries' own keys, just
    appended (what the model's forward does): it enables the ``is_causal`` path and lets
    each query tile find its last visible key without reading positions.

    When the store can show the layer as one zero-copy strided view (the paged store's
    :meth:`~evictlab.kv.paged.PagedKVStore.layer_view`: contiguous cells in equally spaced
    regions), the whole layer is one scaled-dot-product call (:func:`layer_attention`),
    reading exactly what a dense cache of the longest cell reads. Otherwise cells are read
    one by one through :meth:`KVStore.cell_views` (zero-copy views of the paged pool when the
    cell is contiguous; no layer gather, no padding), each with one call for its GQA group
    (K/V never repeated per query head):

    - every key visible to every query (decode: ``cell.last <= q_pos[0]``): no mask;
    - ``own_keys`` and the cell holds only this forward's keys (a one-pass prefill):
      ``is_causal``;
    - otherwise (a chunk after earlier entries, a window, the masked store's holes): a
      boolean mask from positions, the queries taken ``tile`` rows at a time, each tile
      reading only the keys up to its last query (all keys in a cell with holes).

    On CUDA with half-precision inputs and ``flash_attn`` installed, an ``own_keys`` layer
    without holes or window runs as one ``flash_attn_varlen_func`` call over the packed cells (causal,
    bottom-right aligned: exactly "old entries + this forward's keys"). Returns
    ``(batch, q_heads, q_len, d)`` in the query's dtype; an empty cell gives NaN.
    """
    b, hq, q, d = query.shape
    q_first = int(q_pos[0]) if q else 0
    view_fn = getattr(store, "layer_view", None)
    lv = view_fn(layer) if view_fn is not None else None
    if lv is not None and (own_keys or (window is None and int(lv.last.max()) <= q_first)):
        return layer_attention(lv, query, q_pos, q_first, scaling, window, tile=tile)
    views = store.cell_views(layer)
    hk = len(views[0])
    rep = hq // hk
    if (own_keys and window is None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and _flash_varlen() is not None and not any(cv.holes or cv.k.shape[0] == 0 for row in views for cv in row)):
        return _flash_layer(views, query, scaling)
    qp = q_pos.to(query.device)
    out = torch.empty(b, hk, rep, q, d, dtype=query.dtype, device=query.device)
    groups = query.view(b, hk, rep, q, d)  # splitting the head axis is always a view
    for bi, row in enumerate(views):
        for hi, cv in enumerate(row):
            out[bi, hi] = cell_attention(groups[bi, hi], cv, qp, q_first, scaling, window, own_keys=own_keys,
                                         tile=tile)
    return out.view(b, hq, q, d)


def layer_attention(
    lv: LayerView, query: torch.Tensor, q_pos: torch.Tensor, q_first: int, scaling: float,
    window: int | None = None, *, tile: int = QUERY_TILE,
) -> torch.Tensor:
    """All cells of a layer in one scaled-dot-product call per query tile, over the zero-copy
    strided :class:`LayerView` (``(batch, kv_heads, S, d)``; slot ``j`` of a cell is live iff
    ``j < lengths``). Either every key precedes every query (decode), or the last ``q_len``
    live slots of every cell are the queries' own keys (``own_keys``), so causality is by
    index: query ``i`` sees slots ``j < n - q_len + 1 + i``. No mask when nothing needs one
    (equal lengths and decode; a one-pass prefill: ``is_causal``). Returns ``(batch,
    q_heads, q_len, d)``."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    b, hq, q, d = query.shape
    hk, s = lv.k.shape[1], lv.k.shape[2]
    rep = hq // hk
    k, v = (lv.k, lv.v) if lv.k.dtype == query.dtype else (lv.k.to(query.dtype), lv.v.to(query.dtype))
    dev = query.device
    full = bool((lv.lengths == s).all())
    if window is None and int(lv.last.max()) <= q_first:  # every key at or before every query
        if full:  # no mask: transformers' own decode call (GQA kernel), bit for bit
            return sdpa(query, k, v, scale=scaling, enable_gqa=True)
        qg = query.reshape(b, hk, rep * q, d)  # the group's queries as rows: K/V read once per KV head
        mask = (torch.arange(s, device=dev) < torch.from_numpy(lv.lengths).to(dev)[..., None])[:, :, None, :]
        return sdpa(qg, k, v, attn_mask=mask, scale=scaling).view(b, hq, q, d)
    if window is None and full and s == q:  # only this forward's keys in every cell
        return sdpa(query, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    lens = torch.from_numpy(lv.lengths).to(dev)[:, :, None, None]  # (b, hk, 1, 1)
    qp = q_pos.to(dev)
    out = torch.empty_like(query)
    for i0 in range(0, q, tile):
        i1 = min(q, i0 + tile)
        hi = s - q + i1  # slots any query of the tile may see
        j = torch.arange(hi, device=dev)
        ok = j < lens - q + 1 + torch.arange(i0, i1, device=dev)[:, None]  # (b, hk, T, hi)
        if window is not None:
            ok &= lv.pos[:, :, None, :hi] > (qp[i0:i1, None] - window)
        # One additive mask for the layer, then one call per KV head (measured faster on CPU
        # than one GQA call with the mask repeated for every query head).
        bias = torch.zeros(ok.shape, dtype=query.dtype, device=dev).masked_fill_(~ok, float("-inf"))
        for h in range(hk):
            g = slice(h * rep, (h + 1) * rep)
            out[:, g, i0:i1] = sdpa(query[:, g, i0:i1], k[:, h:h + 1, :hi], v[:, h:h + 1, :hi],
                                    attn_mask=bias[:, h:h + 1], scale=scaling, enable_gqa=True)
    return out


def cell_attention(
    query: torch.Tensor, cell: CellView, q_pos: torch.Tensor, q_first: int, scaling: float,
    window: int | None = None, *, own_keys: bool = False, tile: int = QUERY_TILE,
) -> torch.Tensor:
    """One GQA group over one cell: ``query`` ``(n_rep, q_len, d)`` -> ``(n_rep, q_len, d)``.

    ``q_pos`` ``(q_len,)`` on the query's device, ``q_first = q_pos[0]`` (host int). See
    :func:`ragged_attention` for the three paths; every path is exact softmax attention
    (scaled-dot-product kernels, float32 accumulation).
    """
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rep, q, d = query.shape
    n = cell.k.shape[0]
    if n == 0:  # softmax over an empty set (NaN, as grouped_attention)
        return torch.full_like(query, float("nan"))
    k, v = cell.k[None, None], cell.v[None, None]  # (1, 1, n, d): the group shares them
    if k.dtype != query.dtype:
        k, v = k.to(query.dtype), v.to(query.dtype)
    if not cell.holes and window is None:
        if cell.last <= q_first:  # every key at or before every query: no mask (decode)
            return sdpa(query.reshape(1, 1, rep * q, d), k, v, scale=scaling).view(rep, q, d)
        if own_keys and n == q:  # only this forward's keys: plain causal attention
            return sdpa(query[None], k, v, is_causal=True, scale=scaling, enable_gqa=True)[0]
    ends = list(range(min(q, tile), q, tile)) + [q]  # each tile's end row
    if cell.holes:  # positions are not sorted: every tile reads every slot
        his = [n] * len(ends)
    elif own_keys:  # keys up to a tile's last query: the old entries + that many new ones
        his = [n - q + i1 for i1 in ends]
    else:  # keys at positions <= the tile's last query (positions ascend)
        his = torch.searchsorted(cell.pos, q_pos[[i1 - 1 for i1 in ends]], right=True).tolist()
    out = torch.empty_like(query)
    for i0, i1, hi in zip([0] + ends[:-1], ends, his):
        if hi == 0:  # no key at or before these queries (as grouped_attention: NaN)
            out[:, i0:i1] = float("nan")
            continue
        pos, qp = cell.pos[:hi], q_pos[i0:i1, None]
        ok = (pos[None, :] <= qp) & (pos[None, :] >= 0)
        if window is not None:
            ok &= pos[None, :] > qp - window
        out[:, i0:i1] = sdpa(query[None, :, i0:i1], k[:, :, :hi], v[:, :, :hi], attn_mask=ok, scale=scaling,
                             enable_gqa=True)[0]
    return out


_FLASH: object = False  # not looked up yet; then the function or None


def _flash_varlen():  # noqa: ANN202 - the function or None
    """``flash_attn.flash_attn_varlen_func`` when flash-attn is installed, else None."""
    global _FLASH
    if _FLASH is False:
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError:  # optional: CUDA builds only
            flash_attn_varlen_func = None
        _FLASH = flash_attn_varlen_func
    return _FLASH



def _flash_layer(views: list[list[CellView]], query: torch.Tensor, scaling: float) -> torch.Tensor:
    """All cells of a layer in one flash-attn varlen call: each cell is one "sequence" with
    one KV head and its ``n_rep`` query heads; K/V of the cells are packed (a copy of the
    layer's live entries, no padding). ``causal=True`` aligns the queries with the last
    ``q_len`` keys of each cell, which is where this forward's keys are."""
    b, hq, q, d = query.shape
    cells = [cv for row in views for cv in row]
    rep = hq // len(views[0])
    lens = torch.tensor([0] + [cv.k.shape[0] for cv in cells], dtype=torch.int32)
    cu_k = torch.cumsum(lens, 0, dtype=torch.int32).to(query.device)
    cu_q = (torch.arange(len(cells) + 1, dtype=torch.int32) * q).to(query.device)
    k = torch.cat([cv.k for cv in cells]).to(query.dtype)[:, None]  # (total, 1, d)
    v = torch.cat([cv.v for cv in cells]).to(query.dtype)[:, None]
    qs = query.reshape(b * len(views[0]), rep, q, d).transpose(1, 2).reshape(-1, rep, d)  # (cells * q, rep, d)
    out = _flash_varlen()(qs, k, v, cu_q, cu_k, q, int(lens.max()), softmax_scale=scaling, causal=True)
    return out.view(len(cells), q, rep, d).transpose(1, 2).reshape(b, hq, q, d)


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


# --------------------------------------------------------------------------- attention probabilities (scorers, profiles, traces)


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
        q_positions, k_positions: ``(q,)`` and ``(s,)`` (or ``(b, s)``: one row per batch
            item) int64; when both are given the mask is causal (a query sees keys at
            positions ``<=`` its own). A query that sees no key gets an all-zero row.

    Returns:
        ``(b, hq, q, s)`` float32 probabilities (computed in float32 whatever the input).
    """
    b, hq, q, d = queries.shape
    hk, s = keys.shape[1], keys.shape[2]
    g = hq // hk
    # One matmul per KV head with its group's queries stacked (K never repeated).
    logits = torch.matmul(queries.float().reshape(b, hk, g * q, d), keys.float().transpose(-1, -2)) * scaling
    logits = logits.view(b, hk, g, q, s)
    if q_positions is not None and k_positions is not None:
        visible = k_positions.to(queries.device)[..., None, :] <= q_positions.to(queries.device)[:, None]
        logits.masked_fill_(~(visible if visible.ndim == 2 else visible[:, None, None]), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # A fully masked row is NaN after softmax; it received no attention, so it contributes 0.
    probs = torch.nan_to_num_(probs, nan=0.0)
    return probs.reshape(b, hq, q, -1)


#: Default bound on the probabilities one block of :func:`query_attention` holds at once
#: (elements; 2**22 float32 = 16 MiB, plus the logits of the same size while they exist).
QUERY_BLOCK_ELEMENTS = 2 ** 22


def query_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    *,
    reduce: Literal["sum", "mean", "max"],
    block: int | None = None,
) -> torch.Tensor:
    """:func:`attention_probs` reduced over the query axis, computed a block of queries at a time.

    Args:
        queries: ``(b, hq, q, d)``; keys ``(b, hk, s, d)``; scaling, positions: as
            :func:`attention_probs` (causal when both positions are given).
        reduce: ``"sum"``, ``"mean"`` or ``"max"`` over the ``q`` queries of each head.
        block: queries per block; default: as many as keep ``b x hq x block x s`` under
            :data:`QUERY_BLOCK_ELEMENTS`, so memory stays bounded whatever ``q`` is (an
            all-query scorer after a one-pass prefill never holds a ``q x s`` matrix).

    Returns:
        ``(b, hq, s)`` float32. With one block (``q <= block``) it is exactly
        ``attention_probs(...).sum/mean/amax(dim=2)``; with several, block sums (or maxima)
        are combined, so sums differ from the one-block result only by float32 rounding.
    """
    b, hq, q, _ = queries.shape
    s = keys.shape[2]
    if block is None:
        block = max(1, QUERY_BLOCK_ELEMENTS // max(1, b * hq * s))
    if reduce not in ("sum", "mean", "max"):
        raise InputError("reduce", f"unknown reduction {reduce!r}", "use sum, mean or max")
    if q <= block:
        probs = attention_probs(queries, keys, scaling, q_positions, k_positions)
        return probs.amax(dim=2) if reduce == "max" else probs.mean(dim=2) if reduce == "mean" else probs.sum(dim=2)
    out: torch.Tensor | None = None
    for i0 in range(0, q, block):
        qp = None if q_positions is None else q_positions[i0:i0 + block]
        probs = attention_probs(queries[:, :, i0:i0 + block], keys, scaling, qp, k_positions)
        part = probs.amax(dim=2) if reduce == "max" else probs.sum(dim=2)
        out = part if out is None else torch.maximum(out, part) if reduce == "max" else out + part
    assert out is not None
    return out / q if reduce == "mean" else out
