"""Training retention gates on a frozen model: the recipe and the resumable loop.

One step (``batch`` sequences of ``seq_len`` tokens from :class:`~evictlab.gates.data.
TrainingData`):

0. the frozen model runs in the recipe's ``dtype`` (bfloat16 where matrix units make it
   several times faster; the gates, the bias and the losses are float32 whatever it is);
1. teacher: the frozen model, no gates, no grad: logits ``(b, T, V)``;
2. student: the same model inside :func:`~evictlab.gates.hooks.gated_attention` (every
   attention logit gets ``(t - i) log beta_i``): logits, and every layer's ``log beta``;
3. loss = ``(ce + kl) / 2 + capacity_weight x capacity`` (:mod:`evictlab.gates.loss`),
   with ``M_global = n_layers x kv_heads x capacity`` entries;
4. AdamW on the gate parameters only (the model's parameters have ``requires_grad=False``
   for the duration of the run and are restored after), gradient norm clipped, learning
   rate warmed up linearly over ``warmup`` steps then constant.

Every ``checkpoint_every`` steps (and at the end) the step, gate parameters, optimizer
state, RNG states and loss history are written atomically to ``DIR/checkpoint.pt``; a run
started on a folder with a checkpoint of the same fingerprint (model, gate spec, recipe,
data; ``--steps`` may differ, so a run can be extended or ended at its last checkpoint)
continues from it (another fingerprint is refused), and because every batch is a
function of the step and the seed, the resumed run computes exactly what the uninterrupted
one would: bit for bit on CPU with the same thread count (a resume on another device or
thread count continues with a note, since float reductions may then round differently). The finished folder is written by
:func:`evictlab.gates.files.save_gates` (``gates.json`` last) with ``losses.parquet``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from evictlab.errors import InputError
from evictlab.gates import files
from evictlab.gates.data import DataSpec, TrainingData
from evictlab.gates.hooks import gated_attention
from evictlab.gates.loss import capacity_loss, distillation_terms, retained_mass
from evictlab.gates.modules import GateSpec, RetentionGates

__all__ = ["DTYPES", "Recipe", "StepLog", "TrainResult", "resolve_dtype", "train_gates"]

DTYPES = ("float32", "bfloat16")


def resolve_dtype(name: str, device: torch.device) -> str:
    """``--dtype``: ``auto`` is ``bfloat16`` on CUDA (when supported) and on CPUs whose flags
    include ``amx_bf16`` or ``avx512_bf16`` (bfloat16 matrix units: several times faster
    than float32 there), else ``float32`` (bfloat16 is emulated, slower, elsewhere)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "float32"
    return "bfloat16" if {"amx_bf16", "avx512_bf16"} & set(flags) else "float32"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained gates (recorded in gates.json and the checkpoint).

    Defaults are the smollm2-135m CPU recipe measured in docs/gates.md (60 steps of one
    256-token sequence, bfloat16 model on a CPU with bfloat16 matrix units).
    """

    steps: int = 60
    batch: int = 1
    lr: float = 3e-2
    warmup: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    capacity: int = 64  #: M, entries per KV head; M_global = n_layers x kv_heads x M
    capacity_weight: float = 1.0
    intermediate: int = 64
    bias_init: float = 8.0
    shared: bool = True
    seed: int = 0
    checkpoint_every: int = 10
    #: dtype of the frozen model during training (the gates are always float32):
    #: ``bfloat16`` where matrix units make it fast (CUDA, CPUs with AMX/AVX512-BF16), else ``float32``
    dtype: str = "float32"
    data: DataSpec = field(default_factory=DataSpec)

    def __post_init__(self) -> None:
        positive = {"steps": "--steps", "batch": "--batch", "capacity": "--capacity",
                    "intermediate": "--intermediate", "checkpoint_every": "--checkpoint-every"}
        for name, option in positive.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InputError(option, f"must be a positive integer, got {v!r}", f"pass {option} 1 or more")
        if self.batch > 999:
            raise InputError("--batch", f"{self.batch} sequences per step", "use at most 999")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise InputError("--lr", f"must be positive, got {self.lr}", "use e.g. 3e-2")
        for name in ("warmup",):
            if getattr(self, name) < 0:
                raise InputError("--" + name, f"must be >= 0, got {getattr(self, name)}", "pass 0 or more")
        if self.capacity_weight < 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise InputError("--capacity-weight", "capacity_weight and weight_decay must be >= 0, grad_clip > 0",
                             "use the defaults")
        if self.seed < 0:
            raise InputError("--seed", f"must be >= 0, got {self.seed}", "pass 0 or more")
        if self.dtype not in DTYPES:
            raise InputError("--dtype", f"unknown dtype {self.dtype!r}", f"use one of: auto, {', '.join(DTYPES)}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["data"] = self.data.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        names = {f.name for f in fields(cls)}
        data = d.get("data", {})
        kw = {k: v for k, v in d.items() if k in names and k != "data"}
        return cls(**kw, data=DataSpec(seq_len=data["seq_len"], text=data["text"], text_fraction=data["text_fraction"],
                                       tasks=tuple(data["tasks"])))


@dataclass
class StepLog:
    """The loss terms of one step (nats; capacity dimensionless)."""

    step: int
    loss: float
    ce: float
    kl: float
    capacity: float
    #: max over the batch's real steps t of S_t / M_global (1 = exactly at budget)
    retained_ratio: float
    mean_log_beta: float
    lr: float
    wall_s: float
    cpu_s: float


@dataclass
class TrainResult:
    folder: Path
    history: list[StepLog]
    resumed_from: int
    wall_s: float
    cpu_s: float


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class _Frozen:
    """Sets ``requires_grad=False`` on a model's parameters and eval mode; restores both on exit."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.saved: list[tuple[torch.nn.Parameter, bool]] = []
        self.training = model.training

    def __enter__(self) -> None:
        self.saved = [(p, p.requires_grad) for p in self.model.parameters()]
        self.training = self.model.training
        for p, _ in self.saved:
            p.requires_grad_(False)
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        for p, flag in self.saved:
            p.requires_grad_(flag)
        self.model.train(self.training)


