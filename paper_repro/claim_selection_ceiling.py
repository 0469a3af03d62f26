"""Claim: the best s-subset closes only a median 2-5% of the top-mass gap (0.021-0.047, s = 4..32).

Reads the main solver results only (default: the latest `make demo` run's inputs.json; the
certification pass is its own claim, `claim_certified_pool.py`), writes the median gap closed
per (model, s), and pooled over models when there are several, with prompt-clustered
bootstrap CIs to the claims table, and the gap-closed ECDF and per-(layer, head) heatmaps to
figures/.

    .venv/bin/python paper_repro/claim_selection_ceiling.py [--run runs/demo | --results R.parquet ...]
"""

from __future__ import annotations


import polars as pl

import _common

from evictlab.plots.gap import gap_closed_ecdf
from evictlab.plots.heatmap import gap_heatmap
from evictlab.record import RunRecord
from evictlab.stats.ceilings import summarize, summarize_pooled
from evictlab.stats.claims import selection_ceiling


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    record = RunRecord(kind="paper-repro-ceiling", seed=args.seed, config=_common.config(args))
    df = _common.results(args)
    summary = summarize(df, ("model", "s"), seed=args.seed, n_boot=args.n_boot, threshold=args.threshold)
    pooled = summarize_pooled(df, seed=args.seed, n_boot=args.n_boot, threshold=args.threshold)
    if pooled is not None:
        summary = pl.concat([summary, pooled], how="diagonal_relaxed")
    cells = summarize(df, ("model", "s", "layer", "head"), seed=args.seed, n_boot=min(args.n_boot, 200))
    figs = _common.figures_dir(args)
    made = [gap_closed_ecdf(df, figs / "ceiling_gap_closed_ecdf")]
    made += [gap_heatmap(cells, figs / f"ceiling_gap_heatmap_{m}", m) for m in sorted(df["model"].unique().to_list())]
    _common.publish(args, "claim_selection_ceiling.py", selection_ceiling(summary, args.weights), made, record)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
