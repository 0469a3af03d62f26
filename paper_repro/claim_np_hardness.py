"""Claim: deciding whether ES(s) = 0 is NP-complete, even for 1-D values with uniform mass.

Runs the reduction checker (k-subset-sum -> ZERO-ES; CP-SAT and an exact DP on both sides;
certificates mapped both ways) on balanced yes/no instances, writes the counts to the claims
table and the decision times to figures/.

    .venv/bin/python paper_repro/claim_np_hardness.py [--trials 100 --size 8 --seed 0]
"""

from __future__ import annotations


import _common

from evictlab.io import atomic_path
from evictlab.hardness.check import run_check
from evictlab.hardness.generators import balanced
from evictlab.plots.hardness import hardness_times
from evictlab.record import RunRecord
from evictlab.stats.claims import np_hardness


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0], needs_results=False)
    p.add_argument("--trials", type=int, default=100, help="source instances, half yes half no (default 100)")
    p.add_argument("--size", type=int, default=8, help="source values n; the image has 2n+1 (default 8)")
    args = p.parse_args(argv)
    record = RunRecord(kind="paper-repro-np-hardness", seed=args.seed, config=_common.config(args))
    trials = run_check(balanced(args.seed, args.trials, args.size, None))
    with atomic_path(args.out / "hardness_trials.parquet", suffix=".parquet") as tmp:
        trials.write_parquet(tmp)
    made = [hardness_times(trials, _common.figures_dir(args) / "np_hardness_times")]
    _common.publish(args, "claim_np_hardness.py", np_hardness(trials, args.size, args.seed), made, record)
    return 0 if int(trials["agreed"].sum()) == trials.height else 1


if __name__ == "__main__":
    from _common import entry

    entry(main)
