"""CLI: ``evictlab capture``.

A thin wrapper over :mod:`evictlab.capture.runner`; torch and transformers are imported
inside the function so ``evictlab --help`` is fast. (``evictlab models ...`` lives in
:mod:`evictlab.models.commands`.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from evictlab.cliutil import QUIET
from evictlab.executor.commands import EXECUTOR_OPTIONS
from evictlab.io import DEFAULT_MAX_GIB


def capture(
    model: str = typer.Option("smollm2-135m", "--model", help="Registry name, local HF folder or hub id."),
    source: str = typer.Option("shakespeare", "--source",
                               help="shakespeare (plays, before the held-out tail), file:PATH (a text file or a "
                                    "folder of them), jsonl:PATH:FIELD (one JSON object per line), or a task: "
                                    "needle, multi_needle, multi_key, variable_tracking. Text sources give one "
                                    "seeded window of --context tokens per prompt."),
    context: int = typer.Option(2048, "--context", help="Context length in tokens."),
    positions: int = typer.Option(32, "--positions", help="Query positions per prompt."),
    prompts: int = typer.Option(4, "--prompts", help="Number of prompts (a resumed run may raise it)."),
    mode: str = typer.Option("query-agnostic", "--protocol",
                             help="query-agnostic (positions in the context, no question shown) or "
                                  "query-aware (positions in the question; task sources only) (formerly --mode)."),
    layers: str = typer.Option("all", "--layers", help="'all' or a list like 0,5,10-12."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of prompts and positions."),
    rows_per_shard: int = typer.Option(16384, "--rows-per-shard", help="Rows per array shard (cut at prompt ends)."),
    threads: int = typer.Option(0, "--threads", help="CPU threads of the computation (torch) (0 = the library default, all cores; 1 is "
                                "often fastest on a busy shared machine)."),
    batch: int = typer.Option(0, "--batch", help="Prompts per forward pass (consecutive prompts of equal length, "
                              "e.g. text windows); 0 = auto: 8 on CUDA, 1 on CPU."),
    out: Path = typer.Option(..., "--out", help="Row dataset directory (created, or resumed if it exists)."),
    quiet: bool = QUIET,
    max_gib: float = typer.Option(DEFAULT_MAX_GIB, "--max-gib", help="Refuse a dataset that would take more disk than this "
                                  "(GiB, estimated once the model is loaded, before anything is written)."),
    executor: str = EXECUTOR_OPTIONS["executor"],
    address: Optional[str] = EXECUTOR_OPTIONS["address"],
) -> None:
    """Capture attention rows (post-RoPE q, K, V per layer and query head) from a real model.

    Every row is checked against the attention module's own output before it is written.
    Rerunning the same command after an interruption resumes it (completed prompts are kept,
    none is duplicated). With --executor ray each forward (one prompt on CPU, --batch prompts
    on CUDA) is one Ray task (--threads CPUs each, 1 if 0; one GPU with --device cuda) that
    loads the model on its worker; this process writes the dataset, the same as a local run.
    """
    from evictlab.errors import InputError
    from evictlab.executor import check_executor

    check_executor(executor, address)
    from evictlab.rows.schema import MANIFEST_FILE

    # Refused here, before torch is imported and the model loaded (seconds to minutes).
    if out.exists() and not out.is_dir():
        raise InputError("--out", f"{out} is a file, not a row dataset folder",
                         "pass a new folder, or the folder of a capture to resume")
    if out.is_dir() and not (out / MANIFEST_FILE).is_file() and any(out.iterdir()):
        raise InputError("--out", f"{out} is a non-empty folder that is not a row dataset",
                         "pass a new folder, or the folder of a capture to resume")
    from evictlab.capture.config import CaptureConfig
    from evictlab.capture.runner import run_capture

    cfg = CaptureConfig(model=model, source=source, context=context, positions=positions, prompts=prompts,
                        mode=mode, layers=layers, device=device, seed=seed, rows_per_shard=rows_per_shard,
                        threads=threads, batch=batch)
    from evictlab.executor.commands import executor_for

    with executor_for(executor, address) as ex:
        s = run_capture(cfg, out, progress=not quiet, executor=ex, max_gib=max_gib)
    typer.echo(f"{s.rows_written} rows from {s.prompts_written} prompts in {s.seconds:.1f} s "
               f"({s.rows_per_second:.0f} rows/s; {s.prompts_skipped} prompts already done); "
               f"dataset holds {s.rows_total} rows; max |mu - model| / max(1,|v|) = {s.max_verify_error:.1e}; {out}")
