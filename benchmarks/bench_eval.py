"""The evaluation grid's throughput and the cost of masked vs physical mode (docs/performance.md).

A fixed grid on SmolLM2-135M (CPU): the ``needle`` task at a 512-token context, SnapKV +
AdaKV at 32 kept entries per cell, modes ``physical``, ``uniform`` and ``masked``, the
query-agnostic protocol, ``--n`` seeded examples, plus the full-cache reference (one
``full`` cell). It runs into a fresh folder with the same ``run_grid`` as ``evictlab eval
run`` and reports:

- examples per minute over the whole grid (every cell's examples, the full cache's
  included; model load and example building excluded: the model is loaded before the clock
  starts), and per mode;
- the per-example wall-time ratios masked / physical and uniform / physical, paired by
  example (same run, same process), with the bytes each mode held.

    .venv/bin/python benchmarks/bench_eval.py --threads 2 --n 6 [--out bench_eval.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

from evictlab.eval.grid import run_grid
from evictlab.eval.runner import load_cached
from evictlab.eval.spec import GridSpec
from evictlab.record import RunRecord, record_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--budget", default="32")
    p.add_argument("--n", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON (with a run record)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = GridSpec.build(models=[args.model], tasks=["needle"], contexts=[args.context], methods=["snapkv+adakv"],
                          budgets=[args.budget], modes=["physical", "uniform", "masked"],
                          protocols=["query-agnostic"], n=args.n, seed=0)
    record = RunRecord(kind="bench.eval", model=args.model, seed=0, config={**vars(args), "out": str(args.out)})
    load_cached(args.model)  # outside the clock
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_grid(spec, Path(tmp) / "g")
        wall = time.perf_counter() - t0
        res = pl.read_parquet(Path(tmp) / "g" / "results.parquet")
    per_mode = res.group_by("mode", maintain_order=True).agg(
        pl.len().alias("examples"), pl.col("wall_s").sum().alias("wall_s"),
        pl.col("bytes_live").mean().alias("bytes_live"), pl.col("bytes_allocated").mean().alias("bytes_allocated"))
    ev = res.filter(pl.col("mode") != "full")
    phys = ev.filter(pl.col("mode") == "physical").sort("example")["wall_s"].to_numpy()
    ratios = {m: ev.filter(pl.col("mode") == m).sort("example")["wall_s"].to_numpy() / phys
              for m in ("masked", "uniform")}
    out = {
        "examples": res.height, "wall_s": wall, "examples_per_minute": 60.0 * res.height / wall,
        "per_mode": per_mode.to_dicts(),
        "ratio_vs_physical": {m: {"median": float(np.median(r)), "min": float(r.min()), "max": float(r.max())}
                              for m, r in ratios.items()},
        "threads": args.threads, "torch_threads": torch.get_num_threads(),
    }
    print(f"{res.height} examples in {wall:.1f} s: {out['examples_per_minute']:.2f} examples/min "
          f"({args.threads} threads)")
    print("| mode | examples | wall s | ex/min | bytes live (MiB) | bytes allocated (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in out["per_mode"]:
        print(f"| {r['mode']} | {r['examples']} | {r['wall_s']:.1f} | {60 * r['examples'] / r['wall_s']:.2f} | "
              f"{r['bytes_live'] / 2**20:.2f} | {r['bytes_allocated'] / 2**20:.2f} |")
    for m, r in out["ratio_vs_physical"].items():
        print(f"{m} / physical wall time per example: median {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f})")
    if args.out:
        from evictlab.io import atomic_write_json

        atomic_write_json(args.out, out)
        record.write(record_path(args.out), outputs=[str(args.out)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
