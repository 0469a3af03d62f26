"""All-key local search for ES(s): single and pair swaps over all n keys, from three starts.

The pool optimum ES_hat only looks at ``s + r_m + r_e`` keys. This module searches the
s-subsets of **all** n keys of a row with a best-improvement local search
(``docs/solvers.md``, "All-key search"), so its result ES_ls is an upper bound on ES(s) that
is never above ES_hat (the pool argmin is one of the starts, and a move is applied only when
it lowers the error).

Notation (one row, as in :mod:`evictlab.solve.kernels`): normalised masses ``p``, values
``v_i``, dense output ``mu``, ``x_i = p_i (v_i - mu)``, ``e(A) = ||S_A|| / P(A)`` with
``S_A = sum_{i in A} x_i``. The search keeps, for the current set ``A`` (members at
positions ``0..s-1``):

* ``GA[a, :] = <x_{A[a]}, x_m>`` for every key m (one Gram row per member, ``(s, n)``);
* ``R_m = <S_A, x_m> = sum_a GA[a, m]``, ``Q = ||S_A||^2 = sum_a R_{A[a]}``, ``P = P(A)``.

Then a single swap (member at position a, key o, out; non-member i in) is evaluated in O(1):

    Q' = Q - 2 R_o + G_oo + 2 R_i + G_ii - 2 G_oi,    P' = P - p_o + p_i,

and a pair swap ``{o1, o2} -> {i1, i2}`` also in O(1) once the Gram entries among the
shortlisted in-keys are known. One scan of all single swaps is O(s n); a Gram row costs
O(n d) and is computed only for keys that enter ``A`` (rows of the start keys are computed
once per row, four at a time, and shared by the starts and budgets of the row through a
small cache). ``R``, ``Q`` and ``P`` are recomputed from the Gram rows after every move
(O(s n), no drift).

Neighbourhoods, in this order at a local optimum of the previous one:

1. single swaps (o in A, i not in A), all ``s (n - s)`` of them; the best one is applied if
   it lowers ``e^2`` below ``e(A)^2 (1 - LS_REL_TOL)``, first in (position, key) order
   among exact ties;
2. pair swaps ``{o1, o2} -> {i1, i2}``: o1, o2 any two members, i1, i2 from the shortlist
   of the ``n_pair`` non-members whose best single swap has the smallest ``e^2`` (ties:
   smaller index first). The shortlist makes the neighbourhood O(s^2 n_pair^2) instead of
   O(s^2 n^2); with ``n_pair >= n - s`` it is the full pair neighbourhood.

Starts: ``T_s``, the pool argmin, the balancing selector's set (a start equal to an earlier
one is skipped). Then ``kicks`` rounds of iterated local search: from the best local
optimum so far, replace ``m = max(2, s // 4)`` random members (at most ``s`` and the
shortlist size) by ``m`` random keys among the ``2m + 8`` first keys of its shortlist, and
search again. The random numbers come from SplitMix64 seeded by ``(seed, row_id, s)``, so a
result is a pure function of (row, s, options, seed): the same for any thread count or
chunking. The reported set is the one of smallest **exactly recomputed** error
(:func:`evictlab.solve.kernels.forced_error_exact`) among the pool argmin and every local
optimum reached (ties keep the earlier one, the pool argmin first), so ``es_ls <= es_hat``
holds on the exact values.

:func:`evictlab.solve.reference.local_search_reference` is the plain-numpy reference
(every neighbour evaluated from the definition); the tests require the same moves and sets.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from evictlab.core.kernels import row_normalized, row_weighted_sum
from evictlab.solve.kernels import forced_error_exact

#: A move is applied only if it lowers e(A)^2 by more than this relative amount, so
#: rounding noise can never make the search cycle (the same rule as the balancing selector).
LS_REL_TOL = 1e-13
#: Safety cap on improving moves per start (each move lowers e strictly, so the search
#: ends anyway; the cap bounds the time of a pathological row).
LS_MAX_MOVES = 1000
#: Extra cached Gram rows per row beyond the start keys (keys that entered by moves).
_CACHE_EXTRA = 64
#: Rows per work-buffer block of the batch driver (buffers are reused within a block).
_BLOCK = 16
#: Relative slack of the division-free pre-test ``q - bound P^2 < 0`` (rounding cannot hide
#: a candidate; the exact comparison ``q / P^2 < bound`` decides).
_FLAG_SLACK = 1e-12
#: Stand-in for an infinite bound (keeps ``bound * P^2`` finite, so no inf - inf = NaN).
_HUGE = 1e300


# --------------------------------------------------------------------------- random numbers


@njit(cache=True)
def splitmix64(state: np.uint64) -> tuple[np.uint64, np.uint64]:
    """One step of SplitMix64: ``(new_state, output)`` (uint64 arithmetic wraps mod 2^64)."""
    state = np.uint64(state) + np.uint64(0x9E3779B97F4A7C15)  # cast: int64 + uint64 is float64
    z = state
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return state, z ^ (z >> np.uint64(31))


@njit(cache=True)
def ls_seed(seed: int, row_id: int, s: int) -> np.uint64:
    """The SplitMix64 state of one (row, s): a hash of ``(seed, row_id, s)`` (each >= 0)."""
    st, a = splitmix64(np.uint64(seed))
    st, b = splitmix64(a ^ np.uint64(row_id))
    st, c = splitmix64(b ^ np.uint64(s))
    return c


@njit(cache=True)
def randbelow(state: np.uint64, m: int) -> tuple[np.uint64, int]:
    """A number in ``[0, m)`` (``m >= 1``): the next output mod m (bias < m / 2^64)."""
    state, z = splitmix64(state)
    return state, int(z % np.uint64(m))


# --------------------------------------------------------------------------- Gram rows


@njit(cache=True)
def centred_rows(p: np.ndarray, V: np.ndarray, mu: np.ndarray, xbuf: np.ndarray,
                 xtbuf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``X`` ``(n, d)`` with ``x_i = p_i (v_i - mu)``, its transpose ``XT`` ``(d, n)`` and ``G_ii``.

    ``X`` and ``XT`` are C-contiguous views into the flat work buffers ``xbuf``, ``xtbuf``
    (at least ``n d`` entries each): the batch driver reuses them across rows, because
    fresh half-megabyte arrays per row cost more in page faults than the arithmetic. The
    transpose is written in 32 x 32 tiles (a column-by-column write would miss the
    cache on every element at d = 64, n = 1000), and ``G_ii`` is summed over coordinates
    in order but vectorised across keys (the same bits as :func:`gram_row`'s diagonal).
    """
    n, d = V.shape
    X = xbuf[: n * d].reshape((n, d))
    for i in range(n):
        for t in range(d):
            X[i, t] = p[i] * (V[i, t] - mu[t])
    XT = xtbuf[: d * n].reshape((d, n))
    for i0 in range(0, n, 32):
        for t0 in range(0, d, 32):
            for t in range(t0, min(d, t0 + 32)):
                for i in range(i0, min(n, i0 + 32)):
                    XT[t, i] = X[i, t]
    g = np.zeros(n)
    for t in range(d):
        for i in range(n):
            g[i] += XT[t, i] * X[i, t]
    return X, XT, g


