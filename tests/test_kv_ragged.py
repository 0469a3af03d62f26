"""Ragged scaled-dot-product attention (the decode loop's attention) against short references:
every path of ``ragged_attention`` (one call per layer over the zero-copy ``layer_view``,
one call per cell, decode / one-pass causal / masked query tiles / sliding window / the
masked store's holes) equals grouped attention over the gathered layer; through the tiny
models the ragged attention implementation equals eager attention, and every scorer keeps
the same entries either way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evictlab.capture.testing import FAMILIES, tiny_model
from evictlab.errors import InputError
from evictlab.kv import attention as attn_mod
from evictlab.kv.attention import grouped_attention, ragged_attention
from evictlab.kv.cache import RAGGED_ATTENTION, EvictionCache, attach, is_ragged, register_ragged_attention
from evictlab.kv.masked import MaskedKVStore
from evictlab.kv.paged import PagedKVStore

B, HQ, HK, D = 2, 6, 3, 16
SCALE = D ** -0.5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    torch.set_num_threads(1)


def _filled(store, n_layers: int, old: list[int], g: torch.Generator) -> int:
    """Append ``max(old)`` entries to every cell, then keep ``old[h]`` per head (random subsets)."""
    n = max(old)
    rng = np.random.default_rng(int(torch.randint(0, 1000, (1,), generator=g)))
    for l in range(n_layers):
        kv = torch.randn(B, HK, n, D, generator=g)
        store.append(l, kv, torch.randn(B, HK, n, D, generator=g), torch.arange(n))
        store.keep(l, [[torch.from_numpy(np.sort(rng.choice(n, size=old[h], replace=False))) for h in range(HK)]
                       for _ in range(B)])
    return n


def _reference(store, layer: int, q: torch.Tensor, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    k, v, pos = store.gather(layer)
    if window is not None:  # slots window or more positions back are invisible
        far = pos[:, :, None, :] <= (q_pos - window)[None, None, :, None]
        pos = pos[:, :, None, :].expand(-1, -1, q_pos.numel(), -1).masked_fill(far, -1)
        return torch.stack([grouped_attention(q[:, :, t:t + 1], k, v, pos[:, :, t], q_pos[t:t + 1], SCALE)
                            for t in range(q_pos.numel())], 2).squeeze(3)
    return grouped_attention(q, k, v, pos, q_pos, SCALE)


@pytest.mark.parametrize("old", [[9, 9, 9], [5, 11, 8]])
@pytest.mark.parametrize("q_len", [1, 7])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kind", ["paged", "masked"])
def test_ragged_attention_equals_grouped_reference(old: list[int], q_len: int, window: int | None, kind: str) -> None:
    """A forward appends q_len keys to every cell after earlier (ragged) entries, then
    attends: decode (q_len 1) or a prefill chunk; with and without a sliding window."""
    g = torch.Generator().manual_seed(q_len + sum(old))
    store = (PagedKVStore.for_budget(_geometry(2), B, kept_tokens=3 * 12, headroom_tokens_per_cell=16, block_size=4)
             if kind == "paged" else MaskedKVStore(2, B, HK, D))
    n = _filled(store, 2, old, g)
    q_pos = torch.arange(n, n + q_len)
    for l in range(2):
        store.append(l, torch.randn(B, HK, q_len, D, generator=g), torch.randn(B, HK, q_len, D, generator=g), q_pos)
        q = torch.randn(B, HQ, q_len, D, generator=g)
        for tile in (2, 512):
            out = ragged_attention(store, l, q, q_pos, SCALE, window, own_keys=True, tile=tile)
            torch.testing.assert_close(out, _reference(store, l, q, q_pos, window), rtol=1e-5, atol=1e-6)
    if kind == "paged":
        assert store.layer_view(0) is not None  # the one-call-per-layer path ran


def _geometry(n_layers: int):
    from evictlab.models.geometry import ModelGeometry

    return ModelGeometry(n_layers=n_layers, q_heads=HQ, kv_heads=HK, head_dim=D, dtype=torch.float32,
                         windows=(None,) * n_layers, rope=(None,) * n_layers, scaling=SCALE)


def test_one_pass_prefill_is_causal_and_exact() -> None:
    """A cell holding only this forward's keys (a one-pass prefill) equals causal attention."""
    g = torch.Generator().manual_seed(3)
    store = PagedKVStore.for_budget(_geometry(1), B, kept_tokens=3, headroom_tokens_per_cell=40, block_size=8)
    k, v = torch.randn(B, HK, 40, D, generator=g), torch.randn(B, HK, 40, D, generator=g)
    store.append(0, k, v, torch.arange(40))
    q = torch.randn(B, HQ, 40, D, generator=g)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1), is_causal=True, scale=SCALE)
    torch.testing.assert_close(ragged_attention(store, 0, q, torch.arange(40), SCALE, own_keys=True), dense,
                               rtol=1e-5, atol=1e-6)


