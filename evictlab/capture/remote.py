"""Capture on a remote executor (``--executor ray``, ``docs/cluster.md``).

The local run (:mod:`evictlab.capture.runner`) does everything in one process. A remote
executor first runs :func:`capture_probe` on a worker (model geometry for the
manifest, every prompt's forward length and token digest), then one :func:`capture_group`
task per forward group (the local run's groups, :func:`plan_groups`); each task returns its
prompts' :class:`PromptRows` and this process writes them with :func:`write_rows` in
prompt order, so the dataset is the local run's bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from evictlab.capture.config import CaptureConfig, auto_batch, parse_layers
from evictlab.capture.forward import PromptRows, forward_len, capture_prompts, plan_groups, write_rows
from evictlab.capture.provenance import check_size, source_info, text_provenance
from evictlab.errors import InputError
from evictlab.tasks.sources import PromptTokens, build_capture_prompt


@dataclass(frozen=True)
class CapturePlan:
    """What the probe task learns on a worker before any capture task runs: the manifest's
    ``source`` entry, the head dim, every prompt's forward length and token digest, and the
    digest of the weights (:func:`~evictlab.models.loading.weights_digest`)."""

    source: dict[str, Any]
    head_dim: int
    lengths: tuple[int, ...]
    token_digests: tuple[str, ...]
    weights: str


@dataclass(frozen=True)
class CaptureTask:
    """One remote task: prompts ``prompt_ids`` (one forward) under ``cfg``; the worker checks
    that its weights and prompts are the probe's (``weights``, ``token_digests``)."""

    cfg: CaptureConfig
    prompt_ids: tuple[int, ...]
    weights: str
    token_digests: tuple[str, ...]


def _token_digest(prompt: PromptTokens) -> str:
    import hashlib

    return hashlib.sha256(np.asarray(prompt.tokens, dtype=np.int64).tobytes()
                          + str(prompt.n_context).encode()).hexdigest()[:16]


def _worker_model(cfg: CaptureConfig) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, device)`` on this worker (loaded once per process), torch threads
    = the task's CPUs."""
    import torch

    from evictlab.models.loading import check_device, load_cached

    device = check_device(cfg.device)
    torch.set_num_threads(cfg.threads or 1)
    model, tok = load_cached(cfg.model, cfg.device)
    return model, tok, device


def capture_probe(cfg: CaptureConfig) -> CapturePlan:
    """The first remote task of a capture: load the model, check the settings the local run
    checks (layers, head dims, the first prompt) and plan the prompts (:class:`CapturePlan`)."""
    from evictlab.models.loading import weights_digest

    model, tok, _ = _worker_model(cfg)
    source, head_dim, n_layers = source_info(cfg, model, text_provenance(cfg))
    parse_layers(cfg.layers, n_layers)
    prompts = [build_capture_prompt(cfg.source, cfg.context, tok, cfg.seed, i) for i in range(cfg.prompts)]
    return CapturePlan(source, head_dim, tuple(forward_len(p, cfg.mode) for p in prompts),
                       tuple(_token_digest(p) for p in prompts), weights_digest(model))


def capture_group(task: CaptureTask) -> list[PromptRows]:
    """One remote capture task: the forward over ``task.prompt_ids`` and its verified rows.

    Refuses (InputError) when this worker's weights or prompts differ from the probe's: a
    node with another copy of the model or of the source text would mix two datasets.
    """
    import socket

    from evictlab.models.loading import weights_digest

    cfg = task.cfg
    model, tok, device = _worker_model(cfg)
    got = weights_digest(model)
    if got != task.weights:
        raise InputError("--model", f"node {socket.gethostname()} loaded other weights for {cfg.model} (digest "
                         f"{got}, the first task's {task.weights}): rows of two models would be mixed",
                         "give every node the same model files (a shared EVICTLAB_CACHE, or the same "
                         "`evictlab models pull` on each)")
    ids = list(task.prompt_ids)
    prompts = [build_capture_prompt(cfg.source, cfg.context, tok, cfg.seed, i) for i in ids]
    for i, p, want in zip(ids, prompts, task.token_digests):
        if _token_digest(p) != want:
            raise InputError("--source", f"node {socket.gethostname()} builds prompt {i} with other tokens than the "
                             "first task (another source text or tokenizer): rows of two datasets would be mixed",
                             "give every node the same source files and model (shared storage)")
    _, _, n_layers = source_info(cfg, model, {})
    return capture_prompts(model, prompts, ids, cfg, parse_layers(cfg.layers, n_layers), device)


def _device_type(device: str) -> str:
    """``cpu`` or ``cuda`` from ``--device`` (checked on the workers, which own the GPUs)."""
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise InputError("--device", f"device type {kind!r} is not supported", "use cpu or cuda")
    return kind


def capture_remote(cfg: CaptureConfig, out: Path, text: dict[str, str], executor: Any, progress: bool,
                    model_label: str | None, max_gib: float | None = None) -> tuple[int, int, int, float]:
    """A remote executor: a probe task, then one task per forward group; rows are written
    here, in prompt order. ``max_gib``: the size guard (:func:`~evictlab.capture.provenance.check_size`),
    checked on the probe's geometry before anything is written."""
    from evictlab.executor import TaskSpec, task_bar
    from evictlab.rows.writer import RowWriter

    kind = _device_type(cfg.device)
    spec = TaskSpec(cpus=cfg.threads or 1, gpus=1 if kind == "cuda" else 0)
    ((_, plan),) = list(executor.map(capture_probe, [cfg], spec=spec))
    if plan.source.get("text_sha256") != text.get("text_sha256"):
        raise InputError("--source", f"the worker read another text for {cfg.source} than this machine",
                         "give every node the same source files (shared storage)")
    check_size(cfg, plan.source, plan.head_dim, max_gib)
    written = rows_written = 0
    worst = 0.0
    with RowWriter(out, model=model_label or cfg.model, capture_mode=cfg.mode, head_dim=plan.head_dim,
                   source=plan.source, rows_per_shard=cfg.rows_per_shard,
                   expected={"prompts": cfg.prompts}) as writer:
        done = writer.completed_prompts
        todo = [i for i in range(cfg.prompts) if i not in done]
        skipped = cfg.prompts - len(todo)
        groups = plan_groups(todo, lambda i: plan.lengths[i], auto_batch(cfg, kind))
        tasks = [CaptureTask(cfg, tuple(g), plan.weights, tuple(plan.token_digests[i] for i in g)) for g in groups]
        bar = task_bar(f"capture {cfg.model}", disable=not progress)
        # closing(): an error or Ctrl-C here cancels the tasks still out at once
        with contextlib.closing(executor.map(capture_group, tasks, spec=spec, ordered=True, on_progress=bar)) as it:
            try:
                for _, rows_list in it:
                    for rows in rows_list:
                        worst = max(worst, rows.verify_error)
                        rows_written += write_rows(writer, rows)
                        written += 1
            finally:
                bar.close()
    return written, skipped, rows_written, worst