#: Recipe fields a resume may change: they do not change what any step computes (the
#: learning-rate schedule depends on the step only, never on the total), so a run resumed
#: with another ``steps`` equals an uninterrupted run of that many steps.
_RESUMABLE_CHANGES = ("steps", "checkpoint_every")


def fingerprint(model_name: str, spec: GateSpec, recipe: Recipe) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed (a changed value means another run).
    ``steps`` and ``checkpoint_every`` are left out: a resume may extend or end a run."""
    r = {k: v for k, v in recipe.to_dict().items() if k not in _RESUMABLE_CHANGES}
    return {"model": model_name, "spec": spec.to_dict(), "recipe": r}


def environment(device: torch.device, threads: int) -> dict[str, Any]:
    """Where a run computes: a resume elsewhere continues, but is not bit-identical."""
    return {"device": device.type, "threads": int(threads) or torch.get_num_threads()}


def _lr(recipe: Recipe, step: int) -> float:
    return recipe.lr * min(1.0, (step + 1) / recipe.warmup) if recipe.warmup else recipe.lr


def train_step(model: torch.nn.Module, gates: RetentionGates, ids: torch.Tensor, lengths: torch.Tensor,
               m_global: float, capacity_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward both passes and return ``(loss, terms)`` (``loss`` requires grad)."""
    with torch.no_grad():
        teacher = model(input_ids=ids, use_cache=False).logits
    with gated_attention(model, gates) as record:
        student = model(input_ids=ids, use_cache=False).logits
    lbs = [record[l] for l in range(gates.spec.n_layers)]
    ce, kl = distillation_terms(student, teacher, ids, lengths)
    cap = capacity_loss(lbs, m_global, lengths)
    loss = 0.5 * (ce + kl) + capacity_weight * cap
    with torch.no_grad():
        s = retained_mass(lbs)
        real = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        ratio = float(s[real].max()) / m_global
        mean_lb = float(torch.stack([lb.mean() for lb in lbs]).mean())
    return loss, {"ce": float(ce.detach()), "kl": float(kl.detach()), "capacity": float(cap.detach()),
                  "retained_ratio": ratio,
                  "mean_log_beta": mean_lb}


