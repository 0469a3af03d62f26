"""Shared plumbing for the paper_repro scripts: inputs, the claims table, figures folder, run records.

Inputs: each script reads exactly the rows its claim uses. From a finished ``evictlab demo``
run (``--run``), the run's ``inputs.json`` names them: ``results`` (the main solver results,
one file per model), ``rows`` (the row datasets they were solved from) and ``certified``
(the certification pass, its own claim, never pooled with the main results). ``--results``
overrides the run. Every script prints, records and tabulates how many (row, s) pairs it read.

Every script appends (or replaces) its own rows, keyed by claim id and model, in
``<out>/claims.json`` and re-renders ``<out>/claims.md`` (claim, paper value, our value with
CI and its interval method, model, rows, budgets, definitions). Figures go to the
repository's ``figures/`` folder (``--figures`` changes it).
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
from evictlab.record import RunRecord
from evictlab.stats.results import load_results


def parser(description: str, needs_results: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    if needs_results:
        p.add_argument("--run", type=Path, default=Path("runs/demo"),
                       help="a finished `evictlab demo` run folder; its results/*.parquet are used (default runs/demo)")
        p.add_argument("--results", type=Path, nargs="*", default=None,
                       help="solver results Parquet file(s) instead of --run")
        p.add_argument("--rows", nargs="*", default=None, metavar="MODEL=PATH",
                       help="row datasets of those results (default: the run's inputs.json), for pi(s) vs s/head_dim")
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


def _run_inputs(run: Path) -> dict[str, Any] | None:
    path = run / "inputs.json"
    return json.loads(path.read_text()) if path.is_file() else None


def results(args: argparse.Namespace, kind: str = "results") -> pl.DataFrame:
    """The prepared results table the claim reads: ``--results``, else the run's ``kind`` inputs
    (``results``: main results; ``certified``: the certification pass). Prints the count and
    remembers it (``args.read``) for the claims table and the run record."""
    if args.results:
        paths = list(args.results)
    else:
        inputs = _run_inputs(args.run)
        if inputs is not None:
            paths = [Path(p) for p in inputs.get(kind, {}).values()]
        else:  # runs from before inputs.json: certified files were named certified-<model>.parquet
            every = sorted((args.run / "results").glob("*.parquet"))
            paths = [p for p in every if p.name.startswith("certified-") == (kind == "certified")]
    if not paths:
        raise InputError("--run", f"no {kind} results under {args.run}",
                         "run `make demo` (or `evictlab demo`) first, or pass --results FILE.parquet")
    df = load_results(paths)
    args.read = {"pairs": df.height, "files": [str(p) for p in paths]}
    print(f"read {df.height:,} (row, s) pairs ({kind}) from {', '.join(map(str, paths))}")
    return df


def rows(args: argparse.Namespace) -> dict[str, Path]:
    """Model -> row dataset of the main results: ``--rows MODEL=PATH ...``, else the run's inputs (may be empty)."""
    given = getattr(args, "rows", None)
    if given:
        out = {}
        for item in given:
            model, sep, path = item.partition("=")
            if not sep or not model or not path:
                raise InputError("--rows", f"{item!r} is not MODEL=PATH", "e.g. --rows smollm2-135m=runs/cache/rows/...")
            out[model] = Path(path)
        return out
    inputs = None if args.results else _run_inputs(args.run)
    return {m: Path(p) for m, p in (inputs or {}).get("rows", {}).items()}


def figures_dir(args: argparse.Namespace) -> Path:
    d = args.figures
    d.mkdir(parents=True, exist_ok=True)
    return d


def publish(args: argparse.Namespace, script: str, claim_rows: Iterable[Any], figures: Iterable[Any],
            record: RunRecord) -> Path:
    """Upsert this script's claim rows, re-render claims.md, write the run record; return claims.md."""
    store = args.out / "claims.json"
    existing: list[dict[str, Any]] = json.loads(store.read_text()) if store.exists() else []
    new = [dict(r.to_dict(), script=script) for r in claim_rows]
    existing = [r for r in existing if r.get("script") != script] + new
    atomic_write_json(store, existing)
    order = ["claim_selection_ceiling.py", "claim_penalty_trend.py", "claim_auc_range.py", "claim_certified_pool.py",
             "claim_np_hardness.py"]
    existing.sort(key=lambda r: order.index(r["script"]) if r["script"] in order else 99)
    figs = sorted(args.figures.glob("*.png"))
    text = ["# \"Trust the Mass\" (arXiv 2608.25230): claims reproduced with evictlab\n",
            "Each row: one claim, the paper's value, ours with a 95% percentile-bootstrap CI (the interval method "
            "column says what was resampled: prompts, then rows; models first for pooled rows), and the definitions used "
            "(those marked (ours) are our reconstruction; the paper's full text was not available). Regenerate with "
            "the scripts in `paper_repro/` (see docs/reproduction.md).\n",
            md.claims_table(existing), "## Figures\n"]
    # Links relative to claims.md, wherever --out and --figures point.
    text += [f"![{f.stem}]({os.path.relpath(f.resolve(), args.out.resolve())})\n" for f in figs]
    reads = json.loads(reads_path.read_text()) if (reads_path := args.out / "inputs_read.json").exists() else {}
    if hasattr(args, "read"):
        reads[script] = args.read
    atomic_write_json(reads_path, reads)
    if reads:  # scripts that read rows say how many; a grid script reads its own grid
        text.insert(2, "## What each script read\n\n" + "".join(
            f"- `{s}`: {r['pairs']:,} (row, s) pairs" + (f" from {', '.join(f'`{f}`' for f in r['files'])}" if r["files"] else "")
            + "\n" for s, r in sorted(reads.items())))
    out = md.write(args.out / "claims.md", text)
    record.write(args.out / f"{Path(script).stem}.run_record.json",
                 figures=[str(f.png) for f in figures], claims=len(new), read=getattr(args, "read", None))
    print(f"claims table: {out}")
    return out


def entry(main: Any) -> None:
    """Run a script's ``main()`` as its ``__main__``: its return value is the exit code; bad
    input (:class:`InputError`) is one line naming the input and the fix, exit 2; Ctrl-C is one
    line, exit 130 (the shell's code for SIGINT), never a traceback. Files the script wrote are
    whole either way (every write is atomic); what it was computing is not written."""
    import sys

    try:
        code = main()
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): the files written before it are complete; the step in progress was not "
              "written. Rerun the same command to finish.", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(code)
