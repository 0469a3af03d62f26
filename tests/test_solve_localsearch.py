"""All-key local search: kernel against the plain-numpy reference, never worse than the pool,
swap-optimal, exact where every swap-local optimum is global, deterministic."""

from __future__ import annotations

import itertools

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evictlab.solve import reference as sref
from evictlab.solve.kernels import batch_solve
from evictlab.solve.localsearch import LS_REL_TOL, batch_localsearch, ls_seed, randbelow, splitmix64


def _row(seed: int, n: int, d: int, ties: bool = False, dup: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(n, 0.6))
    V = rng.normal(size=(n, d))
    if ties:
        p = np.round(p * 6) + 1.0
        p = p / p.sum()
        V = rng.integers(-2, 3, size=(n, d)).astype(float)
    if dup and n >= 3:
        V[2] = V[1]
    return p, V


def _solve(p: np.ndarray, V: np.ndarray, s: int, n_pair: int, kicks: int, seed: int = 0,
           row_id: int = 7) -> tuple[tuple, tuple]:
    n = p.shape[0]
    off, vs, bud = np.array([0, n]), np.array([0]), np.array([s])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    ls = batch_localsearch(p, off, V, vs, bud, np.array([row_id]), out[4], out[5], out[6], out[1],
                           np.ones((1, 1), dtype=np.bool_), n_pair, kicks, seed)
    return out, ls


def _starts(out: tuple, s: int) -> list[np.ndarray]:
    return [out[4][0, 0, :s], out[5][0, 0, :s], out[6][0, 0, :s]]


# ---------------------------------------------------------------- random numbers


def test_splitmix64_matches_reference_and_published_value() -> None:
    # First output of SplitMix64 from state 0 (the reference implementation's test value).
    st_, z = splitmix64(np.uint64(0))
    assert int(z) == 0xE220A8397B1DCDAF
    py_state = 0
    k_state = np.uint64(0)
    for _ in range(50):
        py_state, pz = sref.splitmix64_reference(py_state)
        k_state, kz = splitmix64(np.uint64(k_state))
        assert int(kz) == pz and int(k_state) == py_state
    for seed, row, s in [(0, 0, 1), (3, 123456789, 32), (2**40, 7, 8)]:
        assert int(ls_seed(seed, row, s)) == sref.ls_seed_reference(seed, row, s)
    state = np.uint64(ls_seed(1, 2, 3))
    draws = []
    for _ in range(2000):
        state, r = randbelow(np.uint64(state), 5)
        draws.append(r)
    assert set(draws) == {0, 1, 2, 3, 4}


# ---------------------------------------------------------------- kernel == reference


@pytest.mark.parametrize("seed", range(12))
def test_kernel_equals_reference_same_moves_and_sets(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(4, 22))
    d = int(rng.integers(1, 5))
    s = int(rng.integers(1, n))
    n_pair = int(rng.choice([0, 3, 6, 40]))
    kicks = int(rng.choice([0, 0, 2]))
    p, V = _row(seed, n, d)
    out, (es, kept, moves) = _solve(p, V, s, n_pair, kicks, seed=seed, row_id=seed * 11)
    e_ref, k_ref, m_ref = sref.local_search_reference(p, V, _starts(out, s), out[1][0, 0], n_pair,
                                                      kicks, seed, seed * 11)
    assert kept[0, 0, :s].tolist() == k_ref.tolist()
    assert int(moves[0, 0]) == m_ref
    assert es[0, 0] == pytest.approx(e_ref, rel=1e-12, abs=1e-14)


