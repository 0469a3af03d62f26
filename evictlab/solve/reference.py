"""Plain-numpy / itertools references for the solvers (obviously correct, one row, slow).

The Numba kernels in :mod:`evictlab.solve.kernels` and :mod:`evictlab.solve.certify` are
tested against these. The single-row definitions come from :mod:`evictlab.core.reference`
(``forced_error``, ``top_mass_set``, ``candidate_pool``); they are re-exported here.
"""

from __future__ import annotations

import itertools

import numpy as np

from evictlab.core.reference import candidate_pool, forced_error, top_mass_set

__all__ = [
    "candidate_pool", "forced_error", "top_mass_set", "pool_bruteforce", "all_keys_bruteforce",
    "balance_reference", "numpy_enumeration", "swap_search_reference", "local_search_reference",
]


def pool_bruteforce(p: np.ndarray, values: np.ndarray, pool: np.ndarray, s: int) -> tuple[float, np.ndarray]:
    """``min e(A)`` over every s-subset of ``pool`` by ``itertools.combinations``.

    Returns ``(value, argmin)``; the argmin is int64 ``(s,)`` sorted (first in
    lexicographic order among exact ties).
    """
    best, arg = np.inf, None
    for A in itertools.combinations(sorted(int(i) for i in pool), s):
        e = forced_error(p, values, list(A))
        if e < best:
            best, arg = e, A
    return float(best), np.asarray(arg if arg is not None else sorted(pool)[:s], dtype=np.int64)


def all_keys_bruteforce(p: np.ndarray, values: np.ndarray, s: int) -> tuple[float, np.ndarray]:
    """``ES(s)``: ``min e(A)`` over every s-subset of all n keys (tiny n only)."""
    return pool_bruteforce(p, values, np.arange(p.shape[0]), s)


def balance_reference(p: np.ndarray, values: np.ndarray, s: int, r_m: int, r_e: int,
                      max_swaps: int) -> tuple[float, np.ndarray, int]:
    """Balancing selector (ours) written directly from its definition.

    Start at ``T_s``; evaluate every single swap within the pool with
    :func:`forced_error`; apply the best one if it lowers ``e(A)``; at most ``max_swaps``.
    Returns ``(e(A), A sorted, swaps applied)``.
    """
    pool = [int(i) for i in candidate_pool(p, values, s, r_m, r_e)]
    A = [int(i) for i in top_mass_set(p, s)]
    cur = forced_error(p, values, A)
    swaps = 0
    while swaps < max_swaps:
        best, move = cur, None
        for o in A:
            for i in pool:
                if i in A:
                    continue
                B = [a for a in A if a != o] + [i]
                e = forced_error(p, values, B)
                if e < best:
                    best, move = e, B
        if move is None or not best < cur * (1 - 1e-13):
            break
        A, cur = move, best
        swaps += 1
    return float(cur), np.asarray(sorted(A), dtype=np.int64), swaps


def numpy_enumeration(p: np.ndarray, values: np.ndarray, pool: np.ndarray, s: int,
                      chunk: int = 65536) -> tuple[float, np.ndarray]:
    """A straightforward vectorised-numpy enumeration (the benchmark baseline).

    ``itertools.combinations`` -> stacked index arrays ``(M, s)`` in chunks -> errors of all
    subsets at once: ``||sum_A p_i (v_i - mu)|| / P(A)``. Returns ``(min, argmin sorted)``.
    """
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    V = np.asarray(values, dtype=np.float64)
    mu = p @ V
    pool = np.asarray(sorted(int(i) for i in pool), dtype=np.int64)
    X = p[pool, None] * (V[pool] - mu[None, :])  # (c, d)
    pw = p[pool]
    best, arg = np.inf, None
    it = itertools.combinations(range(pool.shape[0]), s)
    while True:
        idx = np.fromiter(itertools.chain.from_iterable(itertools.islice(it, chunk)),
                          dtype=np.int64)
        if idx.size == 0:
            break
        idx = idx.reshape(-1, s)
        num = np.linalg.norm(X[idx].sum(axis=1), axis=1)
        den = pw[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.inf)
        j = int(np.argmin(e))
        if e[j] < best:
            best, arg = float(e[j]), pool[idx[j]]
    return best, np.sort(np.asarray(arg, dtype=np.int64))


# --------------------------------------------------------------------------- all-key search

_M64 = (1 << 64) - 1


