"""Numba batch kernels (evictlab.core.kernels) == numpy reference, row by row.

Batches are ragged (different n per row) and share value blocks through ``v_start``, as
rows of one (prompt, layer, KV head) do in the real dataset: each row reads a contiguous
window of one block. Hypothesis draws the layout; numpy draws the numbers from a seed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evictlab.core import freeweight as F
from evictlab.core import kernels as K
from evictlab.core import ranking
from evictlab.core import reference as R
from evictlab.errors import InputError


class RaggedBatch(NamedTuple):
    p: np.ndarray  # float64 [sum n]
    p_off: np.ndarray  # int64 [N+1]
    values: np.ndarray  # float64 [K, d]
    v_start: np.ndarray  # int64 [N]

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.p_off[i], self.p_off[i + 1]
        return self.p[lo:hi], self.values[self.v_start[i] : self.v_start[i] + hi - lo]

    @property
    def n(self) -> np.ndarray:
        return np.diff(self.p_off)


def make_batch(seed: int, n_rows: int, n_max: int, d: int, n_blocks: int, ties: bool, dup: bool) -> RaggedBatch:
    """Ragged batch: ``n_blocks`` value blocks of ``n_max`` vectors; each row a window of one."""
    rng = np.random.default_rng(seed)
    blocks = rng.normal(size=(n_blocks, n_max, d)) * rng.choice([0.01, 1.0, 30.0], size=(n_blocks, 1, 1))
    if dup and n_max >= 3:
        blocks[:, rng.integers(0, n_max, size=n_max // 3)] = blocks[:, :1]
    values = blocks.reshape(n_blocks * n_max, d)
    ns = rng.integers(1, n_max + 1, size=n_rows)
    v_start = np.array([rng.integers(0, n_blocks) * n_max + rng.integers(0, n_max - n + 1) for n in ns], dtype=np.int64)
    ps = []
    for n in ns:
        p = rng.dirichlet(np.full(n, rng.choice([0.1, 1.0, 5.0])))
        if ties and n >= 3:
            p[rng.integers(0, n, size=n // 2)] = p[-1]
            p = p / p.sum()
        ps.append(p)
    p_off = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    return RaggedBatch(np.concatenate(ps), p_off, values, v_start)


batches = st.builds(
    make_batch,
    seed=st.integers(0, 2**32 - 1),
    n_rows=st.integers(1, 12),
    n_max=st.integers(1, 20),
    d=st.integers(1, 5),
    n_blocks=st.integers(1, 3),
    ties=st.booleans(),
    dup=st.booleans(),
)


def tol(values: np.ndarray) -> float:
    return 1e-12 * (1.0 + float(np.abs(values).max()))


def _mu(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Dense output of one row by the kernels' own helper (what the batch kernel passes)."""
    mu = np.empty(v.shape[1])
    K.row_dense_output(np.ascontiguousarray(p), np.ascontiguousarray(v), mu)
    return mu


def random_kept(b: RaggedBatch, seed: int, width: int) -> np.ndarray:
    """Kept sets (N, width) of local indices in random order, -1 padding at random places."""
    rng = np.random.default_rng(seed)
    kept = np.full((b.n.shape[0], width), -1, dtype=np.int64)
    for i, n in enumerate(b.n):
        k = int(rng.integers(1, min(n, width) + 1))
        slots = rng.permutation(width)[:k]
        kept[i, slots] = rng.permutation(n)[:k]
    return kept


@given(batches)
def test_dense_single_key_and_entropy_match_reference(b):
    mu = K.batch_dense_output(*b)
    sk = K.batch_single_key_errors(*b)
    h = K.batch_entropy(b.p, b.p_off)
    assert mu.shape == (b.n.shape[0], b.values.shape[1]) and sk.shape == b.p.shape
    for i in range(b.n.shape[0]):
        p, v = b.row(i)
        np.testing.assert_allclose(mu[i], R.dense_output(p, v), rtol=0, atol=tol(v))
        np.testing.assert_allclose(sk[b.p_off[i] : b.p_off[i + 1]], R.single_key_errors(p, v), rtol=0, atol=tol(v))
        assert abs(h[i] - R.entropy(p)) <= 1e-12


@njit
def _normalized(p):  # noqa: ANN001, ANN202 - the helpers as the solvers call them: from compiled code
    return K.row_normalized(p)


@njit
def _weighted_sum(p, v):  # noqa: ANN001, ANN202
    return K.row_weighted_sum(p, v)


