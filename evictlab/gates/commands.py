"""CLI: ``evictlab gates train`` and ``evictlab gates info`` (thin: they call the library).

Everything the user typed is checked before the model loads (recipe, data, output folder,
device, threads). ``--out DIR`` rules: its parent folder must exist; a DIR holding finished
gates is refused without ``--overwrite``; a DIR holding a checkpoint is resumed (the same
command continues where a killed run stopped) unless ``--overwrite``; any other non-empty
DIR is refused; a second run on the same DIR is refused while the first holds its lock.
torch / transformers are imported inside the functions so ``evictlab --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from evictlab.cliutil import QUIET
from evictlab.errors import InputError

gates_app = typer.Typer(help="Learned retention gates (TRIM-KV / DBTrimKV): train them, inspect them.",
                        no_args_is_help=True)

#: What a gates folder may hold (ours): anything else makes DIR "not a gates folder".
_OURS = ("gates.safetensors", "gates.json", "checkpoint.pt", "losses.parquet", "run_record.json")


def _prepare_out(out: Path, overwrite: bool) -> Path:
    """Apply the ``--out`` rules (module docstring) before the model loads; returns the path."""
    from evictlab.gates import files
    from evictlab.io import check_output_path

    out = check_output_path(out, "--out", directory=True)
    if not out.exists():
        return out
    visible = [p.name for p in out.iterdir() if not p.name.startswith(".")]
    foreign = sorted(n for n in visible if n not in _OURS and not _is_teacher_file(n))
    if foreign:
        raise InputError("--out", f"{out} is not empty and not a gates folder (it holds {', '.join(foreign[:3])})",
                         "choose a new folder for --out")
    if files.is_finished(out) and not overwrite:
        raise InputError("--out", f"{out} already holds finished gates",
                         "pass --overwrite to train them again, or choose another --out")
    return out


def _is_teacher_file(name: str) -> bool:
    """A cached teacher file (:mod:`evictlab.gates.teacher`) a run keeps in its ``--out``."""
    return name.startswith("teacher-") and name.endswith((".safetensors", ".json"))


def _clear(out: Path) -> None:
    """Remove our files from ``out`` (``--overwrite``), nothing else."""
    from evictlab.io import remove_temp_files

    teacher = tuple(p.name for p in out.iterdir() if _is_teacher_file(p.name))
    for name in (*_OURS, *teacher):
        (out / name).unlink(missing_ok=True)
    remove_temp_files(out, (*_OURS, *teacher))


@gates_app.command("train")
def train(
    model: str = typer.Option("smollm2-135m", "--model", help="registry name, local HF folder or hub id"),
    out: Path = typer.Option(..., "--out", help="folder for the gates (created; a checkpoint in it is resumed)"),
    steps: int = typer.Option(80, "--steps", help="optimizer steps"),
    local: bool = typer.Option(False, "--local", help="ablation: one final projection per layer (default: one "
                               "shared by all layers)"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (or cuda:N)"),
    threads: int = typer.Option(0, "--threads", help="CPU threads of the computation (torch) (0 = the library "
                                "default, all cores)"),
    batch: int = typer.Option(4, "--batch", help="sequences per step (drawn from the pool)"),
    pool: int = typer.Option(320, "--pool", help="training sequences; the teacher runs once on each (its "
                             "outputs are cached)"),
    val: int = typer.Option(8, "--val", help="validation sequences (0: none)"),
    val_every: int = typer.Option(20, "--val-every", help="steps between validations (also before the first "
                                  "step and at the end)"),
    topk: int = typer.Option(64, "--topk", help="teacher tokens kept per position for the KL (the rest is one "
                             "bucket)"),
    teacher_cache: Path = typer.Option(None, "--teacher-cache", help="folder that keeps the teacher's outputs for "
                                       "later runs on the same sequences (default: --out, deleted when finished)"),
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per training sequence"),
    lr: float = typer.Option(2e-2, "--lr", help="AdamW learning rate (after a linear warmup)"),
    warmup: int = typer.Option(5, "--warmup", help="warmup steps"),
    schedule: str = typer.Option("cosine", "--schedule", help="learning rate after the warmup: cosine (to "
                                 "--min-lr x --lr at --decay-steps) or constant"),
    decay_steps: int = typer.Option(0, "--decay-steps", help="the step where the cosine ends (0: --steps)"),
    min_lr: float = typer.Option(0.1, "--min-lr", help="the cosine's floor, a fraction of --lr"),
    capacity: int = typer.Option(64, "--capacity", help="M: entries per KV head of the training budget "
                                 "(M_global = layers x KV heads x M)"),
    capacity_weight: float = typer.Option(1.0, "--capacity-weight", help="(initial) weight of the capacity loss"),
    capacity_adapt: float = typer.Option(0.0, "--capacity-adapt", help="rate at which the capacity weight follows "
                                         "the retained mass to the budget (0: a fixed weight)"),
    budget_weight: float = typer.Option(10.0, "--budget-weight", help="weight kappa of the two-sided budget term "
                                        "kappa x (retained mass / budget - 1)^2 (0: none)"),
    intermediate: int = typer.Option(64, "--intermediate", help="width of the gate MLP"),
    bias_init: str = typer.Option("auto", "--bias-init", help="initial final bias: auto (the uniform retention "
                                  "that holds the budget at --seq-len) or a number (8: beta = 0.9997, keep all)"),
    text: str = typer.Option("shakespeare", "--source", help="text source: shakespeare (before the held-out split), "
                             "file:PATH or jsonl:PATH:FIELD"),
    text_fraction: float = typer.Option(0.5, "--text-fraction", help="share of text windows; the rest are "
                                        "synthetic tasks"),
    tasks: str = typer.Option("needle,multi_needle,multi_key,variable_tracking", "--tasks",
                              help="comma-separated synthetic tasks of the non-text sequences"),
    dtype: str = typer.Option("auto", "--dtype", help="dtype of the frozen model while training: auto (bfloat16 "
                              "on CUDA and on CPUs with bfloat16 matrix units, else float32), float32 or bfloat16"),
    seed: int = typer.Option(0, "--seed"),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", help="steps between checkpoints"),
    overwrite: bool = typer.Option(False, "--overwrite", help="start over in an --out that holds gates or a checkpoint"),
    quiet: bool = QUIET,
) -> None:
    """Train retention gates on a frozen model; resumable (rerun the same command after a kill)."""
    from evictlab.cliutil import parse_list
    from evictlab.gates.data import DataSpec
    from evictlab.gates.train import DTYPES, Recipe, resolve_dtype
    from evictlab.io import exclusive_lock
    from evictlab.models.loading import check_device
    from evictlab.record import RunRecord

    # Everything the user typed, checked before the model loads.
    if threads < 0:
        raise InputError("--threads", f"must be >= 0, got {threads}", "pass 0 (torch default) or a thread count")
    if dtype not in ("auto", *DTYPES):
        raise InputError("--dtype", f"unknown dtype {dtype!r}", f"use one of: auto, {', '.join(DTYPES)}")
    dev = check_device(device)
    if decay_steps < 0:
        raise InputError("--decay-steps", f"must be >= 0, got {decay_steps}", "pass 0 (= --steps) or a step count")
    bias: float | str = bias_init
    if bias_init != "auto":
        try:
            bias = float(bias_init)
        except ValueError:
            raise InputError("--bias-init", f"{bias_init!r} is not a number", "use auto or a number, e.g. 8") from None
    recipe = Recipe(steps=steps, batch=batch, lr=lr, warmup=warmup, capacity=capacity, capacity_weight=capacity_weight,
                    capacity_adapt=capacity_adapt, budget_weight=budget_weight, intermediate=intermediate, bias_init=bias, shared=not local,
                    seed=seed, checkpoint_every=checkpoint_every, dtype=resolve_dtype(dtype, dev),
                    schedule=schedule, decay_steps=decay_steps or None, min_lr=min_lr, pool=pool, val=val,
                    val_every=val_every, topk=topk,
                    data=DataSpec(seq_len=seq_len, text=text, text_fraction=text_fraction,
                                  tasks=tuple(parse_list(tasks, "--tasks", "task"))))
    out = _prepare_out(out, overwrite)
    if teacher_cache is not None:
        from evictlab.io import check_output_path

        teacher_cache = check_output_path(teacher_cache, "--teacher-cache", directory=True)
    if recipe.data.text_fraction > 0:
        from evictlab.tasks.texts import load_text_source

        load_text_source(recipe.data.text)  # a missing or unreadable source is refused now (--source)
    with exclusive_lock(out, "--out"):
        _prepare_out(out, overwrite)  # again under the lock: another run may have finished meanwhile
        record = RunRecord(kind="gates.train", model=model, seed=seed,
                           config={"device": device, "threads": threads, "recipe": recipe.to_dict()})
        _train_locked(model, out, recipe, device, threads, overwrite, record, quiet, teacher_cache)


def _train_locked(model_name: str, out: Path, recipe: Any, device: str, threads: int, overwrite: bool,
                  record: Any, quiet: bool = False, teacher_cache: Path | None = None) -> None:
    import torch
    from tqdm import tqdm

    from evictlab.gates import files
    from evictlab.gates.train import train_gates
    from evictlab.models.loading import load_model, weights_digest
    from evictlab.record import record_path

    if threads > 0:
        torch.set_num_threads(threads)
    # gates=default finds gates by the digest of the model as the registry loads it (float32),
    # so it is taken before a cast to the training dtype
    lm, tok = load_model(model_name, device=device)
    digest = weights_digest(lm)
    lm = lm.to(getattr(torch, recipe.dtype))
    if overwrite and out.exists():
        _clear(out)
    bar = tqdm(total=recipe.steps, unit="step", desc=f"gates {'shared' if recipe.shared else 'local'}", disable=quiet)

    def progress(log: Any, done: int, total: int) -> None:
        if bar.n == 0 and done > 1:
            bar.n = done - 1  # resumed: start the bar where the checkpoint left off
        bar.set_postfix(loss=f"{log.loss:.3f}", ce=f"{log.ce:.3f}", kl=f"{log.kl:.4f}", cap=f"{log.capacity:.3f}",
                        S_M=f"{log.retained_mean:.2f}", w=f"{log.capacity_weight:.3g}", refresh=False)
        bar.update(done - bar.n)

    try:
        res = train_gates(lm, tok, recipe, out, model_name=model_name, threads=threads, progress=progress,
                          note=lambda t: bar.write(f"note: {t}"), teacher_cache=teacher_cache,
                          weights_digest=digest)
    finally:
        bar.close()
    record.write(record_path(out, folder=True), outputs=[str(out / files.CONFIG_FILE), str(out / files.WEIGHTS_FILE),
                                                         str(out / files.LOSSES_FILE)],
                 resumed_from_step=res.resumed_from, wall_s_this_call=round(res.wall_s, 2),
                 cpu_s_this_call=round(res.cpu_s, 2))
    last = res.history[-1]
    typer.echo(f"{out}: {len(res.history)} steps, final loss {last.loss:.4f} (ce {last.ce:.4f}, kl {last.kl:.4f}, "
               f"capacity {last.capacity:.4f}, S/M {last.retained_mean:.2f})")
    val = files.read_config(out).get("validation") or []
    if val:
        v = val[-1]
        typer.echo(f"validation ({recipe.val} sequences): ce {v['ce']:.4f}, kl {v['kl']:.4f}, "
                   f"S/M {v['retained_mean']:.3f} (max {v['retained_max']:.3f})")


@gates_app.command("info")
def info(folder: Path = typer.Argument(..., help="a folder written by `evictlab gates train`")) -> None:
    """Print what a gates folder holds: model, geometry, recipe, training summary."""
    from evictlab.gates.files import load_gates

    gates, cfg = load_gates(folder, "FOLDER")
    spec = gates.spec
    tr = cfg.get("training", {})
    last = tr.get("last10_mean") or {}
    lines = [
        f"gates: {folder}",
        f"model: {cfg.get('model')}  geometry: {cfg.get('geometry')}",
        f"projection: {'shared by all layers' if spec.shared else 'one per layer (local ablation)'}; "
        f"MLP {spec.hidden_size} -> {spec.intermediate} -> {spec.kv_heads} per layer; "
        f"{sum(p.numel() for p in gates.parameters())} parameters",
        f"recipe: {cfg.get('recipe')}",
        f"M_global: {cfg.get('m_global')} entries",
        f"training: {tr.get('steps')} steps on {tr.get('device')} ({tr.get('threads')} threads), "
        f"{tr.get('wall_s_steps')} s wall / {tr.get('cpu_s_steps')} s CPU over the steps",
        "last 10 steps (mean): " + ", ".join(f"{k} {v:.4g}" for k, v in last.items()),
    ]
    val = cfg.get("validation") or []
    if val:
        v = val[-1]
        lines.append(f"validation at step {v['step']} ({cfg['recipe'].get('val')} sequences): ce {v['ce']:.4g}, "
                     f"kl {v['kl']:.4g}, retained/budget {v['retained_mean']:.3f} (max {v['retained_max']:.3f})")
    typer.echo("\n".join(lines))
