"""`evictlab solve --search all` and the certificate options end to end: columns, the chain
es_cert <= es_ls <= es_hat, intervals, refusals, resume, determinism."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import polars as pl
import pytest

from evictlab.core import reference as ref
from evictlab.errors import InputError
from evictlab.rows.reader import RowStore
from evictlab.rows.synth import SynthConfig, synthesize
from evictlab.solve.runner import (
    CERT_COLUMNS, LS_COLUMNS, RESULT_COLUMNS, SolveConfig, parts_dir_for, solve_rows,
)

EVICTLAB = str(Path(sys.executable).with_name("evictlab"))


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("allkey") / "rows"
    synthesize(path, SynthConfig(rows=60, keys=40, dim=6, seed=5, rows_per_block=12, spread=0.4,
                                 rows_per_shard=25))
    return path


def test_cli_search_all_with_certificate(rows: Path, tmp_path: Path) -> None:
    out = tmp_path / "res.parquet"
    r = subprocess.run([EVICTLAB, "solve", str(rows), "--keep", "2", "4", "6", "--search", "all",
                        "--certify", "--threads", "1", "--chunk-rows", "25", "--ls-kicks", "2",
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    df = pl.read_parquet(out)
    assert df.columns == list(RESULT_COLUMNS) + list(LS_COLUMNS) + list(CERT_COLUMNS)
    assert df.height == 60 * 3
    assert (df["es_ls"] <= df["es_hat"]).all()  # exact: the pool argmin is a start
    assert (df["es_cert"] <= df["es_ls"]).all()  # exact: the all-key set seeds the certificate
    assert (df["cert_status"] == "optimal").all()
    assert (df["cert_lb"] <= df["es_cert"]).all()
    live = df.filter(~pl.col("e_top_zero"))
    assert (live["gap_closed_ls"] >= live["gap_closed"]).all()
    np.testing.assert_allclose(live["gap_closed_ls"], (live["e_top"] - live["es_ls"]) / live["e_top"], rtol=1e-12)
    assert (df["ls_moves"] >= 0).all()
    # the all-key search finds better sets than the pool on some of these rows
    assert (df["es_ls"] < df["es_hat"]).sum() > 0
    store = RowStore.open(rows)
    ids = [0, 31, 59]
    batch = store.get_rows(ids)
    for i, rid in enumerate(ids):
        p, V = batch.row(i)
        for row in df.filter(pl.col("row_id") == rid).iter_rows(named=True):
            assert len(row["kept_ls"]) == row["s"] == len(set(row["kept_ls"]))
            assert ref.forced_error(p, V, row["kept_ls"]) == pytest.approx(row["es_ls"], rel=1e-10)
            assert ref.forced_error(p, V, row["kept_cert"]) == pytest.approx(row["es_cert"], rel=1e-10)


def test_bad_search_value_is_one_clear_line(rows: Path, tmp_path: Path) -> None:
    r = subprocess.run([EVICTLAB, "solve", str(rows), "--keep", "2", "--search", "everything",
                        "--out", str(tmp_path / "x.parquet")], capture_output=True, text=True)
    assert r.returncode == 2
    err = r.stderr.strip()
    assert "--search" in err and "pool" in err and "all" in err
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("cfg, match", [
    (SolveConfig(budgets=(2,), search="ALL"), "--search"),
    (SolveConfig(budgets=(2,), search="all", ls_pairs=-1), "--ls-pairs"),
    (SolveConfig(budgets=(2,), search="all", ls_kicks=-2), "--ls-kicks"),
    (SolveConfig(budgets=(2,), search="all", ls_seed=-1), "--ls-seed"),
    (SolveConfig(budgets=(2,), search="all", ls_seed=2**63), "--ls-seed"),
    (SolveConfig(budgets=(2,), certify=True, cert_nodes=0), "--cert-nodes"),
])
def test_bad_options_rejected(rows: Path, tmp_path: Path, cfg: SolveConfig, match: str) -> None:
    with pytest.raises(InputError, match=match):
        solve_rows(rows, tmp_path / "r.parquet", cfg, threads=1, progress=False)


def test_node_limit_gives_intervals(rows: Path, tmp_path: Path) -> None:
    cfg = SolveConfig(budgets=(4, 6), certify=True, cert_nodes=40, search="all", chunk_rows=100)
    solve_rows(rows, tmp_path / "r.parquet", cfg, threads=1, progress=False)
    df = pl.read_parquet(tmp_path / "r.parquet")
    assert (df["cert_nodes"] <= 40).all()
    assert (df["cert_status"] == "limit").any()
    assert (df["cert_lb"] <= df["es_cert"]).all() and (df["cert_lb"] >= 0).all()
    np.testing.assert_allclose(df["cert_gap"], df["es_cert"] - df["cert_lb"])
    # the interval holds the certified optimum of a run without the limit
    full = SolveConfig(budgets=(4, 6), certify=True, search="all", chunk_rows=100)
    solve_rows(rows, tmp_path / "f.parquet", full, threads=1, progress=False)
    f = pl.read_parquet(tmp_path / "f.parquet")
    assert (f["cert_status"] == "optimal").all()
    assert (df["cert_lb"] <= f["es_cert"] * (1 + 1e-12)).all()
    assert (f["es_cert"] <= df["es_cert"]).all()
    # cert-max-n / cert-max-s skip rows and budgets (status skipped, nulls), never silently
    small = SolveConfig(budgets=(4, 6), certify=True, cert_max_s=4, cert_max_n=30, chunk_rows=100)
    solve_rows(rows, tmp_path / "s.parquet", small, threads=1, progress=False)
    s = pl.read_parquet(tmp_path / "s.parquet")
    skipped = s.filter((pl.col("s") > 4) | (pl.col("n") > 30))
    assert (skipped["cert_status"] == "skipped").all() and skipped["es_cert"].null_count() == skipped.height
    assert (s.filter((pl.col("s") <= 4) & (pl.col("n") <= 30))["cert_status"] == "optimal").all()
    assert "es_ls" not in s.columns  # certify alone seeds with the search but adds no columns


def test_resume_and_threads_give_identical_results(rows: Path, tmp_path: Path) -> None:
    cfg = SolveConfig(budgets=(3, 5), search="all", ls_kicks=3, ls_seed=9, chunk_rows=20)
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    first = solve_rows(rows, a, cfg, threads=1, progress=False, stop_after=1)
    assert not first.complete and parts_dir_for(a).exists()
    solve_rows(rows, a, cfg, threads=1, progress=False)
    solve_rows(rows, b, cfg, threads=numba.config.NUMBA_NUM_THREADS, progress=False)
    assert pl.read_parquet(a).equals(pl.read_parquet(b))
    other = SolveConfig(budgets=(3, 5), search="all", ls_kicks=3, ls_seed=10, chunk_rows=20)
    solve_rows(rows, tmp_path / "c.parquet", other, threads=1, progress=False)
    c = pl.read_parquet(tmp_path / "c.parquet")
    assert (c["es_ls"] <= c["es_hat"]).all()


def test_main_job_solve_stage_passes_the_search(rows: Path, tmp_path: Path) -> None:
    """The demo's solve stage (a subprocess `evictlab solve`) runs the all-key search when asked,
    and the results cache never hands pool-only results to a --search all job."""
    from evictlab.pipeline.config import AnalysisConfig
    from evictlab.pipeline.stages import solve_key
    from evictlab.pipeline.stages import solve_stage as stage_solve

    cfg = AnalysisConfig(budgets=(2, 4), search="all")
    stage_solve(rows, tmp_path / "all.parquet", cfg, True, log=lambda m: None)
    df = pl.read_parquet(tmp_path / "all.parquet")
    assert set(LS_COLUMNS) <= set(df.columns) and "es_cert" in df.columns
    assert (df["es_ls"] <= df["es_hat"]).all() and (df["es_cert"] <= df["es_ls"] * (1 + 1e-12)).all()
    pool = AnalysisConfig(budgets=(2, 4), search="pool")
    assert solve_key(cfg, True) != solve_key(pool, True) and "-all" in solve_key(cfg, False)
