"""Certified fast free-weight error against the core reference (Wolfe on coordinates)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evictlab.core.reference import free_weight_error
from evictlab.solve.freeweight import free_weight_row
from evictlab.solve.kernels import dense_mu


def _case(seed: int, n: int, d: int, k: int, mode: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(n, 0.5))
    V = rng.normal(size=(n, d))
    if mode == "dup" and n >= 2:
        V[1] = V[0]
    elif mode == "line":  # all values on a line: affinely dependent kept sets
        V = rng.normal(size=(n, 1)) * np.ones((1, d))
    elif mode == "int":
        V = rng.integers(-2, 3, size=(n, d)).astype(float)
    kept = rng.choice(n, size=min(k, n), replace=False).astype(np.int64)
    return p, V, kept


cases = st.builds(_case, seed=st.integers(0, 5000), n=st.integers(1, 20), d=st.integers(1, 8),
                  k=st.integers(1, 20), mode=st.sampled_from(["plain", "dup", "line", "int"]))


@given(case=cases)
@settings(max_examples=120)
def test_matches_reference(case) -> None:
    p, V, kept = case
    mu = dense_mu(p, V)
    val, _ = free_weight_row(p, V, mu, kept)
    ref, _ = free_weight_error(p, V, kept)
    scale = float(np.abs(V).max()) + 1e-300
    assert val == pytest.approx(ref, rel=1e-8, abs=1e-11 * scale)


def test_mu_inside_hull_gives_zero() -> None:
    V = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    p = np.full(4, 0.25)
    val, fb = free_weight_row(p, V, dense_mu(p, V), np.arange(4, dtype=np.int64))
    assert val <= 1e-15 and not fb
