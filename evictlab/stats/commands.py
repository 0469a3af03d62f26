"""``evictlab predictor ...``: fit and evaluate dropped-mass predictors of a significant gap.

* ``fit RESULTS... --out predictor.json``: calibrated logistic regression, versioned JSON.
* ``eval predictor.json OTHER_RESULTS...``: ROC AUC per budget with bootstrap CIs (e.g. on
  another model: cross-model transfer), optionally written as Parquet.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from evictlab.cliutil import outputs_written
from evictlab.errors import InputError

predictor_app = typer.Typer(help="Dropped-mass predictors of a significant selection gap (kappa_hat > threshold).",
                            no_args_is_help=True)


def _features(spec: str) -> list[str]:
    from evictlab.stats.predictors import parse_features

    return parse_features(spec)


def _distinct_results(results: list[Path]) -> None:
    """Refuse a results file given twice (same path, or the same bytes under another name).

    A file read twice would enter every row twice: counted twice in an AUC, and in ``fit``
    the copies of a row would be fitted and then tested as if they were new rows.
    """
    from evictlab.io import sha256_file

    seen_path: dict[Path, Path] = {}
    seen_hash: dict[str, Path] = {}
    for p in results:
        if not p.is_file():
            continue  # load_results names a missing file with its own message
        key = p.resolve()
        if key in seen_path:
            twice = f"{p} is given twice" if str(p) == str(seen_path[key]) else f"{seen_path[key]} and {p} are one file"
            raise InputError("RESULTS", twice, "pass each results file once")
        digest = sha256_file(p)
        if digest in seen_hash:
            raise InputError("RESULTS", f"{p} has the same content as {seen_hash[digest]}",
                             "pass each results file once (a copy would enter every row twice)")
        seen_path[key], seen_hash[digest] = p, p


def _print_auc(table, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from evictlab.report.markdown import ci

    t = Table(title=title)
    for col in ("model", "s", "rows", "positives", "AUC [95% CI]", "Brier"):
        t.add_column(col, justify="right")
    for r in table.iter_rows(named=True):
        auc = ci(r["auc"], r["auc_lo"], r["auc_hi"]) if r["auc"] == r["auc"] else "n/a (one class)"
        t.add_row(r["model"], r["s"], str(r["rows"]), str(r["positives"]), auc,
                  "" if r["brier"] != r["brier"] else f"{r['brier']:.4f}")
    Console().print(t)


@predictor_app.command("fit")
def fit(
    results: List[Path] = typer.Argument(..., help="Solver results Parquet file(s) (evictlab solve --out)."),
    out: Path = typer.Option(..., "--out", help="Where to write the predictor JSON."),
    features: str = typer.Option("mass", "--features", help="'mass' (dropped mass alone), 'extended', or a comma list."),
    threshold: float = typer.Option(1.11, "--threshold", help="Label: kappa_hat > threshold."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the train/calibration/test split and the bootstrap."),
    n_boot: int = typer.Option(1000, "--n-boot", min=1, help="Bootstrap resamples for the held-out AUC CIs."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out (and its run record)."),
) -> None:
    """Fit a calibrated logistic regression on RESULTS; report held-out AUC per s; write versioned JSON."""
    from evictlab.io import check_output_file
    from evictlab.record import RunRecord, record_path
    from evictlab.stats.predictors import fit_and_evaluate
    from evictlab.stats.results import load_results

    if not threshold > 0:  # before any file is read (fit_and_evaluate refuses it too)
        raise InputError("--threshold", f"must be positive, got {threshold}", "use e.g. 1.11")
    check_output_file(out, "--out", overwrite=overwrite)
    _distinct_results(results)
    feats = _features(features)
    record = RunRecord(kind="predictor-fit", seed=seed,
                       config={"results": [str(p) for p in results], "features": feats, "threshold": threshold})
    df = load_results(results)
    pred, held = fit_and_evaluate(df, feats, threshold=threshold, seed=seed, n_boot=n_boot,
                                  source=", ".join(map(str, results)))
    pred.save(out)
    record.write(record_path(out), output=str(out))
    outputs_written(out)
    _print_auc(held, f"held-out AUC of {'+'.join(feats)} (label kappa_hat > {threshold})")
    typer.echo(f"wrote {out}")


@predictor_app.command("eval")
def eval_(
    predictor: Path = typer.Argument(..., help="Predictor JSON from `evictlab predictor fit`."),
    results: List[Path] = typer.Argument(..., help="Solver results Parquet file(s) to evaluate on (e.g. another model)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the AUC table as Parquet (with a run record)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Bootstrap seed."),
    n_boot: int = typer.Option(1000, "--n-boot", min=1, help="Bootstrap resamples for the AUC CIs."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out (and its run record)."),
) -> None:
    """ROC AUC (bootstrap 95% CI) and Brier score of a saved predictor on other results, per model and s."""
    from evictlab.io import check_output_file, write_checked_parquet
    from evictlab.record import RunRecord, record_path
    from evictlab.stats.predictors import Predictor, evaluate
    from evictlab.stats.results import load_results

    if out is not None:
        check_output_file(out, "--out", overwrite=overwrite)
    _distinct_results(results)

    record = RunRecord(kind="predictor-eval", seed=seed,
                       config={"predictor": str(predictor), "results": [str(p) for p in results], "n_boot": n_boot})
    pred = Predictor.load(predictor)
    df = load_results(results)
    table = evaluate(pred, df, seed=seed, n_boot=n_boot, source=", ".join(map(str, results)), name=predictor.stem)
    _print_auc(table, f"AUC of {predictor.name} ({'+'.join(pred.features)}, label kappa_hat > {pred.threshold})")
    if out is not None:
        write_checked_parquet(table, out)
        record.write(record_path(out), output=str(out))
        outputs_written(out)
        typer.echo(f"wrote {out}")
