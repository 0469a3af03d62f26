"""Certified optimum (branch and bound) against itertools brute force over all keys."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evictlab.solve import reference as sref
from evictlab.solve.certify import (
    CERT_REL_TOL, STATUS_LIMIT, STATUS_OPTIMAL, STATUS_SKIPPED, batch_certify, certify_row,
)
from evictlab.solve.kernels import batch_solve


def _instance(seed: int, n: int, d: int, ties: bool, dup: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(n, 0.7))
    if ties:
        p = np.round(p * 6) + 1.0
        p = p / p.sum()
    V = rng.integers(-3, 4, size=(n, d)).astype(float) if ties else rng.normal(size=(n, d))
    if dup and n >= 3:
        V[2] = V[1]
    return p, V


instances = st.builds(
    _instance, seed=st.integers(0, 10_000), n=st.integers(1, 11), d=st.integers(1, 4),
    ties=st.booleans(), dup=st.booleans(),
)


@given(inst=instances, s=st.integers(1, 11))
@settings(max_examples=70)
def test_certified_equals_bruteforce_and_below_pool(inst, s) -> None:
    p, V = inst
    n = p.shape[0]
    s = min(s, n)
    off, vs, bud = np.array([0, n]), np.array([0]), np.array([s])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    es_hat = out[1][0, 0]
    es, kept, status, lb, nodes = batch_certify(p, off, V, vs, bud, out[5][None], 64, 64, 10**7)
    bf, _ = sref.all_keys_bruteforce(p, V, s)
    scale = max(1.0, float(np.abs(V).max()))
    assert status[0, 0] == STATUS_OPTIMAL
    assert es[0, 0] <= es_hat
    assert es[0, 0] == pytest.approx(bf, rel=1e-8, abs=1e-12 * scale)
    ks = kept[0, 0, :s]
    assert sorted(set(ks.tolist())) == ks.tolist()
    assert sref.forced_error(p, V, ks) == pytest.approx(es[0, 0], rel=1e-12, abs=1e-14 * scale)
    assert lb[0, 0] <= es[0, 0]
    assert lb[0, 0] >= es[0, 0] * (1 - 2 * CERT_REL_TOL) - 1e-14 * scale


def test_node_limit_reports_valid_lower_bound() -> None:
    rng = np.random.default_rng(5)
    n, d, s = 24, 6, 6
    p = rng.dirichlet(np.full(n, 0.5))
    V = rng.normal(size=(n, d))
    seed = np.argsort(-p)[:s]
    es, kept, status, lb, nodes = certify_row(p, V, s, seed.astype(np.int64), 50)
    assert status == STATUS_LIMIT and nodes <= 50
    full = certify_row(p, V, s, seed.astype(np.int64), 10**8)
    assert full[2] == STATUS_OPTIMAL
    assert lb <= full[0] * (1 + 1e-12) <= es * (1 + 1e-12)


def test_limits_skip_large_rows_and_budgets() -> None:
    rng = np.random.default_rng(0)
    n, d = 10, 3
    p = rng.dirichlet(np.ones(n))
    V = rng.normal(size=(n, d))
    off, vs, bud = np.array([0, n]), np.array([0]), np.array([2, 5])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 8)
    es, kept, status, lb, nodes = batch_certify(p, off, V, vs, bud, out[5][None], 10, 3, 10**6)
    assert status[0].tolist() == [STATUS_OPTIMAL, STATUS_SKIPPED]
    assert np.isnan(es[0, 1])
    es2, *_ = batch_certify(p, off, V, vs, bud, out[5][None], 9, 8, 10**6)
    assert np.isnan(es2).all()


def test_paper_size_row_certifies_quickly() -> None:
    rng = np.random.default_rng(11)
    n, d, s = 48, 64, 8
    p = rng.dirichlet(np.full(n, 0.3))
    V = rng.normal(size=(n, d))
    off, vs, bud = np.array([0, n]), np.array([0]), np.array([s])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    es, kept, status, lb, nodes = batch_certify(p, off, V, vs, bud, out[5][None], 48, 8, 10**7)
    assert status[0, 0] == STATUS_OPTIMAL
    assert es[0, 0] <= out[1][0, 0]


# ---------------------------------------------------------------- larger rows, bounds, limits


def _bf(p: np.ndarray, V: np.ndarray, s: int) -> float:
    """ES(s) by vectorised enumeration of every s-subset (numpy reference)."""
    return sref.numpy_enumeration(p, V, np.arange(p.shape[0]), s)[0]


@given(seed=st.integers(0, 10_000), n=st.integers(12, 20), d=st.integers(1, 6), s=st.integers(1, 6),
       ties=st.booleans())
@settings(max_examples=40, deadline=None)
def test_certified_equals_exhaustive_enumeration_up_to_n20(seed, n, d, s, ties) -> None:
    p, V = _instance(seed, n, d, ties, False)
    off, vs, bud = np.array([0, n]), np.array([0]), np.array([s])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    es, kept, status, lb, nodes = batch_certify(p, off, V, vs, bud, out[5][None], 64, 8, 10**7)
    bf = _bf(p, V, s)
    scale = max(1.0, float(np.abs(V).max()))
    assert status[0, 0] == STATUS_OPTIMAL
    assert es[0, 0] == pytest.approx(bf, rel=1e-8, abs=1e-12 * scale)
    assert lb[0, 0] <= bf * (1 + 1e-12) + 1e-15


def _node(setup, F: list[int], j: int, k: int):
    """Node quantities (positions in search order) for the bound functions."""
    mu, order, Y, pw, G, lo, hi, pk = setup
    Sd = Y[F].sum(axis=0) if F else np.zeros(Y.shape[1])
    Pd = float(pw[F].sum()) if F else 0.0
    Rrow = G[F].sum(axis=0) if F else np.zeros(G.shape[0])
    return Sd, Pd, Rrow, float(Sd @ Sd)


@given(seed=st.integers(0, 10_000), n=st.integers(4, 12), d=st.integers(1, 5), data=st.data())
@settings(max_examples=120, deadline=None)
def test_node_bounds_never_exceed_the_best_completion(seed, n, d, data) -> None:
    from evictlab.solve.certify import axis_bound, certify_setup, direction_bound

    p, V = _instance(seed, n, d, False, False)
    s = data.draw(st.integers(2, n))
    setup = certify_setup(p, V, s)
    mu, order, Y, pw, G, lo, hi, pk = setup
    depth = data.draw(st.integers(0, s - 1))
    k = s - depth
    j = data.draw(st.integers(depth, n - k))
    F = sorted(data.draw(st.permutations(range(j)))[:depth]) if depth else []
    if len(F) < depth:
        return
    Sd, Pd, Rrow, Qd = _node(setup, F, j, k)
    best = np.inf
    for K in itertools.combinations(range(j, n), k):
        A = [int(order[a]) for a in F + list(K)]
        best = min(best, sref.forced_error(p, V, A))
    b1 = axis_bound(Sd, Pd, j, k, lo, hi, pk)
    w, buf, idx = np.empty(n), np.empty(k), np.empty(k, dtype=np.int64)
    b2 = direction_bound(Rrow, np.sqrt(Qd), Pd, pw, j, k, w, buf, idx) if Qd > 0 else 0.0
    tol = 1e-9 * best + 1e-12
    assert b1 <= best + tol
    assert b2 <= best + tol


def test_direction_bound_is_tight_for_one_key() -> None:
    # With k = 1 and x_i parallel to S_F the direction bound is the exact minimum.
    from evictlab.solve.certify import direction_bound

    Rrow = np.array([0.0, 0.0, 0.5, -0.3, 0.2])  # <S_F, x_i>, S_F of norm 1
    pw = np.array([0.3, 0.2, 0.2, 0.2, 0.1])
    w, buf, idx = np.empty(5), np.empty(1), np.empty(1, dtype=np.int64)
    got = direction_bound(Rrow, 1.0, 0.5, pw, 2, 1, w, buf, idx)
    want = min((1.0 + Rrow[i]) / (0.5 + pw[i]) for i in range(2, 5))
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("limit", [1, 7, 60, 500])
def test_limit_lower_bound_below_optimum_and_nodes_respected(limit: int) -> None:
    for seed in range(8):
        rng = np.random.default_rng(seed)
        n, d, s = 18, 4, int(rng.integers(2, 7))
        p = rng.dirichlet(np.full(n, 0.5))
        V = rng.normal(size=(n, d))
        seed_set = np.argsort(-p)[:s].astype(np.int64)
        es, kept, status, lb, nodes = certify_row(p, V, s, seed_set, limit)
        assert nodes <= limit
        bf = _bf(p, V, s)
        assert lb <= bf * (1 + 1e-12)
        assert es >= bf * (1 - 1e-12)
        assert sref.forced_error(p, V, kept) == pytest.approx(es, rel=1e-12)
        if status == STATUS_OPTIMAL:
            assert es == pytest.approx(bf, rel=1e-9)


@given(seed=st.integers(0, 10_000), n=st.integers(2, 13), d=st.integers(1, 4), s=st.integers(1, 7),
       limit=st.integers(1, 3_000), ties=st.booleans(), use_ls=st.booleans())
@settings(max_examples=60, deadline=None)
def test_interval_contains_bruteforce_optimum_at_any_node_limit(seed, n, d, s, limit, ties, use_ls) -> None:
    """[cert_lb, es_cert] always contains ES(s) (itertools brute force), nodes <= limit, and
    es_cert <= the incumbent it was seeded with (pool argmin, optionally the all-key set)."""
    from evictlab.solve.localsearch import batch_localsearch

    p, V = _instance(seed, n, d, ties, False)
    s = min(s, n)
    off, vs, bud = np.array([0, n]), np.array([0]), np.array([s])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    seeds = out[5][None]
    inc = out[1][0, 0]
    if use_ls:
        ls = batch_localsearch(p, off, V, vs, bud, np.array([seed]), out[4], out[5], out[6], out[1],
                               np.ones((1, 1), dtype=np.bool_), 8, 2, seed)
        seeds, inc = np.stack([out[5], ls[1]]), min(inc, ls[0][0, 0])
    es, kept, status, lb, nodes = batch_certify(p, off, V, vs, bud, seeds, 64, 8, limit)
    bf, _ = sref.all_keys_bruteforce(p, V, s)
    scale = max(1.0, float(np.abs(V).max()))
    tol = 1e-9 * bf + 1e-14 * scale
    assert nodes[0, 0] <= limit
    assert lb[0, 0] <= bf + tol and bf <= es[0, 0] + tol
    assert es[0, 0] <= inc
    assert sref.forced_error(p, V, kept[0, 0, :s]) == pytest.approx(es[0, 0], rel=1e-12, abs=1e-14 * scale)
    if status[0, 0] == STATUS_OPTIMAL:
        assert es[0, 0] == pytest.approx(bf, rel=1e-8, abs=1e-12 * scale)
    else:
        assert status[0, 0] == STATUS_LIMIT


def test_best_seed_is_used_and_result_deterministic() -> None:
    rng = np.random.default_rng(4)
    N, n, d = 6, 40, 8
    p = rng.dirichlet(np.full(n, 0.4), size=N).ravel()
    V = rng.normal(size=(N * n, d))
    off, vs, bud = np.arange(N + 1) * n, np.arange(N) * n, np.array([3, 5])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    from evictlab.solve.localsearch import batch_localsearch

    ls = batch_localsearch(p, off, V, vs, bud, np.arange(N), out[4], out[5], out[6], out[1],
                           np.ones((N, 2), dtype=np.bool_), 8, 2, 0)
    seeds = np.stack([out[5], ls[1]])
    a = batch_certify(p, off, V, vs, bud, seeds, 64, 8, 10**7)
    b = batch_certify(p, off, V, vs, bud, seeds, 64, 8, 10**7)
    for x, y in zip(a, b):
        assert np.array_equal(x, y, equal_nan=True)
    assert (a[2] == STATUS_OPTIMAL).all()
    assert (a[0] <= ls[0]).all() and (ls[0] <= out[1]).all()
    # a better seed never costs more nodes than the pool seed alone on these rows (both prove the same optimum)
    c = batch_certify(p, off, V, vs, bud, out[5][None], 64, 8, 10**7)
    np.testing.assert_allclose(c[0], a[0], rtol=1e-12)
    assert a[4].sum() <= c[4].sum()


def test_suffix_tables_equal_sorted_sums() -> None:
    from evictlab.solve.certify import _suffix_tables

    rng = np.random.default_rng(0)
    for n, r, k in [(1, 1, 1), (5, 3, 4), (30, 4, 8), (40, 2, 3)]:
        Y = rng.normal(size=(n, r))
        Y[n // 2] = Y[0]  # ties
        pw = rng.random(n)
        lo, hi, pk = _suffix_tables(Y, pw, k)
        for j in range(n):
            for kk in range(1, min(k, n - j) + 1):
                np.testing.assert_allclose(lo[j, kk], np.sort(Y[j:], axis=0)[:kk].sum(axis=0), rtol=1e-13, atol=1e-14)
                np.testing.assert_allclose(hi[j, kk], -np.sort(-Y[j:], axis=0)[:kk].sum(axis=0), rtol=1e-13, atol=1e-14)
                assert pk[j, kk] == pytest.approx(np.sort(pw[j:])[::-1][:kk].sum(), rel=1e-13)
