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

Rows of one prompt are not independent: every interval here is a **two-stage clustered
percentile bootstrap** (resample prompts with replacement, then rows within each drawn
prompt), seeded by ``(seed, group key, statistic)``. Rows with e(T_s) = 0 are excluded from
every ratio and counted in ``rows_e_top_zero``.

:func:`clustered_bootstrap` is a small stand-alone implementation; when a shared clustered
bootstrap lands in :mod:`evictlab.stats.bootstrap`, this module should call it instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import polars as pl

from evictlab.errors import InputError
from evictlab.stats.bootstrap import Estimate, rng_for
from evictlab.stats.claims import ClaimRow, weights_for
from evictlab.stats.results import ABS_TOL, REL_TOL

#: The paper's range of median gap closed over s = 4..32 (pool-based).
PAPER_RANGE = (0.021, 0.047)
#: Statuses of the certificate that count as proved optimal.
OPTIMAL = "optimal"
CI_NOTE = "95% two-stage clustered bootstrap CI (prompts, then rows within prompts)"
_EST = ("gap_pool_median", "gap_ls_median", "pool_miss_frac", "gap_pool_cert_median", "gap_ls_cert_median",
        "gap_cert_median", "pool_miss_cert_frac", "ls_optimal_frac", "cert_closed_frac", "ceiling_lo_median",
        "ceiling_hi_median")
#: Columns of :func:`summarize_beyond_pool` after the group keys, in order (estimates carry
#: ``_lo``/``_hi`` CI columns).
SUMMARY_COLUMNS: tuple[str, ...] = (
    "rows", "rows_e_top_zero", "rows_used", "prompts", "rows_certified", "rows_cert_attempted",
    *[f"{e}{suf}" for e in _EST for suf in ("", "_lo", "_hi")],
    "open_width_median", "open_width_max", "cert_nodes_median",
)


def clustered_bootstrap(
    x: np.ndarray, clusters: np.ndarray, stat: Callable[[np.ndarray], float], *, seed: int,
    key: str = "", n_boot: int = 1000, level: float = 0.95,
) -> Estimate:
    """``stat(x)`` with a two-stage clustered percentile-bootstrap CI.

    Each resample draws as many clusters as there are, with replacement, then for every
    drawn cluster as many of its rows as it has, with replacement, and applies ``stat`` to
    the pooled draw. ``x`` must be finite (filter and count non-finite values first).

    Args:
        x: ``(N,)`` values; clusters: ``(N,)`` cluster labels (any sortable dtype).
        stat: e.g. ``np.median`` or ``np.mean``; seed/key: the seeded stream
            (:func:`evictlab.stats.bootstrap.rng_for`); n_boot, level: resamples and coverage.
    """
    if n_boot < 1:
        raise InputError("n_boot", f"must be >= 1, got {n_boot}", "use e.g. 1000 resamples")
    if not 0.0 < level < 1.0:
        raise InputError("level", f"must be in (0, 1), got {level}", "use e.g. 0.95")
    x = np.asarray(x, dtype=np.float64)
    clusters = np.asarray(clusters)
    if x.shape != clusters.shape:
        raise InputError("clusters", f"shape {clusters.shape} differs from x {x.shape}", "pass one label per value")
    if x.size == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    if not np.all(np.isfinite(x)):
        raise InputError("x", "contains NaN or inf", "filter non-finite values and count them")
    point = float(stat(x))
    order = np.argsort(clusters, kind="stable")
    xs = x[order]
    _, starts, sizes = np.unique(clusters[order], return_index=True, return_counts=True)
    G = starts.size
    if x.size == 1:
        return Estimate(point, point, point, 1)
    rng = rng_for(seed, key)
    vals = np.empty(n_boot)
    for b in range(n_boot):
        pick = rng.integers(0, G, size=G)
        sz = sizes[pick]
        base = np.repeat(starts[pick], sz)
        width = np.repeat(sz, sz)
        idx = base + np.floor(rng.random(base.size) * width).astype(np.int64)
        vals[b] = stat(xs[idx])
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(vals, [a, 1.0 - a])
    return Estimate(point, float(lo), float(hi), int(x.size))


def _est(prefix: str, e: Estimate) -> dict[str, float]:
    return {prefix: e.value, f"{prefix}_lo": e.lo, f"{prefix}_hi": e.hi}


def _cluster_ids(g: pl.DataFrame) -> np.ndarray:
    """Cluster label per row: the prompt (rows of one prompt share their context)."""
    if "prompt_id" in g.columns and g["prompt_id"].null_count() == 0:
        return g["prompt_id"].to_numpy()
    return np.arange(g.height)  # no prompt ids: every row its own cluster


def check_beyond_pool(df: pl.DataFrame, source: str = "results") -> None:
    """Refuse a table without the all-key search's columns (one line naming the fix)."""
    missing = [c for c in ("es_ls", "es_hat", "e_top", "s") if c not in df.columns]
    if missing:
        raise InputError(source, f"lacks the columns {missing} of the all-key search",
                         "solve the rows with `evictlab solve ROWS --budgets ... --search all [--certify]`")
    if df.height == 0:
        raise InputError(source, "the results table is empty", "solve at least one row")


