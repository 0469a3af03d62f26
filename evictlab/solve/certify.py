"""Certified global optimum ES(s) over all n keys by branch and bound, with a lower bound always.

For one row with centred, mass-weighted vectors ``x_i = p_i (v_i - mu)``,
``e(A) = ||S_A|| / P(A)`` with ``S_A = sum_{i in A} x_i``. The search fixes keys one at a
time in a static order (decreasing ``||x_i||``: the keys that move ``S_A`` most first;
ties to the larger index), depth-first, "take" before "skip". A node is a chosen set
``F``, a suffix of keys ``j..n-1`` still allowed and ``k = s - |F|`` keys still to choose;
its completions are ``A = F + K``, ``K`` a k-subset of the suffix. Two lower bounds on
``e(A)`` over all completions (proofs in ``docs/solvers.md``, "Certified optimum"):

1. **Axis bound.** In any orthonormal basis ``u_1..u_r`` (the principal axes of the
   ``x_i``; dropping axes only lowers it)

       ||S_A||^2 >= sum_t dist(0, [<u_t,S_F> + lo_t(j,k), <u_t,S_F> + hi_t(j,k)])^2,
       P(A) <= P(F) + (the k largest masses of the suffix),

   ``lo_t``/``hi_t`` the sums of the k smallest / largest ``<u_t, x_i>`` over the suffix
   (suffix tables: O(r) per node).
2. **Direction bound** (a Lagrangian bound that couples direction and mass). For the
   unit vector ``u = S_F / ||S_F||`` and any ``lam >= 0``, ``||S_A|| >= <u, S_A>``, so

       ||S_A|| - lam P(A) >= ||S_F|| - lam P(F) + sum_{i in K} (<u, x_i> - lam p_i)
                         >= ||S_F|| - lam P(F) + (sum of the k smallest such terms) =: phi(lam).

   ``phi(thr) >= 0`` proves ``e(A) >= thr`` for every completion (the pruning test, O(n k)
   with ``<S_F, x_i>`` kept per depth from the Gram matrix); its best ``lam`` (Dinkelbach
   iteration) is the bound's value, used for the open nodes when the search stops.

At ``k = 1`` the node's leaves are evaluated directly (O(1) each from the Gram matrix, an
exact recomputation in the principal coordinates for any leaf that may beat the incumbent).

The incumbent is seeded with the best of the given sets (the pool argmin, and the all-key
search's set when there is one). A node is pruned when a bound reaches
``thr = incumbent * (1 - CERT_REL_TOL)``; when the search ends the result is certified: no
s-subset has ``e(A) < es_cert * (1 - CERT_REL_TOL)`` (the tolerance absorbs rounding in the
bounds). The depth-first phase gets half of ``node_limit``; if it stops there, a
best-first phase continues from its open nodes (smallest bound first, split into "take j"
and "skip j"), which raises the smallest open bound as fast as the bounds allow and may
still finish the proof. If ``node_limit`` is reached the status is "limit" and ``cert_lb``
is the smallest lower bound over the unexplored nodes (both bounds, the larger one per
node), so every row gets an interval ``[cert_lb, es_cert]`` that contains ES(s).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from evictlab.core.kernels import row_normalized, row_weighted_sum
from evictlab.core.ranking import rank_desc
from evictlab.solve.kernels import forced_error_exact

#: Relative tolerance of the certificate (see module docstring).
CERT_REL_TOL = 1e-9
#: Default size limits of the certified solver (documented in docs/solvers.md).
CERT_MAX_N = 256
CERT_MAX_S = 8
CERT_NODE_LIMIT = 20_000_000
#: When the depth-first phase stops at its limit, a best-first phase continues from its
#: open nodes with half the node budget, at most this many nodes (it stores one small
#: record per node: about 40 bytes at s = 8).
BF_MAX_NODES = 1_000_000
#: Safety margin of the direction test, relative to the magnitudes it adds (rounding).
_DIR_MARGIN = 1e-12

STATUS_OPTIMAL = 0
STATUS_LIMIT = 1
STATUS_SKIPPED = 2
STATUS_NAMES = ("optimal", "limit", "skipped")


@njit(cache=True)
def _insert_sorted(buf: np.ndarray, cnt: int, v: float, ascending: bool) -> int:
    """Insert ``v`` into the sorted buffer ``buf[:cnt]`` (capacity ``len(buf)``, the worst
    entry dropped when full); returns the new count."""
    cap = buf.shape[0]
    if cnt == cap:
        last = buf[cap - 1]
        if (ascending and not v < last) or (not ascending and not v > last):
            return cnt
        a = cap - 1
    else:
        a = cnt
        cnt += 1
    while a > 0 and ((ascending and buf[a - 1] > v) or (not ascending and buf[a - 1] < v)):
        buf[a] = buf[a - 1]
        a -= 1
    buf[a] = v
    return cnt


@njit(cache=True)
def _suffix_tables(Y: np.ndarray, pw: np.ndarray, kmax: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Suffix tables for the axis bound: ``lo, hi`` ``(n+1, kmax+1, r)`` and ``pk`` ``(n+1, kmax+1)``.

    ``lo[j, k, t]`` (``hi``) is the sum of the k smallest (largest) ``Y[i, t]``, ``i >= j``,
    summed from the smallest (largest) up; ``pk[j, k]`` the sum of the k largest masses
    ``pw[i]``, ``i >= j``. Entries with ``k > n - j`` are unused (0). Built from ``j = n - 1``
    down, keeping per column the kmax smallest and largest values seen (sorted buffers):
    O(r n kmax^2) instead of a scan of the sorted column per suffix.
    """
    n, r = Y.shape
    lo = np.zeros((n + 1, kmax + 1, r))
    hi = np.zeros((n + 1, kmax + 1, r))
    pk = np.zeros((n + 1, kmax + 1))
    if kmax == 0:
        return lo, hi, pk
    small = np.empty((r, kmax))
    large = np.empty((r, kmax))
    big_p = np.empty(kmax)
    cnt = 0
    for j in range(n - 1, -1, -1):
        c0 = cnt
        cnt = _insert_sorted(big_p, c0, pw[j], False)
        acc = 0.0
        for k in range(cnt):
            acc += big_p[k]
            pk[j, k + 1] = acc
        for t in range(r):
            _insert_sorted(small[t], c0, Y[j, t], True)
            _insert_sorted(large[t], c0, Y[j, t], False)
            a = 0.0
            b = 0.0
            for k in range(cnt):
                a += small[t, k]
                b += large[t, k]
                lo[j, k + 1, t] = a
                hi[j, k + 1, t] = b
    return lo, hi, pk


