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
* ``row_*`` / ``rank_desc``: small jitted building blocks on one row, with **no
  validation**, for use inside other Numba code (e.g. ``evictlab.solve``).

Conventions match :mod:`evictlab.core.reference` exactly: masses are divided by their sum
(validation guarantees it is within 1e-6 of 1); ranking uses the raw masses with ties to the
larger index; ``e(A) = inf`` when ``P(A) = 0``. The forced error is evaluated in the
cancellation-free form ``e(A) = ||sum_{i not in A} p_i (v_i - m_A)|| / sum_i p_i``, which is
algebraically ``||mu - m_A||`` but keeps its relative accuracy when ``D(A)`` is tiny.
All kernels use ``cache=True`` so the first import in a fresh environment compiles once
(a few seconds per kernel) and later processes load machine code from ``__pycache__``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from evictlab.core.validate import (
    check_budget,
    check_count,
    validate_batch,
    validate_kept_batch,
    validate_mass_batch,
)
from evictlab.errors import InputError

#: Wolfe stopping tolerance of the exact (coordinate) phase, relative to max_i ||x_i||^2
#: (same meaning as in the reference).
WOLFE_TOL = 1e-14
#: Wolfe stopping tolerance of the fast Gram phase (tighter, so that its answer usually passes
#: the certificate below without the exact phase).
GRAM_TOL = 1e-15
#: The Gram-phase answer of the free-weight solver is accepted when its coordinate duality gap
#: ``UB - LB`` is at most this fraction of ``UB`` (docs/theory.md section 3 asks for < 1e-9) ...
FREE_REL_GAP = 1e-10
#: ... and ``UB (UB - LB)`` is at most this fraction of ``max_i ||x_i||^2`` (the exact phase's
#: own stopping test, with room for the rounding of the coordinate recomputation).
FREE_ABS_GAP = 1e-12
#: Weights at or below this are treated as zero when leaving a face.
WEIGHT_TOL = 1e-13
#: Below this many multiply-adds a batch runs on one thread: forking the thread pool costs
#: more than it saves (and on an oversubscribed machine far more; docs/performance.md).
PARALLEL_MIN_WORK = 2_000_000

__all__ = [
    "batch_dense_output",
    "batch_top_mass",
    "batch_candidate_pool",
    "batch_forced_error",
    "batch_dropped_mass",
    "batch_free_weight_error",
    "batch_single_key_errors",
    "batch_entropy",
    "rank_desc",
    "top_k_desc",
    "row_dense_output",
    "row_forced_error",
    "row_free_weight",
    "single_blas_thread",
]


# ---------------------------------------------------------------------------------------
# Jitted single-row building blocks (no validation)
# ---------------------------------------------------------------------------------------


@njit(cache=True)
def _before(score: np.ndarray, a: int, b: int) -> bool:
    """True when key ``a`` ranks before key ``b``: larger score, or equal score and larger index."""
    return score[a] > score[b] or (score[a] == score[b] and a > b)


@njit(cache=True)
def _sort_by_rank(score: np.ndarray, idx: np.ndarray) -> None:
    """Sort the key indices ``idx`` in place by rank (``_before``); bottom-up merge sort.

    The order is total (ties broken by index), so any correct sort gives the same result;
    a hand-written one keeps Numba compile time low (no generic argsort / partition).
    """
    m = idx.shape[0]
    buf = np.empty(m, dtype=np.int64)
    width = 1
    src, dst = idx, buf
    while width < m:
        for lo in range(0, m, 2 * width):
            mid = min(lo + width, m)
            hi = min(lo + 2 * width, m)
            i, j, t = lo, mid, lo
            while i < mid and j < hi:
                if _before(score, src[j], src[i]):
                    dst[t] = src[j]
                    j += 1
                else:
                    dst[t] = src[i]
                    i += 1
                t += 1
            while i < mid:
                dst[t] = src[i]
                i += 1
                t += 1
            while j < hi:
                dst[t] = src[j]
                j += 1
                t += 1
        src, dst = dst, src
        width *= 2
    if src is not idx:
        idx[:] = src


