"""Benchmark (not a test): the Ray executor's overhead against the local run at the same core count.

1. The paper-scale synthetic solve (``bench_solve_paper_scale.py``'s rows: 1,000 keys,
   d = 64, s in {4, 8, 16, 32}, pool C_s(2, 2); ``--rows 168192`` is the paper's row count)
   solved locally with ``--threads N`` and on a local Ray instance of N CPUs (one task of
   1 thread per part), interleaved ``--repeats`` times; the results are checked equal
   in the run. The Ray instance is started before the clock (its start-up is reported
   apart); the first Ray run also starts the worker processes and loads the Numba cache in
   each ("cold"), later runs reuse them ("warm").
2. Tasks per second for small tasks: ``--tasks`` no-op tasks (``operator.neg``) through
   :meth:`RayExecutor.map`, ordered and unordered; and solve parts of 16 rows (n = 64).

    .venv/bin/python benchmarks/bench_executor.py --work /tmp/bench-exec --rows 21024 --cpus 2
    .venv/bin/python benchmarks/bench_executor.py --work /tmp/bench-exec --rows 168192 --cpus 2   # paper scale
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import shutil
import statistics
import time
from pathlib import Path


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-exec"))
    ap.add_argument("--rows", type=int, default=168_192)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--cpus", type=int, default=2, help="cores: local --threads and the Ray instance's CPUs")
    ap.add_argument("--chunk-rows", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON")
    args = ap.parse_args()

    import polars as pl
    import ray

    from evictlab.executor.ray_backend import RayExecutor
    from evictlab.rows.synth import SynthConfig, synthesize
    from evictlab.solve.runner import SolveConfig, solve_rows

    args.work.mkdir(parents=True, exist_ok=True)
    rows = args.work / f"rows-{args.rows}"
    if not (rows / "manifest.json").is_file():
        synthesize(rows, SynthConfig(rows=args.rows, keys=args.keys, dim=args.dim, seed=0, spread=0.0))
    cfg = SolveConfig(budgets=(4, 8, 16, 32), chunk_rows=args.chunk_rows)
    load0 = os.getloadavg()[0]
    t_start = _timed(lambda: ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
                                      configure_logging=False))
    ex = RayExecutor()

    def run(kind: str, i: int) -> float:
        out = args.work / f"{kind}-{i}.parquet"
        shutil.rmtree(out.with_name(out.name + ".parts"), ignore_errors=True)
        if kind == "local":
            return _timed(lambda: solve_rows(rows, out, cfg, threads=args.cpus, overwrite=True, progress=False))
        return _timed(lambda: solve_rows(rows, out, cfg, threads=1, overwrite=True, progress=False, executor=ex))

    local, remote = [], []
    for i in range(args.repeats):
        local.append(run("local", i))
        remote.append(run("ray", i))
        print(f"repeat {i}: local {local[-1]:.1f} s, ray {remote[-1]:.1f} s", flush=True)
    ref = pl.read_parquet(args.work / "local-0.parquet")
    for i in range(args.repeats):
        for kind in ("local", "ray"):
            assert pl.read_parquet(args.work / f"{kind}-{i}.parquet").equals(ref), f"{kind}-{i} differs"
    load1 = os.getloadavg()[0]

    # small tasks
    n = args.tasks
    list(ex.map(operator.neg, range(2 * args.cpus)))  # workers up
    t_unordered = _timed(lambda: list(ex.map(operator.neg, range(n))))
    t_ordered = _timed(lambda: list(ex.map(operator.neg, range(n), ordered=True)))
    small = args.work / "small-rows"
    if not (small / "manifest.json").is_file():
        synthesize(small, SynthConfig(rows=2048, keys=64, dim=64, seed=1, spread=0.0))
    small_cfg = SolveConfig(budgets=(4, 8), chunk_rows=16)
    t_small_local = _timed(lambda: solve_rows(small, args.work / "small-local.parquet", small_cfg, threads=args.cpus,
                                              overwrite=True, progress=False))
    t_small_ray = _timed(lambda: solve_rows(small, args.work / "small-ray.parquet", small_cfg, threads=1,
                                            overwrite=True, progress=False, executor=ex))
    parts = 2048 // 16
    res = {
        "rows": args.rows, "keys": args.keys, "dim": args.dim, "cpus": args.cpus, "chunk_rows": args.chunk_rows,
        "ray_start_s": round(t_start, 1), "local_s": [round(x, 1) for x in local],
        "ray_s": [round(x, 1) for x in remote],
        "overhead_cold": round(remote[0] / local[0] - 1, 3),
        "overhead_warm_median": (round(statistics.median(r / lo for r, lo in zip(remote[1:], local[1:])) - 1, 3)
                                 if args.repeats > 1 else None),
        "overhead_best": round(min(remote) / min(local) - 1, 3),
        "noop_tasks_per_s_unordered": round(n / t_unordered, 1), "noop_tasks_per_s_ordered": round(n / t_ordered, 1),
        "small_parts": parts, "small_parts_per_s_local": round(parts / t_small_local, 1),
        "small_parts_per_s_ray": round(parts / t_small_ray, 1), "load_before": round(load0, 1),
        "load_after": round(load1, 1), "results_equal": True,
    }
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    main()
