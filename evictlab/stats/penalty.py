"""The forced-weight penalty pi(s) against s / head_dim, with alternative free-weight definitions.

Why: the paper reports pi rising from 1.07 (s = 4) to 1.79 (s = 32) on models of head
dimension 128; our pi rises faster on SmolLM2 (head dim 64) than on Gemma 3 (head dim 256).
The free weights can use the kept values only within the space they span, whose dimension
is at most min(s - 1, d) for the affine hull, so pi may depend on s / d. This module
measures pi against s / d per model and, on the same rows, under labelled alternative
definitions of the free-weight error (docs/theory.md, section 3):

====================  ==========================================================
``hull`` (default)    e / e_free, weights on the simplex (convex hull; ours)
``hull, ratio of      median(e) / median(e_free) instead of median(e / e_free)
medians``
``affine``            e / e_aff, weights sum to 1, any sign (affine hull)
``nonneg``            e / e_nn, weights >= 0, any sum (cone of the values)
``ls``                e / e_ls, unconstrained weights (linear span)
====================  ==========================================================

:func:`evictlab.solve.ablation.ablation_rows` recomputes T_s and the alternative errors from
the row dataset (a seeded sample of rows, stratified by prompt; every alternative solved
exactly by :mod:`evictlab.core.reference`), :func:`penalty_table` summarises them per (model, s,
definition) with prompt-clustered intervals, and :func:`explain` states which explanation
of the difference from the paper the numbers support.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import polars as pl

from evictlab.errors import InputError
from evictlab.report.markdown import ci
from evictlab.stats.bootstrap import Median, RatioOfMedians, bootstrap
from evictlab.stats.ceilings import CLUSTER_LEVELS, design_for

#: The paper's reported penalty (median at T_s) and its models' head dimension.
PAPER_PI = {4: 1.07, 32: 1.79}
PAPER_HEAD_DIM = 128
DEFINITIONS: dict[str, str] = {
    "hull": "median e/e_free, e_free = distance to the convex hull of the kept values (default; ours)",
    "hull, ratio of medians": "median(e) / median(e_free), same e_free",
    "affine": "median e/e_aff, e_aff = distance to the affine hull (weights sum to 1, any sign; ours)",
    "nonneg": "median e/e_nn, e_nn = distance to the cone of the kept values (weights >= 0, any sum; ours)",
    "ls": "median e/e_ls, e_ls = distance to the span (unconstrained weights; ours)",
}
_ERR = {"hull": "e_hull", "affine": "e_aff", "nonneg": "e_nn", "ls": "e_ls"}


def penalty_table(abl: pl.DataFrame, *, seed: int = 0, n_boot: int = 1000, level: float = 0.95,
                  clusters: Sequence[str] | None = CLUSTER_LEVELS) -> pl.DataFrame:
    """pi per (model, s, definition) with prompt-clustered CIs, and s / head_dim.

    Rows with e(T_s) = 0 are excluded; a ratio with a zero denominator is counted in
    ``nonfinite`` and excluded. Columns: ``model, s, head_dim, s_over_d, definition, rows,
    nonfinite, pi, pi_lo, pi_hi, interval``.
    """
    out = []
    for (m, s), g in sorted(abl.filter(pl.col("e_top") > 0).group_by(["model", "s"]), key=lambda kv: kv[0]):
        d = int(g["head_dim"][0])
        e = g["e_top"].to_numpy()
        stats, nonfinite = {}, {}
        for name, col in _ERR.items():
            den = g[col].to_numpy()
            ok = den > 0
            stats[name] = Median(np.where(ok, e / np.where(ok, den, 1.0), 0.0), ok)
            nonfinite[name] = int((~ok).sum())
        ok = g["e_hull"].to_numpy() > 0
        stats["hull, ratio of medians"] = RatioOfMedians(e, g["e_hull"].to_numpy(), ok)
        nonfinite["hull, ratio of medians"] = int((~ok).sum())
        est = bootstrap(stats, design_for(g, clusters), seed=seed, key=f"penalty|{m}|{s}", n_boot=n_boot, level=level)
        for name in DEFINITIONS:
            r = est[name]
            out.append({"model": m, "s": int(s), "head_dim": d, "s_over_d": s / d, "definition": name,
                        "rows": g.height, "nonfinite": nonfinite[name], "pi": r.value, "pi_lo": r.lo,
                        "pi_hi": r.hi, "interval": r.method})
    if not out:
        raise InputError("ablation", "no (row, s) pair with e(T_s) > 0", "sample more rows")
    return pl.DataFrame(out)


@dataclass(frozen=True)
class Explanation:
    """What the penalty table says about the difference from the paper (see :func:`explain`)."""

    findings: list[str]
    verdict: str


def _pi(r: dict[str, float]) -> str:
    """A row's pi with its interval."""
    return ci(r["pi"], r["pi_lo"], r["pi_hi"], 2)


def _log_gap(a: float, b: float) -> float:
    return abs(math.log(a / b)) if a > 0 and b > 0 else float("inf")


