"""The testable claims of "Trust the Mass" (arXiv 2608.25230; docs/theory.md) as report rows: paper value vs ours.

Each function returns a list of :class:`ClaimRow`; the pipeline's report and the
``paper_repro/`` scripts render them with :mod:`evictlab.report.markdown`. A row states the
claim, the paper's value, our value with its 95% bootstrap CI, how that interval was
resampled (``interval``: prompts, or models then prompts for pooled rows), where our CI
lies against the paper's value (:func:`versus`, one vocabulary: :data:`VERDICTS`), the
model, the number of rows, the budgets, and the definitions used (ours are marked). Numbers
with their interval are printed by :func:`evictlab.report.markdown.ci`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import polars as pl

from evictlab.report.markdown import ci

WEIGHTS_NOTE = "weights quantised (Q4 GGUF)"
#: How the registry's models are stored (docs/capture.md); printed next to every number.
MODEL_WEIGHTS = {
    "smollm2-135m": "Q4_1 GGUF weights, dequantised to float32",
    "gemma3-270m": "Q4_K_M GGUF weights, dequantised to float32",
    "synthetic": "synthetic rows, no model weights",
}


def weights_for(model: str, default: str = WEIGHTS_NOTE) -> str:
    """The weights note of a registry model, else ``default`` (rows pooled over models: each model's own)."""
    if model.startswith("pooled ("):
        return "each model's weights as in its own rows"
    return MODEL_WEIGHTS.get(model, default)
POOL_NOTE = "ES_hat over candidate pool C_s(2, 2) (ours)"


@dataclass(frozen=True)
class ClaimRow:
    """One line of the claims table."""

    claim_id: str
    claim: str
    paper_value: str
    our_value: str
    verdict: str
    model: str
    rows: str
    budgets: str
    definitions: str
    interval: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: The "paper vs ours" verdicts (:func:`versus`; docs/statistics.md, "Paper vs ours").
VERDICTS: tuple[str, ...] = ("ours below paper", "ours above paper", "paper within ours", "overlaps paper", "no data")


def versus(lo: float, hi: float, p_lo: float, p_hi: float) -> str:
    """The one "paper vs ours" verdict: where our interval ``[lo, hi]`` lies against the
    paper's value or range ``[p_lo, p_hi]`` (``p_lo == p_hi`` for a single value).

    ``ours below paper`` / ``ours above paper``: our interval lies entirely below / above it;
    ``paper within ours``: our interval holds the paper's value (its whole range);
    ``overlaps paper``: the two overlap, part of the paper's range outside ours;
    ``no data``: we have no finite interval. Boundaries count as inside.
    """
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return VERDICTS[4]
    if hi < p_lo:
        return VERDICTS[0]
    if lo > p_hi:
        return VERDICTS[1]
    if lo <= p_lo and p_hi <= hi:
        return VERDICTS[2]
    return VERDICTS[3]



def _rows_text(summary: pl.DataFrame) -> str:
    return f"{int(summary['rows'].sum()):,} (row, s) pairs; {int(summary['rows_e_top_zero'].sum())} with e(T_s)=0 excluded"


def selection_ceiling(summary: pl.DataFrame, weights_note: str = WEIGHTS_NOTE) -> list[ClaimRow]:
    """Median gap closed per (model, s) against the paper's 0.021-0.047 over s = 4..32.

    ``summary`` may hold pooled rows (``model`` = ``pooled (...)``, from
    :func:`evictlab.stats.ceilings.summarize_all`): they become rows of their own.
    """
    out = []
    for r in summary.sort("model", "s").iter_rows(named=True):
        out.append(ClaimRow(
            "ceiling", "best subset closes only a median 2-5% of the top-mass gap",
            "0.021-0.047 (s=4..32, 5 models, 168,192 rows)",
            ci(r["gap_closed_median"], r["gap_closed_median_lo"], r["gap_closed_median_hi"]),
            versus(r["gap_closed_median_lo"], r["gap_closed_median_hi"], 0.021, 0.047),
            f"{r['model']} ({weights_for(r['model'], weights_note)})", f"{r['rows_used']:,} used, {r['rows_e_top_zero']} e(T_s)=0 excluded",
            f"s={r['s']}", f"g(s)=(e(T_s)-ES_hat)/e(T_s); {POOL_NOTE}; median, 95% percentile bootstrap CI",
            r.get("interval", "")))
    return out


def penalty_trend(summary: pl.DataFrame, weights_note: str = WEIGHTS_NOTE,
                  head_dims: dict[str, int] | None = None) -> list[ClaimRow]:
    """pi(s) at T_s per (model, s), against the paper's 1.07 (s=4) -> 1.79 (s=32), plus the trend.

    ``head_dims`` (model -> head dimension, optional) adds s / head_dim to the budgets column.
    """
    paper = {4: 1.07, 32: 1.79}
    head_dims = head_dims or {}
    out = []
    for m in sorted(summary["model"].unique().to_list()):
        sub = summary.filter(pl.col("model") == m).sort("s")
        for r in sub.iter_rows(named=True):
            p = paper.get(int(r["s"]))
            out.append(ClaimRow(
                "penalty", "forced-weight penalty pi(s) at T_s",
                f"{p:.2f}" if p is not None else "(not reported)",
                ci(r["pi_top_median"], r["pi_top_median_lo"], r["pi_top_median_hi"]) + f"; at argmin {r['pi_opt_median']:.3f}",
                versus(r["pi_top_median_lo"], r["pi_top_median_hi"], p, p) if p is not None else "-",
                f"{m} ({weights_for(m, weights_note)})", f"{r['rows_used']:,} used, {r['pi_nonfinite']} non-finite ratios excluded",
                f"s={r['s']}" + (f" (s/d={r['s'] / head_dims[m]:.3g})" if m in head_dims else ""),
                "pi(s)=median e(A)/e_free(A), e_free = distance to convex hull of kept values (ours), A=T_s",
                r.get("interval", "")))
        s = sub["s"].to_numpy()
        med = sub["pi_top_median"].to_numpy()
        if s.size >= 2 and np.all(np.isfinite(med)):
            rising = bool(np.all(np.diff(med) > 0))
            out.append(ClaimRow(
                "penalty-trend", "pi(s) rises with s", "1.07 -> 1.79 (rising)",
                " -> ".join(f"{v:.2f}" for v in med), "rising" if rising else "not monotone",
                f"{m} ({weights_for(m, weights_note)})", _rows_text(sub), "s=" + ",".join(map(str, s)), "medians of pi(s) at T_s",
                "-"))
    return out


def penalty_head_dim(verdict: str, table: pl.DataFrame, weights_note: str = WEIGHTS_NOTE) -> list[ClaimRow]:
    """Which explanation of our pi(s) vs the paper's the data support (:func:`evictlab.stats.penalty.explain`).

    ``table``: :func:`evictlab.stats.penalty.penalty_table`.
    """
    hull = table.filter(pl.col("definition") == "hull").sort("model", "s")
    models = sorted(hull["model"].unique().to_list())
    rows = hull.to_dicts()
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]
             if a["model"] != b["model"] and np.isclose(a["s_over_d"], b["s_over_d"])]
    if pairs:  # the test itself: the models at equal s / head_dim
        ours = "; ".join(f"s/d={a['s_over_d']:.3g}: {a['model']} (s={a['s']}) {a['pi']:.2f} vs {b['model']} (s={b['s']}) "
                         f"{b['pi']:.2f}" for a, b in pairs)
    else:
        ours = "; ".join(f"{r['model']} s/d={r['s_over_d']:.3g}: {r['pi']:.2f}" for r in rows)
    return [ClaimRow(
        "penalty-head-dim", "(our check) is pi(s) a function of s / head_dim?",
        "1.07 (s/d=4/128) -> 1.79 (s/d=32/128)", ours, verdict.split(":")[0],
        f"{' + '.join(models)} ({'; '.join(f'{m}: {weights_for(m, weights_note)}' for m in models)})",
        f"{int(hull['rows'].max()):,} sampled rows per (model, s)", "s=" + ",".join(map(str, sorted(set(hull["s"].to_list())))),
        "pi at T_s against s/head_dim; alternative free weights (affine, cone, span, ratio of medians) as ablations (ours)",
        str(hull["interval"][0]) if hull.height else "")]


