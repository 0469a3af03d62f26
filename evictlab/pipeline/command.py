"""``evictlab demo``: which rows for which model, the stages in order, timings and the run record."""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from evictlab.cliutil import QUIET
from evictlab.errors import InputError, refuse_duplicates
from evictlab.pipeline.analysis import analyse
from evictlab.pipeline.config import AnalysisConfig, CaptureSpec, parse_budgets
from evictlab.pipeline.contour import contour_finish, contour_start
from evictlab.pipeline.stages import rows_and_results

#: Default (demo) sizes per model, measured to fit the time bars on the 2-core machine
#: (docs/reproduction.md): 8 prompts from 8 different plays per model; Gemma 3 has fewer
#: heads (72 vs 270 per position), so it gets more positions.
DEMO_CAPTURE = {
    "smollm2-135m": dict(context=256, positions=4, prompts=8),
    "gemma3-270m": dict(context=256, positions=8, prompts=8),
}
DEMO_DEFAULT = dict(context=256, positions=4, prompts=8)
#: Paper scale: 168,480 SmolLM2 rows (8 prompts x 78 positions x 30 layers x 9 heads) + Gemma 3.
FULL_CAPTURE = {
    "smollm2-135m": dict(context=1024, positions=78, prompts=8),
    "gemma3-270m": dict(context=1024, positions=64, prompts=8),
}
DEMO_SYNTH = dict(synthetic_rows=4096, synthetic_keys=512, synthetic_dim=64)
FULL_SYNTH = dict(synthetic_rows=168_192, synthetic_keys=1000, synthetic_dim=64)

#: Certification pass: rows short enough (n <= 48) for the certified optimum, budgets s <= 8;
#: 8 prompts (one position each) so its interval can resample prompts.
CERT_CAPTURE = dict(context=48, positions=1, prompts=8)
CERT_SYNTH = dict(synthetic_rows=1080, synthetic_keys=40, synthetic_dim=64)
CERT_MAX_S = 8

#: The ContourKV section of the default job: one model, one task, two budgets, SnapKV
#: windows with ContourKV (online) and with each baseline, physical (docs/reproduction.md);
#: ``--full`` runs :data:`evictlab.eval.claims.contour.CONTOUR_FULL_GRID`.
DEMO_CONTOUR = {
    "tasks": ["needle_word"], "contexts": [512], "budgets": ["64", "128"],
    "methods": ["snapkv+contourkv", "snapkv", "snapkv+pyramidkv", "snapkv+adakv"],
    "modes": ["physical"], "protocols": ["query-agnostic"], "n": 3,
}


def cert_spec(main: CaptureSpec, seed: int) -> CaptureSpec:
    """The certification pass's rows for the job's first model (or synthetic rows)."""
    if main.synthetic:
        return CaptureSpec(model="synthetic", context=0, positions=0, prompts=0, seed=seed, **CERT_SYNTH)
    return CaptureSpec(model=main.model, source=main.source, seed=seed, **CERT_CAPTURE)


def job_specs(full: bool, synthetic: bool, model: str, second_model: str, context: Optional[int],
              positions: Optional[int], prompts: Optional[int], seed: int) -> list[CaptureSpec]:
    """The rows the job analyses: one spec per model (or one synthetic spec)."""
    if synthetic:
        base = FULL_SYNTH if full else DEMO_SYNTH
        return [CaptureSpec(model="synthetic", context=0, positions=0, prompts=0, seed=seed, **base)]
    specs = []
    for m in [model] + ([second_model] if second_model.lower() not in ("", "none") else []):
        base = dict(FULL_CAPTURE.get(m, FULL_CAPTURE["smollm2-135m"]) if full else DEMO_CAPTURE.get(m, DEMO_DEFAULT))
        if context is not None:
            base["context"] = context
        if positions is not None:
            base["positions"] = positions
        if prompts is not None:
            base["prompts"] = prompts
        specs.append(CaptureSpec(model=m, seed=seed, **base))
    return specs


