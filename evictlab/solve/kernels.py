"""Numba kernels of the solvers: pool enumeration (with a bound) and the balancing selector.

Everything is float64 and works on one row inside a ``prange`` loop over the rows of a ragged
batch (layout in ``docs/architecture.md``). Rows never share state, so results do not depend
on the number of threads.

Notation for one row (``docs/solvers.md``): masses ``p`` (normalised to sum 1), values
``v_i`` ``(d,)``, dense output ``mu``; for the ``c`` keys of the candidate pool the centred,
mass-weighted vectors ``x_i = p_i (v_i - mu)`` and their Gram matrix ``G = X X^T`` ``(c, c)``.
Then for any ``A`` in the pool

    e(A) = ||sum_{i in A} x_i|| / P(A),    ||sum_A x||^2 = sum_{a, b in A} G_ab,

so after an O(c^2 d) precomputation the error of a subset needs only Gram entries.

Enumeration walks the ``t``-subsets ``B`` (``t = min(s, c - s)``) in lexicographic order; the
kept set is ``A = B`` (``s <= c - s``) or ``A = C \\ B`` (the complement side, cheaper when
``s > c / 2``; ``Q_A = ||X||^2 - 2 <X, S_B> + Q_B``). Each prefix of ``B`` carries exact
sums extended from its parent, the last element is swept in O(1) per subset, and a lower
bound on every completion of a prefix (triangle inequality and projection on the fixed
part of ``S_A``) skips the prefixes that cannot beat the incumbent, the balancing set
first: at the paper's scale (s = 32, C(36, 4) = 58,905 subsets) about 74 are evaluated.
The returned error of the argmin is always recomputed exactly from the values
(``forced_error_exact``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from evictlab.core.freeweight import row_free_weight
from evictlab.core.kernels import _dist, row_candidate_pool, row_normalized, row_weighted_sum
from evictlab.core.ranking import top_k_desc

#: The enumeration skips a prefix only when its bound exceeds the incumbent by this relative
#: amount, so subsets that tie with the minimum up to rounding are always evaluated.
PRUNE_REL = 1e-9
#: Rounding allowance of the enumeration's bound (64 units in the last place), charged
#: against the bound's norms and projections.
BOUND_EPS = 64.0 * 2.220446049250313e-16
#: A balancing swap is applied only if it lowers e(A)^2 by more than this relative amount,
#: so rounding noise can never make the selector cycle.
BAL_REL_TOL = 1e-13


# --------------------------------------------------------------------------- row helpers


@njit(cache=True)
def forced_error_exact(p: np.ndarray, V: np.ndarray, mu: np.ndarray, kept: np.ndarray) -> float:
    """``e(A) = ||sum_{i in A} p_i (v_i - mu)|| / P(A)`` from scratch, O(|A| d); inf if P(A) = 0.

    ``kept`` int64 local indices (any order; the caller passes them sorted for determinism).
    """
    d = V.shape[1]
    acc = np.zeros(d)
    P = 0.0
    for a in range(kept.shape[0]):
        i = kept[a]
        pi = p[i]
        P += pi
        for t in range(d):
            acc[t] += pi * (V[i, t] - mu[t])
    if P <= 0.0:
        return np.inf
    q = 0.0
    for t in range(d):
        q += acc[t] * acc[t]
    return np.sqrt(q) / P


@njit(cache=True)
def pool_gram(p: np.ndarray, V: np.ndarray, mu: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """Gram matrix ``G_ab = <x_a, x_b>`` of ``x_a = p_a (v_a - mu)`` over the pool, ``(c, c)``."""
    c = pool.shape[0]
    d = V.shape[1]
    X = np.empty((c, d))
    for a in range(c):
        i = pool[a]
        for t in range(d):
            X[a, t] = p[i] * (V[i, t] - mu[t])
    G = np.empty((c, c))
    for a in range(c):
        for b in range(a, c):
            acc = 0.0
            for t in range(d):
                acc += X[a, t] * X[b, t]
            G[a, b] = acc
            G[b, a] = acc
    return G


# --------------------------------------------------------------------------- enumeration


@njit(cache=True, error_model="numpy")
def enumerate_min(G: np.ndarray, pw: np.ndarray, s: int, e2_inc: float = np.inf) -> tuple[float, np.ndarray, int]:
    """Minimum of ``e(A)^2`` over every s-subset ``A`` of a pool: enumeration with a bound.

    The subsets ``B`` (size ``t = min(s, c - s)``; ``A = B``, or ``A = C \\ B`` when
    ``s > c / 2``) are walked in lexicographic order, depth first over their first
    ``t - 1`` elements. A prefix of ``k`` elements carries its exact sums (``||S||^2``, its
    mass, ``<X, S>`` and the row sums ``R_m = <S, x_m>`` for the keys after its last
    element), extended from its parent in O(c); the last element sweeps one branch-free
    loop, ``||S_B||^2 = ||S||^2 + 2 R_m + G_mm`` in O(1) per subset, with no running sums to
    drift. Before a prefix is extended, a lower bound on ``e^2`` of every completion
    (:func:`_completion_bound`, docs/solvers.md) is compared with the incumbent: the
    smallest value found so far or ``e2_inc``, whichever is smaller; a prefix whose bound
    exceeds it by more than :data:`PRUNE_REL` is skipped with all its completions.

    Args:
        G: ``(c, c)`` Gram matrix of ``x_a = p_a (v_a - mu)``.
        pw: ``(c,)`` masses of the pool keys.
        s: subset size, ``1 <= s <= c``.
        e2_inc: ``e^2`` of a known s-subset of the pool (the balancing set in
            :func:`batch_solve`), or ``inf``. Any value is safe: when the walk's minimum
            ends above it (``e2_inc`` was below the pool's minimum, so the bound may have
            skipped the argmin) the walk is repeated without it.

    Returns:
        ``(best_e2, best, count)``: the smallest value of ``Q_A / P(A)^2`` (rounded; the
        caller recomputes the error of ``best`` exactly), the argmin as int64 pool
        positions ``(s,)`` sorted ascending (for ``B``, the first in lexicographic order
        among exact ties; the bound never skips a subset within ``PRUNE_REL`` of the
        minimum, so it does not change which one), and the number of subsets the minimum
        is taken over, ``C(c, s)`` (evaluated or excluded by the bound). Sets with
        ``P(A) = 0`` count as ``e = inf``.
    """
    c = pw.shape[0]
    comp = s > c - s
    t = c - s if comp else s
    # Totals over the whole pool (used by the complement side).
    g = np.zeros(c)
    XX = 0.0
    PC = 0.0
    for a in range(c):
        acc = 0.0
        for b in range(c):
            acc += G[a, b]
        g[a] = acc
        XX += acc
        PC += pw[a]
    best = np.empty(s, dtype=np.int64)
    if t == 0:
        # A is the whole pool (s == c): one subset.
        for a in range(s):
            best[a] = a
        return (max(XX, 0.0) / (PC * PC) if PC > 0.0 else np.inf), best, 1
    diag = np.empty(c)
    for a in range(c):
        diag[a] = G[a, a]
    # The bound's suffix extremes: xs[j] = max_{m >= j} ||x_m||, pmn / pmx the masses' min / max.
    xs = np.zeros(c + 1)
    pmn = np.full(c + 1, np.inf)
    pmx = np.zeros(c + 1)
    gsc = 0.0
    for a in range(c - 1, -1, -1):
        xs[a] = max(xs[a + 1], np.sqrt(max(diag[a], 0.0)))
        pmn[a] = min(pmn[a + 1], pw[a])
        pmx[a] = max(pmx[a + 1], pw[a])
        gsc += abs(diag[a])
    # binom[m, r] = C(m, r): the size of a skipped prefix's subtree
    binom = np.zeros((c + 1, t + 1), dtype=np.int64)
    for m in range(c + 1):
        binom[m, 0] = 1
        for r in range(1, min(m, t) + 1):
            binom[m, r] = binom[m - 1, r - 1] + (binom[m - 1, r] if r <= m - 1 else 0)
    # values below the rounding level of the pool's sums are never used to skip anything
    floor = BOUND_EPS * gsc / (PC * PC) if PC > 0.0 else 0.0
    # Prefix state by depth k = 0 .. t-1 (k elements chosen): Q[k] = ||S||^2, P[k] its mass,
    # GS[k] = <X, S> (complement side), R[k, m] = <S, x_m> for m after the last element.
    R = np.zeros((t, c))
    Q = np.zeros(t)
    P = np.zeros(t)
    GS = np.zeros(t)
    b = np.empty(t, dtype=np.int64)
    buf = np.empty(c)
    best_b = np.empty(t, dtype=np.int64)
    last = t - 1
    for attempt in range(2):
        inc = e2_inc if attempt == 0 else np.inf
        best_e2 = np.inf
        count = 0
        k = 0
        b[0] = -1
        lo = 0
        while True:
            if last > 0:
                # advance the prefix to its next value (depth first, lexicographic)
                b[k] += 1
                if b[k] > c - (t - k):
                    if k == 0:
                        break
                    k -= 1
                    continue
                bk = b[k]
                Q[k + 1] = Q[k] + 2.0 * R[k, bk] + diag[bk]
                P[k + 1] = P[k] + pw[bk]
                GS[k + 1] = GS[k] + g[bk]
                # R of the new prefix, and the largest projection -+<Z, x_m> over the keys
                # after bk (Z: the part of S_A the prefix fixes, X - S or S)
                proj = 0.0
                pscale = 0.0
                for m in range(bk + 1, c):
                    rm = R[k, m] + G[bk, m]
                    R[k + 1, m] = rm
                    if comp:
                        proj = max(proj, g[m] - rm)
                        pscale = max(pscale, abs(g[m]) + abs(rm))
                    else:
                        proj = max(proj, -rm)
                        pscale = max(pscale, abs(rm))
                r = t - (k + 1)
                thr = min(inc, best_e2)
                if thr < np.inf:
                    if comp:
                        z2 = XX - 2.0 * GS[k + 1] + Q[k + 1]
                        zs = XX + 2.0 * abs(GS[k + 1]) + Q[k + 1]
                        pa = PC - P[k + 1] - r * pmn[bk + 1]
                    else:
                        z2 = Q[k + 1]
                        zs = Q[k + 1]
                        pa = P[k + 1] + r * pmx[bk + 1]
                    lb = _completion_bound(z2, zs, pa, r, xs[bk + 1], proj, pscale)
                    if lb > max(thr * (1.0 + PRUNE_REL), floor):
                        count += binom[c - 1 - bk, r]
                        continue
                if k + 1 < last:
                    k += 1
                    b[k] = bk
                    continue
                lo = bk + 1
            # the last element m sweeps lo .. c-1: one branch-free (vectorisable) loop, then
            # the scan for the first strict improvement
            q0 = Q[last]
            p0 = P[last]
            g0 = GS[last]
            for m in range(lo, c):
                QB = q0 + 2.0 * R[last, m] + diag[m]
                if comp:
                    QA = XX - 2.0 * (g0 + g[m]) + QB
                    PA = PC - p0 - pw[m]
                else:
                    QA = QB
                    PA = p0 + pw[m]
                QA = max(QA, 0.0)  # rounding below zero
                buf[m] = QA / (PA * PA) if PA > 0.0 else np.inf
            for m in range(lo, c):
                if buf[m] < best_e2:
                    best_e2 = buf[m]
                    for u in range(last):
                        best_b[u] = b[u]
                    best_b[last] = m
            count += c - lo
            if last == 0:
                break
        # The skipped prefixes' subsets all lie above max(inc (1 + PRUNE_REL), floor), so the
        # walk's minimum is the pool's when it is no larger; otherwise e2_inc was below the
        # minimum (not a subset's value): walk again without it.
        if inc == np.inf or best_e2 <= max(inc * (1.0 + PRUNE_REL), floor):
            break
    if best_e2 == np.inf:
        # Every subset has zero mass (cannot happen for a pool holding T_s of a simplex row).
        for a in range(s):
            best[a] = a
        return best_e2, best, count
    # Translate the best B into A (pool positions, ascending).
    if comp:
        inb = np.zeros(c, dtype=np.bool_)
        for u in range(t):
            inb[best_b[u]] = True
        k = 0
        for a in range(c):
            if not inb[a]:
                best[k] = a
                k += 1
    else:
        for u in range(t):
            best[u] = best_b[u]
    return best_e2, best, count


@njit(cache=True)
def _completion_bound(z2: float, zs: float, pa: float, r: int, xmax: float, proj: float, pscale: float) -> float:
    """Lower bound on ``e(A)^2`` over the completions of a prefix (docs/solvers.md).

    Every completion is ``S_A = Z -+ (sum of r vectors x_m)`` from the keys after the
    prefix, with ``||Z||^2 = z2`` (``zs`` its rounding scale), so
    ``||S_A|| >= ||Z|| - r max ||x_m||`` (triangle inequality, ``xmax``) and
    ``||S_A|| >= ||Z|| - r max(-+<Z, x_m>)_+ / ||Z||`` (projection on ``Z``, ``proj``,
    ``pscale`` its rounding scale), while ``P(A) <= pa``. Rounding is charged against the
    bound (:data:`BOUND_EPS`); returns 0 where nothing is known.
    """
    if not pa > 0.0:
        return 0.0
    zlo = np.sqrt(max(z2 - BOUND_EPS * zs, 0.0))
    if not zlo > 0.0:
        return 0.0
    num = max(zlo - r * xmax * (1.0 + BOUND_EPS), zlo - r * (proj + BOUND_EPS * pscale) / zlo)
    if not num > 0.0:
        return 0.0
    return num * num / (pa * pa) * (1.0 - BOUND_EPS)


# --------------------------------------------------------------------------- balancing


@njit(cache=True)
def balance_swaps(G: np.ndarray, pw: np.ndarray, s: int, max_swaps: int) -> tuple[np.ndarray, int]:
    """Balancing selector (ours) on a pool whose first ``s`` positions are ``T_s``.

    Best-improvement local search: start at ``A = {0..s-1}``; each round evaluate every
    swap (``o`` in A, ``i`` in C \\ A) in O(1) from the Gram matrix and the row sums
    ``R_m = <S_A, x_m>``, apply the one that lowers ``e(A)^2`` most (first in (o, i) order
    among ties), stop when none lowers it by more than :data:`BAL_REL_TOL` (relative) or
    after ``max_swaps`` swaps. ``R`` and ``Q_A`` are recomputed exactly after each swap.

    Returns:
        ``(A, n_swaps)``: pool positions int64 ``(s,)`` sorted ascending, swaps applied.
    """
    c = pw.shape[0]
    inA = np.zeros(c, dtype=np.bool_)
    for a in range(s):
        inA[a] = True
    R = np.empty(c)
    n_swaps = 0
    while True:
        QA = 0.0
        PA = 0.0
        for m in range(c):
            acc = 0.0
            for a in range(c):
                if inA[a]:
                    acc += G[m, a]
            R[m] = acc
        for a in range(c):
            if inA[a]:
                QA += R[a]
                PA += pw[a]
        cur = QA / (PA * PA) if PA > 0.0 else np.inf
        if n_swaps >= max_swaps:
            break
        best = cur
        bo = -1
        bi = -1
        for o in range(c):
            if not inA[o]:
                continue
            for i in range(c):
                if inA[i]:
                    continue
                q = QA + G[o, o] + G[i, i] - 2.0 * G[o, i] + 2.0 * (R[i] - R[o])
                if q < 0.0:
                    q = 0.0
                P = PA - pw[o] + pw[i]
                if P <= 0.0:
                    continue
                e2 = q / (P * P)
                if e2 < best:
                    best = e2
                    bo = o
                    bi = i
        if bo < 0 or not (best < cur * (1.0 - BAL_REL_TOL)):
            break
        inA[bo] = False
        inA[bi] = True
        n_swaps += 1
    out = np.empty(s, dtype=np.int64)
    k = 0
    for a in range(c):
        if inA[a]:
            out[k] = a
            k += 1
    return out, n_swaps


# --------------------------------------------------------------------------- batch driver


@njit(cache=True)
def _sorted_keys(pool: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Local key indices ``pool[pos]``, sorted ascending."""
    out = np.empty(pos.shape[0], dtype=np.int64)
    for a in range(pos.shape[0]):
        out[a] = pool[pos[a]]
    out.sort()
    return out