@njit(cache=True)
def axis_bound(S: np.ndarray, PF: float, j: int, k: int, lo: np.ndarray, hi: np.ndarray,
               pk: np.ndarray) -> float:
    """Axis bound (module docstring, 1) on ``e(F + K)`` over k-subsets ``K`` of the suffix ``j..``.

    ``S``: ``S_F`` in the principal coordinates ``(r,)``; ``PF = P(F)``. ``inf`` when no
    completion has mass (such sets have no forced output).
    """
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
def k_smallest(w: np.ndarray, j: int, k: int, buf: np.ndarray, idx: np.ndarray) -> float:
    """Sum of the k smallest ``w[i]``, ``i >= j`` (their indices into ``idx[:k]``), O((n - j) k)."""
    n = w.shape[0]
    for a in range(k):
        buf[a] = np.inf
        idx[a] = -1
    for i in range(j, n):
        v = w[i]
        if v < buf[k - 1]:
            a = k - 1
            while a > 0 and buf[a - 1] > v:
                buf[a] = buf[a - 1]
                idx[a] = idx[a - 1]
                a -= 1
            buf[a] = v
            idx[a] = i
    tot = 0.0
    for a in range(k):
        tot += buf[a]
    return tot


@njit(cache=True)
def direction_phi(Rrow: np.ndarray, nrm: float, PF: float, pw: np.ndarray, j: int, k: int, lam: float,
                  w: np.ndarray, buf: np.ndarray, idx: np.ndarray) -> float:
    """``phi(lam)`` of the direction bound (module docstring, 2), with ``Rrow[i] = <S_F, x_i>``.

    ``phi(lam) >= 0`` proves ``e(F + K) >= lam`` for every completion. ``w``, ``buf``,
    ``idx``: work arrays ``(n,)``, ``(k,)``, ``(k,)``; ``idx`` receives the minimising K.
    """
    n = Rrow.shape[0]
    for i in range(j, n):
        w[i] = Rrow[i] / nrm - lam * pw[i]
    return nrm - lam * PF + k_smallest(w, j, k, buf, idx)