@njit(cache=True)
def gram_row(XT: np.ndarray, X: np.ndarray, a: int, out: np.ndarray) -> None:
    """``out[m] = <x_a, x_m>`` for every key m, O(n d).

    The loop over coordinates is outside, so the inner loop over keys is contiguous in
    ``XT`` (vectorised) and each entry still sums its d products in coordinate order,
    which makes ``G_am`` bit-identical to ``G_ma`` and to ``G_mm`` of :func:`centred_rows`.
    """
    d, n = XT.shape
    for m in range(n):
        out[m] = 0.0
    for t in range(d):
        xa = X[a, t]
        for m in range(n):
            out[m] += XT[t, m] * xa


@njit(cache=True)
def gram_rows4(XT: np.ndarray, X: np.ndarray, keys: np.ndarray, out: np.ndarray) -> None:
    """Gram rows of four keys at once into ``out`` ``(4, n)``: each entry is summed in the
    same coordinate order as :func:`gram_row` (identical bits), but every ``XT`` entry is
    loaded once for the four rows (about twice as fast as four single rows)."""
    d, n = XT.shape
    for m in range(n):
        out[0, m] = 0.0
        out[1, m] = 0.0
        out[2, m] = 0.0
        out[3, m] = 0.0
    for t in range(d):
        x0 = X[keys[0], t]
        x1 = X[keys[1], t]
        x2 = X[keys[2], t]
        x3 = X[keys[3], t]
        for m in range(n):
            v = XT[t, m]
            out[0, m] += v * x0
            out[1, m] += v * x1
            out[2, m] += v * x2
            out[3, m] += v * x3


