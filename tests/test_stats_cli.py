"""`evictlab predictor fit/eval` through the CLI: files written, transfer table, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from evictlab.cli import app
from evictlab.errors import CorruptFileError, InputError
from evictlab.stats.planted import planted_results

runner = CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    a, b = d / "a.parquet", d / "b.parquet"
    planted_results(1500, seed=1).write_parquet(a)
    planted_results(800, seed=2, model="other", a=-1.5, b=3.0).write_parquet(b)
    return {"dir": d, "a": a, "b": b}


def test_fit_then_eval_on_other_model(files: dict[str, Path]) -> None:
    pj = files["dir"] / "pred.json"
    r = runner.invoke(app, ["predictor", "fit", str(files["a"]), "--out", str(pj), "--features", "extended", "--n-boot", "50"])
    assert r.exit_code == 0, r.output
    d = json.loads(pj.read_text())
    assert d["format"] == "evictlab.predictor" and d["version"] == 1
    assert d["features"] == ["dropped_mass", "entropy_norm", "log2_s", "depth"]
    assert d["metadata"]["models"] == ["planted"] and len(d["metadata"]["held_out_auc"]) == 5
    assert (files["dir"] / "pred.run_record.json").exists()
    out = files["dir"] / "eval.parquet"
    r = runner.invoke(app, ["predictor", "eval", str(pj), str(files["b"]), "--out", str(out), "--n-boot", "50"])
    assert r.exit_code == 0, r.output
    t = pl.read_parquet(out)
    assert set(t["model"].to_list()) == {"other"} and t.height == 5
    assert (t["auc"] > 0.65).all() and (t["auc_lo"] <= t["auc"]).all()


def test_eval_errors(files: dict[str, Path]) -> None:
    bad = files["dir"] / "v2.json"
    bad.write_text(json.dumps({"format": "evictlab.predictor", "version": 2}))
    r = runner.invoke(app, ["predictor", "eval", str(bad), str(files["b"])])
    assert isinstance(r.exception, InputError) and "version 2" in str(r.exception)
    junk = files["dir"] / "junk.json"
    junk.write_text("[1, 2")
    r = runner.invoke(app, ["predictor", "eval", str(junk), str(files["b"])])
    assert isinstance(r.exception, CorruptFileError)
    r = runner.invoke(app, ["predictor", "fit", str(files["a"]), "--out", str(files["dir"] / "x.json"), "--features", "mass,wat"])
    assert isinstance(r.exception, InputError) and "--features" in str(r.exception)
    r = runner.invoke(app, ["predictor", "fit", str(files["dir"] / "nope.parquet"), "--out", str(files["dir"] / "x.json")])
    assert isinstance(r.exception, InputError) and "no such results file" in str(r.exception)
