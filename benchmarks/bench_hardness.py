"""CP-SAT against the exact (count, sum) DP as ZERO-ES instances grow, both timed in the same run.

For each source size n: ``--per-size`` balanced instances (planted yes / proved no) from
``evictlab.hardness.generators.balanced``; each source and its image (2n+1 values) is decided
by CP-SAT (one worker) and by the DP; answers must agree (the script exits 1 otherwise).
Reports, per size and answer, median milliseconds per decision and the ratio CP-SAT / DP of
the medians (max times go to ``--out``).

Regimes (``--regime``): ``sparse`` draws values from [-2^n, 2^n] (the default of ``check``:
distinct subset sums, the DP's state count grows like 2^n); ``dense`` draws them from [-n, n]
(few distinct sums, the DP's state count stays polynomial). A CP-SAT decision that hits
``--cpsat-limit`` is counted in the last column and enters the medians at the limit (a lower
bound on its true time); the DP is never limited, it always answers.

    .venv/bin/python benchmarks/bench_hardness.py --sizes 4,8,12,16,20 --per-size 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from evictlab.hardness.deciders import Decision, UndecidedError, decide_image, decide_source
from evictlab.hardness.generators import balanced, default_magnitude
from evictlab.hardness.reduction import reduce_instance


SOLVERS = ("source_cpsat", "source_dp", "image_cpsat", "image_dp")


def bench(sizes: list[int], per_size: int, seed: int, regime: str, cpsat_limit_s: float) -> list[dict[str, object]]:
    """One row per (size, answer): median / max milliseconds of each solver, and CP-SAT / DP ratios."""
    rows: list[dict[str, object]] = []
    for n in sizes:
        magnitude = default_magnitude(n) if regime == "sparse" else max(1, n)
        instances = balanced(seed + n, per_size, n, magnitude)
        times: dict[bool, dict[str, list[float]]] = {True: {s: [] for s in SOLVERS}, False: {s: [] for s in SOLVERS}}
        undecided: dict[bool, dict[str, int]] = {True: dict.fromkeys(SOLVERS, 0), False: dict.fromkeys(SOLVERS, 0)}
        for gen in instances:
            image = reduce_instance(gen.source)
            ds: dict[str, Decision | None] = {}
            for name, run in (
                ("source_cpsat", lambda: decide_source(gen.source, "cpsat", time_limit_s=cpsat_limit_s)),
                ("source_dp", lambda: decide_source(gen.source, "dp")),
                ("image_cpsat", lambda: decide_image(image, "cpsat", time_limit_s=cpsat_limit_s)),
                ("image_dp", lambda: decide_image(image, "dp")),
            ):
                try:
                    ds[name] = run()
                except UndecidedError:  # CP-SAT hit the time limit: counted, timed at the limit
                    ds[name] = None
            answers = {d.yes for d in ds.values() if d is not None}
            if answers != {gen.expected_yes}:
                print(f"DISAGREEMENT at n={n}: {gen.source} -> {ds}", file=sys.stderr)
                sys.exit(1)
            for name, d in ds.items():
                times[gen.expected_yes][name].append(cpsat_limit_s if d is None else d.seconds)  # type: ignore[arg-type]
                if d is None:
                    undecided[gen.expected_yes][name] += 1
        for answer in (True, False):
            ts = times[answer]
            if not ts["source_dp"]:
                continue
            row: dict[str, object] = {"regime": regime, "n": n, "image_n": 2 * n + 1, "magnitude": magnitude,
                                      "answer": "yes" if answer else "no", "instances": len(ts["source_dp"])}
            for name in SOLVERS:
                row[f"{name}_median_ms"] = 1e3 * statistics.median(ts[name])
                row[f"{name}_max_ms"] = 1e3 * max(ts[name])
            row["cpsat_timeouts"] = undecided[answer]["source_cpsat"] + undecided[answer]["image_cpsat"]
            row["source_ratio"] = row["source_cpsat_median_ms"] / row["source_dp_median_ms"]  # type: ignore[operator]
            row["image_ratio"] = row["image_cpsat_median_ms"] / row["image_dp_median_ms"]  # type: ignore[operator]
            rows.append(row)
            print(
                f"| {regime} | {n} | {2 * n + 1} | {row['answer']} | {row['source_cpsat_median_ms']:.2f} | "
                f"{row['source_dp_median_ms']:.2f} | {row['source_ratio']:.2f} | {row['image_cpsat_median_ms']:.2f} | "
                f"{row['image_dp_median_ms']:.2f} | {row['image_ratio']:.2f} | {row['cpsat_timeouts']} |",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,8,12,16,20", help="comma-separated source sizes n")
    ap.add_argument("--per-size", type=int, default=10, help="instances per size (half yes, half no)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--regime", choices=("sparse", "dense", "both"), default="both")
    ap.add_argument("--cpsat-limit", type=float, default=60.0,
                    help="CP-SAT seconds per decision; a timeout is counted and timed at the limit")
    ap.add_argument("--out", type=Path, default=None, help="optional JSON file for the rows and a run record")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    regimes = ("sparse", "dense") if args.regime == "both" else (args.regime,)
    t0 = time.perf_counter()
    print("| regime | n | N | answer | source CP-SAT ms | source DP ms | CP-SAT/DP | image CP-SAT ms | image DP ms | CP-SAT/DP | CP-SAT timeouts |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [r for regime in regimes for r in bench(sizes, args.per_size, args.seed, regime, args.cpsat_limit)]
    print(f"total wall time {time.perf_counter() - t0:.1f} s; all decided answers agreed")
    if args.out is not None:
        from evictlab.io import atomic_write_json
        from evictlab.record import RunRecord, record_path

        atomic_write_json(args.out, rows)
        RunRecord(kind="bench-hardness", seed=args.seed, config=vars(args) | {"out": str(args.out)}).write(
            record_path(args.out))


if __name__ == "__main__":
    main()
