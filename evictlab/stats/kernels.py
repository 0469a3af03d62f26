"""Numba kernels for bootstrap statistics from count matrices (the fast path of evictlab.stats.bootstrap).

Each kernel takes a replicate-by-observation count matrix ``counts`` (int32 ``(b, n)``: how
often each observation is in replicate r) and the observations' columns in value order,
and fills ``out`` (float64 ``(b,)``) with one statistic per replicate, in one pass over
each replicate without building the resample. The plain-numpy versions
(``Median.replicates_reference``, ``AUC.replicates_reference`` in
:mod:`evictlab.stats.bootstrap`) compute the same numbers and the tests compare them.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def median_from_counts(counts: np.ndarray, cols: np.ndarray, sorted_vals: np.ndarray, out: np.ndarray) -> None:
    """Median of each replicate: the mean of its order statistics floor((N-1)/2) and floor(N/2).

    ``cols`` int64 ``(m,)``: count columns in ascending value order; ``sorted_vals`` float64
    ``(m,)`` the values in that order. A replicate with no observation gets NaN.
    """
    b, m = counts.shape[0], cols.shape[0]
    for r in range(b):
        tot = 0
        for j in range(m):
            tot += counts[r, cols[j]]
        if tot == 0:
            out[r] = np.nan
            continue
        k1, k2 = (tot - 1) // 2, tot // 2
        acc = 0
        v1 = np.nan
        for j in range(m):
            acc += counts[r, cols[j]]
            if acc > k1 and v1 != v1:
                v1 = sorted_vals[j]
            if acc > k2:
                out[r] = 0.5 * (v1 + sorted_vals[j])
                break


@njit(cache=True)
def auc_from_counts(counts: np.ndarray, cols: np.ndarray, positive: np.ndarray, level: np.ndarray,
                    out: np.ndarray) -> None:
    """Mann-Whitney AUC of each replicate (ties one half); NaN when a class is absent.

    ``cols`` int64 ``(m,)``: count columns in ascending score order; ``positive`` bool
    ``(m,)`` their labels; ``level`` int64 ``(m,)`` their tie level (non-decreasing).
    """
    b, m = counts.shape[0], cols.shape[0]
    for r in range(b):
        num = 0.0
        below = 0.0
        P = 0.0
        j = 0
        while j < m:
            pos_l = 0.0
            neg_l = 0.0
            lev = level[j]
            while j < m and level[j] == lev:
                c = counts[r, cols[j]]
                if positive[j]:
                    pos_l += c
                else:
                    neg_l += c
                j += 1
            num += pos_l * (below + 0.5 * neg_l)
            below += neg_l
            P += pos_l
        out[r] = num / (P * below) if P > 0 and below > 0 else np.nan


@njit(cache=True)
def _next(state: np.ndarray) -> np.uint64:
    """xorshift64* step on ``state[0]`` (uint64); returns the scrambled output."""
    x = state[0]
    x ^= x >> np.uint64(12)
    x ^= x << np.uint64(25)
    x ^= x >> np.uint64(27)
    state[0] = x
    return x * np.uint64(2685821657736338717)


@njit(cache=True)
def _below(state: np.ndarray, w: np.int64) -> np.int64:
    """Uniform integer in [0, w), w < 2^32, without bias (Lemire's multiply-and-reject on the
    high 32 bits of :func:`_next`)."""
    ww = np.uint64(w)
    m = (_next(state) >> np.uint64(32)) * ww
    low = m & np.uint64(0xFFFFFFFF)
    if low < ww:
        t = (np.uint64(0x100000000) - ww) % ww
        while low < t:
            m = (_next(state) >> np.uint64(32)) * ww
            low = m & np.uint64(0xFFFFFFFF)
    return np.int64(m >> np.uint64(32))


@njit(cache=True)
def resample_counts_kernel(first: np.ndarray, n_child: np.ndarray, depth_off: np.ndarray, order: np.ndarray,
                           whole: np.ndarray, seed: np.int64, out: np.ndarray) -> None:
    """Fill ``out`` (int32 ``(b, n)``, zeroed) with ``b`` replicates of a nested design.

    The design is a tree stored depth by depth: the nodes of depth d are
    ``depth_off[d] .. depth_off[d+1] - 1`` in the flat arrays; node j has ``n_child[j]``
    children, the children's indices (within depth d+1) starting at ``first[j]``. Depth 0
    is the root; the children of the last depth are observations, ``order`` maps them to
    count columns. Each drawn node draws ``n_child`` of its children uniformly with
    replacement (the recursion of :func:`evictlab.stats.bootstrap.resample_counts`, whose
    numpy version is the reference), except at a depth d with ``whole[d]`` (bool, one per
    depth), where every node takes each of its children once (strata at the top, whole
    clusters at the bottom), drawing nothing. Draws: xorshift64* seeded by ``seed`` with
    Lemire's unbiased range reduction (same seed, same counts, on every machine).
    """
    state = np.empty(1, np.uint64)
    state[0] = np.uint64(seed) | np.uint64(1)
    for _ in range(4):  # decorrelate nearby seeds
        _next(state)
    depths = depth_off.shape[0] - 1
    b = out.shape[0]
    cap = max(16, out.shape[1])
    cur = np.empty(cap, np.int64)
    nxt = np.empty(cap, np.int64)
    for r in range(b):
        cur[0] = 0
        m = 1
        for d in range(depths):
            base = depth_off[d]
            need = 0
            for i in range(m):
                need += n_child[base + cur[i]]
            last = d == depths - 1
            if not last and need > nxt.shape[0]:
                nxt = np.empty(2 * need, np.int64)
            k = 0
            for i in range(m):
                node = base + cur[i]
                w = n_child[node]
                f = first[node]
                for c in range(w):
                    child = f + c if whole[d] else f + _below(state, w)
                    if last:
                        out[r, order[child]] += 1
                    else:
                        nxt[k] = child
                        k += 1
            if not last:
                if cur.shape[0] < nxt.shape[0]:
                    cur = np.empty(nxt.shape[0], np.int64)
                cur, nxt = nxt, cur
                m = k
