"""Benchmark (not a test): the paper-scale solve, end to end (read, solve, write).

1. Synthesise 168,192 attention rows with 1,000 keys each, d = 64 (256 rows share one
   key/value block, as rows of one (prompt, layer, KV head) do), unless ``--rows-dir``
   already holds them:
       evictlab rows synth --count 168192 --keys 1000 --dim 64 --seed 0 --spread 0 --out DIR
2. Solve s in {4, 8, 16, 32} with the default pool (r_m = r_e = 2), timed from the start
   of the command to the results file and run record on disk:
       evictlab solve DIR --keep 4 8 16 32 --out OUT --overwrite --restart
3. With ``--search all`` (the default of this script: ``--searches pool all``), the same
   command with ``--search all`` (all-key local search, default shortlist and no kicks)
   runs next in the same process, and the ratio of the two wall and CPU times is printed:
   the baseline and the new mode on the same rows, machine and load.

Wall time is what the bar (<= 10 minutes on the 2-core machine) is about; CPU time of the
solve process and the 1-minute load average before/after are reported too, because other
jobs on a shared machine take cores away.

Where the time goes: before the timed runs a tiny solve of each mode fills Numba's cache
(after any change to a kernel file the kernels compile again, ~50 s of CPU: a timed run
that includes it looks twice as slow; its time is printed as "warm-up"). Each timed run's
phases come from its run record (``phases_s``: open, checks, compile, read, solve, write,
collect, write_out, record; ``evictlab.solve.runner.PHASES``), and the share of the solve
phase spent in the free-weight solves is measured in this process on the first 1,024 rows
(the kernel alone against exactly the free-weight solves it makes: T_s's, and the argmin's where it differs).

    .venv/bin/python benchmarks/bench_solve_paper_scale.py --work /tmp/paper [--rows 168192] [--searches pool all]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

from evictlab.core.freeweight import row_free_weight

BUDGETS = ["4", "8", "16", "32"]


def _evictlab() -> str:
    return str(Path(sys.executable).with_name("evictlab"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/evictlab-paper"))
    ap.add_argument("--rows", type=int, default=168_192)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--searches", nargs="+", default=["pool", "all"], choices=["pool", "all"],
                    help="solve modes to time, in order (default: pool, then all)")
    args = ap.parse_args()
    rows_dir = args.work / "rows"
    args.work.mkdir(parents=True, exist_ok=True)
    # synth finishes an interrupted dataset and does nothing when it is complete
    t0 = time.perf_counter()
    subprocess.run([_evictlab(), "rows", "synth", "--count", str(args.rows), "--keys", str(args.keys),
                    "--dim", str(args.dim), "--seed", "0", "--spread", "0", "--out", str(rows_dir)],
                   check=True)
    print(f"synth: {time.perf_counter() - t0:.1f} s wall")
    import polars as pl

    _warm_up(args.work, args.dim, args.searches)

    times: dict[str, tuple[float, float]] = {}
    for search in args.searches:
        out = args.work / f"results-{search}.parquet"
        if out.exists():
            out.unlink()
        parts = out.with_name(out.name + ".parts")
        if parts.exists():
            shutil.rmtree(parts)
        cmd = [_evictlab(), "solve", str(rows_dir), "--keep", *BUDGETS, "--out", str(out),
               "--search", search]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        load0 = os.getloadavg()[0]
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        wall = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (ru.ru_utime - ru0.ru_utime) + (ru.ru_stime - ru0.ru_stime)
        load1 = os.getloadavg()[0]
        times[search] = (wall, cpu)
        df = pl.read_parquet(out)
        print(f"--search {search}: solve end to end {wall:.1f} s wall, {cpu:.1f} s CPU, {df.height} result "
              f"rows, load average {load0:.1f} -> {load1:.1f}, {os.cpu_count()} cores")
        aggs = [pl.col("gap_closed").median(), pl.col("kappa_hat").median(),
                (pl.col("e_top") / pl.col("e_free_top")).median().alias("pi_top")]
        if search == "all":
            aggs += [pl.col("gap_closed_ls").median(),
                     (pl.col("es_ls") < pl.col("es_hat")).mean().alias("pool_misses"),
                     pl.col("ls_moves").mean()]
        print(df.group_by("s").agg(*aggs).sort("s"))
        _print_phases(out, wall)
    if "pool" in times and "all" in times:
        (wp, cp), (wa, ca) = times["pool"], times["all"]
        print(f"ratio all / pool: wall {wa / wp:.2f}x, CPU {ca / cp:.2f}x "
              f"(all-key search alone: {wa - wp:.1f} s wall, {ca - cp:.1f} s CPU)")
    _free_weight_share(rows_dir)


def _warm_up(work: Path, dim: int, searches: list[str]) -> None:
    """Fill Numba's cache with a tiny solve of each mode (the kernels compile here, not in a
    timed run, after a change to a kernel file); print how long it took."""
    tiny = work / "warmup-rows"
    subprocess.run([_evictlab(), "rows", "synth", "--count", "64", "--keys", "64", "--dim", str(dim), "--seed", "0",
                    "--spread", "0", "--out", str(tiny)], check=True, capture_output=True)
    for search in searches:
        out = work / f"warmup-{search}.parquet"
        t0 = time.perf_counter()
        subprocess.run([_evictlab(), "solve", str(tiny), "--keep", *BUDGETS, "--out", str(out), "--overwrite",
                        "--restart", "--search", search], check=True, capture_output=True)
        phases = json.loads(out.with_name(out.stem + ".run_record.json").read_text())["phases_s"]
        print(f"warm-up --search {search}: {time.perf_counter() - t0:.1f} s wall, of which compile or cache load "
              f"{phases['compile']:.1f} s (about 50 s when a kernel file changed since the last run)")


def _print_phases(out: Path, wall: float) -> None:
    """The run record's seconds per phase, with each phase's share of the solve's own time."""
    phases = json.loads(out.with_name(out.stem + ".run_record.json").read_text())["phases_s"]
    inside = sum(v for v in phases.values() if v is not None)
    print(f"  where the time went ({inside:.1f} s inside the solve; {wall - inside:.1f} s starting the process "
          "and importing):")
    from evictlab.solve.runner import PHASES

    for name in PHASES:
        sec = phases.get(name)
        if sec is not None:
            print(f"    {name:<10} {sec:8.1f} s  {100 * sec / inside:5.1f}%")


