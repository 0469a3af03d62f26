"""CLI: ``evictlab dilution check`` and ``evictlab dilution sweep`` (thin: they call the library).

torch and transformers are imported inside the functions so ``evictlab --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

from evictlab.cliutil import QUIET
from evictlab.errors import InputError

#: = evictlab.dilution.sweep.DEFAULT_METHODS (not imported here: it would load the library for --help)
_SWEEP_METHODS = "full,oracle_labels,streaming_llm,h2o,snapkv,expected_attention,snapkv+adakv,snapkv+pyramidkv"

app = typer.Typer(help="Attention dilution: useful mass and its bounds on labelled rows; the distractor sweep.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)


def _ints(text: str, option: str, what: str) -> tuple[int, ...]:
    from evictlab.cliutil import parse_ints

    return tuple(parse_ints(text, option, what, example="32,128"))


def _names(text: str, option: str, what: str) -> tuple[str, ...]:
    from evictlab.cliutil import parse_list

    return tuple(parse_list(text, option, what))


@app.command("check")
def check(
    ctx: typer.Context,
    rows: Path = typer.Argument(..., help="A labelled row dataset (capture of a task source, schema version 2)."),
    out: Path = typer.Option(..., "--out", help="Output table T.parquet (its parent folder must exist); "
                             "T.heads.parquet, T.bounds.parquet, T.md and T.figures/ are written beside it."),
    budgets: str = typer.Option("32,128,512", "--keep", help="Kept-set sizes s: keys kept per row, comma-separated "
                                "(formerly --budgets)."),
    methods: str = typer.Option("top_mass,streaming_llm,h2o,snapkv,pool", "--methods",
                                help="Kept sets: top_mass (ORACLE for the row), streaming_llm, h2o, snapkv, pool."),
    useful: str = typer.Option("fact", "--useful", help="Useful part of an asked fact: fact, value or key_value."),
    margin: float = typer.Option(None, "--margin", help="Also check the bound under an assumed margin Delta_0 "
                                 "(rows with a smaller measured margin are counted as 'assumption fails')."),
    sinks: int = typer.Option(4, "--sinks", help="Always-kept first keys of the scorers' kept sets."),
    recent: int = typer.Option(16, "--recent", help="Always-kept most recent keys of the scorers' kept sets."),
    pool_max_s: int = typer.Option(64, "--pool-max-s", help="Pool optimum only for s up to this (C(s+4, 4) subsets per row)."),
    chunk_blocks: int = typer.Option(32, "--chunk-blocks", help="Blocks per resumable part file."),
    threads: int = typer.Option(0, "--threads", help="CPU threads of the computation (torch, Numba) (0 = the library default)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --out."),
    quiet: bool = QUIET,
) -> None:
    """Useful mass, margins and the dilution bounds (docs/theory.md section 7) on every row.

    Rows must carry fact labels (task sources); Shakespeare and file/jsonl text rows are refused.
    Rerunning the same command after an interruption resumes it.
    """
    from evictlab.cliutil import refuse_unused
    from evictlab.dilution.check import CheckConfig, run_check

    cfg = CheckConfig(budgets=_ints(budgets, "--keep", "kept-key count"), methods=_names(methods, "--methods", "method"),
                      useful=useful,
                      stated_margin=margin, sinks=sinks, recent=recent, pool_max_s=pool_max_s,
                      chunk_blocks=chunk_blocks)
    cfg.check()
    refuse_unused(ctx, "pool_max_s", "--pool-max-s", "pool" in cfg.methods, "pool in --methods")
    _threads(threads)
    s = run_check(rows, out, cfg, overwrite=overwrite, progress=not quiet)
    typer.echo(f"{s.rows} rows, {s.table_rows} table rows ({s.blocks} blocks, {s.blocks_skipped} already done) "
               f"in {s.seconds:.1f} s; bound violations where the assumptions hold: {s.violations}; {s.out}")
    if s.violations:
        raise typer.Exit(1)


def _threads(threads: int) -> None:
    if threads < 0:
        raise InputError("--threads", f"must be >= 0, got {threads}", "pass 0 (library default) or a thread count")
    if threads:
        import torch

        torch.set_num_threads(threads)
        try:
            import numba

            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        except ImportError:  # pragma: no cover - numba is a dependency
            pass


@app.command("sweep")
def sweep(
    model: str = typer.Option("smollm2-135m", "--model", help="Registry name, local HF folder or hub id."),
    distractors: str = typer.Option("0,4,16,64,256", "--distractors",
                                    help="Distractor counts k (near-miss needles, or their length in filler)."),
    n: int = typer.Option(5, "--n", help="Examples per distractor count (the same asked needles for every k)."),
    methods: str = typer.Option(_SWEEP_METHODS,
                                "--methods", help="full, oracle_labels (ORACLE: keeps the asked needle by its "
                                "labels), and scorer or scorer+allocator names as in `evictlab decode`, "
                                "with their own parameters in brackets if wanted (snapkv[window=64])."),
    budget: str = typer.Option("128", "--budget", help="Kept entries for every method: 128 = per cell, "
                               "4096total, or bytes (2MiB); matched bytes across methods."),
    context: int = typer.Option(512, "--context", help="Filler tokens of the haystack besides the needles."),
    kind: str = typer.Option("near_miss", "--kind", help="near_miss (other keys, other values) or filler "
                             "(the same number of extra tokens, content-free)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the examples."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    sinks: int = typer.Option(4, "--sinks", help="Always-kept first entries per cell."),
    recent: int = typer.Option(16, "--recent", help="Always-kept most recent entries per cell."),
    chunk: int = typer.Option(256, "--chunk", help="Prefill chunk (tokens) between compressions."),
    window: int = typer.Option(32, "--window", help="Observation window (queries) for scorers."),
    compress_every: int = typer.Option(16, "--compress-every", help="Decode steps between compressions."),
    layers: str = typer.Option("all", "--layers", help="Layers whose attention enters the useful mass: 'all' or "
                               "a list like 0,5,10-12 (every layer is still evicted and decoded)."),
    threads: int = typer.Option(0, "--threads", help="CPU threads of the computation (torch) (0 = the library default)."),
    scorer_param: list[str] = typer.Option([], "--scorer-param", help="KEY=VALUE for the methods' scorers, as in "
                                           "`evictlab decode` (repeatable; NAME.KEY=VALUE for one scorer), e.g. "
                                           "gates=default for trimkv+global's shipped gates."),
    out: Path = typer.Option(..., "--out", help="Output folder (its parent must exist); rerun to resume."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Run again into a folder that holds a finished sweep."),
    quiet: bool = QUIET,
) -> None:
    """Needle retrieval with k distractors: full cache vs ORACLE (evicts distractors only) vs
    the query-agnostic methods at the same budget; accuracy, answer log-probability, useful mass.

    Resumable: rerun the same command after an interruption.
    """
    from evictlab.dilution.sweep import SweepConfig, run_sweep
    from evictlab.methods.params import parse_assignments

    if threads < 0:
        raise InputError("--threads", f"must be >= 0, got {threads}", "pass 0 (library default) or a thread count")
    cfg = SweepConfig(model=model, distractors=_ints(distractors, "--distractors", "distractor count"), n=n,
                      methods=_names(methods, "--methods", "method"),
                      budget=budget, context=context, kind=kind, seed=seed, device=device, sinks=sinks, recent=recent,
                      chunk=chunk, window=window, compress_every=compress_every, layers=layers,
                      scorer_params=tuple(parse_assignments(scorer_param, "--scorer-param").items()))
    cfg.check()
    s = run_sweep(cfg, out, progress=not quiet, threads=threads, overwrite=overwrite)
    typer.echo(f"{s.units} runs ({s.units_skipped} already done) in {s.seconds:.0f} s; "
               f"{s.out}/report.md, results.parquet, summary.parquet, verdict.parquet")