@given(batches)
def test_row_helpers_are_the_dense_output_the_solvers_use(b):
    # the solvers normalise (row_normalized) then sum (row_weighted_sum); the core's
    # row_dense_output must give those exact bits, and both the reference's values.
    # Called through uncached wrappers, as the solvers call them: a cached helper that
    # returns an array, called from Python after a cached caller compiled it in this
    # process, trips numba's "'descr' is NULL" (its environment is missing after the
    # cache load), whatever the helper computes.
    for i in range(b.n.shape[0]):
        p, v = b.row(i)
        pn = _normalized(p)
        np.testing.assert_allclose(pn, p / p.sum(), rtol=1e-15, atol=0)
        mu = _weighted_sum(pn, v)
        assert np.array_equal(mu, _mu(p, v))
        np.testing.assert_allclose(mu, R.dense_output(p, v), rtol=0, atol=tol(v))


@given(batches, st.integers(1, 20))
def test_top_mass_matches_reference_tie_rule(b, s):
    s = min(s, int(b.n.min()))
    top = K.batch_top_mass(b.p, b.p_off, s)
    assert top.dtype == np.int64 and top.shape == (b.n.shape[0], s)
    for i in range(b.n.shape[0]):
        assert top[i].tolist() == R.top_mass_set(b.row(i)[0], s).tolist()


@given(batches, st.integers(1, 20), st.integers(0, 4), st.integers(0, 4))
def test_candidate_pool_matches_reference(b, s, r_m, r_e):
    s = min(s, int(b.n.min()))
    pool, size = K.batch_candidate_pool(*b, s, r_m, r_e)
    assert pool.shape == (b.n.shape[0], int(size.max()))
    for i in range(b.n.shape[0]):
        p, v = b.row(i)
        ref = R.candidate_pool(p, v, s, r_m, r_e)
        assert size[i] == ref.shape[0]
        assert pool[i, : size[i]].tolist() == ref.tolist()
        assert np.all(pool[i, size[i] :] == -1)


@given(batches, st.integers(0, 10**6), st.integers(1, 20))
def test_forced_dropped_free_match_reference(b, kseed, width):
    kept = random_kept(b, kseed, width)
    e = K.batch_forced_error(*b, kept)
    dm = K.batch_dropped_mass(b.p, b.p_off, kept)
    ef = K.batch_free_weight_error(*b, kept)
    for i in range(b.n.shape[0]):
        p, v = b.row(i)
        a = kept[i][kept[i] >= 0]
        assert abs(e[i] - R.forced_error(p, v, a)) <= tol(v)
        assert abs(e[i] - R.identity_rhs(p, v, a)) <= tol(v)
        assert abs(dm[i] - R.dropped_mass(p, a)) <= 1e-14
        assert abs(ef[i] - R.free_weight_error(p, v, a)[0]) <= tol(v)
        assert ef[i] <= e[i] + tol(v)


@given(batches, st.integers(0, 10**6), st.integers(1, 20))
def test_row_free_weight_weights_are_kkt_optimal(b, kseed, width):
    kept = random_kept(b, kseed, width)
    for i in range(b.n.shape[0]):
        p, v = b.row(i)
        e, w, _ = F.row_free_weight(v, _mu(p, v), kept[i])
        assert np.all(w[kept[i] < 0] == 0.0) and np.all(w >= 0.0) and abs(w.sum() - 1.0) <= 1e-12
        a = kept[i] >= 0
        lb, ub = R.free_weight_gap(p, v, kept[i][a], w[a])
        assert abs(ub - e) <= tol(v)
        x = v[kept[i][a]] - R.dense_output(p, v)
        assert ub * ub - lb * ub <= 1e-12 * float((x * x).sum(axis=1).max()) + 1e-300


def test_forced_error_keeps_relative_accuracy_when_dropped_mass_is_tiny():
    # D(A) = 1e-12: the direct ||mu - m_A|| loses ~4 digits to cancellation, the kernel's
    # form sum_{i not in A} p_i (v_i - m_A) / S does not. Exact value: D * |v_1 - v_0|.
    p = np.array([1.0 - 1e-12, 1e-12])
    v = np.array([[0.3], [1.3]])
    e = K.batch_forced_error(p, np.array([0, 2]), v, np.array([0]), np.array([[0]]))
    assert e[0] == pytest.approx(1e-12, rel=1e-9)


def test_zero_mass_kept_row_gives_inf():
    p = np.array([1.0, 0.0, 0.5, 0.5])
    off = np.array([0, 2, 4])
    v = np.array([[1.0], [2.0], [3.0], [4.0]])
    e = K.batch_forced_error(p, off, v, np.array([0, 2]), np.array([[1], [0]]))
    assert e[0] == np.inf and e[1] == pytest.approx(0.5, abs=1e-15)


