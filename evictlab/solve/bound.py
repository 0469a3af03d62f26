"""Certified lower bound on ES(s) at any n: best-first branch and bound on the continuous relaxation.

For one row with centred, mass-weighted vectors ``x_i = p_i (v_i - mu)`` (principal
coordinates ``Y``, keys in the certificate's order of decreasing ``||x_i||``,
:func:`evictlab.solve.certify.principal_coordinates`), ``e(A) = ||y_A||`` with
``y_A = S_A / P(A) = m_A - mu``. A node is the certificate's: a chosen set ``F``, the keys
before ``j`` not in ``F`` excluded, ``k = s - |F|`` keys still to choose from the suffix
``j..n-1``. Its bound is the **continuous relaxation** of the subset choice (proofs in
``docs/theory.md``, "A lower bound at any n", and ``docs/solvers.md``):

    R(node) = min { ||S_F + sum_i z_i Y_i|| / (P(F) + sum_i z_i p_i) :
                    z in [0, 1]^suffix, sum z = k }
            = dist(0, conv { y_{F+K} : K a k-subset of the suffix }),

computed as the minimum-norm point of that hull by Wolfe's algorithm with the points
generated on the fly (column generation): for a direction ``y`` the point of the hull
minimising ``<y, .>`` is ``y_{F+K}`` with ``K`` the exact minimiser of the ratio
``(<y, S_F> + sum_K <y, Y_i>) / (P(F) + sum_K p_i)`` (Dinkelbach's iteration, each step the
k smallest of ``<y, Y_i> - lam p_i``). Every direction gives a **certified dual bound**
``max(0, min_K <y, y_{F+K}>) / ||y|| <= R(node) <= min over completions of e``, so the bound
is valid whether or not Wolfe's iteration converged (it is stopped after
:data:`BOUND_ITERS` major cycles, at a relative duality gap :data:`BOUND_REL_GAP`, or
when the hull's point ``y`` is shorter than :data:`BOUND_SMALL` times the incumbent); a
rounding margin is subtracted. The first direction is ``S_F`` where ``F`` is not empty (so
the bound is at least the certificate's direction bound), then the parent's last
direction or the relaxation's centroid ``z = k / (n - j)``. Nodes with ``k <= 1`` or no
choice left are evaluated exactly.

At the root the relaxation is 0 (the uniform ``z = s / n`` gives ``sum z_i x_i = 0``),
so the bound comes from branching: best-first (smallest bound first) on "take j" /
"skip j", at most ``node_limit`` node evaluations (:data:`BOUND_NODES` by default). The
incumbent is the best of the given sets (the pool argmin and the all-key search's set)
and of every completion the oracle produces, recomputed exactly. When the smallest open
bound reaches ``incumbent (1 - CERT_REL_TOL)`` the row is **closed** (``es_lb`` is then the
certificate's ``cert_lb`` for an optimal row); otherwise ``es_lb`` is the smallest open
bound, times ``1 - CERT_REL_TOL``. Either way ``es_lb <= ES(s)``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from evictlab.core.kernels import row_normalized
from evictlab.core.freeweight import gram_minor_cycle, hull_point, minor_cycle
from evictlab.solve.certify import CERT_REL_TOL, heap_pop, heap_push, k_smallest, principal_coordinates
from evictlab.solve.kernels import forced_error_exact

#: Default node limit per (row, s) (``evictlab solve --bound-nodes``).
BOUND_NODES = 64
#: Largest accepted node limit (each open node keeps its set and a direction: at s = 32 and
#: r = 64 about 0.6 kB, so 60 MB per thread at the limit).
BOUND_MAX_NODES = 100_000
#: Major cycles of Wolfe's algorithm per node (the bound is valid at any stop).
BOUND_ITERS = 40
#: Wolfe stops when the node's bound is within this fraction of ``||y||`` (an upper bound on
#: the relaxation: ``y`` lies in the hull) ...
BOUND_REL_GAP = 1e-4
#: ... or when ``||y||`` is below this fraction of the incumbent: the relaxation cannot give
#: this node a bound above ``BOUND_SMALL`` times the best error, so further cycles are wasted.
BOUND_SMALL = 1e-3
#: Rounding margin of the dual bound, relative to the magnitudes it adds.
_MARGIN = 1e-12

STATUS_CLOSED = 0
STATUS_LIMIT = 1
LB_STATUS_NAMES = ("closed", "limit")


@njit(cache=True)
def bound_setup(p: np.ndarray, V: np.ndarray) -> tuple:
    """Per-row data of the bound, shared by every budget of the row.

    Returns ``(mu, order, Y, pw, SY, SP)``: the certificate's principal coordinates
    (:func:`evictlab.solve.certify.principal_coordinates`; no Gram matrix, so the setup is
    O(n d^2) time and O(n d) memory at any n) and the suffix sums ``SY[j] = sum_{i >= j} Y_i``
    ``(n + 1, r)``, ``SP[j] = sum_{i >= j} p_i`` ``(n + 1,)``.
    """
    mu, order, X, Y, pw = principal_coordinates(p, V)
    n, r = Y.shape
    SY = np.zeros((n + 1, r))
    SP = np.zeros(n + 1)
    for j in range(n - 1, -1, -1):
        SP[j] = SP[j + 1] + pw[j]
        for t in range(r):
            SY[j, t] = SY[j + 1, t] + Y[j, t]
    return mu, order, Y, pw, SY, SP


@njit(cache=True)
def ratio_min(a: np.ndarray, c: float, PF: float, pw: np.ndarray, j: int, k: int, w: np.ndarray,
              buf: np.ndarray, idx: np.ndarray) -> tuple[float, float, float, bool]:
    """Certified lower bound on ``min_K (c + sum_K a_i) / (PF + sum_K p_i)``, K a k-subset of ``j..``.

    Dinkelbach's iteration (each step the k smallest ``a_i - lam p_i``): at any ``lam``,
    ``lam + min(phi(lam), 0) / D_min`` is a lower bound (``D_min = PF +`` the k smallest
    suffix masses), equal to the minimum when the iteration has converged. ``idx[:k]``
    receives the last minimiser (the exact one at convergence). Returns
    ``(bound, lam, D_min, ok)``; ``ok = False`` when some completion has no mass (``D_min <= 0``):
    no bound then. ``w``, ``buf``, ``idx``: work arrays ``(n,)``, ``(k,)``, ``(k,)``.
    """
    n = a.shape[0]
    for i in range(j, n):
        w[i] = pw[i]
    dmin = PF + k_smallest(w, j, k, buf, idx)
    if not dmin > 0.0:
        return 0.0, 0.0, dmin, False
    for i in range(j, n):
        w[i] = a[i]
    k_smallest(w, j, k, buf, idx)
    num = c
    den = PF
    for t in range(k):
        num += a[idx[t]]
        den += pw[idx[t]]
    lam = num / den
    phi = 0.0
    for _ in range(64):
        for i in range(j, n):
            w[i] = a[i] - lam * pw[i]
        phi = c - lam * PF + k_smallest(w, j, k, buf, idx)
        if phi >= 0.0:
            break
        num = c
        den = PF
        for t in range(k):
            num += a[idx[t]]
            den += pw[idx[t]]
        new = num / den
        if not new < lam:
            break
        lam = new
    return lam + min(phi, 0.0) / dmin, lam, dmin, True


@njit(cache=True)
def _oracle(Y: np.ndarray, pw: np.ndarray, SF: np.ndarray, PF: float, j: int, k: int, y: np.ndarray,
            a: np.ndarray, w: np.ndarray, buf: np.ndarray, idx: np.ndarray, q: np.ndarray) -> tuple[float, bool]:
    """Linear minimisation over the node's hull in direction ``y``.

    Returns ``(lb, ok)``: ``lb`` a certified lower bound on ``min_K <y, y_{F+K}>`` (the
    rounding margin subtracted); writes the minimiser ``K`` to ``idx[:k]`` and its point
    ``y_{F+K}`` to ``q``. ``ok = False``: some completion has no mass (no bound).
    """
    n, r = Y.shape
    ny = 0.0
    c = 0.0
    for t in range(r):
        ny += y[t] * y[t]
        c += y[t] * SF[t]
    ny = np.sqrt(ny)
    for i in range(j, n):
        acc = 0.0
        for t in range(r):
            acc += Y[i, t] * y[t]
        a[i] = acc
    lb, lam, dmin, ok = ratio_min(a, c, PF, pw, j, k, w, buf, idx)
    if not ok:
        return 0.0, False
    den = PF
    nf = 0.0
    for t in range(r):
        q[t] = SF[t]
        nf += SF[t] * SF[t]
    for s_ in range(k):
        i = idx[s_]
        den += pw[i]
        for t in range(r):
            q[t] += Y[i, t]
    for t in range(r):
        q[t] /= den
    # rounding: of the projections (|<y, Y_i>| <= ||y|| ||Y_j|| on the suffix, in the
    # certificate's order) and of the terms lam p_i (masses sum to at most 1 + P(F))
    xj = 0.0
    for t in range(r):
        xj += Y[j, t] * Y[j, t]
    mag = ny * (np.sqrt(nf) + k * np.sqrt(xj)) + abs(lam) * (1.0 + PF)
    return lb - _MARGIN * mag / dmin, True


@njit(cache=True)
def _exact_last(Y: np.ndarray, pw: np.ndarray, SF: np.ndarray, PF: float, j: int) -> tuple[float, int]:
    """``min_{i >= j} ||S_F + Y_i|| / (P(F) + p_i)`` and its ``i`` (``inf, -1`` if no mass)."""
    n, r = Y.shape
    best = np.inf
    arg = -1
    for i in range(j, n):
        den = PF + pw[i]
        if not den > 0.0:
            continue
        qq = 0.0
        for t in range(r):
            z = SF[t] + Y[i, t]
            qq += z * z
        e = np.sqrt(qq) / den
        if e < best:
            best = e
            arg = i
    return best, arg


@njit(cache=True)
def node_bound(Y: np.ndarray, pw: np.ndarray, SY: np.ndarray, SP: np.ndarray, F: np.ndarray, f: int, j: int,
               k: int, thr: float, warm: np.ndarray, y_out: np.ndarray, best_set: np.ndarray) -> tuple[float, bool, float]:
    """Lower bound on ``e(F + K)`` over the k-subsets ``K`` of the suffix ``j..`` (module docstring).

    ``F[:f]``: chosen keys (search order); ``thr``: stop as soon as the bound reaches it
    (the node is pruned); ``warm`` ``(r,)``: a start direction (zeros: the centroid).
    Writes the last direction to ``y_out`` and the best completion the oracle met to
    ``best_set[:s]`` (search order). Returns ``(lb, exact, e_best)``: the bound, whether it
    is the node's exact minimum (``k <= 1`` or no choice left), and the error of
    ``best_set`` in the coordinates (``inf`` when none; the caller recomputes it exactly).
    """
    n, r = Y.shape
    SF = np.zeros(r)
    PF = 0.0
    for a_ in range(f):
        PF += pw[F[a_]]
        for t in range(r):
            SF[t] += Y[F[a_], t]
    for a_ in range(f):
        best_set[a_] = F[a_]
    for t in range(r):
        y_out[t] = 0.0
    m = n - j
    if k == 0 or m == k:
        for a_ in range(k):
            best_set[f + a_] = j + a_
            PF += pw[j + a_]
            for t in range(r):
                SF[t] += Y[j + a_, t]
        if not PF > 0.0:
            return np.inf, True, np.inf
        e = np.sqrt(np.dot(SF, SF)) / PF
        return e, True, e
    if k == 1:
        e, i = _exact_last(Y, pw, SF, PF, j)
        best_set[f] = i
        return e, True, e
    a = np.empty(n)
    w = np.empty(n)
    buf = np.empty(k)
    idx = np.empty(k, dtype=np.int64)
    q = np.empty(r)
    e_best = np.inf
    lb = 0.0
    # 1. the certificate's direction (S_F), when F is not empty
    nsf = np.sqrt(np.dot(SF, SF))
    if f > 0 and nsf > 0.0:
        l1, ok = _oracle(Y, pw, SF, PF, j, k, SF, a, w, buf, idx, q)
        if not ok:
            return 0.0, False, np.inf
        lb = max(lb, l1 / nsf)
        eq = np.sqrt(np.dot(q, q))
        if eq < e_best:
            e_best = eq
            for s_ in range(k):
                best_set[f + s_] = idx[s_]
        if lb >= thr:
            return lb, False, e_best
    # 2. Wolfe's min-norm point over the hull, points from the oracle
    y = np.empty(r)
    nw = np.sqrt(np.dot(warm, warm))
    if nw > 0.0:
        for t in range(r):
            y[t] = warm[t]
    else:  # the centroid z = k / m of the relaxation (a point of the hull)
        frac = k / m
        den = PF + frac * SP[j]
        if not den > 0.0:
            return lb, False, e_best
        for t in range(r):
            y[t] = (SF[t] + frac * SY[j, t]) / den
        if not np.dot(y, y) > 0.0:
            return lb, False, e_best  # 0 lies in the hull: the relaxation is 0
    cap = r + 3
    Qp = np.zeros((cap, r))
    g = np.zeros((cap, cap))
    wt = np.zeros(cap)
    active = np.empty(cap, dtype=np.int64)
    member = np.zeros(cap, dtype=np.bool_)
    na = 0
    scale = 0.0
    for it in range(BOUND_ITERS + 1):
        if it > 0:
            yy = hull_point(Qp, wt, active, na, y)
            if not yy > 0.0:
                break  # 0 in the hull (to rounding)
        else:
            yy = np.dot(y, y)
        ny = np.sqrt(yy)
        l, ok = _oracle(Y, pw, SF, PF, j, k, y, a, w, buf, idx, q)
        if not ok:
            return 0.0, False, np.inf
        if l / ny > lb:
            lb = l / ny
        for t in range(r):
            y_out[t] = y[t]
        eq = np.sqrt(np.dot(q, q))
        if eq < e_best:
            e_best = eq
            for s_ in range(k):
                best_set[f + s_] = idx[s_]
        if lb >= thr or it == BOUND_ITERS:
            break
        # (thr = inf, no incumbent yet, must not read as 'below BOUND_SMALL of it')
        if it > 0 and (lb >= ny * (1.0 - BOUND_REL_GAP) or (thr < np.inf and ny <= BOUND_SMALL * thr)):
            break  # converged to the gap, or the relaxation is below BOUND_SMALL of the incumbent
        dot = np.dot(y, q)
        if it > 0 and yy - dot <= 1e-12 * yy:
            break  # no descent left (rounding)
        slot = -1
        for u in range(cap):
            if not member[u]:
                slot = u
                break
        if slot < 0:
            break
        for t in range(r):
            Qp[slot, t] = q[t]
        for u in range(na):
            v = np.dot(Qp[active[u]], q)
            g[slot, active[u]] = v
            g[active[u], slot] = v
        g[slot, slot] = np.dot(q, q)
        scale = max(scale, g[slot, slot])
        wt[slot] = 0.0
        active[na] = slot
        member[slot] = True
        na += 1
        if na == 1:
            wt[slot] = 1.0
            continue
        na2, ok2 = gram_minor_cycle(g, scale, wt, active, member, na)
        if not ok2:  # Cholesky broke down (near affine dependence): the coordinates decide
            na2 = minor_cycle(Qp, wt, active, member, na)
        na = na2
        if not member[slot]:
            break
    return max(lb, 0.0), False, e_best


@njit(cache=True)
def bound_search(p: np.ndarray, V: np.ndarray, setup: tuple, s: int, seeds: np.ndarray,
                 node_limit: int) -> tuple[float, float, np.ndarray, int, int]:
    """Best-first branch and bound for a lower bound on ES(s) of one row (module docstring).

    Args:
        p: ``(n,)`` masses summing to 1; V: ``(n, d)`` values; setup: :func:`bound_setup`;
        s: ``1 <= s <= n``; seeds: int64 ``(m, s)`` candidate sets (local indices, ``-1``
        rows ignored); node_limit: node evaluations (the root counts as one).

    Returns:
        ``(es_lb, es_ub, kept, status, nodes)``: the certified lower bound, the best error
        found (exact recomputation; ``<=`` every seed's), its set (sorted local indices),
        ``STATUS_CLOSED`` (``es_lb = es_ub (1 - CERT_REL_TOL)``) or ``STATUS_LIMIT``, nodes used.
    """
    mu, order, Y, pw, SY, SP = setup
    n, r = Y.shape
    inc = np.inf
    best = np.sort(order[:s].copy())
    for m in range(seeds.shape[0]):
        if seeds[m, 0] < 0:
            continue
        c0 = np.sort(seeds[m].copy())
        e0 = forced_error_exact(p, V, mu, c0)
        if e0 < inc:
            inc = e0
            best = c0
    if not inc < np.inf:
        inc = forced_error_exact(p, V, mu, best)
    cap = node_limit + 3
    key = np.empty(cap)
    rec_F = np.empty((cap, s), dtype=np.int32)
    rec_d = np.empty(cap, dtype=np.int32)
    rec_j = np.empty(cap, dtype=np.int32)
    rec_y = np.empty((cap, r))
    heap = np.empty(cap, dtype=np.int64)
    Fw = np.empty(s, dtype=np.int64)
    y_out = np.empty(r)
    zero = np.zeros(r)
    cand = np.empty(s, dtype=np.int64)
    glob = np.empty(s, dtype=np.int64)
    thr = inc * (1.0 - CERT_REL_TOL)
    size = 0
    used = 0
    nodes = 1
    lb0, exact0, eb0 = node_bound(Y, pw, SY, SP, Fw, 0, 0, s, thr, zero, y_out, cand)
    if eb0 < inc:
        for a_ in range(s):
            glob[a_] = order[cand[a_]]
        cs = np.sort(glob.copy())
        ec = forced_error_exact(p, V, mu, cs)
        if ec < inc:
            inc = ec
            best = cs
            thr = inc * (1.0 - CERT_REL_TOL)
    if not exact0 and lb0 < thr:
        key[0] = lb0
        rec_d[0] = 0
        rec_j[0] = 0
        rec_y[0] = y_out
        size = heap_push(heap, size, key, 0)
        used = 1
    while size > 0:
        top = heap[0]
        if key[top] >= thr:
            break
        if nodes + 2 > node_limit:
            break
        size = heap_pop(heap, size, key)
        d = rec_d[top]
        j = rec_j[top]

        for child in range(2):
            dc = d + 1 if child == 0 else d
            kc = s - dc
            if j + 1 > n - kc:
                continue  # skip j leaves too few keys
            for a_ in range(d):
                Fw[a_] = rec_F[top, a_]
            if child == 0:
                Fw[d] = j
            nodes += 1
            lb, exact, eb = node_bound(Y, pw, SY, SP, Fw, dc, j + 1, kc, thr, rec_y[top], y_out, cand)
            if eb < inc:
                for a_ in range(s):
                    glob[a_] = order[cand[a_]]
                cs = np.sort(glob.copy())
                ec = forced_error_exact(p, V, mu, cs)
                if ec < inc:
                    inc = ec
                    best = cs
                    thr = inc * (1.0 - CERT_REL_TOL)
            if exact or lb >= thr:
                continue  # evaluated exactly (the incumbent holds it) or pruned
            rec_F[used, :dc] = Fw[:dc]
            rec_d[used] = dc
            rec_j[used] = j + 1
            rec_y[used] = y_out
            key[used] = lb
            size = heap_push(heap, size, key, used)
            used += 1
    closed = size == 0 or key[heap[0]] >= thr
    lb = thr if closed else key[heap[0]] * (1.0 - CERT_REL_TOL)
    if lb > thr:
        lb = thr
    if lb < 0.0:
        lb = 0.0
    return lb, inc, best, STATUS_CLOSED if closed else STATUS_LIMIT, nodes


@njit(cache=True, parallel=True)
def batch_bound(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, budgets: np.ndarray,
    seed_sets: np.ndarray, node_limit: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`bound_search` for every (row, budget) of a ragged batch.

    Args:
        seed_sets: int64 ``(m, N, B, smax)`` candidate sets per (row, budget) (sorted local
            indices, ``-1`` padded), as for :func:`evictlab.solve.certify.batch_certify`.

    Returns:
        es_lb ``(N, B)``, es_ub ``(N, B)`` (the best error found), status ``(N, B)`` int64,
        nodes ``(N, B)`` int64.
    """
    N = p_off.shape[0] - 1
    B = budgets.shape[0]
    M = seed_sets.shape[0]
    lb = np.full((N, B), np.nan)
    ub = np.full((N, B), np.nan)
    status = np.full((N, B), STATUS_LIMIT, dtype=np.int64)
    nodes = np.zeros((N, B), dtype=np.int64)
    for r in prange(N):
        lo_ = p_off[r]
        n = p_off[r + 1] - lo_
        V = values[v_start[r]: v_start[r] + n]
        pr = row_normalized(p[lo_: lo_ + n])
        setup = bound_setup(pr, V)
        for b in range(B):
            s = budgets[b]
            seeds = np.empty((M, s), dtype=np.int64)
            for m in range(M):
                for a in range(s):
                    seeds[m, a] = seed_sets[m, r, b, a]
            l, u, _, st, nd = bound_search(pr, V, setup, s, seeds, node_limit)
            lb[r, b] = l
            ub[r, b] = u
            status[r, b] = st
            nodes[r, b] = nd
    return lb, ub, status, nodes
