"""The decode loop's contract with the methods package (tiny models): scorers built from the
model config (RoPE base), which queries each scorer sees, ragged lengths passed to the
allocators, and KVzip's reconstruction prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from evictlab.capture.testing import ByteTokenizer, tiny_config, tiny_model
from evictlab.decode.compress import EvictionRunner
from evictlab.decode.config import DecodeConfig
from evictlab.decode.extras import recon_ids
from evictlab.decode.loop import run_sequence
from evictlab.errors import InputError
from evictlab.kv.budget import Budget
from evictlab.methods import ALLOCATORS, REGISTRY
from evictlab.methods.allocators import AdaKV
from evictlab.kv.attention import combine_groups
from evictlab.methods.scorers import H2O, KVZIP_PROMPT, KVzip, SnapKV


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # far faster than 2 threads on a shared 2-core machine
    return tiny_model("llama")[0]


def _ids(n: int, seed: int = 0, b: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (b, n), generator=torch.Generator().manual_seed(seed))


def _cfg(**kw: Any) -> DecodeConfig:
    base = dict(mode="physical", budget=Budget("tokens_per_cell", 40), scorer="h2o", allocator="uniform",
                chunk_size=48, compress_every=4, block_size=8, sinks=2, recent=8, window=8)
    base.update(kw)
    return DecodeConfig(**base)


def _model_with(**config_changes: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    for k, v in config_changes.items():
        setattr(config, k, v)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return m.eval()


# -- 1. RoPE base from the model config -----------------------------------------------------

@pytest.mark.parametrize("scorer", ["expected_attention", "compactor"])
def test_loop_scorer_carries_the_models_rope_theta(scorer: str) -> None:
    m = _model_with(rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    runner = EvictionRunner(m, _cfg(scorer=scorer), 1, headroom_tokens_per_cell=64, total_tokens=200)
    assert runner.scorer.rope_theta == 100000.0  # REGISTRY[name]() would carry 10000
    # An explicit parameter still wins.
    runner = EvictionRunner(m, _cfg(scorer=scorer, scorer_params={"rope_theta": 5.0}), 1,
                            headroom_tokens_per_cell=64, total_tokens=200)
    assert runner.scorer.rope_theta == 5.0


def test_loop_refuses_scaled_rope_for_rope_undoing_scorers() -> None:
    m = _model_with(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(InputError):
        run_sequence(m, _ids(100), _ids(4, 1), _cfg(scorer="expected_attention"), answer_ids=_ids(2, 2))
    run_sequence(m, _ids(100), _ids(4, 1), _cfg(scorer="snapkv"), answer_ids=_ids(2, 2))  # no RoPE undone


def test_loop_rejects_unknown_scorer_params(model) -> None:
    with pytest.raises(InputError):
        run_sequence(model, _ids(100), _ids(4, 1), _cfg(scorer_params={"nope": 1}), answer_ids=_ids(2, 2))


# -- 2. Which queries a scorer sees ------------------------------------------------------------

def _spy(base: type, log: list) -> type:
    @dataclass
    class Spy(base):  # type: ignore[misc, valid-type]
        def score(self, inputs):  # noqa: ANN001, ANN202
            out = super().score(inputs)
            log.append(dict(layer=inputs.layer, q_positions=inputs.q_positions.clone(),
                            positions=inputs.positions.clone(), scores=out.clone(),
                            extra=None if inputs.extra_queries is None else inputs.extra_queries.shape[2]))
            return out
    return Spy


def test_h2o_through_the_loop_equals_h2o_over_all_context_queries(model, monkeypatch) -> None:
    """200 context tokens in chunks of 48; the budget (195/cell) is first exceeded after the
    last chunk, so the one prefill compression must score with all 200 queries: H2O is then
    the column sums of the model's own attention (group mean), computed here explicitly."""
    log: list = []
    monkeypatch.setitem(REGISTRY, "h2o", _spy(H2O, log))
    ctx = _ids(200)
    out = run_sequence(model, ctx, _ids(4, 1), _cfg(budget=Budget("tokens_per_cell", 195)), answer_ids=_ids(1, 2))
    assert out.compressions == 1
    with torch.no_grad():
        att = model(input_ids=ctx, output_attentions=True).attentions  # per layer (1, hq, 200, 200)
    assert len(log) == 2 * 2  # 2 layers x 2 KV heads, one call each
    for rec, h in zip(log, [0, 1, 0, 1]):
        assert torch.equal(rec["q_positions"], torch.arange(200))
        ref = combine_groups(att[rec["layer"]].sum(dim=2), 2, "mean")[0, h]  # (200,) keys
        torch.testing.assert_close(rec["scores"].reshape(-1), ref[rec["positions"]], rtol=1e-4, atol=1e-4)