def test_budget_above_a_row_names_the_row():
    p = np.array([0.5, 0.5, 1.0 / 3, 1.0 / 3, 1.0 / 3])
    off = np.array([0, 2, 5])
    with pytest.raises(InputError) as exc:
        K.batch_top_mass(p, off, 3)
    assert exc.value.field == "s" and "row 0" in exc.value.problem
    with pytest.raises(InputError, match="s"):
        K.batch_top_mass(p, off, 0)
    with pytest.raises(InputError, match="r_e"):
        K.batch_candidate_pool(p, off, np.ones((5, 2)), np.array([0, 2]), 1, 2, -1)


def test_validate_false_skips_checks_but_gives_same_answer():
    b = make_batch(3, 5, 8, 3, 2, True, True)
    kept = random_kept(b, 4, 6)
    np.testing.assert_array_equal(K.batch_forced_error(*b, kept), K.batch_forced_error(*b, kept, validate=False))


@pytest.mark.parametrize("seed", range(6))
def test_free_weight_kernel_on_larger_degenerate_rows(seed):
    # Larger kept sets than the hypothesis batches: mu inside the hull (k > d), integer
    # values with many duplicate / affinely dependent points, and k < d; the Gram warm
    # start must hand over to the exact phase without changing the answer.
    rng = np.random.default_rng(seed)
    n, d, k = 96, [3, 8, 24][seed % 3], [6, 40, 90][seed // 2]
    p = rng.dirichlet(np.full(n, 0.3))
    v = rng.normal(size=(n, d))
    if seed % 2:
        v = np.round(v)
    kept = R.top_mass_set(p, k)
    e, w, _ = F.row_free_weight(v, _mu(p, v), kept)
    e_ref, _ = R.free_weight_error(p, v, kept)
    assert abs(e - e_ref) <= tol(v)
    lb, ub = R.free_weight_gap(p, v, kept, w)
    x = v[kept] - R.dense_output(p, v)
    assert ub * ub - lb * ub <= 1e-12 * float((x * x).sum(axis=1).max())


@given(st.lists(st.sampled_from([0.0, -0.0, 0.1, 0.25, 0.5, 1.0, -np.inf]), min_size=1, max_size=40), st.integers(0, 40))
def test_top_k_desc_is_a_prefix_of_the_full_ranking(scores, k):
    # Few distinct values -> many exact ties, where the partial selection must still apply
    # the tie rule (larger index first); checked against sorting (score, index) tuples.
    score = np.array(scores)
    k = min(k, score.shape[0])
    expect = [i for _, i in sorted(((float(score[i]), i) for i in range(score.shape[0])), reverse=True)]
    assert ranking.rank_desc(score).tolist() == expect
    assert ranking.top_k_desc(score, k).tolist() == expect[:k]


# Row solver on small cases with many degenerate hulls (duplicates, collinear values, integer
# lattices), including kept sets of one key and mu inside the hull.


def _fw_case(seed: int, n: int, d: int, k: int, mode: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(n, 0.5))
    v = rng.normal(size=(n, d))
    if mode == "dup" and n >= 2:
        v[1] = v[0]
    elif mode == "line":  # all values on a line: affinely dependent kept sets
        v = rng.normal(size=(n, 1)) * np.ones((1, d))
    elif mode == "int":
        v = rng.integers(-2, 3, size=(n, d)).astype(float)
    kept = rng.choice(n, size=min(k, n), replace=False).astype(np.int64)
    return p, v, kept


fw_cases = st.builds(_fw_case, seed=st.integers(0, 5000), n=st.integers(1, 20), d=st.integers(1, 8),
                     k=st.integers(1, 20), mode=st.sampled_from(["plain", "dup", "line", "int"]))


@given(case=fw_cases)
@settings(max_examples=120)
def test_row_free_weight_matches_reference_on_degenerate_hulls(case) -> None:
    p, v, kept = case
    val, _, _ = F.row_free_weight(v, _mu(p, v), kept)
    ref, _ = R.free_weight_error(p, v, kept)
    scale = float(np.abs(v).max()) + 1e-300
    assert val == pytest.approx(ref, rel=1e-8, abs=1e-11 * scale)


def test_row_free_weight_mu_inside_hull_gives_zero_without_exact_phase() -> None:
    v = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    p = np.full(4, 0.25)
    val, _, used_exact = F.row_free_weight(v, _mu(p, v), np.arange(4, dtype=np.int64))
    assert val <= 1e-15 and not used_exact
