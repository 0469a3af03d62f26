"""The selection ceiling beyond the candidate pool: pool vs all-key search vs certified optimum.

Input: solver results made with ``evictlab solve --search all`` (columns ``es_ls``,
``gap_closed_ls``) and optionally ``--certify`` (``es_cert``, ``cert_status``, ``cert_lb``).
Per group (default ``(model, s)``), on the **same rows** (``docs/statistics.md``, "Beyond
the pool"):

* the median gap closed by the pool optimum ES_hat and by the all-key search ES_ls, and the
  fraction of rows where the pool misses a better set (``es_ls < es_hat``);
* on the certified rows (``cert_status == "optimal"``): the median gap closed by the pool,
  the all-key search and the certified optimum ES(s), the fraction where the pool misses the
  optimum and the fraction where the all-key search reaches it;
* over every row the certificate attempted (optimal or limit): the fraction closed, the
  relative widths ``(es_cert - cert_lb) / es_cert`` of the open intervals, and a bracket for
  the median of the true ceiling g*(s) = (e(T_s) - ES(s)) / e(T_s): each row's g* lies in
  ``[(e_top - es_cert) / e_top, (e_top - cert_lb) / e_top]``, so the median of g* lies
  between the medians of the two endpoints.

Rows of one prompt are not independent: every interval comes from the shared resampling
engine (:mod:`evictlab.stats.bootstrap`) with the design of
:meth:`evictlab.stats.ceilings.Clusters.design`: prompts, then rows within the drawn prompts
(models first when a group spans several models), one set of replicates per group shared by
all its statistics (the certified-row statistics are masked views of the same resamples),
seeded by ``(seed, group key)``. Each summary row names its design in ``interval``. Rows with
e(T_s) = 0 are excluded from every ratio and counted in ``rows_e_top_zero``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from evictlab.errors import InputError
from evictlab.report.markdown import ci
from evictlab.stats.bootstrap import Estimate, Mean, Median, Stat, bootstrap
from evictlab.stats.ceilings import CLUSTER_LEVELS, Clusters, group_indices
from evictlab.stats.claims import ClaimRow, weights_for
from evictlab.stats.results import ABS_TOL, REL_TOL

#: The paper's range of median gap closed over s = 4..32 (pool-based).
PAPER_RANGE = (0.021, 0.047)
#: Statuses of the certificate that count as proved optimal.
OPTIMAL = "optimal"
_EST = ("gap_pool_median", "gap_ls_median", "pool_miss_frac", "gap_pool_cert_median", "gap_ls_cert_median",
        "gap_cert_median", "pool_miss_cert_frac", "ls_optimal_frac", "cert_closed_frac", "ceiling_lo_median",
        "ceiling_hi_median")
#: Columns of :func:`summarize_beyond_pool` after the group keys, in order (estimates carry
#: ``_lo``/``_hi`` CI columns).
SUMMARY_COLUMNS: tuple[str, ...] = (
    "rows", "rows_e_top_zero", "rows_used", "prompts", "interval", "rows_certified", "rows_cert_attempted",
    *[f"{e}{suf}" for e in _EST for suf in ("", "_lo", "_hi")],
    "open_width_median", "open_width_max", "cert_nodes_median",
)


def _est(prefix: str, e: Estimate) -> dict[str, float]:
    return {prefix: e.value, f"{prefix}_lo": e.lo, f"{prefix}_hi": e.hi}


def check_beyond_pool(df: pl.DataFrame, source: str = "results") -> None:
    """Refuse a table without the all-key search's columns (one line naming the fix)."""
    missing = [c for c in ("es_ls", "es_hat", "e_top", "s") if c not in df.columns]
    if missing:
        raise InputError(source, f"lacks the columns {missing} of the all-key search",
                         "solve the rows with `evictlab solve ROWS --keep ... --search all [--certify]`")
    if df.height == 0:
        raise InputError(source, "the results table is empty", "solve at least one row")


