"""Exactness of captured rows on tiny random-init Llama, Qwen2, OLMo2 and Gemma 3 models.

The references are independent of the capture code: ``output_attentions`` of eager
attention for p, and the o_proj input read by a hook the test registers itself for mu.
Rows go through the real RowWriter/RowStore round trip, so the stored queries, keys,
values, key ranges and scale are what is checked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from evictlab.capture.hooks import AttentionCapture, verify_layer
from evictlab.tasks.sources import PromptTokens
from evictlab.capture.forward import write_prompt
from evictlab.capture.testing import FAMILIES, TINY_SLIDING_WINDOW, tiny_model
from evictlab.errors import InputError
from evictlab.models.sites import find_attention_sites
from evictlab.rows.reader import RowStore
from evictlab.rows.writer import RowWriter


def _hook_count(model: torch.nn.Module) -> int:
    # transformers installs its own output-recording hooks on the first forward that asks
    # for attentions; run one so those are counted in "before"
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2]]), output_attentions=True)
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def capture_and_reference(model: torch.nn.Module, tokens: list[int], positions: list[int]):
    """Capture rows and, independently, eager attention weights and per-head outputs."""
    head_out: dict[int, torch.Tensor] = {}
    handles = []
    for site in find_attention_sites(model):
        def pre(mod, args, layer=site.layer, h=site.n_q_heads, d=site.head_dim):
            x = args[0]
            head_out[layer] = x.view(x.shape[0], x.shape[1], h, d)[0].transpose(0, 1).double()
        handles.append(site.o_proj.register_forward_pre_hook(pre))
    try:
        with torch.no_grad(), AttentionCapture(model, positions) as cap:
            out = model(input_ids=torch.tensor([tokens]), output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    attn = [a[0].double() for a in out.attentions]  # per layer (H, L, L)
    return cap.captures, attn, head_out


def _store_rows(tmp_path: Path, captures, tokens: list[int], positions: np.ndarray, d: int) -> RowStore:
    prompt = PromptTokens("t", "test", tokens, len(tokens))
    with RowWriter(tmp_path / "rows", model="tiny", capture_mode="query-agnostic", head_dim=d) as w:
        write_prompt(w, 0, prompt, "query-agnostic", captures)
    return RowStore.open(tmp_path / "rows")


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_reproduce_eager_attention(family: str, tmp_path: Path) -> None:
    model, _ = tiny_model(family, seed=11)
    L = 48
    tokens = torch.randint(0, 256, (L,), generator=torch.Generator().manual_seed(1)).tolist()
    positions = [0, 1, 5, 9, 23, 24, 47]
    before = _hook_count(model)
    captures, attn, head_out = capture_and_reference(model, tokens, positions)
    assert _hook_count(model) == before  # every handle removed
    site0 = find_attention_sites(model)[0]
    store = _store_rows(tmp_path, captures, tokens, np.array(positions), site0.head_dim)
    n_layers = len(attn)
    assert store.n_rows == n_layers * site0.n_q_heads * len(positions)
    worst_p = worst_mu = 0.0
    for batch in store.iter_batches(max_rows=50):
        meta = batch.meta
        for i in range(batch.n_rows):
            layer, h, t = (int(meta[c][i]) for c in ("layer", "q_head", "position"))
            p, V = batch.row(i)
            keys = batch.key_index[batch.p_off[i]:batch.p_off[i + 1]]
            ref = attn[layer][h, t].numpy()
            # p matches eager attention on the keys the row sees, and the row sees every key
            # eager attention gives weight to (nothing outside the window)
            worst_p = max(worst_p, float(np.abs(p - ref[keys]).max()))
            outside = np.delete(ref, keys)
            assert outside.size == 0 or float(outside.max()) == 0.0
            mu = p @ V
            worst_mu = max(worst_mu, float(np.abs(mu - head_out[layer][h, t].numpy()).max()))
            # GQA: query head h reads kv head h // group
            assert int(meta["kv_head"][i]) == h // (site0.n_q_heads // site0.n_kv_heads)
    assert worst_p < 1e-5
    assert worst_mu < 1e-5


def test_gemma3_sliding_layer_stores_only_window(tmp_path: Path) -> None:
    model, _ = tiny_model("gemma3", seed=2)
    tokens = list(range(3, 43))
    positions = [2, 20, 39]
    captures, attn, _ = capture_and_reference(model, tokens, positions)
    sliding = captures[0]
    assert sliding.sliding_window == TINY_SLIDING_WINDOW and captures[1].sliding_window is None
    lo, hi = sliding.key_range(sliding.positions)
    assert lo.tolist() == [0, 20 - TINY_SLIDING_WINDOW + 1, 39 - TINY_SLIDING_WINDOW + 1]
    assert hi.tolist() == [3, 21, 40]
    # eager attention's nonzero pattern on the sliding layer is exactly that window
    for j, t in enumerate(positions):
        nz = np.flatnonzero(attn[0][0, t].numpy() > 0)
        assert nz.tolist() == list(range(lo[j], hi[j]))
    store = _store_rows(tmp_path, captures, tokens, np.array(positions), 16)
    meta = store.meta
    n_sliding = meta.filter(meta["layer"] == 0)["n"].to_list()
    assert max(n_sliding) == TINY_SLIDING_WINDOW
    # the stored block for the sliding layer starts at the earliest key any row sees
    batch = next(store.iter_batches(max_rows=1000, filter=pl.col("layer") == 0))
    assert batch.values.shape[0] == 40 * 2  # keys 0..39 (first row sees 0..2), per KV head
    batch = next(store.iter_batches(max_rows=1000, filter=(pl.col("layer") == 0) & (pl.col("position") == 39)))
    assert batch.key_index[: batch.n[0]].tolist() == list(range(32, 40))


def test_scaling_is_the_modules_own() -> None:
    model, _ = tiny_model("gemma3")
    sites = find_attention_sites(model)
    # Gemma 3 scales logits by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
    assert all(s.scaling == pytest.approx(24 ** -0.5) for s in sites)
    llama, _ = tiny_model("llama")
    assert all(s.scaling == pytest.approx(16 ** -0.5) for s in find_attention_sites(llama))


def test_hooks_removed_when_forward_raises() -> None:
    model, _ = tiny_model("llama")
    before = _hook_count(model)
    with pytest.raises(InputError, match="batch"):
        with torch.no_grad(), AttentionCapture(model, [1]):
            model(input_ids=torch.zeros(2, 8, dtype=torch.long), use_cache=False)
    assert _hook_count(model) == before
    # and the model still runs normally afterwards
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


def test_layer_subset_and_bad_inputs() -> None:
    model, _ = tiny_model("qwen2")
    with torch.no_grad(), AttentionCapture(model, [3, 4], layers=[1]) as cap:
        model(input_ids=torch.arange(10)[None], use_cache=False)
    assert list(cap.captures) == [1]
    assert cap.captures[1].queries.shape == (4, 2, 16)
    assert cap.captures[1].keys.shape == (2, 10, 16)
    assert verify_layer(cap.captures[1]) < 1e-5
    with pytest.raises(InputError, match="--layers"):
        AttentionCapture(model, [1], layers=[7])
    with pytest.raises(InputError, match="positions"):
        with torch.no_grad(), AttentionCapture(model, [12]):
            model(input_ids=torch.arange(10)[None], use_cache=False)
    with pytest.raises(InputError, match="attention modules"):
        find_attention_sites(torch.nn.Linear(3, 3))


def test_heads_equal_length_layout_is_unambiguous() -> None:
    """L == n_heads makes (B,H,L,d) and (B,L,H,d) the same shape; strides decide."""
    model, _ = tiny_model("gemma3", seed=4)
    tokens = [5, 9, 11, 200]  # L = 4 = n_q_heads
    captures, attn, head_out = capture_and_reference(model, tokens, [1, 3])
    for c in captures.values():
        assert verify_layer(c) < 1e-5


def test_verification_catches_a_wrong_model() -> None:
    """A model whose attention the hooks misread must fail verification, not pass silently."""
    model, _ = tiny_model("llama", seed=0)
    with torch.no_grad(), AttentionCapture(model, [6, 7]) as cap:
        model(input_ids=torch.arange(1, 9)[None], use_cache=False)
    c = cap.captures[0]
    c.scaling *= 2.0  # as if the model used a different logit scale than recorded
    assert verify_layer(c) > 1e-3


def test_capture_leaves_model_config_and_globals_untouched() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, _ = tiny_model("olmo2", seed=1)
    cfg_before = model.config.to_dict()
    attn_before = dict(ALL_ATTENTION_FUNCTIONS.items())
    fwd_before = {n: type(m).forward for n, m in model.named_modules()}
    x = torch.arange(1, 13)[None]
    with torch.no_grad():
        ref = model(input_ids=x).logits
        with AttentionCapture(model, [5, 11]):
            inside = model(input_ids=x, use_cache=False).logits
        after = model(input_ids=x).logits
    assert torch.equal(ref, inside) and torch.equal(ref, after)  # hooks only observe
    assert model.config.to_dict() == cfg_before
    assert dict(ALL_ATTENTION_FUNCTIONS.items()) == attn_before
    assert {n: type(m).forward for n, m in model.named_modules()} == fwd_before
    assert all("forward" not in vars(m) for m in model.modules())  # no instance patches
