"""Dilution measures (docs/theory.md section 7) against the one-row numpy reference, and the
three theorems on constructed rows: where they are tight and where their assumptions fail."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st

from evictlab.dilution import reference as ref
from evictlab.dilution.check import bound_checks
from evictlab.dilution.measures import TOL, kept_measures, margin_bound, row_measures


def _block(logit_rows: list[np.ndarray], L: int, lo: list[int] | None = None):
    """Dense (R, L) arrays for rows given by their logits over keys [lo, lo + len)."""
    R = len(logit_rows)
    lo = lo or [0] * R
    P = np.zeros((R, L))
    Lg = np.full((R, L), -np.inf)
    vis = np.zeros((R, L), bool)
    for r, z in enumerate(logit_rows):
        a, b = lo[r], lo[r] + len(z)
        P[r, a:b] = ref.softmax(z)
        Lg[r, a:b] = z
        vis[r, a:b] = True
    return P, Lg, vis


def _seeded(seed: int, R: int = 6, L: int = 40, d: int = 5):
    rng = np.random.default_rng(seed)
    lo = [int(rng.integers(0, 8)) for _ in range(R)]
    rows = [rng.normal(0, 2.5, size=int(rng.integers(10, L - lo[r] + 1))) for r in range(R)]
    P, Lg, vis = _block(rows, L, lo)
    useful = np.zeros(L, bool)
    useful[rng.choice(L, size=6, replace=False)] = True
    kept = vis & (rng.random((R, L)) < 0.5)
    V = rng.normal(size=(L, d))
    return P, Lg, vis, useful, kept, V, rows, lo


@pytest.mark.parametrize("seed", range(12))
def test_block_measures_equal_the_one_row_reference(seed: int) -> None:
    P, Lg, vis, useful, kept, V, rows, lo = _seeded(seed)
    rm = row_measures(P, Lg, vis, useful)
    km = kept_measures(P, Lg, vis, useful, V, kept)
    for r, z in enumerate(rows):
        a, b = lo[r], lo[r] + len(z)
        u, k, v = useful[a:b], kept[r, a:b], V[a:b]
        if not u.any():
            assert rm["n_useful"][r] == 0 and rm["alpha"][r] == 0 and math.isnan(rm["bound_margin"][r])
            continue
        assert rm["alpha"][r] == pytest.approx(ref.useful_mass(z, u), abs=1e-13)
        assert rm["alpha_logits"][r] == pytest.approx(ref.useful_mass(z, u), abs=1e-13)
        assert rm["bound_margin"][r] == pytest.approx(ref.margin_lower_bound(z, u), rel=1e-12, abs=1e-300)
        assert rm["bound_upper"][r] == pytest.approx(ref.spread_upper_bound(z, u), rel=1e-12)
        assert rm["margin"][r] == pytest.approx(min(z[u]) - max(z[~u]))
        assert rm["margin_mean"][r] == pytest.approx(z[u].mean() - max(z[~u]))
        if k.any():
            assert km["alpha_kept"][r] == pytest.approx(ref.kept_useful_mass(z, u, k), abs=1e-13)
            assert km["sigma_distractor"][r] == pytest.approx(ref.distractor_fraction(z, u, k), rel=1e-12)
            assert km["err_kept"][r] == pytest.approx(ref.useful_error(z, u, v, k), rel=1e-10, abs=1e-12)
            assert km["kept"][r] == k.sum() and km["kept_useful"][r] == (k & u).sum()
            assert bool(km["contains_useful"][r]) == bool((k | ~u).all())
        assert km["err_full"][r] == pytest.approx(ref.useful_error(z, u, v), rel=1e-10, abs=1e-12)


@given(st.integers(1, 6), st.integers(1, 30), st.floats(-8, 8), st.floats(-8, 8))
def test_theorem1_is_tight_on_two_level_rows(nu: int, nd: int, a: float, b: float) -> None:
    """All useful logits a, all distractor logits b: every bound of Theorem 1 is an equality."""
    z = np.array([a] * nu + [b] * nd)
    u = np.array([True] * nu + [False] * nd)
    P, Lg, vis = _block([z], len(z))
    rm = row_measures(P, Lg, vis, u)
    exact = 1.0 / (1.0 + (nd / nu) * math.exp(-(a - b)))
    for key in ("alpha", "bound_margin", "bound_mean", "bound_upper"):
        assert rm[key][0] == pytest.approx(exact, rel=1e-12), key


@given(st.lists(st.floats(-20, 20), min_size=2, max_size=25), st.integers(0, 10**6))
def test_theorem1_holds_on_random_rows(z: list[float], seed: int) -> None:
    z_arr = np.array(z)
    rng = np.random.default_rng(seed)
    u = rng.random(len(z)) < 0.4
    if u.all() or not u.any():
        u[0], u[-1] = True, False
    P, Lg, vis = _block([z_arr], len(z))
    rm = row_measures(P, Lg, vis, u)
    assert rm["bound_margin"][0] <= rm["bound_mean"][0] + TOL
    assert rm["bound_mean"][0] <= rm["alpha"][0] + TOL <= rm["bound_upper"][0] + 2 * TOL


def test_stated_margin_fails_when_its_assumption_fails() -> None:
    """One useful, one distractor key with equal logits: Delta = 0 < Delta_0 = 5 and the stated
    bound 1/(1 + e^-5) = 0.993 exceeds alpha = 1/2; the check counts it as 'assumption fails'."""
    P, Lg, vis = _block([np.array([0.0, 0.0])], 2)
    u = np.array([True, False])
    rm = row_measures(P, Lg, vis, u, stated_margin=5.0)
    assert rm["alpha"][0] == pytest.approx(0.5)
    assert not rm["stated_holds"][0] and rm["slack_stated"][0] < -0.4
    # ...and with the margin true (Delta = 6 >= 5) the stated bound holds
    P2, Lg2, vis2 = _block([np.array([6.0, 0.0])], 2)
    rm2 = row_measures(P2, Lg2, vis2, u, stated_margin=5.0)
    assert rm2["stated_holds"][0] and rm2["slack_stated"][0] > 0


def test_margin_bound_never_overflows() -> None:
    nu, nd = np.array([1, 1, 3]), np.array([10**6, 1, 0])
    out = margin_bound(np.array([-1e4, 1e4, 0.0]), nu, nd)
    assert out[0] == 0.0 and out[1] == 1.0 and math.isnan(out[2])


@pytest.mark.parametrize("seed", range(8))
def test_theorem2_share_formula_and_kept_sets_containing_u(seed: int) -> None:
    P, Lg, vis, useful, kept, V, rows, lo = _seeded(seed)
    rm = row_measures(P, Lg, vis, useful)
    km = kept_measures(P, Lg, vis, useful, V, kept)
    a, su, sd, aa = rm["alpha"], km["sigma_useful"], km["sigma_distractor"], km["alpha_kept"]
    ok = (a > 0) & (a < 1) & np.isfinite(aa) & np.isfinite(sd)
    formula = a * (1 - a) * (su - sd) / (su * a + sd * (1 - a))
    np.testing.assert_allclose((aa - a)[ok], formula[ok], atol=1e-13)
    assert (np.sign(np.round(aa - a, 12))[ok] == np.sign(np.round(su - sd, 12))[ok]).all()
    # keep every useful key plus a random half of the rest: alpha_A = alpha_rho >= alpha
    with_u = kept | (vis & useful[None, :])
    k2 = kept_measures(P, Lg, vis, useful, V, with_u)
    has_u = rm["n_useful"] > 0
    assert k2["contains_useful"][has_u].all()
    assert (k2["alpha_kept"][has_u] >= a[has_u] - TOL).all()
    np.testing.assert_allclose(k2["alpha_kept"][has_u], k2["alpha_rho"][has_u], atol=1e-13)
    np.testing.assert_allclose(k2["alpha_kept"][has_u], ((a + 0) / (a + k2["sigma_distractor"] * (1 - a)))[has_u],
                               atol=1e-13)
    # Theorem 3: the identity, the scaling and the bound
    scale = 1 + k2["value_scale"][has_u]
    assert (k2["identity_gap"][has_u] <= 1e-12 * scale).all()
    assert (k2["err_kept"][has_u] <= k2["err_bound"][has_u] + 1e-12 * scale).all()
    ratio_ok = has_u & np.isfinite(k2["err_ratio"]) & np.isfinite(k2["value_shift"])
    np.testing.assert_allclose(k2["err_ratio"][ratio_ok], (k2["error_scaling"] * k2["value_shift"])[ratio_ok],
                               rtol=1e-9)
    assert (k2["error_scaling"][has_u & (a < 1)] <= 1 + TOL).all()


def test_theorem2_assumption_fails_when_a_useful_key_is_evicted() -> None:
    """Evicting the strongest useful key lowers alpha (sigma_U < sigma_D): allowed, since U is not in A."""
    z = np.array([5.0, 1.0, 0.0, 0.0, 0.0])
    u = np.array([True, True, False, False, False])
    P, Lg, vis = _block([z], 5)
    kept = np.array([[False, True, True, True, True]])
    rm = row_measures(P, Lg, vis, u)
    km = kept_measures(P, Lg, vis, u, np.eye(5), kept)
    assert not km["contains_useful"][0] and km["sigma_useful"][0] < km["sigma_distractor"][0]
    assert km["alpha_kept"][0] < rm["alpha"][0]


def _table(rows: list[dict]) -> pl.DataFrame:
    base = {"useful_visible": True, "stated_holds": True, "slack_stated": 0.0, "value_scale": 1.0}
    return pl.DataFrame([{**base, **r} for r in rows], infer_schema_length=None)


def test_bound_checks_count_violations_only_where_assumptions_hold() -> None:
    full = {"method": "full", "alpha": 0.3, "alpha_logits": 0.3, "bound_margin": 0.2, "bound_mean": 0.25,
            "bound_upper": 0.5, "slack_margin": 0.1, "slack_mean": 0.05, "slack_upper": 0.2}
    kept = {"method": "snapkv", "alpha": 0.3, "alpha_kept": 0.2, "alpha_rho": 0.2, "sigma_useful": 0.5,
            "sigma_distractor": 0.8, "contains_useful": False, "kept_useful": 1, "kept_distractors": 3,
            "slack_margin_kept": 0.01, "err_kept": 1.0, "identity_gap": 0.5, "err_bound": 0.5,
            "err_ratio": 1.0, "error_scaling": 1.0, "value_shift": 2.0}
    bad = dict(kept, contains_useful=True)  # alpha_A < alpha with U in A: a violation of Theorem 2
    t = _table([full, {**full, "slack_margin": -0.5}, kept, bad])
    checks = {r["check"]: r for r in bound_checks(t).to_dicts()}
    assert checks["margin_lower"]["violations"] == 1 and checks["margin_lower"]["slack_min"] == -0.5
    assert checks["kept_raises_alpha"]["violations"] == 1
    assert checks["kept_raises_alpha"]["assumption_fails"] == 1
    assert checks["kept_raises_alpha"]["violations_when_fails"] == 1
    assert checks["share_criterion"]["violations"] == 0  # alpha_A < alpha and sigma_U < sigma_D agree
    assert checks["error_identity"]["violations"] == 1 and checks["error_bound"]["violations"] == 1
    assert checks["error_scaling"]["violations"] == 1
    assert checks["mean_margin_lower"]["violations"] == 0 and checks["spread_upper"]["violations"] == 0
    assert "stated_margin_lower" not in checks
    assert "stated_margin_lower" in set(bound_checks(t, stated=True)["check"])


@given(st.lists(st.floats(-15, 15), min_size=3, max_size=20), st.integers(0, 10**6), st.booleans())
def test_theorems_2_and_3_on_random_rows_and_kept_sets(z: list[float], seed: int, keep_u: bool) -> None:
    """Any A: the share criterion and Theorem 1 over A. A containing U: alpha_A = alpha_rho >=
    alpha, and Theorem 3's identity, scaling and bound (values drawn per key)."""
    z_arr = np.array(z)
    n = len(z)
    rng = np.random.default_rng(seed)
    u = rng.random(n) < 0.35
    u[0], u[-1] = True, False
    k = rng.random(n) < 0.5
    k[int(rng.integers(0, n))] = True
    if keep_u:
        k |= u
    V = rng.normal(size=(n, 3)) * rng.uniform(0.1, 10)
    P, Lg, vis = _block([z_arr], n)
    rm = row_measures(P, Lg, vis, u)
    km = kept_measures(P, Lg, vis, u, V, k[None, :])
    a, aa, su, sd = rm["alpha"][0], km["alpha_kept"][0], km["sigma_useful"][0], km["sigma_distractor"][0]
    if np.isfinite(sd) and 0 < a < 1:
        assert aa - a == pytest.approx(a * (1 - a) * (su - sd) / (su * a + sd * (1 - a)), abs=TOL)
        if abs(aa - a) > 1e-9 and abs(su - sd) > 1e-9:
            assert (aa > a) == (su > sd)
    if km["kept_useful"][0] > 0 and km["kept_distractors"][0] > 0:
        assert aa >= km["bound_margin_kept"][0] - TOL
        assert km["margin_kept"][0] >= rm["margin"][0] - 1e-12 or not keep_u
    if keep_u:
        assert km["contains_useful"][0] and aa >= a - TOL
        assert aa == pytest.approx(km["alpha_rho"][0], abs=1e-12)
        scale = 1 + km["value_scale"][0]
        assert km["identity_gap"][0] <= 1e-9 * scale
        assert km["err_kept"][0] <= km["err_bound"][0] + 1e-9 * scale
        # the same error from the one-row reference
        assert km["err_kept"][0] == pytest.approx(ref.useful_error(z_arr, u, V, k), rel=1e-9, abs=1e-9 * scale)
        if np.isfinite(km["err_ratio"][0]) and np.isfinite(km["value_shift"][0]) and a < 1 - 1e-6:
            assert km["err_ratio"][0] == pytest.approx(km["error_scaling"][0] * km["value_shift"][0], rel=1e-7)


def test_theorem3_identity_fails_when_a_useful_key_is_evicted() -> None:
    """Two useful keys with different values, one evicted: m_A - m_U is no longer a multiple of
    m_{D n A} - m_U, so the identity (Theorem 3's conclusion) does not hold without U in A."""
    z = np.array([1.0, 1.0, 0.0, 0.0])
    u = np.array([True, True, False, False])
    V = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    P, Lg, vis = _block([z], 4)
    km = kept_measures(P, Lg, vis, u, V, np.array([[True, False, True, True]]))
    assert not km["contains_useful"][0] and km["identity_gap"][0] > 0.1
    full = kept_measures(P, Lg, vis, u, V, np.array([[True, True, True, False]]))
    assert full["contains_useful"][0] and full["identity_gap"][0] < 1e-12
