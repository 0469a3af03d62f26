"""``evictlab decode`` and ``evictlab audit`` through the entry point: bad input is one line
naming an option of the command the user ran, exit 2, before any model loads; method
parameters; budgets above the full cache; outputs (tiny local model folder, no download)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from evictlab import cli
from evictlab.capture.testing import save_tiny_folder
from cli_helpers import run_cli


def _options(command: str) -> set[str]:
    """The option names of ``evictlab COMMAND``."""
    import typer.main

    cmd = typer.main.get_command(cli.app).commands[command]
    return {o for p in cmd.params for o in p.opts}


def _main(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """Run ``evictlab.cli.main`` (the console entry point) in-process; (exit code, stderr)."""
    code, _, err = run_cli(argv, capsys, monkeypatch)
    return code, err


def _subprocess(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EVICTLAB_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "evictlab.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def _assert_one_line_naming(stderr: str, option: str, command: str) -> None:
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith(f"error: {option}: ") and "Fix:" in errors[0], errors[0]
    assert option in _options(command), f"{option} is not an option of `evictlab {command}`"


DECODE_BAD = [
    (["--method", "bogus"], "--method"),
    (["--method", "snapkv+bogus"], "--method"),
    (["--method", "oracle"], "--method"),  # needs the future; decode is greedy
    (["--scorer-param", "windw=3"], "--scorer-param"),
    (["--scorer-param", "window=x"], "--scorer-param"),
    (["--scorer-param", "window"], "--scorer-param"),
    (["--method", "snapkv+adakv", "--allocator-param", "alpha=2"], "--allocator-param"),
    (["--allocator-param", "alpha=0.3"], "--allocator-param"),  # uniform takes no parameters
    (["--task", "bogus"], "--task"),
    (["--store", "bogus"], "--store"),
    (["--budget", "abc"], "--budget"),
    (["--budget", "0"], "--budget"),
    (["--chunk", "0"], "--chunk"),
    (["--compress-every", "0"], "--compress-every"),
    (["--sinks", "-1"], "--sinks"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
]
AUDIT_BAD = [
    (["--methods", ""], "--methods"),
    (["--methods", " , "], "--methods"),
    (["--methods", "snapkv,snapkv"], "--methods"),
    (["--methods", "snapkv,nope+adakv"], "--methods"),
    (["--budget", "32", "--budget", "32"], "--budget"),
    (["--budget", "32", "--budget", "32/cell"], "--budget"),
    (["--budget", "-3"], "--budget"),
    (["--task", "needle,bogus"], "--task"),
    (["--task", "needle,needle"], "--task"),
    (["--methods", "snapkv+adakv", "--allocator-param", "beta=2"], "--allocator-param"),
    (["--methods", "snapkv,h2o", "--scorer-param", "kvzip.window=3"], "--scorer-param"),
    (["--methods", "snapkv,h2o", "--scorer-param", "window=0"], "--scorer-param"),
    (["--n", "0"], "--n"),
    (["--window", "0"], "--window"),
]


@pytest.mark.parametrize(("command", "args", "option"),
                         [("decode", a, o) for a, o in DECODE_BAD] + [("audit", a, o) for a, o in AUDIT_BAD])
def test_bad_input_names_an_option_of_the_command(command: str, args: list[str], option: str, tmp_path: Path,
                                                  capsys, monkeypatch) -> None:
    """Each refusal: exit 2, one `error: --option: ... Fix: ...` line, the option exists on
    that command, nothing written, and no model loaded (the --model path does not exist,
    so reaching the loader would name --model instead)."""
    out = tmp_path / ("a.parquet" if command == "audit" else "d.json")
    rc, err = _main([command, "--model", str(tmp_path / "no-model"), *args, "--out", str(out)], capsys,
                    monkeypatch)
    assert rc == 2
    _assert_one_line_naming(err, option, command)
    assert not any(tmp_path.iterdir())


def test_real_entry_point_subprocess(tmp_path: Path) -> None:
    """The same through ``python -m evictlab.cli`` (two cases): the wrong option names the
    old code printed (`--methods` for decode, `--source` for --task) are gone."""
    res = _subprocess("decode", "--method", "bogus", "--out", "d.json", cwd=tmp_path)
    assert res.returncode == 2
    _assert_one_line_naming(res.stderr, "--method", "decode")
    res = _subprocess("audit", "--methods", "snapkv", "--task", "bogus", "--out", "a.parquet", cwd=tmp_path)
    assert res.returncode == 2
    _assert_one_line_naming(res.stderr, "--task", "audit")
    assert not (tmp_path / "a.parquet").exists() and not (tmp_path / "d.json").exists()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "olmo2"
    save_tiny_folder(folder)
    return folder


def test_decode_budget_above_the_full_cache_is_stated(tiny_folder: Path, tmp_path: Path, capsys,
                                                      monkeypatch) -> None:
    out = tmp_path / "d.json"
    rc, err = _main(["decode", "--model", str(tiny_folder), "--budget", "2GiB", "--context", "96",
                     "--max-new-tokens", "3", "--threads", "1", "--out", str(out)], capsys, monkeypatch)
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert res["compressions"] == 0 and res["budget_effective_tokens"] < res["budget_tokens"]
    assert "nothing was evicted" in err
    # The pool: the full cache plus at most one partial page per cell and the null block
    # (2 layers x 2 KV heads, pages of 16 entries of 2 x 16 x 4 bytes).
    assert res["bytes_allocated_peak"] <= res["bytes_full_cache"] + (4 + 1) * 16 * 128
    assert (tmp_path / "d.run_record.json").exists()


def test_decode_params_reach_the_method_and_the_record(tiny_folder: Path, tmp_path: Path, capsys,
                                                       monkeypatch) -> None:
    out = tmp_path / "d.json"
    rc, err = _main(["decode", "--model", str(tiny_folder), "--method", "snapkv+adakv", "--budget", "24",
                     "--scorer-param", "window=8", "--scorer-param", "pooling=max", "--allocator-param", "alpha=0.5",
                     "--context", "96", "--chunk", "32", "--recent", "4", "--max-new-tokens", "3", "--threads", "1",
                     "--out", str(out)], capsys, monkeypatch)
    assert rc == 0, err
    res = json.loads(out.read_text())
    assert res["scorer_params"] == {"window": 8, "pooling": "max"} and res["allocator_params"] == {"alpha": 0.5}
    assert res["compressions"] >= 1 and res["budget_effective_tokens"] == res["budget_tokens"] == 24 * 4
    record = json.loads((tmp_path / "d.run_record.json").read_text())
    assert record["config"]["allocator_params"] == {"alpha": 0.5}


def test_decode_budget_below_the_floor_names_budget(tiny_folder: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    rc, err = _main(["decode", "--model", str(tiny_folder), "--budget", "4", "--context", "96", "--threads", "1",
                     "--out", str(tmp_path / "d.json")], capsys, monkeypatch)
    assert rc == 2
    _assert_one_line_naming(err, "--budget", "decode")
    assert "always-kept" in err and not (tmp_path / "d.json").exists()


def test_audit_writes_every_output_with_params_per_method(tiny_folder: Path, tmp_path: Path, capsys,
                                                          monkeypatch) -> None:
    out = tmp_path / "a.parquet"
    rc, err = _main(["audit", "--model", str(tiny_folder), "--methods", "snapkv,h2o+adakv", "--budget", "24",
                     "--budget", "100000", "--allocator-param", "alpha=0.5", "--n", "1", "--context", "96",
                     "--chunk", "32", "--recent", "4", "--threads", "1", "--out", str(out)], capsys, monkeypatch)
    assert rc == 0, err
    df = pl.read_parquet(out)
    assert df.height == 1 + 2 * 2 * 2
    rows = df.filter(pl.col("mode") != "full")
    assert set(rows.filter(pl.col("allocator") == "adakv")["allocator_params"]) == {'{"alpha": 0.5}'}
    assert set(rows.filter(pl.col("allocator") == "uniform")["allocator_params"]) == {"{}"}
    assert set(rows["protocol"]) == {"query-agnostic"}
    big = rows.filter(pl.col("budget_value") == 100000)
    assert (big["budget_effective_tokens"] < big["budget_tokens"]).all()
    phys = big.filter(pl.col("mode") == "physical")
    assert (phys["bytes_allocated"] <= phys["bytes_full_cache"] + 5 * 16 * 128).all()
    for suffix in (".png", ".pdf", ".md", ".run_record.json"):
        assert out.with_suffix(suffix).exists()


@pytest.mark.parametrize("command", ["decode", "audit"])
def test_out_is_checked_before_any_work(command: str, tmp_path: Path, capsys, monkeypatch) -> None:
    """The project's output rule: an existing --out needs --overwrite, a directory is not a
    file, the folder must exist; all refused before the model loads."""
    existing = tmp_path / "done.out"
    existing.write_text("a finished result")
    for out, problem in ((existing, "already exists"), (tmp_path, "is a directory"),
                         (tmp_path / "missing" / "x.out", "does not exist")):
        rc, err = _main([command, "--model", str(tmp_path / "no-model"), "--out", str(out)], capsys, monkeypatch)
        assert rc == 2 and problem in err
        _assert_one_line_naming(err, "--out", command)
    assert existing.read_text() == "a finished result"
    # With --overwrite the check passes and the next problem (the model) is reported instead.
    rc, err = _main([command, "--model", str(tmp_path / "no-model"), "--out", str(existing), "--overwrite"],
                    capsys, monkeypatch)
    assert rc == 2
    _assert_one_line_naming(err, "--model", command)
