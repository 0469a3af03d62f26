"""Numba kernels for the single-row math over ragged batches of rows (float64).

Batch layout (the contract in ``docs/architecture.md``): ``p`` float64 ``[sum n_i]`` holds
every row's masses back to back, row i being ``p[p_off[i]:p_off[i+1]]``; ``values`` float64
``[K, d]`` is a pool of value vectors shared by rows, row i reading
``values[v_start[i] : v_start[i] + n_i]``. Kept sets are int64 ``(N, k)`` *local* key
indices (``0 <= idx < n_i``), padded with ``-1`` (padding may sit anywhere and is skipped).

Two layers:

* ``batch_*`` public wrappers: validate their inputs with :mod:`evictlab.core.validate`
  (vectorised, linear time; pass ``validate=False`` when the batch was already checked,
  e.g. inside a solver loop), then call a jitted kernel parallel over rows (``prange``);
  batches below ``PARALLEL_MIN_WORK`` multiply-adds run on one thread, because forking
  the thread pool costs more than it saves there.
* ``row_*``: small jitted building blocks on one row, with **no validation**, for use
  inside other Numba code (e.g. ``evictlab.solve``, which has no copies of its own); the
  ranking blocks are :mod:`evictlab.core.ranking`, the free-weight solver
  :mod:`evictlab.core.freeweight`, the thread rules :mod:`evictlab.core.threads`.

Conventions match :mod:`evictlab.core.reference` exactly: masses are divided by their sum
(validation guarantees it is within 1e-6 of 1); ranking uses the raw masses with ties to the
larger index; ``e(A) = inf`` when ``P(A) = 0``. The forced error is evaluated in the
cancellation-free form ``e(A) = ||sum_{i not in A} p_i (v_i - m_A)|| / sum_i p_i``, which is
algebraically ``||mu - m_A||`` but keeps its relative accuracy when ``D(A)`` is tiny.
All kernels use ``cache=True`` so the first import in a fresh environment compiles once
(a few seconds per kernel) and later processes load machine code from ``__pycache__``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from evictlab.core.freeweight import row_free_weight
from evictlab.core.ranking import top_k_desc
from evictlab.core.threads import run_kernel
from evictlab.core.validate import (
    check_budget,
    check_count,
    validate_batch,
    validate_kept_batch,
    validate_mass_batch,
)
from evictlab.errors import InputError


__all__ = [
    "batch_dense_output",
    "batch_top_mass",
    "batch_candidate_pool",
    "batch_forced_error",
    "batch_dropped_mass",
    "batch_free_weight_error",
    "batch_single_key_errors",
    "batch_entropy",
    "row_dense_output",
    "row_forced_error",
    "row_normalized",
    "row_weighted_sum",
    "row_candidate_pool",
]


# ---------------------------------------------------------------------------------------
# Jitted single-row building blocks (no validation)
#
# Call these from compiled code (the batch kernels and the solvers do). Called from Python
# after a cached caller compiled the same signature in this process, an array-returning
# cached helper trips numba's "'descr' is NULL" error (the helper's environment is missing
# after the cache load): from Python use the batch wrappers below, or wrap the helper in
# an njit function as the tests do.
# ---------------------------------------------------------------------------------------


@njit(cache=True)
def row_normalized(p_row: np.ndarray) -> np.ndarray:
    """``p_row / S`` ``(n,)`` with ``S = sum p`` summed in key order (the one normalisation of
    the kernels: every dense output and solver starts from these masses)."""
    n = p_row.shape[0]
    total = 0.0
    for i in range(n):
        total += p_row[i]
    out = np.empty(n)
    for i in range(n):
        out[i] = p_row[i] / total
    return out


@njit(cache=True)
def row_weighted_sum(w: np.ndarray, v_row: np.ndarray) -> np.ndarray:
    """``sum_i w_i v_i`` ``(d,)`` in key order; ``w`` ``(n,)``, ``v_row`` ``(n, d)``. With the
    normalised masses (:func:`row_normalized`) it is the dense output ``mu``."""
    n, d = v_row.shape
    mu = np.zeros(d)
    for i in range(n):
        wi = w[i]
        for j in range(d):
            mu[j] += wi * v_row[i, j]
    return mu


@njit(cache=True)
def row_dense_output(p_row: np.ndarray, v_row: np.ndarray, mu: np.ndarray) -> float:
    """Fill ``mu`` ``(d,)`` with ``sum_i (p_i / S) v_i`` for one row; return ``S = sum p``.

    ``p_row`` ``(n,)``, ``v_row`` ``(n, d)``; the same bits as
    ``row_weighted_sum(row_normalized(p_row), v_row)``.
    """
    n = p_row.shape[0]
    total = 0.0
    for i in range(n):
        total += p_row[i]
    mu[:] = row_weighted_sum(row_normalized(p_row), v_row)
    return total


@njit(cache=True)
def row_candidate_pool(order_p: np.ndarray, order_err: np.ndarray, n: int, s: int, r_m: int, r_e: int) -> np.ndarray:
    """Pool ``C_s(r_m, r_e)`` from the two rankings, int64 ``(c,)``; ``pool[:s]`` is ``T_s``.

    ``order_p``: keys by mass descending (ties: larger index first); ``order_err``: keys by
    single-key error ``||mu - v_i||`` descending (same tie rule); both may be truncated to
    their first ``s + r_m`` and ``s + r_m + r_e`` entries (enough to build the pool). ``n``:
    number of keys of the row. Same order as ``evictlab.core.reference.candidate_pool``.
    """
    n_top = min(n, s + r_m)
    n_extra = min(n - n_top, r_e)
    pool = np.empty(n_top + n_extra, dtype=np.int64)
    in_top = np.zeros(n, dtype=np.bool_)
    for a in range(n_top):
        pool[a] = order_p[a]
        in_top[order_p[a]] = True
    c = n_top
    for a in range(order_err.shape[0]):
        if c == n_top + n_extra:
            break
        j = order_err[a]
        if not in_top[j]:
            pool[c] = j
            c += 1
    return pool


@njit(cache=True)
def _dist(mu: np.ndarray, v_row: np.ndarray, i: int) -> float:
    """``||mu - v_row[i]||`` with four interleaved partial sums.

    One running sum makes every add wait for the previous one (latency-bound, ~4x slower
    at d = 64); four sums in a fixed order keep the result deterministic, and identical
    vectors still get bitwise-identical errors (the pool's tie rule relies on that).
    """
    d = mu.shape[0]
    a0 = 0.0
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    j = 0
    while j + 4 <= d:
        t0 = mu[j] - v_row[i, j]
        t1 = mu[j + 1] - v_row[i, j + 1]
        t2 = mu[j + 2] - v_row[i, j + 2]
        t3 = mu[j + 3] - v_row[i, j + 3]
        a0 += t0 * t0
        a1 += t1 * t1
        a2 += t2 * t2
        a3 += t3 * t3
        j += 4
    while j < d:
        t0 = mu[j] - v_row[i, j]
        a0 += t0 * t0
        j += 1
    return np.sqrt((a0 + a1) + (a2 + a3))


@njit(cache=True)
def row_forced_error(p_row: np.ndarray, v_row: np.ndarray, kept: np.ndarray) -> float:
    """Forced error ``e(A)`` of one row; ``kept`` int64 ``(k,)`` local indices, ``-1`` skipped.

    Evaluated as ``||sum_{i not in A} p_i (v_i - m_A)|| / S`` (no cancellation for small
    ``D(A)``); ``inf`` when ``P(A) = 0``. ``p_row`` ``(n,)``, ``v_row`` ``(n, d)``.
    """
    n, d = v_row.shape
    mask = np.zeros(n, dtype=np.bool_)
    for t in range(kept.shape[0]):
        if kept[t] >= 0:
            mask[kept[t]] = True
    total = 0.0
    mass_a = 0.0
    m_a = np.zeros(d)
    for i in range(n):
        total += p_row[i]
        if mask[i]:
            mass_a += p_row[i]
            for j in range(d):
                m_a[j] += p_row[i] * v_row[i, j]
    if mass_a <= 0.0:
        return np.inf
    for j in range(d):
        m_a[j] /= mass_a
    diff = np.zeros(d)
    for i in range(n):
        if not mask[i]:
            for j in range(d):
                diff[j] += p_row[i] * (v_row[i, j] - m_a[j])
    acc = 0.0
    for j in range(d):
        acc += diff[j] * diff[j]
    return np.sqrt(acc) / total


# ---------------------------------------------------------------------------------------
# Jitted batch kernels (no validation; parallel over rows)
# ---------------------------------------------------------------------------------------


@njit(cache=True, parallel=True)
def _k_dense_output(p, p_off, values, v_start):
    n_rows = p_off.shape[0] - 1
    d = values.shape[1]
    out = np.empty((n_rows, d))
    for r in prange(n_rows):
        lo, hi = p_off[r], p_off[r + 1]
        vs = v_start[r]
        mu = np.empty(d)
        row_dense_output(p[lo:hi], values[vs : vs + hi - lo], mu)
        out[r, :] = mu
    return out


@njit(cache=True, parallel=True)
def _k_top_mass(p, p_off, s):
    n_rows = p_off.shape[0] - 1
    out = np.empty((n_rows, s), dtype=np.int64)
    for r in prange(n_rows):
        out[r, :] = top_k_desc(p[p_off[r] : p_off[r + 1]], s)
    return out


@njit(cache=True, parallel=True)
def _k_candidate_pool(p, p_off, values, v_start, s, r_m, r_e, c_max):
    n_rows = p_off.shape[0] - 1
    d = values.shape[1]
    pool = np.full((n_rows, c_max), -1, dtype=np.int64)
    size = np.empty(n_rows, dtype=np.int64)
    for r in prange(n_rows):
        lo, hi = p_off[r], p_off[r + 1]
        n = hi - lo
        p_row = p[lo:hi]
        v_row = values[v_start[r] : v_start[r] + n]
        n_top = min(n, s + r_m)
        order = top_k_desc(p_row, n_top)
        err = np.empty(n)
        mu = np.empty(d)
        row_dense_output(p_row, v_row, mu)
        for i in range(n):
            err[i] = _dist(mu, v_row, i)
        # at most n_top of the first n_top + r_e keys by error are in the top: enough extras
        row = row_candidate_pool(order, top_k_desc(err, min(n, n_top + r_e)), n, s, r_m, r_e)
        pool[r, :row.shape[0]] = row
        size[r] = row.shape[0]
    return pool, size


@njit(cache=True, parallel=True)
def _k_forced_error(p, p_off, values, v_start, kept):
    n_rows = p_off.shape[0] - 1
    out = np.empty(n_rows)
    for r in prange(n_rows):
        lo, hi = p_off[r], p_off[r + 1]
        out[r] = row_forced_error(p[lo:hi], values[v_start[r] : v_start[r] + hi - lo], kept[r])
    return out


@njit(cache=True, parallel=True)
def _k_dropped_mass(p, p_off, kept):
    n_rows = p_off.shape[0] - 1
    out = np.empty(n_rows)
    for r in prange(n_rows):
        lo, hi = p_off[r], p_off[r + 1]
        mask = np.zeros(hi - lo, dtype=np.bool_)
        for t in range(kept.shape[1]):
            if kept[r, t] >= 0:
                mask[kept[r, t]] = True
        total = 0.0
        dropped = 0.0
        for i in range(hi - lo):
            total += p[lo + i]
            if not mask[i]:
                dropped += p[lo + i]
        out[r] = dropped / total
    return out


@njit(cache=True, parallel=True)
def _k_free_weight_error(p, p_off, values, v_start, kept):
    n_rows = p_off.shape[0] - 1
    out = np.empty(n_rows)
    d = values.shape[1]
    for r in prange(n_rows):
        lo, hi = p_off[r], p_off[r + 1]
        v_row = values[v_start[r] : v_start[r] + hi - lo]
        mu = np.empty(d)
        row_dense_output(p[lo:hi], v_row, mu)
        out[r] = row_free_weight(v_row, mu, kept[r])[0]
    return out


@njit(cache=True, parallel=True)
def _k_single_key_errors(p, p_off, values, v_start):
    n_rows = p_off.shape[0] - 1
    d = values.shape[1]
    out = np.empty(p.shape[0])
    for r in prange(n_rows):
        lo, hi = p_off[r], p_off[r + 1]
        v_row = values[v_start[r] : v_start[r] + hi - lo]
        mu = np.empty(d)
        row_dense_output(p[lo:hi], v_row, mu)
        for i in range(hi - lo):
            out[lo + i] = _dist(mu, v_row, i)
    return out


@njit(cache=True, parallel=True)
def _k_entropy(p, p_off):
    n_rows = p_off.shape[0] - 1
    out = np.empty(n_rows)
    for r in prange(n_rows):
        lo, hi = p_off[r], p_off[r + 1]
        total = 0.0
        for i in range(lo, hi):
            total += p[i]
        h = 0.0
        for i in range(lo, hi):
            if p[i] > 0.0:
                q = p[i] / total
                h -= q * np.log(q)
        out[r] = h
    return out


# ---------------------------------------------------------------------------------------
# Public wrappers (validate, then call the kernels)
# ---------------------------------------------------------------------------------------


def _batch(p, p_off, values, v_start, validate):
    """Validated and converted batch arrays (or plain dtype conversion when trusted)."""
    if validate:
        return validate_batch(p, p_off, values, v_start)
    return (
        np.ascontiguousarray(p, dtype=np.float64),
        np.ascontiguousarray(p_off, dtype=np.int64),
        np.ascontiguousarray(values, dtype=np.float64),
        np.ascontiguousarray(v_start, dtype=np.int64),
    )


def _masses(p, p_off, validate):
    if validate:
        return validate_mass_batch(p, p_off)
    return np.ascontiguousarray(p, dtype=np.float64), np.ascontiguousarray(p_off, dtype=np.int64)


def _kept(kept, p_off, validate):
    if validate:
        return validate_kept_batch(kept, p_off)
    return np.ascontiguousarray(kept, dtype=np.int64)


def _check_budget_rows(s: object, p_off: np.ndarray) -> int:
    """``1 <= s <= n_i`` for every row, naming the first row that is too short."""
    n = np.diff(p_off)
    s = check_budget(s, int(n.max()))
    short = np.flatnonzero(n < s)
    if short.size:
        i = int(short[0])
        raise InputError("s", f"is {s}, above the n = {int(n[i])} keys of row {i}", f"use s <= {int(n.min())} (the shortest row) or drop rows with n < s")
    return s


def batch_dense_output(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, *, validate: bool = True
) -> np.ndarray:
    """Dense outputs ``mu_i = sum_j p_j v_j`` of every row: float64 ``(N, d)``."""
    b = _batch(p, p_off, values, v_start, validate)
    return run_kernel(_k_dense_output, b[0].shape[0] * b[2].shape[1], *b)


def batch_top_mass(p: np.ndarray, p_off: np.ndarray, s: int, *, validate: bool = True) -> np.ndarray:
    """``T_s`` of every row: int64 ``(N, s)`` local indices, largest mass first, ties to the larger index.

    Raises:
        InputError: if ``s < 1`` or ``s > n_i`` for some row (the row is named).
    """
    p_arr, off = _masses(p, p_off, validate)
    s = _check_budget_rows(s, off)
    return run_kernel(_k_top_mass, 20.0 * p_arr.shape[0], p_arr, off, s)


def batch_candidate_pool(
    p: np.ndarray,
    p_off: np.ndarray,
    values: np.ndarray,
    v_start: np.ndarray,
    s: int,
    r_m: int = 2,
    r_e: int = 2,
    *,
    validate: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pools ``C_s(r_m, r_e)`` (ours) of every row.

    Returns:
        ``(pool, pool_size)``: ``pool`` int64 ``(N, c_max)`` local indices padded with ``-1``,
        row i's pool being ``pool[i, :pool_size[i]]`` with ``pool_size[i] = min(n_i, s + r_m +
        r_e)`` and ``c_max = max_i pool_size[i]``. Order as in
        :func:`evictlab.core.reference.candidate_pool`: top-``(s + r_m)`` by mass in rank
        order, then the ``r_e`` largest single-key errors among the rest (ties to the larger
        index), so ``pool[i, :s]`` is ``T_s``.
    """
    b = _batch(p, p_off, values, v_start, validate)
    s = _check_budget_rows(s, b[1])
    r_m = check_count(r_m, "r_m")
    r_e = check_count(r_e, "r_e")
    c_max = int(min(int(np.diff(b[1]).max()), s + r_m + r_e))
    return run_kernel(_k_candidate_pool, b[0].shape[0] * (b[2].shape[1] + 40.0), *b, s, r_m, r_e, c_max)


def batch_forced_error(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, kept: np.ndarray, *, validate: bool = True
) -> np.ndarray:
    """Forced errors ``e(A_i) = ||mu_i - m_{A_i}||`` of every row: float64 ``(N,)``.

    ``kept`` int64 ``(N, k)`` local indices padded with ``-1``. ``inf`` where ``P(A_i) = 0``.
    """
    b = _batch(p, p_off, values, v_start, validate)
    k = _kept(kept, b[1], validate)
    return run_kernel(_k_forced_error, b[0].shape[0] * b[2].shape[1], *b, k)


def batch_dropped_mass(p: np.ndarray, p_off: np.ndarray, kept: np.ndarray, *, validate: bool = True) -> np.ndarray:
    """Dropped masses ``D(A_i)`` (of the normalised rows) of every row: float64 ``(N,)`` in ``[0, 1]``."""
    p_arr, off = _masses(p, p_off, validate)
    k = _kept(kept, off, validate)
    return run_kernel(_k_dropped_mass, 2.0 * p_arr.shape[0], p_arr, off, k)


def batch_free_weight_error(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, kept: np.ndarray, *, validate: bool = True
) -> np.ndarray:
    """Free-weight errors (ours) ``e_free(A_i)`` of every row: float64 ``(N,)``.

    Exact distance from ``mu_i`` to the convex hull of the kept values, with a certified
    duality gap (:func:`row_free_weight`; the same certificate as
    ``reference.free_weight_error``).
    """
    b = _batch(p, p_off, values, v_start, validate)
    k = _kept(kept, b[1], validate)
    # Wolfe: Gram matrix k^2 d per row plus a few least-squares solves of similar cost; the
    # exact phase's LAPACK calls run inside the parallel loop (one BLAS thread).
    work = 4.0 * k.shape[0] * k.shape[1] ** 2 * b[2].shape[1]
    return run_kernel(_k_free_weight_error, work, *b, k, lapack=True)


def batch_single_key_errors(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, *, validate: bool = True
) -> np.ndarray:
    """Single-key errors ``||mu_i - v_j||`` of every key of every row: float64 ``[sum n_i]`` (laid out like ``p``)."""
    b = _batch(p, p_off, values, v_start, validate)
    return run_kernel(_k_single_key_errors, 2.0 * b[0].shape[0] * b[2].shape[1], *b)


def batch_entropy(p: np.ndarray, p_off: np.ndarray, *, validate: bool = True) -> np.ndarray:
    """Shannon entropies (nats) of the normalised rows: float64 ``(N,)``."""
    p_arr, off = _masses(p, p_off, validate)
    return run_kernel(_k_entropy, 20.0 * p_arr.shape[0], p_arr, off)