def demo(
    name: str = typer.Option("", "--name", help="Run folder under --runs (default: demo, demo-full, demo-synthetic...)."),
    full: bool = typer.Option(False, "--full", help="Paper scale: >= 168,192 SmolLM2 rows plus gemma3-270m (about an hour on 2 cores)."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Synthetic rows (evictlab rows synth) instead of a model capture."),
    model: str = typer.Option("smollm2-135m", "--model", help="Model to capture (registry name or local HF folder)."),
    second_model: str = typer.Option("gemma3-270m", "--second-model",
                                     help="Second model (cross-model transfer and pooled claims); 'none' for one model."),
    context: Optional[int] = typer.Option(None, "--context", help="Prompt length in tokens (default 256; 1024 with --full)."),
    positions: Optional[int] = typer.Option(None, "--positions",
                                            help="Query positions per prompt (default 4 for SmolLM2 and 8 for Gemma 3; "
                                                 "78 and 64 with --full)."),
    prompts: Optional[int] = typer.Option(None, "--prompts", help="Prompts per model, each from a different play (default 8)."),
    budgets: str = typer.Option("4,8,16,32", "--keep", help="Keys kept per row, the budgets s, comma-separated "
                                "(formerly --budgets)."),
    certify: bool = typer.Option(True, "--certify/--no-certify",
                                 help="Certification pass: short-context rows (n <= 48) solved with --certify, to count how often the pool misses the true optimum."),
    search: str = typer.Option("all", "--search",
                               help="Solver neighbourhood of the main rows: all (default) adds the all-key search "
                                    "(ES_ls) and the report's section on the ceiling beyond the pool; pool skips it."),
    threshold: float = typer.Option(1.11, "--threshold", help="Significant gap: kappa_hat > threshold."),
    seed: int = typer.Option(0, "--seed", help="Seed for synthetic rows, splits and bootstrap."),
    n_boot: int = typer.Option(1000, "--n-boot", help="Bootstrap resamples for medians and AUCs."),
    hardness_trials: int = typer.Option(40, "--hardness-trials", help="NP-hardness checker instances (0: skip)."),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Folder for run outputs and the rows cache."),
    threads: int = typer.Option(1, "--threads", help="CPU threads of the capture stage's computation (torch) (0 = the library default, all cores). One "
                                "thread avoids OpenMP oversubscription on shared machines (docs/performance.md)."),
    results: Optional[List[Path]] = typer.Option(None, "--results", help="Analyse existing solver results (skip capture and solve)."),
    resolve: bool = typer.Option(False, "--resolve", help="Re-run the solver even if cached results for these rows and settings exist."),
    contour: bool = typer.Option(True, "--contour/--no-contour",
                                 help="ContourKV section: ContourKV vs uniform, PyramidKV and AdaKV at matched bytes in "
                                      "the decode loop (--model, needle_word, 2 budgets; with --full the whole grid). "
                                      "Needs a model: skipped with --synthetic or --results."),
    quiet: bool = QUIET,
) -> None:
    """The main job: capture -> solve -> stats -> predictors -> figures -> report; prints where the report is."""
    from rich.console import Console

    from evictlab.record import RunRecord, record_path

    console = Console(stderr=True)

    def log(msg: str) -> None:
        if not quiet:
            console.print(f"[bold cyan]\\[demo][/bold cyan] {msg}", highlight=False)

    if not threshold > 0:
        raise InputError("--threshold", f"must be positive, got {threshold}", "use e.g. 1.11")
    if search not in ("pool", "all"):
        raise InputError("--search", f"must be 'pool' or 'all', got {search!r}", "pass --search all or --search pool")
    if threads < 0:
        raise InputError("--threads", f"must be >= 0, got {threads}", "pass 0 (torch default) or a thread count")
    if results:
        refuse_duplicates([p.resolve() for p in results], "--results", "results file")
    if not synthetic and not results:  # every model name, before any stage runs (nothing is pulled here)
        from evictlab.models.loading import check_model_name

        check_model_name(model, "--model")
        if second_model.lower() not in ("", "none"):
            check_model_name(second_model, "--second-model")
    cfg = AnalysisConfig(budgets=parse_budgets(budgets), threshold=threshold, seed=seed, n_boot=n_boot,
                         hardness_trials=hardness_trials, threads=threads, search=search, quiet=quiet)
    run_name = name or ("demo" + ("-full" if full else "") + ("-synthetic" if synthetic else ""))
    out = runs / run_name
    record = RunRecord(kind="demo", model=model, seed=seed,
                       config={"full": full, "synthetic": synthetic, "second_model": second_model,
                               "budgets": cfg.budgets, "pool": cfg.pool,
                               "threshold": threshold, "n_boot": n_boot, "certify": certify, "resolve": resolve,
                               "search": search,
                               "threads": threads, "contour": contour,
                               "results": [str(p) for p in results] if results else None})
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    facts: dict[str, str] = {}
    cert_paths: Optional[list[Path]] = None
    rows: dict[str, Path] = {}
    inputs: dict[str, dict[str, str]] = {"results": {}, "rows": {}, "certified": {}, "certified_rows": {}}
    contour_job = None
    if contour and not synthetic and not results:
        from evictlab.eval.claims.contour import CONTOUR_FULL_GRID

        # the grid needs only the model: it runs on a second core beside capture and solve
        grid = dict(CONTOUR_FULL_GRID) if full else {**DEMO_CONTOUR, "models": [model]}
        contour_job = contour_start(grid, out / "contourkv", cfg, log)
    try:
        if results:
            result_paths = list(results)
            facts["input"] = "given solver results: " + ", ".join(map(str, results))
        else:
            specs = job_specs(full, synthetic, model, second_model, context, positions, prompts, seed)
            result_paths = []
            for spec in specs:
                res, rows[spec.label()] = rows_and_results(spec, cfg, False, out / "results" / f"{spec.label()}.parquet",
                                                           runs, resolve, timings, facts, log)
                result_paths.append(res)
            if certify:
                cspec = cert_spec(specs[0], seed)
                # the short rows always get the all-key search too (cheap at n <= 48; it also seeds
                # the certificate): the report's beyond-the-pool section compares all three there
                ccfg = AnalysisConfig(budgets=tuple(b for b in cfg.budgets if b <= CERT_MAX_S) or (4,), pool=cfg.pool,
                                      threads=threads, search="all")
                cres, crows = rows_and_results(cspec, ccfg, True, out / "certified" / f"{cspec.label()}.parquet",
                                               runs, resolve, timings, facts, log, tag="certification ")
                cert_paths = [cres]
                inputs["certified"][cspec.label()], inputs["certified_rows"][cspec.label()] = str(cres), str(crows)
        inputs["results"] = {p.stem: str(p) for p in result_paths}
        inputs["rows"] = {m: str(p) for m, p in rows.items()}
        from evictlab.io import atomic_write_json

        # which files each claim reads (paper_repro/ uses it): main results, their rows, the certification pass
        atomic_write_json(out / "inputs.json", inputs)
        contour_result = None
        if contour_job is not None:
            t_c = time.perf_counter()
            contour_result = contour_finish(contour_job, cfg, log)
            timings["contourkv grid"] = time.perf_counter() - contour_job.t0
            timings["contourkv grid (waited)"] = time.perf_counter() - t_c
            facts["contourkv grid"] = (f"`{out / 'contourkv'}` (`evictlab eval run`, {contour_job.grid['n']} examples per "
                                       "cell; run beside capture and solve, on a second core)")
        elif contour:
            facts["contourkv grid"] = "not run (it needs a model: --synthetic and --results skip it)"
    finally:
        if contour_job is not None:
            contour_job.stop()  # a failed or interrupted job stops the grid too; a rerun resumes it
    t_an = time.perf_counter()
    report = analyse(result_paths, out, cfg, {"facts": facts}, log=log, cert_results=cert_paths,
                     rows=rows or None, contour=contour_result)
    timings["analysis"] = time.perf_counter() - t_an
    timings["total"] = time.perf_counter() - t0
    record.write(record_path(out, folder=True), timings_s={k: round(v, 2) for k, v in timings.items()},
                 outputs={"report": str(report), "results": [str(p) for p in result_paths]})
    log(f"done in {timings['total']:.0f}s")
    typer.echo(f"report: {report}")
