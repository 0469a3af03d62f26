"""CLI commands ``evictlab audit`` and ``evictlab decode`` (thin: they call the library).

Everything the user typed is checked before the model loads (methods, parameters,
budgets, tasks, sizes). The library raises :class:`InputError` with neutral field names
(``method``, ``scorer_param``, ``budget``, ...); :func:`_as_options` reports them under the
option of the command the user ran (``decode --method``, ``audit --methods``).
torch / transformers are imported inside the functions so ``evictlab --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, Optional

import typer

from evictlab.cliutil import QUIET, outputs_written
from evictlab.errors import InputError

_DEFAULT_METHODS = "streaming_llm,h2o,snapkv,snapkv+adakv,snapkv+pyramidkv"

# Neutral library field -> the option of each command that sets it.
_COMMON = {
    "scorer_param": "--scorer-param", "allocator_param": "--allocator-param",
    "budget": "--budget", "budget.value": "--budget", "budget.unit": "--budget",
    "task": "--task", "tasks": "--task", "--source": "--task",
    "chunk_size": "--chunk", "compress_every": "--compress-every", "window": "--window",
    "block_size": "--block-size", "sinks": "--sinks", "recent": "--recent",
    "model": "--model", "model.config": "--model", "max_subsets": "--trace-max-subsets",
}
DECODE_OPTIONS = {**_COMMON, "method": "--method", "scorer": "--method", "allocator": "--method",
                  "mode": "--store", "answer_ids": "--max-new-tokens"}
AUDIT_OPTIONS = {**_COMMON, "method": "--methods", "scorer": "--methods", "allocator": "--methods",
                 "n": "--n"}

_PARAM_HELP = ("method parameter as key=value, repeatable (e.g. {ex}); a key goes to every chosen {kind} "
               "that has it, NAME.key=value to that {kind} only")
# Options both commands share (one definition, one help text).
_SCORER_PARAM = typer.Option([], "--scorer-param", help=_PARAM_HELP.format(ex="window=64", kind="scorer"))
_ALLOCATOR_PARAM = typer.Option([], "--allocator-param", help=_PARAM_HELP.format(ex="alpha=0.3", kind="allocator"))
_DEVICE = typer.Option("cpu", "--device", help="cpu or cuda")
_SINKS = typer.Option(4, "--sinks", help="always-kept first entries per cell")
_RECENT = typer.Option(16, "--recent", help="always-kept most recent entries per cell")
_CHUNK = typer.Option(256, "--chunk", help="prefill chunk (tokens) between compressions")
_COMPRESS_EVERY = typer.Option(16, "--compress-every", help="decode steps between compressions")
_WINDOW = typer.Option(32, "--window", help="observation window (queries) for scorers")
_BLOCK_SIZE = typer.Option(16, "--block-size", help="page size of the physical store (entries)")
_PROTOCOL = typer.Option("query-agnostic", "--protocol", help="query-agnostic (the context is compressed before "
                         "the question is fed) or query-aware (LABELLED: nothing is compressed before the question is "
                         "fed, at any --chunk, so the ranking sees it; holds the whole context until then) "
                         "(formerly the flag --query-aware)")
_THREADS = typer.Option(0, "--threads", help="CPU threads of the computation (torch) (0 = the library default, all cores)")
_OVERWRITE = typer.Option(False, "--overwrite", help="replace an existing --out (and the files written beside it)")
_TRACE = typer.Option(None, "--trace", help="Parquet file of per-compression diagnostics: one row per (compression, "
                      "layer, KV head) with kept/held entries, the observation window's dropped mass, e(A), e(T_s) and "
                      "ES_hat (docs/methods.md)")
_TRACE_MAX_SUBSETS = typer.Option(20_000, "--trace-max-subsets", help="largest pool enumeration per row for the "
                                  "trace's ES_hat (larger: null with the reason)")
#: The loop's options, for other commands that run the decode loop (``evictlab eval run``).
LOOP_OPTIONS = {"scorer_param": _SCORER_PARAM, "allocator_param": _ALLOCATOR_PARAM, "device": _DEVICE,
                "sinks": _SINKS, "recent": _RECENT, "chunk": _CHUNK, "compress_every": _COMPRESS_EVERY,
                "window": _WINDOW, "block_size": _BLOCK_SIZE}


@contextlib.contextmanager
def _as_options(options: dict[str, str]) -> Iterator[None]:
    """Re-raise the library's :class:`InputError` under the command's option names."""
    try:
        yield
    except InputError as exc:
        option = options.get(exc.field)
        if option is None:
            raise
        raise type(exc)(option, exc.problem, exc.fix) from None


def return_freed_memory() -> None:
    """Let glibc give freed large blocks back to the system at once (``mallopt``
    ``M_MMAP_THRESHOLD`` = 128 KiB: blocks above it are mapped and unmapped one by one).

    glibc's default raises that threshold as large blocks are freed, after which a
    prefill's activation tensors come from the heap and stay resident once freed: measured
    on a 4k one-pass prefill of SmolLM2 during development, peak RSS 1.35 GB instead of
    1.21 GB (``benchmarks/bench_decode.py --malloc-default`` compares). A no-op where glibc
    is not the allocator."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