def summarize_beyond_pool(
    df: pl.DataFrame, by: Sequence[str] = ("model", "s"), *, seed: int = 0, n_boot: int = 1000,
    level: float = 0.95,
) -> pl.DataFrame:
    """One row per group with the statistics of the module docstring (columns below).

    Columns (``_lo``/``_hi``: clustered CI): ``rows, rows_e_top_zero, rows_used, prompts``;
    ``gap_pool_median, gap_ls_median, pool_miss_frac`` (all rows used);
    ``rows_certified, gap_pool_cert_median, gap_ls_cert_median, gap_cert_median,
    pool_miss_cert_frac, ls_optimal_frac`` (certified rows); ``rows_cert_attempted,
    cert_closed_frac, open_width_median, open_width_max, ceiling_lo_median,
    ceiling_hi_median, cert_nodes_median`` (rows the certificate attempted). Certificate
    columns are NaN (counts 0) without ``--certify``.
    """
    check_beyond_pool(df)
    if "e_top_zero" not in df.columns:
        df = df.with_columns((pl.col("e_top") <= 0.0).alias("e_top_zero"))
    if "model" not in df.columns:
        df = df.with_columns(pl.lit("unknown").alias("model"))
    by = list(by)
    has_cert = "es_cert" in df.columns and "cert_status" in df.columns
    rows: list[dict[str, object]] = []
    for key, g in sorted(df.group_by(by), key=lambda kv: kv[0]):
        keyd = dict(zip(by, key))
        tag = "|".join(f"{k}={v}" for k, v in keyd.items())
        zero = g["e_top_zero"].to_numpy() | (g["e_top"].to_numpy() <= 0.0)
        nz = g.filter(pl.Series(~zero))
        cl = _cluster_ids(nz)
        et, eh, el = (nz[c].cast(pl.Float64).to_numpy() for c in ("e_top", "es_hat", "es_ls"))
        tol = np.maximum(np.abs(eh) * REL_TOL, ABS_TOL)
        row: dict[str, object] = {**keyd, "rows": g.height, "rows_e_top_zero": int(zero.sum()),
                                  "rows_used": nz.height, "prompts": int(np.unique(cl).size)}

        def boot(name: str, x: np.ndarray, c: np.ndarray, stat: Callable = np.median) -> None:
            row.update(_est(name, clustered_bootstrap(x, c, stat, seed=seed, key=f"{tag}|{name}",
                                                      n_boot=n_boot, level=level)))

        boot("gap_pool_median", (et - eh) / et, cl)
        boot("gap_ls_median", (et - el) / et, cl)
        boot("pool_miss_frac", (el < eh - tol).astype(float), cl, np.mean)
        if has_cert:
            st = nz["cert_status"].cast(pl.Utf8).to_numpy()
            ec = nz["es_cert"].cast(pl.Float64).fill_null(np.nan).to_numpy()
            lb = nz["cert_lb"].cast(pl.Float64).fill_null(np.nan).to_numpy() if "cert_lb" in nz.columns \
                else np.where(st == OPTIMAL, ec, np.nan)
            opt = st == OPTIMAL
            att = opt | (st == "limit")
            row["rows_certified"] = int(opt.sum())
            row["rows_cert_attempted"] = int(att.sum())
            if opt.any():
                c = cl[opt]
                boot("gap_pool_cert_median", ((et - eh) / et)[opt], c)
                boot("gap_ls_cert_median", ((et - el) / et)[opt], c)
                boot("gap_cert_median", ((et - ec) / et)[opt], c)
                boot("pool_miss_cert_frac", (ec < eh - tol)[opt].astype(float), c, np.mean)
                boot("ls_optimal_frac", (el <= ec + np.maximum(np.abs(ec) * REL_TOL, ABS_TOL))[opt].astype(float),
                     c, np.mean)
            if att.any():
                c = cl[att]
                boot("cert_closed_frac", opt[att].astype(float), c, np.mean)
                width = np.where(ec > 0, (ec - lb) / np.where(ec > 0, ec, 1.0), 0.0)[att & ~opt]
                row["open_width_median"] = float(np.median(width)) if width.size else 0.0
                row["open_width_max"] = float(width.max()) if width.size else 0.0
                boot("ceiling_lo_median", ((et - ec) / et)[att], c)
                boot("ceiling_hi_median", ((et - lb) / et)[att], c)
                row["cert_nodes_median"] = float(np.median(nz["cert_nodes"].to_numpy()[att])) \
                    if "cert_nodes" in nz.columns else float("nan")
        else:
            row["rows_certified"] = 0
            row["rows_cert_attempted"] = 0
        for name in _EST:
            for suf in ("", "_lo", "_hi"):
                row.setdefault(name + suf, float("nan"))
        for name in ("open_width_median", "open_width_max", "cert_nodes_median"):
            row.setdefault(name, float("nan"))
        rows.append(row)
    return pl.DataFrame(rows).select(*by, *SUMMARY_COLUMNS)


def _fmt(r: dict[str, object], name: str, d: int = 3) -> str:
    v, lo, hi = (float(r[name + s]) for s in ("", "_lo", "_hi"))  # type: ignore[arg-type]
    if not np.isfinite(v):
        return "n/a"
    return f"{v:.{d}f} [{lo:.{d}f}, {hi:.{d}f}]"


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
    """Claims-table rows: the paper's 2-5% against pool, all-key and certified medians."""
    out = []
    for r in summary.sort("model", "s").iter_rows(named=True):
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
            f"e(T_s)=0 excluded", f"s={r['s']}",
            "ES_hat: pool C_s(2, 2) (ours); ES_ls: all-key single/pair-swap search (ours, an upper bound on ES); "
            f"ES(s): branch and bound with lower bound; {CI_NOTE}; "
            + (weights_note or weights_for(str(r["model"])))))
    return out
