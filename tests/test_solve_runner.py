"""`evictlab solve` end to end: columns, invariants, resume, determinism, input errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import polars as pl
import pytest

from evictlab.core import reference as ref
from evictlab.errors import InputError
from evictlab.record import record_path
from evictlab.rows.batch import RowBatch
from evictlab.rows.reader import RowStore
from evictlab.rows.synth import SynthConfig, synthesize
from evictlab.solve.runner import (
    CERT_COLUMNS, RESULT_COLUMNS, SolveConfig, parts_dir_for, solve_batch, solve_rows,
)

EVICTLAB = str(Path(sys.executable).with_name("evictlab"))


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("solve") / "rows"
    synthesize(path, SynthConfig(rows=90, keys=24, dim=6, seed=3, rows_per_block=16, spread=0.5,
                                 rows_per_shard=40))
    return path


def test_cli_end_to_end(rows: Path, tmp_path: Path) -> None:
    out = tmp_path / "res.parquet"
    r = subprocess.run([EVICTLAB, "solve", str(rows), "--keep", "2", "4", "8", "--pool", "2", "1",
                        "--certify", "--threads", "1", "--chunk-rows", "32", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    df = pl.read_parquet(out)
    assert df.columns == list(RESULT_COLUMNS) + list(CERT_COLUMNS)
    assert df.height == 90 * 3
    assert df.select(pl.struct("row_id", "s").is_unique().all()).item()
    assert sorted(df["s"].unique().to_list()) == [2, 4, 8]
    assert (df["es_hat"] <= df["e_bal"]).all() and (df["e_bal"] <= df["e_top"]).all()
    cert = df.filter(pl.col("cert_status") == "optimal")
    assert cert.height == df.height  # n <= 24 and s <= 8: everything certified
    assert (cert["es_cert"] <= cert["es_hat"]).all()
    assert df["model"].null_count() == 0
    rec = json.loads(record_path(out).read_text())
    assert rec["kind"] == "solve" and rec["config"]["budgets"] == [2, 4, 8]
    assert not parts_dir_for(out).exists()
    # numbers agree with the single-row reference
    store = RowStore.open(rows)
    batch = store.get_rows([0, 17, 89])
    for i, rid in enumerate([0, 17, 89]):
        p, V = batch.row(i)
        for s in (2, 4, 8):
            row = df.filter((pl.col("row_id") == rid) & (pl.col("s") == s)).row(0, named=True)
            assert row["e_top"] == pytest.approx(ref.forced_error(p, V, ref.top_mass_set(p, s)), rel=1e-10)
            assert row["es_hat"] == pytest.approx(ref.forced_error(p, V, row["kept"]), rel=1e-10)
            pool = ref.candidate_pool(p, V, s, 2, 1)
            assert set(row["kept"]) <= set(pool.tolist())
            assert row["dropped_mass"] == pytest.approx(ref.dropped_mass(p, ref.top_mass_set(p, s)), abs=1e-12)
            assert row["entropy"] == pytest.approx(ref.entropy(p), rel=1e-10)
            assert row["e_free_top"] == pytest.approx(
                ref.free_weight_error(p, V, ref.top_mass_set(p, s))[0], rel=1e-7, abs=1e-10)
            assert row["kappa_hat"] == pytest.approx(row["e_top"] / max(row["es_hat"], 1e-12))
            assert row["gap_closed"] == pytest.approx(1 - 1 / row["kappa_hat"], abs=1e-12)


def test_budget_above_n_rejected_cli(rows: Path, tmp_path: Path) -> None:
    r = subprocess.run([EVICTLAB, "solve", str(rows), "--keep", "4", "200", "--out",
                        str(tmp_path / "x.parquet")], capture_output=True, text=True)
    assert r.returncode == 2
    assert "exceeds the number of keys" in r.stderr and "s <= n" in r.stderr
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.parametrize("cfg,match", [
    (SolveConfig(budgets=()), "no budget"),
    (SolveConfig(budgets=(4, 4)), "duplicates"),
    (SolveConfig(budgets=(0,)), ">= 1"),
    (SolveConfig(budgets=(4,), r_m=-1), "r_m"),
    (SolveConfig(budgets=(8,), r_m=8, r_e=8, max_subsets=1000), "subsets"),
])
def test_bad_config_rejected(rows: Path, tmp_path: Path, cfg: SolveConfig, match: str) -> None:
    with pytest.raises(InputError, match=match):
        solve_rows(rows, tmp_path / "x.parquet", cfg, progress=False)


def test_resume_after_interruption(rows: Path, tmp_path: Path) -> None:
    cfg = SolveConfig(budgets=(3, 6), chunk_rows=25)
    full = solve_rows(rows, tmp_path / "full.parquet", cfg, progress=False)
    assert full.complete and full.parts_total == 4
    out = tmp_path / "res.parquet"
    part = solve_rows(rows, out, cfg, progress=False, stop_after=2)
    assert not part.complete and part.parts_written == 2 and not out.exists()
    assert len(list(parts_dir_for(out).glob("part-*.parquet"))) == 2
    # a different job must not mix with these parts
    with pytest.raises(InputError, match="holds the parts of a run with other settings"):
        solve_rows(rows, out, SolveConfig(budgets=(3,), chunk_rows=25), progress=False)
    again = solve_rows(rows, out, cfg, progress=False)
    assert again.complete and again.parts_done_before == 2 and again.parts_written == 2
    a, b = pl.read_parquet(out), pl.read_parquet(tmp_path / "full.parquet")
    assert a.height == 90 * 2 and a.select(pl.struct("row_id", "s").is_unique().all()).item()
    assert a.equals(b)
    with pytest.raises(InputError, match="already exists"):
        solve_rows(rows, out, cfg, progress=False)


def test_identical_across_runs_and_threads(rows: Path, tmp_path: Path) -> None:
    cfg = SolveConfig(budgets=(2, 5, 9), certify=True)
    store = RowStore.open(rows)
    batch = next(store.iter_batches(90))
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = solve_batch(batch, cfg, "m")
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = solve_batch(batch, cfg, "m")
        three = solve_batch(batch, cfg, "m")
    finally:
        numba.set_num_threads(before)
    assert one.equals(two) and two.equals(three)


def test_zero_error_rows_are_flagged_not_dropped() -> None:
    rng = np.random.default_rng(0)
    n, d = 5, 3
    V = rng.normal(size=(2 * n, d))
    V[n:] = 1.0  # second row: all values equal -> e(A) = 0 for every A
    p = np.concatenate([rng.dirichlet(np.ones(n)), rng.dirichlet(np.ones(n))])
    meta = pl.DataFrame({"row_id": [0, 1], "prompt_id": [0, 0], "layer": [0, 0], "q_head": [0, 0],
                         "kv_head": [0, 0], "position": [-1, -1], "n": [n, n]})
    batch = RowBatch(p=p, p_off=np.array([0, n, 2 * n]), values=V, v_start=np.array([0, n]),
                     key_index=np.arange(2 * n) % n, meta=meta)
    df = solve_batch(batch, SolveConfig(budgets=(2, 5)), None)
    assert df.height == 4
    z = df.filter(pl.col("e_top_zero"))
    # row 1 at both budgets, row 0 at s = n (all keys kept)
    assert sorted(zip(z["row_id"], z["s"])) == [(0, 5), (1, 2), (1, 5)]
    assert z["gap_closed"].null_count() == 3 and z["kappa_hat"].null_count() == 3
    nz = df.filter(~pl.col("e_top_zero"))
    assert nz["gap_closed"].null_count() == 0
    assert df["kept_pos"].to_list()[0] == df["kept"].to_list()[0]  # key_index = local index here


def test_the_run_records_where_the_time_went(rows: Path, tmp_path: Path) -> None:
    """Issue 28, item 12: every phase of a local solve is timed into the summary and the run
    record (the paper-scale benchmark prints them), so a slowdown names its phase."""
    from evictlab.solve.runner import PHASES

    out = tmp_path / "t.parquet"
    s = solve_rows(rows, out, SolveConfig(budgets=(2, 5), chunk_rows=20), progress=False)
    assert list(s.extra["phases_s"]) == list(PHASES) and all(v >= 0 for v in s.extra["phases_s"].values())
    assert s.extra["phases_s"]["solve"] > 0 and s.extra["phases_s"]["compile"] > 0
    rec = json.loads(record_path(out).read_text())["phases_s"]
    assert set(rec) == set(PHASES) - {"record"}  # (the record is written with sorted keys)