def test_layer_view_is_zero_copy_and_refused_when_irregular() -> None:
    g = torch.Generator().manual_seed(4)
    store = PagedKVStore.for_budget(_geometry(2), B, kept_tokens=30, headroom_tokens_per_cell=8, block_size=4)
    _filled(store, 2, [4, 9, 6], g)
    lv = store.layer_view(1)
    assert lv is not None
    lo, hi = store.kv_pool.data_ptr(), store.kv_pool.data_ptr() + store.kv_pool.numel() * 4
    assert lo <= lv.k.data_ptr() < hi and lo <= lv.v.data_ptr() < hi  # views of the pool
    assert lv.lengths.tolist() == [[4, 9, 6]] * B and lv.k.shape == (B, HK, 9, D)
    for b in range(B):
        for h in range(HK):
            n = int(lv.lengths[b, h])
            cv = store.cell_views(1)[b][h]
            assert torch.equal(lv.k[b, h, :n], cv.k) and torch.equal(lv.pos[b, h, :n], cv.pos)
    frag = PagedKVStore(1, B, HK, D, capacity_blocks=64, block_size=4)
    frag._home[:] = 0  # no regions: cells interleave, nothing equally spaced
    for t in range(3):
        frag.append(0, torch.randn(B, HK, 5, D), torch.randn(B, HK, 5, D), torch.arange(5 * t, 5 * t + 5))
    assert frag.layer_view(0) is None


#: what tests call the two attentions: eager (capture) and the decode loop's ragged one
IMPL = {"eager": lambda: "eager", "decode": register_ragged_attention}


