"""CLI commands ``evictlab eval run`` and ``evictlab eval compare`` (thin: they call the library).

Everything typed is checked before any model loads (:class:`~evictlab.eval.spec.GridSpec`);
checks that need a model's geometry (a budget at or above the full cache, below the
always-kept floors; an example beyond the model's positions) run once the models are loaded
and before the first cell. The library's neutral error fields are reported under this
command's options (:func:`evictlab.decode.commands.as_options`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from evictlab.decode.commands import LOOP_OPTIONS, as_options
from evictlab.cliutil import QUIET
from evictlab.executor.commands import EXECUTOR_OPTIONS

eval_app = typer.Typer(help="The evaluation grid: methods at matched bytes on seeded examples, paired comparisons.",
                       no_args_is_help=True, rich_markup_mode=None)

RUN_OPTIONS = {
    "models": "--models", "model": "--models", "--model": "--models", "model.config": "--models", "tokenizer": "--models",
    "tasks": "--tasks", "task": "--tasks", "contexts": "--context", "context_tokens": "--context",
    "windows": "--context", "budgets": "--budget", "budget": "--budget", "budget.value": "--budget",
    "budget.unit": "--budget", "methods": "--methods", "method": "--methods", "scorer": "--methods",
    "allocator": "--methods", "modes": "--store", "mode": "--store", "protocols": "--protocol",
    "question_ids": "--protocol", "n": "--n", "seed": "--seed", "threads": "--threads", "scorer_param": "--scorer-param",
    "allocator_param": "--allocator-param", "ppl_target": "--ppl-target", "out": "--out", "chunk_size": "--chunk",
    "compress_every": "--compress-every", "window": "--window", "block_size": "--block-size", "sinks": "--sinks",
    "recent": "--recent", "prefill": "--prefill", "questions": "--questions", "question": "--questions",
    "distractors": "--distractors",
}
COMPARE_OPTIONS = {"tie_rule": "--tie-rule", "tolerance": "--tolerance", "level": "--level", "n_boot": "--n-boot",
                   "results": "GRID", "out": "--out"}


#: The keys of an ``eval run --config`` file (docs/evaluation.md, "Config files"): each is
#: an option's name without its dashes, with the kind of value it takes
#: (:data:`evictlab.cliutil.CONFIG_KINDS`).
CONFIG_KEYS: dict[str, str] = {
    "models": "list", "tasks": "list", "context": "list", "budget": "list", "methods": "list", "store": "list",
    "protocol": "list", "prefill": "str", "questions": "int", "n": "int", "seed": "int", "out": "path",
    "scorer_param": "strings", "allocator_param": "strings", "ppl_target": "int", "device": "str", "sinks": "int",
    "recent": "int", "chunk": "int", "compress_every": "int", "window": "int", "block_size": "int",
    "threads": "int", "workers": "int", "trace": "bool", "distractors": "list",
}
#: Config keys whose parameter is named otherwise (the option's plural spelling in Python).
CONFIG_PARAMS = {"budget": "budgets", "store": "modes", "protocol": "protocols"}


@eval_app.command("run")
def run(
    ctx: typer.Context,
    models: str = typer.Option("smollm2-135m", "--models", "--model",
                               help="comma-separated models: registry names, local HF folders or hub ids"),
    tasks: str = typer.Option("needle", "--tasks", "--task", help="comma-separated tasks (docs/evaluation.md): needle, multi_key, multi_needle, "
                              "variable_tracking, needle_word, multi_key_word, multi_value, heldout_ppl, the "
                              "multi-question families, or suite (the suite's tasks without the cells the full "
                              "cache cannot do, from data/task_floor), dilution_near_miss_kK / dilution_filler_kK "
                              "(needle retrieval with K labelled distractors; docs/dilution.md), or the families "
                              "dilution_near_miss / dilution_filler with --distractors"),
    distractors: Optional[str] = typer.Option(None, "--distractors", show_default=False,
                                              help="comma-separated distractor counts K (0-270): each dilution "
                                                   "family in --tasks (dilution_near_miss, dilution_filler) becomes "
                                                   "one task per K, e.g. dilution_near_miss_k16; refused without a "
                                                   "family"),
    context: str = typer.Option("1024", "--context", help="comma-separated context lengths (tokens)"),
    budgets: str = typer.Option(None, "--budget", show_default=False,
                                help="KV budgets, comma-separated: 64 (kept tokens per cell), 4096total, 2MiB "
                                     "(default 64; none with --methods full) (formerly --budgets)"),
    methods: str = typer.Option("snapkv,snapkv+adakv", "--methods",
                                help="comma-separated scorer or scorer+allocator, each part optionally with its "
                                     "own parameters, an arm of its own: trimkv[gates=DIR]+global, snapkv[window=64] "
                                     "(commas inside brackets do not split; a bracket parameter overrides "
                                     "--scorer-param/--allocator-param for that arm); `full` alone: the full cache "
                                     "only"),
    modes: str = typer.Option(None, "--store", show_default=False,
                              help="how the cache is held, comma-separated: physical, uniform (physical, equal sizes "
                                   "per cell), masked (default physical) (formerly --modes)"),
    protocols: str = typer.Option(None, "--protocol", show_default=False,
                                  help="protocols, comma-separated: query-agnostic, query-aware (default "
                                       "query-agnostic) (formerly --protocols)"),
    prefill: str = typer.Option("one-pass", "--prefill",
                                help="one-pass (the context fed once and compressed after it; one prefill per "
                                     "context shared by every arm) or chunked (the per-arm path: each arm feeds the "
                                     "context in --chunk pieces, compressing after each)"),
    questions: Optional[int] = typer.Option(None, "--questions", show_default=False,
                                            help="questions answered per context, the first ones (default: every "
                                                 "question the task asks); one row per (cell, example, question)"),
    n: int = typer.Option(10, "--n", help="seeded examples (contexts) per (task, context length)"),
    seed: int = typer.Option(0, "--seed", help="seed of the examples"),
    out: Optional[Path] = typer.Option(None, "--out", show_default=False,
                                       help="grid folder (created; rerun the same command to resume); required, "
                                            "here or as `out` in the --config file"),
    config: Optional[Path] = typer.Option(None, "--config", show_default=False,
                                          help="TOML file of this command's options (keys: the option names without "
                                               "dashes, e.g. experiments/smoke.toml); options given here override it"),
    scorer_param: list[str] = LOOP_OPTIONS["scorer_param"], allocator_param: list[str] = LOOP_OPTIONS["allocator_param"],
    ppl_target: int = typer.Option(32, "--ppl-target", help="target tokens of a heldout_ppl window"),
    device: str = LOOP_OPTIONS["device"], sinks: int = LOOP_OPTIONS["sinks"], recent: int = LOOP_OPTIONS["recent"],
    chunk: int = typer.Option(256, "--chunk", help="with --prefill chunked: prefill chunk (tokens) between compressions"),
    compress_every: int = LOOP_OPTIONS["compress_every"],
    window: int = LOOP_OPTIONS["window"], block_size: int = LOOP_OPTIONS["block_size"],
    threads: int = typer.Option(0, "--threads", help="torch CPU threads (0 = torch default; with --workers or "
                                "--executor ray: threads per task, 1 if 0)"),
    workers: int = EXECUTOR_OPTIONS["workers"],
    quiet: bool = QUIET,
    trace: bool = typer.Option(False, "--trace", help="also write per-compression diagnostics (OUT/trace.parquet: "
                               "one row per (cell, example, question, compression, layer, KV head) with kept/held "
                               "entries, the observation window's dropped mass, e(A), e(T_s), ES_hat; docs/methods.md)"),
    executor: str = EXECUTOR_OPTIONS["executor"],
    address: Optional[str] = EXECUTOR_OPTIONS["address"],
) -> None:
    """Run (or resume) the grid models x tasks x contexts x budgets x methods x modes x protocols
    x n examples x their questions; one row per (cell, example, question) in OUT/results.parquet.
    One-pass (default): each context is prefilled once and every arm answers from it. With
    --workers N the units run in N local processes; with --executor ray each unit is one Ray
    task (models cached per worker); this process writes the parts (docs/evaluation.md)."""
    from evictlab.io import check_output_path
    from evictlab.record import RunRecord

    with as_options(RUN_OPTIONS):
        spec, p, cfg_file = grid_of(ctx)
        out = check_output_path(p["out"], "--out", directory=True)
        threads = p["threads"]
        spec.check_models()
        from evictlab.models.loading import check_device

        executor, workers, quiet = p["executor"], p["workers"], p["quiet"]
        if executor == "local":
            check_device(spec.device)  # a remote run's workers own the GPUs (checked there)
        record = RunRecord(kind="eval.run", model=",".join(spec.models), seed=spec.seed,
                           config={**spec.to_dict(), "executor": executor, "workers": workers,
                                   "config_file": None if cfg_file is None else cfg_file.record()})

        import torch
        from tqdm import tqdm

        from evictlab.eval.grid import remote_cells, run_grid
        from evictlab.executor import task_bar
        from evictlab.executor.commands import executor_for

        in_process = executor == "local" and workers == 1
        if threads > 0 and in_process:
            torch.set_num_threads(threads)
        bar: Any = None

        def on_start(total: int, done: int) -> None:
            nonlocal bar
            if in_process:
                bar = tqdm(total=total, initial=done, unit="ex", desc="eval", disable=True if quiet else None,
                           dynamic_ncols=True)
            else:  # tasks (units): done, running, queued, failed
                bar = task_bar("eval", initial=0, disable=quiet)

        def progress(k: int) -> None:
            if bar is not None:
                bar.update(k)

        def on_tasks(counts: Any) -> None:
            if bar is not None:
                bar(counts)

        from evictlab.executor.processes import ProcessExecutor

        pool = ProcessExecutor(workers, threads or 1) if workers > 1 else executor_for(executor, p["address"])
        with pool as ex:
            remote = (None, None) if in_process else remote_cells(ex, threads, spec.device, on_tasks)
            try:
                res = run_grid(spec, out, progress=progress, on_start=on_start, record=record,
                               map_cells=remote[0], check_models=remote[1])
            finally:
                if bar is not None:
                    bar.close()
    if spec.prefill == "one-pass":
        typer.echo(f"{res.cells} cells over {res.units} contexts ({res.ran} contexts run now, {res.resumed} already "
                   f"done): {res.results}")
    else:
        typer.echo(f"{res.cells} cells ({res.ran} run now, {res.resumed} already done): {res.results}")
    typer.echo(f"next: evictlab eval compare {out}")


def grid_of(ctx: Any) -> tuple[Any, dict[str, Any], Any]:
    """The grid ``eval run`` would run: ``(GridSpec, parameters, config file or None)`` from
    the command's click context (its parameters, the ``--config`` file applied where an
    option was not given on the command line), every typed value checked (InputError
    naming the option), no model loaded. Tests and ``experiments/`` checks read a config
    file's grid through it."""
    from evictlab.cliutil import apply_config, given, parse_ints, parse_list, read_config
    from evictlab.decode.config import LoopSettings
    from evictlab.errors import InputError
    from evictlab.eval.spec import GridSpec
    from evictlab.executor import check_executor
    from evictlab.methods import parse_assignments

    config = ctx.params.get("config")
    cfg_file = read_config(config, CONFIG_KEYS, "--config") if config is not None else None
    p = apply_config(ctx, dict(ctx.params), cfg_file, CONFIG_PARAMS)
    check_executor(p["executor"], p["address"])
    if p["workers"] < 1:
        raise InputError("--workers", f"{p['workers']} workers", "use --workers 1 (this process) or more (local processes)")
    if p["workers"] > 1 and p["executor"] != "local":
        raise InputError("--workers", f"starts local processes; with --executor {p['executor']} the cluster runs the "
                         "units", "drop --workers (the cluster runs as many units as it has CPUs), or the --executor")
    if p["out"] is None:
        raise InputError("--out", "is required", "pass --out DIR (or out = \"DIR\" in the --config file)")
    if p["threads"] < 0:
        raise InputError("--threads", f"must be >= 0, got {p['threads']}", "pass 0 (torch default) or a thread count")
    in_file = cfg_file is not None and "chunk" in cfg_file.values
    if p["prefill"] == "one-pass" and (given(ctx, "chunk") or in_file):
        where = "--chunk" if given(ctx, "chunk") else f"chunk in {cfg_file.path}"  # type: ignore[union-attr]
        raise InputError("--chunk", f"{where} only applies with --prefill chunked (a one-pass prefill feeds the "
                         "whole context at once)", "drop it, or pass --prefill chunked")
    method_list = parse_list(p["methods"], "--methods", "method")
    evicting = any(m != "full" for m in method_list)
    budgets, modes, protocols = p["budgets"], p["modes"], p["protocols"]
    budget_list = parse_list(budgets, "--budget", "budget") if budgets is not None else (["64"] if evicting else [])
    spec = GridSpec.build(
        models=parse_list(p["models"], "--models", "model"), tasks=parse_list(p["tasks"], "--tasks", "task"),
        contexts=parse_list(p["context"], "--context", "context length"), methods=method_list,
        budgets=budget_list, modes=None if modes is None else parse_list(modes, "--store", "store"),
        protocols=None if protocols is None else parse_list(protocols, "--protocol", "protocol"), n=p["n"],
        seed=p["seed"],
        loop=LoopSettings(sinks=p["sinks"], recent=p["recent"], chunk_size=p["chunk"],
                          compress_every=p["compress_every"], window=p["window"], block_size=p["block_size"]),
        scorer_params=parse_assignments(p["scorer_param"], "--scorer-param"),
        allocator_params=parse_assignments(p["allocator_param"], "--allocator-param"),
        target_tokens=p["ppl_target"], device=p["device"], trace=p["trace"], prefill=p["prefill"],
        questions=p["questions"],
        distractors=None if p["distractors"] is None else parse_ints(p["distractors"], "--distractors",
                                                                      "distractor count", lo=0, example="0,4,16,64"))
    return spec, p, cfg_file


