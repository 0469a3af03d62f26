"""The decode loop on Gemma 3 (sliding-window layers), tiny model: layer 0 slides with a
window of 8 tokens, layer 1 is full attention; contexts are much longer than the window."""

from __future__ import annotations

from types import SimpleNamespace

import polars as pl
import pytest
import torch

from evictlab.capture.testing import TINY_SLIDING_WINDOW, tiny_config, tiny_model
from evictlab.decode.audit import Example, audit_configs, run_audit
from evictlab.decode.compress import EvictionRunner, attach_model
from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import run_sequence
from evictlab.errors import InputError
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.kv.cache import EvictionCache, attach
from evictlab.kv.masked import MaskedKVStore
from evictlab.kv.paged import PagedKVStore
from evictlab.models.geometry import layer_windows

W = TINY_SLIDING_WINDOW
N_CTX, N_Q, N_A = 70, 5, 12


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)  # far faster than 2 threads on a shared 2-core machine
    model, _ = tiny_model("gemma3")
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, 256, (2, N_CTX), generator=g)
    q = torch.randint(3, 256, (2, N_Q), generator=g)
    a = torch.randint(3, 256, (2, N_A), generator=g)
    with torch.no_grad():
        ref = model(input_ids=torch.cat([ctx, q, a], 1), use_cache=False).logits
    # Row t of run_sequence's logits predicts answer token t: it comes from position n + m - 1 + t.
    ref = ref[:, N_CTX + N_Q - 1:N_CTX + N_Q - 1 + N_A].float()
    return model, ctx, q, a, ref


def _cfg(**kw) -> DecodeConfig:
    base = dict(mode="physical", budget=Budget("tokens_per_cell", 1000), scorer="snapkv", allocator="uniform",
                chunk_size=16, compress_every=4, block_size=4, sinks=2, recent=4, window=8)
    base.update(kw)
    return DecodeConfig.of(**base)


def _cell_sizes(kept: torch.Tensor) -> torch.Tensor:
    """``(batch, kv_heads)`` live entries from ``DecodeOutput.context_kept[l]``."""
    return (kept >= 0).sum(-1)


