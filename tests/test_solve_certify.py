"""Certified optimum (branch and bound) against itertools brute force over all keys."""

from __future__ import annotations

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
    es, kept, status, lb, nodes = batch_certify(p, off, V, vs, bud, out[5], 64, 64, 10**7)
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
    assert status == STATUS_LIMIT and nodes == 50
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
    es, kept, status, lb, nodes = batch_certify(p, off, V, vs, bud, out[5], 10, 3, 10**6)
    assert status[0].tolist() == [STATUS_OPTIMAL, STATUS_SKIPPED]
    assert np.isnan(es[0, 1])
    es2, *_ = batch_certify(p, off, V, vs, bud, out[5], 9, 8, 10**6)
    assert np.isnan(es2).all()


def test_paper_size_row_certifies_quickly() -> None:
    rng = np.random.default_rng(11)
    n, d, s = 48, 64, 8
    p = rng.dirichlet(np.full(n, 0.3))
    V = rng.normal(size=(n, d))
    off, vs, bud = np.array([0, n]), np.array([0]), np.array([s])
    out = batch_solve(p, off, V, vs, bud, 2, 2, 64)
    es, kept, status, lb, nodes = batch_certify(p, off, V, vs, bud, out[5], 48, 8, 10**7)
    assert status[0, 0] == STATUS_OPTIMAL
    assert es[0, 0] <= out[1][0, 0]