@njit(cache=True)
def _ratio(Rrow: np.ndarray, nrm: float, PF: float, pw: np.ndarray, idx: np.ndarray, k: int) -> tuple[float, float]:
    """``(N, D)`` of the completion ``idx[:k]``: ``N = ||S_F|| + sum <u, x_i>``, ``D = P(F) + sum p_i``."""
    num = nrm
    den = PF
    for a in range(k):
        num += Rrow[idx[a]] / nrm
        den += pw[idx[a]]
    return num, den


@njit(cache=True)
def direction_bound(Rrow: np.ndarray, nrm: float, PF: float, pw: np.ndarray, j: int, k: int,
                    w: np.ndarray, buf: np.ndarray, idx: np.ndarray) -> float:
    """Value of the direction bound: ``max(0, min_K (||S_F|| + sum_K <u,x_i>) / (P(F) + P(K)))``.

    Dinkelbach's iteration on the ratio (each step one ``phi``); whatever ``lam`` it stops at,
    ``lam + min(phi(lam), 0) / D_min`` is a valid lower bound (``D_min`` = P(F) + the k
    smallest suffix masses), and it equals the minimum when the iteration has converged.
    Returns 0 when a completion can make the projection non-positive, or when some
    completion has no mass bound away from zero.
    """
    n = Rrow.shape[0]
    if nrm <= 0.0:
        return 0.0
    # D_min: the k smallest masses of the suffix
    for i in range(j, n):
        w[i] = pw[i]
    dmin = PF + k_smallest(w, j, k, buf, idx)
    if dmin <= 0.0:
        return 0.0
    direction_phi(Rrow, nrm, PF, pw, j, k, 0.0, w, buf, idx)  # K0: the k smallest <u, x_i>
    num, den = _ratio(Rrow, nrm, PF, pw, idx, k)
    if num <= 0.0:
        return 0.0
    lam = num / den
    phi = direction_phi(Rrow, nrm, PF, pw, j, k, lam, w, buf, idx)
    for _ in range(64):
        if phi >= 0.0:
            break  # lam is the minimum ratio (to rounding)
        num, den = _ratio(Rrow, nrm, PF, pw, idx, k)
        if num <= 0.0:
            return 0.0
        new = num / den
        if not new < lam:
            break  # no progress (rounding): the correction below keeps the bound valid
        lam = new
        phi = direction_phi(Rrow, nrm, PF, pw, j, k, lam, w, buf, idx)
    lb = lam + min(phi, 0.0) / dmin
    return lb if lb > 0.0 else 0.0


@njit(cache=True)
def certify_setup(p: np.ndarray, V: np.ndarray, kmax: int) -> tuple:
    """Per-row data of the search, shared by every budget ``s <= kmax`` of the row.

    Returns ``(mu, order, Y, pw, G, lo, hi, pk)``: keys in search order (decreasing
    ``||x_i||``, ties to the larger index), their principal coordinates ``Y`` ``(n, r)``,
    masses ``pw``, Gram matrix ``G = X X^T`` ``(n, n)`` and the suffix tables for ``k <= kmax``.
    """
    mu, order, X, Y, pw = principal_coordinates(p, V)
    G = X @ X.T
    lo, hi, pk = _suffix_tables(Y, pw, min(kmax, V.shape[0]))
    return mu, order, Y, pw, G, lo, hi, pk


@njit(cache=True)
def principal_coordinates(p: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                                   np.ndarray]:
    """The row in the search order and principal coordinates (shared with ``solve.bound``).

    ``p`` ``(n,)`` masses summing to 1, ``V`` ``(n, d)`` values. Returns
    ``(mu, order, X, Y, pw)``: the dense output ``(d,)``; the search order (decreasing
    ``||x_i||`` for ``x_i = p_i (v_i - mu)``, ties to the larger index); ``X`` ``(n, d)``
    the ``x_i`` in that order; ``Y = X V_r`` ``(n, r)`` their coordinates on the principal
    axes (an orthonormal basis of their span, ``r`` = its dimension, or one zero column when
    every ``x_i = 0``), so ``||sum_A Y_i|| = ||sum_A x_i||``; ``pw`` the masses in that order.
    """
    n, d = V.shape
    mu = row_weighted_sum(p, V)
    X0 = np.empty((n, d))
    nx = np.empty(n)
    for i in range(n):
        acc = 0.0
        for t in range(d):
            x = p[i] * (V[i, t] - mu[t])
            X0[i, t] = x
            acc += x * x
        nx[i] = acc
    order = rank_desc(nx)
    X = np.empty((n, d))
    pw = np.empty(n)
    for a in range(n):
        pw[a] = p[order[a]]
        X[a] = X0[order[a]]
    # Principal axes of the x_i (an orthonormal basis of their span).
    _, sv, vt = np.linalg.svd(X, full_matrices=False)
    r = 0
    for t in range(sv.shape[0]):
        if sv[t] > 0.0:
            r += 1
    if r > 0:
        Y = X @ np.ascontiguousarray(vt[:r].T)
    else:  # every x_i = 0: all errors are 0; one zero coordinate keeps the shapes valid
        Y = np.zeros((n, 1))
    return mu, order, X, Y, pw