def test_all_query_scorers_see_every_query_exactly_once(model, monkeypatch) -> None:
    """Compressions after every chunk and every 4 decode steps (fewer than the window): H2O
    must see each processed query once, SnapKV keeps its sliding window of `window`."""
    logs: dict[str, list] = {"h2o": [], "snapkv": []}
    monkeypatch.setitem(REGISTRY, "h2o", _spy(H2O, logs["h2o"]))
    monkeypatch.setitem(REGISTRY, "snapkv", _spy(SnapKV, logs["snapkv"]))
    ctx, q, a = _ids(150), _ids(5, 1), _ids(13, 2)
    for name in logs:
        run_sequence(model, ctx, q, _cfg(scorer=name, window=8), answer_ids=a)
    total = 150 + 5 + 12  # the last answer token is never fed; decode compressions after 4, 8, 12
    seen = torch.cat([r["q_positions"] for r in logs["h2o"] if r["layer"] == 0][::2])  # head 0 of layer 0
    assert torch.equal(seen, torch.arange(seen.numel()))  # every query once, in order
    assert seen.numel() == total
    assert all(r["q_positions"].numel() == 8 for r in logs["snapkv"])
    assert torch.equal(logs["snapkv"][-1]["q_positions"], torch.arange(total - 8, total))


# -- 3. Ragged lengths to the allocators -------------------------------------------------------

def test_allocator_gets_each_cells_real_length(model, monkeypatch) -> None:
    calls: list = []

    @dataclass(frozen=True)
    class Spy(AdaKV):
        def allocate(self, inputs):  # noqa: ANN001, ANN202
            sizes = super().allocate(inputs)
            calls.append((inputs.lengths.copy(), [s.shape[-1] for s in inputs.scores], sizes))
            return sizes

    monkeypatch.setitem(ALLOCATORS, "spy", Spy)
    out = run_sequence(model, _ids(200, b=2), _ids(5, 1, b=2), _cfg(scorer="snapkv", allocator="spy"),
                       answer_ids=_ids(9, 2, b=2))
    assert len(calls) == out.compressions >= 4
    ragged = False
    for lengths, padded, sizes in calls:
        assert lengths is not None and lengths.shape == (2, 2)
        assert (lengths.max(axis=1) == np.array(padded)).all()
        ragged |= bool((lengths.min(axis=1) < lengths.max(axis=1)).any())
        assert (sizes <= lengths).all() and sizes.sum() == 40 * 4
    assert ragged  # adakv made heads differ, so padding was there to be ignored


# -- 4. KVzip's reconstruction prompt ----------------------------------------------------------

class _WordTokenizer:
    """A Hugging Face-like tokenizer: ``tok(text, add_special_tokens=...)["input_ids"]``."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([1] if add_special_tokens else []) + [3 + len(w) for w in text.split()]}


def test_recon_ids_prefix_the_kvzip_prompt() -> None:
    chunk = _ids(7, b=2)
    prompt = list(KVZIP_PROMPT.encode("utf-8"))
    for tok in (None, ByteTokenizer()):  # the tiny models' byte vocabulary
        ids = recon_ids(KVzip(), chunk, tok)
        assert ids.shape == (2, len(prompt) + 7)
        assert ids[0, :len(prompt)].tolist() == prompt and torch.equal(ids[:, len(prompt):], chunk)
    ids = recon_ids(KVzip(), chunk, _WordTokenizer())  # a real tokenizer: its ids, no BOS
    assert ids[0, :-7].tolist() == [3 + len(w) for w in KVZIP_PROMPT.split()]
    assert torch.equal(recon_ids(SnapKV(), chunk, None), chunk)  # no reconstruction_ids: chunk alone


def test_kvzip_reconstruction_pass_has_the_prompt_and_agrees_physical_masked(model, monkeypatch) -> None:
    log: list = []
    monkeypatch.setitem(REGISTRY, "kvzip", _spy(KVzip, log))
    ctx, q, a = _ids(150), _ids(5, 1), _ids(9, 2)
    cfg = _cfg(scorer="kvzip", chunk_size=50, window=6)
    phys = run_sequence(model, ctx, q, cfg, answer_ids=a)
    n_phys = len(log)
    mask = run_sequence(model, ctx, q, _cfg(scorer="kvzip", chunk_size=50, window=6, mode="masked"), answer_ids=a)
    torch.testing.assert_close(phys.logits, mask.logits, rtol=1e-4, atol=1e-4)
    p = len(KVZIP_PROMPT.encode("utf-8"))
    extra = [r["extra"] for r in log[:n_phys] if r["layer"] == 0]
    assert extra[:3 * 2] == [p + 50] * 6  # three prefill compressions x 2 heads: prompt + chunk
    assert extra[-1] == p + 6  # decode: prompt + the last `window` tokens
    # Positions are unchanged by the passes: the kept context is at positions < 150.
    assert all(int(k.max()) < 150 for k in phys.context_kept)


def test_kvzip_reconstructs_every_chunk_since_the_last_compression(model, monkeypatch) -> None:
    """Budget 120/cell with chunks of 50: no compression after chunk 1 or 2, so the pass at
    chunk 3 must reconstruct all three chunks (one prompt each)."""
    log: list = []
    monkeypatch.setitem(REGISTRY, "kvzip", _spy(KVzip, log))
    run_sequence(model, _ids(150), _ids(5, 1), _cfg(scorer="kvzip", chunk_size=50, budget=Budget("tokens_per_cell", 120)),
                 answer_ids=_ids(2, 2))
    p = len(KVZIP_PROMPT.encode("utf-8"))
    assert log[0]["extra"] == 3 * (p + 50)


def test_kvzip_without_a_tokenizer_needs_a_byte_vocabulary() -> None:
    m = _model_with(vocab_size=300)
    with pytest.raises(InputError, match="tokenizer"):
        run_sequence(m, _ids(100), _ids(4, 1), _cfg(scorer="kvzip"), answer_ids=_ids(2, 2))
