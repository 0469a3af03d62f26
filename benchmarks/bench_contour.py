"""ContourKV allocation speed against the other allocators (results in docs/performance.md).

One ``allocate`` call for the SmolLM2-135M geometry (30 layers x 3 KV heads = 90 cells), at
per-cell budgets 64..512, with every cell holding ``--held`` entries (a compression after a
prefill chunk holds budget + chunk; the first compression of a long prefill holds the
whole chunk). Timed: ``uniform`` (the baseline of every ratio, same run), ``pyramidkv``,
``adakv`` (reads the scores), ``contourkv`` offline (a profile file: knots from the relative
grid, 98 per cell), ``contourkv`` online (the window profile given: one knot per held
entry), ``contourkv_pred`` offline (a mass-only predictor on every knot). Also the level
search alone (the Numba k-way merge) against its enumerate-and-sort numpy reference,
``contourkv_mass`` and ``contourkv_error`` online (the scorer-ranked curves given) and their
exact min-sum split alone, pruned (the default) against unpruned (``prune=False``, every step
of the programme: the same counts, asserted), and,
separately, what the online mode adds to a compression in the loop: ``window_stats`` for
all 90 cells (9 query heads, a 32-query window).

Each time is the median of ``--reps`` calls after one warm-up call (Numba compile or cache
load excluded), in microseconds, as this thread's CPU time (the ratio against uniform uses
it) and wall time.

    .venv/bin/python benchmarks/bench_contour.py --threads 1 --out /tmp/contour_bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from evictlab.contour.level import envelope, min_sum_increments, top_increments, top_increments_reference
from evictlab.contour.profile import GRID, ContourProfile, window_stats
from evictlab.methods import AllocInputs, check_sizes, make_allocator
from evictlab.methods.testing import example_predictor, example_ranked_window, example_window

L, HK, HQ, D = 30, 3, 9, 64
FLOOR = 20  # sinks 4 + recent 16, the decode defaults


def _time(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """Median wall and CPU (this thread) microseconds per call, after one warm-up call.

    On a shared, oversubscribed machine wall time includes waiting for a core; the thread's
    CPU time does not (single-threaded code: the two agree on an idle machine)."""
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall) * 1e6, statistics.median(cpu) * 1e6


def _profile(folder: Path, seed: int) -> Path:
    """A profile of SmolLM2's geometry, cells from peaked to flat (seeded)."""
    rng = np.random.default_rng(seed)
    power = rng.uniform(0.05, 3.0, size=(L, HK, 1))
    dropped = (1.0 - GRID) ** (1.0 / power) * (GRID < 1)
    geometry = {"n_layers": L, "kv_heads": HK, "q_heads": HQ, "head_dim": D, "windows": [None] * L}
    ones = np.ones((L, HK))
    prof = ContourProfile("synthetic-smollm2-geometry", geometry, GRID.copy(), dropped, ones * 0.5,
                          np.ones((L, HK), np.int64), ones * 2048, {"rows": "bench"})
    return prof.save(folder / "profile.json")


