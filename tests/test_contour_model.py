"""ContourKV on the real default model (SmolLM2-135M, short contexts): captured rows -> a fitted
profile -> ``snapkv+contourkv`` in the decode loop, physically enforced, in both modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from evictlab.capture.config import CaptureConfig
from evictlab.capture.runner import run_capture
from evictlab.contour.fit import fit_profile
from evictlab.decode.audit import task_examples
from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import run_sequence
from evictlab.decode.trace import CompressionTrace
from evictlab.kv.budget import Budget, kv_bytes
from evictlab.models.geometry import model_geometry

pytestmark = [pytest.mark.model, pytest.mark.slow]
PER_CELL = 24


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, real_model):
    torch.set_num_threads(1)
    model, tok = real_model("smollm2-135m")  # the session's shared model
    folder = tmp_path_factory.mktemp("contour")
    cfg = CaptureConfig(model="smollm2-135m", source="shakespeare", context=96, positions=4, prompts=2, threads=1)
    run_capture(cfg, folder / "rows", model=model, tokenizer=tok, progress=False)
    prof = fit_profile(folder / "rows")
    prof.save(folder / "contour.json")
    ex = task_examples(tok, ["needle"], 1, 128, seed=0)[0]
    t = lambda x: torch.tensor([x])  # noqa: E731
    return model, tok, folder / "contour.json", prof, t(ex.context_ids), t(ex.question_ids), t(ex.answer_ids[:3])


def test_fitted_profile_describes_every_cell(real) -> None:
    model, _, _, prof, *_ = real
    g = model_geometry(model)
    assert prof.shape == (g.n_layers, g.kv_heads) == (30, 3)
    assert prof.geometry["head_dim"] == 64 and prof.geometry["q_heads"] == 9
    assert (prof.rows == 2 * 4 * 3).all()  # 2 prompts x 4 positions x 3 query heads per KV head
    assert np.allclose(prof.dropped[..., 0], 1.0) and np.allclose(prof.dropped[..., -1], 0.0, atol=1e-12)
    assert (np.diff(prof.dropped, axis=-1) <= 1e-12).all()
    # cells differ: the allocation has something to work with
    assert prof.dropped[..., 40].std() > 0.01


@pytest.mark.parametrize("profile", [True, False])
def test_snapkv_contourkv_holds_the_budget_physically(real, profile: bool) -> None:
    model, tok, path, _, ctx, q, a = real
    g = model_geometry(model)
    params = {"profile": str(path)} if profile else {}
    outs = {}
    trace = CompressionTrace(max_subsets=1)  # ES_hat off here: the tiny-model tests check it
    for mode in ("physical", "masked"):
        cfg = DecodeConfig.of(mode=mode, budget=Budget("tokens_per_cell", PER_CELL), scorer="snapkv",
                           allocator="contourkv", allocator_params=params, chunk_size=64, compress_every=2,
                           window=16, sinks=4, recent=8)
        outs[mode] = run_sequence(model, ctx, q, cfg, answer_ids=a, tokenizer=tok,
                                  compression_trace=trace if mode == "physical" else None)
    phys = outs["physical"]
    budget = PER_CELL * g.cells
    assert phys.compressions >= 2 and torch.isfinite(phys.logits).all()
    assert phys.after_compression("live_tokens") == budget
    assert phys.after_compression("bytes_live") == kv_bytes(budget, g.head_dim, g.dtype)
    assert outs["masked"].after_compression("bytes_live") > phys.after_compression("bytes_live")
    torch.testing.assert_close(phys.logits, outs["masked"].logits, rtol=1e-4, atol=1e-4)
    table = trace.table()
    assert table.height == phys.compressions * g.cells
    sizes = table.filter(table["compression"] == 0)["kept"].to_numpy()
    assert sizes.sum() == budget and sizes.min() < sizes.max()  # ragged, per the profiles