@njit(cache=True)
def _prefill(XT: np.ndarray, X: np.ndarray, keys: np.ndarray, slot_of: np.ndarray,
             cache: np.ndarray, used: np.ndarray) -> None:
    """Cache the Gram rows of ``keys`` (distinct, not yet cached), four at a time."""
    k = min(keys.shape[0], cache.shape[0] - used[0])
    blk = np.empty((4, X.shape[0]))
    four = np.empty(4, dtype=np.int64)
    for u0 in range(0, k, 4):
        m = min(4, k - u0)
        for u in range(4):
            four[u] = keys[u0 + min(u, m - 1)]
        gram_rows4(XT, X, four, blk)
        for u in range(m):
            sl = used[0]
            used[0] += 1
            slot_of[keys[u0 + u]] = sl
            cache[sl] = blk[u]


@njit(cache=True)
def _fetch_row(XT: np.ndarray, X: np.ndarray, key: int, out: np.ndarray,
               slot_of: np.ndarray, cache: np.ndarray, used: np.ndarray) -> None:
    """Gram row of ``key`` into ``out``: copied from the row cache, or computed (and cached if room)."""
    sl = slot_of[key]
    if sl >= 0:
        out[:] = cache[sl]
        return
    gram_row(XT, X, key, out)
    if used[0] < cache.shape[0]:
        sl = used[0]
        used[0] += 1
        slot_of[key] = sl
        cache[sl] = out


@njit(cache=True)
def _dot(X: np.ndarray, a: int, b: int) -> float:
    """``<x_a, x_b>`` summed in coordinate order (the same bits as :func:`gram_row`)."""
    acc = 0.0
    for t in range(X.shape[1]):
        acc += X[b, t] * X[a, t]
    return acc


# --------------------------------------------------------------------------- scans


@njit(cache=True)
def _sums(GA: np.ndarray, A: np.ndarray, pw: np.ndarray, R: np.ndarray) -> tuple[float, float]:
    """Recompute ``R = sum_a GA[a]``, ``Q = sum_a R[A[a]]`` (clamped at 0) and ``P`` (fixed order)."""
    s, n = GA.shape
    R[:] = 0.0
    for a in range(s):
        for m in range(n):
            R[m] += GA[a, m]
    Q = 0.0
    P = 0.0
    for a in range(s):
        Q += R[A[a]]
        P += pw[A[a]]
    return max(Q, 0.0), P


@njit(cache=True)
def _swap_terms(inA: np.ndarray, R: np.ndarray, g: np.ndarray, c: np.ndarray) -> None:
    """``c[i] = 2 R_i + G_ii`` for non-members, ``inf`` for members (they cannot come in)."""
    for i in range(c.shape[0]):
        c[i] = np.inf if inA[i] else 2.0 * R[i] + g[i]


@njit(cache=True, inline="always")
def _swap_e2(base_q: float, base_p: float, ci: float, gi: float, pi: float) -> float:
    """``e^2`` of one single swap: ``q / P^2`` with ``q = base_q + c_i - 2 G_oi`` (clamped at 0)
    and ``P = base_p + p_i``; ``inf`` when the swapped set has no mass."""
    Pn = base_p + pi
    if Pn <= 0.0:
        return np.inf
    q = base_q + (ci - 2.0 * gi)
    q = q if q > 0.0 else 0.0
    return q / (Pn * Pn)


