"""``evictlab contour fit`` and ContourKV / ``--trace`` on ``decode`` and ``audit`` through the
entry point: outputs, and bad input as one line naming an option, exit 2 (tiny local model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest

from evictlab import cli
from evictlab.capture.testing import save_tiny_folder
from evictlab.record import record_path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """``evictlab ARGV`` in-process through the console entry point: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["evictlab", *argv])
    try:
        cli.main()
        return 0, capsys.readouterr().err
    except SystemExit as exc:
        return int(exc.code or 0), capsys.readouterr().err


def _one_error(err: str, field: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"error: {field}") and "Fix:" in lines[0], lines[0]


@pytest.fixture(scope="module")
def synth_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from evictlab.rows.synth import SynthConfig, synthesize

    out = tmp_path_factory.mktemp("rows") / "syn"
    synthesize(out, SynthConfig(rows=200, keys=32, dim=8, seed=0))
    return out


def test_contour_fit_writes_a_profile_and_refuses_bad_input(synth_rows: Path, tmp_path: Path, capsys,
                                                           monkeypatch) -> None:
    out = tmp_path / "c.json"
    rc, err = _run(["contour", "fit", str(synth_rows), "--out", str(out)], capsys, monkeypatch)
    assert rc == 0, err
    d = json.loads(out.read_text())
    assert d["format"] == "evictlab.contour" and d["version"] == 1 and len(d["cells"]) == 1
    assert d["source"]["rows_used"] == 200 and json.loads(record_path(out).read_text())["kind"] == "contour.fit"
    assert "flattest" in err
    rc, err = _run(["contour", "fit", str(synth_rows), "--out", str(out)], capsys, monkeypatch)
    assert rc == 2
    _one_error(err, "--out")
    rc, err = _run(["contour", "fit", str(tmp_path / "nope"), "--out", str(tmp_path / "d.json")], capsys, monkeypatch)
    assert rc == 2 and "no such row dataset" in err
    _one_error(err, str(tmp_path / "nope"))
    rc, err = _run(["contour", "fit", str(synth_rows), str(tmp_path / "r.parquet"), "--out", str(tmp_path / "d.json")],
                   capsys, monkeypatch)
    assert rc == 2 and "no such results file" in err
    rc, err = _run(["contour", "fit", str(synth_rows), "--predictor", str(tmp_path / "p.json"), "--out",
                    str(tmp_path / "d.json")], capsys, monkeypatch)
    assert rc == 2 and "no such predictor file" in err
    assert not (tmp_path / "d.json").exists()


def test_contour_fit_interrupted_exit_matches_what_happened(synth_rows: Path, tmp_path: Path, capsys,
                                                            monkeypatch) -> None:
    """Issue 28, item 4: a Ctrl-C after the profile was written (while the summary prints)
    used to print "wrote", then "interrupted", exit 130, and the rerun was refused. Now a
    finished write is success (exit 0, one note), and an interrupt before it is a clean 130
    that leaves no --out, so the same command runs again."""
    import rich.console

    from evictlab.contour.profile import ContourProfile

    out = tmp_path / "c.json"

    def ctrl_c(*a, **k):  # noqa: ANN002, ANN003
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ContourProfile, "save", ctrl_c)  # before the profile is written
        rc, err = _run(["contour", "fit", str(synth_rows), "--out", str(out)], capsys, monkeypatch)
    assert rc == 130 and "interrupted; rerun the same command to resume" in err and not out.exists()
    with monkeypatch.context() as m:
        m.setattr(rich.console.Console, "print", ctrl_c)  # after: while the summary table prints
        rc, err = _run(["contour", "fit", str(synth_rows), "--out", str(out)], capsys, monkeypatch)
    assert rc == 0 and out.is_file() and record_path(out).is_file(), err
    assert "interrupted; rerun" not in err and f"interrupted after the outputs were complete ({out})" in err
    assert json.loads(out.read_text())["format"] == "evictlab.contour"


def test_demo_refuses_a_bogus_model_name_before_any_work(tmp_path: Path, capsys, monkeypatch) -> None:
    """Issue 28, item 4: `demo --second-model bogus` used to capture and solve for ~90 s first."""
    import evictlab.pipeline.command as command

    def no_work(*a, **k):  # noqa: ANN002, ANN003
        raise AssertionError("a stage ran before the model names were checked")

    monkeypatch.setattr(command, "rows_and_results", no_work)
    monkeypatch.setattr(command, "contour_start", no_work)
    for argv, field in ((["--second-model", "bogus"], "--second-model"), (["--model", "bogus"], "--model")):
        rc, err = _run(["demo", "--runs", str(tmp_path), *argv], capsys, monkeypatch)
        assert rc == 2 and "interrupted" not in err
        _one_error(err, field)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "olmo2"
    save_tiny_folder(folder)
    return folder


