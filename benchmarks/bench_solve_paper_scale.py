"""Benchmark (not a test): the paper-scale solve, end to end (read, solve, write).

1. Synthesise 168,192 attention rows with 1,000 keys each, d = 64 (256 rows share one
   key/value block, as rows of one (prompt, layer, KV head) do), unless ``--rows-dir``
   already holds them:
       evictlab rows synth --rows 168192 --keys 1000 --dim 64 --seed 0 --spread 0 --out DIR
2. Solve s in {4, 8, 16, 32} with the default pool (r_m = r_e = 2), timed from the start
   of the command to the results file and run record on disk:
       evictlab solve DIR --budgets 4 8 16 32 --out OUT --overwrite --restart
3. With ``--search all`` (the default of this script: ``--searches pool all``), the same
   command with ``--search all`` (all-key local search, default shortlist and no kicks)
   runs next in the same process, and the ratio of the two wall and CPU times is printed:
   the baseline and the new mode on the same rows, machine and load.

Wall time is what the bar (<= 10 minutes on the 2-core machine) is about; CPU time of the
solve process and the 1-minute load average before/after are reported too, because other
jobs on a shared machine take cores away.

    .venv/bin/python benchmarks/bench_solve_paper_scale.py --work /tmp/paper [--rows 168192] [--searches pool all]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


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
    subprocess.run([_evictlab(), "rows", "synth", "--rows", str(args.rows), "--keys", str(args.keys),
                    "--dim", str(args.dim), "--seed", "0", "--spread", "0", "--out", str(rows_dir)],
                   check=True)
    print(f"synth: {time.perf_counter() - t0:.1f} s wall")
    import polars as pl

    times: dict[str, tuple[float, float]] = {}
    for search in args.searches:
        out = args.work / f"results-{search}.parquet"
        if out.exists():
            out.unlink()
        parts = out.with_name(out.name + ".parts")
        if parts.exists():
            shutil.rmtree(parts)
        cmd = [_evictlab(), "solve", str(rows_dir), "--budgets", "4", "8", "16", "32", "--out", str(out),
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
    if "pool" in times and "all" in times:
        (wp, cp), (wa, ca) = times["pool"], times["all"]
        print(f"ratio all / pool: wall {wa / wp:.2f}x, CPU {ca / cp:.2f}x "
              f"(all-key search alone: {wa - wp:.1f} s wall, {ca - cp:.1f} s CPU)")


if __name__ == "__main__":
    main()
