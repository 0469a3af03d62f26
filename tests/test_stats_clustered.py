"""The clustered bootstrap: its resampling distribution by hand, statistics from counts, coverage, ICC."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evictlab.stats.bootstrap import (
    AUC, Design, Mean, Median, SignShare, bootstrap, bootstrap_mean, icc_oneway, percentile_interval, rank_icc,
    resample_counts, resample_counts_reference, rng_for, roc_auc, sign_rates,
)
from evictlab.errors import InputError
from evictlab.stats.ceilings import design_for, summarize
from evictlab.stats.results import prepare


@pytest.mark.parametrize("engine", [resample_counts, resample_counts_reference])
def test_two_stage_distribution_matches_hand_computation(engine) -> None:
    # prompt A holds rows {1, 2}, prompt B holds row {10}. Two-stage resampling draws two
    # prompts with replacement, then every drawn prompt redraws its own rows. By hand:
    #   (B, B) p 1/4: {10, 10} -> mean 10
    #   (A, B) p 1/2: A's two draws {1,1} 1/4, {1,2} 1/2, {2,2} 1/4, plus 10 -> 4, 13/3, 14/3
    #   (A, A) p 1/4: four draws from {1, 2}, k twos ~ Bin(4, 1/2) -> (4 + k) / 4
    x = np.array([1.0, 2.0, 10.0])
    design = Design.nested([np.array(["A", "A", "B"])], ["prompt"])
    exact = {Fraction(10): Fraction(1, 4), Fraction(4): Fraction(1, 8), Fraction(13, 3): Fraction(1, 4),
             Fraction(14, 3): Fraction(1, 8)}
    for k, w in enumerate((1, 4, 6, 4, 1)):
        exact[Fraction(4 + k, 4)] = Fraction(1, 4) * Fraction(w, 16)
    assert sum(exact.values()) == 1
    n_boot = 200_000
    counts = np.concatenate(list(engine(design, rng_for(0, "hand"), n_boot)))
    assert counts.shape == (n_boot, 3)
    sizes = counts.sum(axis=1)
    assert set(np.unique(sizes)) == {2, 3, 4}  # (B,B): 2, (A,B): 3, (A,A): 4 observations
    means = [Fraction(int(c @ np.array([1, 2, 10])), int(c.sum())) for c in counts[:20_000]]
    freq = {v: means.count(v) / len(means) for v in set(means)}
    assert set(freq) == set(exact)
    for v, p in exact.items():
        sd = np.sqrt(float(p) * (1 - float(p)) / len(means))
        assert abs(freq[v] - float(p)) < 5 * sd, (v, freq[v], p)
    # the statistic from counts is the statistic of the expanded resample
    reps = Mean(x).replicates(counts[:1000])
    assert np.allclose(reps, [float(m) for m in means[:1000]], rtol=0, atol=1e-12)


def test_row_design_is_the_ordinary_bootstrap() -> None:
    counts = next(resample_counts_reference(Design.rows(7), rng_for(3, "k"), 5))
    idx = rng_for(3, "k").integers(0, 7, size=(5, 7))
    assert np.array_equal(counts, np.stack([np.bincount(r, minlength=7) for r in idx]))


def test_three_levels_nest_labels_and_keep_cluster_sizes() -> None:
    model = np.array(["a"] * 6 + ["b"] * 4)
    prompt = np.array([0, 0, 0, 1, 1, 1, 0, 0, 1, 1])  # prompt 0 of a and of b are different
    d = Design.nested([model, prompt], ["model", "prompt"])
    assert d.clusters(0) == 2 and d.clusters(1) == 4
    assert d.describe() == "cluster bootstrap: model > prompt (2 models, 4 prompts)"
    a = list(resample_counts(d, rng_for(1), 300))
    assert all(np.array_equal(x, y) for x, y in zip(a, resample_counts(d, rng_for(1), 300)))  # same seed, same bits
    for c in a:
        # every replicate is made of whole prompts' worth of draws: sizes are sums of 3s and 2s
        for r in c:
            per_prompt = [r[(model == m) & (prompt == p)].sum() for m in "ab" for p in (0, 1)]
            assert per_prompt[0] % 3 == 0 and per_prompt[1] % 3 == 0
            assert per_prompt[2] % 2 == 0 and per_prompt[3] % 2 == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), st.integers(0, 2**32 - 1))
def test_median_and_auc_from_counts_equal_expanded_resamples(sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    x = np.round(rng.normal(size=n), 1)  # ties on purpose
    y = rng.uniform(size=n) < 0.5
    design = Design.nested([np.repeat(np.arange(len(sizes)), sizes)], ["prompt"])
    counts = next(resample_counts(design, rng_for(seed), 50))
    med = Median(x).replicates(counts)
    auc = AUC(y, x).replicates(counts)
    for r, c in enumerate(counts):
        expanded = np.repeat(np.arange(n), c)
        assert med[r] == np.median(x[expanded])
        want = roc_auc(y[expanded], x[expanded])
        assert (np.isnan(auc[r]) and np.isnan(want)) or auc[r] == pytest.approx(want, abs=1e-12)


def _clustered(rng: np.random.Generator, prompts: int, rows: int, between: float) -> tuple[np.ndarray, np.ndarray]:
    effect = rng.normal(0.0, between, prompts)
    groups = np.repeat(np.arange(prompts), rows)
    return effect[groups] + rng.normal(0.0, 1.0, prompts * rows), groups


def test_cluster_bootstrap_covers_nearer_nominal_than_row_bootstrap() -> None:
    # 10 prompts x 30 rows, prompt effect sd 1 (ICC 0.5), true mean 0: 150 seeded datasets
    rng = np.random.default_rng(2024)
    hit_c = hit_r = 0
    sims = 150
    for k in range(sims):
        x, g = _clustered(rng, 10, 30, 1.0)
        c = bootstrap_mean(x, seed=k, n_boot=300, clusters=g)
        r = bootstrap_mean(x, seed=k, n_boot=300)
        hit_c += c.lo <= 0.0 <= c.hi
        hit_r += r.lo <= 0.0 <= r.hi
    cov_c, cov_r = hit_c / sims, hit_r / sims
    assert abs(cov_c - 0.95) < abs(cov_r - 0.95)
    assert cov_c >= 0.8 and cov_r <= 0.6, (cov_c, cov_r)  # 10 clusters: percentile intervals undercover a little


def test_icc_oneway_against_variance_components() -> None:
    rng = np.random.default_rng(5)
    x, g = _clustered(rng, 400, 20, 1.0)  # between variance 1, within 1: ICC 0.5
    assert icc_oneway(x, g) == pytest.approx(0.5, abs=0.05)
    x0, g0 = _clustered(rng, 400, 20, 0.0)
    assert abs(icc_oneway(x0, g0)) < 0.02
    assert rank_icc(np.exp(x), g) == pytest.approx(icc_oneway(np.argsort(np.argsort(x)) + 1.0, g), abs=1e-12)
    assert np.isnan(icc_oneway(np.arange(5.0), np.zeros(5)))


def test_icc_oneway_by_hand_on_unequal_groups() -> None:
    # groups {1, 2, 3} and {7, 9}: grand mean 4.4; MSB = (3 * 2.4^2 + 2 * 3.6^2) / 1 = 43.2;
    # MSW = (1 + 0 + 1 + 1 + 1) / 3 = 4/3; n0 = (5 - 13/5) / 1 = 2.4
    want = (43.2 - 4 / 3) / (43.2 + 1.4 * 4 / 3)
    assert icc_oneway(np.array([1, 2, 3, 7, 9.0]), np.array([0, 0, 0, 1, 1])) == pytest.approx(want, rel=1e-12)


def test_shared_replicates_and_determinism() -> None:
    rng = np.random.default_rng(8)
    x, g = _clustered(rng, 6, 10, 0.5)
    d = Design.nested([g], ["prompt"])
    a = bootstrap({"m": Median(x), "f": Mean(x > 0)}, d, seed=1, key="k", n_boot=200)
    b = bootstrap({"f": Mean(x > 0)}, d, seed=1, key="k", n_boot=200)
    assert a["f"] == b["f"]
    assert a["m"].method == "cluster bootstrap: prompt (6 prompts)"


def _results(prompts: int, rows: int, between: float, seed: int) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    gap, g = _clustered(rng, prompts, rows, between)
    gap = 1 / (1 + np.exp(-gap - 2))  # in (0, 1)
    n = gap.size
    e_top = np.full(n, 1.0)
    es_hat = e_top * (1 - gap)
    return prepare(pl.DataFrame({
        "row_id": np.arange(n), "s": np.full(n, 4), "n": np.full(n, 40), "e_top": e_top, "es_hat": es_hat,
        "e_bal": es_hat, "gap_closed": gap, "kappa_hat": e_top / es_hat, "dropped_mass": rng.uniform(size=n),
        "e_free_top": e_top / 1.5, "e_free_opt": es_hat / 1.4, "pi_top": np.full(n, 1.5), "pi_opt": np.full(n, 1.4),
        "layer": np.zeros(n, dtype=np.int64), "prompt_id": g, "model": ["m"] * n}))


def test_summary_intervals_resample_prompts() -> None:
    df = _results(8, 50, 1.0, 3)
    t = summarize(df, ("model", "s"), n_boot=300, compare_rows=True).row(0, named=True)
    assert t["interval"] == "cluster bootstrap: prompt > row (8 prompts, 400 rows)"
    assert t["prompts"] == 8
    width = t["gap_closed_median_hi"] - t["gap_closed_median_lo"]
    row_width = t["gap_closed_median_row_hi"] - t["gap_closed_median_row_lo"]
    assert width > 2 * row_width  # strongly clustered: rows understate the uncertainty
    assert t["gap_closed_median_icc"] > 0.3
    no = summarize(df, ("model", "s"), n_boot=300, clusters=None).row(0, named=True)
    assert no["interval"] == "row bootstrap"


def test_design_for_drops_constant_levels_but_names_a_single_prompt() -> None:
    df = _results(1, 20, 0.0, 1)
    assert design_for(df).describe().startswith("cluster bootstrap: prompt > row (1 prompt, 20 rows); one prompt only")
    two = pl.concat([_results(3, 5, 0.0, 1), _results(3, 5, 0.0, 2).with_columns(pl.lit("b").alias("model"))])
    assert design_for(two).names == ("model", "prompt", "row")
    assert design_for(two.filter(pl.col("model") == "b")).names == ("prompt", "row")


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 60), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_numba_kernels_equal_numpy_references(n: int, b: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=n), 1)
    y = rng.uniform(size=n) < 0.4
    mask = rng.uniform(size=n) < 0.8
    counts = rng.integers(0, 3, size=(b, n)).astype(np.int32)
    counts[0] = 0  # an empty replicate
    for stat in (Median(x, mask), AUC(y, x, mask)):
        fast, ref = stat.replicates(counts), stat.replicates_reference(counts)
        assert np.allclose(fast, ref, rtol=0, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("engine", [resample_counts, resample_counts_reference])
def test_whole_leaves_keep_a_rows_budgets_together(engine) -> None:
    # 3 prompts x 2 rows x 4 budgets: a drawn row brings its 4 observations, never a resample of them
    prompt = np.repeat([0, 1, 2], 8)
    row = np.repeat(np.arange(6), 4)
    d = Design.nested([prompt, row], ["prompt", "row"], whole_leaves=True)
    for c in engine(d, rng_for(4), 200):
        per_row = c.reshape(-1, 6, 4)
        assert (per_row == per_row[:, :, :1]).all()  # equal counts across a row's budgets
        assert (c.reshape(-1, 3, 8).sum(axis=2) % 8 == 0).all()  # prompts drawn whole-sized


@pytest.mark.parametrize("engine", [resample_counts, resample_counts_reference])
def test_whole_clusters_distribution_matches_hand_computation(engine) -> None:
    # example a = rows {1, 1, 1}, example b = {0}: two examples drawn with replacement, each
    # with all its rows: (a, a) p 1/4 -> mean 1; (a, b) or (b, a) p 1/2 -> 3/4; (b, b) p 1/4 -> 0
    x = np.array([1.0, 1.0, 1.0, 0.0])
    design = Design.whole_clusters(["a", "a", "a", "b"])
    counts = np.concatenate(list(engine(design, rng_for(0, "whole"), 40_000)))
    assert (counts[:, :3] == counts[:, :1]).all()  # the rows of a drawn example move together
    means = Mean(x).replicates(counts)
    for v, p in ((1.0, 0.25), (0.75, 0.5), (0.0, 0.25)):
        freq = float(np.mean(np.isclose(means, v)))
        assert abs(freq - p) < 5 * np.sqrt(p * (1 - p) / means.size), (v, freq)
    assert design.describe() == "cluster bootstrap: example (2 examples)"


@pytest.mark.parametrize("engine", [resample_counts, resample_counts_reference])
def test_strata_are_kept_and_their_clusters_resampled_inside(engine) -> None:
    # strata S = {e0, e1}, T = {e2, e3}, one row per example: each stratum draws two of its
    # own examples (multiplicities (2,0), (1,1), (0,2) with p 1/4, 1/2, 1/4), independently,
    # and always holds exactly two draws: 9 combinations with p = product
    design = Design.whole_clusters([0, 1, 2, 3], strata=["S", "S", "T", "T"])
    counts = np.concatenate(list(engine(design, rng_for(1, "strata"), 40_000)))
    assert (counts[:, :2].sum(1) == 2).all() and (counts[:, 2:].sum(1) == 2).all()
    p1 = {(2, 0): 0.25, (1, 1): 0.5, (0, 2): 0.25}
    for a, pa in p1.items():
        for b, pb in p1.items():
            freq = float(np.mean((counts[:, 0] == a[0]) & (counts[:, 2] == b[0])))
            p = pa * pb
            assert abs(freq - p) < 5 * np.sqrt(p * (1 - p) / counts.shape[0]), (a, b, freq)
    assert design.describe() == "cluster bootstrap within strata (stratum: 2): example (4 examples); whole clusters"


def test_strata_must_leave_something_to_resample() -> None:
    with pytest.raises(Exception, match="nothing to resample"):
        Design.nested([[0, 0, 1]], ["group"], whole_leaves=True, strata=1)


def test_sign_share_recounts_each_group_on_every_replicate() -> None:
    # comparisons c (examples 0, 1: +1, -1) and d (examples 0, 1: +1, +1)
    outcome = np.array([1, -1, 1, 1])
    groups = np.array(["c", "c", "d", "d"])
    won = SignShare(outcome, groups, 1)
    assert won.point() == 0.5 and SignShare(outcome, groups, 0).point() == 0.5
    counts = np.array([[2, 0, 2, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=np.int32)
    # c's sums +2, -2, 0; d's +2, +2, +2
    assert won.replicates(counts).tolist() == [1.0, 0.5, 0.5]
    assert SignShare(outcome, groups, -1).replicates(counts).tolist() == [0.0, 0.5, 0.0]


def test_sign_rates_are_the_resampled_verdicts_of_each_group() -> None:
    # c (examples 0, 1: +1, -1), d (+1, +1); drawing 2 of 2 examples: {0,0} 1/4, {1,1} 1/4, {0,1} 1/2
    outcome = np.array([1, -1, 1, 1])
    groups = np.array(["c", "c", "d", "d"])
    design = Design.whole_clusters(np.array([0, 1, 0, 1]), "example")
    labels, pos, neg = sign_rates(outcome, groups, design, seed=0, key="t", n_boot=20_000)
    assert labels.tolist() == ["c", "d"]
    assert pos[0] == pytest.approx(0.25, abs=0.015) and neg[0] == pytest.approx(0.25, abs=0.015)
    assert pos[1] == 1.0 and neg[1] == 0.0
    # a narrow win (one example of 10 won, nine tied) survives only the resamples that draw it
    e = np.array([1] + [0] * 9)
    _, pos, neg = sign_rates(e, np.zeros(10), Design.whole_clusters(np.arange(10), "example"), seed=1,
                             n_boot=20_000)
    assert pos[0] == pytest.approx(1 - 0.9**10, abs=0.015) and neg[0] == 0.0
    with pytest.raises(InputError, match="outcome"):
        sign_rates(e, np.zeros(10), Design.whole_clusters(np.arange(4), "example"), seed=0)


def test_percentile_interval_is_the_quantiles_of_the_level() -> None:
    reps = np.arange(1001, dtype=float)
    assert percentile_interval(reps, 0.95) == pytest.approx((25.0, 975.0), abs=1e-9)
    assert percentile_interval(reps, 0.5) == pytest.approx((250.0, 750.0), abs=1e-9)
    assert all(np.isnan(percentile_interval(np.array([]))))