@njit(cache=True)
def _node_lb(Sd: np.ndarray, Pd: float, Rrow: np.ndarray, Qd: float, j: int, k: int, pw: np.ndarray,
             lo: np.ndarray, hi: np.ndarray, pk: np.ndarray, w: np.ndarray, buf: np.ndarray,
             idx: np.ndarray) -> float:
    """The node's lower bound: the larger of the axis and the direction bound."""
    b = axis_bound(Sd, Pd, j, k, lo, hi, pk)
    if Qd > 0.0 and b < np.inf:
        b2 = direction_bound(Rrow, np.sqrt(Qd), Pd, pw, j, k, w, buf, idx)
        if b2 > b:
            b = b2
    return b


@njit(cache=True)
def _less(key: np.ndarray, a: int, b: int) -> bool:
    """Heap order: smaller bound first, then the earlier record (deterministic)."""
    return key[a] < key[b] or (key[a] == key[b] and a < b)


@njit(cache=True)
def heap_push(heap: np.ndarray, size: int, key: np.ndarray, slot: int) -> int:
    """Push record ``slot`` onto the binary min-heap ``heap[:size]``; returns the new size."""
    i = size
    heap[i] = slot
    while i > 0:
        par = (i - 1) // 2
        if _less(key, heap[i], heap[par]):
            heap[par], heap[i] = heap[i], heap[par]
            i = par
        else:
            break
    return size + 1


@njit(cache=True)
def heap_pop(heap: np.ndarray, size: int, key: np.ndarray) -> int:
    """Remove the minimum ``heap[0]``; returns the new size."""
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        left = 2 * i + 1
        m = i
        if left < size and _less(key, heap[left], heap[m]):
            m = left
        if left + 1 < size and _less(key, heap[left + 1], heap[m]):
            m = left + 1
        if m == i:
            break
        heap[m], heap[i] = heap[i], heap[m]
        i = m
    return size


@njit(cache=True)
def _state(F: np.ndarray, d: int, Y: np.ndarray, pw: np.ndarray, G: np.ndarray,
           S: np.ndarray, R: np.ndarray) -> tuple[float, float]:
    """``S = S_F`` (principal coordinates), ``R = <S_F, x_i>``; returns ``(P(F), ||S_F||^2)``.

    Summed over ``F[:d]`` in order, as the depth-first phase accumulates them.
    """
    S[:] = 0.0
    R[:] = 0.0
    P = 0.0
    for a in range(d):
        f = F[a]
        P += pw[f]
        for t in range(S.shape[0]):
            S[t] += Y[f, t]
        for i in range(R.shape[0]):
            R[i] += G[f, i]
    q = 0.0
    for t in range(S.shape[0]):
        q += S[t] * S[t]
    return P, q