as_options = _as_options  # public: `evictlab eval` maps the library's fields the same way


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v <= 0:
            raise InputError("--" + name.replace("_", "-"), f"must be positive, got {v}", "pass a positive integer")


def _check_tasks(tasks: list[str]) -> None:
    from evictlab.tasks.synthetic import TASKS

    if not tasks:
        raise InputError("--task", "no task given", f"use some of: {', '.join(TASKS)}")
    for t in tasks:
        if t not in TASKS:
            raise InputError("--task", f"unknown task {t!r}", f"use some of: {', '.join(TASKS)}")


def _trace_for(ctx: Any, trace: Path | None, out: Path, max_subsets: int, overwrite: bool) -> Any:
    """A :class:`~evictlab.decode.trace.CompressionTrace` for ``--trace`` (checked like --out), or None."""
    from evictlab.cliutil import refuse_unused

    refuse_unused(ctx, "trace_max_subsets", "--trace-max-subsets", trace is not None, "--trace")
    if trace is None:
        return None
    from evictlab.decode.trace import CompressionTrace
    from evictlab.io import check_output_file

    trace = check_output_file(trace, "--trace", overwrite=overwrite)
    if trace.resolve() == out.resolve():
        raise InputError("--trace", f"{trace} is also --out", "write the trace to another file")
    return CompressionTrace(max_subsets=max_subsets)


def _query_aware(protocol: str) -> bool:
    """``--protocol``'s value as the loop's switch (InputError on another word)."""
    from evictlab.decode.config import PROTOCOLS

    if protocol not in PROTOCOLS:
        raise InputError("--protocol", f"unknown protocol {protocol!r}", f"use {' or '.join(PROTOCOLS)}")
    return protocol == PROTOCOLS[1]


def _loop_settings(sinks: int, recent: int, chunk: int, compress_every: int, window: int,
                   block_size: int):  # noqa: ANN202 - returns LoopSettings (lazy import)
    from evictlab.decode.config import LoopSettings

    return LoopSettings(sinks=sinks, recent=recent, chunk_size=chunk, compress_every=compress_every,
                        window=window, block_size=block_size)