@njit(cache=True)
def rank_desc(score: np.ndarray) -> np.ndarray:
    """Indices of ``score`` ``(n,)`` sorted descending, ties to the larger index first. O(n log n)."""
    idx = np.arange(score.shape[0])
    _sort_by_rank(score, idx)
    return idx


@njit(cache=True)
def top_k_desc(score: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` entries of ``rank_desc(score)``, int64 ``(k,)``, in O(n log k).

    A binary heap of size ``k`` keeps the ``k`` best keys seen so far with the worst at the
    root; a key replaces the root when it ranks before it. The survivors are then sorted.
    ``0 <= k <= n``.
    """
    n = score.shape[0]
    k = max(0, min(k, n))
    heap = np.empty(k, dtype=np.int64)
    if k == 0:
        return heap
    size = 0
    for i in range(n):
        if size < k:
            # push: sift up while the parent ranks before the new key (root = worst)
            c = size
            heap[c] = i
            size += 1
            while c > 0:
                parent = (c - 1) // 2
                if _before(score, heap[parent], heap[c]):
                    heap[parent], heap[c] = heap[c], heap[parent]
                    c = parent
                else:
                    break
        elif _before(score, i, heap[0]):
            heap[0] = i
            c = 0
            while True:  # sift down: move the worse child up
                left = 2 * c + 1
                if left >= k:
                    break
                worst = left
                right = left + 1
                if right < k and _before(score, heap[left], heap[right]):
                    worst = right
                if _before(score, heap[c], heap[worst]):
                    heap[c], heap[worst] = heap[worst], heap[c]
                    c = worst
                else:
                    break
    _sort_by_rank(score, heap)
    return heap


@njit(cache=True)
def row_dense_output(p_row: np.ndarray, v_row: np.ndarray, mu: np.ndarray) -> float:
    """Fill ``mu`` ``(d,)`` with ``sum_i (p_i / S) v_i`` for one row; return ``S = sum p``.

    ``p_row`` ``(n,)``, ``v_row`` ``(n, d)``.
    """
    n, d = v_row.shape
    total = 0.0
    for i in range(n):
        total += p_row[i]
    for j in range(d):
        mu[j] = 0.0
    for i in range(n):
        wi = p_row[i] / total
        for j in range(d):
            mu[j] += wi * v_row[i, j]
    return total


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


@njit(cache=True)
def _affine_min(xs: np.ndarray) -> np.ndarray:
    """Weights (sum 1) of the min-norm point of the affine hull of the rows of ``xs`` ``(m, d)``.

    Same parametrisation as the reference: ``alpha = e_0 + sum_j beta_j (e_j - e_0)`` with
    ``beta`` from an SVD least-squares solve (LAPACK ``gelsd``).
    """
    m, d = xs.shape
    alpha = np.ones(m)
    if m == 1:
        return alpha
    diff = np.empty((d, m - 1))
    rhs = np.empty(d)
    for j in range(d):
        rhs[j] = -xs[0, j]
        for c in range(1, m):
            diff[j, c - 1] = xs[c, j] - xs[0, j]
    rcond = np.finfo(np.float64).eps * max(d, m - 1)
    beta = np.linalg.lstsq(diff, rhs, rcond)[0]
    s = 0.0
    for c in range(m - 1):
        alpha[c + 1] = beta[c]
        s += beta[c]
    alpha[0] = 1.0 - s
    return alpha


@njit(cache=True)
def _ratio_step(w: np.ndarray, active: np.ndarray, member: np.ndarray, na: int, alpha: np.ndarray) -> int:
    """One boundary step of Wolfe's minor cycle; compacts ``active`` in place, returns its new size.

    ``alpha`` ``(na,)`` are the affine-minimiser weights of the active points, some
    ``<= WEIGHT_TOL``. Move ``w`` towards ``alpha`` as far as the simplex allows (ratio
    test), drop the point that hits zero (and any others at zero), renormalise.
    """
    best_r = np.inf
    best_t = -1
    for t in range(na):
        if alpha[t] <= WEIGHT_TOL:
            cur = w[active[t]]
            den = cur - alpha[t]
            r = cur / den if den > 0.0 else 0.0
            if r < best_r:
                best_r = r
                best_t = t
    theta = min(max(best_r, 0.0), 1.0)
    new = np.empty(na)
    for t in range(na):
        new[t] = (1.0 - theta) * w[active[t]] + theta * alpha[t]
    keep = np.empty(na, dtype=np.bool_)
    any_keep = False
    for t in range(na):
        keep[t] = new[t] > WEIGHT_TOL and t != best_t
        any_keep = any_keep or keep[t]
    if not any_keep:
        keep[int(np.argmax(new))] = True
    tot = 0.0
    for t in range(na):
        if keep[t]:
            tot += new[t]
    for t in range(na):
        w[active[t]] = 0.0
    m = 0
    for t in range(na):
        a = active[t]
        if keep[t]:
            w[a] = new[t] / tot
            active[m] = a
            m += 1
        else:
            member[a] = False
    return m


@njit(cache=True)
def _gram_affine_min(g: np.ndarray, active: np.ndarray, na: int, shift: float) -> tuple[np.ndarray, bool]:
    """Affine-minimiser weights of the active points from the Gram matrix ``g`` ``(k, k)``.

    Solves ``(G_SS + shift 1 1^T) u = 1`` by Cholesky and returns ``alpha = u / sum(u)``
    (for any ``shift > 0`` this is the minimiser of ``alpha^T G_SS alpha`` with sum 1;
    ``shift = max_i ||x_i||^2`` matches the scales). Returns ``ok = False`` when the
    matrix is numerically singular (points nearly affinely dependent): the caller then
    falls back to the SVD least-squares path.
    """
    m = na
    chol = np.zeros((m, m))
    for j in range(m):
        diag = g[active[j], active[j]] + shift
        acc = diag
        for c in range(j):
            acc -= chol[j, c] * chol[j, c]
        if not acc > 1e-12 * diag:
            return np.empty(0), False
        chol[j, j] = np.sqrt(acc)
        for i in range(j + 1, m):
            acc = g[active[i], active[j]] + shift
            for c in range(j):
                acc -= chol[i, c] * chol[j, c]
            chol[i, j] = acc / chol[j, j]
    z = np.empty(m)
    for i in range(m):
        acc = 1.0
        for c in range(i):
            acc -= chol[i, c] * z[c]
        z[i] = acc / chol[i, i]
    u = np.empty(m)
    for i in range(m - 1, -1, -1):
        acc = z[i]
        for c in range(i + 1, m):
            acc -= chol[c, i] * u[c]
        u[i] = acc / chol[i, i]
    tot = u.sum()
    if not (tot > 0.0 and np.isfinite(tot)):
        return np.empty(0), False
    return u / tot, True


@njit(cache=True)
def _wolfe_gram(
    g: np.ndarray, scale: float, w: np.ndarray, active: np.ndarray, member: np.ndarray, na: int
) -> tuple[int, bool]:
    """Fast phase: Wolfe's algorithm on the Gram matrix ``g = X X^T`` (no ``d`` in the loop).

    Updates ``w``, ``active``, ``member`` in place and returns ``(active size, ok)``;
    ``ok = False`` when a Cholesky solve breaks down (near affine dependence) or the
    iteration limit is hit. ``w`` is always a convex combination of the active points, so
    the exact phase (:func:`_wolfe_direct`) can warm-start from it. Gram arithmetic squares
    the conditioning, so the caller certifies the answer on the coordinates.
    """
    k = g.shape[0]
    dots = np.empty(k)
    for _ in range(50 * k + 100):
        for i in range(k):
            acc = 0.0
            for t in range(na):
                acc += g[i, active[t]] * w[active[t]]
            dots[i] = acc
        yy = 0.0
        for t in range(na):
            yy += w[active[t]] * dots[active[t]]
        jn = int(np.argmin(dots))
        if yy - dots[jn] <= GRAM_TOL * scale or member[jn]:
            return na, True
        active[na] = jn
        member[jn] = True
        na += 1
        while True:  # minor cycle
            alpha, ok = _gram_affine_min(g, active, na, scale)
            if not ok:
                return na, False
            if alpha.min() > WEIGHT_TOL:
                for t in range(na):
                    w[active[t]] = alpha[t]
                break
            na = _ratio_step(w, active, member, na, alpha)
        if not member[jn]:
            return na, True  # the new point left at once (rounding): let the certificate decide
    return na, False


@njit(cache=True)
def _minor_cycle(x: np.ndarray, w: np.ndarray, active: np.ndarray, member: np.ndarray, na: int) -> int:
    """Wolfe's minor cycle on the coordinates ``x`` (SVD least squares); returns the active size."""
    d = x.shape[1]
    while True:
        xs = np.empty((na, d))
        for t in range(na):
            xs[t, :] = x[active[t], :]
        alpha = _affine_min(xs)
        if alpha.min() > WEIGHT_TOL:
            for t in range(na):
                w[active[t]] = alpha[t]
            return na
        na = _ratio_step(w, active, member, na, alpha)


@njit(cache=True)
def _hull_point(x: np.ndarray, w: np.ndarray, active: np.ndarray, na: int, y: np.ndarray) -> float:
    """Write ``y = sum_{t < na} w[active[t]] x[active[t]]`` (shape ``(d,)``) and return ``||y||^2``."""
    d = x.shape[1]
    for j in range(d):
        y[j] = 0.0
    for t in range(na):
        a = active[t]
        for j in range(d):
            y[j] += w[a] * x[a, j]
    yy = 0.0
    for j in range(d):
        yy += y[j] * y[j]
    return yy


@njit(cache=True)
def _wolfe_direct(x: np.ndarray, scale: float, w: np.ndarray, active: np.ndarray, member: np.ndarray, na: int) -> int:
    """Exact phase: Wolfe's algorithm on the coordinates, warm-started from ``(w, active)``.

    Starts with a minor cycle (so ``w`` becomes the affine minimiser of a face, computed
    from the coordinates), then runs major cycles with the stopping test of the reference:
    ``||y||^2 - min_i <y, x_i> <= WOLFE_TOL * scale``.
    """
    k, d = x.shape
    y = np.empty(d)
    dots = np.empty(k)
    na = _minor_cycle(x, w, active, member, na)
    for _ in range(50 * (k + d) + 100):
        yy = _hull_point(x, w, active, na, y)
        for i in range(k):
            acc = 0.0
            for j in range(d):
                acc += x[i, j] * y[j]
            dots[i] = acc
        jn = int(np.argmin(dots))
        if yy - dots[jn] <= WOLFE_TOL * scale or member[jn]:
            break
        active[na] = jn
        member[jn] = True
        na += 1
        na = _minor_cycle(x, w, active, member, na)
        if not member[jn]:
            break
    return na


@njit(cache=True)
def _min_norm_weights(x: np.ndarray) -> tuple[np.ndarray, bool]:
    """Min-norm point of ``conv`` of the rows of ``x`` ``(k, d)``: ``(weights (k,), used_exact)``.

    1. Wolfe's algorithm on the Gram matrix ``X X^T`` (:func:`_wolfe_gram`, Cholesky solves
       of size |active|, no ``d`` in the loop).
    2. Certificate on the coordinates: with ``y = sum w_i x_i``, ``UB = ||y||`` is attained
       and ``LB = max(0, min_i <y, x_i>) / ||y||`` is a valid lower bound (the hyperplane
       normal to ``y`` through the nearest vertex separates the hull from 0). The Gram answer
       is accepted when ``UB - LB <= FREE_REL_GAP * UB`` and ``UB (UB - LB) <= FREE_ABS_GAP *
       max_i ||x_i||^2``, or when ``UB`` is at the rounding level of the values.
    3. Otherwise the exact phase (:func:`_wolfe_direct`: Wolfe on the coordinates with the
       SVD least squares and stopping test of ``reference._wolfe_min_norm_point``),
       warm-started from the Gram phase's active set.
    """
    k, d = x.shape
    g = x @ x.T
    sq = np.empty(k)
    for i in range(k):
        sq[i] = g[i, i]
    scale = sq.max()
    w = np.zeros(k)
    j0 = int(np.argmin(sq))
    w[j0] = 1.0
    if scale == 0.0:
        return w, False
    active = np.empty(k, dtype=np.int64)
    member = np.zeros(k, dtype=np.bool_)
    active[0] = j0
    member[j0] = True
    na, ok = _wolfe_gram(g, scale, w, active, member, 1)
    if ok:
        y = np.empty(d)
        yy = _hull_point(x, w, active, na, y)
        ub = np.sqrt(yy)
        if ub <= 1e-13 * np.sqrt(scale):
            return w, False  # mu lies in the hull up to rounding of the values
        dmin = np.inf
        for i in range(k):
            acc = 0.0
            for j in range(d):
                acc += y[j] * x[i, j]
            dmin = min(dmin, acc)
        gap = ub - max(0.0, dmin) / ub
        if gap <= FREE_REL_GAP * ub and ub * gap <= FREE_ABS_GAP * scale:
            return w, False
    _wolfe_direct(x, scale, w, active, member, na)
    return w, True


@njit(cache=True)
def row_free_weight(v_row: np.ndarray, mu: np.ndarray, kept: np.ndarray) -> tuple[float, np.ndarray, bool]:
    """Free-weight error (ours) of one row: ``(e_free, w, used_exact)``.

    ``e_free(A) = min_{w in simplex} ||sum_{i in A} w_i (v_i - mu)||``, the distance from
    ``mu`` to ``conv{v_i : i in A}`` (docs/theory.md section 3). ``v_row`` ``(n, d)``; ``mu`` ``(d,)`` the dense
    output (:func:`row_dense_output`; the caller usually has it already); ``kept`` int64
    ``(k,)`` local indices with at least one entry ``>= 0``, ``-1`` skipped (not checked
    here). ``w`` ``(k,)`` is aligned with ``kept`` (0 on padding). ``used_exact`` says the
    Gram phase's certificate failed and the exact coordinate phase ran (see
    :func:`_min_norm_weights`); either way the duality gap is certified. The error is
    recomputed from the final weights as ``||sum_i w_i x_i||``, not carried through the
    iterations.
    """
    d = v_row.shape[1]
    k = 0
    for t in range(kept.shape[0]):
        if kept[t] >= 0:
            k += 1
    x = np.empty((k, d))
    pos = np.empty(k, dtype=np.int64)
    c = 0
    for t in range(kept.shape[0]):
        if kept[t] >= 0:
            for j in range(d):
                x[c, j] = v_row[kept[t], j] - mu[j]
            pos[c] = t
            c += 1
    wk, used_exact = _min_norm_weights(x)
    w = np.zeros(kept.shape[0])
    acc = 0.0
    for j in range(d):
        yj = 0.0
        for c in range(k):
            yj += wk[c] * x[c, j]
        acc += yj * yj
    for c in range(k):
        w[pos[c]] = wk[c]
    return np.sqrt(acc), w, used_exact


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
        for t in range(n_top):
            pool[r, t] = order[t]
            err[order[t]] = -np.inf  # already in the pool: rank last
        n_extra = min(n - n_top, r_e)
        eorder = top_k_desc(err, n_extra)
        for t in range(n_extra):
            pool[r, n_top + t] = eorder[t]
        size[r] = n_top + n_extra
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


def single_blas_thread():
    """Context manager limiting BLAS / LAPACK (OpenBLAS, MKL) to one thread.

    Use it around Numba kernels that call LAPACK inside ``prange`` (the SVD least squares of
    the exact free-weight phase, the SVD of the solve certificate): otherwise every Numba
    thread starts its own BLAS thread pool, the cores are oversubscribed and spin-waiting
    BLAS threads cost more than the work (measured 15x slower). Shared by
    :mod:`evictlab.core` and :mod:`evictlab.solve`.
    """
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1)


def _call(kernel, work: float, *args, lapack: bool = False):
    """Run a parallel kernel, on one thread when ``work`` (multiply-adds) is small.

    ``lapack=True``: the kernel calls LAPACK inside its parallel loop, so BLAS is limited to
    one thread while it runs multi-threaded (:func:`single_blas_thread`).
    """
    threads = numba.get_num_threads()
    if work >= PARALLEL_MIN_WORK or threads == 1:
        if lapack and threads > 1:
            with single_blas_thread():
                return kernel(*args)
        return kernel(*args)
    numba.set_num_threads(1)
    try:
        return kernel(*args)
    finally:
        numba.set_num_threads(threads)


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
    return _call(_k_dense_output, b[0].shape[0] * b[2].shape[1], *b)


def batch_top_mass(p: np.ndarray, p_off: np.ndarray, s: int, *, validate: bool = True) -> np.ndarray:
    """``T_s`` of every row: int64 ``(N, s)`` local indices, largest mass first, ties to the larger index.

    Raises:
        InputError: if ``s < 1`` or ``s > n_i`` for some row (the row is named).
    """
    p_arr, off = _masses(p, p_off, validate)
    s = _check_budget_rows(s, off)
    return _call(_k_top_mass, 20.0 * p_arr.shape[0], p_arr, off, s)


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
    return _call(_k_candidate_pool, b[0].shape[0] * (b[2].shape[1] + 40.0), *b, s, r_m, r_e, c_max)


def batch_forced_error(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, kept: np.ndarray, *, validate: bool = True
) -> np.ndarray:
    """Forced errors ``e(A_i) = ||mu_i - m_{A_i}||`` of every row: float64 ``(N,)``.

    ``kept`` int64 ``(N, k)`` local indices padded with ``-1``. ``inf`` where ``P(A_i) = 0``.
    """
    b = _batch(p, p_off, values, v_start, validate)
    k = _kept(kept, b[1], validate)
    return _call(_k_forced_error, b[0].shape[0] * b[2].shape[1], *b, k)


def batch_dropped_mass(p: np.ndarray, p_off: np.ndarray, kept: np.ndarray, *, validate: bool = True) -> np.ndarray:
    """Dropped masses ``D(A_i)`` (of the normalised rows) of every row: float64 ``(N,)`` in ``[0, 1]``."""
    p_arr, off = _masses(p, p_off, validate)
    k = _kept(kept, off, validate)
    return _call(_k_dropped_mass, 2.0 * p_arr.shape[0], p_arr, off, k)


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
    return _call(_k_free_weight_error, work, *b, k, lapack=True)


def batch_single_key_errors(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, *, validate: bool = True
) -> np.ndarray:
    """Single-key errors ``||mu_i - v_j||`` of every key of every row: float64 ``[sum n_i]`` (laid out like ``p``)."""
    b = _batch(p, p_off, values, v_start, validate)
    return _call(_k_single_key_errors, 2.0 * b[0].shape[0] * b[2].shape[1], *b)


def batch_entropy(p: np.ndarray, p_off: np.ndarray, *, validate: bool = True) -> np.ndarray:
    """Shannon entropies (nats) of the normalised rows: float64 ``(N,)``."""
    p_arr, off = _masses(p, p_off, validate)
    return _call(_k_entropy, 20.0 * p_arr.shape[0], p_arr, off)