@pytest.mark.parametrize("family", FAMILIES)
def test_model_through_ragged_attention_equals_eager_without_cache(family: str) -> None:
    """Nothing evicted: chunks and decode steps through the cache with ragged attention
    give the eager model's own logits (both stores)."""
    eager, _ = tiny_model(family)
    ragged, _ = tiny_model(family, attn_implementation=register_ragged_attention())
    assert is_ragged(ragged) and not is_ragged(eager) and ragged.config._attn_implementation == RAGGED_ATTENTION
    ids = torch.randint(3, 256, (2, 41), generator=torch.Generator().manual_seed(3))
    from evictlab.decode.compress import attach_model

    with torch.no_grad():
        dense = eager(input_ids=ids).logits
        torch.testing.assert_close(ragged(input_ids=ids).logits, dense, rtol=1e-4, atol=1e-5)  # sdpa outside the loop
        for store in (PagedKVStore(2, 2, 2, 16, capacity_blocks=64, block_size=8), MaskedKVStore(2, 2, 2, 16)):
            cache = EvictionCache(store)
            with attach_model(ragged, cache):
                parts = [ragged(input_ids=ids[:, :20], cache=cache, use_cache=True).logits]
                parts += [ragged(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(20, 41)]
            torch.testing.assert_close(torch.cat(parts, 1), dense, rtol=1e-4, atol=5e-5)


def test_ragged_attention_records_the_models_queries() -> None:
    """The queries ragged attention records are the eager hooks' (post-RoPE, post-norm)."""
    for family in ("olmo2", "gemma3"):
        got = {}
        for attention in ("eager", "decode"):
            model, _ = tiny_model(family, attn_implementation=IMPL[attention]())
            cache = EvictionCache(MaskedKVStore(2, 1, 2, 16))
            cache.query_window = 12
            with torch.no_grad(), attach(model, cache):
                model(input_ids=torch.arange(3, 15)[None], cache=cache, use_cache=True)
            got[attention] = cache.queries
        for l in range(2):
            torch.testing.assert_close(got["decode"][l][0], got["eager"][l][0], rtol=1e-5, atol=1e-6)
            assert torch.equal(got["decode"][l][1].cpu(), got["eager"][l][1].cpu())


def _kept_sets(monkeypatch, run):  # noqa: ANN001, ANN202
    """Every keep() call of a run: (store kind, layer, kept indices per cell)."""
    calls = []
    for cls in (PagedKVStore, MaskedKVStore):
        orig = cls.keep

        def rec(self, layer, keep, _orig=orig):  # noqa: ANN001, ANN202
            calls.append((self.kind, layer, [[k.tolist() for k in row] for row in keep]))
            return _orig(self, layer, keep)

        monkeypatch.setattr(cls, "keep", rec)
    out = run()
    monkeypatch.undo()
    return out, calls


SCORERS = ["streaming_llm", "h2o", "snapkv", "expected_attention", "kvzip", "compactor", "oracle"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("scorer", SCORERS)
def test_every_scorer_keeps_the_same_entries_with_ragged_attention(monkeypatch, family: str, scorer: str) -> None:
    """The switch from eager to ragged sdpa attention changes no kept set at any compression
    (prefill chunks and decode) and the logits by float rounding only."""
    from evictlab.decode.config import DecodeConfig
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import Budget

    g = torch.Generator().manual_seed(0)
    ctx, q, a = (torch.randint(3, 256, (2, n), generator=g) for n in (150, 6, 12))
    modes = ["physical", "masked"] if scorer in ("snapkv", "h2o") else ["physical"]
    for mode in modes:
        cfg = DecodeConfig(mode=mode, budget=Budget("tokens_per_cell", 30), scorer=scorer, allocator="adakv",
                           chunk_size=40, compress_every=5, block_size=8, sinks=2, recent=6)
        runs = {}
        for attention in ("eager", "decode"):
            model, _ = tiny_model(family, attn_implementation=IMPL[attention]())
            runs[attention] = _kept_sets(monkeypatch, lambda m=model: run_sequence(m, ctx, q, cfg, answer_ids=a))
        (eager_out, eager_keep), (ragged_out, ragged_keep) = runs["eager"], runs["decode"]
        assert len(eager_keep) > 3 * 2 and ragged_keep == eager_keep
        torch.testing.assert_close(ragged_out.logits, eager_out.logits, rtol=1e-5, atol=1e-5)


def test_nothing_evicted_equals_the_full_cache_to_1e5() -> None:
    from evictlab.decode.config import DecodeConfig
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import Budget

    model, _ = tiny_model("qwen2", attn_implementation=register_ragged_attention())
    g = torch.Generator().manual_seed(1)
    ctx, q, a = (torch.randint(3, 256, (2, n), generator=g) for n in (120, 5, 10))
    full = run_sequence(model, ctx, q, DecodeConfig(mode="full", chunk_size=32), answer_ids=a)
    for chunk in (32, 1000):  # chunked and one-pass prefill
        out = run_sequence(model, ctx, q, DecodeConfig(mode="physical", budget=Budget("tokens_per_cell", 1000),
                                                       chunk_size=chunk), answer_ids=a)
        assert out.compressions == 0
        torch.testing.assert_close(out.logits, full.logits, rtol=0, atol=1e-5)


def test_query_tiles_bound_every_mask(monkeypatch) -> None:
    """No attention call of a prefill sees more than ``tile`` query rows: the mask (and any
    score matrix a kernel builds) is at most tile x keys, whatever the chunk."""
    shapes = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):  # noqa: ANN001, ANN202
        shapes.append((q.shape[-2], None if attn_mask is None else tuple(attn_mask.shape)))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(5)
    store = PagedKVStore.for_budget(_geometry(1), B, kept_tokens=3 * 30, headroom_tokens_per_cell=50, block_size=4)
    n = _filled(store, 1, [20, 30, 25], g)
    store.append(0, torch.randn(B, HK, 50, D), torch.randn(B, HK, 50, D), torch.arange(n, n + 50))
    q = torch.randn(B, HQ, 50, D)
    out = ragged_attention(store, 0, q, torch.arange(n, n + 50), SCALE, own_keys=True, tile=16)
    torch.testing.assert_close(out, _reference(store, 0, q, torch.arange(n, n + 50), None), rtol=1e-5, atol=1e-6)
    assert shapes and all(rows <= 16 and (m is None or m[-2] <= 16) for rows, m in shapes)


def test_load_model_attention_option() -> None:
    from evictlab.models.loading import check_attn_implementation

    assert check_attn_implementation("eager") == "eager" and check_attn_implementation("sdpa") == "sdpa"
    assert register_ragged_attention() == RAGGED_ATTENTION  # the decode loop's callers register it ...
    assert check_attn_implementation(RAGGED_ATTENTION) == RAGGED_ATTENTION  # ... and load with its name
    with pytest.raises(InputError, match="attn_implementation"):
        check_attn_implementation("flash")
    assert tiny_model("llama")[0].config._attn_implementation == "eager"  # capture's default is unchanged
    assert attn_mod.QUERY_TILE >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_attention_on_cuda_matches_cpu(dtype: torch.dtype) -> None:
    """The same code path on CUDA (and, with flash-attn installed and a half dtype, its
    varlen kernel) gives the CPU result."""
    g = torch.Generator().manual_seed(6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for q_len in (1, 9):
        stores = {}
        for dev in ("cpu", "cuda"):
            gg = torch.Generator().manual_seed(6)
            st = PagedKVStore.for_budget(_geometry(1), B, kept_tokens=3 * 20, headroom_tokens_per_cell=10,
                                         block_size=4, device=dev)
            n = _filled(st, 1, [12, 20, 15], gg)
            st.append(0, torch.randn(B, HK, q_len, D, generator=g).to(dev), torch.randn(B, HK, q_len, D).to(dev),
                      torch.arange(n, n + q_len))
            stores[dev] = st
        stores["cuda"].kv_pool.copy_(stores["cpu"].kv_pool.to("cuda"))
        q = torch.randn(B, HQ, q_len, D, generator=g)
        ref = ragged_attention(stores["cpu"], 0, q, torch.arange(n, n + q_len), SCALE, own_keys=True)
        got = ragged_attention(stores["cuda"], 0, q.to("cuda", dtype), torch.arange(n, n + q_len), SCALE,
                               own_keys=True)
        torch.testing.assert_close(got.float().cpu(), ref, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_loop_on_cuda_keeps_the_cpu_entries(monkeypatch) -> None:
    from evictlab.decode.config import DecodeConfig
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import Budget

    g = torch.Generator().manual_seed(0)
    ctx, q, a = (torch.randint(3, 256, (1, n), generator=g) for n in (150, 6, 12))
    cfg = DecodeConfig(mode="physical", budget=Budget("tokens_per_cell", 30), scorer="snapkv", chunk_size=40,
                       compress_every=5, block_size=8, sinks=2, recent=6)
    res = {}
    for dev in ("cpu", "cuda"):
        model, _ = tiny_model("llama", attn_implementation=register_ragged_attention())
        model.to(dev)
        res[dev] = _kept_sets(monkeypatch, lambda m=model, d=dev: run_sequence(
            m, ctx.to(d), q.to(d), cfg, answer_ids=a.to(d)))
    assert res["cuda"][1] == res["cpu"][1]
    torch.testing.assert_close(res["cuda"][0].logits.cpu(), res["cpu"][0].logits, rtol=1e-4, atol=1e-4)
