"""The masked-vs-physical audit table, figure and report (tiny model), and the CLI commands
(real default model, short context)."""

from __future__ import annotations

import json

import polars as pl
import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.decode.audit import Example, audit_configs, run_audit
from evictlab.decode.config import LoopSettings
from evictlab.errors import InputError
from evictlab.kv.budget import Budget
from evictlab.methods import parse_method
from evictlab.plots.audit import audit_bars
from evictlab.decode.audit_report import audit_markdown

REQUIRED = ["method", "mode", "budget_tokens", "bytes_budget", "bytes_live", "bytes_allocated", "bytes_full_cache",
            "peak_rss", "exact_match", "kl", "top1_agreement", "answer_ppl", "freed_fraction"]


def test_audit_table_masked_never_counted_as_freed(tmp_path) -> None:
    torch.set_num_threads(1)  # far faster than two on a shared 2-core machine
    model, _ = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ex = [Example("synthetic", torch.randint(3, 256, (150,), generator=g).tolist(),
                  torch.randint(3, 256, (5,), generator=g).tolist(), torch.randint(3, 256, (4,), generator=g).tolist())]
    loop = LoopSettings(chunk_size=50, compress_every=4, block_size=8, sinks=2, recent=6, window=8)
    df = run_audit(model, ex, audit_configs(["snapkv", "h2o+adakv"],
                                            [Budget("tokens_per_cell", 24), Budget("tokens_per_cell", 48)], loop=loop))
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
    assert (tmp_path / "d.run_record.json").exists()
    bad = CliRunner().invoke(app, ["decode", "--store", "nope", "--out", str(out), "--overwrite"])
    assert bad.exit_code != 0


def test_run_audit_validates_everything_before_running(monkeypatch) -> None:
    """Empty or repeated methods/budgets, bad parameters and budgets below the floor are
    refused before the full-cache reference runs (it used to run first, then crash)."""
    import evictlab.decode.audit as audit_mod

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("nothing may run before validation")

    monkeypatch.setattr(audit_mod, "run_sequence", boom)
    model, _ = tiny_model("llama")
    ex = [Example("synthetic", list(range(3, 103)), [5, 6], [7])]
    b = Budget("tokens_per_cell", 24)
    cases = [
        (dict(methods=[], budgets=[b]), "method: no method"),
        (dict(methods=["snapkv", "snapkv"], budgets=[b]), "method: method snapkv is given twice"),
        (dict(methods=["snapkv"], budgets=[b, Budget("tokens_per_cell", 24)]), "budget: budget 24 tokens_per_cell"),
        (dict(methods=["snapkv"], budgets=[]), "budget: no budget"),
        (dict(methods=["snapkv"], budgets=[b], modes=["masked", "nope"]), "mode: unknown mode 'nope'"),
        (dict(methods=["snapkv+adakv"], budgets=[b], allocator_params={"alpha": "2"}), "allocator_param"),
        (dict(methods=["snapkv"], budgets=[Budget("tokens_per_cell", 2)]), "budget: .* below the .* always-kept"),
    ]
    for kw, msg in cases:
        with pytest.raises(InputError, match=msg):
            run_audit(model, ex, audit_configs(**kw))