@eval_app.command("compare")
def compare(
    grid: Path = typer.Argument(..., help="a grid folder written by `evictlab eval run`"),
    out: Path = typer.Option(None, "--out", show_default=False,
                             help="pairs table (default GRID/pairs.parquet); the report (.md), figures and run "
                                  "record are written beside it"),
    tie_rule: str = typer.Option("em-logprob", "--tie-rule",
                                 help="em-logprob (comparison: more example wins than losses) or bootstrap "
                                      "(comparison: a paired bootstrap interval containing 0 is a tie)"),
    tolerance: float = typer.Option(0.1, "--tolerance", help="nats of answer log-prob within which examples tie"),
    level: float = typer.Option(0.95, "--level", help="bootstrap interval level"),
    n_boot: int = typer.Option(2000, "--n-boot", help="bootstrap resamples"),
    seed: int = typer.Option(0, "--seed", help="bootstrap seed"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out (and the files beside it)"),
    partial: bool = typer.Option(False, "--partial",
                                 help="a one-pass grid not finished yet (running or stopped): compare the first "
                                      "examples done in every cell, the report labelled PARTIAL (default --out "
                                      "GRID/partial/pairs.parquet)"),
) -> None:
    """Paired comparisons of a finished grid: wins, ties and losses, the claims, a report.
    With --partial, of the examples a running or stopped grid has done everywhere."""
    from evictlab.cliutil import outputs_written
    from evictlab.errors import InputError
    from evictlab.eval.compare import TieRule, configuration_lines
    from evictlab.eval.grid import MANIFEST, RESULTS, read_manifest
    from evictlab.io import check_output_file, exclusive_lock
    from evictlab.record import record_path

    with as_options(COMPARE_OPTIONS):
        if not grid.is_dir():
            raise InputError("GRID", f"{grid} is not a folder", "pass the --out folder of `evictlab eval run`")
        if not (grid / MANIFEST).is_file():
            raise InputError("GRID", f"{grid} is not a grid folder (no {MANIFEST})",
                             "pass the --out folder of `evictlab eval run`")
        manifest = read_manifest(grid)
        finished = (grid / RESULTS).is_file()
        if not finished and not partial:
            raise InputError("GRID", f"the grid in {grid} is not finished (no {RESULTS})",
                             "rerun the same `evictlab eval run` command to finish it, or pass --partial "
                             "for the examples done so far")
        partial = partial and not finished  # a finished grid is compared whole
        if out is None:
            out = grid / "partial" / "pairs.parquet" if partial else grid / "pairs.parquet"
        if out.suffix != ".parquet":
            raise InputError("--out", f"{out} does not end in .parquet (the pairs table is a Parquet file)",
                             f"use e.g. --out {out.with_suffix('.parquet')}")
        made = None
        if partial and out == grid / "partial" / "pairs.parquet" and not out.parent.exists():
            out.parent.mkdir()  # the default folder; a user's --out folder must exist
            made = out.parent
        try:
            out = check_output_file(out, "--out", overwrite=overwrite)
            results, note, record = _compare_inputs(grid, manifest, partial, seed, tie_rule, tolerance, level, n_boot)
        except BaseException:
            if made is not None and not any(made.iterdir()):
                made.rmdir()  # a refused or interrupted comparison leaves no empty folder behind
            raise
        rule = TieRule(kind=tie_rule, tolerance=tolerance, level=level, n_boot=n_boot, seed=seed)  # type: ignore[arg-type]
        with exclusive_lock(out, "--out"):
            written, configs = write_comparison(results, out, rule, manifest, note=note)
        record.write(record_path(out), outputs=[str(p) for p in written])
        outputs_written(*written)
    if note is not None:
        typer.echo(note)
    typer.echo(f"{written[0]}\n{written[1]}")
    for line in configuration_lines(configs):  # the papers' unit (the report states the rule)
        typer.echo(line)


def _compare_inputs(grid: Path, manifest: dict[str, Any], partial: bool, seed: int, tie_rule: str, tolerance: float,
                    level: float, n_boot: int) -> tuple[Any, str | None, Any]:
    """``(results, note, record)`` of ``eval compare``: the grid's results (with ``partial``,
    the examples done everywhere, and the note saying so) and the run record to write."""
    from evictlab.eval.grid import RESULTS
    from evictlab.io import read_checked_parquet
    from evictlab.record import RunRecord

    record = RunRecord(kind="eval.compare", seed=seed, config={
        "grid": str(grid), "tie_rule": tie_rule, "tolerance": tolerance, "level": level, "n_boot": n_boot})
    if not partial:
        return read_checked_parquet(grid / RESULTS, "rerun `evictlab eval run` into a new folder"), None, record
    from evictlab.eval.grid import partial_results
    from evictlab.eval.spec import GridSpec

    got = partial_results(GridSpec.from_dict(manifest["spec"]), grid)
    record.config["partial"] = {"examples": got.examples, "n": got.n, "units_done": got.units_done,
                                "units": got.units}
    return got.results, got.describe(), record


def write_comparison(results: Any, out: Path, rule: Any, manifest: dict[str, Any],
                     note: str | None = None) -> tuple[list[Path], Any]:
    """Pairs table, claims, configuration counts, figures and the Markdown report for
    ``results`` (atomic files; ``note``: a line the report opens with, e.g. a partial
    grid's). Returns the paths written (the table, the report, the claims, the
    configurations, then the figures) and the configurations table
    (:func:`evictlab.eval.compare.configurations`)."""
    import polars as pl

    from evictlab.errors import InputError
    from evictlab.eval.claims.contour import contour_summary, contourkv_versus
    from evictlab.eval.claims.enforcement import enforcement_cost
    from evictlab.eval.claims.gates import retention_gates
    from evictlab.eval.claims.margin import query_aware_margin
    from evictlab.eval.compare import compare as compare_pairs
    from evictlab.eval.compare import configurations
    from evictlab.io import atomic_write_text, write_checked_parquet
    from evictlab.plots.evaluation import accuracy_vs_bytes, wtl_bars
    from evictlab.eval.report import evaluation_markdown

    pairs = compare_pairs(results, rule)
    claims_e, detail_e = enforcement_cost(results, seed=rule.seed, n_boot=rule.n_boot)
    claims_m, detail_m = query_aware_margin(results, seed=rule.seed, n_boot=rule.n_boot)
    claims_c, detail_c = contourkv_versus(results, tolerance=rule.tolerance, seed=rule.seed, n_boot=rule.n_boot)
    claims_g, detail_g = retention_gates(results, seed=rule.seed, n_boot=rule.n_boot)
    glance = (contour_summary(results, tolerance=rule.tolerance, seed=rule.seed, n_boot=rule.n_boot)
              if detail_c.height else pl.DataFrame())
    stem = out.with_suffix("")
    figs = []
    for make, suffix in ((lambda p: wtl_bars(pairs, p), "_wtl"), (lambda p: accuracy_vs_bytes(results, p), "_accuracy")):
        try:
            figs.append(make(stem.parent / (stem.name + suffix)))
        except InputError:
            continue  # nothing of that kind in this grid (e.g. only the full cache)
    if glance.height and (glance["baseline"] == "uniform").any():
        from evictlab.plots.contour import verdict_forest

        figs.append(verdict_forest(glance, stem.parent / (stem.name + "_contour")))
    spec = manifest["spec"]
    config = {k: spec[k] for k in ("models", "tasks", "contexts", "budgets", "methods", "modes", "protocols", "n",
                                   "seed", "loop", "scorer_params", "allocator_params", "device", "prefill",
                                   "questions") if k in spec}
    md = evaluation_markdown(results, pairs, rule=rule.describe(), claims=[*claims_e, *claims_m, *claims_c, *claims_g],
                             enforcement=detail_e, margin=detail_m, contour=detail_c, contour_glance=glance,
                             gates=detail_g,
                             figures=[(f.png.name, f.caption) for f in figs], config=config,
                             skipped=manifest.get("skipped", []), floors=spec.get("floors", []), seed=rule.seed,
                             n_boot=rule.n_boot, note=note)
    report = stem.with_suffix(".md")
    atomic_write_text(report, md)
    write_checked_parquet(pairs, out)
    claims_path = stem.parent / (stem.name + "_claims.parquet")
    rows = [c.to_dict() for c in (*claims_e, *claims_m, *claims_c, *claims_g)]
    write_checked_parquet(pl.DataFrame(rows, schema={k: pl.Utf8 for k in (
        "claim_id", "claim", "paper_value", "our_value", "interval", "verdict", "model", "rows", "budgets",
        "definitions")}), claims_path)
    configs = configurations(pairs)
    configs_path = stem.parent / (stem.name + "_configurations.parquet")
    write_checked_parquet(configs, configs_path)
    extra = []
    if glance.height:
        extra.append(stem.parent / (stem.name + "_contour.parquet"))
        write_checked_parquet(glance, extra[-1])
    if detail_g.height:
        extra.append(stem.parent / (stem.name + "_gates.parquet"))
        write_checked_parquet(detail_g, extra[-1])
    return [out, report, claims_path, configs_path, *extra, *[f.png for f in figs], *[f.pdf for f in figs]], configs
