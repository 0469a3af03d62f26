"""Plain-numpy reference for the single-row math (one row, written to be obviously correct).

A row has masses ``p`` float64 ``(n,)`` and value vectors ``values`` float64 ``(n, d)``.
A kept set ``kept`` is an integer array of distinct key indices in ``[0, n)``, any order.
Definitions (``docs/theory.md``, "Single-row definitions"):

* dense output ``mu = sum_i p_i v_i``;
* mass ``P(A) = sum_{i in A} p_i``, dropped mass ``D(A) = 1 - P(A)``;
* forced output ``m_A = sum_{i in A} p_i v_i / P(A)``, forced error ``e(A) = ||mu - m_A||_2``;
* identity ``e(A) = D(A) * ||m_{A^c} - m_A||``;
* ``T_s``: the s keys of largest p, ties to the larger index;
* candidate pool ``C_s(r_m, r_e)`` (ours), free-weight error (ours), least-squares ablation.

Masses are accepted when they sum to 1 within ``1e-6`` (float32 softmax rows) and are
divided by their sum first, so every quantity here is computed on an exact-simplex row; this
keeps the identity exact to rounding instead of to ``1e-6``. Ranking (``T_s``) uses the
masses as given, so the normalisation can never merge two distinct masses into a tie.

Every function validates its inputs and raises :class:`evictlab.errors.InputError`.
This module favours clarity over speed; :mod:`evictlab.core.kernels` is the fast path and
is tested against this one.
"""

from __future__ import annotations

import numpy as np

from evictlab.core.validate import check_budget, check_count, validate_kept, validate_masses, validate_row
from evictlab.errors import InputError

#: Wolfe stopping tolerance: stop when ``||x||^2 - min_i <x, x_i> <= WOLFE_TOL * max_i ||x_i||^2``.
WOLFE_TOL = 1e-14
#: Weights below ``WEIGHT_TOL`` (relative to 1) are treated as zero when leaving a face.
WEIGHT_TOL = 1e-13


def _row(p: object, values: object) -> tuple[np.ndarray, np.ndarray]:
    """Validate and normalise a row: returns ``(p / sum(p), values)`` in float64."""
    p_arr, v_arr = validate_row(p, values)
    return p_arr / p_arr.sum(), v_arr


def _masses(p: object) -> np.ndarray:
    """Validate and normalise masses alone: returns ``p / sum(p)`` in float64."""
    p_arr = validate_masses(p)
    return p_arr / p_arr.sum()


def _mask(kept: np.ndarray, n: int) -> np.ndarray:
    """Boolean ``(n,)`` membership mask of a kept set."""
    m = np.zeros(n, dtype=bool)
    m[kept] = True
    return m


def dense_output(p: object, values: object) -> np.ndarray:
    """Dense attention output ``mu = sum_i p_i v_i``, shape ``(d,)``."""
    p_n, v = _row(p, values)
    return p_n @ v


def forced_output(p: object, values: object, kept: object) -> np.ndarray:
    """Forced (renormalised) output ``m_A = sum_{i in A} p_i v_i / P(A)``, shape ``(d,)``.

    Raises:
        InputError: if the kept keys carry zero mass (no renormalised softmax exists).
    """
    p_n, v = _row(p, values)
    a = validate_kept(kept, p_n.shape[0])
    mass = p_n[a].sum()
    if mass <= 0.0:
        raise InputError("kept", "holds zero attention mass, so the forced output is undefined", "keep at least one key with p > 0")
    return (p_n[a] @ v[a]) / mass


def forced_error(p: object, values: object, kept: object) -> float:
    """Forced error ``e(A) = ||mu - m_A||_2`` (same units as the values).

    Returns ``inf`` when ``P(A) = 0`` (the forced output does not exist; any set with mass
    beats it), so minimisers never pick such a set.
    """
    p_n, v = _row(p, values)
    a = validate_kept(kept, p_n.shape[0])
    mass = p_n[a].sum()
    if mass <= 0.0:
        return float("inf")
    mu = p_n @ v
    m_a = (p_n[a] @ v[a]) / mass
    return float(np.linalg.norm(mu - m_a))


