"""Properties of the plain-numpy single-row reference (evictlab.core.reference).

Rows are drawn from a seed chosen by hypothesis (derandomized profile in conftest.py), with
structure flags that produce the hard cases: peaked or flat masses, exact mass ties,
duplicated value vectors, zero masses, values of very different scales.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import nnls

from evictlab.core import reference as R
from evictlab.errors import InputError


def make_row(seed: int, n: int, d: int, peaked: bool, ties: bool, dup: bool, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """A random row ``(p (n,), values (n, d))`` with optional ties / duplicates."""
    rng = np.random.default_rng(seed)
    alpha = 0.2 if peaked else 3.0
    p = rng.dirichlet(np.full(n, alpha))
    if ties and n >= 3:
        # Exact ties: copy a mass onto other keys, then renormalise (ties survive scaling).
        p[rng.integers(0, n, size=n // 2)] = p[0]
        p = p / p.sum()
    values = rng.normal(size=(n, d)) * scale
    if dup and n >= 3:
        values[rng.integers(0, n, size=n // 3)] = values[1]
    return p, values


rows = st.builds(
    make_row,
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 24),
    d=st.integers(1, 6),
    peaked=st.booleans(),
    ties=st.booleans(),
    dup=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
)


def kept_from(p: np.ndarray, seed: int, frac: float) -> np.ndarray:
    """A random non-empty kept set of about ``frac * n`` keys, in random order."""
    n = p.shape[0]
    rng = np.random.default_rng(seed)
    k = int(np.clip(round(frac * n), 1, n))
    return rng.permutation(n)[:k]


def tol(values: np.ndarray) -> float:
    """Absolute tolerance for errors in value units: a few hundred ulps of the value scale."""
    return 1e-12 * (1.0 + float(np.abs(values).max()))


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0))
def test_identity_holds_to_rounding(row, kseed, frac):
    p, v = row
    kept = kept_from(p, kseed, frac)
    e = R.forced_error(p, v, kept)
    rhs = R.identity_rhs(p, v, kept)
    # Independent evaluation of D(A) ||m_{A^c} - m_A|| with explicit loops over keys.
    n = p.shape[0]
    keep = set(int(i) for i in kept)
    pa = sum(p[i] for i in keep)
    pc = sum(p[i] for i in range(n) if i not in keep)
    m_a = sum(p[i] * v[i] for i in keep) / pa
    direct = 0.0 if pc == 0 else pc / (pa + pc) * float(np.linalg.norm(sum(p[i] * v[i] for i in range(n) if i not in keep) / pc - m_a))
    assert abs(e - rhs) <= tol(v)
    assert abs(rhs - direct) <= tol(v)


@given(rows)
def test_keeping_everything_has_zero_error(row):
    p, v = row
    everything = np.arange(p.shape[0])
    assert R.forced_error(p, v, everything) <= tol(v)
    assert R.identity_rhs(p, v, everything) == 0.0
    assert R.dropped_mass(p, everything) == 0.0
    assert R.free_weight_error(p, v, everything)[0] <= tol(v)


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0), st.integers(0, 10**6))
def test_error_invariant_under_key_permutation(row, kseed, frac, pseed):
    p, v = row
    kept = kept_from(p, kseed, frac)
    perm = np.random.default_rng(pseed).permutation(p.shape[0])
    inv = np.argsort(perm)  # new position of old key i
    p2, v2, kept2 = p[perm], v[perm], inv[kept]
    assert abs(R.forced_error(p, v, kept) - R.forced_error(p2, v2, kept2)) <= tol(v)
    assert abs(R.dropped_mass(p, kept) - R.dropped_mass(p2, kept2)) <= 1e-15 * p.shape[0]
    assert abs(R.free_weight_error(p, v, kept)[0] - R.free_weight_error(p2, v2, kept2)[0]) <= tol(v)


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0), st.floats(-20.0, 20.0))
def test_error_scales_with_values(row, kseed, frac, c):
    p, v = row
    kept = kept_from(p, kseed, frac)
    e = R.forced_error(p, v, kept)
    assert abs(R.forced_error(p, c * v, kept) - abs(c) * e) <= tol(c * v) + abs(c) * tol(v)
    ef = R.free_weight_error(p, v, kept)[0]
    assert abs(R.free_weight_error(p, c * v, kept)[0] - abs(c) * ef) <= tol(c * v) + abs(c) * tol(v)


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0), st.integers(0, 10**6))
def test_error_invariant_under_translation(row, kseed, frac, tseed):
    p, v = row
    kept = kept_from(p, kseed, frac)
    shift = np.random.default_rng(tseed).normal(size=v.shape[1]) * 10.0
    moved = v + shift[None, :]
    assert abs(R.forced_error(p, v, kept) - R.forced_error(p, moved, kept)) <= tol(moved)
    assert abs(R.free_weight_error(p, v, kept)[0] - R.free_weight_error(p, moved, kept)[0]) <= tol(moved)
    # Least squares is NOT translation invariant (no sum-to-one constraint): only check order.
    assert R.least_squares_error(p, moved, kept) <= R.free_weight_error(p, moved, kept)[0] + tol(moved)


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0))
def test_free_weight_between_least_squares_and_forced(row, kseed, frac):
    p, v = row
    kept = kept_from(p, kseed, frac)
    e = R.forced_error(p, v, kept)
    ef, w = R.free_weight_error(p, v, kept)
    ls = R.least_squares_error(p, v, kept)
    assert ls <= ef + tol(v)
    assert ef <= e + tol(v)
    assert w.shape == kept.shape and np.all(w >= 0.0) and abs(w.sum() - 1.0) <= 1e-12


def _nnls_free_weight(p: np.ndarray, v: np.ndarray, kept: np.ndarray) -> float:
    """Independent solver: NNLS on ``[V_A^T; M 1^T] w ~ [mu; M]`` (large M enforces sum w = 1)."""
    mu = (p / p.sum()) @ v
    big = 1e3 * (1.0 + np.abs(v).max())
    a = np.vstack([v[kept].T, big * np.ones((1, kept.shape[0]))])
    b = np.concatenate([mu, [big]])
    w, _ = nnls(a, b, maxiter=50 * a.shape[1])
    w = w / w.sum()
    return float(np.linalg.norm(mu - w @ v[kept]))


@given(rows, st.integers(0, 10**6), st.floats(0.05, 1.0))
def test_free_weight_matches_independent_nnls_and_kkt(row, kseed, frac):
    p, v = row
    kept = kept_from(p, kseed, frac)
    ef, w = R.free_weight_error(p, v, kept)
    # Wolfe is exact: never worse than NNLS (a feasible point), and NNLS can't beat it either.
    assert abs(ef - _nnls_free_weight(p, v, kept)) <= 1e-9 * (1.0 + np.abs(v).max())
    # KKT of min ||X w||^2 on the simplex: with y = X w, every <x_i, y> >= ||y||^2 (up to
    # rounding), with equality on the support of w.
    mu = (p / p.sum()) @ v
    x = v[kept] - mu
    y = w @ x
    dots = x @ y
    scale = float((x * x).sum(axis=1).max())
    assert dots.min() >= y @ y - 1e-12 * scale
    assert np.all(np.abs(dots[w > 1e-9] - y @ y) <= 1e-10 * scale)
    lb, ub = R.free_weight_gap(p, v, kept, w)
    assert abs(ub - ef) <= 1e-15 * (1.0 + np.sqrt(scale))
    assert 0.0 <= lb <= ub + 1e-15
    assert (ub * ub - lb * ub) <= 1e-12 * scale  # the Wolfe gap in squared units


def test_free_weight_on_a_known_hull():
    # mu is the centroid of a triangle's corners (0,0), (3,0), (0,3) plus a far key.
    p = np.array([0.25, 0.25, 0.25, 0.25])
    v = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 3.0], [4.0, 4.0]])  # mu = (1.75, 1.75)
    e, w = R.free_weight_error(p, v, np.array([1, 2]))
    # distance from (1.75, 1.75) to the segment x + y = 3: (3.5 - 3) / sqrt(2)
    assert e == pytest.approx(0.5 / np.sqrt(2.0), abs=1e-15)
    assert w == pytest.approx([0.5, 0.5], abs=1e-15)
    e_in, _ = R.free_weight_error(p, v, np.array([0, 1, 3]))
    assert e_in <= 1e-14  # (1.75, 1.75) lies in conv{(0,0), (3,0), (4,4)}


def test_forced_error_small_example_by_hand():
    p = np.array([0.5, 0.3, 0.2])
    v = np.array([[1.0], [0.0], [-1.0]])
    # mu = 0.3; m_{0,1} = 0.5 / 0.8 = 0.625; e = 0.325; D = 0.2; m_{A^c} = -1 -> 0.2 * 1.625
    assert R.dense_output(p, v) == pytest.approx([0.3], abs=1e-15)
    assert R.forced_output(p, v, [1, 0]) == pytest.approx([0.625], abs=1e-15)
    assert R.forced_error(p, v, [0, 1]) == pytest.approx(0.325, abs=1e-15)
    assert R.identity_rhs(p, v, [0, 1]) == pytest.approx(0.325, abs=1e-15)
    assert R.dropped_mass(p, [0, 1]) == pytest.approx(0.2, abs=1e-15)
    assert R.single_key_errors(p, v) == pytest.approx([0.7, 0.3, 1.3], abs=1e-15)
    assert R.entropy(p) == pytest.approx(-(0.5 * np.log(0.5) + 0.3 * np.log(0.3) + 0.2 * np.log(0.2)), abs=1e-15)


def test_zero_mass_kept_set_has_infinite_error():
    p = np.array([1.0, 0.0, 0.0])
    v = np.array([[1.0], [2.0], [3.0]])
    assert R.forced_error(p, v, [1, 2]) == np.inf
    assert R.identity_rhs(p, v, [1, 2]) == np.inf
    assert R.identity_rhs(p, v, [0]) == 0.0  # dropped keys carry no mass
    with pytest.raises(InputError, match="kept"):
        R.forced_output(p, v, [1, 2])


def test_top_mass_tie_rule_prefers_larger_index():
    p = np.array([0.2, 0.1, 0.2, 0.1, 0.2, 0.2]) / 1.0
    assert R.top_mass_set(p, 1).tolist() == [5]
    assert R.top_mass_set(p, 4).tolist() == [5, 4, 2, 0]
    assert R.top_mass_set(p, 6).tolist() == [5, 4, 2, 0, 3, 1]


@given(rows, st.integers(1, 24))
def test_top_mass_set_matches_brute_force_ranking(row, s):
    p, _ = row
    s = min(s, p.shape[0])
    top = R.top_mass_set(p, s)
    # Independent rule: sort the pairs (p_i, i) descending as Python tuples.
    expect = [i for _, i in sorted(((float(p[i]), i) for i in range(p.shape[0])), reverse=True)[:s]]
    assert top.dtype == np.int64 and top.tolist() == expect


@given(rows, st.integers(1, 24), st.integers(0, 4), st.integers(0, 4))
def test_candidate_pool_definition(row, s, r_m, r_e):
    p, v = row
    n = p.shape[0]
    s = min(s, n)
    pool = R.candidate_pool(p, v, s, r_m, r_e)
    assert pool.shape == (min(n, s + r_m + r_e),) and len(set(pool.tolist())) == pool.shape[0]
    n_top = min(n, s + r_m)
    assert pool[:n_top].tolist() == R.top_mass_set(p, n_top).tolist()
    err = R.single_key_errors(p, v)
    rest = [i for i in range(n) if i not in set(pool[:n_top].tolist())]
    expect = [i for _, i in sorted(((float(err[i]), i) for i in rest), reverse=True)[:r_e]]
    assert pool[n_top:].tolist() == expect


@given(rows)
def test_entropy_bounds(row):
    p, _ = row
    h = R.entropy(p)
    assert -1e-12 <= h <= np.log(p.shape[0]) + 1e-12


def test_least_squares_is_an_ablation_lower_bound_on_a_known_case():
    # Two kept vectors spanning the plane: least squares reaches mu exactly,
    # the simplex-constrained weights cannot (mu is off the segment).
    p = np.array([0.5, 0.25, 0.25])
    v = np.array([[2.0, 2.0], [1.0, 0.0], [0.0, 1.0]])  # mu = (1.25, 1.25)
    assert R.least_squares_error(p, v, [1, 2]) <= 1e-15
    assert R.free_weight_error(p, v, [1, 2])[0] == pytest.approx(np.sqrt(2) * 0.75, abs=1e-15)


def test_exhaustive_small_row_free_weight_never_above_forced():
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.ones(6))
    v = rng.normal(size=(6, 2))
    for k in range(1, 7):
        for kept in itertools.combinations(range(6), k):
            kept = np.array(kept)
            assert R.free_weight_error(p, v, kept)[0] <= R.forced_error(p, v, kept) + 1e-14


def _face_enumeration_free_weight(p: np.ndarray, v: np.ndarray, kept: np.ndarray) -> float:
    """Exact independent reference for small |A|: the optimum is the affine minimiser of
    some face with non-negative weights (Caratheodory: an affinely independent face
    suffices), so the minimum over all faces of those feasible affine minimisers is exact."""
    mu = (p / p.sum()) @ v
    x = v[kept] - mu
    best = np.inf
    for size in range(1, kept.shape[0] + 1):
        for face in itertools.combinations(range(kept.shape[0]), size):
            xf = x[list(face)]
            # KKT of min ||xf^T a||^2 s.t. sum a = 1:  [2 G  1; 1^T 0] [a; lam] = [0; 1]
            kkt = np.zeros((size + 1, size + 1))
            kkt[:size, :size] = 2.0 * xf @ xf.T
            kkt[:size, size] = 1.0
            kkt[size, :size] = 1.0
            rhs = np.zeros(size + 1)
            rhs[size] = 1.0
            sol = np.linalg.lstsq(kkt, rhs, rcond=None)[0]
            a = sol[:size]
            if abs(a.sum() - 1.0) < 1e-9 and np.all(a >= -1e-12):
                best = min(best, float(np.linalg.norm(a @ xf)))
    return best


@given(rows, st.integers(0, 10**6), st.integers(1, 5))
def test_free_weight_matches_exact_face_enumeration(row, kseed, k):
    p, v = row
    kept = np.random.default_rng(kseed).permutation(p.shape[0])[: min(k, p.shape[0])]
    ef, _ = R.free_weight_error(p, v, kept)
    assert abs(ef - _face_enumeration_free_weight(p, v, kept)) <= 1e-10 * (1.0 + np.abs(v).max())
