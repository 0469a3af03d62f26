"""The main job's analysis stages on a small planted results table: report, tables and figures exist and are non-empty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest

from evictlab.pipeline import AnalysisConfig, analyse, parse_budgets
from evictlab.errors import InputError
from evictlab.stats.planted import planted_results


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    df = pl.concat([planted_results(400, seed=1, search_all=True),
                    planted_results(300, seed=2, model="planted-b", a=-1.0, b=3.0, search_all=True)])
    cert = planted_results(200, budgets=(4, 8), seed=3, certify=True, search_all=True)
    analyse(df, out, AnalysisConfig(n_boot=50, n_boot_cells=20, hardness_trials=4, hardness_size=6),
            log=lambda m: None, cert_results=cert, contour=_contour_result(out))
    return out


def test_report_written_with_claims_and_definitions(run_dir: Path) -> None:
    text = (run_dir / "report.md").read_text()
    for needle in ("Claims of \"Trust the Mass\"", "| claim | paper value |", "0.021-0.047", "AUC 0.76-0.89",
                   "NP-complete", "(ours)", "Q4", "Budgets s = 4, 8, 16, 32", "Cross-model transfer",
                   "e(T_s)=0", "Eviction: none performed",
                   "Certified optimum ES(s) vs pool optimum ES_hat(s) (certification pass",
                   # the interval method is stated next to the intervals, the row bootstrap only as a comparison
                   "cluster bootstrap that resamples prompts, then rows", "interval method",
                   "Interval method: `cluster bootstrap: prompt > row", "row bootstrap (comparison only)",
                   "cluster bootstrap: model > prompt > row (2 models", "### Pooled over models",
                   "How much of the variation is between prompts", "ICC gap closed (ranks)",
                   "## The selection ceiling beyond the candidate pool", "all-key search [95% CI]",
                   "bracket of the median true ceiling", "| certification pass | planted | 8 |"):
        assert needle in text, needle
    # every figure the report links exists and is non-empty, as PNG and PDF
    links = [line.split("](")[1].split(")")[0] for line in text.splitlines() if line.startswith("![")]
    assert len(links) == 9  # beyond the pool (main, certification), gap medians, ECDF, pi(s), ROC, mass-kappa, 2 heatmaps
    for rel in links:
        png = run_dir / rel
        assert png.stat().st_size > 5000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pdf = png.with_suffix(".pdf")
        assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5000


def test_tables_one_row_per_observation(run_dir: Path) -> None:
    s = pl.read_parquet(run_dir / "tables" / "summary_model_s.parquet")
    assert s.height == 8 and s.select("model", "s").n_unique() == 8
    cells = pl.read_parquet(run_dir / "tables" / "summary_model_s_layer_head.parquet")
    assert cells.select("model", "s", "layer", "head").n_unique() == cells.height
    zero = pl.read_parquet(run_dir / "tables" / "e_top_zero_counts.parquet")
    assert int(zero["rows"].sum()) == 700 * 4
    auc = pl.read_parquet(run_dir / "tables" / "auc.parquet")
    assert {"dropped mass (raw)", "mass LR (held-out)", "extended LR (held-out)"} <= set(auc["predictor"].to_list())
    tr = pl.read_parquet(run_dir / "tables" / "auc_transfer.parquet")
    assert set(tr["trained_on"].to_list()) == {"planted", "planted-b"}
    claims = pl.read_parquet(run_dir / "tables" / "claims.parquet")
    ceiling = claims.filter(pl.col("claim_id") == "ceiling")
    assert ceiling.height == 12  # 2 models x 4 budgets + 4 pooled
    assert all(m.startswith("cluster bootstrap: ") for m in ceiling["interval"].to_list())
    assert s["interval"].str.starts_with("cluster bootstrap: prompt > row").all()
    assert {"gap_closed_median_icc", "gap_closed_median_row_lo", "prompts"} <= set(s.columns)
    assert {"ceiling", "penalty", "penalty-trend", "auc", "np-hardness", "certified"} <= set(claims["claim_id"].to_list())
    cs = pl.read_parquet(run_dir / "tables" / "certified_summary.parquet")
    assert cs["s"].to_list() == [4, 8] and (cs["rows_certified"] == 200).all()
    # planted: the certified optimum beats the pool on 1 - 0.9 x 0.7 = 37% (10% certificate, 30% all-key)
    assert (0.25 < cs["cert_beats_pool_frac"]).all() and (cs["cert_beats_pool_frac"] < 0.5).all()
    hard = claims.filter(pl.col("claim_id") == "np-hardness").row(0, named=True)
    assert hard["verdict"].startswith("consistent")
    assert len(list((run_dir / "predictors").glob("*.json"))) == 4
    # beyond the pool: both passes, per model and s, never pooled; the planted relations come back
    bp = pl.read_parquet(run_dir / "tables" / "beyond_pool_summary.parquet")
    assert bp.select("pass", "model", "s").rows() == [("main rows", m, s) for m in ("planted", "planted-b")
                                                       for s in (4, 8, 16, 32)] + \
        [("certification pass", "planted", 4), ("certification pass", "planted", 8)]
    assert (bp["pool_miss_frac"] > 0.2).all() and (bp["pool_miss_frac"] < 0.4).all()  # planted: 30%
    assert (bp["gap_ls_median"] >= bp["gap_pool_median"]).all()
    main, cert = bp.filter(pl.col("pass") == "main rows"), bp.filter(pl.col("pass") == "certification pass")
    assert (main["rows_cert_attempted"] == 0).all() and (cert["rows_certified"] == cert["rows_used"]).all()
    assert bp["interval"].str.starts_with("cluster bootstrap: prompt > row").all()
    beyond = claims.filter(pl.col("claim_id") == "ceiling_beyond_pool")
    assert beyond.height == 10 and beyond["rows"].str.contains("certification pass").sum() == 2


def test_search_pool_skips_the_beyond_pool_section(tmp_path: Path) -> None:
    """Results without the all-key columns: no section, no table, a note says why (solve with --search all)."""
    from evictlab.pipeline.analysis import beyond_pool_stage

    notes: list[str] = []
    df = planted_results(150, budgets=(4, 8), seed=1)
    beyond, figs = beyond_pool_stage(df, None, AnalysisConfig(n_boot=20), tmp_path / "t", tmp_path / "f", notes)
    assert beyond is None and figs == [] and not (tmp_path / "t").exists()
    assert len(notes) == 1 and "--search all" in notes[0]


def _contour_result(tmp: Path) -> Any:
    """A ContourResult from a hand-made grid: ContourKV wins 2 of 3 examples at 64/cell, ties at 128."""
    from evictlab.eval.claims.contour import contourkv_versus
    from evictlab.eval.runner import RESULT_COLUMNS
    from evictlab.pipeline.contour import ContourResult

    rows = []
    for method, budget, em in (("snapkv+contourkv", "64/cell", [1, 1, 0]), ("snapkv", "64/cell", [0, 0, 0]),
                               ("snapkv+contourkv", "128/cell", [1, 1, 1]), ("snapkv", "128/cell", [1, 1, 1]),
                               ("full", None, [1, 1, 1])):
        full = method == "full"
        for i, e in enumerate(em):
            rows.append({c: None for c in RESULT_COLUMNS} | {
                "model": "smollm2-135m", "task": "needle_word", "context": 512, "method": method,
                "mode": "full" if full else "physical", "scorer": None if full else "snapkv",
                "allocator": None if full else ("contourkv" if "+" in method else "uniform"),
                "protocol": "none" if full else "query-agnostic", "budget": budget, "example": i,
                "exact_match": float(e), "answer_logprob": -1.0, "ppl": 1.0, "bytes_live": 100})
    res = pl.DataFrame(rows, schema=RESULT_COLUMNS)
    claims, detail = contourkv_versus(res, n_boot=50)
    grid = {"models": ["smollm2-135m"], "tasks": ["needle_word"], "contexts": [512], "budgets": ["64", "128"],
            "methods": ["snapkv+contourkv", "snapkv"], "modes": ["physical"], "protocols": ["query-agnostic"], "n": 3}
    return ContourResult(grid=grid, folder=tmp / "contourkv", results=res, claims=claims, detail=detail)


def test_contourkv_section_in_the_report(run_dir: Path) -> None:
    tmp_path = run_dir
    text = (tmp_path / "report.md").read_text()
    assert "## ContourKV at matched bytes (decode loop, physical)" in text
    assert "1 wins / 1 ties / 0 losses over 2 comparisons" in text and "93 wins / 22 ties / 22 losses" in text
    assert "needle_word" in text and "full cache on the same examples" in text
    detail = pl.read_parquet(tmp_path / "tables" / "contourkv_comparisons.parquet")
    assert detail.sort("budget")["verdict"].to_list() == ["tie", "win"]
    ids = pl.read_parquet(tmp_path / "tables" / "claims.parquet")["claim_id"].to_list()
    assert "contourkv:contourkv_vs_uniform" in ids and "contourkv:vs_kvzip" in ids


def test_contour_stage_runs_eval_run_with_the_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from evictlab.pipeline import contour

    given = _contour_result(tmp_path)
    calls: list[list[str]] = []

    class FakeProc:  # the grid as a background process that has already finished
        def __init__(self, cmd: list[str]) -> None:
            assert cmd[1:3] == ["-m", "evictlab.cli"]
            calls.append(cmd[3:])
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            given.results.write_parquet(out / "results.parquet")

        def poll(self) -> int:
            return 0

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(contour.subprocess, "Popen", FakeProc)
    got = contour.contour_stage(given.grid, tmp_path / "c", AnalysisConfig(n_boot=20, threads=1), lambda m: None)
    assert calls == [["eval", "run", "--models", "smollm2-135m", "--tasks", "needle_word", "--context", "512",
                      "--budget", "64,128", "--methods", "snapkv+contourkv,snapkv", "--store", "physical",
                      "--protocol", "query-agnostic", "--n", "3", "--seed", "0", "--threads", "1", "--quiet",
                      "--out", str(tmp_path / "c")]]
    assert got.detail.height == 2 and {c.claim_id for c in got.claims} >= {"contourkv:contourkv_vs_uniform"}


def test_contour_job_failure_is_a_stage_error_and_stop_ends_a_running_grid(tmp_path: Path) -> None:
    """The background grid: a non-zero exit is a StageError naming the command; a job that
    fails or is interrupted stops the grid (terminate, then kill) instead of leaving it."""
    import subprocess
    import sys
    import time

    from evictlab.pipeline import contour
    from evictlab.pipeline.config import StageError

    failed = contour.ContourJob(proc=subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"]), grid={},
                               work=tmp_path, args=["eval", "run", "--bogus"], t0=time.perf_counter())
    with pytest.raises(StageError, match="evictlab eval run --bogus` exited with status 2"):
        contour.contour_finish(failed, AnalysisConfig(n_boot=20), lambda m: None)
    running = contour.ContourJob(proc=subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
                                grid={}, work=tmp_path, args=["eval", "run"], t0=time.perf_counter())
    running.stop()
    assert running.proc.poll() is not None