def dropped_mass(p: object, kept: object) -> float:
    """Dropped mass ``D(A) = sum_{i not in A} p_i`` (of the normalised row), in ``[0, 1]``.

    Summed over the dropped keys rather than as ``1 - P(A)``, so small ``D`` keeps its
    relative accuracy.
    """
    p_n = _masses(p)
    a = validate_kept(kept, p_n.shape[0])
    return float(p_n[~_mask(a, p_n.shape[0])].sum())


def identity_rhs(p: object, values: object, kept: object) -> float:
    """Right side of the identity, ``D(A) * ||m_{A^c} - m_A||``.

    It is 0 when ``A`` is every key or when the dropped keys carry no mass (then
    ``m_{A^c}`` is undefined but ``D(A) = 0``), and ``inf`` when ``P(A) = 0``.
    """
    p_n, v = _row(p, values)
    a = validate_kept(kept, p_n.shape[0])
    keep = _mask(a, p_n.shape[0])
    mass_a, mass_c = p_n[keep].sum(), p_n[~keep].sum()
    if mass_a <= 0.0:
        return float("inf")
    if mass_c <= 0.0:
        return 0.0
    m_a = (p_n[keep] @ v[keep]) / mass_a
    m_c = (p_n[~keep] @ v[~keep]) / mass_c
    return float(mass_c * np.linalg.norm(m_c - m_a))


def _rank_desc(score: np.ndarray) -> np.ndarray:
    """Indices sorted by ``score`` descending, ties to the larger index first."""
    idx = np.arange(score.shape[0])
    # lexsort's last key is the primary key: -score ascending, then -index ascending.
    return np.lexsort((-idx, -score))


def top_mass_set(p: object, s: object) -> np.ndarray:
    """``T_s``: the ``s`` keys of largest mass, int64 ``(s,)``, largest mass first.

    Ties go to the larger (more recent) index first, so ``T_s`` is deterministic.
    """
    p_arr = validate_masses(p)
    s = check_budget(s, p_arr.shape[0])
    return _rank_desc(p_arr)[:s].astype(np.int64)


def single_key_errors(p: object, values: object) -> np.ndarray:
    """Single-key errors ``||mu - v_i||`` for every key, float64 ``(n,)``."""
    p_n, v = _row(p, values)
    mu = p_n @ v
    return np.linalg.norm(v - mu[None, :], axis=1)


def candidate_pool(p: object, values: object, s: object, r_m: object = 2, r_e: object = 2) -> np.ndarray:
    """Candidate pool ``C_s(r_m, r_e)`` (ours), int64 ``(c,)`` with ``c = min(n, s + r_m + r_e)``.

    Ordering: first the top-``(s + r_m)`` keys by mass in ``T`` rank order (largest mass
    first, ties to the larger index), then the ``r_e`` keys of largest single-key error
    ``||mu - v_i||`` among the rest, largest error first (ties to the larger index). So
    ``pool[:s]`` is ``T_s``.
    """
    p_raw, v = validate_row(p, values)
    p_n = p_raw / p_raw.sum()
    n = p_n.shape[0]
    s = check_budget(s, n)
    r_m = check_count(r_m, "r_m")
    r_e = check_count(r_e, "r_e")
    top = _rank_desc(p_raw)[: min(n, s + r_m)]
    rest = np.setdiff1d(np.arange(n), top)
    err = single_key_errors(p_n, v)[rest]
    extra = rest[_rank_desc(err)[: min(rest.shape[0], r_e)]]
    return np.concatenate([top, extra]).astype(np.int64)


def free_weight_error(p: object, values: object, kept: object) -> tuple[float, np.ndarray]:
    """Free-weight error (ours): distance from ``mu`` to ``conv{v_i : i in kept}``.

    ``e_free(A) = min_{w >= 0, sum w = 1} ||mu - sum_{i in A} w_i v_i||``, solved exactly by
    Wolfe's minimum-norm-point algorithm on the translated points ``x_i = v_i - mu``.

    Certificate: at the returned weights ``w`` with ``x = sum w_i x_i``, the hyperplane
    ``{z : <x, z> = min_i <x, x_i>}`` separates the hull from the origin, so
    ``LB = max(0, min_i <x, x_i>) / ||x|| <= e_free <= ||x|| = UB``; the solver stops when
    ``||x||^2 - min_i <x, x_i> <= 1e-14 * max_i ||x_i||^2``, i.e. ``UB - LB`` is below about
    ``1e-14 * max_i ||x_i||^2 / UB``. :func:`free_weight_gap` recomputes this gap.

    Returns:
        ``(e_free, w)`` with ``w`` float64 ``(len(kept),)`` on the simplex, aligned with
        ``kept`` as given.
    """
    p_n, v = _row(p, values)
    a = validate_kept(kept, p_n.shape[0])
    mu = p_n @ v
    x = v[a] - mu[None, :]
    w = _wolfe_min_norm_point(x)
    return float(np.linalg.norm(w @ x)), w


