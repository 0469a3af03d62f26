"""paper_repro scripts: each reads exactly its claim's rows, says how many, and writes its claim rows and figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from evictlab.stats.planted import planted_results

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "paper_repro" / script), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_claim_scripts_write_rows_and_figures(tmp_path: Path) -> None:
    res = tmp_path / "r.parquet"
    planted_results(300, seed=4).write_parquet(res)
    out = tmp_path / "out"
    figs = tmp_path / "figs"  # the default is the repository's figures/ folder
    common = ["--results", str(res), "--out", str(out), "--figures", str(figs), "--n-boot", "30",
              "--weights", "planted (test)"]
    printed = _run("claim_selection_ceiling.py", *common)
    assert "read 1,200 (row, s) pairs (results)" in printed
    _run("claim_np_hardness.py", "--trials", "4", "--size", "6", "--out", str(out), "--figures", str(figs))
    rows = json.loads((out / "claims.json").read_text())
    ids = {r["claim_id"] for r in rows}
    assert ids == {"ceiling", "np-hardness"}
    assert all(r["interval"].startswith("cluster bootstrap: prompt > row") for r in rows if r["claim_id"] == "ceiling")
    # re-running a script replaces its rows instead of duplicating them
    _run("claim_selection_ceiling.py", *common)
    assert len(json.loads((out / "claims.json").read_text())) == len(rows)
    md = (out / "claims.md").read_text()
    assert "| claim | paper value |" in md and "0.021-0.047" in md and "NP-complete" in md
    assert "interval method" in md and "`claim_selection_ceiling.py`: 1,200 (row, s) pairs" in md
    for name in ("ceiling_gap_closed_ecdf", "ceiling_gap_heatmap_planted", "np_hardness_times"):
        for ext in ("png", "pdf"):
            assert (figs / f"{name}.{ext}").stat().st_size > 3000
    assert "](../figs/np_hardness_times.png)" in md
    assert (out / "claim_np_hardness.run_record.json").exists()


@pytest.mark.slow
def test_certification_pass_is_its_own_claim(tmp_path: Path) -> None:
    """A demo run folder: main results and the certification pass are read by different scripts, never pooled."""
    run = tmp_path / "run"
    (run / "results").mkdir(parents=True)
    (run / "certified").mkdir()
    planted_results(300, seed=4).write_parquet(run / "results" / "planted.parquet")
    planted_results(120, budgets=(4, 8), seed=5, certify=True).write_parquet(run / "certified" / "planted.parquet")
    (run / "inputs.json").write_text(json.dumps({
        "results": {"planted": str(run / "results" / "planted.parquet")},
        "certified": {"planted": str(run / "certified" / "planted.parquet")}, "rows": {}}))
    out = tmp_path / "out"
    common = ["--run", str(run), "--out", str(out), "--figures", str(tmp_path / "figs"), "--n-boot", "30"]
    assert "read 1,200 (row, s) pairs (results)" in _run("claim_selection_ceiling.py", *common)
    assert "read 240 (row, s) pairs (certified)" in _run("claim_certified_pool.py", *common)
    claims = pl.DataFrame(json.loads((out / "claims.json").read_text()))
    ceiling = claims.filter(pl.col("claim_id") == "ceiling")
    assert ceiling.height == 4 and all("e(T_s)=0" in r for r in ceiling["rows"].to_list())
    assert sum(int(r.split(" used")[0].replace(",", "")) for r in ceiling["rows"].to_list()) <= 1200
    cert = claims.filter(pl.col("claim_id") == "certified")
    assert cert["budgets"].to_list() == ["s=4", "s=8"] and all("of 120" in r for r in cert["rows"].to_list())
    reads = json.loads((out / "inputs_read.json").read_text())
    assert reads["claim_selection_ceiling.py"]["pairs"] == 1200 and reads["claim_certified_pool.py"]["pairs"] == 240


@pytest.mark.slow
def test_penalty_script_uses_the_runs_rows(tmp_path: Path) -> None:
    """claim_penalty_trend.py reads the run's results and their rows, and states the s/head_dim check."""
    from evictlab.rows import SynthConfig, synthesize
    from evictlab.solve import SolveConfig, solve_rows

    run = tmp_path / "run"
    (run / "results").mkdir(parents=True)
    rows = tmp_path / "rows"
    synthesize(rows, SynthConfig(rows=48, keys=30, dim=6, seed=4, rows_per_block=8))
    res = run / "results" / "syn.parquet"
    solve_rows(rows, res, SolveConfig(budgets=(2, 4)), progress=False)
    (run / "inputs.json").write_text(json.dumps({"results": {"syn": str(res)}, "rows": {"synthetic": str(rows)},
                                                 "certified": {}}))
    out = tmp_path / "out"
    printed = _run("claim_penalty_trend.py", "--run", str(run), "--out", str(out), "--figures", str(tmp_path / "f"),
                   "--n-boot", "30", "--ablation-rows", "0")
    assert "read 96 (row, s) pairs (results)" in printed and "pi(s) vs s/head_dim:" in printed
    claims = json.loads((out / "claims.json").read_text())
    assert "penalty-head-dim" in {r["claim_id"] for r in claims}
    assert (tmp_path / "f" / "penalty_vs_head_dim.png").exists()


def test_every_script_exits_through_the_shared_entry() -> None:
    """Every paper_repro script's ``__main__`` is ``_common.entry(main)``: bad input one line
    (exit 2), Ctrl-C one line (exit 130), never a traceback."""
    scripts = [p for p in (ROOT / "paper_repro").glob("*.py") if not p.name.startswith("_")]
    assert scripts
    for p in scripts:
        tail = p.read_text().rsplit('if __name__ == "__main__":', 1)
        assert len(tail) == 2 and "entry(main)" in tail[1], p.name


def test_entry_turns_bad_input_and_ctrl_c_into_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from evictlab.errors import InputError

    monkeypatch.syspath_prepend(str(ROOT / "paper_repro"))
    from _common import entry

    def bad() -> int:
        raise InputError("--budget", "above the context", "use a smaller --budget")

    def interrupted() -> int:
        raise KeyboardInterrupt

    for fn, code, words in ((bad, 2, "error: --budget"), (interrupted, 130, "interrupted (Ctrl-C)"),
                            (lambda: 0, 0, None)):
        with pytest.raises(SystemExit) as exc:
            entry(fn)
        assert exc.value.code == code
        err = capsys.readouterr().err
        assert (err == "") if words is None else (err.startswith(words) and err.count("\n") == 1)