def train_gates(
    model: torch.nn.Module,
    tokenizer: Any,
    recipe: Recipe,
    out: str | os.PathLike[str],
    *,
    model_name: str,
    threads: int = 0,
    progress: Callable[[StepLog, int, int], None] | None = None,
    note: Callable[[str], None] | None = None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train gates for ``model`` into ``out`` (created if missing), resuming a checkpoint there.

    ``progress(log, step_done, total)`` is called after every step; ``note(text)`` with
    remarks (a resume, a resume on another device or thread count: it continues, but is not
    bit-identical to an uninterrupted run). ``stop_after``: return after that many steps of
    this call (with a checkpoint written), as an interrupted run would (tests use it). The
    caller holds the folder's write lock.
    """
    out = Path(out)
    device = next(model.parameters()).device
    have = str(next(model.parameters()).dtype).removeprefix("torch.")
    if have != recipe.dtype:
        raise InputError("--dtype", f"the recipe trains with a {recipe.dtype} model, this one is {have}",
                         f"load the model as {recipe.dtype} (load_model(..., dtype=torch.{recipe.dtype}))")
    out.mkdir(exist_ok=True)
    spec = GateSpec.for_model(model, intermediate=recipe.intermediate, shared=recipe.shared,
                              bias_init=recipe.bias_init)
    fp = fingerprint(model_name, spec, recipe)
    env = environment(device, threads)
    say = note or (lambda _t: None)
    gates = RetentionGates(spec, seed=recipe.seed).to(device)
    opt = torch.optim.AdamW(gates.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    history: list[StepLog] = []
    start = 0
    ckpt = files.load_checkpoint(out)
    if ckpt is not None:
        old = _comparable(ckpt.get("fingerprint"))
        if old != fp:
            raise InputError("--out", f"{out} holds a checkpoint of another run ({_diff(old, fp)})",
                             "rerun with the options of that run to resume it, choose another --out, or pass "
                             "--overwrite to start over")
        gates.load_state_dict(ckpt["gates"])
        opt.load_state_dict(ckpt["optimizer"])
        files.restore_rng(ckpt["rng"])
        history = [StepLog(**h) for h in ckpt["history"]]
        start = int(ckpt["step"])
        if start > recipe.steps:
            raise InputError("--steps", f"{out} holds a checkpoint at step {start}, past --steps {recipe.steps}",
                             f"pass --steps {start} or more to finish that run, or --overwrite to start over")
        say(f"resuming {out} at step {start} of {recipe.steps}")
        if ckpt.get("environment") != env:
            say(f"the checkpoint was written on {ckpt.get('environment')}, this run is on {env}: it continues, but is "
                "not bit-identical to an uninterrupted run")
    data = TrainingData(tokenizer, recipe.data, recipe.seed)
    m_global = float(spec.n_layers * spec.kv_heads * recipe.capacity)
    t0, c0 = time.perf_counter(), _cpu_seconds()
    done_here = 0
    gates.train()
    with _Frozen(model):
        for step in range(start, recipe.steps):
            ts, cs = time.perf_counter(), _cpu_seconds()
            lr = _lr(recipe, step)
            for group in opt.param_groups:
                group["lr"] = lr
            ids, lengths = data.batch(step, recipe.batch, device)
            loss, terms = train_step(model, gates, ids, lengths, m_global, recipe.capacity_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(gates.parameters(), recipe.grad_clip)
            opt.step()
            log = StepLog(step=step, loss=float(loss.detach()), lr=lr, wall_s=time.perf_counter() - ts,
                          cpu_s=_cpu_seconds() - cs, **terms)
            history.append(log)
            done_here += 1
            last = step + 1 == recipe.steps
            if (step + 1) % recipe.checkpoint_every == 0 or last or (stop_after is not None and done_here >= stop_after):
                files.save_checkpoint(out, {"step": step + 1, "gates": gates.state_dict(), "optimizer": opt.state_dict(),
                                            "rng": files.capture_rng(), "history": [asdict(h) for h in history],
                                            "fingerprint": fp, "environment": env})
            if progress is not None:
                progress(log, step + 1, recipe.steps)
            if stop_after is not None and done_here >= stop_after and not last:
                return TrainResult(out, history, start, time.perf_counter() - t0, _cpu_seconds() - c0)
    gates.eval()
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    _finish(out, gates, recipe, model, model_name, history, start, env, wall, cpu)
    return TrainResult(out, history, start, wall, cpu)


def _comparable(fp: Any) -> Any:
    """A stored fingerprint without the fields a resume may change (checkpoints written
    before those fields were left out of fingerprints still carry them)."""
    if isinstance(fp, dict) and isinstance(fp.get("recipe"), dict):
        return {**fp, "recipe": {k: v for k, v in fp["recipe"].items() if k not in _RESUMABLE_CHANGES}}
    return fp


def _diff(old: Any, new: dict[str, Any]) -> str:
    """The first fields in which two fingerprints differ, as ``name: old -> new``."""
    if not isinstance(old, dict):
        return "an unreadable fingerprint"
    out = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif a != b:
            out.append(f"{path}: {a!r} -> {b!r}")

    walk(old, new, "")
    return "; ".join(out[:3]) or "same values"


def _finish(out: Path, gates: RetentionGates, recipe: Recipe, model: torch.nn.Module, model_name: str,
            history: list[StepLog], resumed_from: int, env: dict[str, Any], wall: float, cpu: float) -> None:
    """Write losses.parquet, then the gates (gates.json last), then drop the checkpoint."""
    import polars as pl

    from evictlab.io import write_checked_parquet
    from evictlab.models.geometry import model_geometry

    g = model_geometry(model)
    write_checked_parquet(pl.DataFrame([asdict(h) for h in history]), out / files.LOSSES_FILE)
    tail = history[-min(10, len(history)):]
    meta = {
        "model": model_name,
        "geometry": files.geometry_meta(model),
        "recipe": recipe.to_dict(),
        "data": recipe.data.to_dict(),
        "seed": recipe.seed,
        "m_global": g.n_layers * g.kv_heads * recipe.capacity,
        "training": {
            "steps": len(history), "device": str(next(model.parameters()).device), "threads": env["threads"],
            "wall_s_this_call": round(wall, 2), "cpu_s_this_call": round(cpu, 2), "resumed_from_step": resumed_from,
            "wall_s_steps": round(sum(h.wall_s for h in history), 2),
            "cpu_s_steps": round(sum(h.cpu_s for h in history), 2),
            "first": asdict(history[0]) if history else None,
            "last10_mean": {k: sum(getattr(h, k) for h in tail) / len(tail)
                            for k in ("loss", "ce", "kl", "capacity", "retained_ratio", "mean_log_beta")} if tail else None,
        },
    }
    files.save_gates(out, gates, meta)
    (out / files.CHECKPOINT_FILE).unlink(missing_ok=True)
