"""Exactness: ragged attention == dense attention (nothing evicted) and == forced-weight
attention restricted to the kept set (with evictions), for every head; and the same through
a stock transformers model via the Cache subclass and hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.kv.attention import forced_attention_reference, ragged_attention
from evictlab.kv.cache import EvictionCache, attach
from evictlab.kv.masked import MaskedKVStore
from evictlab.kv.paged import PagedKVStore

B, HQ, HK, D, N = 2, 6, 3, 16, 37


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: far faster than two on a shared 2-core machine."""
    torch.set_num_threads(1)


def _store_with(k: torch.Tensor, v: torch.Tensor, bs: int = 8) -> PagedKVStore:
    store = PagedKVStore(1, B, HK, D, capacity_blocks=64, block_size=bs, dtype=k.dtype)
    store.append_gather(0, k, v, torch.arange(k.shape[2]))
    return store


def test_nothing_evicted_equals_dense_attention() -> None:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, HK, N, D, generator=g), torch.randn(B, HK, N, D, generator=g)
    q = torch.randn(B, HQ, 1, D, generator=g)
    store = _store_with(k, v)
    out = ragged_attention(store, 0, q, torch.tensor([N - 1]), D ** -0.5)
    rep = HQ // HK
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    dense = torch.softmax(q @ kk.transpose(-1, -2) * D ** -0.5, -1) @ vv
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_evictions_equals_forced_weights_every_head(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    k, v = torch.randn(B, HK, N, D, generator=g) * 2, torch.randn(B, HK, N, D, generator=g)
    q = torch.randn(B, HQ, 1, D, generator=g)
    store = _store_with(k, v, bs=4)
    kept = [[torch.from_numpy(np.sort(rng.choice(N, size=int(rng.integers(1, N)), replace=False)))
             for _ in range(HK)] for _ in range(B)]
    store.keep(0, kept)
    out = ragged_attention(store, 0, q, torch.tensor([N]), D ** -0.5)
    rep = HQ // HK
    for b in range(B):
        for hq in range(HQ):
            hk = hq // rep
            ref = forced_attention_reference(q[b, hq, 0], k[b, hk], v[b, hk], kept[b][hk], D ** -0.5)
            torch.testing.assert_close(out[b, hq, 0].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "olmo2"])
def test_model_through_cache_nothing_evicted_equals_dense(family: str) -> None:
    model, _ = tiny_model(family)
    ids = torch.randint(3, 256, (2, 41), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        for store in (PagedKVStore(2, 2, 2, 16, capacity_blocks=64, block_size=8), MaskedKVStore(2, 2, 2, 16)):
            cache = EvictionCache(store)
            with attach(model, cache):
                parts = [model(input_ids=ids[:, :20], cache=cache, use_cache=True).logits]
                parts += [model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(20, 41)]
            torch.testing.assert_close(torch.cat(parts, 1), dense, rtol=1e-4, atol=1e-4)


def test_model_with_ragged_evictions_physical_equals_masked_and_forced_reference() -> None:
    """Evict different entries per head; the model's own eager attention over the physical
    store must equal the masked store's, and layer 0's attention output must equal the
    forced-weight reference computed from the recorded queries."""
    model, _ = tiny_model("llama")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 256, (2, 30), generator=g)
    rng = np.random.default_rng(4)
    keep = {l: [[torch.from_numpy(np.sort(rng.choice(30, size=5 + 7 * h + l, replace=False))) for h in range(2)]
                for _ in range(2)] for l in range(2)}
    logits = {}
    for kind in ("physical", "masked"):
        store = (PagedKVStore(2, 2, 2, 16, capacity_blocks=64, block_size=4) if kind == "physical"
                 else MaskedKVStore(2, 2, 2, 16))
        cache = EvictionCache(store)
        cache.query_window = 1
        captured = {}
        attn0 = model.model.layers[0].self_attn
        hook = attn0.register_forward_hook(lambda _m, _a, out: captured.__setitem__("o", out[0]))
        try:
            with torch.no_grad(), attach(model, cache):
                model(input_ids=ids, cache=cache, use_cache=True)
                full_k = {l: store.gather(l)[:2] for l in range(2)}
                for l in range(2):
                    store.keep(l, keep[l])
                nxt = torch.tensor([[7], [9]])
                logits[kind] = model(input_ids=nxt, cache=cache, use_cache=True).logits
                q0 = cache.queries[0][0]  # (2, 4, 1, 16) post-RoPE query of the new token
                k_all, v_all, _ = store.gather(0) if kind == "physical" else (None, None, None)
        finally:
            hook.remove()
        if kind == "physical":
            # Forced reference for every query head of layer 0: kept old entries + the new one.
            k_new, v_new = k_all, v_all
            o_proj_in = []
            for b in range(2):
                heads = []
                for hq in range(4):
                    hk = hq // 2
                    n_keep = keep[0][b][hk].numel()
                    kk = torch.cat([full_k[0][0][b, hk, :30], k_new[b, hk, n_keep:n_keep + 1]])
                    vv = torch.cat([full_k[0][1][b, hk, :30], v_new[b, hk, n_keep:n_keep + 1]])
                    kept = torch.cat([keep[0][b][hk], torch.tensor([30])])
                    heads.append(forced_attention_reference(q0[b, hq, 0], kk, vv, kept, attn0.scaling))
                o_proj_in.append(torch.cat(heads))
            expect = attn0.o_proj(torch.stack(o_proj_in).float())
            torch.testing.assert_close(captured["o"][:, 0], expect, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits["physical"], logits["masked"], rtol=1e-4, atol=1e-5)


