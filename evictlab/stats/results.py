"""Reading and checking solver results (the contract in docs/architecture.md, "Solver results").

One row per (row_id, s). This module validates the columns stats/ needs, adds the derived
columns every statistic shares, and separates rows whose top-mass error is zero (their gap
closed is undefined: 0/0), so they are counted and reported, never silently dropped.
"""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl

from evictlab.errors import InputError
from evictlab.io import read_checked_parquet

#: Columns every statistic needs.
REQUIRED = (
    "row_id", "s", "n", "e_top", "es_hat", "e_bal", "gap_closed", "kappa_hat",
    "dropped_mass", "e_free_top", "e_free_opt", "pi_top", "pi_opt", "layer",
)
#: Optional columns used when present.
OPTIONAL = ("model", "entropy", "q_head", "kv_head", "prompt_id", "position",
            "e_top_zero", "es_cert", "cert_status")

#: Relative tolerance when comparing two errors computed by different routines.
REL_TOL = 1e-9
#: Absolute floor of that tolerance (errors are O(1) values' norms).
ABS_TOL = 1e-12


def load_results(path: str | os.PathLike[str] | list[str | os.PathLike[str]]) -> pl.DataFrame:
    """Read one or several results Parquet files (concatenated) and check their columns."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    frames = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise InputError(str(p), "no such results file", "run `evictlab solve ROWS --out RESULTS.parquet` first")
        # the checksum written by `evictlab solve` is verified; a file without one (an older
        # evictlab) is read after a one-line warning
        frames.append(read_checked_parquet(p, "re-run `evictlab solve` to rewrite it"))
    df = pl.concat(frames, how="diagonal_relaxed") if len(frames) > 1 else frames[0]
    return prepare(df, source=", ".join(str(p) for p in paths))


def prepare(df: pl.DataFrame, source: str = "results") -> pl.DataFrame:
    """Check required columns and add the derived ones stats/ uses.

    Adds (or normalises): ``model`` (``"unknown"`` when absent), ``head`` (``q_head`` or -1),
    ``e_top_zero`` (from ``e_top == 0`` when absent), ``bal_gap_closed`` =
    (e_top - e_bal)/e_top, ``bal_reaches_opt`` = e_bal equals ES_hat to tolerance, and
    ``depth`` = layer / max layer of that model (0 for a single-layer model).
    """
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise InputError(source, f"missing solver-result columns {missing}",
                         "produce the table with `evictlab solve` (see docs/architecture.md, 'Solver results')")
    if df.height == 0:
        raise InputError(source, "the results table is empty", "solve at least one row")
    if "model" not in df.columns:
        df = df.with_columns(pl.lit("unknown").alias("model"))
    if "q_head" not in df.columns:
        df = df.with_columns(pl.lit(-1, dtype=pl.Int64).alias("q_head"))
    if "e_top_zero" not in df.columns:
        df = df.with_columns((pl.col("e_top") <= 0.0).alias("e_top_zero"))
    tol = pl.max_horizontal(pl.col("es_hat").abs() * REL_TOL, pl.lit(ABS_TOL))
    max_layer = pl.col("layer").max().over("model")
    df = df.with_columns(
        pl.col("model").cast(pl.Utf8),
        pl.col("s").cast(pl.Int64),
        pl.col("layer").cast(pl.Int64),
        pl.col("q_head").cast(pl.Int64).alias("head"),
        pl.when(pl.col("e_top") > 0)
        .then((pl.col("e_top") - pl.col("e_bal")) / pl.col("e_top"))
        .otherwise(None)
        .alias("bal_gap_closed"),
        (pl.col("e_bal") <= pl.col("es_hat") + tol).alias("bal_reaches_opt"),
        pl.when(max_layer > 0).then(pl.col("layer") / max_layer).otherwise(0.0).alias("depth"),
    )
    return df


def split_zero(df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(rows with e_top > 0, rows with e_top = 0). The second are counted, not analysed."""
    zero = df.filter(pl.col("e_top_zero") | (pl.col("e_top") <= 0.0))
    keep = df.filter(~(pl.col("e_top_zero") | (pl.col("e_top") <= 0.0)))
    return keep, zero


def zero_counts(df: pl.DataFrame, by: tuple[str, ...] = ("model", "s")) -> pl.DataFrame:
    """Rows with e_top = 0 per group, beside all rows of that group."""
    return (
        df.group_by(list(by))
        .agg(
            pl.len().alias("rows"),
            (pl.col("e_top_zero") | (pl.col("e_top") <= 0.0)).sum().alias("rows_e_top_zero"),
        )
        .sort(list(by))
    )
