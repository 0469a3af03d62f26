"""Fast free-weight error with a certified duality gap (falls back to the core solver).

``e_free(A) = min_{w in simplex} ||sum_{i in A} w_i x_i||`` with ``x_i = v_i - mu`` (SPEC 3,
ours). The solver runs Wolfe's min-norm-point algorithm entirely on the small Gram matrix
``H = X X^T`` ``(k, k)`` (no ``d`` in the loop, Cholesky for the affine minimiser), then
*certifies* the answer on the coordinates: with ``y = sum w_i x_i``,
``UB = ||y||`` is attained and ``LB = max(0, min_i <y, x_i>) / ||y||`` is a valid lower bound
(the hyperplane normal to ``y`` through the nearest vertex separates the hull from 0). The
value ``UB`` is accepted only if ``UB - LB <= FREE_REL_GAP * UB`` (or ``UB`` is at the rounding
level of the values); otherwise the exact solver of :mod:`evictlab.core.kernels`
(``row_free_weight``, Wolfe with an SVD-based minor cycle on the coordinates) is used. So
every returned value carries a duality gap below 1e-9 relative, as the spec requires.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from evictlab.core.kernels import row_free_weight

#: Accept the Gram-phase answer when its coordinate duality gap is below this (relative).
FREE_REL_GAP = 1e-10
#: Wolfe's stopping test on the Gram matrix, relative to max_i ||x_i||^2.
_GRAM_TOL = 1e-15
#: Affine weights below this count as leaving the face.
_W_TOL = 1e-13


@njit(cache=True)
def _affine_weights(H: np.ndarray, act: np.ndarray, na: int, shift: float) -> tuple[np.ndarray, bool]:
    """Weights ``a`` (sum 1) minimising ``a^T H_SS a`` over the active set ``S = act[:na]``.

    Solves ``(H_SS + shift 1 1^T) u = 1`` by Cholesky (the shift makes the system positive
    definite whenever the points are affinely independent) and returns ``u / sum(u)``;
    ``ok = False`` if the factorisation breaks down (near affine dependence).
    """
    L = np.zeros((na, na))
    for j in range(na):
        dj = H[act[j], act[j]] + shift
        acc = dj
        for c in range(j):
            acc -= L[j, c] * L[j, c]
        if not acc > 1e-12 * dj:
            return np.empty(0), False
        L[j, j] = np.sqrt(acc)
        for i in range(j + 1, na):
            acc = H[act[i], act[j]] + shift
            for c in range(j):
                acc -= L[i, c] * L[j, c]
            L[i, j] = acc / L[j, j]
    z = np.empty(na)
    for i in range(na):
        acc = 1.0
        for c in range(i):
            acc -= L[i, c] * z[c]
        z[i] = acc / L[i, i]
    u = np.empty(na)
    for i in range(na - 1, -1, -1):
        acc = z[i]
        for c in range(i + 1, na):
            acc -= L[c, i] * u[c]
        u[i] = acc / L[i, i]
    tot = 0.0
    for i in range(na):
        tot += u[i]
    if not (tot > 0.0 and np.isfinite(tot)):
        return np.empty(0), False
    return u / tot, True


@njit(cache=True)
def gram_wolfe(H: np.ndarray) -> tuple[np.ndarray, bool]:
    """Wolfe's min-norm point on the Gram matrix ``H`` ``(k, k)``; returns ``(w (k,), ok)``.

    ``ok = False`` when a Cholesky step breaks down or the iteration limit is hit (the
    caller then uses the exact coordinate solver).
    """
    k = H.shape[0]
    w = np.zeros(k)
    act = np.empty(k, dtype=np.int64)
    member = np.zeros(k, dtype=np.bool_)
    scale = 0.0
    j0 = 0
    for i in range(k):
        if H[i, i] > scale:
            scale = H[i, i]
        if H[i, i] < H[j0, j0]:
            j0 = i
    w[j0] = 1.0
    act[0] = j0
    member[j0] = True
    na = 1
    if scale == 0.0:
        return w, True
    Hw = np.empty(k)
    for _ in range(50 * k + 100):
        for i in range(k):
            acc = 0.0
            for t in range(na):
                acc += H[i, act[t]] * w[act[t]]
            Hw[i] = acc
        yy = 0.0
        for t in range(na):
            yy += w[act[t]] * Hw[act[t]]
        j = 0
        for i in range(1, k):
            if Hw[i] < Hw[j]:
                j = i
        if yy - Hw[j] <= _GRAM_TOL * scale or member[j]:
            return w, True
        act[na] = j
        member[j] = True
        na += 1
        while True:  # minor cycle
            a, ok = _affine_weights(H, act, na, scale)
            if not ok:
                return w, False
            amin = a[0]
            for t in range(1, na):
                amin = min(amin, a[t])
            if amin > _W_TOL:
                for t in range(na):
                    w[act[t]] = a[t]
                break
            # ratio test: move towards a until the first weight hits zero, drop it
            theta = 1.0
            drop = -1
            for t in range(na):
                if a[t] <= _W_TOL:
                    cur = w[act[t]]
                    den = cur - a[t]
                    r = cur / den if den > 0.0 else 0.0
                    if r < theta or drop < 0:
                        theta = min(max(r, 0.0), 1.0)
                        drop = t
            m = 0
            tot = 0.0
            for t in range(na):
                nw = (1.0 - theta) * w[act[t]] + theta * a[t]
                if t == drop or nw <= _W_TOL:
                    w[act[t]] = 0.0
                    member[act[t]] = False
                else:
                    w[act[t]] = nw
                    tot += nw
                    act[m] = act[t]
                    m += 1
            if m == 0:
                return w, False
            na = m
            for t in range(na):
                w[act[t]] /= tot
    return w, False


@njit(cache=True)
def free_weight_row(p: np.ndarray, V: np.ndarray, mu: np.ndarray, kept: np.ndarray) -> tuple[float, bool]:
    """``e_free(A)`` of one row with a certified gap; returns ``(value, used_fallback)``.

    ``p`` ``(n,)`` masses summing to 1, ``V`` ``(n, d)``, ``mu`` the dense output, ``kept``
    int64 local indices ``(k,)``.
    """
    k = kept.shape[0]
    d = V.shape[1]
    X = np.empty((k, d))
    xmax = 0.0
    for a in range(k):
        acc = 0.0
        for t in range(d):
            X[a, t] = V[kept[a], t] - mu[t]
            acc += X[a, t] * X[a, t]
        xmax = max(xmax, acc)
    H = X @ X.T
    w, ok = gram_wolfe(H)
    if ok:
        y = np.zeros(d)
        for a in range(k):
            if w[a] != 0.0:
                for t in range(d):
                    y[t] += w[a] * X[a, t]
        yy = 0.0
        for t in range(d):
            yy += y[t] * y[t]
        ub = np.sqrt(yy)
        if ub <= 1e-13 * np.sqrt(xmax):
            return ub, False  # mu lies in the hull up to rounding of the values
        dmin = np.inf
        for a in range(k):
            acc = 0.0
            for t in range(d):
                acc += y[t] * X[a, t]
            dmin = min(dmin, acc)
        lb = max(0.0, dmin) / ub
        if ub - lb <= FREE_REL_GAP * ub:
            return ub, False
    return row_free_weight(p, V, kept)[0], True