@njit(cache=True, parallel=True)
def _free_weight_solves(p_off: np.ndarray, values: np.ndarray, v_start: np.ndarray, mu: np.ndarray,
                        kept: np.ndarray, same: np.ndarray) -> float:
    """The free-weight solves ``batch_solve`` makes for one budget: T_s's (``kept[0]``) and the
    argmin's (``kept[1]``) where it differs (``same[r]`` False), from the dense outputs ``mu``
    ``(N, d)``; returns the sum of the errors (so nothing is optimised away)."""
    n_rows = p_off.shape[0] - 1
    acc = np.zeros(n_rows)
    for r in prange(n_rows):
        n = p_off[r + 1] - p_off[r]
        V = values[v_start[r]: v_start[r] + n]
        acc[r] = row_free_weight(V, mu[r], kept[0, r])[0]
        if not same[r]:
            acc[r] += row_free_weight(V, mu[r], kept[1, r])[0]
    return acc.sum()


def _free_weight_share(rows_dir: Path, rows: int = 1024) -> None:
    """The share of the solve kernel's time spent in its free-weight solves, on the first
    ``rows`` rows, in this process: ``batch_solve`` against exactly the free-weight solves it
    makes (T_s's, and the argmin's where it differs from T_s), from the same dense outputs."""
    from evictlab.core.kernels import batch_dense_output
    from evictlab.core.threads import single_blas_thread
    from evictlab.rows.reader import RowStore
    from evictlab.solve.kernels import batch_solve

    b = next(RowStore.open(rows_dir).iter_batches(rows))
    bud = np.asarray([int(x) for x in BUDGETS], dtype=np.int64)
    with single_blas_thread():
        batch_solve(b.p, b.p_off, b.values, b.v_start, bud[:1], 2, 2, 64)  # compiled / loaded, not timed
        t_solve = np.inf
        for _ in range(3):  # the fastest of three, for both sides
            t0 = time.perf_counter()
            res = batch_solve(b.p, b.p_off, b.values, b.v_start, bud, 2, 2, 64)
            t_solve = min(t_solve, time.perf_counter() - t0)
        mu = batch_dense_output(b.p, b.p_off, b.values, b.v_start)
        sets = []
        for j, s in enumerate(bud):
            top, opt = res[4][:, j, :s], res[5][:, j, :s]
            sets.append((np.ascontiguousarray(np.stack([top, opt])), np.all(top == opt, axis=1)))
        _free_weight_solves(b.p_off, b.values, b.v_start, mu, *sets[0])  # compiled / loaded, not timed
        t_free = np.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for kept, same in sets:
                _free_weight_solves(b.p_off, b.values, b.v_start, mu, kept, same)
            t_free = min(t_free, time.perf_counter() - t0)
    print(f"free-weight solves: {t_free:.2f} s of the kernel's {t_solve:.2f} s on {b.n_rows} rows "
          f"(~{100 * min(t_free / t_solve, 1):.0f}% of the solve phase)")


if __name__ == "__main__":
    main()