@njit(cache=True, parallel=True)
def batch_solve(
    p: np.ndarray,
    p_off: np.ndarray,
    values: np.ndarray,
    v_start: np.ndarray,
    budgets: np.ndarray,
    r_m: int,
    r_e: int,
    max_swaps: int,
) -> tuple:
    """Top-mass, pool optimum and balancing selector for every (row, budget) of a ragged batch.

    Args:
        p, p_off, values, v_start: the ragged batch (``docs/architecture.md``); each row's
            masses are divided by their sum first (as in ``evictlab.core.reference``).
        budgets: int64 ``(B,)``, every ``1 <= s <= n_i`` (the caller checks).
        r_m, r_e: pool parameters; max_swaps: balancing swap limit K.

    Returns (``smax = max(budgets)``, index lists ``-1`` padded, local key indices sorted):
        e_top ``(N, B)``, es_hat ``(N, B)``, e_bal ``(N, B)``, dropped ``(N, B)`` = D(T_s),
        kept_top ``(N, B, smax)``, kept_opt ``(N, B, smax)`` (argmin of ES_hat),
        kept_bal ``(N, B, smax)``, pool_size ``(N, B)``, n_subsets ``(N, B)``,
        n_swaps ``(N, B)``, entropy ``(N,)`` in nats, e_free_top ``(N, B)`` and
        e_free_opt ``(N, B)`` (free-weight errors of T_s and of the argmin, min-norm point
        with a certified duality gap, ``evictlab.core.freeweight.row_free_weight``; reused when the
        sets coincide),
        scale ``(N,)`` = ``max(max_i ||v_i - mu||, ||mu||)`` (the row's error scale, for zero tests).

    Guarantees by construction (each value is an exactly recomputed e(A) of an s-subset of
    the pool): ``es_hat <= e_bal <= e_top``.
    """
    N = p_off.shape[0] - 1
    B = budgets.shape[0]
    smax = 0
    for b in range(B):
        smax = max(smax, budgets[b])
    e_top = np.empty((N, B))
    es_hat = np.empty((N, B))
    e_bal = np.empty((N, B))
    dropped = np.empty((N, B))
    kept_top = np.full((N, B, smax), -1, dtype=np.int64)
    kept_opt = np.full((N, B, smax), -1, dtype=np.int64)
    kept_bal = np.full((N, B, smax), -1, dtype=np.int64)
    pool_size = np.empty((N, B), dtype=np.int64)
    n_sub = np.empty((N, B), dtype=np.int64)
    n_swaps = np.empty((N, B), dtype=np.int64)
    ent = np.empty(N)
    ef_top = np.empty((N, B))
    ef_opt = np.empty((N, B))
    scale = np.empty(N)
    for r in prange(N):
        lo = p_off[r]
        n = p_off[r + 1] - lo
        V = values[v_start[r] : v_start[r] + n]
        d = V.shape[1]
        pr = row_normalized(p[lo : lo + n])
        h = 0.0
        for i in range(n):
            if pr[i] > 0.0:
                h -= pr[i] * np.log(pr[i])
        ent[r] = h
        mu = row_weighted_sum(pr, V)
        err = np.empty(n)
        for i in range(n):
            err[i] = _dist(mu, V, i)  # the same bits as the pool of evictlab.core.kernels
        # Only the first smax + r_m keys by mass (and smax + r_m + r_e by single-key error)
        # can enter any T_s or pool; the dropped mass uses the complement of T_s.
        order_p = top_k_desc(p[lo : lo + n], min(n, smax + r_m))  # raw masses: no merged ties
        order_err = top_k_desc(err, min(n, smax + r_m + r_e))
        # error scale for zero tests: the spread of the values or their magnitude (the
        # rounding level of mu), whichever is larger
        mnorm = 0.0
        for t in range(d):
            mnorm += mu[t] * mu[t]
        scale[r] = max(err[order_err[0]], np.sqrt(mnorm))
        for b in range(B):
            s = budgets[b]
            # T_s and its dropped mass (summed over the dropped keys: no 1 - P cancellation).
            top = np.sort(order_p[:s].copy())
            intop = np.zeros(n, dtype=np.bool_)
            for a in range(s):
                intop[order_p[a]] = True
            dm = 0.0
            for i in range(n):
                if not intop[i]:
                    dm += pr[i]
            dropped[r, b] = dm
            et = forced_error_exact(pr, V, mu, top)
            pool = row_candidate_pool(order_p, order_err, n, s, r_m, r_e)
            c = pool.shape[0]
            pw = np.empty(c)
            for a in range(c):
                pw[a] = pr[pool[a]]
            G = pool_gram(pr, V, mu, pool)
            pos_bal, nsw = balance_swaps(G, pw, s, max_swaps)
            # the balancing set's e^2 from the Gram matrix: the enumeration's first incumbent
            qb = 0.0
            pb = 0.0
            for a in range(s):
                pb += pw[pos_bal[a]]
                for a2 in range(s):
                    qb += G[pos_bal[a], pos_bal[a2]]
            inc = max(qb, 0.0) / (pb * pb) if pb > 0.0 else np.inf
            _, pos_opt, cnt = enumerate_min(G, pw, s, inc)
            opt = _sorted_keys(pool, pos_opt)
            eo = forced_error_exact(pr, V, mu, opt)
            bal = _sorted_keys(pool, pos_bal)
            eb = forced_error_exact(pr, V, mu, bal)
            # Enforce es_hat <= e_bal <= e_top exactly: all three sets lie in the pool, so
            # taking the smaller exact value is still the minimum over the pool's s-subsets.
            if eb > et:
                eb = et
                bal = top
            if eo > eb:
                eo = eb
                opt = bal
            ef_top[r, b] = row_free_weight(V, mu, top)[0]
            same = True
            for a in range(s):
                if opt[a] != top[a]:
                    same = False
            ef_opt[r, b] = ef_top[r, b] if same else row_free_weight(V, mu, opt)[0]
            e_top[r, b] = et
            e_bal[r, b] = eb
            es_hat[r, b] = eo
            for a in range(s):
                kept_top[r, b, a] = top[a]
                kept_opt[r, b, a] = opt[a]
                kept_bal[r, b, a] = bal[a]
            pool_size[r, b] = c
            n_sub[r, b] = cnt
            n_swaps[r, b] = nsw
    return (e_top, es_hat, e_bal, dropped, kept_top, kept_opt, kept_bal, pool_size, n_sub,
            n_swaps, ent, ef_top, ef_opt, scale)