def free_weight_gap(p: object, values: object, kept: object, w: object) -> tuple[float, float]:
    """Bounds ``(LB, UB)`` on ``e_free(A)`` certified by the weights ``w`` (see above).

    ``UB = ||sum w_i (v_i - mu)||`` is attained by ``w``; ``LB`` is the distance from the
    origin to the separating hyperplane with normal ``x``. ``UB - LB`` is the duality gap.
    """
    p_n, v = _row(p, values)
    a = validate_kept(kept, p_n.shape[0])
    w_arr = np.asarray(w, dtype=np.float64)
    if w_arr.shape != a.shape:
        raise InputError("w", f"has shape {w_arr.shape}, kept has {a.shape}", "pass one weight per kept key")
    x = v[a] - (p_n @ v)[None, :]
    xw = w_arr @ x
    ub = float(np.linalg.norm(xw))
    if ub == 0.0:
        return 0.0, 0.0
    # Clipped into [0, UB]: rounding in the dot products can move LB a few ulps past UB.
    return min(ub, max(0.0, float(np.min(x @ xw)) / ub)), ub


def _affine_min(xs: np.ndarray) -> np.ndarray:
    """Weights ``alpha`` (sum 1) of the min-norm point of the affine hull of rows of ``xs``.

    Parametrise ``alpha = e_0 + sum_{j>0} beta_j (e_j - e_0)`` and solve the least-squares
    problem ``min_beta ||x_0 + (X_{1:} - x_0)^T beta||`` with SVD-based ``lstsq`` (stable
    under near affine dependence).
    """
    if xs.shape[0] == 1:
        return np.ones(1)
    diff = (xs[1:] - xs[0][None, :]).T  # (d, k-1)
    beta = np.linalg.lstsq(diff, -xs[0], rcond=None)[0]
    return np.concatenate([[1.0 - beta.sum()], beta])


def _wolfe_min_norm_point(x: np.ndarray, max_major: int | None = None) -> np.ndarray:
    """Wolfe (1976) min-norm point of ``conv`` of the rows of ``x`` ``(k, d)``; weights ``(k,)``.

    Major cycle: stop if the Wolfe gap ``||y||^2 - min_i <y, x_i>`` is below tolerance,
    else add the most descending point. Minor cycle: move to the affine minimiser of the
    active set if it lies in the relative interior of its simplex, otherwise step to the
    boundary (ratio test) and drop the point(s) whose weight reaches zero. Finite in exact
    arithmetic; the tolerances make it finite in floating point.
    """
    k = x.shape[0]
    sq = np.einsum("ij,ij->i", x, x)
    scale = float(sq.max())
    w = np.zeros(k)
    j0 = int(np.argmin(sq))
    w[j0] = 1.0
    if scale == 0.0:  # every kept value equals mu
        return w
    active = [j0]
    max_major = max_major or 50 * (k + x.shape[1]) + 100
    for _ in range(max_major):
        y = w @ x
        dots = x @ y
        j = int(np.argmin(dots))
        if float(y @ y) - float(dots[j]) <= WOLFE_TOL * scale or j in active:
            break  # optimal within tolerance (or numerically stalled: j already active)
        active.append(j)
        while True:  # minor cycle
            alpha = _affine_min(x[active])
            if np.all(alpha > WEIGHT_TOL):
                w[:] = 0.0
                w[active] = alpha
                break
            cur = w[active]
            neg = np.flatnonzero(alpha <= WEIGHT_TOL)
            denom = cur[neg] - alpha[neg]
            ratios = np.where(denom > 0.0, cur[neg] / np.where(denom > 0.0, denom, 1.0), 0.0)
            r = int(np.argmin(ratios))
            theta = min(max(float(ratios[r]), 0.0), 1.0)
            new = (1.0 - theta) * cur + theta * alpha
            keep = new > WEIGHT_TOL
            keep[neg[r]] = False  # the ratio-test argmin always leaves, whatever rounding says
            if not keep.any():
                keep[int(np.argmax(new))] = True
            active = [a for a, kk in zip(active, keep) if kk]
            w[:] = 0.0
            w[active] = new[keep] / new[keep].sum()
        if j not in active:
            break  # the new point cannot enter: no further progress is possible in floats
    return w


