"""The main job's in-process stages: statistics, predictors, claims and figures from the solver
results (:func:`compute` returns an :class:`Analysis`; :func:`analyse` adds the report).

Nothing here writes Markdown: :mod:`evictlab.pipeline.report` turns an :class:`Analysis` into
the report.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from evictlab.errors import InputError
from evictlab.pipeline.config import AnalysisConfig
from evictlab.pipeline.stages import hardness_stage, write_parquet


@dataclass
class Analysis:
    """Everything the report shows, computed by :func:`compute` (tables are also on disk under ``out``)."""

    out: Path
    cfg: AnalysisConfig
    models: list[str]
    pairs: int                      # (row, s) pairs analysed
    summaries: dict[str, Any]       # level name -> summary table (evictlab.stats.ceilings.LEVELS)
    auc: Any                        # AUC table: raw dropped mass and held-out predictors
    transfer: Any                   # cross-model AUC table, or None
    claims: list[Any]               # evictlab.stats.claims.ClaimRow
    figures: list[Any]              # evictlab.plots.common figure results (png, pdf, caption)
    cert_summary: Any = None        # certification-pass summary, or None
    notes: list[str] = field(default_factory=list)
    penalty: Any = None             # evictlab.stats.penalty.penalty_table, or None (no rows given)
    explanation: Any = None         # evictlab.stats.penalty.Explanation, or None
    head_dims: dict[str, int] = field(default_factory=dict)
    cert_pairs: int = 0             # (row, s) pairs of the certification pass
    beyond: Any = None              # evictlab.stats.beyond_pool summaries (column ``pass``), or None
    contour: Any = None             # ContourResult of the ContourKV section, or None (not run)


def compute(results: Any, out_dir: str | os.PathLike[str], cfg: AnalysisConfig, log: Any = print,
            cert_results: Any = None, rows: Optional[dict[str, Path]] = None, contour: Any = None) -> Analysis:
    """Statistics, predictors, claims and figures from a solver-results table.

    ``results``: a polars DataFrame (all models concatenated) or a list of Parquet paths.
    ``cert_results`` (same forms, optional): results solved with ``--certify`` on short rows;
    summarised separately (how often the certified optimum beats the pool optimum).
    ``rows`` (model -> row dataset, optional): the rows the results were solved from; with
    them pi(s) is checked against s / head_dim with the free-weight ablations.
    ``contour`` (a :class:`ContourResult`, optional): the ContourKV section's grid; its
    claim rows join the claims table and its per-comparison table lands in ``tables/``.
    Every interval resamples prompts (models too, for pooled rows): docs/statistics.md.
    Every table, figure and predictor lands under ``out_dir``.
    """
    import polars as pl

    from evictlab.plots.gap import gap_closed_ecdf, gap_closed_medians
    from evictlab.plots.heatmap import gap_heatmap
    from evictlab.plots.mass_kappa import mass_vs_kappa
    from evictlab.plots.penalty import penalty_curve, penalty_vs_head_dim
    from evictlab.plots.roc import roc_curves, roc_table
    from evictlab.stats import claims as cl
    from evictlab.stats.beyond_pool import beyond_pool_claims
    from evictlab.stats.ceilings import summarize, summarize_all
    from evictlab.stats.predictors import FEATURE_SETS, auc_by_group, evaluate, fit_predictor, label
    from evictlab.stats.results import load_results, prepare, split_zero, zero_counts

    out = Path(out_dir)
    tables, figs, preds = out / "tables", out / "figures", out / "predictors"
    t0 = time.perf_counter()
    df = prepare(results) if isinstance(results, pl.DataFrame) else load_results(results)
    models = sorted(df["model"].unique().to_list())
    claim_note = cfg.weights_note
    if cfg.weights_note == AnalysisConfig.weights_note:  # not set by the caller: per registry model
        claim_note = "weights as recorded with its rows"
        cfg.weights_note = "; ".join(f"{m}: {cl.weights_for(m, claim_note)}" for m in models)
    log(f"stats: {df.height:,} (row, s) pairs, models {models}")

    # ---- statistics --------------------------------------------------------------------
    summaries = summarize_all(df, seed=cfg.seed, n_boot=cfg.n_boot, n_boot_cells=cfg.n_boot_cells,
                              threshold=cfg.threshold)
    for name, t in summaries.items():
        write_parquet(t, tables / f"summary_{name}.parquet")
    write_parquet(zero_counts(df), tables / "e_top_zero_counts.parquet")
    write_parquet(df.filter(pl.col("e_top_zero")).drop("kept", strict=False), tables / "e_top_zero_rows.parquet")
    log(f"stats: summaries done ({time.perf_counter() - t0:.1f}s)")

    # ---- predictors --------------------------------------------------------------------
    auc_mass = auc_by_group(df, "dropped_mass", threshold=cfg.threshold, seed=cfg.seed, n_boot=cfg.n_boot,
                            name="dropped mass (raw)", compare_rows=True)
    if len(models) > 1:  # pooled over models: resample models, then prompts, then rows
        auc_mass = pl.concat([auc_mass, auc_by_group(df, "dropped_mass", threshold=cfg.threshold, seed=cfg.seed,
                                                     n_boot=cfg.n_boot, by=("s",), name="dropped mass (raw)",
                                                     compare_rows=True)], how="diagonal_relaxed")
    auc_parts = [auc_mass]
    notes: list[str] = []
    fitted: dict[tuple[str, str], Any] = {}
    used_all, _ = split_zero(df)
    roc_parts = [used_all.select(pl.lit("dropped mass (raw)").alias("predictor"), "model", "s",
                                 (pl.col("kappa_hat") > cfg.threshold).alias("y"),
                                 pl.col("dropped_mass").cast(pl.Float64).alias("score"))]
    for m in models:
        dm = df.filter(pl.col("model") == m)
        for set_name, feats in FEATURE_SETS.items():
            try:
                pred, test = fit_predictor(dm, feats, threshold=cfg.threshold, seed=cfg.seed, source=f"{m} results")
            except InputError as exc:
                notes.append(f"predictor `{set_name}` not fitted on {m}: {exc}")
                continue
            pred.metadata["model"] = m
            pred.save(preds / f"{m}-{set_name}.json")
            fitted[(m, set_name)] = pred
            auc_parts.append(evaluate(pred, test, seed=cfg.seed, n_boot=cfg.n_boot, name=f"{set_name} LR (held-out)"))
            roc_parts.append(test.select(pl.lit(f"{set_name} LR (held-out)").alias("predictor"), "model", "s")
                             .with_columns(pl.Series("y", label(test, cfg.threshold)),
                                           pl.Series("score", pred.score_table(test))))
    transfer = []
    for (a, set_name), pred in fitted.items():
        for b in models:
            if b == a:
                continue
            try:
                t = evaluate(pred, df.filter(pl.col("model") == b), seed=cfg.seed, n_boot=cfg.n_boot,
                             name=f"{set_name} LR fit on {a}")
            except InputError as exc:
                notes.append(f"transfer {a} -> {b} ({set_name}) not evaluated: {exc}")
                continue
            transfer.append(t.with_columns(pl.lit(a).alias("trained_on")))
    auc_all = pl.concat(auc_parts, how="diagonal_relaxed")
    write_parquet(auc_all, tables / "auc.parquet")
    transfer_df = pl.concat(transfer, how="diagonal_relaxed") if transfer else None
    if transfer_df is not None:
        write_parquet(transfer_df, tables / "auc_transfer.parquet")
    elif len(models) < 2:
        notes.append("cross-model transfer needs two models (run with --full, or `evictlab predictor eval` on another model's results)")
    log(f"predictors: {len(fitted)} fitted ({time.perf_counter() - t0:.1f}s)")

    # ---- claims, with the NP-hardness checker and the certification pass ---------------
    # ---- pi(s) against s / head_dim, with free-weight ablations (needs the rows) ------------
    penalty = explanation = None
    head_dims: dict[str, int] = {}
    if rows:
        from evictlab.rows import RowStore
        from evictlab.solve.ablation import ablation_rows
        from evictlab.stats.penalty import explain, penalty_table

        parts = []
        for m, path in sorted(rows.items()):
            head_dims[m] = RowStore.open(path).head_dim
            parts.append(ablation_rows(path, df, model=m, max_rows=cfg.ablation_rows, seed=cfg.seed))
        abl = pl.concat(parts)
        write_parquet(abl, tables / "penalty_ablation_rows.parquet")
        penalty = penalty_table(abl, seed=cfg.seed, n_boot=cfg.n_boot)
        write_parquet(penalty, tables / "penalty_by_definition.parquet")
        explanation = explain(penalty)
        log(f"penalty ablations: {abl.height:,} (row, s) pairs ({time.perf_counter() - t0:.1f}s)")
    else:
        notes.append("pi(s) against s / head_dim and the free-weight ablations need the row datasets "
                     "(run the whole job, or `paper_repro/claim_penalty_trend.py --rows`)")

    claim_rows = cl.selection_ceiling(pl.concat([summaries["model_s"], summaries["pooled_s"]], how="diagonal_relaxed")
                                      if "pooled_s" in summaries else summaries["model_s"], claim_note)
    claim_rows += cl.penalty_trend(summaries["model_s"], claim_note, head_dims)
    if penalty is not None:
        claim_rows += cl.penalty_head_dim(explanation.verdict, penalty, claim_note)
    claim_rows += cl.auc_range(auc_mass, claim_note, cfg.threshold)
    if cfg.hardness_trials > 0:
        trials = hardness_stage(cfg, out / "hardness", log)
        write_parquet(trials, tables / "hardness_trials.parquet")
        claim_rows += cl.np_hardness(trials, cfg.hardness_size, cfg.seed)
    cert_summary = None
    cert_pairs = 0
    cdf = None
    if cert_results is not None:
        cdf = prepare(cert_results) if isinstance(cert_results, pl.DataFrame) else load_results(cert_results)
        if "es_cert" not in cdf.columns:
            raise InputError("certified results", "no es_cert column", "solve those rows with `evictlab solve --certify`")
        cert_pairs = cdf.height
        cert_summary = summarize(cdf, ("model", "s"), seed=cfg.seed, n_boot=cfg.n_boot, threshold=cfg.threshold)
        write_parquet(cert_summary, tables / "certified_summary.parquet")
        claim_rows += cl.certified(cert_summary, claim_note)
    # ---- the ceiling beyond the pool: pool vs all-key search vs certified optimum -----------
    beyond, beyond_figs = beyond_pool_stage(df, cdf, cfg, tables, figs, notes)
    if beyond is not None:
        claim_rows += beyond_pool_claims(beyond, claim_note)
    if contour is not None:
        claim_rows += contour.claims
        if contour.detail.height:
            write_parquet(contour.detail, tables / "contourkv_comparisons.parquet")
    write_parquet(pl.DataFrame([c.to_dict() for c in claim_rows]), tables / "claims.parquet")

    # ---- figures -----------------------------------------------------------------------
    figures = [*beyond_figs,
        gap_closed_medians(pl.concat([summaries["model_s"], summaries["pooled_s"]], how="diagonal_relaxed")
                           if "pooled_s" in summaries else summaries["model_s"], figs / "gap_closed_medians"),
        gap_closed_ecdf(df, figs / "gap_closed_ecdf"),
        penalty_curve(summaries["model_s"], figs / "penalty_pi_s"),
        roc_curves(roc_table(pl.concat(roc_parts, how="diagonal_relaxed").with_columns(pl.col("s").cast(pl.Utf8))),
                   figs / "roc", cfg.threshold),
        mass_vs_kappa(df, figs / "mass_vs_kappa", cfg.threshold, seed=cfg.seed),
    ]
    if penalty is not None:
        figures.append(penalty_vs_head_dim(penalty, figs / "penalty_vs_head_dim"))
    for m in models:
        figures.append(gap_heatmap(summaries["model_s_layer_head"], figs / f"gap_heatmap_{m}", m))
    log(f"figures: {2 * len(figures)} files ({time.perf_counter() - t0:.1f}s)")
    return Analysis(out=out, cfg=cfg, models=models, pairs=df.height, summaries=summaries, auc=auc_all,
                    transfer=transfer_df, claims=claim_rows, figures=figures, cert_summary=cert_summary, notes=notes,
                    penalty=penalty, explanation=explanation, head_dims=head_dims, cert_pairs=cert_pairs,
                    beyond=beyond, contour=contour)


#: ``pass`` labels of the beyond-the-pool summaries: the main rows and the certification pass.
BEYOND_PASSES = ("main rows", "certification pass")


def beyond_pool_stage(df: Any, cdf: Any, cfg: AnalysisConfig, tables: Path, figs: Path,
                      notes: list[str]) -> tuple[Any, list[Any]]:
    """Per (model, s): median gap closed by the pool, the all-key search and (certification pass)
    the certified optimum on the same rows, with prompt-clustered CIs
    (:func:`evictlab.stats.beyond_pool.summarize_beyond_pool`), for every results table that has
    the all-key columns; written to ``tables/beyond_pool_summary.parquet`` (column ``pass``),
    with the pool vs all-key figure. Returns ``(summary or None, figures)``; the two passes
    are different row sets and are never pooled. Without all-key columns anywhere, a line in
    ``notes`` says how to get them.
    """
    import polars as pl

    from evictlab.plots.beyond_pool import gap_pool_vs_allkey
    from evictlab.stats.beyond_pool import summarize_beyond_pool

    parts, figures = [], []
    for name, table in zip(BEYOND_PASSES, (df, cdf)):
        if table is None or "es_ls" not in table.columns:
            continue
        sm = summarize_beyond_pool(table, ("model", "s"), seed=cfg.seed, n_boot=cfg.n_boot)
        parts.append(sm.select(pl.lit(name).alias("pass"), pl.all()))
        stem = "ceiling_beyond_pool" + ("" if name == BEYOND_PASSES[0] else "_certification")
        figures.append(gap_pool_vs_allkey(table, sm, figs / stem))
    if not parts:
        notes.append("beyond the pool: the results have no all-key search columns (solve with `--search all`)")
        return None, []
    beyond = pl.concat(parts, how="diagonal_relaxed")
    write_parquet(beyond, tables / "beyond_pool_summary.parquet")
    return beyond, figures


def analyse(results: Any, out_dir: str | os.PathLike[str], cfg: AnalysisConfig,
            provenance: Optional[dict[str, Any]] = None, log: Any = print, cert_results: Any = None,
            rows: Optional[dict[str, Path]] = None, contour: Any = None) -> Path:
    """:func:`compute`, then the Markdown report (:func:`evictlab.pipeline.report.write_report`); returns its path."""
    from evictlab.pipeline.report import write_report

    t0 = time.perf_counter()
    analysis = compute(results, out_dir, cfg, log=log, cert_results=cert_results, rows=rows, contour=contour)
    report = write_report(analysis, provenance or {})
    log(f"report: {report} ({time.perf_counter() - t0:.1f}s)")
    return report
