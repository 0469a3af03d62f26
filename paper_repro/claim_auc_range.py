"""Claim: dropped mass predicts a significant gap (kappa_hat > 1.11) with ROC AUC 0.76-0.89.

Reads the main solver results only and writes the AUC of the raw dropped mass per (model, s),
pooled over s, and pooled over models when there are several, with prompt-clustered
bootstrap CIs, to the claims table; ROC curves (raw mass, and the calibrated mass-only logistic regression
on held-out rows) and the mass-vs-kappa scatter to figures/.

    .venv/bin/python paper_repro/claim_auc_range.py [--run runs/demo | --results R.parquet ...]
"""

from __future__ import annotations


import polars as pl

import _common

from evictlab.errors import InputError
from evictlab.plots.mass_kappa import mass_vs_kappa
from evictlab.plots.roc import roc_curves, roc_table
from evictlab.record import RunRecord
from evictlab.stats.claims import auc_range
from evictlab.stats.predictors import FEATURE_SETS, auc_by_group, fit_predictor, label
from evictlab.stats.results import split_zero


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    record = RunRecord(kind="paper-repro-auc", seed=args.seed, config=_common.config(args))
    df = _common.results(args)
    auc = auc_by_group(df, "dropped_mass", threshold=args.threshold, seed=args.seed, n_boot=args.n_boot,
                       name="dropped mass (raw)")
    if df["model"].n_unique() > 1:  # pooled over models: models, then prompts, then rows resampled
        auc = pl.concat([auc, auc_by_group(df, "dropped_mass", threshold=args.threshold, seed=args.seed,
                                           n_boot=args.n_boot, by=("s",), name="dropped mass (raw)")],
                        how="diagonal_relaxed")
    used, _ = split_zero(df)
    parts = [used.select(pl.lit("dropped mass (raw)").alias("predictor"), "model", pl.col("s").cast(pl.Utf8),
                         (pl.col("kappa_hat") > args.threshold).alias("y"), pl.col("dropped_mass").alias("score"))]
    for m in sorted(df["model"].unique().to_list()):
        try:
            pred, test = fit_predictor(df.filter(pl.col("model") == m), FEATURE_SETS["mass"],
                                       threshold=args.threshold, seed=args.seed)
        except InputError as exc:
            print(f"note: no fitted predictor for {m}: {exc}")
            continue
        parts.append(test.select(pl.lit("mass LR (held-out)").alias("predictor"), "model", pl.col("s").cast(pl.Utf8))
                     .with_columns(pl.Series("y", label(test, args.threshold)), pl.Series("score", pred.score_table(test))))
    figs = _common.figures_dir(args)
    made = [roc_curves(roc_table(pl.concat(parts)), figs / "auc_roc", args.threshold),
            mass_vs_kappa(df, figs / "auc_mass_vs_kappa", args.threshold, seed=args.seed)]
    _common.publish(args, "claim_auc_range.py", auc_range(auc, args.weights, args.threshold), made, record)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