_DECODE = ["--context", "96", "--chunk", "32", "--recent", "4", "--window", "8", "--max-new-tokens", "3",
           "--threads", "1"]


def test_decode_contourkv_with_a_trace(tiny_folder: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out, trace = tmp_path / "d.json", tmp_path / "t.parquet"
    rc, err = _run(["decode", "--model", str(tiny_folder), "--method", "snapkv+contourkv", "--budget", "24",
                    "--trace", str(trace), *_DECODE, "--out", str(out)], capsys, monkeypatch)
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert res["trace"] == str(trace) and res["compressions"] >= 1
    assert res["bytes_live_after_compression"] == res["budget_tokens"] * 2 * 16 * 4  # 2 x head_dim 16 x float32
    df = pl.read_parquet(trace)
    assert df.height == res["compressions"] * 2 * 2  # 2 layers x 2 KV heads
    assert set(df["method"]) == {"snapkv+contourkv"} and set(df["protocol"]) == {"query-agnostic"}
    assert df.group_by("compression").agg(pl.col("kept").sum())["kept"].to_list() == [24 * 4] * res["compressions"]
    record = json.loads(record_path(out).read_text())
    assert str(trace) in record["outputs"]


def test_decode_contourkv_refusals(tiny_folder: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from evictlab.contour.profile import GRID, ContourProfile

    base = ["decode", "--model", str(tiny_folder), "--method", "snapkv+contourkv", "--budget", "24", *_DECODE,
            "--out", str(tmp_path / "d.json")]
    cases = [
        (["--allocator-param", f"profile={tmp_path / 'missing.json'}"], "--allocator-param", "no such profile file"),
        (["--allocator-param", "profle=x.json"], "--allocator-param", "has no parameter profle"),
        (["--store", "full", "--trace", str(tmp_path / "t.parquet")], "--trace", "nothing to trace"),
        (["--trace", str(tmp_path / "t.parquet"), "--trace-max-subsets", "0"], "--trace-max-subsets", ">= 1"),
        (["--trace", str(tmp_path / "d.json")], "--trace", "is also --out"),
        (["--trace", str(tmp_path / "no" / "t.parquet")], "--trace", "does not exist"),
    ]
    import numpy as np

    other = ContourProfile("other", {"n_layers": 3, "kv_heads": 2, "q_heads": 4, "head_dim": 16,
                                     "windows": [None] * 3},
                           GRID.copy(), np.tile(1 - GRID, (3, 2, 1)), np.zeros((3, 2)), np.ones((3, 2), np.int64),
                           np.ones((3, 2)), {})
    other.save(tmp_path / "other.json")
    cases.append((["--allocator-param", f"profile={tmp_path / 'other.json'}"], "--allocator-param",
                  "was fitted on another model geometry (n_layers 3 in the profile, 2 in the model"))
    # the shipped profiles describe other models: profile=default is refused, before the run
    cases.append((["--allocator-param", "profile=default"], "--allocator-param",
                  "profile=default: no shipped profile describes this model's geometry"))
    cases.append((["--method", "snapkv+contourkv_offline"], "--allocator-param", "shipped: gemma3-270m, smollm2-135m"))
    cases.append((["--method", "snapkv+contourkv_error", "--allocator-param", "ranking=query"], "--allocator-param",
                  "contourkv_error parameter ranking='query'"))
    for args, option, problem in cases:
        rc, err = _run([*base, *args], capsys, monkeypatch)
        assert rc == 2, (args, err)
        _one_error(err, option)
        assert problem in err, (args, err)
    assert not (tmp_path / "d.json").exists() and not (tmp_path / "t.parquet").exists()


def test_audit_traces_every_run(tiny_folder: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out, trace = tmp_path / "a.parquet", tmp_path / "t.parquet"
    rc, err = _run(["audit", "--model", str(tiny_folder), "--methods", "snapkv+contourkv,snapkv+adakv",
                    "--budget", "24", "--n", "1", "--context", "96", "--chunk", "32", "--recent", "4",
                    "--threads", "1", "--trace", str(trace), "--out", str(out)], capsys, monkeypatch)
    assert rc == 0, err
    df = pl.read_parquet(trace)
    assert set(df["method"]) == {"snapkv+contourkv", "snapkv+adakv"} and set(df["mode"]) == {"masked", "physical"}
    assert set(df["task"]) == {"needle"} and set(df["example"]) == {0}
    audit = pl.read_parquet(out).filter(pl.col("mode") == "physical")
    assert (audit["bytes_live"] == audit["bytes_budget"]).all()
