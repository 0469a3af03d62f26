"""CLI commands ``evictlab audit`` and ``evictlab decode`` (thin: they call the library).

torch / transformers are imported inside the functions so ``evictlab --help`` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from evictlab.errors import InputError

_DEFAULT_METHODS = "streaming_llm,h2o,snapkv,snapkv+adakv,snapkv+pyramidkv"


def _base_config(sinks: int, recent: int, chunk: int, compress_every: int, window: int, block_size: int,
                 query_aware: bool):  # noqa: ANN202 - returns DecodeConfig (lazy import)
    from evictlab.decode.loop import DecodeConfig

    for name, v in (("--chunk", chunk), ("--compress-every", compress_every), ("--window", window),
                    ("--block-size", block_size)):
        if v <= 0:
            raise InputError(name, f"must be positive, got {v}", "pass a positive integer")
    return DecodeConfig(sinks=sinks, recent=recent, chunk_size=chunk, compress_every=compress_every,
                        window=window, block_size=block_size, query_aware=query_aware)


def audit(
    model: str = typer.Option("smollm2-135m", help="registry name, local HF folder or hub id"),
    budget: list[str] = typer.Option(["64"], help="kept budget; repeat for several: 64 (tokens per cell), 4096total, 2MiB"),
    methods: str = typer.Option(_DEFAULT_METHODS, help="comma-separated scorer or scorer+allocator"),
    task: str = typer.Option("needle", help="comma-separated tasks: needle, multi_needle, multi_key, variable_tracking"),
    n: int = typer.Option(2, help="examples per task"),
    context: int = typer.Option(1024, help="context tokens per example"),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("audit.parquet"), help="Parquet table; .png/.pdf/.md/.run.json written beside it"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    sinks: int = typer.Option(4), recent: int = typer.Option(16),
    chunk: int = typer.Option(256, help="prefill chunk (tokens) between compressions"),
    compress_every: int = typer.Option(16, help="decode steps between compressions"),
    window: int = typer.Option(32, help="observation window (queries) for scorers"),
    block_size: int = typer.Option(16, help="page size of the physical store (entries)"),
    query_aware: bool = typer.Option(False, "--query-aware", help="LABELLED OPTION: let rankings see the question"),
    threads: int = typer.Option(0, help="torch CPU threads (0 = torch default)"),
) -> None:
    """Each method at the same budget, masked vs physically enforced, side by side."""
    import torch
    from rich.console import Console

    from evictlab.decode.audit import run_audit, task_examples
    from evictlab.models.loading import load_model
    from evictlab.plots.audit import audit_bars
    from evictlab.report.audit import audit_markdown
    from evictlab.io import atomic_path, atomic_write_text
    from evictlab.kv.budget import Budget
    from evictlab.report.record import RunRecord

    if threads > 0:
        torch.set_num_threads(threads)
    budgets = [Budget.parse(b) for b in budget]
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    tasks = [t.strip() for t in task.split(",") if t.strip()]
    base = _base_config(sinks, recent, chunk, compress_every, window, block_size, query_aware)
    record = RunRecord(kind="decode.audit", model=model, seed=seed, config={
        "budgets": budget, "methods": method_list, "tasks": tasks, "n": n, "context": context,
        "device": device, **base.to_dict()})
    console = Console(stderr=True)
    lm, tok = load_model(model, device=device)
    examples = task_examples(tok, tasks, n, context, seed)
    total = 1 + len(method_list) * len(budgets) * 2
    done = [0]

    def progress(msg: str) -> None:
        done[0] += 1
        console.print(f"[{done[0]}/{total}] {msg}")

    df = run_audit(lm, examples, method_list, budgets, base=base, tokenizer=tok, progress=progress)
    with atomic_path(out, suffix=".parquet") as tmp:
        df.write_parquet(tmp)
    stem = out.with_suffix("")
    fig = audit_bars(df, stem)
    md = audit_markdown(df, model=model, config=record.config, figure=fig.png.name)
    atomic_write_text(stem.with_suffix(".md"), md)
    record.write(stem.with_suffix(".run.json"), outputs=[str(out), str(fig.png), str(fig.pdf), str(stem.with_suffix(".md"))])
    console.print(df.select("method", "mode", "budget_per_cell", "bytes_live", "bytes_allocated",
                            "bytes_full_cache", "kl", "exact_match"))
    typer.echo(str(out))


def decode(
    model: str = typer.Option("smollm2-135m", help="registry name, local HF folder or hub id"),
    method: str = typer.Option("snapkv", help="scorer or scorer+allocator"),
    task: str = typer.Option("needle", help="needle, multi_needle, multi_key or variable_tracking"),
    budget: str = typer.Option("64", help="kept budget: 64 (tokens per cell), 4096total or 2MiB"),
    mode: str = typer.Option("physical", help="physical, masked (audit of others) or full"),
    context: int = typer.Option(1024, help="context tokens"),
    max_new_tokens: int = typer.Option(16),
    seed: int = typer.Option(0),
    out: Path = typer.Option(Path("decode.json"), help="result JSON; the run record goes beside it"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    sinks: int = typer.Option(4), recent: int = typer.Option(16),
    chunk: int = typer.Option(256), compress_every: int = typer.Option(16), window: int = typer.Option(32),
    block_size: int = typer.Option(16),
    query_aware: bool = typer.Option(False, "--query-aware", help="LABELLED OPTION: let rankings see the question"),
    threads: int = typer.Option(0, help="torch CPU threads (0 = torch default)"),
) -> None:
    """Run one method on one task example (greedy), with a progress bar and a run record."""
    from dataclasses import replace

    import torch
    from tqdm import tqdm

    from evictlab.methods import parse_method
    from evictlab.models.loading import load_model
    from evictlab.decode.loop import run_sequence
    from evictlab.decode.tasks import build_prompt, decode_ids, score_exact_match
    from evictlab.capture.prompts import make_task
    from evictlab.io import atomic_write_json
    from evictlab.kv.budget import Budget
    from evictlab.report.record import RunRecord

    if mode not in ("physical", "masked", "full"):
        raise InputError("--mode", f"unknown mode {mode!r}", "use physical, masked or full")
    if threads > 0:
        torch.set_num_threads(threads)
    scorer, alloc = parse_method(method)
    cfg = replace(_base_config(sinks, recent, chunk, compress_every, window, block_size, query_aware),
                  mode=mode, scorer=scorer, allocator=alloc, budget=None if mode == "full" else Budget.parse(budget))
    record = RunRecord(kind="decode.decode", model=model, seed=seed,
                       config={"task": task, "context": context, "max_new_tokens": max_new_tokens,
                               "device": device, **cfg.to_dict()})
    lm, tok = load_model(model, device=device)
    prompt = build_prompt(make_task(task, context, tok, seed), tok,
                          "query-aware" if query_aware else "query-agnostic")
    dev = next(lm.parameters()).device
    ctx = torch.tensor([prompt.context_ids], device=dev)
    q = torch.tensor([prompt.question_ids], device=dev)
    t0 = time.perf_counter()
    with tqdm(total=ctx.shape[1] + q.shape[1] + max_new_tokens, unit="tok", desc=f"{method} {mode}") as bar:
        res = run_sequence(lm, ctx, q, cfg, max_new_tokens=max_new_tokens, progress=bar.update, tokenizer=tok)
    text = decode_ids(tok, res.tokens[0].tolist())
    final = res.trace[-1].report if res.trace else None
    result = {
        "method": method, "mode": mode, "task": task, "answer": prompt.answer, "prediction": text,
        "exact_match": score_exact_match(text, prompt.answer), "budget_tokens": res.budget_tokens,
        "bytes_full_cache": res.bytes_full_cache,
        "bytes_live_after_compression": res.after_compression("bytes_live"),
        "bytes_allocated_peak": res.peak("bytes_allocated"),
        "bytes_final": None if final is None else final.__dict__,
        "compressions": res.compressions, "peak_rss": res.peak_rss,
        "tokens_per_s": (ctx.shape[1] + q.shape[1] + max_new_tokens) / (time.perf_counter() - t0),
    }
    atomic_write_json(out, result)
    record.write(out.with_suffix(".run.json"), outputs=[str(out)])
    typer.echo(f"{method} [{mode}] answer={prompt.answer!r} prediction={text.strip()!r} "
               f"exact_match={result['exact_match']}")
