"""Numba kernels of the solvers: pool enumeration (revolving door) and the balancing selector.

Everything is float64 and works on one row inside a ``prange`` loop over the rows of a ragged
batch (layout in ``docs/architecture.md``). Rows never share state, so results do not depend
on the number of threads.

Notation for one row (``docs/solvers.md``): masses ``p`` (normalised to sum 1), values
``v_i`` ``(d,)``, dense output ``mu``; for the ``c`` keys of the candidate pool the centred,
mass-weighted vectors ``x_i = p_i (v_i - mu)`` and their Gram matrix ``G = X X^T`` ``(c, c)``.
Then for any ``A`` in the pool

    e(A) = ||sum_{i in A} x_i|| / P(A),    ||sum_A x||^2 = sum_{a, b in A} G_ab,

so after an O(c^2 d) precomputation the error of a subset needs only Gram entries.

Enumeration walks the ``t``-subsets ``B`` (``t = min(s, c - s)``) in revolving-door order; the
kept set is ``A = B`` (``s <= c - s``) or ``A = C \\ B`` (the complement side, cheaper when
``s > c / 2``). A swap ``o -> i`` of ``B`` updates

    Q_B' = Q_B + 2 (T_i - T_o) - G_ii - G_oo + 2 G_io,  T_m = sum_{b in B'} G_mb,

in O(t), and for the complement side ``Q_A = ||X||^2 - 2 <X, S_B> + Q_B``. Rounding drift is
bounded by recomputing ``Q_B`` from scratch every :data:`REFRESH` steps, and the returned
error of the argmin is always recomputed exactly from the values (``forced_error_exact``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from evictlab.core.freeweight import row_free_weight
from evictlab.core.kernels import row_candidate_pool, row_normalized, row_weighted_sum
from evictlab.core.ranking import top_k_desc
from evictlab.solve.revolving import rd_init, rd_next

#: Steps between exact recomputations of the running sums during enumeration (drift guard).
REFRESH = 256
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


@njit(cache=True)
def enumerate_min(G: np.ndarray, pw: np.ndarray, s: int) -> tuple[float, np.ndarray, int]:
    """Minimum of ``e(A)^2`` over every s-subset ``A`` of a pool, by revolving-door enumeration.

    The subsets ``B`` (size ``t = min(s, c - s)``; ``A = B`` or its complement) are visited
    in the order of :func:`evictlab.solve.revolving.rd_next`, in which consecutive subsets
    differ by one swap. In that order the smallest element ``c1`` sweeps a run of values
    while ``W = B \\ {c1}`` stays fixed, and each change of ``W`` is a single swap. So we keep
    ``RW_m = <S_W, x_m>`` for all m (O(c) per swap of W, and recomputed from scratch every
    :data:`REFRESH` swaps against drift) and evaluate each subset of a sweep in O(1):
    ``||S_W + x_m||^2 = ||S_W||^2 + 2 RW_m + G_mm``.

    Args:
        G: ``(c, c)`` Gram matrix of ``x_a = p_a (v_a - mu)``.
        pw: ``(c,)`` masses of the pool keys.
        s: subset size, ``1 <= s <= c``.

    Returns:
        ``(best_e2, best, count)``: the smallest running value of ``Q_A / P(A)^2`` (rounded;
        the caller recomputes the error of ``best`` exactly), the argmin as int64 pool
        positions ``(s,)`` sorted ascending (first in visiting order among exact ties), and
        the number of subsets evaluated (``C(c, s)``). Sets with ``P(A) = 0`` count as
        ``e = inf``.
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
    cc = rd_init(c, t)
    RW = np.zeros(c)
    best_b = np.empty(t, dtype=np.int64)
    best_e2 = np.inf
    count = 0
    since = REFRESH  # forces an exact computation of RW at the start
    while True:
        if since >= REFRESH:
            # Exact recomputation of W's sums (drift guard).
            for m in range(c):
                acc = 0.0
                for u in range(2, t + 1):
                    acc += G[m, cc[u]]
                RW[m] = acc
            since = 0
        WW = 0.0
        PW = 0.0
        gW = 0.0
        for u in range(2, t + 1):
            a = cc[u]
            WW += RW[a]
            PW += pw[a]
            gW += g[a]
        # Sweep c1 over its run (up to c2 - 1 for odd t, down to 0 for even t), in the
        # same order as the easy steps of Algorithm R.
        if t % 2 == 1:
            m0 = cc[1]
            m1 = cc[2] - 1
            step = 1
        else:
            m0 = cc[1]
            m1 = 0
            step = -1
        m = m0
        while True:
            QB = WW + 2.0 * RW[m] + diag[m]
            if comp:
                QA = XX - 2.0 * (gW + g[m]) + QB
                PA = PC - PW - pw[m]
            else:
                QA = QB
                PA = PW + pw[m]
            if PA > 0.0:
                if QA < 0.0:
                    QA = 0.0  # rounding below zero
                e2 = QA / (PA * PA)
                if e2 < best_e2:
                    best_e2 = e2
                    best_b[0] = m
                    for u in range(1, t):
                        best_b[u] = cc[u + 1]
            if m == m1:
                break
            m += step
        count += (m1 - m0) * step + 1
        cc[1] = m1
        o, i = rd_next(cc, t)  # the easy case is exhausted: a move involving W
        if o < 0:
            break
        # W changes by the swap's elements plus the change of c1 (old m1 -> new cc[1]):
        # W_new = W_old + {m1, i} - {o, cc[1]} (a pair that appears on both sides cancels).
        add0 = m1
        add1 = i
        rem0 = o
        rem1 = cc[1]
        if add0 == rem0:
            add0 = -1
            rem0 = -1
        elif add0 == rem1:
            add0 = -1
            rem1 = -1
        if add1 >= 0 and add1 == rem0:
            add1 = -1
            rem0 = -1
        elif add1 >= 0 and add1 == rem1:
            add1 = -1
            rem1 = -1
        for pair in range(2):
            a_in = add0 if pair == 0 else add1
            if a_in < 0:
                continue
            if rem0 >= 0:
                a_out = rem0
                rem0 = -1
            else:
                a_out = rem1
                rem1 = -1
            for q in range(c):
                RW[q] += G[a_in, q] - G[a_out, q]
            since += 1
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
        best.sort()
    if best_e2 == np.inf:
        # Every subset has zero mass (cannot happen for a pool holding T_s of a simplex row).
        for a in range(s):
            best[a] = a
    return best_e2, best, count


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
            acc = 0.0
            for t in range(d):
                diff = V[i, t] - mu[t]
                acc += diff * diff
            err[i] = np.sqrt(acc)
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
            _, pos_opt, cnt = enumerate_min(G, pw, s)
            opt = _sorted_keys(pool, pos_opt)
            eo = forced_error_exact(pr, V, mu, opt)
            pos_bal, nsw = balance_swaps(G, pw, s, max_swaps)
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
