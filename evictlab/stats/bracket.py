"""The selection ceiling bracketed from both sides, per (model, n band, s), and the verdict on 2-5%.

Input: solver results made with ``evictlab solve --search all --bound`` (columns ``es_ls``,
``es_lb``, ``es_bb``, ``lb_status``; optionally ``--certify``: ``cert_lb``, ``cert_status``).
Per row the true ceiling g*(s) = (e(T_s) - ES(s)) / e(T_s) lies in
``[(e_top - upper) / e_top, (e_top - lower) / e_top]`` with ``upper`` the best set known
(``es_bb``: the bound's best set, at most the all-key search's ``es_ls``) and ``lower`` the
largest certified lower bound (``es_lb``, and ``cert_lb`` where the certificate ran;
docs/theory.md, section 5.1). The median being monotone, the median of g* over the rows of
a group lies between the medians of the two ends: the **bracket**.

Per group: the median gap closed by the all-key search (``gap_ls``), the bracket's lower
end (``gap_lo``, from ``es_bb``) and upper end (``gap_ub``), the fraction of rows the bound
closed, each with a prompt-clustered bootstrap interval from the one resampling engine
(:mod:`evictlab.stats.bootstrap`; design :meth:`evictlab.stats.ceilings.Clusters.design`:
prompts, then rows; one set of replicates per group, seeded by ``(seed, group key)``), and
the verdict on the paper's "2-5%" (its upper end :data:`PAPER_HI`):

* ``understated``: the lower end's CI lies above 5% (even the sets we found close more);
* ``holds``: the upper end's CI lies at or below 5% (no selection can close more);
* ``straddles``: otherwise (the bracket, with its intervals, contains 5%).

Rows with e(T_s) = 0 are excluded and counted in ``rows_e_top_zero``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from evictlab.errors import InputError
from evictlab.stats.bootstrap import Estimate, Mean, Median, Stat, bootstrap
from evictlab.stats.ceilings import CLUSTER_LEVELS, Clusters, group_indices

#: The paper's pool-based range of the median gap closed (s = 4..32); the verdict tests its top.
PAPER_RANGE = (0.021, 0.047)
#: "2-5%": the verdict's threshold.
PAPER_HI = 0.05
#: Upper edges of the default n bands (a row with n keys falls in the first band with n <= edge).
N_EDGES: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
VERDICTS = ("understated", "holds", "straddles", "no data")
_EST = ("gap_ls_median", "gap_lo_median", "gap_ub_median", "closed_frac")
#: Columns of :func:`bracket_table` after the group keys (estimates carry ``_lo``/``_hi``).
BRACKET_COLUMNS: tuple[str, ...] = (
    "rows", "rows_e_top_zero", "rows_used", "prompts", "n_min", "n_max", "interval",
    *[f"{e}{suf}" for e in _EST for suf in ("", "_lo", "_hi")], "width", "lb_nodes_median", "verdict",
)


def n_band(n: pl.Expr | str = "n", edges: Sequence[int] = N_EDGES) -> pl.Expr:
    """The n band of each row as text ``"lo-hi"`` (``lo`` = the previous edge + 1), from ``edges``."""
    e = pl.col(n) if isinstance(n, str) else n
    expr = pl.lit(f">{edges[-1]}")
    prev = [0, *edges[:-1]]
    for lo, hi in reversed(list(zip(prev, edges))):
        expr = pl.when(e <= hi).then(pl.lit(f"{lo + 1}-{hi}")).otherwise(expr)
    return expr.alias("n_band")


def check_bracket(df: pl.DataFrame, source: str = "results") -> None:
    """Refuse a table without the all-key search's and the bound's columns (one line, the fix)."""
    missing = [c for c in ("e_top", "es_ls", "es_lb", "es_bb", "lb_status", "s", "n") if c not in df.columns]
    if missing:
        raise InputError(source, f"lacks the columns {missing} of the all-key search and the bound",
                         "solve the rows with `evictlab solve ROWS --keep ... --search all --bound`")
    if df.height == 0:
        raise InputError(source, "the results table is empty", "solve at least one row")


def verdict(lo_lo: float, ub_hi: float, threshold: float = PAPER_HI) -> str:
    """``understated`` (lower end's CI above ``threshold``), ``holds`` (upper end's CI at or
    below it), else ``straddles``; ``no data`` without a finite lower end."""
    if not np.isfinite(lo_lo):
        return "no data"
    if lo_lo > threshold:
        return "understated"
    if np.isfinite(ub_hi) and ub_hi <= threshold:
        return "holds"
    return "straddles"


def _est(prefix: str, e: Estimate) -> dict[str, float]:
    return {prefix: e.value, f"{prefix}_lo": e.lo, f"{prefix}_hi": e.hi}


def bracket_table(
    df: pl.DataFrame, by: Sequence[str] = ("model", "n_band", "s"), *, edges: Sequence[int] = N_EDGES,
    seed: int = 0, n_boot: int = 1000, level: float = 0.95, clusters: Sequence[str] | None = CLUSTER_LEVELS,
    threshold: float = PAPER_HI,
) -> pl.DataFrame:
    """One row per group: the bracket of the median ceiling and the verdict (module docstring).

    ``by`` may name ``n_band`` (computed from ``n`` and ``edges`` when absent) and any column
    of ``df`` (e.g. a ``context`` column the caller added). Columns: the group keys, then
    :data:`BRACKET_COLUMNS`: ``width`` is ``gap_ub_median - gap_lo_median`` (points of the
    gap closed), ``lb_nodes_median`` the bound's nodes.
    """
    check_bracket(df)
    if "n_band" in by and "n_band" not in df.columns:
        df = df.with_columns(n_band("n", edges))
    if "e_top_zero" not in df.columns:
        df = df.with_columns((pl.col("e_top") <= 0.0).alias("e_top_zero"))
    if "model" not in df.columns:
        df = df.with_columns(pl.lit("unknown").alias("model"))
    by = list(by)
    cl = Clusters.of(df, clusters)
    f64 = {c: df[c].cast(pl.Float64).fill_null(np.nan).to_numpy() for c in ("e_top", "es_ls", "es_lb", "es_bb")}
    lower = f64["es_lb"].copy()
    if "cert_lb" in df.columns:  # the certificate's bound, where it ran, may be the larger one
        cert = df["cert_lb"].cast(pl.Float64).fill_null(np.nan).to_numpy()
        lower = np.where(np.isfinite(cert), np.fmax(lower, cert), lower)
    upper = np.fmin(f64["es_bb"], f64["es_ls"])
    et = f64["e_top"]
    zero = df["e_top_zero"].to_numpy() | ~(et > 0.0)
    closed = (df["lb_status"].cast(pl.Utf8) == "closed").to_numpy()
    nodes = df["lb_nodes"].cast(pl.Float64).to_numpy() if "lb_nodes" in df.columns else None
    n_all = df["n"].to_numpy()
    rows: list[dict[str, object]] = []
    for key, idx in group_indices(df, by):
        keyd = dict(zip(by, key))
        tag = "|".join(f"{k}={v}" for k, v in keyd.items())
        nz = idx[~zero[idx]]
        row: dict[str, object] = {**keyd, "rows": idx.size, "rows_e_top_zero": int(idx.size - nz.size),
                                  "rows_used": nz.size}
        row["prompts"] = int(np.unique(cl.prompt[nz]).size) if cl.prompt is not None else nz.size
        row["n_min"] = int(n_all[idx].min())
        row["n_max"] = int(n_all[idx].max())
        design = cl.design(nz)
        row["interval"] = design.describe()
        if nz.size:
            e = et[nz]
            stats: dict[str, Stat] = {
                "gap_ls_median": Median((e - f64["es_ls"][nz]) / e),
                "gap_lo_median": Median((e - upper[nz]) / e),
                "gap_ub_median": Median((e - lower[nz]) / e),
                "closed_frac": Mean(closed[nz].astype(float)),
            }
            for name, est in bootstrap(stats, design, seed=seed, key=tag, n_boot=n_boot, level=level).items():
                row.update(_est(name, est))
            row["lb_nodes_median"] = float(np.median(nodes[nz])) if nodes is not None else float("nan")
        for name in _EST:
            for suf in ("", "_lo", "_hi"):
                row.setdefault(name + suf, float("nan"))
        row.setdefault("lb_nodes_median", float("nan"))
        row["width"] = float(row["gap_ub_median"]) - float(row["gap_lo_median"])  # type: ignore[arg-type]
        row["verdict"] = verdict(float(row["gap_lo_median_lo"]), float(row["gap_ub_median_hi"]),  # type: ignore[arg-type]
                                 threshold)
        rows.append(row)
    return pl.DataFrame(rows).select(*by, *BRACKET_COLUMNS)
