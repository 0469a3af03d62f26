"""Benchmark (not a test): subset evaluations per second per core, Numba kernel vs numpy.

For each pool configuration, random rows with d = 64 are generated; both methods find the
exact minimum of e(A) over every s-subset of the same candidate pool:

* kernel: ``evictlab.solve.kernels`` Gram matrix of the pool + bounded enumeration
  (``pool_gram`` + ``enumerate_min``), one thread;
* numpy: ``evictlab.solve.reference.numpy_enumeration`` (itertools.combinations -> stacked
  index arrays -> vectorised errors in chunks of 65,536 subsets).

Per-core speed is measured in CPU seconds of this process (``time.process_time``), so other
jobs on a shared machine slow the wall clock but not the per-core number much (cache and
memory-bandwidth contention still do). Both methods run in the same process and their
minima are checked to agree.

    .venv/bin/python benchmarks/bench_solve_enum.py [--rows 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import time
from math import comb

import numba
import numpy as np

from numba import njit

from evictlab.solve.kernels import enumerate_min, forced_error_exact, pool_gram
from evictlab.solve.reference import numpy_enumeration

CONFIGS = [  # (s, pool size c): default pool r_m = r_e = 2 -> c = s + 4, plus larger pools
    (4, 8), (8, 12), (16, 20), (32, 36), (8, 24), (12, 24),
]


@njit(cache=True)
def _kernel_rows(P: np.ndarray, Vs: np.ndarray, pools: np.ndarray, s: int) -> np.ndarray:
    """Kernel path for R rows (the row loop inside Numba, as in ``batch_solve``).

    ``P`` ``(R, n)``, ``Vs`` ``(R, n, d)``, ``pools`` ``(R, c)``; returns ES_hat ``(R,)``,
    each recomputed exactly from the values.
    """
    R = P.shape[0]
    out = np.empty(R)
    for r in range(R):
        p = P[r]
        V = Vs[r]
        pool = pools[r]
        mu = p @ V
        G = pool_gram(p, V, mu, pool)
        pw = np.empty(pool.shape[0])
        for a in range(pool.shape[0]):
            pw[a] = p[pool[a]]
        _, best, _ = enumerate_min(G, pw, s)
        kept = np.empty(s, dtype=np.int64)
        for a in range(s):
            kept[a] = pool[best[a]]
        out[r] = forced_error_exact(p, V, mu, np.sort(kept))
    return out


@njit(cache=True)
def _grams(P: np.ndarray, Vs: np.ndarray, pools: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool Gram matrices ``(R, c, c)`` and pool masses ``(R, c)`` (untimed setup)."""
    R, c = pools.shape
    Gs = np.empty((R, c, c))
    PW = np.empty((R, c))
    for r in range(R):
        mu = P[r] @ Vs[r]
        Gs[r] = pool_gram(P[r], Vs[r], mu, pools[r])
        for a in range(c):
            PW[r, a] = P[r, pools[r, a]]
    return Gs, PW


@njit(cache=True)
def _enum_only(Gs: np.ndarray, PW: np.ndarray, s: int) -> float:
    """Enumeration alone (Gram precomputed): the bounded enumeration's own speed."""
    acc = 0.0
    for r in range(Gs.shape[0]):
        e2, _, _ = enumerate_min(Gs[r], PW[r], s)
        acc += e2
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20, help="rows per configuration (kernel)")
    ap.add_argument("--numpy-rows", type=int, default=3, help="rows per configuration (numpy)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--json", type=str, default=None, help="write the results here")
    args = ap.parse_args()
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    d = args.dim
    results = []
    # compile once outside the timings
    _kernel_rows(rng.dirichlet(np.ones(8))[None, :], rng.normal(size=(1, 8, d)),
                 np.arange(8, dtype=np.int64)[None, :], 4)
    g0, w0 = _grams(rng.dirichlet(np.ones(8))[None, :], rng.normal(size=(1, 8, d)),
                    np.arange(8, dtype=np.int64)[None, :])
    _enum_only(g0, w0, 4)
    print(f"{'s':>3} {'|C|':>4} {'subsets':>10} {'kernel ev/s/core':>17} {'enum-only ev/s':>15} "
          f"{'numpy ev/s/core':>16} {'ratio':>7}")
    for s, c in CONFIGS:
        n = 2 * c  # the pool is the top c of n keys
        m = comb(c, s)
        rows = []
        # enough rows for ~2e6 kernel evaluations (timer resolution), at most 5,000
        for _ in range(max(args.rows, min(5000, -(-2_000_000 // m)))):
            p = rng.dirichlet(np.full(n, 0.2))
            V = rng.normal(size=(n, d))
            pool = np.argsort(-p)[:c].astype(np.int64)
            rows.append((p, V, pool))
        P = np.stack([r[0] for r in rows])
        Vs = np.stack([r[1] for r in rows])
        pools = np.stack([r[2] for r in rows])
        # kernel: Gram + enumeration + exact recomputation of the argmin, per row
        t0 = time.process_time()
        k_vals = _kernel_rows(P, Vs, pools, s)
        tk = time.process_time() - t0
        k_rate = m * len(rows) / tk
        Gs, PW = _grams(P, Vs, pools)
        t0 = time.process_time()
        _enum_only(Gs, PW, s)
        e_rate = m * len(rows) / (time.process_time() - t0)
        # numpy baseline on the first rows
        nr = min(args.numpy_rows, len(rows))
        t0 = time.process_time()
        n_vals = [numpy_enumeration(p, V, pool, s)[0] for p, V, pool in rows[:nr]]
        tn = time.process_time() - t0
        n_rate = m * nr / tn
        for a, b in zip(k_vals, n_vals):
            assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (a, b)
        results.append({"s": s, "pool": c, "subsets_per_row": m, "kernel_evals_per_s_core": k_rate,
                        "enum_only_evals_per_s_core": e_rate, "numpy_evals_per_s_core": n_rate, "ratio": k_rate / n_rate, "d": d})
        print(f"{s:>3} {c:>4} {m:>10} {k_rate:>17.3e} {e_rate:>15.3e} {n_rate:>16.3e} "
              f"{k_rate / n_rate:>7.0f}")
    if args.json:
        from evictlab.io import atomic_write_json

        atomic_write_json(args.json, {"benchmark": "solve_enum", "results": results})


if __name__ == "__main__":
    main()
