"""The README's picture of the main job: the selection-ceiling figure and an excerpt of the claims table.

Reads a finished `evictlab demo` run (default runs/demo) and writes, under figures/:

    readme_selection_ceiling.png   median gap closed per model and s (and pooled), clustered CIs, paper range
    readme_claims.md               the claims table's headline rows (ceiling, penalty vs s/head_dim, AUC)

Regenerate after `make demo` with

    .venv/bin/python paper_repro/readme_figures.py [--run runs/demo] [--figures figures]

and paste `figures/readme_claims.md` into the README's "What `make demo` produces" section
(tests/test_readme.py checks that the two agree).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

from evictlab.io import atomic_write_text
from evictlab.plots.gap import gap_closed_medians
from evictlab.report import markdown as md

#: Claim rows shown in the README: pooled and per-model ceilings at the smallest and largest
#: budget, the pi(s) trend and our s/head_dim check, and the pooled AUC over all budgets.
EXCERPT_COLUMNS = ("claim", "model", "budgets", "paper_value", "our_value", "interval", "verdict")
EXCERPT_HEADERS = ("claim", "model", "budgets", "paper", "ours [95% CI]", "interval method", "paper vs ours")


def excerpt(claims: pl.DataFrame) -> pl.DataFrame:
    """The README's rows of a claims table (see :data:`EXCERPT_COLUMNS`)."""
    budgets = sorted({b for b in claims["budgets"].to_list() if b.startswith("s=") and b[2:].isdigit()}, key=lambda b: int(b[2:]))
    ends = {budgets[0], budgets[-1]} if budgets else set()
    keep = (
        ((pl.col("claim_id") == "ceiling") & pl.col("budgets").is_in(list(ends)))
        | pl.col("claim_id").is_in(["penalty-trend", "penalty-head-dim"])
        | ((pl.col("claim_id") == "auc") & (pl.col("budgets") == "s=all"))
        | ((pl.col("claim_id") == "auc") & pl.col("model").str.starts_with("pooled") & pl.col("budgets").is_in(list(ends)))
        | (pl.col("claim_id") == "np-hardness")
    )
    out = claims.filter(keep).with_columns(pl.col("model").str.replace(r" \([^()]*\)$", ""))  # drop the weights note
    return out.select(EXCERPT_COLUMNS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, default=Path("runs/demo"), help="a finished `evictlab demo` run (default runs/demo)")
    p.add_argument("--figures", type=Path, default=Path("figures"), help="output folder (default figures/)")
    args = p.parse_args(argv)
    tables = args.run / "tables"
    if not (tables / "claims.parquet").is_file():
        raise SystemExit(f"error: {tables / 'claims.parquet'} not found; run `make demo` first (or pass --run)")
    summary = pl.read_parquet(tables / "summary_model_s.parquet")
    if (tables / "summary_pooled_s.parquet").is_file():
        summary = pl.concat([summary, pl.read_parquet(tables / "summary_pooled_s.parquet")], how="diagonal_relaxed")
    fig = gap_closed_medians(summary, args.figures / "readme_selection_ceiling", dpi=100)
    fig.pdf.unlink(missing_ok=True)  # the README shows the PNG only; the run keeps both
    claims = pl.read_parquet(tables / "claims.parquet")
    text = md.table(excerpt(claims), EXCERPT_COLUMNS, EXCERPT_HEADERS)
    atomic_write_text(args.figures / "readme_claims.md", text)
    print(f"wrote {fig.png} ({fig.png.stat().st_size / 1024:.0f} KiB) and {args.figures / 'readme_claims.md'}")
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
