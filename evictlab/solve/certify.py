"""Certified global optimum ES(s) over all n keys by branch and bound (small rows only).

For one row with centred, mass-weighted vectors ``x_i = p_i (v_i - mu)``,
``e(A) = ||sum_{i in A} x_i|| / P(A)``. The search fixes keys one at a time in order of
decreasing mass (depth-first, "take" before "skip"); a node is a chosen set ``F``, a suffix
of keys ``j..n-1`` still allowed, and ``k = s - |F|`` keys still to choose.

Lower bound of a node (valid for every completion ``A = F + K``, ``K`` a k-subset of the
suffix): in any orthonormal basis ``u_1..u_r`` (we use the principal axes of the ``x_i``, so
few coordinates carry the spread; dropping axes only lowers the bound),

    ||S_A||^2 >= sum_t dist(0, [<u_t,S_F> + lo_t(j,k), <u_t,S_F> + hi_t(j,k)])^2,

where ``lo_t``/``hi_t`` are the sums of the k smallest / largest ``<u_t, x_i>`` over the suffix,
and ``P(A) <= P(F) + (the k largest masses of the suffix)``. So
``LB = sqrt(that) / (P(F) + top-k mass)`` (``inf`` if that mass is 0: such sets have no forced
output). Suffix tables make a bound O(r).

The incumbent is seeded with the pool optimum ES_hat and its argmin. A node is pruned when
``LB >= incumbent * (1 - CERT_REL_TOL)``; when the search ends the result is certified:
no s-subset has ``e(A) < es_cert * (1 - CERT_REL_TOL)`` (the tolerance absorbs rounding in the
bound). If ``node_limit`` is reached the status is "limit" and ``cert_lb`` is the smallest
bound over the unexplored nodes (a valid lower bound on ES(s)).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from evictlab.solve.kernels import dense_mu, forced_error_exact, rank_desc

#: Relative tolerance of the certificate (see module docstring).
CERT_REL_TOL = 1e-9
#: Default size limits of the certified solver (documented in docs/solvers.md).
CERT_MAX_N = 48
CERT_MAX_S = 8
CERT_NODE_LIMIT = 20_000_000

STATUS_OPTIMAL = 0
STATUS_LIMIT = 1
STATUS_SKIPPED = 2
STATUS_NAMES = ("optimal", "limit", "skipped")


@njit(cache=True)
def _suffix_tables(Y: np.ndarray, pw: np.ndarray, kmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Suffix tables for the bound: ``lo, hi`` ``(n+1, kmax+1, r)`` and ``pk`` ``(n+1, kmax+1)``.

    ``lo[j, k, t]`` (``hi``) is the sum of the k smallest (largest) ``Y[i, t]``, ``i >= j``;
    ``pk[j, k]`` the sum of the k largest masses ``pw[i]``, ``i >= j`` (``pw`` is sorted
    descending, so that is ``pw[j] + ... + pw[j+k-1]``). Entries with ``k > n - j`` are
    unused (0). Each column is sorted once; a suffix walks the sorted order skipping
    indices below j (no allocation per suffix).
    """
    n, r = Y.shape
    lo = np.zeros((n + 1, kmax + 1, r))
    hi = np.zeros((n + 1, kmax + 1, r))
    pk = np.zeros((n + 1, kmax + 1))
    for j in range(n):
        kk = min(kmax, n - j)
        acc = 0.0
        for k in range(1, kk + 1):
            acc += pw[j + k - 1]
            pk[j, k] = acc
    for t in range(r):
        order = np.argsort(Y[:, t])
        for j in range(n):
            kk = min(kmax, n - j)
            k = 0
            a = 0.0
            for q in range(n):
                i = order[q]
                if i >= j:
                    k += 1
                    a += Y[i, t]
                    lo[j, k, t] = a
                    if k == kk:
                        break
            k = 0
            b = 0.0
            for q in range(n - 1, -1, -1):
                i = order[q]
                if i >= j:
                    k += 1
                    b += Y[i, t]
                    hi[j, k, t] = b
                    if k == kk:
                        break
    return lo, hi, pk


@njit(cache=True)
def _bound(S: np.ndarray, PF: float, j: int, k: int, lo: np.ndarray, hi: np.ndarray, pk: np.ndarray) -> float:
    """Lower bound on ``e(F + K)`` over k-subsets ``K`` of the suffix ``j..`` (module docstring)."""
    r = S.shape[0]
    q = 0.0
    for t in range(r):
        a = S[t] + lo[j, k, t]
        b = S[t] + hi[j, k, t]
        if a > 0.0:
            q += a * a
        elif b < 0.0:
            q += b * b
    den = PF + pk[j, k]
    if den <= 0.0:
        return np.inf
    return np.sqrt(q) / den