@njit(cache=True)
def _flag_row(base_q: float, base_p: float, c: np.ndarray, row: np.ndarray, pw: np.ndarray, lim: float,
              tmp: np.ndarray) -> int:
    """Division-free pre-test of one member's swaps: ``tmp[i] = q_i - lim P_i^2`` for every key
    (``q_i``, ``P_i``: the swapped set's ``||S||^2`` and mass); returns how many are negative.

    Branch-free, so it vectorises (a count does; a min reduction would not).
    """
    flagged = 0
    for i in range(row.shape[0]):
        Pn = base_p + pw[i]
        t = (base_q + (c[i] - 2.0 * row[i])) - lim * (Pn * Pn)
        tmp[i] = t
        flagged += 1 if t < 0.0 else 0
    return flagged


@njit(cache=True)
def _single_scan(GA: np.ndarray, A: np.ndarray, R: np.ndarray, g: np.ndarray, pw: np.ndarray,
                 Q: float, P: float, bound: float, c: np.ndarray, tmp: np.ndarray) -> tuple[float, int, int]:
    """Best single swap with ``e^2 < bound``: ``(e2, position, key)``, or ``(bound, -1, -1)``.

    ``c`` from :func:`_swap_terms`; ``tmp`` an ``(n,)`` work array. For each member the
    branch-free, division-free test ``q_i - best P_i^2 < 0`` (vectorised, with a relative
    slack of :data:`_FLAG_SLACK`) flags the keys that may beat the best so far; only flagged
    keys get the exact comparison ``q_i / P_i^2 < best``, in (position, key) order, so
    among exact ties the first swap wins.
    """
    s, n = GA.shape
    best = bound
    ba = -1
    bi = -1
    for a in range(s):
        o = A[a]
        base_q = Q - 2.0 * R[o] + g[o]
        base_p = P - pw[o]
        row = GA[a]
        if _flag_row(base_q, base_p, c, row, pw, best * (1.0 + _FLAG_SLACK), tmp) == 0:
            continue
        for i in range(n):
            if tmp[i] < 0.0:
                e2 = _swap_e2(base_q, base_p, c[i], row[i], pw[i])
                if e2 < best:
                    best = e2
                    ba = a
                    bi = i
    return best, ba, bi


@njit(cache=True)
def _before(v1: float, k1: int, v2: float, k2: int) -> bool:
    """Shortlist order: smaller value first, then smaller key."""
    return v1 < v2 or (v1 == v2 and k1 < k2)


@njit(cache=True)
def _shortlist_scan(GA: np.ndarray, A: np.ndarray, R: np.ndarray, g: np.ndarray, pw: np.ndarray,
                    Q: float, P: float, c: np.ndarray, L: int, tmp: np.ndarray) -> np.ndarray:
    """The ``L`` non-members of smallest ``bestval_i`` (ties: smaller key first), in that order.

    ``bestval_i`` = the smallest ``e^2`` over the single swaps that bring non-member i in
    (swaps to a zero-mass set excluded; a key with none is never listed). A buffer holds
    the L best partial minima (``where`` maps keys into it); once full, the flag test of
    :func:`_single_scan` against the L-th value skips most of every later member's row.
    """
    s, n = GA.shape
    val = np.full(L, np.inf)
    key = np.full(L, -1, dtype=np.int64)
    where = np.full(n, -1, dtype=np.int64)
    cnt = 0
    if L == 0:
        return key[:0].copy()
    for a in range(s):
        o = A[a]
        base_q = Q - 2.0 * R[o] + g[o]
        base_p = P - pw[o]
        row = GA[a]
        full = cnt == L  # fixed for the row: tmp is filled only for rows that start full
        if full:
            if _flag_row(base_q, base_p, c, row, pw, val[L - 1] * (1.0 + _FLAG_SLACK), tmp) == 0:
                continue
        for i in range(n):
            if full and not tmp[i] < 0.0:
                continue
            if c[i] == np.inf:
                continue
            e2 = _swap_e2(base_q, base_p, c[i], row[i], pw[i])
            if e2 == np.inf:
                continue  # no mass
            pos = where[i]
            if pos >= 0:
                if not e2 < val[pos]:
                    continue
            elif cnt < L:
                pos = cnt
                cnt += 1
            elif _before(e2, i, val[L - 1], key[L - 1]):
                pos = L - 1
                where[key[pos]] = -1
            else:
                continue
            val[pos] = e2
            key[pos] = i
            where[i] = pos
            while pos > 0 and _before(val[pos], key[pos], val[pos - 1], key[pos - 1]):
                val[pos], val[pos - 1] = val[pos - 1], val[pos]
                key[pos], key[pos - 1] = key[pos - 1], key[pos]
                where[key[pos]] = pos
                where[key[pos - 1]] = pos - 1
                pos -= 1
    return key[:cnt].copy()