def audit(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", help="registry name, local HF folder or hub id"),
    budget: list[str] = typer.Option(["64"], help="kept budget; repeat for several: 64 (tokens per cell), "
                                     "4096total, 2MiB"),
    methods: str = typer.Option(_DEFAULT_METHODS, help="comma-separated scorer or scorer+allocator, each part "
                                "optionally with its own parameters: snapkv[window=64]+adakv[alpha=0.3] (commas "
                                "inside brackets do not split; they override --scorer-param/--allocator-param)"),
    scorer_param: list[str] = _SCORER_PARAM, allocator_param: list[str] = _ALLOCATOR_PARAM,
    task: str = typer.Option("needle", help="comma-separated tasks: needle, multi_needle, multi_key, variable_tracking"),
    n: int = typer.Option(2, help="examples per task"),
    context: int = typer.Option(1024, help="context tokens per example"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("audit.parquet"), help="Parquet table; .png/.pdf/.md and .run_record.json written beside it"),
    device: str = _DEVICE, sinks: int = _SINKS, recent: int = _RECENT, chunk: int = _CHUNK,
    compress_every: int = _COMPRESS_EVERY, window: int = _WINDOW, block_size: int = _BLOCK_SIZE,
    protocol: str = _PROTOCOL, threads: int = _THREADS, overwrite: bool = _OVERWRITE,
    trace: Optional[Path] = _TRACE, trace_max_subsets: int = _TRACE_MAX_SUBSETS, quiet: bool = QUIET,
) -> None:
    """Each method at the same budget, masked vs physically enforced, side by side."""
    from rich.console import Console

    from evictlab.cliutil import parse_list
    from evictlab.io import check_output_file
    from evictlab.kv.budget import Budget
    from evictlab.methods import parse_assignments
    from evictlab.record import RunRecord

    with _as_options(AUDIT_OPTIONS):
        # Everything the user typed, checked before the model loads.
        query_aware = _query_aware(protocol)
        out = check_output_file(out, "--out", overwrite=overwrite)
        tracer = _trace_for(ctx, trace, out, trace_max_subsets, overwrite)
        _check_positive(n=n, context=context)
        if threads < 0:
            raise InputError("--threads", f"must be >= 0, got {threads}", "pass 0 (torch default) or a thread count")
        budgets = [Budget.parse(b) for b in parse_list(budget, "--budget", "budget")]
        method_list = parse_list(methods, "--methods", "method")
        tasks = parse_list(task, "--task", "task")
        _check_tasks(tasks)
        sp = parse_assignments(scorer_param, "--scorer-param")
        ap = parse_assignments(allocator_param, "--allocator-param")
        from evictlab.decode.audit import audit_configs, run_audit, task_examples

        loop = _loop_settings(sinks, recent, chunk, compress_every, window, block_size)
        configs = audit_configs(method_list, budgets, loop=loop, query_aware=query_aware, scorer_params=sp,
                                allocator_params=ap)  # every method built once, here
        record = RunRecord(kind="decode.audit", model=model, seed=seed, config={
            "budgets": budget, "methods": method_list, "tasks": tasks, "n": n, "context": context,
            "device": device, "scorer_param": sp, "allocator_param": ap, **asdict(loop), "query_aware": query_aware})

        import torch

        from evictlab.kv.cache import register_ragged_attention
        from evictlab.models.loading import load_model

        if threads > 0:
            torch.set_num_threads(threads)
        return_freed_memory()
        console = Console(stderr=True)
        lm, tok = load_model(model, device=device, attn_implementation=register_ragged_attention())
        examples = task_examples(tok, tasks, n, context, seed)
        total = 1 + len(method_list) * len(budgets) * 2
        done = [0]

        def progress(msg: str) -> None:
            done[0] += 1
            if not quiet:
                console.print(f"[{done[0]}/{total}] {msg}")

        df = run_audit(lm, examples, configs, loop=loop, tokenizer=tok, progress=progress,
                       compression_trace=tracer)
    if tracer is not None:
        tracer.write(trace)
    _write_audit(df, out, model, record, trace)
    outputs_written(out)
    console.print(df.select("method", "mode", "budget_per_cell", "bytes_live", "bytes_allocated",
                            "bytes_full_cache", "kl", "exact_match"))
    typer.echo(str(out))


