"""The main job's stages: settings, cached rows and solver results, and the analysis tables.

Nothing here writes Markdown: :func:`compute` returns an :class:`Analysis` (tables, claim
rows, figures, notes) and :mod:`evictlab.report.demo` turns it into the report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from evictlab.errors import EvictlabError, InputError
from evictlab.io import read_checked_parquet


class StageError(EvictlabError, RuntimeError):
    """A pipeline stage (a subprocess command) failed; the message names the command."""


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------
#: Bumped when the prompts a capture setting produces change (2: Shakespeare plays, one per
#: prompt, before the held-out tail), so cached rows of an older rule are never reused.
ROWS_RULE_VERSION = 2


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
        """Folder name under runs/cache/rows that identifies these rows (and the prompt rule's version)."""
        if self.synthetic:
            return f"synthetic-r{self.synthetic_rows}-k{self.synthetic_keys}-d{self.synthetic_dim}-seed{self.seed}"
        return (f"{self.model}-{self.source}-ctx{self.context}-pos{self.positions}-pr{self.prompts}-seed{self.seed}"
                f"-rule{ROWS_RULE_VERSION}")

    def label(self) -> str:
        """Model name as it appears in tables."""
        return "synthetic" if self.synthetic else self.model


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
    #: rows per model for the free-weight ablations of pi(s) (a seeded sample, even over prompts)
    ablation_rows: int = 600
    #: torch threads of the capture stage (``evictlab capture --threads``; 0 = torch's default)
    threads: int = 1
    #: solver neighbourhood of the main rows (``evictlab solve --search``): ``all`` adds the
    #: all-key search (ES_ls) and the report's beyond-the-pool section; ``pool`` skips both
    search: str = "all"
    extra: dict[str, Any] = field(default_factory=dict)


def parse_budgets(text: str) -> tuple[int, ...]:
    """``"4,8 16"`` -> ``(4, 8, 16)`` (sorted); InputError naming ``--budgets`` otherwise (the list
    rule of :mod:`evictlab.cliutil`: no empty entry, no budget twice)."""
    from evictlab.cliutil import parse_ints

    b = parse_ints(text.split(), "--budgets", "budget", lo=1, example="4,8,16,32")
    if not b:
        raise InputError("--budgets", "no budget given", "pass e.g. --budgets 4,8,16,32")
    return tuple(sorted(b))


# --------------------------------------------------------------------------------------
# stages 1-2: rows and solver results (subprocesses, cached)
# --------------------------------------------------------------------------------------
def _evictlab(args: list[str], log: Any, ok: tuple[int, ...] = (0,)) -> float:
    """Run ``evictlab ARGS`` with this interpreter; return wall seconds; raise StageError when
    its exit status is not in ``ok``."""
    cmd = [sys.executable, "-m", "evictlab.cli", *args]
    log(f"$ evictlab {' '.join(args)}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    if proc.returncode not in ok:
        raise StageError(f"`evictlab {' '.join(args)}` exited with status {proc.returncode}; see its message above")
    return time.perf_counter() - t0


def ensure_rows(spec: CaptureSpec, cache: Path, log: Any, threads: int = 1) -> tuple[Path, bool, float]:
    """Rows for ``spec``, from the cache or freshly produced. Returns (path, cached?, seconds).

    ``threads``: torch threads of the capture (rows do not depend on it beyond rounding).
    """
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
                "--threads", str(threads), "--out", str(rows)]
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
    root = Path(__file__).resolve().parents[1]
    for sub in ("solve", "core"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    b = ",".join(map(str, cfg.budgets))
    search = "-all" if cfg.search == "all" else ""
    return f"b{b}-p{cfg.pool[0]},{cfg.pool[1]}{search}{'-cert' if certify else ''}-{h.hexdigest()[:12]}"


def _copy(src: Path, dest: Path) -> None:
    import shutil

    from evictlab.io import atomic_path

    with atomic_path(dest, suffix=".parquet") as tmp:
        shutil.copyfile(src, tmp)


def solve_rows(rows: Path, out: Path, cfg: AnalysisConfig, certify: bool, log: Any) -> float:
    """``evictlab solve ROWS --budgets ... --pool r_m r_e --search pool|all [--certify] --out RESULTS``."""
    args = ["solve", str(rows), "--budgets", *map(str, cfg.budgets), "--pool", *map(str, cfg.pool),
            "--search", cfg.search, "--out", str(out)]
    if certify:
        args.append("--certify")
    if out.exists():
        args.append("--overwrite")
    return _evictlab(args, log)


def rows_and_results(spec: CaptureSpec, cfg: AnalysisConfig, certify: bool, res: Path, runs: Path, resolve: bool,
                     timings: dict[str, float], facts: dict[str, str], log: Any, tag: str = "") -> tuple[Path, Path]:
    """Rows (cached or produced) -> solver results (cached or solved) -> copied to ``res``.

    Returns ``(res, rows)``: the results file and the row dataset they were solved from.
    """
    rows, cached, secs = ensure_rows(spec, runs / "cache" / "rows", log, cfg.threads)
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
        + f"; budgets {', '.join(map(str, cfg.budgets))}{', all-key search' if cfg.search == 'all' else ''}"
        + f"{', certified' if certify else ''})")
    return res, rows


def _label_model(path: Path, label: str) -> None:
    """Make sure the results carry a model column (synthetic rows have none)."""
    import polars as pl

    df = read_checked_parquet(path, "run the demo again with --resolve")
    if "model" in df.columns and df["model"].null_count() == 0 and (df["model"] != "").all():
        return
    write_parquet(df.with_columns(pl.lit(label).alias("model")), path)


# --------------------------------------------------------------------------------------
# stages 3-5: statistics, predictors, claims, figures (in-process)
# --------------------------------------------------------------------------------------
def write_parquet(df: Any, path: Path) -> Path:
    """Write a polars frame atomically, with its checksum; return ``path``."""
    from evictlab.io import write_checked_parquet

    write_checked_parquet(df, path)
    return path


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
        from evictlab.stats.penalty import ablation_rows, explain, penalty_table

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
    """:func:`compute`, then the Markdown report (:func:`evictlab.report.demo.write_report`); returns its path."""
    from evictlab.report.demo import write_report

    t0 = time.perf_counter()
    analysis = compute(results, out_dir, cfg, log=log, cert_results=cert_results, rows=rows, contour=contour)
    report = write_report(analysis, provenance or {})
    log(f"report: {report} ({time.perf_counter() - t0:.1f}s)")
    return report


def hardness_stage(cfg: AnalysisConfig, work: Path, log: Any) -> Any:
    """``evictlab hardness check --trials N --size n --seed S --out WORK`` (a subprocess, like
    stages 1-2, so its input errors name that command's options); returns its trial table.

    Exit status 1 means the exact methods disagreed: that is a result (the claims table
    reports the disagreements), not a failed stage.
    """
    import polars as pl

    args = ["hardness", "check", "--trials", str(cfg.hardness_trials), "--size", str(cfg.hardness_size),
            "--seed", str(cfg.seed), "--out", str(work), "--overwrite"]
    work.mkdir(parents=True, exist_ok=True)
    _evictlab(args, log, ok=(0, 1))
    trials = work / "trials.parquet"
    if not trials.is_file():
        raise StageError(f"`evictlab {' '.join(args)}` wrote no {trials}; see its message above")
    return read_checked_parquet(trials, f"delete {work} and run the demo again")


# --------------------------------------------------------------------------------------
# the ContourKV section: a small evaluation grid in the decode loop (subprocess, resumable)
# --------------------------------------------------------------------------------------
@dataclass
class ContourResult:
    """The ContourKV section's inputs to the report: the grid as run, its results, the
    claim rows and the per-comparison table of :func:`evictlab.eval.claims.contourkv_versus`."""

    grid: dict[str, Any]
    folder: Path
    results: Any
    claims: list[Any]
    detail: Any


@dataclass
class ContourJob:
    """A running ContourKV grid (:func:`contour_start`): the subprocess, its grid and folder."""

    proc: subprocess.Popen
    grid: dict[str, Any]
    work: Path
    args: list[str]
    t0: float

    def stop(self) -> None:
        """Stop the grid (the main job failed or was interrupted); a rerun resumes it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def contour_start(grid: dict[str, Any], work: Path, cfg: AnalysisConfig, log: Any) -> ContourJob:
    """Start ``evictlab eval run`` over ``grid`` (keys of
    :data:`evictlab.eval.claims.CONTOUR_FULL_GRID`) into ``work`` (a rerun resumes it) as a
    subprocess, and return at once: the grid needs only the model, so it runs on a second
    core while the single-threaded capture and solve stages run (docs/reproduction.md).
    :func:`contour_finish` waits for it. A subprocess like stages 1-2, so its input errors
    name that command's options."""
    args = ["eval", "run", "--models", ",".join(grid["models"]), "--tasks", ",".join(grid["tasks"]),
            "--context", ",".join(map(str, grid["contexts"])), "--budgets", ",".join(grid["budgets"]),
            "--methods", ",".join(grid["methods"]), "--modes", ",".join(grid["modes"]),
            "--protocols", ",".join(grid["protocols"]), "--n", str(grid["n"]), "--seed", str(cfg.seed),
            "--threads", str(cfg.threads), "--quiet", "--out", str(work)]
    work.parent.mkdir(parents=True, exist_ok=True)
    log(f"$ evictlab {' '.join(args)}  (in the background)")
    proc = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args])
    return ContourJob(proc=proc, grid=dict(grid), work=work, args=args, t0=time.perf_counter())


def contour_finish(job: ContourJob, cfg: AnalysisConfig, log: Any) -> ContourResult:
    """Wait for :func:`contour_start`'s grid, then ContourKV against the other allocators at
    matched bytes; raise StageError when the grid failed."""
    import polars as pl

    from evictlab.eval.claims import contourkv_versus

    if job.proc.poll() is None:
        log("waiting for the ContourKV grid")
    code = job.proc.wait()
    if code != 0:
        raise StageError(f"`evictlab {' '.join(job.args)}` exited with status {code}; see its message above")
    results = read_checked_parquet(job.work / "results.parquet", f"delete {job.work} and run the demo again")
    claims, detail = contourkv_versus(results, seed=cfg.seed, n_boot=cfg.n_boot)
    return ContourResult(grid=job.grid, folder=job.work, results=results, claims=claims, detail=detail)


def contour_stage(grid: dict[str, Any], work: Path, cfg: AnalysisConfig, log: Any) -> ContourResult:
    """:func:`contour_start` then :func:`contour_finish` (the grid in the foreground)."""
    job = contour_start(grid, work, cfg, log)
    try:
        return contour_finish(job, cfg, log)
    finally:
        job.stop()