@njit(cache=True)
def _best_first(setup: tuple, s: int, front_F: np.ndarray, front_d: np.ndarray, front_j: np.ndarray,
                inc: float, budget: int) -> tuple[float, np.ndarray, bool, float, bool, int]:
    """Best-first continuation of the search from the open nodes ``(F, j)`` of the depth-first phase.

    The open node of smallest bound is expanded first: a node with one key to choose has
    its leaves evaluated; any other node is split into "take j" ``(F + {j}, j + 1)`` and
    "skip j" ``(F, j + 1)``, each child kept if its bound (:func:`_node_lb`) is below the
    threshold. Stops when the smallest open bound reaches the threshold (the search is
    then complete) or when the next expansion would exceed ``budget`` nodes. Because the
    smallest open bound is expanded first, the returned lower bound rises as fast as the
    bounds allow: this is what gives a row that stops at its limit a useful ``cert_lb``.

    Returns:
        ``(inc, cand, found, lb, closed, nodes)``: incumbent error (coordinates), the last
        improving leaf (local indices, unsorted) and whether there was one, the lower bound
        ``min(thr, smallest open bound)``, whether no open node is left, nodes used.
    """
    mu, order, Y, pw, G, lo, hi, pk = setup
    n = pw.shape[0]
    r = Y.shape[1]
    m0 = front_d.shape[0]
    cap = m0 + budget + 2
    key = np.empty(cap)
    rec_F = np.empty((cap, s), dtype=np.int32)
    rec_d = np.empty(cap, dtype=np.int32)
    rec_j = np.empty(cap, dtype=np.int32)
    heap = np.empty(cap, dtype=np.int64)
    size = 0
    used = 0
    S = np.empty(r)
    R = np.empty(n)
    Sc = np.empty(r)
    Rc = np.empty(n)
    w = np.empty(n)
    buf = np.empty(s)
    idx = np.empty(s, dtype=np.int64)
    cand = np.empty(s, dtype=np.int64)
    found = False
    thr = inc * (1.0 - CERT_REL_TOL)
    nodes = 0
    for u in range(m0):
        d = front_d[u]
        P, q = _state(front_F[u], d, Y, pw, G, S, R)
        # the open nodes' bounds are the final bound's (not counted, as in the
        # depth-first phase's closing step: at most s + 1 evaluations)
        b = _node_lb(S, P, R, q, front_j[u], s - d, pw, lo, hi, pk, w, buf, idx)
        if b < thr:
            rec_F[used, :d] = front_F[u, :d]
            rec_d[used] = d
            rec_j[used] = front_j[u]
            key[used] = b
            size = heap_push(heap, size, key, used)
            used += 1
    while size > 0:
        top = heap[0]
        if key[top] >= thr:
            break
        d = rec_d[top]
        j = rec_j[top]
        k = s - d
        if nodes + (n - j if k == 1 else 2) > budget:
            break
        size = heap_pop(heap, size, key)
        P, q = _state(rec_F[top], d, Y, pw, G, S, R)
        if k == 1:
            for i in range(j, n):
                nodes += 1
                Pn = P + pw[i]
                if Pn <= 0.0:
                    continue
                qq = 0.0
                for t in range(r):
                    z = S[t] + Y[i, t]
                    qq += z * z
                e = np.sqrt(qq) / Pn
                if e < inc:
                    inc = e
                    thr = inc * (1.0 - CERT_REL_TOL)
                    for a in range(d):
                        cand[a] = order[rec_F[top, a]]
                    cand[d] = order[i]
                    found = True
            continue
        for child in range(2):
            dc = d + 1 if child == 0 else d
            kc = s - dc
            if j + 1 > n - kc:
                continue
            if child == 0:
                Pc = P + pw[j]
                for t in range(r):
                    Sc[t] = S[t] + Y[j, t]
                for i in range(n):
                    Rc[i] = R[i] + G[j, i]
                qc = 0.0
                for t in range(r):
                    qc += Sc[t] * Sc[t]
                b = _node_lb(Sc, Pc, Rc, qc, j + 1, kc, pw, lo, hi, pk, w, buf, idx)
            else:
                b = _node_lb(S, P, R, q, j + 1, kc, pw, lo, hi, pk, w, buf, idx)
            nodes += 1
            if b < thr:
                rec_F[used, :d] = rec_F[top, :d]
                if child == 0:
                    rec_F[used, d] = j
                rec_d[used] = dc
                rec_j[used] = j + 1
                key[used] = b
                size = heap_push(heap, size, key, used)
                used += 1
    closed = size == 0 or key[heap[0]] >= thr
    lb = thr if closed else key[heap[0]]
    return inc, cand, found, lb, closed, nodes