def test_kernel_equals_reference_at_larger_n_with_pairs() -> None:
    for seed in range(3):
        p, V = _row(50 + seed, 60, 6)
        s = 6
        out, (es, kept, moves) = _solve(p, V, s, 5, 1, seed=seed, row_id=seed)
        e_ref, k_ref, m_ref = sref.local_search_reference(p, V, _starts(out, s), out[1][0, 0], 5, 1,
                                                          seed, seed)
        assert kept[0, 0, :s].tolist() == k_ref.tolist()
        assert int(moves[0, 0]) == m_ref
        assert es[0, 0] == pytest.approx(e_ref, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_one_search_and_its_shortlist_equal_reference(seed: int) -> None:
    from numba import njit

    from evictlab.core.kernels import row_weighted_sum
    from evictlab.solve.localsearch import centred_rows, local_search

    # From compiled code, as the solver calls it (see core/kernels.py's note on the helpers).
    mu_of = njit(lambda pn, V: row_weighted_sum(pn, V))
    n, d, s = 40 + seed, 5, 3 + seed
    p, V = _row(200 + seed, n, d)
    pn = p / p.sum()
    X, XT, g = centred_rows(pn, V, mu_of(pn, V), np.empty(n * d), np.empty(n * d))
    out, _ = _solve(p, V, s, 0, 0)
    for start in _starts(out, s):
        for n_pair, n_short in [(0, 12), (4, 4), (6, 15)]:
            A, mv, short = local_search(X, XT, g, pn, start.copy(), n_pair, n_short, 1000,
                                        np.full(n, -1), np.empty((4, n)), np.zeros(1, np.int64),
                                        np.empty(s * n))
            A_ref, mv_ref, short_ref = sref.swap_search_reference(pn, V, start, n_pair, n_short)
            assert A.tolist() == A_ref and mv == mv_ref
            assert short.tolist() == short_ref


# ---------------------------------------------------------------- invariants


instances = st.builds(_row, seed=st.integers(0, 10_000), n=st.integers(1, 12), d=st.integers(1, 4),
                      ties=st.booleans(), dup=st.booleans())


@given(inst=instances, s=st.integers(1, 12), n_pair=st.sampled_from([0, 4, 32]),
       kicks=st.sampled_from([0, 3]))
@settings(max_examples=80, deadline=None)
def test_never_worse_than_pool_and_swap_optimal(inst, s, n_pair, kicks) -> None:
    p, V = inst
    n = p.shape[0]
    s = min(s, n)
    out, (es, kept, moves) = _solve(p, V, s, n_pair, kicks)
    es_hat = out[1][0, 0]
    assert es[0, 0] <= es_hat  # exact, not approximate: the pool argmin is a start
    # never better than the exact optimum over all keys (itertools brute force, independent)
    bf, _ = sref.all_keys_bruteforce(p, V, s)
    assert es[0, 0] >= bf * (1 - 1e-12) - 1e-15 * max(1.0, float(np.abs(V).max()))
    ks = kept[0, 0, :s].tolist()
    assert ks == sorted(set(ks)) and len(ks) == s and 0 <= ks[0] and ks[-1] < n
    scale = max(1.0, float(np.abs(V).max()))
    assert sref.forced_error(p, V, ks) == pytest.approx(es[0, 0], rel=1e-12, abs=1e-14 * scale)
    # No single swap improves the result beyond the acceptance tolerance (plus rounding).
    cur = es[0, 0] ** 2
    for _, _, B in sref.single_swaps(ks, n):
        assert sref.forced_error(p, V, B) ** 2 >= cur * (1 - 1e-9) - 1e-24 * scale**2
    # With the whole pair neighbourhood (n_pair >= n - s), no pair swap improves either.
    if n_pair >= n - s and s >= 2:
        for o1, o2 in itertools.combinations(ks, 2):
            for i1, i2 in itertools.combinations([i for i in range(n) if i not in ks], 2):
                B = [k for k in ks if k not in (o1, o2)] + [i1, i2]
                assert sref.forced_error(p, V, B) ** 2 >= cur * (1 - 1e-9) - 1e-24 * scale**2


def _local_minima(p: np.ndarray, V: np.ndarray, s: int) -> tuple[float, list[float]]:
    """Global optimum and the values of all single-swap local minima (brute force)."""
    n = p.shape[0]
    err = {A: sref.forced_error(p, V, list(A)) for A in itertools.combinations(range(n), s)}
    minima = []
    for A, e in err.items():
        neighbours = (tuple(sorted(set(A) - {o} | {i})) for o in A for i in range(n) if i not in A)
        if all(err[B] >= e * (1 - 1e-9) for B in neighbours):
            minima.append(e)
    return min(err.values()), minima


def test_equals_bruteforce_where_every_swap_optimum_is_global() -> None:
    checked = 0
    for seed in range(150):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(5, 11))
        s = int(rng.integers(1, n))
        p, V = _row(seed, n, int(rng.integers(1, 4)))
        opt, minima = _local_minima(p, V, s)
        if max(minima) > opt * (1 + 1e-9) + 1e-15:
            continue  # a non-global local minimum exists: the search may stop there
        checked += 1
        out, (es, _, _) = _solve(p, V, s, 0, 0)
        assert es[0, 0] == pytest.approx(opt, rel=1e-9, abs=1e-15)
    assert checked >= 60


