"""Scorers on a real (tiny, random-initialised) transformers model.

The scorers are given post-RoPE queries and keys; these tests check that our RoPE matches
the model's own, and that the attention the scorers compute is the model's attention.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from evictlab.capture.testing import tiny_model
from evictlab.methods import ALLOCATORS, REGISTRY, AllocInputs, ScoreInputs, make_scorer, select_keep
from evictlab.methods.testing import allocator_for_tests, scorers_on_tensors, with_needs
from evictlab.methods.scorers import H2O, rope_rotate
from evictlab.models.geometry import rope_theta_of


@pytest.mark.parametrize("family", ["llama", "qwen2", "olmo2"])
def test_rope_rotate_matches_model_rotary_embedding(family: str) -> None:
    model, _ = tiny_model(family, seed=0)
    cfg = model.config
    pos = torch.arange(5, 45)[None]
    x = torch.randn(1, 2, 40, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rotary_emb(x, pos)
    ref, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(rope_rotate(x, pos[0], rope_theta_of(cfg)), ref, rtol=1e-5, atol=1e-5)


def capture_layer(model, ids: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """Post-RoPE queries, keys, values and the eager attention weights of one layer."""
    attn = model.model.layers[layer].self_attn
    got: dict[str, torch.Tensor] = {}

    def hook(module, args, kwargs, output):
        h = kwargs["hidden_states"]
        b, n, _ = h.shape
        shape = (b, n, -1, module.head_dim)
        q = module.q_proj(h).view(shape).transpose(1, 2)
        k = module.k_proj(h).view(shape).transpose(1, 2)
        v = module.v_proj(h).view(shape).transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        got["q"], got["k"] = apply_rotary_pos_emb(q, k, cos, sin)
        got["v"], got["weights"], got["scaling"] = v, output[1], torch.tensor(module.scaling)

    handle = attn.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    return got


def test_h2o_equals_model_attention_column_sums() -> None:
    model, _ = tiny_model("llama", seed=1)
    ids = torch.randint(3, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    got = capture_layer(model, ids, layer=1)
    pos = torch.arange(48)
    inp = ScoreInputs(1, 2, got["k"], got["v"], pos, got["q"], pos, float(got["scaling"]))
    ours = H2O().score(inp)
    w = got["weights"]  # (b, hq, q, s), the model's own softmax
    ref = w.sum(dim=2).reshape(2, 2, 2, 48).mean(dim=2)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_every_scorer_and_allocator_on_model_tensors() -> None:
    """Registry grid on real tensors: finite scores, a valid plan, sinks/recent kept."""
    model, _ = tiny_model("llama", seed=2)
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    layers = [capture_layer(model, ids, layer=i) for i in range(2)]
    pos = torch.arange(64)
    chunk = slice(0, 48)  # compress after 48 tokens; the next 16 give "future" queries
    for name in scorers_on_tensors():  # trimkv (trained gates) runs in test_decode_methods / test_gates
        scorer = make_scorer(name, model.config)
        scores = []
        for li, got in enumerate(layers):
            inp = ScoreInputs(li, 2, got["k"][:, :, chunk], got["v"][:, :, chunk], pos[chunk],
                              got["q"][:, :, chunk], pos[chunk], float(got["scaling"]),
                              extra_queries=got["q"][:, :, 48:])
            sc = scorer.score(inp)
            assert sc.shape == (1, 2, 48) and torch.isfinite(sc).all(), name
            scores.append(sc)
        for alloc_name in ALLOCATORS:
            alloc = allocator_for_tests(alloc_name)
            sizes = alloc.allocate(with_needs(alloc, AllocInputs.build(scores, 2 * 2 * 20, floor=4 + 8)))
            assert sizes.sum() == 80, (name, alloc_name)
            for li in range(2):
                keep = select_keep(scores[li], sizes[li], pos[chunk], sinks=4, recent=8)
                for h in range(2):
                    kept = set(keep[0][h].tolist())
                    assert len(kept) == sizes[li, h]
                    assert set(range(4)) <= kept and set(range(40, 48)) <= kept
