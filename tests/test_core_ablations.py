"""The free-weight ablations (affine hull, non-negative cone) against independent exact methods."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import nnls

from evictlab.core import reference as R
from tests.test_core_reference import kept_from, rows, tol


def _kkt_affine(p: np.ndarray, v: np.ndarray, kept: np.ndarray) -> float:
    """min ||V_A^T w - mu|| s.t. 1^T w = 1 through its KKT system [[G, 1], [1^T, 0]] [w; l] = [V_A mu; 1],
    G = V_A V_A^T, solved by scipy's minimum-norm least squares (handles singular G)."""
    pn = p / p.sum()
    mu = pn @ v
    Va = v[kept]
    k = Va.shape[0]
    K = np.zeros((k + 1, k + 1))
    K[:k, :k] = Va @ Va.T
    K[:k, k] = K[k, :k] = 1.0
    rhs = np.r_[Va @ mu, 1.0]
    sol = scipy.linalg.lstsq(K, rhs, lapack_driver="gelsd")[0]
    return float(np.linalg.norm(Va.T @ sol[:k] - mu))


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0))
def test_affine_error_equals_kkt_solve(row, kseed, frac):
    p, v = row
    kept = kept_from(p, kseed, frac)
    # the KKT system squares the conditioning: compare at a tolerance scaled to it
    scale = 1.0 + float(np.abs(v).max())
    assert R.affine_error(p, v, kept) == pytest.approx(_kkt_affine(p, v, kept), abs=1e-6 * scale)


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0))
def test_nonneg_error_equals_scipy_nnls_and_meets_kkt(row, kseed, frac):
    p, v = row
    kept = kept_from(p, kseed, frac)
    e, w = R.nonneg_error(p, v, kept)
    mu = (p / p.sum()) @ v
    ref = float(nnls(v[kept].T, mu, maxiter=50 * (len(kept) + 5))[1])
    assert e == pytest.approx(ref, abs=1e-9 * (1.0 + float(np.abs(v).max()) ** 2) ** 0.5 * 10)
    assert np.all(w >= 0.0) and w.shape == kept.shape
    assert e == pytest.approx(float(np.linalg.norm(mu - v[kept].T @ w)), abs=tol(v))
    grad = v[kept] @ (mu - v[kept].T @ w)  # KKT: grad <= 0 off the support, = 0 on it
    gscale = 1e-9 * (1.0 + float(np.abs(v).max())) ** 2
    assert np.all(grad <= gscale)
    assert np.all(np.abs(grad[w > 0]) <= gscale)


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0))
def test_ablations_are_ordered(row, kseed, frac):
    p, v = row
    kept = kept_from(p, kseed, frac)
    e = R.forced_error(p, v, kept)
    hull = R.free_weight_error(p, v, kept)[0]
    aff = R.affine_error(p, v, kept)
    cone = R.nonneg_error(p, v, kept)[0]
    ls = R.least_squares_error(p, v, kept)
    t = 1e-9 * (1.0 + float(np.abs(v).max()))
    assert ls <= aff + t and aff <= hull + t and hull <= e + t
    assert ls <= cone + t and cone <= hull + t


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0), st.integers(0, 10**6))
def test_affine_error_translation_invariant(row, kseed, frac, tseed):
    p, v = row
    kept = kept_from(p, kseed, frac)
    moved = v + np.random.default_rng(tseed).normal(size=v.shape[1])[None, :] * 10.0
    assert R.affine_error(p, v, kept) == pytest.approx(R.affine_error(p, moved, kept), abs=1e-9 * (1 + np.abs(moved).max()))


def test_affine_hull_fills_space_once_kept_exceeds_dim() -> None:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(12))
    v = rng.normal(size=(12, 3))
    assert R.affine_error(p, v, np.arange(4)) <= 1e-12  # 4 points in general position span R^3 affinely
    assert R.affine_error(p, v, np.arange(3)) > 1e-6    # a plane misses mu
    assert R.nonneg_error(p, v, [0])[0] == pytest.approx(
        float(np.linalg.norm(p @ v - max(0.0, float(v[0] @ (p @ v)) / float(v[0] @ v[0])) * v[0])), abs=1e-12)