def explain(table: pl.DataFrame, paper: dict[int, float] = PAPER_PI, paper_head_dim: int = PAPER_HEAD_DIM) -> Explanation:
    """Test two explanations of our pi(s) against the paper's, from a :func:`penalty_table`.

    1. **s / head_dim**: if pi depends on s / d, two models agree where their s / d match
       (better than where their s match), and our pi at the paper's s / d values
       (4/128, 32/128) is near the paper's. Supported when some pairs have matching s / d,
       their mean |log pi ratio| is below that of the same-s pairs, and every matched pair's
       intervals overlap.
    2. **free-weight definition**: some alternative definition brings every model within
       10% of the paper's values at s = 4 and s = 32 (mean |log ratio| < log 1.1).
    Otherwise neither is supported by these data.
    """
    hull = table.filter(pl.col("definition") == "hull")
    models = sorted(hull["model"].unique().to_list())
    rows = {(r["model"], r["s"]): r for r in hull.iter_rows(named=True)}
    findings: list[str] = []
    matched_sd, matched_s, overlaps = [], [], []
    for i, a in enumerate(models):
        for b in models[i + 1:]:
            for (ma, sa), ra in rows.items():
                if ma != a:
                    continue
                for (mb, sb), rb in rows.items():
                    if mb != b:
                        continue
                    if math.isclose(ra["s_over_d"], rb["s_over_d"]):
                        matched_sd.append(_log_gap(ra["pi"], rb["pi"]))
                        ok = ra["pi_lo"] <= rb["pi_hi"] and rb["pi_lo"] <= ra["pi_hi"]
                        overlaps.append(ok)
                        findings.append(f"same s/d = {ra['s_over_d']:.4g}: {a} (s={sa}) pi {_pi(ra)} vs {b} (s={sb}) "
                                        f"{_pi(rb)}: intervals {'overlap' if ok else 'do not overlap'}")
                    if sa == sb:
                        matched_s.append(_log_gap(ra["pi"], rb["pi"]))
    sd_ok = bool(matched_sd) and (not matched_s or np.mean(matched_sd) < np.mean(matched_s)) and all(overlaps)
    if matched_sd:
        findings.append(f"mean |log pi ratio| between models: {np.mean(matched_sd):.3f} at equal s/d vs "
                        f"{np.mean(matched_s):.3f} at equal s" if matched_s else
                        f"mean |log pi ratio| at equal s/d: {np.mean(matched_sd):.3f}")
    elif len(models) > 1:
        findings.append("no two models share an s/d value in these budgets, so s/d cannot be compared directly")
    for s_p, pi_p in sorted(paper.items()):
        x = s_p / paper_head_dim
        for m in models:
            hit = [r for (mm, _), r in rows.items() if mm == m and math.isclose(r["s_over_d"], x)]
            if hit:
                r = hit[0]
                findings.append(f"at the paper's s/d = {s_p}/{paper_head_dim}: {m} (s={r['s']}) pi {_pi(r)} "
                                f"vs paper {pi_p:.2f}")
    closest, best = None, float("inf")
    for name in DEFINITIONS:
        sub = {(r["model"], r["s"]): r["pi"] for r in table.filter(pl.col("definition") == name).iter_rows(named=True)}
        gaps = [_log_gap(sub[(m, s)], v) for m in models for s, v in paper.items() if (m, s) in sub]
        if not gaps:
            continue
        g = float(np.mean(gaps))
        findings.append(f"definition `{name}`: pi at s = {', '.join(map(str, sorted(paper)))} "
                        + "; ".join(f"{m} " + " -> ".join(f"{sub[(m, s)]:.2f}" for s in sorted(paper) if (m, s) in sub)
                                    for m in models)
                        + f" (paper {' -> '.join(f'{v:.2f}' for _, v in sorted(paper.items()))}; mean |log ratio| {g:.3f})")
        if g < best:
            closest, best = name, g
    def_ok = closest is not None and closest != "hull" and best < math.log(1.1)
    if sd_ok:
        verdict = ("supported: s / head_dim. At equal s/d the models' pi agree (intervals overlap) and agree better "
                   "than at equal s, so the free weights' room (how many kept values per head dimension) explains "
                   "much of the difference from the paper's head-dim-128 models.")
    elif def_ok:
        verdict = (f"supported: the free-weight definition. `{closest}` brings every model within 10% of the paper's "
                   "values, so the paper's free weights are likely defined that way.")
    else:
        why = []
        if matched_sd:
            why.append("at equal s/d the models' pi still differ" + ("" if all(overlaps) else " beyond their intervals")
                       + (" and agree no better than at equal s" if matched_s and np.mean(matched_sd) >= np.mean(matched_s) else ""))
        else:
            why.append("s/d could not be matched across models")
        why.append(f"no free-weight definition reaches the paper's values (closest: `{closest}`, mean |log ratio| "
                   f"{best:.3f}); relaxing the weights (affine, cone, span) lowers the free-weight error and so "
                   "raises pi further")
        verdict = ("not explained by s / head_dim or by the free-weight definition: " + "; ".join(why)
                   + ". Remaining candidates not tested here: the model families, the context length, quantisation.")
    return Explanation(findings, verdict)