@njit(cache=True)
def certify_search(p: np.ndarray, V: np.ndarray, setup: tuple, s: int, seeds: np.ndarray,
                   node_limit: int) -> tuple[float, np.ndarray, int, float, int]:
    """Branch and bound for ES(s) of one row (module docstring), from :func:`certify_setup`.

    Args:
        p: ``(n,)`` masses summing to 1; V: ``(n, d)`` values; s: ``1 <= s <= min(n, kmax)``.
        seeds: int64 ``(m, s)`` candidate incumbents (local indices; ``-1`` rows ignored).
        node_limit: maximal number of node evaluations (bound evaluations plus leaves).

    Returns:
        ``(es_cert, kept, status, lb, nodes)``: the best error found (exact recomputation),
        its set (sorted local indices), ``STATUS_OPTIMAL`` or ``STATUS_LIMIT``, a certified
        lower bound on ES(s) (``es_cert * (1 - CERT_REL_TOL)`` when optimal), nodes used.
    """
    mu, order, Y, pw, G, lo, hi, pk = setup
    n = pw.shape[0]
    r = Y.shape[1]
    inc = np.inf
    best_set = np.arange(s)
    for m in range(seeds.shape[0]):
        if seeds[m, 0] < 0:
            continue
        cand0 = np.sort(seeds[m].copy())
        e0 = forced_error_exact(p, V, mu, cand0)
        if e0 < inc:
            inc = e0
            best_set = cand0
    if not inc < np.inf:
        # no usable seed: T_s in search order is always a set with mass when p is a simplex
        best_set = np.sort(rank_desc(p)[:s].copy())
        inc = forced_error_exact(p, V, mu, best_set)
    # Depth-first search with explicit stacks: chosen[depth], next candidate nxt[depth],
    # partial sums per depth (coordinates Sd, mass Pd, <S_F, x_i> for all i in Rd, Qd = ||S_F||^2),
    # each level copying its parent's (no add/subtract drift).
    chosen = np.empty(s, dtype=np.int64)
    nxt = np.zeros(s + 1, dtype=np.int64)
    Sd = np.zeros((s + 1, r))
    Pd = np.zeros(s + 1)
    Rd = np.zeros((s + 1, n))
    Qd = np.zeros(s + 1)
    sumx = np.zeros(s + 1)  # sum of ||x_f|| over F (scale of the rounding in Rd)
    w = np.empty(n)
    buf = np.empty(s)
    idx = np.empty(s, dtype=np.int64)
    xmax = 0.0
    for i in range(n):
        xmax = max(xmax, np.sqrt(G[i, i]))
    thr = inc * (1.0 - CERT_REL_TOL)
    dfs_limit = node_limit - min(node_limit // 2, BF_MAX_NODES)
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
        if k == 1:
            # The leaves F + {i}, i >= j: O(1) each, exact coordinates only for candidates.
            thr2 = thr * thr
            for i in range(j, n):
                if nodes >= dfs_limit:
                    nxt[depth] = i
                    limit_hit = True
                    break
                nodes += 1
                P = Pd[depth] + pw[i]
                if P <= 0.0:
                    continue
                q = Qd[depth] + 2.0 * Rd[depth, i] + G[i, i]
                # Gram-form prefilter; the slack covers its rounding, exact coordinates decide.
                if q - thr2 * P * P > 1e-6 * thr2 * P * P + 1e-12 * (Qd[depth] + 2.0 * abs(Rd[depth, i]) + G[i, i]):
                    continue
                qq = 0.0
                for t in range(r):
                    z = Sd[depth, t] + Y[i, t]
                    qq += z * z
                e = np.sqrt(qq) / P
                if e < inc:
                    inc = e
                    thr = inc * (1.0 - CERT_REL_TOL)
                    thr2 = thr * thr
                    for a in range(depth):
                        cand[a] = order[chosen[a]]
                    cand[depth] = order[i]
                    found = True
            if limit_hit:
                break
            depth -= 1
            if depth >= 0:
                nxt[depth] = chosen[depth] + 1
            continue
        if nodes >= dfs_limit:
            limit_hit = True
            break
        nodes += 1
        prune = axis_bound(Sd[depth], Pd[depth], j, k, lo, hi, pk) >= thr
        if not prune and Qd[depth] > 0.0:
            nrm = np.sqrt(Qd[depth])
            phi = direction_phi(Rd[depth], nrm, Pd[depth], pw, j, k, thr, w, buf, idx)
            margin = _DIR_MARGIN * (nrm + thr * (Pd[depth] + k) + k * xmax * (1.0 + sumx[depth] / nrm))
            prune = phi >= margin
        if prune:
            # No completion from this suffix can beat the incumbent: close the level.
            depth -= 1
            if depth >= 0:
                nxt[depth] = chosen[depth] + 1
            continue
        chosen[depth] = j
        for t in range(r):
            Sd[depth + 1, t] = Sd[depth, t] + Y[j, t]
        Pd[depth + 1] = Pd[depth] + pw[j]
        for i in range(n):
            Rd[depth + 1, i] = Rd[depth, i] + G[j, i]
        qq = 0.0
        for t in range(r):
            qq += Sd[depth + 1, t] * Sd[depth + 1, t]
        Qd[depth + 1] = qq
        sumx[depth + 1] = sumx[depth] + np.sqrt(G[j, j])
        depth += 1
        nxt[depth] = j + 1
    lb = thr
    if limit_hit:
        # The open nodes: level u still has to try the suffix from nxt[u] (the level where
        # the search stopped) or chosen[u] + 1 (the levels above it). The best-first phase
        # continues from them with the rest of the budget.
        front_F = np.zeros((depth + 1, s), dtype=np.int64)
        front_d = np.zeros(depth + 1, dtype=np.int64)
        front_j = np.zeros(depth + 1, dtype=np.int64)
        m = 0
        for u in range(depth + 1):
            ju = nxt[u] if u == depth else chosen[u] + 1
            if ju <= n - (s - u):
                front_F[m, :u] = chosen[:u]
                front_d[m] = u
                front_j[m] = ju
                m += 1
        inc2, cand2, found2, lb, closed, nd = _best_first(
            (mu, order, Y, pw, G, lo, hi, pk), s, front_F[:m], front_d[:m], front_j[:m], inc,
            node_limit - nodes)
        nodes += nd
        limit_hit = not closed
        if found2:
            found = True
            cand = cand2
            inc = inc2
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


@njit(cache=True)
def certify_row(p: np.ndarray, V: np.ndarray, s: int, inc_set: np.ndarray,
                node_limit: int) -> tuple[float, np.ndarray, int, float, int]:
    """:func:`certify_search` for one (row, s) with one seed set ``inc_set`` ``(s,)``."""
    setup = certify_setup(p, V, s)
    seeds = np.empty((1, s), dtype=np.int64)
    seeds[0] = inc_set
    return certify_search(p, V, setup, s, seeds, node_limit)


@njit(cache=True, parallel=True)
def batch_certify(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, budgets: np.ndarray,
    seed_sets: np.ndarray, max_n: int, max_s: int, node_limit: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Certified ES(s) for every (row, budget) of a ragged batch; rows/budgets beyond the limits skipped.

    Args:
        seed_sets: int64 ``(m, N, B, smax)``: ``m`` candidate incumbents per (row, budget)
            (the pool argmin, and the all-key search's set when there is one), sorted local
            indices, ``-1`` padded; the best one (exact error) seeds the search.
        max_n, max_s: size limits; larger rows/budgets get ``STATUS_SKIPPED`` and NaN values.

    Returns:
        es_cert ``(N, B)``, kept_cert ``(N, B, smax)`` (``-1`` padded), status ``(N, B)`` int64,
        cert_lb ``(N, B)``, nodes ``(N, B)`` int64.
    """
    N = p_off.shape[0] - 1
    B = budgets.shape[0]
    M = seed_sets.shape[0]
    smax = seed_sets.shape[3]
    es = np.full((N, B), np.nan)
    kept = np.full((N, B, smax), -1, dtype=np.int64)
    status = np.full((N, B), STATUS_SKIPPED, dtype=np.int64)
    lb = np.full((N, B), np.nan)
    nodes = np.zeros((N, B), dtype=np.int64)
    kmax = 0
    for b in range(B):
        if budgets[b] <= max_s:
            kmax = max(kmax, budgets[b])
    for r in prange(N):
        lo_ = p_off[r]
        n = p_off[r + 1] - lo_
        if n > max_n or kmax == 0:
            continue
        V = values[v_start[r] : v_start[r] + n]
        pr = row_normalized(p[lo_ : lo_ + n])
        setup = certify_setup(pr, V, kmax)
        for b in range(B):
            s = budgets[b]
            if s > max_s:
                continue
            seeds = np.empty((M, s), dtype=np.int64)
            for m in range(M):
                for a in range(s):
                    seeds[m, a] = seed_sets[m, r, b, a]
            e, ks, st, l, nd = certify_search(pr, V, setup, s, seeds, node_limit)
            es[r, b] = e
            kept[r, b, :s] = ks
            status[r, b] = st
            lb[r, b] = l
            nodes[r, b] = nd
    return es, kept, status, lb, nodes