def summarize_beyond_pool(
    df: pl.DataFrame, by: Sequence[str] = ("model", "s"), *, seed: int = 0, n_boot: int = 1000,
    level: float = 0.95, clusters: Sequence[str] | None = CLUSTER_LEVELS,
) -> pl.DataFrame:
    """One row per group with the statistics of the module docstring (columns below).

    Columns (``_lo``/``_hi``: the CI of ``interval``'s design): ``rows, rows_e_top_zero,
    rows_used, prompts, interval``; ``gap_pool_median, gap_ls_median, pool_miss_frac`` (all
    rows used); ``rows_certified, gap_pool_cert_median, gap_ls_cert_median, gap_cert_median,
    pool_miss_cert_frac, ls_optimal_frac`` (certified rows); ``rows_cert_attempted,
    cert_closed_frac, open_width_median, open_width_max, ceiling_lo_median,
    ceiling_hi_median, cert_nodes_median`` (rows the certificate attempted). Certificate
    columns are NaN (counts 0) without ``--certify``. ``clusters``: the cluster levels
    (:data:`evictlab.stats.ceilings.CLUSTER_LEVELS`; None = row bootstrap).
    """
    check_beyond_pool(df)
    if "e_top_zero" not in df.columns:
        df = df.with_columns((pl.col("e_top") <= 0.0).alias("e_top_zero"))
    if "model" not in df.columns:
        df = df.with_columns(pl.lit("unknown").alias("model"))
    by = list(by)
    cl = Clusters.of(df, clusters)
    et_all, eh_all, el_all = (df[c].cast(pl.Float64).to_numpy() for c in ("e_top", "es_hat", "es_ls"))
    zero_all = df["e_top_zero"].to_numpy() | (et_all <= 0.0)
    has_cert = "es_cert" in df.columns and "cert_status" in df.columns
    if has_cert:
        st_all = df["cert_status"].cast(pl.Utf8).fill_null("").to_numpy()
        ec_all = df["es_cert"].cast(pl.Float64).fill_null(np.nan).to_numpy()
        lb_all = (df["cert_lb"].cast(pl.Float64).fill_null(np.nan).to_numpy() if "cert_lb" in df.columns
                  else np.where(st_all == OPTIMAL, ec_all, np.nan))
        nodes_all = df["cert_nodes"].cast(pl.Float64).to_numpy() if "cert_nodes" in df.columns else None
    rows: list[dict[str, object]] = []
    for key, idx in group_indices(df, by):
        keyd = dict(zip(by, key))
        tag = "|".join(f"{k}={v}" for k, v in keyd.items())
        nz = idx[~zero_all[idx]]
        design = cl.design(nz)
        et, eh, el = et_all[nz], eh_all[nz], el_all[nz]
        tol = np.maximum(np.abs(eh) * REL_TOL, ABS_TOL)
        prompts = int(np.unique(cl.prompt[nz]).size) if cl.prompt is not None else nz.size
        row: dict[str, object] = {**keyd, "rows": idx.size, "rows_e_top_zero": int(idx.size - nz.size),
                                  "rows_used": nz.size, "prompts": prompts, "interval": design.describe()}
        stats: dict[str, Stat] = {
            "gap_pool_median": Median((et - eh) / et),
            "gap_ls_median": Median((et - el) / et),
            "pool_miss_frac": Mean((el < eh - tol).astype(float)),
        }
        row["rows_certified"] = row["rows_cert_attempted"] = 0
        width = np.zeros(0)
        if has_cert:
            st, ec, lb = st_all[nz], ec_all[nz], lb_all[nz]
            opt = st == OPTIMAL
            att = opt | (st == "limit")
            row["rows_certified"], row["rows_cert_attempted"] = int(opt.sum()), int(att.sum())
            # certified-row statistics are masked views of the same resamples (a resample with
            # no certified row gives NaN, dropped)
            ec0, lb0 = np.where(att, ec, 0.0), np.where(att, lb, 0.0)
            if opt.any():
                stats.update({
                    "gap_pool_cert_median": Median((et - eh) / et, opt),
                    "gap_ls_cert_median": Median((et - el) / et, opt),
                    "gap_cert_median": Median((et - ec0) / et, opt),
                    "pool_miss_cert_frac": Mean((ec0 < eh - tol).astype(float), opt),
                    "ls_optimal_frac": Mean((el <= ec0 + np.maximum(np.abs(ec0) * REL_TOL, ABS_TOL)).astype(float),
                                            opt),
                })
            if att.any():
                stats.update({
                    "cert_closed_frac": Mean(opt.astype(float), att),
                    "ceiling_lo_median": Median((et - ec0) / et, att),
                    "ceiling_hi_median": Median((et - lb0) / et, att),
                })
                open_ = att & ~opt
                width = np.where(ec > 0, (ec - lb) / np.where(ec > 0, ec, 1.0), 0.0)[open_]
                row["open_width_median"] = float(np.median(width)) if width.size else 0.0
                row["open_width_max"] = float(width.max()) if width.size else 0.0
                if nodes_all is not None:
                    row["cert_nodes_median"] = float(np.median(nodes_all[nz][att]))
        for name, e in bootstrap(stats, design, seed=seed, key=tag, n_boot=n_boot, level=level).items():
            row.update(_est(name, e))
        for name in _EST:
            for suf in ("", "_lo", "_hi"):
                row.setdefault(name + suf, float("nan"))
        for name in ("open_width_median", "open_width_max", "cert_nodes_median"):
            row.setdefault(name, float("nan"))
        rows.append(row)
    return pl.DataFrame(rows).select(*by, *SUMMARY_COLUMNS)


