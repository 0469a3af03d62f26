"""benchmarks/gpu_check.sh, the script prepared for a lent GPU machine, rehearsed on the CPU at
a small size (tiny model, one example at 160 tokens): every step runs and writes its results
where docs/performance.md ("The GPU check") says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _eval_run_options() -> set[str]:
    import typer

    from evictlab.eval.commands import eval_app

    cmd = typer.main.get_command(eval_app).commands["run"]
    return {o for p in cmd.params for o in getattr(p, "opts", [])}


def test_gpu_check_refuses_bad_arguments() -> None:
    for args, needle in ((["--device", "tpu"], "--device tpu"), (["--bogus"], "unknown argument --bogus"),
                         (["--config", "nope.toml"], "--config nope.toml")):
        p = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and needle in p.stderr and "Fix:" in p.stderr


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_at_a_small_size(tmp_path: Path) -> None:
    missing = [o for o in ("--config", "--prefill") if o not in _eval_run_options()]
    if missing:
        pytest.skip(f"`evictlab eval run` has no {' or '.join(missing)} yet (issue 23 items 1 and 6, the grid "
                    "engine): the GPU check's claim grid runs `eval run --config experiments/gpu_check.toml`")
    from evictlab.capture.testing import save_tiny_folder

    model = tmp_path / "llama"
    save_tiny_folder(model, "llama")
    out = tmp_path / "check"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--small", "--model", str(model), "--out", str(out),
                        "--python", sys.executable, "--peer-venv", str(tmp_path / "no-venv")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    summary = json.loads((out / "summary.json").read_text())
    assert p.returncode == 0 and summary["ok"], (p.stderr[-3000:], (out / "gpu_check.log").read_text()[-3000:])
    assert [s["step"] for s in summary["steps"]] == ["cuda_tests", "bench_decode", "grid", "compare"]
    env_json = json.loads((out / "env.json").read_text())
    assert env_json["device"] == "cpu" and env_json["cuda_available"] is False
    assert "skipped" in (out / "cuda_tests.log").read_text()  # on a CPU the CUDA tests skip, by name
    bench = json.loads((out / "bench_decode.json").read_text())
    assert {r["run"] for r in bench["results"]} == {"full", "snapkv", "shared_prefill"}
    ratios = {r["ratio"]: r for r in bench["ratios"]}
    assert ratios["shared prefill / full prefill"]["median"] > 0 and ratios["shared prefill / full prefill"][
        "target"] == "<= 1.05"
    res = pl.read_parquet(out / "grid" / "results.parquet")
    assert set(res["method"]) == {"snapkv+adakv", "expected_attention+adakv", "full"}  # the config's methods
    assert set(res.filter(pl.col("method") != "full")["mode"]) == {"physical", "uniform", "masked"}
    assert set(res["context"]) == {160} and set(res["device"].drop_nulls()) <= {"cpu"}  # the overrides won
    md = (out / "grid" / "pairs.md").read_text()
    assert "## Configurations: the papers' unit" in md
    text = (out / "summary.md").read_text()
    assert "| grid | ok |" in text and "kvpress skipped" in text