def bench(held: int, per_cells: list[int], reps: int, seed: int) -> list[dict[str, Any]]:
    folder = Path(tempfile.mkdtemp(prefix="bench-contour-"))
    profile = _profile(folder, seed)
    predictor = example_predictor(folder)
    g = torch.Generator().manual_seed(seed)
    scores = [torch.rand(1, HK, held, generator=g) for _ in range(L)]
    allocators = {
        "uniform": make_allocator("uniform"),
        "pyramidkv": make_allocator("pyramidkv"),
        "adakv": make_allocator("adakv"),
        "contourkv (offline)": make_allocator("contourkv", profile=str(profile)),
        "contourkv (online)": make_allocator("contourkv"),
        "contourkv_pred (offline)": make_allocator("contourkv_pred", profile=str(profile), predictor=str(predictor)),
        "contourkv_mass (online)": make_allocator("contourkv_mass"),
        "contourkv_error (online)": make_allocator("contourkv_error"),
    }
    rows = []
    for per_cell in per_cells:
        base = AllocInputs.build(scores, per_cell * L * HK, floor=FLOOR, next_position=4096)
        window = example_window(base, seed)
        ranked = example_ranked_window(base, seed)
        times = {}
        for name, alloc in allocators.items():
            inp = base
            if "online" in name:
                inp = dataclasses.replace(base, window=ranked)  # the ranked curves besides the query tails
            check_sizes(inp, alloc.allocate(inp), name)
            times[name] = _time(lambda a=alloc, i=inp: a.allocate(i), reps)
        # The level search alone on the online knots (one per held entry), kernel vs reference.
        alloc = make_allocator("contourkv_query")  # the query-tail knots, one per held entry
        inp = dataclasses.replace(base, window=window)
        x, y, nk = alloc.knots(inp)
        prio = envelope(y)
        room = np.full(L * HK, held - FLOOR)
        extra = per_cell * L * HK - FLOOR * L * HK
        assert (top_increments(x, prio, nk, room, extra) == top_increments_reference(x, prio, nk, room, extra)).all()
        times["level search (kernel)"] = _time(lambda: top_increments(x, prio, nk, room, extra, validate=False), reps)
        times["level search (numpy reference)"] = _time(lambda: top_increments_reference(x, prio, nk, room, extra),
                                                        max(3, reps // 20))
        # The exact min-sum split alone on contourkv_error's curves, pruned vs every step.
        alloc = allocators["contourkv_error (online)"]
        inp = dataclasses.replace(base, window=ranked)
        caps = alloc.caps(inp)
        F = alloc.costs(inp, caps)
        room_e = (caps - inp.floors).reshape(-1)
        extra_e = inp.target - int(inp.floors.sum())
        assert (min_sum_increments(F, room_e, extra_e) == min_sum_increments(F, room_e, extra_e, prune=False)).all()
        times["min-sum split (pruned)"] = _time(lambda: min_sum_increments(F, room_e, extra_e), max(3, reps // 10))
        times["min-sum split (every step)"] = _time(lambda: min_sum_increments(F, room_e, extra_e, prune=False),
                                                    max(3, reps // 50))
        for name, (wall, cpu) in times.items():
            rows.append({"held": held, "budget_per_cell": per_cell, "method": name, "wall_us": wall, "cpu_us": cpu,
                         "ratio_vs_uniform": cpu / times["uniform"][1]})
    return rows


def bench_window(held: int, window: int, reps: int, seed: int) -> dict[str, Any]:
    """What the online mode adds to one compression: window_stats for all 90 cells."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, HK, held, D, generator=g)
    queries = torch.randn(L, HQ, window, D, generator=g)
    qpos = torch.arange(held - window, held)
    kpos = torch.arange(held)
    rep = HQ // HK

    def run() -> None:
        for l in range(L):
            for h in range(HK):
                window_stats(queries[l, h * rep:(h + 1) * rep], keys[l, h], D ** -0.5, qpos, kpos)

    wall, cpu = _time(run, reps)
    return {"held": held, "window": window, "cells": L * HK, "wall_us": wall, "cpu_us": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held", type=int, nargs="+", default=[576, 4096], help="entries per cell before the call")
    ap.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512], help="kept entries per cell")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        import numba

        numba.set_num_threads(args.threads)
    rows = []
    for held in args.held:
        rows += bench(held, [b for b in args.budgets if b < held], args.reps, args.seed)
    windows = [bench_window(held, 32, max(3, args.reps // 40), args.seed) for held in args.held]
    print("| held/cell | budget/cell | method | CPU us per call | wall us | CPU x uniform |")
    print("|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['held']} | {r['budget_per_cell']} | {r['method']} | {r['cpu_us']:.0f} | {r['wall_us']:.0f} | "
              f"{r['ratio_vs_uniform']:.2f} |")
    print()
    print("| held/cell | window | cells | window_stats CPU ms per compression | wall ms |")
    print("|---:|---:|---:|---:|---:|")
    for w in windows:
        print(f"| {w['held']} | {w['window']} | {w['cells']} | {w['cpu_us'] / 1e3:.0f} | {w['wall_us'] / 1e3:.0f} |")
    if args.out is not None:
        from evictlab.io import atomic_write_json
        from evictlab.record import RunRecord, record_path

        atomic_write_json(args.out, {"allocate": rows, "window_stats": windows})
        RunRecord(kind="bench.contour", config=vars(args) | {"out": str(args.out)}).write(
            record_path(args.out), output=str(args.out))


if __name__ == "__main__":
    main()
