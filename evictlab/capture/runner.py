"""The capture run: prompts -> model forward under hooks -> verified rows in a RowWriter.

One prompt at a time: build its tokens (:func:`evictlab.tasks.sources.build_capture_prompt`),
choose its query positions (:func:`~evictlab.capture.forward.query_positions`), run one forward pass with
:class:`~evictlab.capture.hooks.AttentionCapture`, check every captured row against the
attention module's own per-head output (:func:`~evictlab.capture.hooks.verify_layer`),
then write one block per (layer, KV head) and one query row per (layer, query head,
position) into :class:`evictlab.rows.writer.RowWriter`, and end the prompt.

Blocks hold only the keys the layer's rows see: on full-attention layers keys
``[0, max position]``; on sliding-window layers (Gemma 3) keys
``[min position - W + 1, max position]``. Block key positions are absolute token positions.

Labels: task prompts carry the token spans of their inserted facts
(:attr:`~evictlab.tasks.sources.PromptTokens.facts`), written into the dataset's
``facts`` column (schema version 2); text prompts have none.

Resuming: the writer commits whole prompts; a rerun with the same settings skips the
prompts listed in ``completed_prompts`` (prompt id = prompt index), so an interrupted run
continues where it stopped without duplicating rows. Raising ``--prompts`` on a finished
dataset appends more prompts. Any other setting that differs is refused: rows of one
dataset must come from one configuration (:mod:`evictlab.capture.provenance`). A run record
(``run_record.json``) is written at the end of every run.

Modules: settings in :mod:`evictlab.capture.config`, the forward and its rows in
:mod:`evictlab.capture.forward`, remote executors in :mod:`evictlab.capture.remote`; this
module is the run itself and the local executor.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from evictlab.capture.config import CaptureConfig, auto_batch, parse_layers
from evictlab.capture.forward import forward_len, capture_prompts, write_rows
from evictlab.capture.provenance import check_resume, check_size, source_info, text_provenance
from evictlab.capture.remote import capture_remote
from evictlab.errors import InputError
from evictlab.tasks.sources import PromptTokens, build_capture_prompt


@dataclass
class CaptureSummary:
    """What a capture run did."""

    out: str
    rows_total: int
    rows_written: int
    prompts_written: int
    prompts_skipped: int
    seconds: float
    rows_per_second: float
    max_verify_error: float


def run_capture(cfg: CaptureConfig, out: str | Path, *, model: Any = None, tokenizer: Any = None,
                progress: bool = True, model_label: str | None = None, executor: Any = None,
                max_gib: float | None = None) -> CaptureSummary:
    """Capture ``cfg.prompts`` prompts into the row dataset at ``out`` (resuming if present).

    ``model``/``tokenizer`` may be passed pre-loaded (tests, notebooks); otherwise
    ``cfg.model`` is loaded with :func:`evictlab.models.loading.load_model`. ``executor``
    (:mod:`evictlab.executor`): None or local runs the forwards here; a Ray executor runs one
    task per forward group (:func:`capture_group`, one prompt on CPU), each loading the
    model on its worker, and this process writes the rows in prompt order, so the dataset
    holds the same rows in the same shards as a local run. ``max_gib``: refuse (before
    anything is written, once the model's geometry is known) a dataset estimated above this
    many GiB (:func:`~evictlab.capture.provenance.capture_bytes`; default :data:`evictlab.io.DEFAULT_MAX_GIB`).
    """
    from evictlab.io import check_output_path
    from evictlab.record import RunRecord
    from evictlab.rows.schema import RECORD_FILE

    cfg.check()
    if max_gib is not None and not max_gib > 0:
        raise InputError("--max-gib", f"must be > 0, got {max_gib}", "pass e.g. --max-gib 4")
    out = check_output_path(out, "--out", directory=True)  # before the model is loaded
    text = text_provenance(cfg)
    check_resume(out, cfg, text)
    if cfg.threads < 0:
        raise InputError("--threads", f"must be >= 0, got {cfg.threads}", "pass 0 (torch default) or a thread count")
    remote = executor is not None and executor.name != "local"
    record = RunRecord(kind="capture", config={**asdict(cfg), "executor": "ray" if remote else "local"},
                       model=model_label or cfg.model, seed=cfg.seed)
    t0 = time.perf_counter()
    if remote:
        if model is not None:
            raise InputError("model", "a pre-loaded model cannot be sent to remote workers",
                             "pass the model by name (cfg.model), or use the local executor")
        written, skipped, rows_written, worst = capture_remote(cfg, out, text, executor, progress, model_label,
                                                               max_gib)
    else:
        written, skipped, rows_written, worst = _capture_local(cfg, out, text, model, tokenizer, progress,
                                                               model_label, max_gib)
    seconds = time.perf_counter() - t0
    from evictlab.rows.reader import RowStore

    total = RowStore.open(out).n_rows
    summary = CaptureSummary(out=str(out), rows_total=total, rows_written=rows_written,
                             prompts_written=written, prompts_skipped=skipped, seconds=round(seconds, 3),
                             rows_per_second=round(rows_written / seconds, 1) if seconds > 0 else 0.0,
                             max_verify_error=worst)
    record.write(out / RECORD_FILE, output=str(out), summary=asdict(summary))
    return summary


def _capture_local(cfg: CaptureConfig, out: Path, text: dict[str, str], model: Any, tokenizer: Any,
                   progress: bool, model_label: str | None, max_gib: float | None = None) -> tuple[int, int, int, float]:
    """The local executor: forwards here, prompt group after prompt group."""
    from tqdm.auto import tqdm

    from evictlab.models.loading import check_device, load_model
    from evictlab.rows.writer import RowWriter

    device = check_device(cfg.device)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    if model is None:
        model, tokenizer = load_model(cfg.model, device=cfg.device)
    else:
        model.to(device)
    source, head_dim, n_layers = source_info(cfg, model, text)
    layers = parse_layers(cfg.layers, n_layers)
    check_size(cfg, source, head_dim, max_gib)
    # a prompt the settings cannot build (e.g. a text shorter than --context) is refused
    # before the dataset folder exists
    built = {0: build_capture_prompt(cfg.source, cfg.context, tokenizer, cfg.seed, 0)}

    def prompt(i: int) -> PromptTokens:
        if i not in built:
            built[i] = build_capture_prompt(cfg.source, cfg.context, tokenizer, cfg.seed, i)
        return built[i]

    written = rows_written = 0
    worst = 0.0
    t0 = time.perf_counter()
    # The dataset is marked complete only when this block ends normally, after the last
    # prompt; an exception or a kill leaves it incomplete (readers refuse it until resumed).
    with RowWriter(out, model=model_label or cfg.model, capture_mode=cfg.mode, head_dim=head_dim,
                   source=source, rows_per_shard=cfg.rows_per_shard,
                   expected={"prompts": cfg.prompts}) as writer:
        done = writer.completed_prompts
        todo = [i for i in range(cfg.prompts) if i not in done]
        skipped = cfg.prompts - len(todo)
        if 0 in done:
            built.clear()
        per = auto_batch(cfg, device.type)
        bar = tqdm(total=cfg.prompts, initial=skipped, desc=f"capture {cfg.model}", unit="prompt",
                   disable=not progress)
        # groups are planned lazily, so each prompt is built once, just before its forward
        group: list[int] = []
        for pos, i in enumerate(todo):
            group.append(i)
            nxt = todo[pos + 1] if pos + 1 < len(todo) else None
            if (nxt is not None and len(group) < per
                    and forward_len(prompt(nxt), cfg.mode) == forward_len(prompt(group[0]), cfg.mode)):
                continue
            batch = [prompt(j) for j in group]
            for j in group:
                del built[j]
            for rows in capture_prompts(model, batch, group, cfg, layers, device):
                worst = max(worst, rows.verify_error)
                rows_written += write_rows(writer, rows)
                written += 1
            bar.update(len(group))
            bar.set_postfix(rows=rows_written, rows_s=f"{rows_written / max(time.perf_counter() - t0, 1e-9):.0f}")
            group = []
        bar.close()
    return written, skipped, rows_written, worst