def test_layer_windows() -> None:
    assert layer_windows(tiny_model("gemma3")[0]) == [W, None]
    for family in ("llama", "qwen2", "olmo2"):
        assert layer_windows(SimpleNamespace(config=tiny_config(family))) == [None, None]
    # No layer_types but a sliding_window (Mistral): every layer slides.
    mistral = SimpleNamespace(num_hidden_layers=3, sliding_window=5)
    assert layer_windows(SimpleNamespace(config=mistral)) == [5, 5, 5]
    chunked = SimpleNamespace(num_hidden_layers=2, sliding_window=5, layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(InputError):
        layer_windows(SimpleNamespace(config=chunked))


@pytest.mark.parametrize("store_kind", ["physical", "masked"])
def test_attach_model_applies_the_window_in_one_forward(setup, store_kind: str) -> None:
    """One 40-token forward through the cache == the model's own forward; the plain causal
    mask of ``attach`` (no window) would not be, so the window bound is really exercised."""
    model, ctx, _, _, _ = setup
    ids = ctx[:, :40]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits

    def run(ctx_manager) -> torch.Tensor:
        store = (PagedKVStore(2, 2, 2, 16, capacity_blocks=64, block_size=8) if store_kind == "physical"
                 else MaskedKVStore(2, 2, 2, 16))
        cache = EvictionCache(store)
        with torch.no_grad(), ctx_manager(model, cache):
            return model(input_ids=ids, cache=cache, use_cache=True).logits

    torch.testing.assert_close(run(attach_model), ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(run(attach), ref, atol=1e-3)


@pytest.mark.parametrize("mode", ["physical", "masked"])
def test_nothing_evicted_equals_the_models_forward(setup, mode: str) -> None:
    """Large budget: the scorer evicts nothing, only out-of-window entries of the sliding
    layer are dropped, and the logits equal the model's own no-cache forward."""
    model, ctx, q, a, ref = setup
    out = run_sequence(model, ctx, q, _cfg(mode=mode), answer_ids=a)
    assert out.compressions == 0
    torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)
    # After the context the sliding cells hold exactly the last window - 1 positions ...
    sliding, full = out.context_kept
    assert (_cell_sizes(sliding) == W - 1).all()
    last = torch.arange(N_CTX - W + 1, N_CTX)
    assert all(torch.equal(sliding[b, h][sliding[b, h] >= 0], last) for b in range(2) for h in range(2))
    # ... and the full-attention cells every context position.
    assert (_cell_sizes(full) == N_CTX).all()
    # Bytes: the physical store frees the dropped entries, the masked store holds them all.
    per_entry = kv_bytes(1, 16, torch.float32)
    after = [t.report for t in out.trace if t.phase == "compress" and t.seen == N_CTX][-1]
    assert after.live_tokens == 2 * 2 * (W - 1 + N_CTX)
    if mode == "physical":
        assert after.bytes_live == after.live_tokens * per_entry
    else:
        assert after.bytes_live == 2 * 2 * 2 * N_CTX * per_entry


def test_full_mode_and_bytes_full_cache_count_the_window(setup) -> None:
    model, ctx, q, a, ref = setup
    full = run_sequence(model, ctx, q, _cfg(mode="full"), answer_ids=a)
    torch.testing.assert_close(full.logits, ref, rtol=1e-4, atol=1e-4)
    fed = N_CTX + N_Q + N_A - 1  # the last answer token is never fed
    # Full layer: every entry fed; sliding layer: window - 1 (what a stock sliding cache holds).
    assert full.bytes_full_cache == kv_bytes((fed + W - 1) * 2 * 2, 16, torch.float32)


@pytest.mark.parametrize("scorer,allocator", [("snapkv", "uniform"), ("h2o", "adakv"), ("expected_attention", "uniform"),
                                              ("kvzip", "pyramidkv"), ("streaming_llm", "adakv")])
def test_evictions_physical_equals_masked(setup, scorer: str, allocator: str) -> None:
    model, ctx, q, a, ref = setup
    cfg = dict(budget=Budget("tokens_per_cell", 12), scorer=scorer, allocator=allocator)
    phys = run_sequence(model, ctx, q, _cfg(mode="physical", **cfg), answer_ids=a)
    mask = run_sequence(model, ctx, q, _cfg(mode="masked", **cfg), answer_ids=a)
    assert phys.compressions > 0
    torch.testing.assert_close(phys.logits, mask.logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(phys.logits, ref, atol=1e-3)  # eviction changed something
    for lp, lm in zip(phys.context_kept, mask.context_kept):
        assert torch.equal(lp, lm)
    budget_tokens = 12 * 2 * 2
    assert phys.budget_tokens == budget_tokens
    assert phys.after_compression("live_tokens") == 2 * budget_tokens == mask.after_compression("live_tokens")
    assert phys.after_compression("bytes_live") == kv_bytes(2 * budget_tokens, 16, torch.float32)
    assert mask.after_compression("bytes_live") > 2 * phys.after_compression("bytes_live")
    assert (_cell_sizes(phys.context_kept[0]) <= W - 1).all()


def test_budget_a_sliding_cell_cannot_hold_goes_to_full_cells(setup) -> None:
    """10 per cell (40 per sequence): the sliding cells hold their window - 1 = 7 entries,
    the uniform allocator gives the rest to the full-attention cells (13 each)."""
    model, ctx, q, a, _ = setup
    out = run_sequence(model, ctx, q, _cfg(budget=Budget("tokens_per_cell", 10), sinks=1, recent=2), answer_ids=a)
    sliding, full = out.context_kept
    assert (_cell_sizes(sliding) == W - 1).all()
    assert (_cell_sizes(full) == 2 * 10 - (W - 1)).all()
    # The sliding cells keep the last window - 1 positions (nothing older is attendable).
    assert int(sliding[sliding >= 0].min()) >= N_CTX - W + 1


def test_greedy_decoding_with_decode_time_compression(setup) -> None:
    model, ctx, q, _, _ = setup
    out = run_sequence(model, ctx, q, _cfg(budget=Budget("tokens_per_cell", 12), compress_every=3), max_new_tokens=10)
    assert out.tokens.shape == (2, 10)
    assert torch.equal(out.tokens, out.logits.argmax(-1))
    masked = run_sequence(model, ctx, q, _cfg(mode="masked", budget=Budget("tokens_per_cell", 12), compress_every=3),
                          max_new_tokens=10)
    assert torch.equal(out.tokens, masked.tokens)


def test_per_layer_type_rope_base_for_rope_undoing_scorers(setup) -> None:
    model = setup[0]
    runner = EvictionRunner(model, _cfg(scorer="compactor"), 1, headroom_tokens_per_cell=64, total_tokens=200)
    assert [s.rope_theta for s in runner.layer_scorers] == [10000.0, 1000000.0]  # sliding, full
    runner = EvictionRunner(model, _cfg(scorer="compactor", scorer_params={"rope_theta": 5.0}), 1,
                            headroom_tokens_per_cell=64, total_tokens=200)
    assert [s.rope_theta for s in runner.layer_scorers] == [5.0, 5.0]


def test_budget_floor_counts_the_window(setup) -> None:
    """Always-kept entries: sinks + recent per full cell, at most window - 1 per sliding cell."""
    model, ctx, q, a, _ = setup
    # floor = 2 x min(10, 7) + 2 x 10 = 34 <= 36 = 9 per cell: accepted.
    run_sequence(model, ctx[:, :40], q, _cfg(budget=Budget("total_tokens", 36), sinks=2, recent=8), answer_ids=a[:, :2])
    with pytest.raises(InputError):
        run_sequence(model, ctx[:, :40], q, _cfg(budget=Budget("total_tokens", 33), sinks=2, recent=8),
                     answer_ids=a[:, :2])


def test_audit_on_gemma(setup) -> None:
    model, ctx, q, a, _ = setup
    ex = [Example("synthetic", ctx[0].tolist(), q[0].tolist(), a[0, :4].tolist())]
    df = run_audit(model, ex, audit_configs(["snapkv+adakv"], [Budget("tokens_per_cell", 12)], loop=_cfg().loop))
    phys = df.filter(pl.col("mode") == "physical").row(0, named=True)
    mask = df.filter(pl.col("mode") == "masked").row(0, named=True)
    assert phys["kl"] == pytest.approx(mask["kl"], abs=1e-6)
    assert mask["freed_fraction"] == 0
    assert phys["bytes_live"] == phys["bytes_budget"] < mask["bytes_live"]
