"""The capture run on tiny models: dataset contents, positions, resume, errors, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from evictlab.capture import forward, runner
from evictlab.capture.hooks import AttentionCapture
from evictlab.capture.config import CaptureConfig, parse_layers
from evictlab.capture.runner import run_capture
from evictlab.capture.testing import ByteTokenizer, save_tiny_folder, tiny_model
from evictlab.errors import InputError
from evictlab.rows.reader import RowStore

CFG = CaptureConfig(model="tiny-llama", source="needle", context=400, positions=5, prompts=3, seed=4)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=5)[0]


def _run(cfg: CaptureConfig, out: Path, model) -> runner.CaptureSummary:
    return run_capture(cfg, out, model=model, tokenizer=ByteTokenizer(), progress=False)


def _content(path: Path) -> tuple[pl.DataFrame, np.ndarray, np.ndarray]:
    st = RowStore.open(path)
    batch = st.get_rows(np.arange(st.n_rows), with_keys=True)
    return st.meta, batch.p, batch.values


def test_dataset_layout_and_record(tmp_path: Path, llama) -> None:
    s = _run(CFG, tmp_path / "r", llama)
    assert s.rows_written == s.rows_total == 3 * 2 * 4 * 5  # prompts x layers x q heads x positions
    assert s.max_verify_error < 1e-5
    st = RowStore.open(tmp_path / "r")
    summ = st.summary()
    assert summ["capture_mode"] == "query-agnostic" and summ["model"] == "tiny-llama"
    assert summ["source"]["capture"]["source"] == "needle"
    assert summ["source"]["gqa"]["0"] == [4, 2]
    prompts = st.prompts
    assert prompts["prompt_id"].to_list() == [0, 1, 2]
    assert set(prompts["mode"].to_list()) == {"query-agnostic"}
    meta = st.meta
    for pid in range(3):
        toks = prompts.filter(pl.col("prompt_id") == pid)["tokens"].to_list()[0]
        pos = meta.filter(pl.col("prompt_id") == pid)["position"].unique().sort().to_numpy()
        n = len(toks)  # query-agnostic: only the context is stored (and shown to the model)
        assert n <= 400 + 1
        assert pos.size == 5 and pos.min() >= n // 2 and pos.max() < n
        # stratified: one position in each fifth of the last half
        edges = np.floor(np.linspace(n // 2, n, 6)).astype(int)
        assert all(edges[i] <= pos[i] < max(edges[i + 1], edges[i] + 1) for i in range(5))
    rec = json.loads((tmp_path / "r" / "run_record.json").read_text())
    assert rec["kind"] == "capture" and rec["config"]["seed"] == 4
    assert rec["summary"]["rows_written"] == s.rows_written


def test_rows_recomputable_from_stored_tokens(tmp_path: Path, llama) -> None:
    _run(replace(CFG, prompts=1), tmp_path / "r", llama)
    st = RowStore.open(tmp_path / "r")
    toks = st.prompts["tokens"].to_list()[0]
    meta = st.meta.filter((pl.col("layer") == 1) & (pl.col("q_head") == 3))
    pos = meta["position"].to_list()
    with torch.no_grad(), AttentionCapture(llama, pos, layers=[1]) as cap:
        llama(input_ids=torch.tensor([toks]), use_cache=False)
    batch = st.get_rows(meta["row_id"].to_numpy(), with_keys=True)
    c = cap.captures[1]
    for i in range(batch.n_rows):
        p, _ = batch.row(i)
        K = c.keys[1, : pos[i] + 1].double().numpy()
        z = (K @ c.queries[3, i].double().numpy()) * c.scaling
        ref = np.exp(z - z.max())
        np.testing.assert_allclose(p, ref / ref.sum(), atol=1e-6)


def test_interrupted_run_resumes_without_duplicates(tmp_path: Path, llama, monkeypatch) -> None:
    full = tmp_path / "full"
    _run(CFG, full, llama)
    part = tmp_path / "part"
    real = forward.capture_batch
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C during prompt 2
        return real(*a, **k)

    monkeypatch.setattr(forward, "capture_batch", flaky)
    with pytest.raises(KeyboardInterrupt):
        _run(CFG, part, llama)
    monkeypatch.setattr(forward, "capture_batch", real)
    with pytest.raises(InputError, match="incomplete row dataset"):
        RowStore.open(part)  # an interrupted capture never reads as a finished one
    st = RowStore.open(part, allow_incomplete=True)
    assert sorted(st.prompts["prompt_id"].to_list()) == [0, 1]  # complete prompts were kept
    s = _run(CFG, part, llama)
    assert s.prompts_skipped == 2 and s.prompts_written == 1
    m1, p1, v1 = _content(full)
    m2, p2, v2 = _content(part)
    # same rows in the same order; only the shard layout differs (the resumed run cut a shard)
    cols = [c for c in m1.columns if c not in ("shard", "local")]
    assert m1.select(cols).equals(m2.select(cols))
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(v1, v2)
    # a rerun of a finished capture writes nothing
    again = _run(CFG, part, llama)
    assert again.rows_written == 0 and again.prompts_skipped == 3
    assert RowStore.open(part).n_rows == m1.height


def test_more_prompts_extend_and_other_settings_are_refused(tmp_path: Path, llama) -> None:
    out = tmp_path / "r"
    _run(replace(CFG, prompts=1), out, llama)
    s = _run(replace(CFG, prompts=2), out, llama)
    assert s.prompts_skipped == 1 and s.prompts_written == 1
    with pytest.raises(InputError, match="--positions"):
        _run(replace(CFG, positions=6), out, llama)
    with pytest.raises(InputError, match="--seed"):
        _run(replace(CFG, seed=5), out, llama)


def test_query_aware_positions_are_in_the_question(tmp_path: Path, llama) -> None:
    cfg = replace(CFG, mode="query-aware", positions=4, prompts=1, source="multi_key")
    _run(cfg, tmp_path / "r", llama)
    st = RowStore.open(tmp_path / "r")
    toks = st.prompts["tokens"].to_list()[0]
    info = json.loads(st.prompts["text"].to_list()[0])
    n_ctx = info["n_context"]
    assert len(toks) > n_ctx  # the question is part of the stored prompt
    assert bytes(toks[n_ctx:]).decode().lstrip().startswith("What is the special magic number")
    pos = st.meta["position"].unique().to_numpy()
    assert pos.size == 4 and pos.min() >= n_ctx and pos.max() < len(toks)
    assert st.prompts["mode"].to_list() == ["query-aware"]
    assert st.summary()["capture_mode"] == "query-aware"


def test_sliding_window_model_capture(tmp_path: Path) -> None:
    gemma, _ = tiny_model("gemma3", seed=1)
    s = _run(replace(CFG, prompts=1), tmp_path / "r", gemma)
    assert s.max_verify_error < 1e-5
    meta = RowStore.open(tmp_path / "r").meta
    assert meta.filter(pl.col("layer") == 0)["n"].max() == 8
    assert meta.filter(pl.col("layer") == 1)["n"].min() > 8


def test_config_errors() -> None:
    with pytest.raises(InputError, match="--protocol"):
        replace(CFG, source="shakespeare", mode="query-aware").check()
    with pytest.raises(InputError, match="--protocol"):
        replace(CFG, mode="sideways").check()
    with pytest.raises(InputError, match="--source"):
        replace(CFG, source="wikipedia").check()
    with pytest.raises(InputError, match="--positions"):
        replace(CFG, positions=300).check()
    with pytest.raises(InputError, match="--context"):
        replace(CFG, context=0).check()
    assert parse_layers("all", 30) is None
    assert parse_layers("0,5,10-12", 30) == [0, 5, 10, 11, 12]
    with pytest.raises(InputError, match="--layers"):
        parse_layers("3-1", 30)
    with pytest.raises(InputError, match="--layers"):
        parse_layers("40", 30)


def test_layer_subset(tmp_path: Path, llama) -> None:
    _run(replace(CFG, prompts=1, layers="1"), tmp_path / "r", llama)
    assert RowStore.open(tmp_path / "r").meta["layer"].unique().to_list() == [1]


def _cli(*args: str, env_cache: Path) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "EVICTLAB_CACHE": str(env_cache)}
    return subprocess.run([sys.executable, "-m", "evictlab.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_cli_capture_local_folder_and_errors(tmp_path: Path) -> None:
    folder = tmp_path / "olmo2"
    save_tiny_folder(folder)
    out = tmp_path / "rows"
    r = _cli("capture", "--model", str(folder), "--source", "needle", "--context", "200",
             "--positions", "4", "--prompts", "2", "--out", str(out), "--quiet", "--threads", "1",
             env_cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "64 rows from 2 prompts" in r.stdout  # 2 prompts x 2 layers x 4 heads x 4 positions
    assert RowStore.open(out).n_rows == 64
    bad = _cli("capture", "--model", "smollm9", "--out", str(tmp_path / "x"), env_cache=tmp_path / "cache")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "smollm2-135m" in bad.stderr
    (tmp_path / "afile").write_text("x")  # --out a regular file used to be a traceback
    for out, words in ((tmp_path / "afile", "is a file"), (tmp_path / "no" / "r", "mkdir -p")):
        bad = _cli("capture", "--model", str(folder), "--source", "needle", "--context", "200",
                   "--positions", "4", "--prompts", "1", "--out", str(out), "--quiet",
                   env_cache=tmp_path / "cache")
        assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
        assert words in bad.stderr and "--out" in bad.stderr
    lst = _cli("models", "list", env_cache=tmp_path / "cache")
    assert lst.returncode == 0 and "not pulled" in lst.stdout and "gemma3-270m" in lst.stdout


def test_killed_cli_run_resumes_to_identical_dataset(tmp_path: Path) -> None:
    """SIGKILL mid-run (no Python cleanup at all), rerun: same rows as an uninterrupted run."""
    import os
    import signal
    import time

    folder = tmp_path / "olmo2"
    save_tiny_folder(folder)
    args = ["capture", "--model", str(folder), "--source", "multi_key", "--context", "300",
            "--positions", "3", "--prompts", "12", "--rows-per-shard", "1", "--quiet", "--threads", "1"]
    env = {**os.environ, "EVICTLAB_CACHE": str(tmp_path / "cache")}
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args, "--out", str(killed)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    man = killed / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if man.exists() and json.loads(man.read_text())["counts"]["prompts"] >= 2:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert man.exists()
    # a capture is marked complete only at its end: the killed one reads as unfinished
    m = json.loads(man.read_text())
    assert m["complete"] is False and m["expected"] == {"prompts": 12}
    with pytest.raises(InputError, match="incomplete row dataset.*rerun the same `evictlab capture`"):
        RowStore.open(killed)
    # resume and the reference run in-process (same run_capture as the CLI; saves two
    # interpreter start-ups, which dominate this test's time)
    from evictlab.models.loading import load_model

    model, tok = load_model(str(folder))
    cfg = CaptureConfig(model=str(folder), source="multi_key", context=300, positions=3, prompts=12,
                        rows_per_shard=1)
    s = run_capture(cfg, killed, model=model, tokenizer=tok, progress=False)
    assert s.prompts_skipped >= 2 and s.rows_total == 12 * 2 * 4 * 3
    full = tmp_path / "full"
    run_capture(cfg, full, model=model, tokenizer=tok, progress=False)
    m1, p1, v1 = _content(full)
    m2, p2, v2 = _content(killed)
    cols = [c for c in m1.columns if c not in ("shard", "local")]
    assert m1.select(cols).equals(m2.select(cols))
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(v1, v2)
    assert RowStore.open(killed).prompts["prompt_id"].sort().to_list() == list(range(12))
    assert json.loads(man.read_text())["complete"] is True
