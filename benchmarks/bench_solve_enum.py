"""Benchmark (not a test): subset evaluations per second per core, Numba kernel vs numpy.

For each pool configuration, random rows with d = 64 are generated; both methods find the
exact minimum of e(A) over every s-subset of the same candidate pool:

* kernel: ``evictlab.solve.kernels`` Gram matrix of the pool + revolving-door enumeration
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
import json
import time
from math import comb

import numba
import numpy as np

from evictlab.solve.kernels import enumerate_min, forced_error_exact, pool_gram
from evictlab.solve.reference import numpy_enumeration

CONFIGS = [  # (s, pool size c): default pool r_m = r_e = 2 -> c = s + 4, plus larger pools
    (4, 8), (8, 12), (16, 20), (32, 36), (8, 24), (12, 24),
]


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
    p0 = rng.dirichlet(np.ones(8))
    V0 = rng.normal(size=(8, d))
    _, b0, _ = enumerate_min(pool_gram(p0, V0, p0 @ V0, np.arange(8)), p0, 4)
    forced_error_exact(p0, V0, p0 @ V0, b0)
    print(f"{'s':>3} {'|C|':>4} {'subsets':>10} {'kernel ev/s/core':>17} {'numpy ev/s/core':>16} {'ratio':>7}")
    for s, c in CONFIGS:
        n = 64
        rows = []
        for _ in range(args.rows):
            p = rng.dirichlet(np.full(n, 0.2))
            V = rng.normal(size=(n, d))
            pool = np.argsort(-p)[:c].astype(np.int64)
            rows.append((p, V, pool))
        m = comb(c, s)
        # kernel: Gram + enumeration (+ exact recomputation of the argmin) per row
        t0 = time.process_time()
        k_vals = []
        for p, V, pool in rows:
            mu = p @ V
            G = pool_gram(p, V, mu, pool)
            _, best, cnt = enumerate_min(G, p[pool].copy(), s)
            k_vals.append(forced_error_exact(p, V, mu, np.sort(pool[best])))
        tk = time.process_time() - t0
        k_rate = m * len(rows) / tk
        # numpy baseline on the first rows
        nr = min(args.numpy_rows, len(rows))
        t0 = time.process_time()
        n_vals = [numpy_enumeration(p, V, pool, s)[0] for p, V, pool in rows[:nr]]
        tn = time.process_time() - t0
        n_rate = m * nr / tn
        for a, b in zip(k_vals, n_vals):
            assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (a, b)
        results.append({"s": s, "pool": c, "subsets_per_row": m, "kernel_evals_per_s_core": k_rate,
                        "numpy_evals_per_s_core": n_rate, "ratio": k_rate / n_rate, "d": d})
        print(f"{s:>3} {c:>4} {m:>10} {k_rate:>17.3e} {n_rate:>16.3e} {k_rate / n_rate:>7.0f}")
    if args.json:
        from evictlab.io import atomic_write_json

        atomic_write_json(args.json, {"benchmark": "solve_enum", "results": results})


if __name__ == "__main__":
    main()