def test_recorded_queries_reproduce_model_attention_weights() -> None:
    """The post-RoPE queries the hooks record give the model's own attention weights."""
    model, _ = tiny_model("qwen2")
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    store = MaskedKVStore(2, 1, 2, 16)
    cache = EvictionCache(store)
    cache.query_window = 12
    with torch.no_grad(), attach(model, cache):
        out = model(input_ids=ids, cache=cache, use_cache=True, output_attentions=True)
    attn = model.model.layers[1].self_attn
    q, _ = cache.queries[1]
    k = store.k[1][:, :, :12].repeat_interleave(2, 1)
    logits = q @ k.transpose(-1, -2) * attn.scaling
    logits = logits.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(torch.softmax(logits, -1), out.attentions[1], rtol=1e-4, atol=1e-5)


def test_cellwise_views_fragmented_contiguous_and_causal_equal_gathered_attention() -> None:
    """ragged_attention reads cells as pool views (contiguous) or per-cell gathers
    (fragmented); both, with a causal prefill-chunk query block, equal grouped attention
    over the layer gather. resize() lays every cell out as one run with a gap of free
    blocks after it, so later appends keep cells contiguous (zero-copy).
    (Fragmentation is forced here: normally each cell starts in its own region.)"""
    from evictlab.kv.attention import grouped_attention

    g = torch.Generator().manual_seed(5)
    bs, n_layers = 4, 2
    store = PagedKVStore(n_layers, B, HK, D, capacity_blocks=200, block_size=bs)
    store._home[:] = 0  # no home regions: interleaved chunk appends fragment the cells
    seen = 0
    for chunk in (5, 7, 3, 9):
        for l in range(n_layers):
            store.append(l, torch.randn(B, HK, chunk, D, generator=g), torch.randn(B, HK, chunk, D, generator=g),
                         torch.arange(seen, seen + chunk))
        seen += chunk
    rng = np.random.default_rng(0)
    for l in range(n_layers):
        store.keep(l, [[torch.from_numpy(np.sort(rng.choice(seen, size=int(rng.integers(1, seen)), replace=False)))
                        for _ in range(HK)] for _ in range(B)])

    def check(q_pos: torch.Tensor) -> None:
        q = torch.randn(B, HQ, q_pos.numel(), D, generator=g)
        for l in range(n_layers):
            k, v, pos = store.gather(l)
            ref = grouped_attention(q, k, v, pos, q_pos, D ** -0.5)
            torch.testing.assert_close(ragged_attention(store, l, q, q_pos, D ** -0.5), ref, rtol=1e-5, atol=1e-6)

    assert store.contiguous_cells()[0] < store.contiguous_cells()[1]
    assert any(cv.copied for row in store.cell_views(0) + store.cell_views(1) for cv in row)
    check(torch.arange(seen - 6, seen))  # some keys lie in some queries' future
    check(torch.tensor([seen]))
    store.resize(store.blocks_in_use + B * HK * n_layers * 3)
    assert store.contiguous_cells() == (n_layers * B * HK, n_layers * B * HK)
    check(torch.arange(seen - 6, seen))
    for t in range(2 * bs):  # decode appends take the adjacent free block
        for l in range(n_layers):
            store.append(l, torch.randn(B, HK, 1, D, generator=g), torch.randn(B, HK, 1, D, generator=g),
                         torch.tensor([seen]))
        seen += 1
    assert store.contiguous_cells() == (n_layers * B * HK, n_layers * B * HK)
    assert not any(cv.copied for row in store.cell_views(0) for cv in row)
    check(torch.tensor([seen - 1]))


def test_interleaved_chunks_stay_contiguous_in_their_regions() -> None:
    """Each cell starts in its own region of the pool, so chunks appended to every cell in
    turn (a chunked prefill) leave every cell one contiguous run while it fits its region;
    a cell that outgrows it falls back to other free blocks (correct, just copied)."""
    bs, n_layers, cells = 4, 2, 2 * B * HK
    store = PagedKVStore(n_layers, B, HK, D, capacity_blocks=cells * 6, block_size=bs)  # 6 blocks per region
    g = torch.Generator().manual_seed(1)
    seen = 0
    for chunk in (5, 7, 3, 9):  # 24 entries = 6 blocks per cell: exactly the region
        for l in range(n_layers):
            kv = torch.randn(B, HK, chunk, D, generator=g)
            store.append(l, kv, kv, torch.arange(seen, seen + chunk))
        seen += chunk
    assert store.contiguous_cells() == (cells, cells)
    assert not any(cv.copied for l in range(n_layers) for row in store.cell_views(l) for cv in row)
    store.keep(0, [[torch.arange(0, 24, 2)] * HK] * B)  # frees blocks at the end of layer 0's regions
    kv = torch.randn(B, HK, 12, D, generator=g)
    store.append(1, kv, kv, torch.arange(seen, seen + 12))  # layer 1 outgrows its regions
    assert store.contiguous_cells(1)[0] < store.contiguous_cells(1)[1]
    q = torch.randn(B, HQ, 1, D, generator=g)
    k, v, pos = store.gather(1)
    from evictlab.kv.attention import grouped_attention

    torch.testing.assert_close(ragged_attention(store, 1, q, torch.tensor([seen + 12]), D ** -0.5),
                               grouped_attention(q, k, v, pos, torch.tensor([seen + 12]), D ** -0.5),
                               rtol=1e-5, atol=1e-6)
