"""Claim: the best subset closes only a median 2-5% of the gap -- tested beyond the candidate pool.

The paper's ceiling is a pool optimum, a lower bound on what selection can do. This script
reads solver results made with the all-key search (and, where available, the certificate):

    evictlab solve ROWS --keep 4 8 16 32 --search all --out R.parquet            # any n
    evictlab solve ROWS --keep 2 4 8 --search all --certify --out C.parquet      # n <= 256

and writes, per (model, s), the median gap closed by the pool, the all-key search and the
certified optimum on the same rows with prompt-clustered bootstrap CIs (prompts, then
rows; the shared engine evictlab.stats.bootstrap), the fraction of rows where the pool
misses, the certificate's closure rate and interval widths, and the verdict on the 2-5% claim, to the claims table; the summary table
to ``<out>/ceiling_beyond_pool.parquet``; and the figure (pool vs all-key gap, per s) to
``figures/``. It prints how many rows it used.

    .venv/bin/python paper_repro/claim_ceiling_beyond_pool.py --results R.parquet [C.parquet ...]
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import _common
import polars as pl

from evictlab.errors import InputError
from evictlab.io import atomic_path
from evictlab.plots.beyond_pool import gap_pool_vs_allkey
from evictlab.record import RunRecord
from evictlab.stats.beyond_pool import beyond_pool_claims, check_beyond_pool, summarize_beyond_pool


def _load(args) -> list[tuple[str, pl.DataFrame]]:
    """``(path, table)`` per results file, each checked for the all-key columns."""
    if args.results:
        paths = list(args.results)
    else:  # a finished `evictlab demo` run: its main results and certification pass (inputs.json)
        inputs = args.run / "inputs.json"
        named = json.loads(inputs.read_text()) if inputs.is_file() else {}
        paths = [Path(p) for kind in ("results", "certified") for p in named.get(kind, {}).values()] \
            or sorted((args.run / "results").glob("*.parquet"))
    if not paths:
        raise InputError("--results", "no results files given",
                         "pass --results R.parquet (made with `evictlab solve ... --search all`)")
    out = []
    for p in paths:
        if not p.exists():
            raise InputError(str(p), "no such results file", "run `evictlab solve ROWS ... --search all` first")
        df = pl.read_parquet(p)
        check_beyond_pool(df, str(p))
        out.append((str(p), df))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args(argv)
    record = RunRecord(kind="paper-repro-ceiling-beyond-pool", seed=args.seed, config=_common.config(args))
    figs = _common.figures_dir(args)
    weights = None if args.weights == "weights quantised (Q4 GGUF)" else args.weights
    summaries, made, claims = [], [], []
    # One summary per results file: a --certify run on short rows and a --search all run on
    # long rows are different row sets, never pooled.
    files = _load(args)
    for path, df in files:
        summary = summarize_beyond_pool(df, ("model", "s"), seed=args.seed, n_boot=args.n_boot)
        name = "ceiling_beyond_pool" if len(files) == 1 else f"ceiling_beyond_pool_{Path(path).stem}"
        made.append(gap_pool_vs_allkey(df, summary, figs / name))
        for c in beyond_pool_claims(summary, weights):
            claims.append(replace(c, rows=f"{c.rows}; {path}"))
        summaries.append(summary.with_columns(pl.lit(path).alias("results_file")))
        n_clusters = df.select("model", "prompt_id").n_unique() if "prompt_id" in df.columns else df.height
        print(f"{path}: {int(summary['rows_used'].sum()):,} (row, s) pairs used from {n_clusters} (model, prompt) "
              f"clusters; {int(summary['rows_e_top_zero'].sum())} with e(T_s) = 0 excluded; "
              f"{int(summary['rows_certified'].sum()):,} certified optimal")
        cols = [c for c in ("model", "s", "rows_used", "prompts", "gap_pool_median", "gap_ls_median",
                            "pool_miss_frac", "rows_certified", "gap_cert_median", "cert_closed_frac",
                            "open_width_median", "ceiling_lo_median", "ceiling_hi_median")]
        with pl.Config(tbl_rows=100, tbl_cols=20, tbl_width_chars=260, float_precision=3):
            print(summary.select(cols))
    args.out.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out / "ceiling_beyond_pool.parquet", suffix=".parquet") as tmp:
        pl.concat(summaries, how="diagonal_relaxed").write_parquet(tmp)
    _common.publish(args, "claim_ceiling_beyond_pool.py", claims, made, record)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