def auc_range(auc: pl.DataFrame, weights_note: str = WEIGHTS_NOTE, threshold: float = 1.11) -> list[ClaimRow]:
    """AUC of dropped mass for kappa_hat > threshold per (model, s) against the paper's 0.76-0.89.

    ``auc``: a table from :func:`evictlab.stats.predictors.auc_by_group` (or ``evaluate``).
    """
    out = []
    for r in auc.iter_rows(named=True):
        out.append(ClaimRow(
            "auc", f"dropped mass predicts kappa_hat > {threshold}", "AUC 0.76-0.89",
            ci(r["auc"], r["auc_lo"], r["auc_hi"]), versus(r["auc_lo"], r["auc_hi"], 0.76, 0.89),
            f"{r['model']} ({weights_for(r['model'], weights_note)})", f"{r['rows']:,} ({r['positives']:,} positive), {r['rows_e_top_zero']} e(T_s)=0 excluded",
            f"s={r['s']}", f"score={r['predictor']}; label kappa_hat=e(T_s)/max(ES_hat,eps)>{threshold}; {POOL_NOTE}; ROC AUC, bootstrap CI",
            r.get("interval", "")))
    return out


def certified(summary: pl.DataFrame, weights_note: str = WEIGHTS_NOTE) -> list[ClaimRow]:
    """How often the certified global optimum ES(s) beats the pool optimum ES_hat(s) (beyond the paper)."""
    out = []
    for r in summary.sort("model", "s").iter_rows(named=True):
        if "cert_beats_pool_frac" not in r:
            continue
        out.append(ClaimRow(
            "certified", "(beyond the paper) the candidate pool contains the optimum", "- (paper enumerates a pool)",
            ci(r["cert_beats_pool_frac"], r["cert_beats_pool_frac_lo"], r["cert_beats_pool_frac_hi"]) + " of rows: ES(s) < ES_hat(s)",
            "-", f"{r['model']} ({weights_for(r['model'], weights_note)})",
            f"{r['rows_certified']:,} certified of {r['rows']:,} (short rows, n <= 48)", f"s={r['s']}",
            f"ES(s) over all keys by branch and bound (proved); {POOL_NOTE}", r.get("cert_interval", "")))
    return out


def np_hardness(trials: pl.DataFrame, size: int, seed: int) -> list[ClaimRow]:
    """The ZERO-ES reduction checker's counts (from ``evictlab hardness check --out``'s trials.parquet)."""
    tried = trials.height
    agreed = int(trials["agreed"].sum())
    yes = int((trials["expected"] == "yes").sum())
    certs = int(trials["certificates_checked"].sum()) if "certificates_checked" in trials.columns else 0
    return [ClaimRow(
        "np-hardness", "deciding ES(s) = 0 is NP-complete (1-D values, uniform mass)", "NP-complete (proof)",
        f"{agreed}/{tried} instances agree ({yes} yes, {tried - yes} no); {certs} certificates mapped and verified",
        "consistent (no disagreement)" if agreed == tried else f"{tried - agreed} DISAGREEMENTS",
        "- (integer instances)", f"{tried} k-subset-sum instances, n={size}", f"seed={seed}",
        "reduction k-subset-sum -> ZERO-ES (docs/theory.md), CP-SAT vs exact DP, integer arithmetic", "- (exact)")]
