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
