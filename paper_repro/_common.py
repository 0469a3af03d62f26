"""Shared plumbing for the paper_repro scripts: inputs, the claims table, figures folder, run records.

Every script appends (or replaces) its own rows, keyed by claim id and model, in
``<out>/claims.json`` and re-renders ``<out>/claims.md`` (claim, paper value, our value with
CI, model, rows, budgets, definitions). Figures go to the repository's ``figures/`` folder
(``--figures`` changes it).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Iterable

import polars as pl

from evictlab.errors import InputError
from evictlab.io import atomic_write_json
from evictlab.report import markdown as md
from evictlab.report.record import RunRecord
from evictlab.stats.results import load_results


def parser(description: str, needs_results: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    if needs_results:
        p.add_argument("--run", type=Path, default=Path("runs/demo"),
                       help="a finished `evictlab demo` run folder; its results/*.parquet are used (default runs/demo)")
        p.add_argument("--results", type=Path, nargs="*", default=None,
                       help="solver results Parquet file(s) instead of --run")
        p.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
        p.add_argument("--threshold", type=float, default=1.11, help="significant gap: kappa_hat > threshold")
        p.add_argument("--weights", default="weights quantised (Q4 GGUF)",
                       help="how the model weights were stored (printed next to every number)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap / instance seed (default 0)")
    p.add_argument("--out", type=Path, default=Path("runs/paper_repro"), help="output folder (default runs/paper_repro)")
    p.add_argument("--figures", type=Path, default=Path("figures"), help="figures folder (default figures/)")
    return p


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed arguments as JSON-safe values (paths as strings) for the run record."""
    def safe(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [safe(x) for x in v]
        return str(v) if isinstance(v, Path) else v

    return {k: safe(v) for k, v in vars(args).items()}


def results(args: argparse.Namespace) -> pl.DataFrame:
    """The prepared results table named by --results or --run."""
    paths = list(args.results) if args.results else sorted((args.run / "results").glob("*.parquet"))
    if not paths:
        raise InputError("--run", f"no results/*.parquet under {args.run}",
                         "run `make demo` (or `evictlab demo`) first, or pass --results FILE.parquet")
    return load_results(paths)


def figures_dir(args: argparse.Namespace) -> Path:
    d = args.figures
    d.mkdir(parents=True, exist_ok=True)
    return d


def publish(args: argparse.Namespace, script: str, rows: Iterable[Any], figures: Iterable[Any],
            record: RunRecord) -> Path:
    """Upsert this script's claim rows, re-render claims.md, write the run record; return claims.md."""
    store = args.out / "claims.json"
    existing: list[dict[str, Any]] = json.loads(store.read_text()) if store.exists() else []
    new = [dict(r.to_dict(), script=script) for r in rows]
    existing = [r for r in existing if r.get("script") != script] + new
    atomic_write_json(store, existing)
    order = ["claim_selection_ceiling.py", "claim_penalty_trend.py", "claim_auc_range.py", "claim_np_hardness.py"]
    existing.sort(key=lambda r: order.index(r["script"]) if r["script"] in order else 99)
    figs = sorted(args.figures.glob("*.png"))
    text = ["# \"Trust the Mass\" (arXiv 2608.25230): claims reproduced with evictlab\n",
            "Each row: one claim, the paper's value, ours with a 95% percentile-bootstrap CI, and the definitions used "
            "(those marked (ours) are our reconstruction; the paper's full text was not available). Regenerate with "
            "the scripts in `paper_repro/` (see docs/reproduction.md).\n",
            md.claims_table(existing), "## Figures\n"]
    # Links relative to claims.md, wherever --out and --figures point.
    text += [f"![{f.stem}]({os.path.relpath(f.resolve(), args.out.resolve())})\n" for f in figs]
    out = md.write(args.out / "claims.md", text)
    record.write(args.out / f"{Path(script).stem}.run_record.json",
                 figures=[str(f.png) for f in figures], claims=len(new))
    print(f"claims table: {out}")
    return out