def splitmix64_reference(state: int) -> tuple[int, int]:
    """SplitMix64 in Python integers: ``(new_state, output)`` (as ``localsearch.splitmix64``)."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


def ls_seed_reference(seed: int, row_id: int, s: int) -> int:
    """The random state of one (row, s) (as ``localsearch.ls_seed``)."""
    _, a = splitmix64_reference(seed)
    _, b = splitmix64_reference(a ^ row_id)
    _, c = splitmix64_reference(b ^ s)
    return c


def _e2(p: np.ndarray, values: np.ndarray, A: list[int]) -> float:
    """``e(A)^2`` from the definition (``inf`` when ``P(A) = 0``)."""
    e = forced_error(p, values, A)
    return e * e


def single_swaps(A: list[int], n: int) -> list[tuple[int, int, list[int]]]:
    """Every single swap of the set ``A`` (member positions) among keys ``0..n-1``:
    ``(position a, key i not in A, A with A[a] replaced by i)``, in (a, i) order."""
    out = []
    for a in range(len(A)):
        for i in range(n):
            if i in A:
                continue
            B = list(A)
            B[a] = i
            out.append((a, i, B))
    return out


def swap_search_reference(p: np.ndarray, values: np.ndarray, start: list[int] | np.ndarray,
                          n_pair: int, n_short: int, max_moves: int = 1000,
                          rel_tol: float = 1e-13) -> tuple[list[int], int, list[int]]:
    """Best-improvement single/pair-swap search from ``start``, every neighbour from the definition.

    The algorithm of :func:`evictlab.solve.localsearch.local_search`, written out:
    while a single swap (member position a, non-member i; first in (a, i) order among
    ties) lowers ``e^2`` below ``e(A)^2 (1 - rel_tol)``, apply the best one; then rank the
    non-members by ``bestval_i`` = the smallest ``e^2`` of a single swap bringing i in
    (ties: smaller i), and if some pair swap of two members for two of the first
    ``n_pair`` ranked keys beats the same bound, apply the best one (first in
    (a1, a2, l1, l2) order) and start over. Swaps to sets with zero mass are never taken.

    Returns ``(A in member-position order, moves, the first max(n_short, n_pair) ranked keys)``.
    """
    n = p.shape[0]
    A = [int(i) for i in start]
    s = len(A)
    moves = 0
    if s == n:
        return A, 0, []

    def neighbours() -> list[tuple[int, int, list[int]]]:
        """Every single swap with mass: (position a, key i, the swapped set), in (a, i) order."""
        return [(a, i, B) for a, i, B in single_swaps(A, n) if p[B].sum() > 0]

    while True:
        cur = _e2(p, values, A)
        bound = cur * (1.0 - rel_tol) if np.isfinite(cur) else 1e300
        if moves < max_moves:
            best, move = bound, None
            for a, i, B in neighbours():
                v = _e2(p, values, B)
                if v < best:
                    best, move = v, (a, i)
            if move is not None:
                A[move[0]] = move[1]
                moves += 1
                continue
        bestval: dict[int, float] = {}
        for _, i, B in neighbours():
            bestval[i] = min(bestval.get(i, np.inf), _e2(p, values, B))
        short = sorted(bestval, key=lambda i: (bestval[i], i))[: max(n_short, n_pair)]
        if moves >= max_moves or n_pair < 2 or s < 2 or len(short) < 2:
            return A, moves, short
        best, move = bound, None
        cand = short[:n_pair]
        for a1 in range(s):
            for a2 in range(a1 + 1, s):
                for l1 in range(len(cand)):
                    for l2 in range(l1 + 1, len(cand)):
                        B = A.copy()
                        B[a1], B[a2] = cand[l1], cand[l2]
                        if p[B].sum() <= 0:
                            continue
                        v = _e2(p, values, B)
                        if v < best:
                            best, move = v, (a1, a2, cand[l1], cand[l2])
        if move is None:
            return A, moves, short
        A[move[0]], A[move[1]] = move[2], move[3]
        moves += 1


def local_search_reference(p: np.ndarray, values: np.ndarray, starts: list[np.ndarray], es_hat: float,
                           n_pair: int, kicks: int, seed: int, row_id: int,
                           max_moves: int = 1000) -> tuple[float, np.ndarray, int]:
    """All-key search of one (row, s) (``evictlab.solve.localsearch.search_row``) from the definition.

    ``starts`` = [T_s, pool argmin (exact error ``es_hat``), balancing set], each sorted; a
    start equal to an earlier one is skipped. Then ``kicks`` rounds: from the best local
    optimum, ``m = max(2, s // 4)`` random member positions (partial Fisher-Yates over
    0..s-1) get ``m`` random keys of the first ``2m + 8`` of its ranked keys (partial
    Fisher-Yates), random numbers from SplitMix64 seeded by ``(seed, row_id, s)``.
    Returns ``(es_ls, kept sorted, moves)``: the smallest exact error among the pool argmin
    and every local optimum (ties keep the earlier).
    """
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    values = np.asarray(values, dtype=np.float64)
    s = len(starts[0])
    m0 = max(2, s // 4)
    n_short = max(n_pair, 2 * m0 + 8) if kicks > 0 else n_pair
    best_e, best = es_hat, sorted(int(i) for i in starts[1])
    loc_e, loc, loc_short = np.inf, best, []
    moves = 0
    state = ls_seed_reference(seed, row_id, s)
    runs: list[list[int]] = []
    seen: list[list[int]] = []
    for st_ in starts:
        st_l = sorted(int(i) for i in st_)
        if st_l not in seen:
            seen.append(st_l)
            runs.append(st_l)
    k = 0
    while k < len(runs) + kicks:
        if k < len(runs):
            start = runs[k]
        else:
            if not loc_short:
                break
            cand = list(loc_short[: 2 * m0 + 8])
            m = min(m0, s, len(cand))
            pos = list(range(s))
            start = list(loc)
            for u in range(m):
                state, z = splitmix64_reference(state)
                r = z % (s - u)
                pos[u], pos[u + r] = pos[u + r], pos[u]
            for u in range(m):
                state, z = splitmix64_reference(state)
                r = z % (len(cand) - u)
                cand[u], cand[u + r] = cand[u + r], cand[u]
                start[pos[u]] = cand[u]
        k += 1
        A, mv, short = swap_search_reference(p, values, start, n_pair, n_short, max_moves)
        moves += mv
        As = sorted(A)
        e = forced_error(p, values, As)
        if e < loc_e:
            loc_e, loc, loc_short = e, As, short
        if e < best_e:
            best_e, best = e, As
    return float(best_e), np.asarray(best, dtype=np.int64), moves