@njit(cache=True)
def _pair_scan(GA: np.ndarray, A: np.ndarray, R: np.ndarray, g: np.ndarray, pw: np.ndarray,
               X: np.ndarray, Q: float, P: float, short: np.ndarray,
               bound: float) -> tuple[float, int, int, int, int]:
    """Best pair swap ``{A[a1], A[a2]} -> {short[l1], short[l2]}`` with ``e^2 < bound``.

    Returns ``(e2, a1, a2, i1, i2)``, or ``(bound, -1, -1, -1, -1)``; among exact ties the
    smallest ``(a1, a2, l1, l2)`` wins (``a1 < a2`` positions, ``l1 < l2`` shortlist order).
    With ``o1 = A[a1]``, ``o2 = A[a2]``, ``i1 = short[l1]``, ``i2 = short[l2]``:

        Q' = BQ[a1, a2] + c_l1 + c_l2 - 2 (GS[a1, l1] + GS[a1, l2]) - 2 W[a2] + 2 G_i1i2,
        BQ[a1, a2] = Q - 2 (R_o1 + R_o2) + G_o1o1 + G_o2o2 + 2 G_o1o2,
        c_l = 2 R_i + G_ii,  GS[a, l] = G_{A[a] short[l]},  W[a] = GS[a, l1] + GS[a, l2],
        P' = BP[a1, a2] + p_i1 + p_i2,  BP[a1, a2] = P - p_o1 - p_o2,

    so for each (l1, l2, a1) the candidates a2 > a1 form one contiguous, vectorised loop with
    the division-free flag test of :func:`_single_scan`.
    """
    s = GA.shape[0]
    L = short.shape[0]
    GS = np.empty((s, L))
    cl = np.empty(L)
    pl = np.empty(L)
    for l in range(L):
        i = short[l]
        cl[l] = 2.0 * R[i] + g[i]
        pl[l] = pw[i]
        for a in range(s):
            GS[a, l] = GA[a, i]
    BQ = np.empty((s, s))
    BP = np.empty((s, s))
    for a1 in range(s):
        o1 = A[a1]
        for a2 in range(s):
            o2 = A[a2]
            BQ[a1, a2] = Q - 2.0 * (R[o1] + R[o2]) + (g[o1] + g[o2] + 2.0 * GA[a1, o2])
            BP[a1, a2] = P - pw[o1] - pw[o2]
    W = np.empty(s)
    tmp = np.empty(s)
    best = bound
    best_key = (s, s, L, L)
    for l1 in range(L):
        for l2 in range(l1 + 1, L):
            h = 2.0 * _dot(X, short[l1], short[l2])
            cc = cl[l1] + cl[l2] + h
            pp = pl[l1] + pl[l2]
            for a in range(s):
                W[a] = GS[a, l1] + GS[a, l2]
            for a1 in range(s - 1):
                k1 = cc - 2.0 * W[a1]
                lim = best * (1.0 + _FLAG_SLACK)
                flagged = 0
                for a2 in range(a1 + 1, s):
                    Pn = BP[a1, a2] + pp
                    t = (BQ[a1, a2] + k1 - 2.0 * W[a2]) - lim * (Pn * Pn)
                    tmp[a2] = t
                    flagged += 1 if t < 0.0 else 0
                if flagged == 0:
                    continue
                for a2 in range(a1 + 1, s):
                    if tmp[a2] < 0.0:
                        Pn = BP[a1, a2] + pp
                        if Pn <= 0.0:
                            continue
                        q = BQ[a1, a2] + k1 - 2.0 * W[a2]
                        q = q if q > 0.0 else 0.0
                        e2 = q / (Pn * Pn)
                        key = (a1, a2, l1, l2)
                        if e2 < best or (e2 == best and key < best_key):
                            best = e2
                            best_key = key
    if best_key[0] == s:
        return bound, -1, -1, -1, -1
    return best, best_key[0], best_key[1], short[best_key[2]], short[best_key[3]]


