"""The masked-vs-physical audit table, figure and report (tiny model), and the CLI commands
(real default model, short context)."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.decode.audit import Example, run_audit
from evictlab.decode.loop import DecodeConfig
from evictlab.errors import InputError
from evictlab.kv.budget import Budget
from evictlab.methods import parse_method
from evictlab.plots.audit import audit_bars
from evictlab.report.audit import audit_markdown

REQUIRED = ["method", "mode", "budget_tokens", "bytes_budget", "bytes_live", "bytes_allocated", "bytes_full_cache",
            "peak_rss", "exact_match", "kl", "top1_agreement", "answer_ppl", "freed_fraction"]


def test_audit_table_masked_never_counted_as_freed(tmp_path) -> None:
    torch.set_num_threads(1)  # far faster than two on a shared 2-core machine
    model, _ = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ex = [Example("synthetic", torch.randint(3, 256, (150,), generator=g).tolist(),
                  torch.randint(3, 256, (5,), generator=g).tolist(), torch.randint(3, 256, (4,), generator=g).tolist())]
    base = DecodeConfig(chunk_size=50, compress_every=4, block_size=8, sinks=2, recent=6, window=8)
    df = run_audit(model, ex, ["snapkv", "h2o+adakv"], [Budget("tokens_per_cell", 24), Budget("tokens_per_cell", 48)],
                   base=base)
    assert set(REQUIRED) <= set(df.columns)
    assert df.height == 1 + 2 * 2 * 2
    assert set(df["mode"]) == {"full", "masked", "physical"}
    phys = df.filter(pl.col("mode") == "physical").sort("method", "budget_tokens")
    mask = df.filter(pl.col("mode") == "masked").sort("method", "budget_tokens")
    # Same kept entries -> same fidelity; different bytes.
    for col in ("kl", "top1_agreement", "exact_match"):
        assert phys[col].to_list() == pytest.approx(mask[col].to_list(), abs=1e-6)
    assert (mask["freed_fraction"] == 0).all()
    assert (phys["freed_fraction"] > 0.5).all()
    assert (phys["bytes_live"] == phys["bytes_budget"]).all()
    assert (mask["bytes_live"] > 3 * mask["bytes_budget"]).all()
    fig = audit_bars(df, tmp_path / "audit")
    assert all(p.exists() and p.stat().st_size > 1000 for p in (fig.png, fig.pdf))
    md = audit_markdown(df, model="tiny", config={"x": 1}, figure="audit.png")
    assert "never" in md and "| snapkv | physical |" in md


def test_parse_method() -> None:
    assert parse_method("snapkv") == ("snapkv", "uniform")
    assert parse_method("h2o+adakv") == ("h2o", "adakv")
    with pytest.raises(InputError):
        parse_method("nope")
    with pytest.raises(InputError):
        parse_method("snapkv+nope")


@pytest.mark.model
@pytest.mark.slow
def test_decode_cli_real_model(tmp_path) -> None:
    from typer.testing import CliRunner

    from evictlab.cli import app

    out = tmp_path / "d.json"
    res = CliRunner().invoke(app, ["decode", "--method", "snapkv+adakv", "--budget", "24", "--context", "96",
                                   "--max-new-tokens", "3", "--chunk", "48", "--compress-every", "2",
                                   "--recent", "8", "--threads", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["mode"] == "physical" and data["compressions"] >= 2
    assert data["bytes_live_after_compression"] == 24 * 30 * 3 * 2 * 64 * 4
    assert (tmp_path / "d.run.json").exists()
    bad = CliRunner().invoke(app, ["decode", "--mode", "nope", "--out", str(out)])
    assert bad.exit_code != 0
