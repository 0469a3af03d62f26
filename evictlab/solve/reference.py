"""Plain-numpy / itertools references for the solvers (obviously correct, one row, slow).

The Numba kernels in :mod:`evictlab.solve.kernels` and :mod:`evictlab.solve.certify` are
tested against these. The single-row definitions come from :mod:`evictlab.core.reference`
(``forced_error``, ``top_mass_set``, ``candidate_pool``); they are re-exported here.
"""

from __future__ import annotations

import itertools

import numpy as np

from evictlab.core.reference import candidate_pool, forced_error, top_mass_set

__all__ = [
    "candidate_pool", "forced_error", "top_mass_set", "pool_bruteforce", "all_keys_bruteforce",
    "balance_reference", "numpy_enumeration",
]


def pool_bruteforce(p: np.ndarray, values: np.ndarray, pool: np.ndarray, s: int) -> tuple[float, np.ndarray]:
    """``min e(A)`` over every s-subset of ``pool`` by ``itertools.combinations``.

    Returns ``(value, argmin)``; the argmin is int64 ``(s,)`` sorted (first in
    lexicographic order among exact ties).
    """
    best, arg = np.inf, None
    for A in itertools.combinations(sorted(int(i) for i in pool), s):
        e = forced_error(p, values, list(A))
        if e < best:
            best, arg = e, A
    return float(best), np.asarray(arg if arg is not None else sorted(pool)[:s], dtype=np.int64)


def all_keys_bruteforce(p: np.ndarray, values: np.ndarray, s: int) -> tuple[float, np.ndarray]:
    """``ES(s)``: ``min e(A)`` over every s-subset of all n keys (tiny n only)."""
    return pool_bruteforce(p, values, np.arange(p.shape[0]), s)


def balance_reference(p: np.ndarray, values: np.ndarray, s: int, r_m: int, r_e: int,
                      max_swaps: int) -> tuple[float, np.ndarray, int]:
    """Balancing selector (ours) written directly from its definition.

    Start at ``T_s``; evaluate every single swap within the pool with
    :func:`forced_error`; apply the best one if it lowers ``e(A)``; at most ``max_swaps``.
    Returns ``(e(A), A sorted, swaps applied)``.
    """
    pool = [int(i) for i in candidate_pool(p, values, s, r_m, r_e)]
    A = [int(i) for i in top_mass_set(p, s)]
    cur = forced_error(p, values, A)
    swaps = 0
    while swaps < max_swaps:
        best, move = cur, None
        for o in A:
            for i in pool:
                if i in A:
                    continue
                B = [a for a in A if a != o] + [i]
                e = forced_error(p, values, B)
                if e < best:
                    best, move = e, B
        if move is None or not best < cur * (1 - 1e-13):
            break
        A, cur = move, best
        swaps += 1
    return float(cur), np.asarray(sorted(A), dtype=np.int64), swaps


def numpy_enumeration(p: np.ndarray, values: np.ndarray, pool: np.ndarray, s: int,
                      chunk: int = 65536) -> tuple[float, np.ndarray]:
    """A straightforward vectorised-numpy enumeration (the benchmark baseline).

    ``itertools.combinations`` -> stacked index arrays ``(M, s)`` in chunks -> errors of all
    subsets at once: ``||sum_A p_i (v_i - mu)|| / P(A)``. Returns ``(min, argmin sorted)``.
    """
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    V = np.asarray(values, dtype=np.float64)
    mu = p @ V
    pool = np.asarray(sorted(int(i) for i in pool), dtype=np.int64)
    X = p[pool, None] * (V[pool] - mu[None, :])  # (c, d)
    pw = p[pool]
    best, arg = np.inf, None
    it = itertools.combinations(range(pool.shape[0]), s)
    while True:
        idx = np.fromiter(itertools.chain.from_iterable(itertools.islice(it, chunk)),
                          dtype=np.int64)
        if idx.size == 0:
            break
        idx = idx.reshape(-1, s)
        num = np.linalg.norm(X[idx].sum(axis=1), axis=1)
        den = pw[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.inf)
        j = int(np.argmin(e))
        if e[j] < best:
            best, arg = float(e[j]), pool[idx[j]]
    return best, np.sort(np.asarray(arg, dtype=np.int64))
