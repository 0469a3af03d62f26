"""pi(s) against s / head_dim: the ablation rows against the reference, the table, the explanation, the report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from evictlab.core import reference as R
from evictlab.errors import CorruptFileError
from evictlab.pipeline import AnalysisConfig, compute
from evictlab.pipeline.report import write_report
from evictlab.rows import RowStore, SynthConfig, synthesize
from evictlab.solve import SolveConfig, solve_rows
from evictlab.solve.ablation import ablation_rows
from evictlab.stats.penalty import DEFINITIONS, explain, penalty_table
from evictlab.stats.results import load_results


@pytest.fixture(scope="module")
def solved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pl.DataFrame]:
    base = tmp_path_factory.mktemp("penalty")
    rows = base / "rows"
    synthesize(rows, SynthConfig(rows=96, keys=40, dim=6, seed=2, rows_per_block=12))
    solve_rows(rows, base / "r.parquet", SolveConfig(budgets=(2, 4, 8)), progress=False)
    res = load_results(base / "r.parquet").with_columns(pl.lit("syn").alias("model"))
    return rows, res


def test_ablation_rows_match_the_reference(solved) -> None:
    rows, res = solved
    abl = ablation_rows(rows, res, model="syn", max_rows=None)
    assert abl.height == 96 * 3 and (abl["head_dim"] == 6).all()
    tol = 1e-9
    assert (abl["e_aff"] <= abl["e_hull"] + tol).all() and (abl["e_nn"] <= abl["e_hull"] + tol).all()
    assert (abl["e_ls"] <= abl["e_aff"] + tol).all() and (abl["e_hull"] <= abl["e_top"] + tol).all()
    batch = RowStore.open(rows).get_rows([5, 40])
    for i, rid in enumerate([5, 40]):
        p, v = batch.row(i)
        for s in (2, 8):
            r = abl.filter((pl.col("row_id") == rid) & (pl.col("s") == s)).row(0, named=True)
            kept = R.top_mass_set(p, s)
            assert r["e_aff"] == pytest.approx(R.affine_error(p, v, kept), abs=1e-12)
            assert r["e_nn"] == pytest.approx(R.nonneg_error(p, v, kept)[0], abs=1e-9)
            assert r["e_hull"] == pytest.approx(R.free_weight_error(p, v, kept)[0], rel=1e-7, abs=1e-10)
    sample = ablation_rows(rows, res, model="syn", max_rows=24, seed=1)
    assert sample.select("row_id").n_unique() == 24
    assert sample.group_by("prompt_id").agg(pl.col("row_id").n_unique())["row_id"].to_list() == [3] * 8


def test_rows_and_results_must_belong_together(solved, tmp_path: Path) -> None:
    rows, res = solved
    other = tmp_path / "other"
    synthesize(other, SynthConfig(rows=96, keys=40, dim=6, seed=9, rows_per_block=12))
    with pytest.raises(CorruptFileError, match="differs from the results"):
        ablation_rows(other, res, model="syn", max_rows=20)


def test_penalty_table_definitions_and_s_over_d(solved) -> None:
    rows, res = solved
    table = penalty_table(ablation_rows(rows, res, model="syn", max_rows=None), n_boot=100)
    assert set(table["definition"].to_list()) == set(DEFINITIONS)
    assert table.filter(pl.col("s") == 4)["s_over_d"].to_list() == [4 / 6] * len(DEFINITIONS)
    assert table["interval"].str.starts_with("cluster bootstrap: prompt > row (8 prompts").all()
    hull = table.filter(pl.col("definition") == "hull").sort("s")
    aff = table.filter(pl.col("definition") == "affine").sort("s")
    assert (aff["pi"] >= hull["pi"] - 1e-9).all()  # a smaller denominator: pi can only grow


def _table(points: dict[tuple[str, int, int], dict[str, float]]) -> pl.DataFrame:
    rows = []
    for (m, s, d), by_def in points.items():
        for name in DEFINITIONS:
            v = by_def.get(name, by_def["hull"] * 1.2)
            rows.append({"model": m, "s": s, "head_dim": d, "s_over_d": s / d, "definition": name, "rows": 100,
                         "nonfinite": 0, "pi": v, "pi_lo": v - 0.02, "pi_hi": v + 0.02, "interval": "test"})
    return pl.DataFrame(rows)


def test_explain_recognises_each_explanation() -> None:
    # pi a function of s/d alone: two head dims agree at equal s/d, not at equal s
    f = {4: 1.1, 8: 1.3, 16: 1.6, 32: 2.0, 64: 2.5}
    sd = _table({("a", s, 64): {"hull": f[s]} for s in (4, 8, 16, 32)} | {("b", s, 128): {"hull": f[s // 2] if s > 4 else 1.0}
                                                                           for s in (4, 8, 16, 32)})
    assert explain(sd).verdict.startswith("supported: s / head_dim")
    # an alternative definition reaches the paper's values on every model
    dfn = _table({(m, s, 64 * (i + 1)): {"hull": 1.5 + s / 10 + i, "hull, ratio of medians": {4: 1.08, 32: 1.78}.get(s, 1.4)}
                  for i, m in enumerate("ab") for s in (4, 8, 16, 32)})
    assert explain(dfn).verdict.startswith("supported: the free-weight definition. `hull, ratio of medians`")
    neither = _table({(m, s, 64 * (i + 1)): {"hull": 1.5 + s / 10 + i} for i, m in enumerate("ab") for s in (4, 8, 16, 32)})
    ex = explain(neither)
    assert ex.verdict.startswith("not explained") and any("same s/d" in f for f in ex.findings)


def test_report_section_from_rows(solved, tmp_path: Path) -> None:
    rows, res = solved
    a = compute(res, tmp_path, AnalysisConfig(budgets=(2, 4, 8), n_boot=50, n_boot_cells=10, hardness_trials=0,
                                              ablation_rows=48), log=lambda m: None, rows={"syn": rows})
    assert a.head_dims == {"syn": 6} and a.penalty is not None
    text = write_report(a, {}).read_text()
    for needle in ("Forced-weight penalty against s / head_dim", "**Which explanation the data support:**",
                   "pi: affine", "s=2 (s/d=0.333)", "penalty_vs_head_dim.png"):
        assert needle in text, needle
    assert (tmp_path / "tables" / "penalty_by_definition.parquet").exists()
    claims = pl.read_parquet(tmp_path / "tables" / "claims.parquet")
    assert "penalty-head-dim" in claims["claim_id"].to_list()
