"""Statistics over solver results: bootstrap, summaries, AUC against known answers, predictor JSON."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from evictlab.errors import CorruptFileError, InputError
from evictlab.stats.bootstrap import bootstrap_auc, bootstrap_median, roc_auc
from evictlab.stats.ceilings import summarize
from evictlab.stats.planted import planted_auc, planted_results
from evictlab.stats.predictors import FEATURE_SETS, Predictor, auc_by_group, evaluate, fit_predictor
from evictlab.stats.results import prepare, split_zero


@pytest.fixture(scope="module")
def planted() -> pl.DataFrame:
    return prepare(planted_results(4000, seed=1, certify=True))


def test_bootstrap_is_deterministic_and_key_dependent() -> None:
    x = np.random.default_rng(0).lognormal(size=501)
    a = bootstrap_median(x, seed=3, key="g", n_boot=300)
    b = bootstrap_median(x, seed=3, key="g", n_boot=300)
    c = bootstrap_median(x, seed=4, key="g", n_boot=300)
    assert a == b
    assert (a.lo, a.hi) != (c.lo, c.hi)
    assert a.lo <= a.value <= a.hi
    assert a.value == pytest.approx(np.median(x))


def test_bootstrap_median_ci_covers_true_median() -> None:
    # exponential(1): true median ln 2; a 95% CI should cover it in most of 40 seeded samples
    hits = 0
    for k in range(40):
        x = np.random.default_rng(100 + k).exponential(size=400)
        e = bootstrap_median(x, seed=k, n_boot=400)
        hits += e.lo <= np.log(2) <= e.hi
    assert hits >= 34


def test_roc_auc_matches_sklearn_with_ties() -> None:
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(5)
    y = rng.uniform(size=700) < 0.3
    score = np.round(rng.normal(size=700) + y, 1)  # many ties
    assert roc_auc(y, score) == pytest.approx(roc_auc_score(y, score), abs=1e-12)
    assert np.isnan(roc_auc(np.zeros(5, bool), np.arange(5.0)))


@pytest.mark.parametrize("a,b", [(-2.0, 4.0), (-1.0, 1.5)])
def test_auc_of_dropped_mass_recovers_planted_value(a: float, b: float) -> None:
    df = prepare(planted_results(30_000, budgets=(8,), seed=2, a=a, b=b, zero_frac=0.0))
    expected = planted_auc(a, b)
    t = auc_by_group(df, n_boot=100, seed=0)
    row = t.filter(pl.col("s") == "8").row(0, named=True)
    assert row["auc"] == pytest.approx(expected, abs=0.01)
    assert row["auc_lo"] <= expected + 0.005 and row["auc_hi"] >= expected - 0.005


def test_planted_auc_quadrature_against_monte_carlo() -> None:
    rng = np.random.default_rng(9)
    m = rng.uniform(size=400_000)
    y = rng.uniform(size=m.size) < 1 / (1 + np.exp(-(-2 + 4 * m)))
    assert roc_auc(y, m) == pytest.approx(planted_auc(-2, 4), abs=0.003)


def test_zero_rows_counted_not_dropped(planted: pl.DataFrame) -> None:
    keep, zero = split_zero(planted)
    assert zero.height > 0 and keep.height + zero.height == planted.height
    t = summarize(planted, ("model", "s"), n_boot=50)
    assert int(t["rows"].sum()) == planted.height
    assert int(t["rows_e_top_zero"].sum()) == zero.height
    assert (t["rows_used"] + t["rows_e_top_zero"] == t["rows"]).all()


def test_summary_values(planted: pl.DataFrame) -> None:
    t = summarize(planted, ("model", "s"), n_boot=100)
    assert t.height == 4
    for r in t.iter_rows(named=True):
        sub = planted.filter((pl.col("s") == r["s"]) & ~pl.col("e_top_zero"))
        assert r["gap_closed_median"] == pytest.approx(float(np.median(sub["gap_closed"].to_numpy())))
        assert r["gap_closed_median_lo"] <= r["gap_closed_median"] <= r["gap_closed_median_hi"]
        assert r["frac_significant"] == pytest.approx(float((sub["kappa_hat"] > 1.11).mean()))
        # planted: certified optimum below the pool optimum in ~10 % of rows
        assert 0.05 < r["cert_beats_pool_frac"] < 0.15
        assert 0.0 < r["bal_reaches_opt_frac"] < 1.0
    # pi planted to rise with s
    assert t.sort("s")["pi_top_median"].is_sorted()
    again = summarize(planted, ("model", "s"), n_boot=100)
    assert again.equals(t)


def test_summary_missing_column_is_clear() -> None:
    df = planted_results(50).drop("es_hat")
    with pytest.raises(InputError, match="es_hat"):
        prepare(df)


def test_predictor_fit_beats_chance_and_round_trips(planted: pl.DataFrame, tmp_path) -> None:
    pred, test = fit_predictor(planted, FEATURE_SETS["extended"], seed=0)
    assert test.height > 0 and set(test["part"].unique().to_list()) == {2}
    assert pred.coef[0] > 0  # more dropped mass -> more likely a gap
    assert pred.metadata["test_auc"] == pytest.approx(planted_auc(-2, 4), abs=0.03)
    path = pred.save(tmp_path / "p.json")
    back = Predictor.load(path)
    X = np.random.default_rng(0).uniform(size=(50, 4))
    np.testing.assert_array_equal(back.predict_proba(X), pred.predict_proba(X))
    assert back.to_dict() == json.loads(path.read_text())
    ev = evaluate(back, planted, n_boot=50)
    assert set(ev["s"].to_list()) == {"4", "8", "16", "32", "all"}
    assert (ev["auc"] > 0.7).all()
    # calibration: mean predicted probability close to the base rate on held-out rows
    p_test = back.score_table(test)
    assert abs(p_test.mean() - (test["kappa_hat"] > 1.11).mean()) < 0.03


def test_predictor_json_errors(planted: pl.DataFrame, tmp_path) -> None:
    pred, _ = fit_predictor(planted, FEATURE_SETS["extended"], seed=0)
    d = pred.to_dict()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        Predictor.load(bad)
    with pytest.raises(InputError, match="no such predictor"):
        Predictor.load(tmp_path / "missing.json")
    with pytest.raises(InputError, match="version 99"):
        Predictor.from_dict({**d, "version": 99})
    with pytest.raises(CorruptFileError, match="format"):
        Predictor.from_dict({**d, "format": "something-else"})
    with pytest.raises(CorruptFileError, match="lengths"):
        Predictor.from_dict({**d, "logistic": {"coef": [1.0], "intercept": 0.0}})
    with pytest.raises(CorruptFileError, match="malformed"):
        Predictor.from_dict({k: v for k, v in d.items() if k != "scaler"})
    with pytest.raises(InputError, match="unknown"):
        Predictor.from_dict({**d, "features": ["dropped_mass", "x", "log2_s", "depth"]})
    # feature mismatch: the other table lacks the entropy column the predictor needs
    other = prepare(planted_results(300, seed=3).drop("entropy"))
    with pytest.raises(InputError, match="entropy"):
        evaluate(pred, other, n_boot=10)


def test_fit_needs_both_classes(planted: pl.DataFrame) -> None:
    with pytest.raises(InputError, match="both classes"):
        fit_predictor(planted, threshold=1e9)


def test_bootstrap_auc_deterministic() -> None:
    rng = np.random.default_rng(1)
    y = rng.uniform(size=300) < 0.4
    s = rng.normal(size=300) + y
    assert bootstrap_auc(y, s, seed=1, key="k", n_boot=200) == bootstrap_auc(y, s, seed=1, key="k", n_boot=200)


def test_vectorised_bootstrap_auc_equals_explicit_resample() -> None:
    from evictlab.stats.bootstrap import Design, resample_counts, rng_for

    rng = np.random.default_rng(2)
    y = rng.uniform(size=250) < 0.35
    s = np.round(rng.normal(size=250) + y, 1)
    est = bootstrap_auc(y, s, seed=11, key="x", n_boot=1)
    counts = next(resample_counts(Design.rows(250), rng_for(11, "x"), 1))[0]
    idx = np.repeat(np.arange(250), counts)
    assert est.lo == pytest.approx(roc_auc(y[idx], s[idx]), abs=1e-12)