def _write_audit(df: Any, out: Path, model: str, record: Any, trace: Path | None = None) -> None:
    """Figure and report first, then the table, then the run record: each file is atomic,
    and the record (written last) marks a finished audit."""
    from evictlab.io import atomic_write_text, write_checked_parquet
    from evictlab.plots.audit import audit_bars
    from evictlab.decode.audit_report import audit_markdown
    from evictlab.record import record_path

    stem = out.with_suffix("")
    fig = audit_bars(df, stem)
    md = audit_markdown(df, model=model, config=record.config, figure=fig.png.name)
    atomic_write_text(stem.with_suffix(".md"), md)
    write_checked_parquet(df, out)
    record.write(record_path(out),
                 outputs=[str(out), str(fig.png), str(fig.pdf), str(stem.with_suffix(".md"))]
                 + ([] if trace is None else [str(trace)]))


def decode(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", help="registry name, local HF folder or hub id"),
    method: str = typer.Option("snapkv", help="scorer or scorer+allocator, each part optionally with its own "
                               "parameters: snapkv[window=64,pooling=max]+adakv[alpha=0.3] (they override "
                               "--scorer-param/--allocator-param)"),
    scorer_param: list[str] = _SCORER_PARAM, allocator_param: list[str] = _ALLOCATOR_PARAM,
    task: str = typer.Option("needle", help="needle, multi_needle, multi_key or variable_tracking"),
    budget: str = typer.Option("64", help="kept budget: 64 (tokens per cell), 4096total or 2MiB"),
    mode: str = typer.Option("physical", "--store", help="how the cache is held: physical (a paged store that frees "
                             "what is evicted), masked (full tensors, evicted entries masked: the audit of others) or "
                             "full (no eviction) (formerly --mode)"),
    context: int = typer.Option(1024, help="context tokens"),
    max_new_tokens: int = typer.Option(16, help="greedy tokens to generate"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("decode.json"), help="result JSON; the run record goes beside it"),
    device: str = _DEVICE, sinks: int = _SINKS, recent: int = _RECENT, chunk: int = _CHUNK,
    compress_every: int = _COMPRESS_EVERY, window: int = _WINDOW, block_size: int = _BLOCK_SIZE,
    protocol: str = _PROTOCOL, threads: int = _THREADS, overwrite: bool = _OVERWRITE,
    trace: Optional[Path] = _TRACE, trace_max_subsets: int = _TRACE_MAX_SUBSETS, quiet: bool = QUIET,
) -> None:
    """Run one method on one task example (greedy), with a progress bar and a run record."""
    from evictlab.io import check_output_file
    from evictlab.kv.budget import Budget
    from evictlab.decode.config import DecodeConfig
    from evictlab.methods import build_method, parse_assignments
    from evictlab.record import RunRecord, record_path

    with _as_options(DECODE_OPTIONS):
        # Everything the user typed, checked before the model loads.
        query_aware = _query_aware(protocol)
        out = check_output_file(out, "--out", overwrite=overwrite)
        tracer = _trace_for(ctx, trace, out, trace_max_subsets, overwrite)
        if tracer is not None and mode == "full":
            raise InputError("--trace", "--store full compresses nothing, so there is nothing to trace",
                             "use --store physical or masked, or drop --trace")
        _check_positive(context=context, max_new_tokens=max_new_tokens)
        if threads < 0:
            raise InputError("--threads", f"must be >= 0, got {threads}", "pass 0 (torch default) or a thread count")
        _check_tasks([task])
        loop = _loop_settings(sinks, recent, chunk, compress_every, window, block_size)
        built = None if mode == "full" else build_method(
            method, parse_assignments(scorer_param, "--scorer-param"),
            parse_assignments(allocator_param, "--allocator-param"))  # built once, passed to the loop
        cfg = DecodeConfig(mode=mode, budget=None if mode == "full" else Budget.parse(budget), method=built,
                           loop=loop, query_aware=query_aware)
        if built is not None and built.future:
            raise InputError("--method", f"{built.scorer_name} needs the true future tokens, which greedy decoding "
                             "does not have", "use it in `evictlab audit` (teacher-forced), or pick another scorer")
        record = RunRecord(kind="decode.decode", model=model, seed=seed,
                           config={"task": task, "context": context, "max_new_tokens": max_new_tokens,
                                   "device": device, **cfg.to_dict()})

        import torch
        from tqdm import tqdm

        from evictlab.tasks.synthetic import make_task
        from evictlab.decode.loop import run_sequence
        from evictlab.tasks.examples import tokenize_task, decode_ids, score_exact_match, useful_spec
        from evictlab.kv.cache import register_ragged_attention
        from evictlab.models.loading import load_model

        if threads > 0:
            torch.set_num_threads(threads)
        return_freed_memory()
        lm, tok = load_model(model, device=device, attn_implementation=register_ragged_attention())
        prompt = tokenize_task(make_task(task, context, tok, seed), tok)
        facts = partial(useful_spec, prompt, tok)  # the example's labels (computed when asked for)
        cfg = cfg.with_labels(facts)  # oracle_labels
        dev = next(lm.parameters()).device
        ctx = torch.tensor([prompt.context_ids], device=dev)
        q = torch.tensor([prompt.question_ids], device=dev)
        if mode != "full":  # a budget below the always-kept floor, a profile of another model:
            from evictlab.models.geometry import model_geometry  # refused before the run starts

            geometry = model_geometry(lm)
            cfg.budget_tokens(geometry, ctx.shape[1] + q.shape[1] + max_new_tokens)
            built.for_model(geometry)  # the allocator checks the model (bound once; the loop reuses it)
        t0 = time.perf_counter()
        with tqdm(total=ctx.shape[1] + q.shape[1] + max_new_tokens, unit="tok", desc=f"{method} {mode}",
                  disable=quiet) as bar:
            if tracer is not None:
                tracer.label(facts=facts, method=method, mode=mode, budget=budget,
                             protocol="query-aware" if query_aware else "query-agnostic", task=task)
            res = run_sequence(lm, ctx, q, cfg, max_new_tokens=max_new_tokens, progress=bar.update, tokenizer=tok,
                               compression_trace=tracer)
    text = decode_ids(tok, res.tokens[0].tolist())
    final = res.trace[-1].report if res.trace else None
    result = {
        "method": method, "mode": mode, "task": task, "answer": prompt.answer, "prediction": text,
        "tokens": res.tokens[0].tolist(),
        "scorer_params": cfg.to_dict()["scorer_params"], "allocator_params": cfg.to_dict()["allocator_params"],
        "protocol": cfg.protocol, "chunk_size": chunk,
        "bytes_live_peak": res.peak("bytes_live"),
        "exact_match": score_exact_match(text, prompt.answer), "budget_tokens": res.budget_tokens,
        "budget_effective_tokens": res.budget_effective_tokens,
        "bytes_full_cache": res.bytes_full_cache,
        "bytes_live_after_compression": res.after_compression("bytes_live"),
        "bytes_allocated_peak": res.peak("bytes_allocated"),
        "bytes_final": None if final is None else final.__dict__,
        "compressions": res.compressions, "peak_rss": res.peak_rss,
        "tokens_per_s": (ctx.shape[1] + q.shape[1] + max_new_tokens) / (time.perf_counter() - t0),
    }
    from evictlab.io import atomic_write_json

    if tracer is not None:
        tracer.write(trace)
        result["trace"] = str(trace)
    atomic_write_json(out, result)
    record.write(record_path(out), outputs=[str(out)] + ([] if trace is None else [str(trace)]))
    outputs_written(out)
    if res.budget_tokens is not None and res.budget_effective_tokens is not None \
            and res.budget_effective_tokens < res.budget_tokens:
        typer.echo(f"note: the budget ({res.budget_tokens} kept entries) is above the full cache "
                   f"({res.budget_effective_tokens} entries): nothing was evicted", err=True)
    typer.echo(f"{method} [{mode}] answer={prompt.answer!r} prediction={text.strip()!r} "
               f"exact_match={result['exact_match']}")
