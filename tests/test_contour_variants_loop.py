"""ContourKV's variants in the decode loop (tiny models): every variant runs physically and
masked, holds exactly the budget, gives the same logits in both stores; what the
scorer-ranked variants plan is what the selection incurs (the trace's ``dropped_kept`` and
``e_kept`` are the window curves read at the allocated sizes); ``profile=default`` is refused
for a model no shipped profile describes, before the run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import run_sequence
from evictlab.decode.trace import CompressionTrace
from evictlab.errors import InputError
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.methods.contour import ContourKV
from evictlab.methods.testing import example_predictor, model_profile
from evictlab.models.geometry import model_geometry

VARIANTS = ["contourkv", "contourkv_mass", "contourkv_error", "contourkv_relerror", "contourkv_query",
            "contourkv_pred", "contourkv_offline"]


def _cfg(**kw):
    base = dict(mode="physical", budget=Budget("tokens_per_cell", 12), scorer="snapkv", allocator="contourkv",
                chunk_size=24, compress_every=4, block_size=8, sinks=2, recent=3, window=6)
    base.update(kw)
    return DecodeConfig.of(**base)


def _params(name: str, model, tmp_path: Path) -> dict:
    if name == "contourkv_pred":
        return {"predictor": str(example_predictor())}
    if name == "contourkv_offline":  # the tiny model has no shipped profile: a file of its geometry
        return {"profile": str(model_profile(model, tmp_path / "tiny.json"))}
    return {}


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request):
    torch.set_num_threads(1)
    model, _ = tiny_model(request.param)
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(3, 256, (2, 80), generator=g)
    q = torch.randint(3, 256, (2, 4), generator=g)
    a = torch.randint(3, 256, (2, 6), generator=g)
    return model, ctx, q, a


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_runs_physical_and_masked_within_budget(tiny, name: str, tmp_path: Path) -> None:
    model, ctx, q, a = tiny
    g = model_geometry(model)
    params = _params(name, model, tmp_path)
    outs = {mode: run_sequence(model, ctx, q, _cfg(mode=mode, allocator=name, allocator_params=params), answer_ids=a)
            for mode in ("physical", "masked")}
    phys = outs["physical"]
    budget = 12 * g.cells
    assert phys.compressions >= 3 and torch.isfinite(phys.logits).all()
    assert phys.after_compression("live_tokens") == budget * 2  # two sequences, exactly the budget
    assert phys.after_compression("bytes_live") == kv_bytes(budget * 2, g.head_dim, g.dtype)
    torch.testing.assert_close(phys.logits, outs["masked"].logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("name", "column", "curve"), [("contourkv", "dropped_kept", "ranked"),
                                                       ("contourkv_mass", "dropped_kept", "ranked"),
                                                       ("contourkv_error", "e_kept", "error")])
def test_planned_is_incurred_for_the_scorer_ranking(tiny, monkeypatch, name: str, column: str, curve: str) -> None:
    """The window curve at each cell's allocated size equals the trace's measurement of the
    set the scorer kept (one sequence: the plan is that sequence's own)."""
    model, ctx, q, a = tiny
    plans = []
    orig = ContourKV.allocate

    def record(self, inputs):  # noqa: ANN001, ANN202
        sizes = orig(self, inputs)
        plans.append((inputs, sizes))
        return sizes

    monkeypatch.setattr(ContourKV, "allocate", record)
    trace = CompressionTrace(max_subsets=1)
    run_sequence(model, ctx[:1], q[:1], _cfg(allocator=name), answer_ids=a[:1], compression_trace=trace)
    table = trace.table()
    assert len(plans) == table["compression"].n_unique() >= 3
    for i, (inputs, sizes) in enumerate(plans):
        rows = table.filter(table["compression"] == i).sort("layer", "kv_head")
        arrays = getattr(inputs.window, curve)
        planned = [float(arrays[l][0, h, sizes[l, h]]) for l in range(sizes.shape[0]) for h in range(sizes.shape[1])]
        assert rows["kept"].to_list() == sizes.reshape(-1).tolist()
        np.testing.assert_allclose(planned, rows[column].to_numpy(), rtol=1e-6, atol=1e-9)


def test_default_profile_is_refused_for_a_model_without_one(tiny) -> None:
    model, ctx, q, a = tiny
    with pytest.raises(InputError, match="profile=default: no shipped profile describes this model's geometry"):
        run_sequence(model, ctx, q, _cfg(allocator="contourkv_offline"), answer_ids=a)
    with pytest.raises(InputError, match="no shipped profile"):
        run_sequence(model, ctx, q, _cfg(allocator="contourkv_mass", allocator_params={"profile": "default"}),
                     answer_ids=a)