def _fmt(r: dict[str, object], name: str, d: int = 3) -> str:
    return ci(*(float(r[name + s]) for s in ("", "_lo", "_hi")), d)  # type: ignore[arg-type]


def ceiling_verdict(r: dict[str, object], paper: tuple[float, float] = PAPER_RANGE) -> str:
    """The verdict on the paper's 2-5% claim for one (model, s) summary row, stated either way.

    The paper's number is a pool optimum, so it bounds the ceiling from below. The all-key
    search gives a higher lower bound; the certificate (where it ran) an upper bound:

    * all-key CI entirely above the paper's range: the claim **understates** the ceiling;
    * certified bracket (upper end's CI) within or below the range: the claim **holds** for
      the true optimum on these rows;
    * all-key CI inside or overlapping the range and no certified upper end: **consistent**
      (the lower bound agrees; the true ceiling is not bracketed);
    * all-key CI entirely below the range: ours **below** the paper.
    """
    p_lo, p_hi = paper
    ls_lo, ls_hi = float(r["gap_ls_median_lo"]), float(r["gap_ls_median_hi"])  # type: ignore[arg-type]
    up_hi = float(r.get("ceiling_hi_median_hi", float("nan")))  # type: ignore[arg-type]
    if not np.isfinite(ls_lo):
        return "no data"
    if ls_lo > p_hi:
        return (f"understated: even the all-key search's median (a lower bound on the ceiling) is above "
                f"{p_hi:.3f}")
    if np.isfinite(up_hi) and up_hi <= p_hi:
        if ls_hi < p_lo:
            return f"below: the certified ceiling's median is below {p_lo:.3f}"
        return f"holds: the certified bracket of the median ceiling lies within or below {p_hi:.3f}"
    if ls_hi < p_lo:
        return f"below: the all-key median is below {p_lo:.3f} (the true ceiling is not bracketed)"
    return "consistent: the all-key median overlaps 2-5%; the true ceiling is not bracketed from above"


def beyond_pool_claims(summary: pl.DataFrame, weights_note: str | None = None) -> list[ClaimRow]:
    """Claims-table rows: the paper's 2-5% against pool, all-key and certified medians.

    ``weights_note``: the weights text when a model is not in the registry (default: the
    registry's). A ``pass`` column (the main job's summaries) is named in the rows text.
    """
    out = []
    keys = [c for c in ("pass", "model", "s") if c in summary.columns]
    for r in summary.sort(keys).iter_rows(named=True):
        ours = (f"pool {_fmt(r, 'gap_pool_median')}; all-key {_fmt(r, 'gap_ls_median')}; "
                f"pool misses {_fmt(r, 'pool_miss_frac')}")
        if r["rows_cert_attempted"]:
            ours += (f"; certified {_fmt(r, 'gap_cert_median')} on {r['rows_certified']:,} rows "
                     f"({float(r['cert_closed_frac']):.1%} closed); median ceiling in "
                     f"[{float(r['ceiling_lo_median']):.3f}, {float(r['ceiling_hi_median']):.3f}]")
        out.append(ClaimRow(
            "ceiling_beyond_pool", "best subset closes only a median 2-5% of the top-mass gap (beyond the pool)",
            "0.021-0.047 (s=4..32; pool-based)", ours, ceiling_verdict(r), str(r["model"]),
            f"{int(r['rows_used']):,} rows from {int(r['prompts'])} prompts; {int(r['rows_e_top_zero'])} with "
            f"e(T_s)=0 excluded" + (f" ({r['pass']})" if r.get("pass") else ""), f"s={r['s']}",
            "ES_hat: pool C_s(2, 2) (ours); ES_ls: all-key single/pair-swap search (ours, an upper bound on ES); "
            "ES(s): branch and bound with lower bound; 95% percentile CIs; "
            + (weights_for(str(r["model"]), weights_note) if weights_note else weights_for(str(r["model"]))),
            str(r.get("interval", ""))))
    return out
