"""Ranking keys in Numba: the full order and the top k, ties to the larger index.

The one rank rule of the package (the same as :func:`evictlab.core.reference.top_mass_set`):
a larger score first, and among equal scores the larger index first. Small jitted building
blocks with **no validation**, for use inside other Numba code (the core's batch kernels,
the solvers).
"""

from __future__ import annotations

import numpy as np
from numba import njit

@njit(cache=True)
def _before(score: np.ndarray, a: int, b: int) -> bool:
    """True when key ``a`` ranks before key ``b``: larger score, or equal score and larger index."""
    return score[a] > score[b] or (score[a] == score[b] and a > b)


@njit(cache=True)
def _sort_by_rank(score: np.ndarray, idx: np.ndarray) -> None:
    """Sort the key indices ``idx`` in place by rank (``_before``); bottom-up merge sort.

    The order is total (ties broken by index), so any correct sort gives the same result;
    a hand-written one keeps Numba compile time low (no generic argsort / partition).
    """
    m = idx.shape[0]
    buf = np.empty(m, dtype=np.int64)
    width = 1
    src, dst = idx, buf
    while width < m:
        for lo in range(0, m, 2 * width):
            mid = min(lo + width, m)
            hi = min(lo + 2 * width, m)
            i, j, t = lo, mid, lo
            while i < mid and j < hi:
                if _before(score, src[j], src[i]):
                    dst[t] = src[j]
                    j += 1
                else:
                    dst[t] = src[i]
                    i += 1
                t += 1
            while i < mid:
                dst[t] = src[i]
                i += 1
                t += 1
            while j < hi:
                dst[t] = src[j]
                j += 1
                t += 1
        src, dst = dst, src
        width *= 2
    if src is not idx:
        idx[:] = src


@njit(cache=True)
def rank_desc(score: np.ndarray) -> np.ndarray:
    """Indices of ``score`` ``(n,)`` sorted descending, ties to the larger index first. O(n log n)."""
    idx = np.arange(score.shape[0])
    _sort_by_rank(score, idx)
    return idx


@njit(cache=True)
def top_k_desc(score: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` entries of ``rank_desc(score)``, int64 ``(k,)``, in O(n log k).

    A binary heap of size ``k`` keeps the ``k`` best keys seen so far with the worst at the
    root; a key replaces the root when it ranks before it. The survivors are then sorted.
    ``0 <= k <= n``.
    """
    n = score.shape[0]
    k = max(0, min(k, n))
    heap = np.empty(k, dtype=np.int64)
    if k == 0:
        return heap
    size = 0
    for i in range(n):
        if size < k:
            # push: sift up while the parent ranks before the new key (root = worst)
            c = size
            heap[c] = i
            size += 1
            while c > 0:
                parent = (c - 1) // 2
                if _before(score, heap[parent], heap[c]):
                    heap[parent], heap[c] = heap[c], heap[parent]
                    c = parent
                else:
                    break
        elif _before(score, i, heap[0]):
            heap[0] = i
            c = 0
            while True:  # sift down: move the worse child up
                left = 2 * c + 1
                if left >= k:
                    break
                worst = left
                right = left + 1
                if right < k and _before(score, heap[left], heap[right]):
                    worst = right
                if _before(score, heap[c], heap[worst]):
                    heap[c], heap[worst] = heap[worst], heap[c]
                    c = worst
                else:
                    break
    _sort_by_rank(score, heap)
    return heap
