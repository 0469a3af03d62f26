"""The free-weight solver in Numba: the min-norm point of the convex hull of the kept values.

:func:`row_free_weight` (one row, no validation) runs Wolfe's algorithm in two phases, a
fast Gram phase and an exact coordinate phase, and certifies its answer by the duality gap
(docs/theory.md, section 3); the same solver is behind
:func:`evictlab.core.kernels.batch_free_weight_error` and ``evictlab solve``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

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
def _chol_rows(g: np.ndarray, active: np.ndarray, start: int, na: int, shift: float, L: np.ndarray) -> bool:
    """Rows ``start .. na-1`` of the Cholesky factor ``L`` of ``G_SS + shift 1 1^T`` (in place).

    ``S`` is ``active[:na]`` in its order and ``g`` ``(k, k)`` the Gram matrix of all
    points; rows below ``start`` must already hold the factor of ``active[:start]``. Row
    ``i`` of a Cholesky factor depends only on rows ``< i``, so a point appended to the
    active set costs one row, O(na^2), and after points leave only the rows from the first
    one that moved are recomputed: the same bits as a factorisation from scratch. Returns
    ``False`` when a pivot falls below ``1e-12`` of its diagonal (points nearly affinely
    dependent: the caller falls back to the SVD path). ``shift = max_i ||x_i||^2`` matches
    the scales; for any ``shift > 0`` the affine minimiser is unchanged (see
    :func:`_chol_affine`).
    """
    for i in range(start, na):
        ai = active[i]
        for j in range(i):
            acc = g[ai, active[j]] + shift
            for c in range(j):
                acc -= L[i, c] * L[j, c]
            L[i, j] = acc / L[j, j]
        diag = g[ai, ai] + shift
        acc = diag
        for c in range(i):
            acc -= L[i, c] * L[i, c]
        if not acc > 1e-12 * diag:
            return False
        L[i, i] = np.sqrt(acc)
    return True


@njit(cache=True)
def _chol_affine(L: np.ndarray, na: int) -> tuple[np.ndarray, bool]:
    """Affine-minimiser weights of the active points from the factor ``L`` of :func:`_chol_rows`.

    Solves ``(G_SS + shift 1 1^T) u = 1`` by two triangular solves and returns
    ``alpha = u / sum(u)``: for any ``shift > 0`` this minimises ``alpha^T G_SS alpha``
    subject to ``sum(alpha) = 1``. ``ok = False`` when ``sum(u)`` is not positive and finite.
    """
    m = na
    z = np.empty(m)
    for i in range(m):
        acc = 1.0
        for c in range(i):
            acc -= L[i, c] * z[c]
        z[i] = acc / L[i, i]
    u = np.empty(m)
    for i in range(m - 1, -1, -1):
        acc = z[i]
        for c in range(i + 1, m):
            acc -= L[c, i] * u[c]
        u[i] = acc / L[i, i]
    tot = u.sum()
    if not (tot > 0.0 and np.isfinite(tot)):
        return np.empty(0), False
    return u / tot, True


@njit(cache=True)
def _factored_minor_cycle(
    g: np.ndarray, scale: float, w: np.ndarray, active: np.ndarray, member: np.ndarray, na: int,
    L: np.ndarray, nvalid: int,
) -> tuple[int, bool]:
    """Wolfe's minor cycle on the Gram matrix, keeping the Cholesky factor ``L`` of the active set.

    ``L`` ``(>= na, >= na)`` holds valid rows for ``active[:nvalid]`` on entry and for the
    whole (returned) active set on a successful return. Returns ``(active size, ok)``.
    """
    while True:
        if not _chol_rows(g, active, nvalid, na, scale, L):
            return na, False
        alpha, ok = _chol_affine(L, na)
        if not ok:
            return na, False
        if alpha.min() > WEIGHT_TOL:
            for t in range(na):
                w[active[t]] = alpha[t]
            return na, True
        before = active[:na].copy()
        na = _ratio_step(w, active, member, na, alpha)
        # the rows before the first point that left are still the factor's
        nvalid = na
        for t in range(na):
            if active[t] != before[t]:
                nvalid = t
                break


@njit(cache=True)
def gram_minor_cycle(
    g: np.ndarray, scale: float, w: np.ndarray, active: np.ndarray, member: np.ndarray, na: int
) -> tuple[int, bool]:
    """Wolfe's minor cycle from the Gram matrix ``g`` of the points (Cholesky of the active set).

    ``w`` (weights indexed like the rows of ``g``), ``active[:na]`` and ``member`` are
    updated in place; returns ``(active size, ok)``, ``ok = False`` when a Cholesky solve
    breaks down (the caller falls back to :func:`minor_cycle` on the coordinates). Also
    used by the relaxation of ``evictlab.solve.bound``, whose points are generated on the fly.
    """
    return _factored_minor_cycle(g, scale, w, active, member, na, np.empty((na, na)), 0)


@njit(cache=True)
def _wolfe_gram(
    g: np.ndarray, scale: float, w: np.ndarray, active: np.ndarray, member: np.ndarray, na: int
) -> tuple[int, bool]:
    """Fast phase: Wolfe's algorithm on the Gram matrix ``g = X X^T`` (no ``d`` in the loop).

    Updates ``w``, ``active``, ``member`` in place and returns ``(active size, ok)``;
    ``ok = False`` when a Cholesky solve breaks down (near affine dependence) or the
    iteration limit is hit. ``w`` is always a convex combination of the active points, so
    the exact phase (:func:`_wolfe_direct`) can warm-start from it. Gram arithmetic squares
    the conditioning, so the caller certifies the answer on the coordinates. The Cholesky
    factor of the active set is kept across major cycles (one new row per added point,
    :func:`_chol_rows`), which gives the same bits as refactoring at every step.
    """
    k = g.shape[0]
    dots = np.empty(k)
    L = np.empty((k, k))
    nvalid = 0
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
        na, ok = _factored_minor_cycle(g, scale, w, active, member, na, L, nvalid)
        if not ok:
            return na, False
        nvalid = na
        if not member[jn]:
            return na, True  # the new point left at once (rounding): let the certificate decide
    return na, False


@njit(cache=True)
def minor_cycle(x: np.ndarray, w: np.ndarray, active: np.ndarray, member: np.ndarray, na: int) -> int:
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
def hull_point(x: np.ndarray, w: np.ndarray, active: np.ndarray, na: int, y: np.ndarray) -> float:
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
    na = minor_cycle(x, w, active, member, na)
    for _ in range(50 * (k + d) + 100):
        yy = hull_point(x, w, active, na, y)
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
        na = minor_cycle(x, w, active, member, na)
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
        yy = hull_point(x, w, active, na, y)
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
