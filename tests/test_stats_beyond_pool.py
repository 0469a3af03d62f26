"""Beyond-the-pool statistics: the shared resampling engine's design, summaries on planted tables, verdicts, figure, script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.stats.beyond_pool import (
    beyond_pool_claims, ceiling_verdict, check_beyond_pool, summarize_beyond_pool,
)
from evictlab.stats.bootstrap import Design, Mean, Median, bootstrap

ROOT = Path(__file__).resolve().parents[1]


def _planted(n_prompts: int = 6, rows: int = 30, certify: bool = True) -> pl.DataFrame:
    """Results with known relations: es_ls = 0.8 es_hat on odd rows, certified on all but the last prompt."""
    out = []
    rid = 0
    for s in (4, 8):
        for p in range(n_prompts):
            for r in range(rows):
                e_top = 1.0 + 0.01 * r
                es_hat = 0.95 * e_top
                es_ls = es_hat * (0.8 if r % 2 else 1.0)
                row = {"row_id": rid, "s": s, "model": "m", "prompt_id": p, "e_top": e_top, "es_hat": es_hat,
                       "es_ls": es_ls, "e_top_zero": False}
                if certify:
                    opt = p < n_prompts - 1
                    row.update(es_cert=es_ls, cert_status="optimal" if opt else "limit",
                               cert_lb=es_ls * (1 - 1e-9) if opt else 0.5 * es_ls, cert_nodes=100)
                out.append(row)
                rid += 1
    # one e(T_s) = 0 row per budget: counted, never used
    for s in (4, 8):
        z = {"row_id": rid, "s": s, "model": "m", "prompt_id": 0, "e_top": 0.0, "es_hat": 0.0, "es_ls": 0.0,
             "e_top_zero": True}
        if certify:
            z.update(es_cert=0.0, cert_status="optimal", cert_lb=0.0, cert_nodes=1)
        out.append(z)
        rid += 1
    return pl.DataFrame(out)


def test_summary_on_planted_table() -> None:
    df = _planted()
    sm = summarize_beyond_pool(df, seed=0, n_boot=200)
    assert sm.height == 2 and sm["s"].to_list() == [4, 8]
    r = sm.row(0, named=True)
    assert r["rows"] == 181 and r["rows_e_top_zero"] == 1 and r["rows_used"] == 180 and r["prompts"] == 6
    assert r["gap_pool_median"] == pytest.approx(0.05)
    assert r["pool_miss_frac"] == pytest.approx(0.5)
    g_ls = 1 - 0.95 * np.array([0.8 if k % 2 else 1.0 for k in range(30)])
    assert r["gap_ls_median"] == pytest.approx(np.median(np.tile(g_ls, 6)))
    assert r["rows_certified"] == 150 and r["rows_cert_attempted"] == 180
    assert r["cert_closed_frac"] == pytest.approx(150 / 180)
    assert r["gap_cert_median"] == pytest.approx(r["gap_ls_cert_median"])
    assert r["ls_optimal_frac"] == 1.0 and r["pool_miss_cert_frac"] == pytest.approx(0.5)
    assert r["open_width_median"] == pytest.approx(0.5)
    # the bracket of the median ceiling: lower end from es_cert, upper end from cert_lb
    assert r["ceiling_lo_median"] <= r["ceiling_hi_median"]
    for name in ("gap_pool_median", "gap_ls_median", "pool_miss_frac", "ceiling_hi_median"):
        assert r[name + "_lo"] <= r[name] <= r[name + "_hi"]


def test_intervals_come_from_the_shared_engine() -> None:
    """The summary's CIs are exactly the engine's, with prompts > rows resampled (whole rows)."""
    df = _planted()
    sm = summarize_beyond_pool(df, seed=5, n_boot=300).row(0, named=True)
    assert sm["interval"] == "cluster bootstrap: prompt > row (6 prompts, 180 rows)"
    g = df.filter((pl.col("s") == 4) & ~pl.col("e_top_zero"))
    et, eh, el = (g[c].to_numpy() for c in ("e_top", "es_hat", "es_ls"))
    design = Design.nested([g["prompt_id"].to_numpy(), g["row_id"].to_numpy()], ["prompt", "row"], whole_leaves=True)
    opt = (g["cert_status"] == "optimal").to_numpy()
    want = bootstrap({"gap_pool_median": Median((et - eh) / et), "gap_ls_median": Median((et - el) / et),
                      "pool_miss_frac": Mean((el < eh * (1 - 1e-9)).astype(float)),
                      "cert_closed_frac": Mean(opt.astype(float), np.ones(opt.size, bool))},
                     design, seed=5, key="model=m|s=4", n_boot=300)
    for name in ("gap_ls_median", "pool_miss_frac", "cert_closed_frac"):
        assert (sm[name], sm[name + "_lo"], sm[name + "_hi"]) == pytest.approx(
            (want[name].value, want[name].lo, want[name].hi)), name
    # clustered data: the prompt-clustered interval is wider than the row bootstrap's
    rows_only = summarize_beyond_pool(df, seed=5, n_boot=300, clusters=None).row(0, named=True)
    assert rows_only["interval"] == "row bootstrap"
    assert (sm["cert_closed_frac_hi"] - sm["cert_closed_frac_lo"]) > \
        2 * (rows_only["cert_closed_frac_hi"] - rows_only["cert_closed_frac_lo"])
    # determinism: same seed, same bits; the claims name the design
    assert summarize_beyond_pool(df, seed=5, n_boot=300).equals(summarize_beyond_pool(df, seed=5, n_boot=300))
    claim = beyond_pool_claims(summarize_beyond_pool(df, seed=5, n_boot=50))[0]
    assert claim.interval.startswith("cluster bootstrap: prompt > row")


def test_summary_without_certificate_and_refusal() -> None:
    sm = summarize_beyond_pool(_planted(certify=False), seed=0, n_boot=50)
    assert (sm["rows_certified"] == 0).all() and sm["gap_cert_median"].is_nan().all()
    # the same columns in the same order with and without a certificate (tables stack)
    assert sm.columns == summarize_beyond_pool(_planted(), seed=0, n_boot=20).columns
    with pytest.raises(InputError, match="--search all"):
        check_beyond_pool(pl.DataFrame({"s": [4], "e_top": [1.0], "es_hat": [0.9]}))


@pytest.mark.parametrize("ls, up, want", [
    ((0.06, 0.05, 0.07), None, "understated"),
    ((0.03, 0.02, 0.04), (0.04, 0.03, 0.045), "holds"),
    ((0.03, 0.02, 0.04), None, "consistent"),
    ((0.01, 0.005, 0.015), None, "below"),
    ((0.03, 0.02, 0.04), (0.09, 0.08, 0.1), "consistent"),
])
def test_verdict_either_way(ls, up, want) -> None:
    r = {"gap_ls_median": ls[0], "gap_ls_median_lo": ls[1], "gap_ls_median_hi": ls[2]}
    if up:
        r.update(ceiling_hi_median=up[0], ceiling_hi_median_lo=up[1], ceiling_hi_median_hi=up[2])
    assert ceiling_verdict(r).startswith(want)


def test_figure_and_paper_repro_script(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from evictlab.plots.beyond_pool import gap_pool_vs_allkey

    df = _planted()
    sm = summarize_beyond_pool(df, seed=0, n_boot=50)
    fig = gap_pool_vs_allkey(df, sm, tmp_path / "fig")
    assert fig.png.stat().st_size > 1000 and fig.pdf.exists() and "cluster bootstrap: prompt > row" in fig.caption
    res = tmp_path / "r.parquet"
    df.write_parquet(res)
    # the script in-process (no second interpreter start): paper_repro/ on the path for _common
    import importlib

    sys.path.insert(0, str(ROOT / "paper_repro"))
    try:
        script = importlib.import_module("claim_ceiling_beyond_pool")
        calls = []  # the figure was drawn above; here only its wiring is checked (rendering is slow)
        monkeypatch.setattr(script, "gap_pool_vs_allkey",
                            lambda res_df, summ, path: calls.append((res_df.height, summ.height, path)) or fig)
        code = script.main(["--results", str(res), "--n-boot", "50", "--out", str(tmp_path / "out"),
                            "--figures", str(tmp_path / "figs")])
    finally:
        sys.path.remove(str(ROOT / "paper_repro"))
    assert code == 0
    out = capsys.readouterr().out
    assert "360 (row, s) pairs used" in out and "300 certified optimal" in out
    claims = (tmp_path / "out" / "claims.md").read_text()
    assert "beyond the pool" in claims and "understated" in claims
    assert pl.read_parquet(tmp_path / "out" / "ceiling_beyond_pool.parquet").height == 2
    assert calls == [(df.height, 2, tmp_path / "figs" / "ceiling_beyond_pool")]
    bad = subprocess.run([sys.executable, str(ROOT / "paper_repro" / "claim_ceiling_beyond_pool.py"), "--results",
                          str(tmp_path / "none.parquet"), "--out", str(tmp_path / "o2")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("error:") and "none.parquet" in bad.stderr