def test_reaches_optima_the_pool_misses() -> None:
    # Random rows with few dimensions are hard for the pool (d = 3: many subsets nearly
    # cancel); the all-key search recovers the global optimum on many of them, more with the
    # pair neighbourhood and kicks. Counts on these fixed seeds (measured): 125 misses of
    # 200, recovered 45 / 65 / 86 times by single swaps / + pairs / + 4 kicks.
    miss = 0
    found = {(0, 0): 0, (32, 0): 0, (32, 4): 0}
    for seed in range(60):
        p, V = _row(seed, 14, 3)
        s = 4
        bf, _ = sref.numpy_enumeration(p, V, np.arange(14), s)  # vectorised brute force
        for (n_pair, kicks) in found:
            out, (es, _, _) = _solve(p, V, s, n_pair, kicks)
            assert es[0, 0] >= bf * (1 - 1e-12)
            if bf < out[1][0, 0] * (1 - 1e-9) and es[0, 0] <= bf * (1 + 1e-9):
                found[(n_pair, kicks)] += 1
        miss += bf < out[1][0, 0] * (1 - 1e-9)
    assert miss >= 25
    assert found[(0, 0)] >= 0.25 * miss
    assert found[(0, 0)] <= found[(32, 0)] <= found[(32, 4)]
    assert found[(32, 4)] >= 0.5 * miss


# ---------------------------------------------------------------- determinism


def test_deterministic_across_threads_and_runs() -> None:
    rng = np.random.default_rng(3)
    N, n, d = 40, 80, 8
    p = rng.dirichlet(np.full(n, 0.3), size=N).ravel()
    V = rng.normal(size=(N * n, d))
    off, vs = np.arange(N + 1) * n, np.arange(N) * n
    bud = np.array([3, 8])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    todo = np.ones((N, 2), dtype=np.bool_)
    ids = np.arange(N) * 3

    def run(threads: int, seed: int) -> tuple:
        old = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            return batch_localsearch(p, off, V, vs, bud, ids, out[4], out[5], out[6], out[1], todo, 8, 3, seed)
        finally:
            numba.set_num_threads(old)

    a = run(1, 5)
    b = run(numba.config.NUMBA_NUM_THREADS, 5)
    c = run(1, 5)
    for x, y, z in zip(a, b, c):
        assert np.array_equal(x, y) and np.array_equal(x, z)
    assert (a[0] <= out[1]).all()
    assert (a[0] < out[1]).any()  # the search does improve on random rows
    # A row's result does not depend on which other rows share its batch.
    half = batch_localsearch(p, off, V, vs, bud, ids, out[4], out[5], out[6], out[1],
                             np.concatenate([np.zeros((N // 2, 2), bool), todo[N // 2:]]), 8, 3, 5)
    assert np.array_equal(half[1][N // 2:], a[1][N // 2:])
    assert np.isnan(half[0][: N // 2]).all()


def test_tolerance_constant_matches_balancing_rule() -> None:
    from evictlab.solve.kernels import BAL_REL_TOL

    assert LS_REL_TOL == BAL_REL_TOL
