"""Claim: the forced-weight penalty pi(s) rises from 1.07 (s = 4) to 1.79 (s = 32).

Reads the main solver results only and writes median pi(s) at T_s (and at the argmin) per
(model, s) with prompt-clustered bootstrap CIs, and whether it rises with s, to the claims
table; the pi(s) curve to figures/. With the row datasets (the run's inputs.json, or
--rows MODEL=PATH) it also checks pi against s / head_dim with the labelled free-weight
ablations (affine hull, cone, span, ratio of medians) on a seeded sample of rows
(--ablation-rows; 0 = all rows) and states which explanation of the difference from the
paper the data support.

    .venv/bin/python paper_repro/claim_penalty_trend.py [--run runs/demo | --results R.parquet ... --rows M=ROWS ...]
"""

from __future__ import annotations


import polars as pl

import _common

from evictlab.io import atomic_path
from evictlab.plots.penalty import penalty_curve, penalty_vs_head_dim
from evictlab.record import RunRecord
from evictlab.rows import RowStore
from evictlab.stats.ceilings import summarize
from evictlab.stats.claims import penalty_head_dim, penalty_trend
from evictlab.solve.ablation import ablation_rows
from evictlab.stats.penalty import explain, penalty_table


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--ablation-rows", type=int, default=600,
                   help="rows per model for the free-weight ablations, spread over prompts (0 = all; default 600)")
    args = p.parse_args(argv)
    record = RunRecord(kind="paper-repro-penalty", seed=args.seed, config=_common.config(args))
    df = _common.results(args)
    summary = summarize(df, ("model", "s"), seed=args.seed, n_boot=args.n_boot, threshold=args.threshold)
    figs = _common.figures_dir(args)
    made = [penalty_curve(summary, figs / "penalty_pi_s")]
    rows = _common.rows(args)
    head_dims = {m: RowStore.open(path).head_dim for m, path in rows.items()}
    claims = penalty_trend(summary, args.weights, head_dims)
    if rows:
        abl = pl.concat([ablation_rows(path, df, model=m, max_rows=args.ablation_rows or None, seed=args.seed)
                         for m, path in sorted(rows.items())])
        table = penalty_table(abl, seed=args.seed, n_boot=args.n_boot)
        with atomic_path(args.out / "penalty_by_definition.parquet", suffix=".parquet") as tmp:
            table.write_parquet(tmp)
        ex = explain(table)
        print("\n".join(["pi(s) vs s/head_dim:", *ex.findings, ex.verdict]))
        claims += penalty_head_dim(ex.verdict, table, args.weights)
        made.append(penalty_vs_head_dim(table, figs / "penalty_vs_head_dim"))
    else:
        print("note: no row datasets given (--rows MODEL=PATH), so pi vs s/head_dim is not checked")
    _common.publish(args, "claim_penalty_trend.py", claims, made, record)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
