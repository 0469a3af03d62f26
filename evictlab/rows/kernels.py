"""Numba kernels that recompute attention weights ``p`` from what a shard stores.

* :func:`query_p_py`: query rows, ``p = softmax(scale * q . K[lo:hi]^T)``;
* :func:`logits_p_py`: logits rows, ``p = softmax(logits)``.

Both compute each row on its own in float64 with a fixed summation order (no BLAS), so a
row's ``p`` has the same bits whatever batch it is read in. They are plain Python (the
reference) compiled on first use by :func:`compiled` (cached on disk).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def query_p_py(Kt: np.ndarray, Q: np.ndarray, scale: np.ndarray, lo: np.ndarray,
                hi: np.ndarray, out: np.ndarray, out_off: np.ndarray) -> int:  # pragma: no cover
    """p of query rows reading one block, written into ``out``; returns -1 or a bad row.

    ``Kt``: float64 ``[d, W]`` (the block's keys, transposed, columns c0..c0+W);
    ``Q``: float32 ``[r, d]``; ``scale``: float64 ``[r]``; ``lo``, ``hi``: int64 ``[r]``
    relative to c0; row i's weights go to ``out[out_off[i] : out_off[i] + hi[i] - lo[i]]``.
    Each row is computed on its own, summing over d in a fixed order (no BLAS, no
    reassociation), so a row's p has the same bits whatever batch it is read in.
    """
    d = Kt.shape[0]
    for i in range(Q.shape[0]):
        a = lo[i]
        m = hi[i] - a
        o = out_off[i]
        z = np.zeros(m)
        for k in range(d):
            qk = np.float64(Q[i, k])
            kr = Kt[k, a : a + m]  # a slice keeps the inner loop free of index arithmetic (SIMD)
            for j in range(m):
                z[j] += qk * kr[j]
        mx = -np.inf
        for j in range(m):
            z[j] *= scale[i]
            if not np.isfinite(z[j]):
                return i
            if z[j] > mx:
                mx = z[j]
        tot = 0.0
        for j in range(m):
            z[j] = np.exp(z[j] - mx)
            tot += z[j]
        for j in range(m):
            out[o + j] = z[j] / tot
    return -1


def logits_p_py(x: np.ndarray, starts: np.ndarray, n: np.ndarray, out: np.ndarray,
                 out_off: np.ndarray) -> int:  # pragma: no cover (numba-compiled)
    """p = softmax of stored logits ``x[starts[i] : starts[i] + n[i]]`` (float32/64) into
    ``out[out_off[i]:...]``, float64, one row at a time; returns -1 or the first bad row."""
    for i in range(n.shape[0]):
        a = starts[i]
        o = out_off[i]
        mx = -np.inf
        for j in range(n[i]):
            v = np.float64(x[a + j])
            if not np.isfinite(v):
                return i
            if v > mx:
                mx = v
        tot = 0.0
        for j in range(n[i]):
            e = np.exp(np.float64(x[a + j]) - mx)
            out[o + j] = e
            tot += e
        for j in range(n[i]):
            out[o + j] /= tot
    return -1


_COMPILED: dict[str, Any] = {}


def compiled(name: str) -> Any:
    """The numba-compiled kernel ``name`` (compiled on first use, cached on disk)."""
    if name not in _COMPILED:
        import numba

        fn = {"query": query_p_py, "logits": logits_p_py}[name]
        _COMPILED[name] = numba.njit(cache=True, nogil=True)(fn)
    return _COMPILED[name]