@njit(cache=True)
def certify_row(p: np.ndarray, V: np.ndarray, s: int, inc_set: np.ndarray, node_limit: int) -> tuple[float, np.ndarray, int, float, int]:
    """Branch and bound for ES(s) of one row (module docstring).

    Args:
        p: ``(n,)`` masses summing to 1; V: ``(n, d)`` values; s: budget ``1 <= s <= n``.
        inc_set: ``(s,)`` local indices of a starting incumbent (ES_hat's argmin).
        node_limit: maximal number of bound evaluations.

    Returns:
        ``(es_cert, kept, status, lb, nodes)``: the best error found (exact recomputation),
        its set (sorted local indices), ``STATUS_OPTIMAL`` or ``STATUS_LIMIT``, a certified
        lower bound on ES(s) (``es_cert * (1 - CERT_REL_TOL)`` when optimal), nodes used.
    """
    n, d = V.shape
    mu = dense_mu(p, V)
    inc_sorted = np.sort(inc_set.copy())
    inc = forced_error_exact(p, V, mu, inc_sorted)
    best_set = inc_sorted.copy()
    # Order keys by mass descending; x_i = p_i (v_i - mu) in that order.
    order = rank_desc(p)
    X = np.empty((n, d))
    pw = np.empty(n)
    for a in range(n):
        i = order[a]
        pw[a] = p[i]
        for t in range(d):
            X[a, t] = p[i] * (V[i, t] - mu[t])
    # Principal axes of the x_i (an orthonormal basis of their span).
    _, sv, vt = np.linalg.svd(X, full_matrices=False)
    r = 0
    for t in range(sv.shape[0]):
        if sv[t] > 0.0:
            r += 1
    if r > 0:
        Y = X @ np.ascontiguousarray(vt[:r].T)
    else:  # every x_i = 0: all errors are 0; one zero coordinate keeps the shapes valid
        r = 1
        Y = np.zeros((n, 1))
    lo, hi, pk = _suffix_tables(Y, pw, s)
    # Depth-first search with explicit stacks: chosen[depth], next candidate nxt[depth],
    # partial sums Sd[depth] (no add/subtract drift: each level copies its parent's sum).
    chosen = np.empty(s, dtype=np.int64)
    nxt = np.zeros(s + 1, dtype=np.int64)
    Sd = np.zeros((s + 1, r))
    Pd = np.zeros(s + 1)
    thr = inc * (1.0 - CERT_REL_TOL)
    nodes = 0
    depth = 0
    found = False
    cand = np.empty(s, dtype=np.int64)
    limit_hit = False
    while depth >= 0:
        j = nxt[depth]
        k = s - depth
        if j > n - k:
            depth -= 1
            if depth >= 0:
                nxt[depth] = chosen[depth] + 1
            continue
        if nodes >= node_limit:
            limit_hit = True
            break
        nodes += 1
        if _bound(Sd[depth], Pd[depth], j, k, lo, hi, pk) >= thr:
            # No completion from this suffix can beat the incumbent: close the level.
            depth -= 1
            if depth >= 0:
                nxt[depth] = chosen[depth] + 1
            continue
        chosen[depth] = j
        for t in range(r):
            Sd[depth + 1, t] = Sd[depth, t] + Y[j, t]
        Pd[depth + 1] = Pd[depth] + pw[j]
        if depth + 1 == s:
            q = 0.0
            for t in range(r):
                q += Sd[s, t] * Sd[s, t]
            if Pd[s] > 0.0:
                e = np.sqrt(q) / Pd[s]
                if e < inc:
                    inc = e
                    thr = inc * (1.0 - CERT_REL_TOL)
                    for a in range(s):
                        cand[a] = order[chosen[a]]
                    found = True
            nxt[depth] = j + 1
            continue
        depth += 1
        nxt[depth] = j + 1
    lb = thr
    if limit_hit:
        # Smallest bound over the open nodes: level u still has to try suffix nxt[u].
        for u in range(depth + 1):
            ku = s - u
            if nxt[u] <= n - ku:
                b = _bound(Sd[u], Pd[u], nxt[u], ku, lo, hi, pk)
                if b < lb:
                    lb = b
    es = forced_error_exact(p, V, mu, best_set)
    if found:
        cs = np.sort(cand.copy())
        ec = forced_error_exact(p, V, mu, cs)
        if ec < es:  # exact recomputation decides between the seed and the new set
            es = ec
            best_set = cs
    if lb > es:
        lb = es
    return es, best_set, STATUS_LIMIT if limit_hit else STATUS_OPTIMAL, lb, nodes


@njit(cache=True, parallel=True)
def batch_certify(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, budgets: np.ndarray,
    seed_sets: np.ndarray, max_n: int, max_s: int, node_limit: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Certified ES(s) for every (row, budget) of a ragged batch; rows/budgets beyond the limits skipped.

    Args:
        seed_sets: int64 ``(N, B, smax)`` incumbents (ES_hat argmins), ``-1`` padded.
        max_n, max_s: size limits; larger rows/budgets get ``STATUS_SKIPPED`` and NaN values.

    Returns:
        es_cert ``(N, B)``, kept_cert ``(N, B, smax)`` (``-1`` padded), status ``(N, B)`` int64,
        cert_lb ``(N, B)``, nodes ``(N, B)`` int64.
    """
    N = p_off.shape[0] - 1
    B = budgets.shape[0]
    smax = seed_sets.shape[2]
    es = np.full((N, B), np.nan)
    kept = np.full((N, B, smax), -1, dtype=np.int64)
    status = np.full((N, B), STATUS_SKIPPED, dtype=np.int64)
    lb = np.full((N, B), np.nan)
    nodes = np.zeros((N, B), dtype=np.int64)
    for r in prange(N):
        lo_ = p_off[r]
        n = p_off[r + 1] - lo_
        if n > max_n:
            continue
        V = values[v_start[r] : v_start[r] + n]
        tot = 0.0
        for i in range(n):
            tot += p[lo_ + i]
        pr = np.empty(n)
        for i in range(n):
            pr[i] = p[lo_ + i] / tot
        for b in range(B):
            s = budgets[b]
            if s > max_s:
                continue
            e, ks, st, l, nd = certify_row(pr, V, s, seed_sets[r, b, :s].copy(), node_limit)
            es[r, b] = e
            for a in range(s):
                kept[r, b, a] = ks[a]
            status[r, b] = st
            lb[r, b] = l
            nodes[r, b] = nd
    return es, kept, status, lb, nodes