# --------------------------------------------------------------------------- one search


@njit(cache=True)
def local_search(X: np.ndarray, XT: np.ndarray, g: np.ndarray, pw: np.ndarray, start: np.ndarray,
                 n_pair: int, n_short: int, max_moves: int, slot_of: np.ndarray, cache: np.ndarray,
                 used: np.ndarray, gabuf: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """Best-improvement single/pair-swap search from ``start`` (module docstring).

    Args:
        X, XT, g: :func:`centred_rows` of the row; pw: ``(n,)`` normalised masses.
        start: int64 ``(s,)`` distinct keys (member positions follow this order).
        n_pair: shortlist size of the pair neighbourhood (< 2: single swaps only).
        n_short: length of the shortlist returned (``>= n_pair``; the kicks draw from it).
        max_moves: cap on applied moves; slot_of/cache/used: the row's Gram-row cache.
        gabuf: flat work buffer of at least ``s n`` entries (the members' Gram rows).

    Returns:
        ``(A, moves, short)``: the final set in member-position order (not sorted), the
        number of applied moves (a pair swap counts as one), and the final set's shortlist
        (:func:`_shortlist_scan`, up to ``n_short`` keys; empty when ``s = n``).
    """
    n = pw.shape[0]
    s = start.shape[0]
    A = start.copy()
    inA = np.zeros(n, dtype=np.bool_)
    GA = gabuf[: s * n].reshape((s, n))
    for a in range(s):
        inA[A[a]] = True
        _fetch_row(XT, X, A[a], GA[a], slot_of, cache, used)
    R = np.empty(n)
    c = np.empty(n)
    tmp = np.empty(n)
    moves = 0
    if s == n:
        return A, 0, np.empty(0, dtype=np.int64)
    while True:
        Q, P = _sums(GA, A, pw, R)
        cur = Q / (P * P) if P > 0.0 else np.inf
        bound = cur * (1.0 - LS_REL_TOL) if cur < np.inf else _HUGE
        _swap_terms(inA, R, g, c)
        if moves < max_moves:
            best, ba, bi = _single_scan(GA, A, R, g, pw, Q, P, bound, c, tmp)
            if ba >= 0:
                inA[A[ba]] = False
                A[ba] = bi
                inA[bi] = True
                _fetch_row(XT, X, bi, GA[ba], slot_of, cache, used)
                moves += 1
                continue
        short = _shortlist_scan(GA, A, R, g, pw, Q, P, c, max(n_short, n_pair), tmp)
        if moves >= max_moves or n_pair < 2 or s < 2 or short.shape[0] < 2:
            return A, moves, short
        best2, a1, a2, i1, i2 = _pair_scan(GA, A, R, g, pw, X, Q, P, short[:n_pair], bound)
        if a1 < 0:
            return A, moves, short
        inA[A[a1]] = False
        inA[A[a2]] = False
        A[a1] = i1
        A[a2] = i2
        inA[i1] = True
        inA[i2] = True
        _fetch_row(XT, X, i1, GA[a1], slot_of, cache, used)
        _fetch_row(XT, X, i2, GA[a2], slot_of, cache, used)
        moves += 1


@njit(cache=True)
def kick_size(s: int) -> int:
    """Members replaced by a kick: ``max(2, s // 4)`` (before the caps)."""
    return max(2, s // 4)


@njit(cache=True)
def kick(A: np.ndarray, short: np.ndarray, state: np.uint64) -> tuple[np.ndarray, np.uint64]:
    """Perturb the sorted set ``A``: ``m = kick_size(s)`` random members (capped at ``s`` and
    the candidates) replaced by random keys among the first ``2m + 8`` of ``short``
    (partial Fisher-Yates on both sides, members first, SplitMix64)."""
    s = A.shape[0]
    m0 = kick_size(s)
    cand = short[: min(short.shape[0], 2 * m0 + 8)].copy()
    m = min(m0, s, cand.shape[0])
    out = A.copy()
    pos = np.arange(s)
    for u in range(m):
        state, r = randbelow(state, s - u)
        pos[u], pos[u + r] = pos[u + r], pos[u]
    for u in range(m):
        state, r = randbelow(state, cand.shape[0] - u)
        cand[u], cand[u + r] = cand[u + r], cand[u]
        out[pos[u]] = cand[u]
    return out, state


@njit(cache=True)
def _same_set(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two sorted int arrays are equal."""
    for u in range(a.shape[0]):
        if a[u] != b[u]:
            return False
    return True


@njit(cache=True)
def search_row(pr: np.ndarray, V: np.ndarray, mu: np.ndarray, X: np.ndarray, XT: np.ndarray,
               g: np.ndarray, starts: np.ndarray, es_hat: float, n_pair: int, kicks: int,
               state: np.uint64, slot_of: np.ndarray, cache: np.ndarray,
               used: np.ndarray, gabuf: np.ndarray) -> tuple[float, np.ndarray, int]:
    """All-key search of one (row, s) from the sorted start sets ``starts`` ``(m, s)``.

    ``starts[1]`` must be the pool argmin, whose exact error is ``es_hat``; the result is the
    smallest exact error among it and every local optimum (module docstring).

    Returns:
        ``(es_ls, kept_ls, moves)``: exact error, sorted local indices ``(s,)``, moves applied
        over all starts and kicks.
    """
    m, s = starts.shape
    n_short = n_pair
    if kicks > 0:
        n_short = max(n_pair, 2 * kick_size(s) + 8)
    best_e = es_hat
    best = starts[1].copy()
    loc_e = np.inf  # best local optimum (its shortlist drives the kicks)
    loc = starts[1].copy()
    loc_short = np.empty(0, dtype=np.int64)
    moves = 0
    for k in range(m + kicks):
        if k < m:
            dup = False
            for w in range(k):
                if _same_set(starts[k], starts[w]):
                    dup = True
            if dup:
                continue
            start = starts[k]
        else:
            if loc_short.shape[0] == 0:
                break
            start, state = kick(loc, loc_short, state)
        A, mv, short = local_search(X, XT, g, pr, start, n_pair, n_short, LS_MAX_MOVES,
                                    slot_of, cache, used, gabuf)
        moves += mv
        As = np.sort(A)
        e = forced_error_exact(pr, V, mu, As)
        if e < loc_e:
            loc_e = e
            loc = As
            loc_short = short
        if e < best_e:
            best_e = e
            best = As
    return best_e, best, moves


# --------------------------------------------------------------------------- batch driver


@njit(cache=True, parallel=True)
def batch_localsearch(
    p: np.ndarray, p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, budgets: np.ndarray,
    row_ids: np.ndarray, kept_top: np.ndarray, kept_opt: np.ndarray, kept_bal: np.ndarray,
    es_hat: np.ndarray, todo: np.ndarray, n_pair: int, kicks: int, seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All-key search for every (row, budget) of a ragged batch with ``todo[r, b]`` set.

    Args:
        p, p_off, values, v_start: the ragged batch (masses divided by their sum, as in
            :func:`evictlab.solve.kernels.batch_solve`).
        budgets: int64 ``(B,)``; row_ids: int64 ``(N,)`` global row ids (seed the kicks).
        kept_top, kept_opt, kept_bal: int64 ``(N, B, smax)`` sorted start sets (``-1`` padded)
            from ``batch_solve``: T_s, the pool argmin, the balancing set.
        es_hat: ``(N, B)`` exact error of ``kept_opt``; todo: bool ``(N, B)``.
        n_pair, kicks, seed: see the module docstring (``seed >= 0``).

    Returns:
        es_ls ``(N, B)`` (NaN where not todo), kept_ls ``(N, B, smax)`` (``-1`` padded),
        moves ``(N, B)`` int64.
    """
    N = p_off.shape[0] - 1
    B = budgets.shape[0]
    smax = kept_opt.shape[2]
    es = np.full((N, B), np.nan)
    kept = np.full((N, B, smax), -1, dtype=np.int64)
    moves = np.zeros((N, B), dtype=np.int64)
    d = values.shape[1]
    smax_todo = 0
    for b in range(B):
        smax_todo = max(smax_todo, budgets[b])
    n_blocks = (N + _BLOCK - 1) // _BLOCK
    for blk in prange(n_blocks):
        r0 = blk * _BLOCK
        r1 = min(N, r0 + _BLOCK)
        # Work buffers shared by the rows of this block (sized for its longest row).
        nmax = 0
        capmax = 0
        for r in range(r0, r1):
            nmax = max(nmax, p_off[r + 1] - p_off[r])
            cap = 0
            for b in range(B):
                if todo[r, b]:
                    cap += 3 * budgets[b]
            capmax = max(capmax, min(p_off[r + 1] - p_off[r], cap + _CACHE_EXTRA))
        xbuf = np.empty(nmax * d)
        xtbuf = np.empty(nmax * d)
        cbuf = np.empty(capmax * nmax)
        gabuf = np.empty(smax_todo * nmax)
        for r in range(r0, r1):
            cap = 0
            for b in range(B):
                if todo[r, b]:
                    cap += 3 * budgets[b]
            if cap == 0:
                continue
            lo = p_off[r]
            n = p_off[r + 1] - lo
            V = values[v_start[r] : v_start[r] + n]
            pr = row_normalized(p[lo : lo + n])
            mu = row_weighted_sum(pr, V)
            X, XT, g = centred_rows(pr, V, mu, xbuf, xtbuf)
            # Row cache of Gram rows: the start keys of every budget (computed up front, four
            # at a time), plus room for keys that enter by moves.
            cap = min(n, cap + _CACHE_EXTRA)
            slot_of = np.full(n, -1, dtype=np.int64)
            cache = cbuf[: cap * n].reshape((cap, n))
            used = np.zeros(1, dtype=np.int64)
            seen = np.zeros(n, dtype=np.bool_)
            first = np.empty(cap, dtype=np.int64)
            nf = 0
            for b in range(B):
                if todo[r, b]:
                    for a in range(budgets[b]):
                        for kk in (kept_top[r, b, a], kept_opt[r, b, a], kept_bal[r, b, a]):
                            if not seen[kk] and nf < cap:
                                seen[kk] = True
                                first[nf] = kk
                                nf += 1
            _prefill(XT, X, first[:nf], slot_of, cache, used)
            for b in range(B):
                if not todo[r, b]:
                    continue
                s = budgets[b]
                starts = np.empty((3, s), dtype=np.int64)
                for a in range(s):
                    starts[0, a] = kept_top[r, b, a]
                    starts[1, a] = kept_opt[r, b, a]
                    starts[2, a] = kept_bal[r, b, a]
                e, ks, mv = search_row(pr, V, mu, X, XT, g, starts, es_hat[r, b], n_pair, kicks,
                                       ls_seed(seed, row_ids[r], s), slot_of, cache, used, gabuf)
                es[r, b] = e
                kept[r, b, :s] = ks
                moves[r, b] = mv
    return es, kept, moves
