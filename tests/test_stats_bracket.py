"""The bracket of the median ceiling (stats/bracket.py) on synthetic results frames."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.stats.bracket import BRACKET_COLUMNS, bracket_table, n_band, verdict


def _frame(g_ls: np.ndarray, g_lo: np.ndarray, g_ub: np.ndarray, *, model: str = "m", n: int = 1500,
           prompts: int = 8, s: int = 8) -> pl.DataFrame:
    """One row per entry: e_top = 1, es_ls = 1 - g_ls, es_bb = 1 - g_lo, es_lb = 1 - g_ub."""
    m = g_ls.size
    return pl.DataFrame({
        "model": [model] * m, "prompt_id": np.arange(m) % prompts, "row_id": np.arange(m),
        "s": np.full(m, s), "n": np.full(m, n), "e_top": np.ones(m), "es_ls": 1 - g_ls, "es_bb": 1 - g_lo,
        "es_lb": 1 - g_ub, "lb_status": np.where(g_lo == g_ub, "closed", "limit"), "lb_nodes": np.full(m, 64),
        "e_top_zero": np.zeros(m, dtype=bool),
    })


def test_verdicts_and_medians() -> None:
    rng = np.random.default_rng(0)
    m = 80
    up = rng.uniform(0.08, 0.12, m)  # all-key gaps around 10%: understated
    hold = rng.uniform(0.01, 0.03, m)  # bracket entirely under 5%: holds
    wide = rng.uniform(0.02, 0.04, m)  # lower end under 5%, upper end 30%: straddles
    df = pl.concat([
        _frame(up, up + 0.01, up + 0.2, model="a"),
        _frame(hold, hold, hold + 0.005, model="b"),
        _frame(wide, wide, wide + 0.3, model="c"),
    ])
    t = bracket_table(df, n_boot=300)
    assert t.columns == ["model", "n_band", "s", *BRACKET_COLUMNS]
    by = {r["model"]: r for r in t.iter_rows(named=True)}
    assert by["a"]["verdict"] == "understated"
    assert by["b"]["verdict"] == "holds"
    assert by["c"]["verdict"] == "straddles"
    for name, (gl, glo, gub) in {"a": (up, up + 0.01, up + 0.2), "b": (hold, hold, hold + 0.005),
                                 "c": (wide, wide, wide + 0.3)}.items():
        r = by[name]
        assert r["gap_ls_median"] == pytest.approx(np.median(gl))
        assert r["gap_lo_median"] == pytest.approx(np.median(glo))
        assert r["gap_ub_median"] == pytest.approx(np.median(gub))
        assert r["width"] == pytest.approx(np.median(gub) - np.median(glo))
        for e in ("gap_ls_median", "gap_lo_median", "gap_ub_median"):
            assert r[f"{e}_lo"] <= r[e] <= r[f"{e}_hi"]
        assert r["prompts"] == 8 and r["rows_used"] == m and r["n_band"] == "1025-2048"
        assert "prompt" in r["interval"]
    assert by["b"]["closed_frac"] == pytest.approx(0.0)


def test_the_bracket_uses_the_larger_lower_bound_and_the_better_set() -> None:
    g = np.full(40, 0.05)
    df = _frame(g, g, g + 0.5).with_columns(
        pl.lit(1.0 - 0.07).alias("cert_lb"),  # the certificate proves more than the bound here
        pl.lit(1.0 - 0.06).alias("es_ls"))  # the all-key search found a better set than es_bb
    r = bracket_table(df, n_boot=200).row(0, named=True)
    assert r["gap_ub_median"] == pytest.approx(0.07)
    assert r["gap_lo_median"] == pytest.approx(0.06)
    assert r["gap_ls_median"] == pytest.approx(0.06)


def test_clustered_interval_is_wider_than_rows_when_prompts_differ() -> None:
    rng = np.random.default_rng(1)
    prompt_effect = rng.normal(0, 0.05, 8)
    g = 0.1 + prompt_effect[np.arange(160) % 8] + rng.normal(0, 0.005, 160)
    df = _frame(g, g, g + 0.1)
    clustered = bracket_table(df, n_boot=400).row(0, named=True)
    rows = bracket_table(df, n_boot=400, clusters=None).row(0, named=True)
    w = lambda r: r["gap_ls_median_hi"] - r["gap_ls_median_lo"]  # noqa: E731
    assert w(clustered) > 2 * w(rows)


def test_zero_rows_are_counted_and_excluded() -> None:
    g = np.full(20, 0.1)
    df = _frame(g, g, g + 0.1).with_columns(
        pl.when(pl.col("row_id") < 5).then(0.0).otherwise(pl.col("e_top")).alias("e_top"),
        (pl.col("row_id") < 5).alias("e_top_zero"))
    r = bracket_table(df, n_boot=100).row(0, named=True)
    assert r["rows"] == 20 and r["rows_e_top_zero"] == 5 and r["rows_used"] == 15
    assert r["gap_ls_median"] == pytest.approx(0.1)


def test_n_bands_and_verdict_edges() -> None:
    d = pl.DataFrame({"n": [1, 64, 65, 300, 4096, 5000, 10**6]}).select(n_band())
    assert d["n_band"].to_list() == ["1-64", "1-64", "65-128", "257-512", "2049-4096", "4097-8192", ">32768"]
    assert verdict(0.051, 0.5) == "understated"
    assert verdict(0.01, 0.05) == "holds"
    assert verdict(0.04, 0.06) == "straddles"
    assert verdict(float("nan"), 0.01) == "no data"


def test_refuses_results_without_the_bound() -> None:
    with pytest.raises(InputError, match="--bound"):
        bracket_table(pl.DataFrame({"e_top": [1.0], "es_ls": [0.9], "s": [8], "n": [100]}))
