"""Claim: the forced-weight penalty pi(s) rises from 1.07 (s = 4) to 1.79 (s = 32).

Writes median pi(s) at T_s (and at the argmin) per (model, s) with bootstrap CIs, and whether
it rises with s, to the claims table; the pi(s) curve to figures/.

    .venv/bin/python paper_repro/claim_penalty_trend.py [--run runs/demo | --results R.parquet ...]
"""

from __future__ import annotations

import sys

import _common

from evictlab.plots.penalty import penalty_curve
from evictlab.report.record import RunRecord
from evictlab.stats.ceilings import summarize
from evictlab.stats.claims import penalty_trend


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    record = RunRecord(kind="paper-repro-penalty", seed=args.seed, config=_common.config(args))
    df = _common.results(args)
    summary = summarize(df, ("model", "s"), seed=args.seed, n_boot=args.n_boot, threshold=args.threshold)
    made = [penalty_curve(summary, _common.figures_dir(args) / "penalty_pi_s")]
    _common.publish(args, "claim_penalty_trend.py", penalty_trend(summary, args.weights), made, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