def least_squares_error(p: object, values: object, kept: object) -> float:
    """Ablation: ``min_{w in R^|A|} ||mu - sum_{i in A} w_i v_i||`` (unconstrained weights).

    A lower bound on :func:`free_weight_error`; never the default analysis.
    """
    p_n, v = _row(p, values)
    a = validate_kept(kept, p_n.shape[0])
    mu = p_n @ v
    w = np.linalg.lstsq(v[a].T, mu, rcond=None)[0]
    return float(np.linalg.norm(mu - v[a].T @ w))


def entropy(p: object) -> float:
    """Shannon entropy ``-sum_i p_i log p_i`` of the normalised row, in nats (``0 log 0 = 0``)."""
    p_n = _masses(p)
    nz = p_n[p_n > 0]
    return float(-(nz * np.log(nz)).sum())


def affine_error(p: object, values: object, kept: object) -> float:
    """Ablation (ours): ``min_{sum w = 1} ||mu - sum_{i in A} w_i v_i||``, weights of any sign.

    The distance from ``mu`` to the affine hull of the kept values, by least squares on the
    differences ``v_i - v_first`` (SVD ``lstsq``; see :func:`_affine_min`). Translation
    invariant like ``e`` and ``e_free``; ``e_aff <= e_free``, and ``e_aff = 0`` for rows in
    general position once ``|A| > d``.
    """
    p_n, v = _row(p, values)
    a = validate_kept(kept, p_n.shape[0])
    x = v[a] - (p_n @ v)[None, :]
    return float(np.linalg.norm(_affine_min(x) @ x))


def nonneg_error(p: object, values: object, kept: object) -> tuple[float, np.ndarray]:
    """Ablation (ours): ``min_{w >= 0} ||mu - sum_{i in A} w_i v_i||``, weights need not sum to 1.

    The distance from ``mu`` to the cone spanned by the kept values (through the origin, so
    unlike ``e`` and ``e_free`` it is not invariant when all values are translated);
    ``e_nn <= e_free``. Solved exactly by the Lawson-Hanson active-set method: add the
    coordinate with the largest positive gradient ``V_A (mu - V_A^T w)`` to the passive
    set, solve least squares on it, step back to the boundary and drop coordinates that
    reach zero; stop when no gradient exceeds ``1e-12 * scale`` (the KKT conditions
    ``w >= 0``, gradient ``<= 0``, gradient ``= 0`` on the support, to rounding).

    Returns ``(e_nn, w)``, ``w`` float64 ``(len(kept),)``, aligned with ``kept``.
    """
    p_n, v = _row(p, values)
    a = validate_kept(kept, p_n.shape[0])
    A = v[a].T  # (d, k)
    b = p_n @ v
    k = A.shape[1]
    w = np.zeros(k)
    scale = float(np.abs(A).max(initial=0.0)) * max(float(np.abs(b).max(initial=0.0)), float(np.abs(A).max(initial=0.0)))
    if scale == 0.0:
        return float(np.linalg.norm(b)), w
    tol = 1e-12 * scale
    passive = np.zeros(k, dtype=bool)
    for _ in range(3 * k + 10):
        grad = A.T @ (b - A @ w)
        cand = np.where(~passive, grad, -np.inf)
        j = int(np.argmax(cand))
        if not cand[j] > tol:
            break
        passive[j] = True
        while True:  # inner loop: least squares on the passive set, kept feasible
            z = np.zeros(k)
            idx = np.flatnonzero(passive)
            z[idx] = np.linalg.lstsq(A[:, idx], b, rcond=None)[0]
            if np.all(z[idx] > WEIGHT_TOL):
                w = z
                break
            neg = idx[z[idx] <= WEIGHT_TOL]
            step = np.min(w[neg] / np.maximum(w[neg] - z[neg], 1e-300))
            w = w + step * (z - w)
            passive &= w > WEIGHT_TOL
            w[~passive] = 0.0
            if not passive.any():
                break
    return float(np.linalg.norm(b - A @ w)), w
