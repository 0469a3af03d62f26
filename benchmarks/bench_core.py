"""Benchmark: Numba batch kernels vs a Python loop over the numpy reference, same run.

Builds a seeded ragged batch shaped like captured rows (rows of one value block see causal
prefixes of it, so ``n`` varies per row and values are shared through ``v_start``), times
every ``evictlab.core.kernels.batch_*`` function (best of ``--repeat`` after a warm-up
call, so Numba compile / cache load is excluded) and the equivalent loop over
``evictlab.core.reference`` (once), checks they agree, and prints one line per kernel with
the speed ratio. ``--out FILE.json`` also writes the table (and a run record beside it).

    .venv/bin/python benchmarks/bench_core.py --rows 400 --n-max 1024 --dim 64 --s 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import numpy as np


def make_batch(rows: int, n_max: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ragged batch ``(p, p_off, values, v_start)``: 8 value blocks of ``n_max`` keys, rows
    read causal prefixes of length ``n ~ U[n_max/8, n_max]``; masses are a softmax of
    Gaussian logits (scale 2) with a sink at key 0, like real attention rows."""
    rng = np.random.default_rng(seed)
    n_blocks = 8
    values = rng.normal(size=(n_blocks * n_max, dim))
    ns = rng.integers(max(1, n_max // 8), n_max + 1, size=rows)
    v_start = rng.integers(0, n_blocks, size=rows) * n_max
    ps = []
    for n in ns:
        logits = 2.0 * rng.normal(size=n)
        logits[0] += 4.0  # attention sink
        e = np.exp(logits - logits.max())
        ps.append(e / e.sum())
    p_off = np.concatenate([[0], np.cumsum(ns)]).astype(np.int64)
    return np.concatenate(ps), p_off, values, v_start.astype(np.int64)


def best_of(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Best wall time over ``repeat`` calls (seconds) and the last result."""
    best, out = np.inf, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--n-max", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--s", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="Numba threads (default: Numba's default, all cores)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import numba

    if args.threads is not None:
        numba.set_num_threads(args.threads)
    from evictlab.core import kernels as K
    from evictlab.core import reference as R

    p, p_off, values, v_start = make_batch(args.rows, args.n_max, args.dim, args.seed)
    n_rows = p_off.shape[0] - 1
    s = args.s
    rows = [(p[p_off[i] : p_off[i + 1]], values[v_start[i] : v_start[i] + p_off[i + 1] - p_off[i]]) for i in range(n_rows)]
    top = K.batch_top_mass(p, p_off, s)
    pool, size = K.batch_candidate_pool(p, p_off, values, v_start, s, 2, 2)

    cases: list[tuple[str, Callable[[], np.ndarray], Callable[[], np.ndarray]]] = [
        ("dense_output", lambda: K.batch_dense_output(p, p_off, values, v_start),
         lambda: np.stack([R.dense_output(pr, vr) for pr, vr in rows])),
        ("top_mass", lambda: K.batch_top_mass(p, p_off, s),
         lambda: np.stack([R.top_mass_set(pr, s) for pr, _ in rows])),
        ("candidate_pool", lambda: K.batch_candidate_pool(p, p_off, values, v_start, s, 2, 2)[0],
         lambda: np.stack([R.candidate_pool(pr, vr, s, 2, 2) for pr, vr in rows])),
        ("forced_error", lambda: K.batch_forced_error(p, p_off, values, v_start, top),
         lambda: np.array([R.forced_error(pr, vr, top[i]) for i, (pr, vr) in enumerate(rows)])),
        ("dropped_mass", lambda: K.batch_dropped_mass(p, p_off, top),
         lambda: np.array([R.dropped_mass(pr, top[i]) for i, (pr, _) in enumerate(rows)])),
        ("single_key_errors", lambda: K.batch_single_key_errors(p, p_off, values, v_start),
         lambda: np.concatenate([R.single_key_errors(pr, vr) for pr, vr in rows])),
        ("entropy", lambda: K.batch_entropy(p, p_off),
         lambda: np.array([R.entropy(pr) for pr, _ in rows])),
        ("free_weight_error(T_s)", lambda: K.batch_free_weight_error(p, p_off, values, v_start, top),
         lambda: np.array([R.free_weight_error(pr, vr, top[i])[0] for i, (pr, vr) in enumerate(rows)])),
        ("free_weight_error(pool)", lambda: K.batch_free_weight_error(p, p_off, values, v_start, pool),
         lambda: np.array([R.free_weight_error(pr, vr, pool[i, : size[i]])[0] for i, (pr, vr) in enumerate(rows)])),
    ]
    print(f"rows={n_rows} keys={p.shape[0]} (n {int(np.diff(p_off).min())}..{int(np.diff(p_off).max())}) d={args.dim} s={s} "
          f"numba threads={numba.get_num_threads()}")
    print(f"{'kernel':26s} {'numba ms':>10s} {'numpy-loop ms':>14s} {'ratio':>8s} {'max |diff|':>11s}")
    table = []
    for name, fast, ref in cases:
        fast()  # warm-up: load the cached machine code (or compile once)
        t_fast, out_fast = best_of(fast, args.repeat)
        t_ref, out_ref = best_of(ref, 1)
        diff = float(np.max(np.abs(np.asarray(out_fast, dtype=np.float64) - np.asarray(out_ref, dtype=np.float64))))
        table.append({"kernel": name, "numba_s": t_fast, "reference_s": t_ref, "ratio": t_ref / t_fast, "max_abs_diff": diff})
        print(f"{name:26s} {1e3 * t_fast:10.2f} {1e3 * t_ref:14.1f} {t_ref / t_fast:8.1f} {diff:11.2e}")

    if args.out is not None:
        from evictlab.io import atomic_write_json
        from evictlab.record import RunRecord, record_path

        record = RunRecord(kind="bench_core", seed=args.seed, config=vars(args) | {"out": str(args.out)})
        atomic_write_json(args.out, {"rows": n_rows, "keys": int(p.shape[0]), "threads": numba.get_num_threads(), "table": table})
        record.write(record_path(args.out))


if __name__ == "__main__":
    main()
