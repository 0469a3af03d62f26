"""Training retention gates on a frozen model: the recipe and the resumable loop.

Before the first step: the run's fixed sequences (a training pool of ``pool`` sequences
and ``val`` validation sequences, :meth:`~evictlab.gates.data.TrainingData.pool`) and the
teacher's top-``topk`` outputs on them (:mod:`evictlab.gates.teacher`: computed once,
cached on disk and checked, reused by every step and by a resumed run).

One step (``batch`` pool sequences of ``seq_len`` tokens, :func:`~evictlab.gates.data.step_indices`):

0. the frozen model runs in the recipe's ``dtype`` (bfloat16 where matrix units make it
   several times faster; the gates, the bias and the losses are float32 whatever it is);
1. teacher: read from the cache (``(b, T-1, k)`` top-k log-probabilities and the rest);
2. student: the same model inside :func:`~evictlab.gates.hooks.gated_attention` (every
   attention logit gets ``(t - i) log beta_i``): logits, and every layer's ``log beta``;
3. loss = ``(ce + kl) / 2 + lambda_s x capacity + budget_weight x (r - 1)^2``
   (:mod:`evictlab.gates.loss`; the KL against the teacher's top-k,
   :func:`~evictlab.gates.loss.topk_distillation_terms`; ``capacity`` the hinge on the
   overshoot; ``r`` the batch's mean of ``max_t S_t / M_global``,
   :func:`~evictlab.gates.loss.budget_loss`, which pulls the mass to the budget from both
   sides), with ``M_global = n_layers x kv_heads x capacity`` entries;
4. AdamW on the gate parameters only (the model's parameters have ``requires_grad=False``
   for the duration of the run and are restored after), gradient norm clipped, learning
   rate warmed up linearly over ``warmup`` steps, then (``schedule="cosine"``) decayed on a
   cosine to ``min_lr x lr`` at step ``decay_steps`` (constant after);
5. optionally (``capacity_adapt > 0``; off in the recipe: on SmolLM2 it drove the mass to
   0.6 of the budget, docs/gates.md) the hinge's weight follows the retained mass:
   ``lambda_{s+1} = clip(lambda_s x exp(capacity_adapt x clip(r_s - 1, -0.25, 0.25)), 1e-3, 1e3)``
   with ``r_s`` the batch's ``r`` (``capacity_adapt = 0``: the fixed weight
   ``capacity_weight``, which is also ``lambda_0``).

Validation (the ``val`` sequences, no grad: the loss terms and the retained mass at the
weight's current value) runs before the first step, every ``val_every`` steps and at the
end; the rows are kept in the checkpoint and in ``gates.json``.

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
from evictlab.gates.data import MAX_POOL, DataSpec, TrainingData, step_indices
from evictlab.gates.hooks import gated_attention
from evictlab.gates.loss import (budget_loss, capacity_loss, distillation_terms, per_sequence_retained,
                                 retained_mass, topk_distillation_terms)
from evictlab.gates.modules import GateSpec, RetentionGates
from evictlab.gates.teacher import TeacherTargets, teacher_targets

__all__ = ["DTYPES", "SCHEDULES", "Recipe", "StepLog", "TrainResult", "budget_bias", "convergence", "resolve_dtype",
           "train_gates", "validate"]

DTYPES = ("float32", "bfloat16")
SCHEDULES = ("cosine", "constant")
#: Range of the adapted capacity weight lambda_s.
WEIGHT_RANGE = (1e-3, 1e3)
#: The retained mass's distance to the budget that moves lambda is clipped to +- this: far
#: above the budget lambda grows by at most exp(capacity_adapt x 0.25) per step, so it cannot
#: explode before the mass has come down (which, with Adam remembering the huge gradients,
#: would freeze the gates evicting nearly everything).
ADAPT_CLIP = 0.25


def budget_bias(seq_len: int, capacity: int) -> float:
    """The gate bias whose uniform retention ``beta = sigmoid(bias)`` makes a cell of a
    ``seq_len``-token sequence retain ``capacity`` entries at its last step:
    ``(1 - beta^T) / (1 - beta) = M`` (``bias_init="auto"``: training then starts at the
    budget, as a recency policy, instead of far above it). 8.0 (keep all) when ``M >= T``."""
    T, M = int(seq_len), float(capacity)
    if M >= T:
        return 8.0
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        if (1 - mid ** T) / (1 - mid) < M:
            lo = mid
        else:
            hi = mid
    beta = (lo + hi) / 2
    return round(math.log(beta / (1 - beta)), 6)


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

    Defaults are the smollm2-135m CPU recipe measured in docs/gates.md. ``bias_init``
    ``"auto"`` becomes :func:`budget_bias` of the sequence length and capacity, and
    ``decay_steps`` None becomes ``steps``, when the recipe is built (the numbers are what
    is recorded).
    """

    steps: int = 80
    batch: int = 4
    lr: float = 2e-2
    warmup: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    capacity: int = 64  #: M, entries per KV head; M_global = n_layers x kv_heads x M
    capacity_weight: float = 1.0
    #: rate of the capacity weight's adaptation (0: a fixed weight)
    capacity_adapt: float = 0.0
    #: weight kappa of the two-sided budget term kappa x (r - 1)^2 (0: none)
    budget_weight: float = 10.0
    intermediate: int = 64
    bias_init: float | str = "auto"
    shared: bool = True
    seed: int = 0
    checkpoint_every: int = 10
    schedule: str = "cosine"
    decay_steps: int | None = None
    min_lr: float = 0.1  #: the cosine's floor, a fraction of ``lr``
    pool: int = 320  #: training sequences (the teacher runs once on each)
    val: int = 8  #: validation sequences
    val_every: int = 20
    topk: int = 64  #: teacher tokens kept per position
    #: dtype of the frozen model during training (the gates are always float32):
    #: ``bfloat16`` where matrix units make it fast (CUDA, CPUs with AMX/AVX512-BF16), else ``float32``
    dtype: str = "float32"
    data: DataSpec = field(default_factory=DataSpec)

    def __post_init__(self) -> None:
        if self.bias_init == "auto":
            object.__setattr__(self, "bias_init", budget_bias(self.data.seq_len, self.capacity)
                               if isinstance(self.capacity, int) and self.capacity > 0 else 8.0)
        if not isinstance(self.bias_init, (int, float)) or isinstance(self.bias_init, bool):
            raise InputError("--bias-init", f"must be a number or auto, got {self.bias_init!r}", "use auto or e.g. 8")
        object.__setattr__(self, "bias_init", float(self.bias_init))
        if self.decay_steps is None:
            object.__setattr__(self, "decay_steps", self.steps)
        positive = {"steps": "--steps", "batch": "--batch", "capacity": "--capacity",
                    "intermediate": "--intermediate", "checkpoint_every": "--checkpoint-every",
                    "decay_steps": "--decay-steps", "pool": "--pool", "val_every": "--val-every", "topk": "--topk"}
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
        if self.pool > MAX_POOL or not (isinstance(self.val, int) and 0 <= self.val <= MAX_POOL):
            raise InputError("--pool" if self.pool > MAX_POOL else "--val", f"pool {self.pool}, validation {self.val}",
                             f"use at most {MAX_POOL} sequences each (validation may be 0)")
        if self.schedule not in SCHEDULES:
            raise InputError("--schedule", f"unknown schedule {self.schedule!r}", f"use one of: {', '.join(SCHEDULES)}")
        if not 0.0 <= self.min_lr <= 1.0:
            raise InputError("--min-lr", f"{self.min_lr} is not in [0, 1]", "use a fraction of --lr, e.g. 0.1")
        if not (self.budget_weight >= 0 and math.isfinite(self.budget_weight)):
            raise InputError("--budget-weight", f"must be >= 0, got {self.budget_weight}", "use e.g. 10 (0: none)")
        if not (self.capacity_adapt >= 0 and math.isfinite(self.capacity_adapt)):
            raise InputError("--capacity-adapt", f"must be >= 0, got {self.capacity_adapt}", "use e.g. 1 (0: fixed)")
        if self.capacity_adapt > 0 and not WEIGHT_RANGE[0] <= self.capacity_weight <= WEIGHT_RANGE[1]:
            raise InputError("--capacity-weight", f"{self.capacity_weight} is outside {WEIGHT_RANGE} (the adapted range)",
                             "use e.g. 1")
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
        kw.setdefault("bias_init", 8.0)  # recipes written before "auto" recorded the number
        kw.setdefault("budget_weight", 0.0)  # nor the budget term
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
    #: mean over the batch's sequences of max_t S_t / M_global
    retained_mean: float = float("nan")
    #: the capacity weight lambda_s this step used
    capacity_weight: float = float("nan")
    #: the two-sided budget term (retained_mean - 1)^2 (unweighted; 0 when the recipe has none)
    budget: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0


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
_RESUMABLE_CHANGES = ("steps", "checkpoint_every", "val_every")


def fingerprint(model_name: str, spec: GateSpec, recipe: Recipe) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed (a changed value means another run).
    ``steps`` and ``checkpoint_every`` are left out: a resume may extend or end a run."""
    r = {k: v for k, v in recipe.to_dict().items() if k not in _RESUMABLE_CHANGES}
    return {"model": model_name, "spec": spec.to_dict(), "recipe": r}


def environment(device: torch.device, threads: int) -> dict[str, Any]:
    """Where a run computes: a resume elsewhere continues, but is not bit-identical."""
    return {"device": device.type, "threads": int(threads) or torch.get_num_threads()}


def _lr(recipe: Recipe, step: int) -> float:
    """The learning rate of ``step``: a function of the step and the recipe (never of how
    many steps this call runs)."""
    warm = min(1.0, (step + 1) / recipe.warmup) if recipe.warmup else 1.0
    if recipe.schedule == "constant":
        return recipe.lr * warm
    horizon = max(1, int(recipe.decay_steps or recipe.steps) - recipe.warmup)
    progress = min(1.0, max(0.0, (step - recipe.warmup) / horizon))
    return recipe.lr * warm * (recipe.min_lr + (1 - recipe.min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))


def _next_weight(recipe: Recipe, weight: float, retained_mean: float) -> float:
    if recipe.capacity_adapt == 0 or not math.isfinite(retained_mean):
        return weight
    w = weight * math.exp(recipe.capacity_adapt * min(ADAPT_CLIP, max(-ADAPT_CLIP, retained_mean - 1.0)))
    return min(WEIGHT_RANGE[1], max(WEIGHT_RANGE[0], w))


def train_step(model: torch.nn.Module, gates: RetentionGates, ids: torch.Tensor, lengths: torch.Tensor,
               m_global: float, capacity_weight: float,
               teacher: TeacherTargets | None = None, budget_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward the student (and the teacher, unless its cached ``teacher`` targets for these
    ``ids`` are given: then the KL is the top-k one) and return ``(loss, terms)`` (``loss``
    requires grad when the gates do). ``ids (b, T)``, ``lengths (b,)``."""
    if teacher is None:
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits
    with gated_attention(model, gates) as record:
        student = model(input_ids=ids, use_cache=False).logits
    lbs = [record[l] for l in range(gates.spec.n_layers)]
    if teacher is None:
        ce, kl = distillation_terms(student, full, ids, lengths)
    else:
        ce, kl = topk_distillation_terms(student, ids, lengths, teacher.top_idx, teacher.top_logp, teacher.tail_logp)
    cap = capacity_loss(lbs, m_global, lengths)
    loss = 0.5 * (ce + kl) + capacity_weight * cap
    bud = budget_loss(lbs, m_global, lengths) if budget_weight else None
    if bud is not None:
        loss = loss + budget_weight * bud
    with torch.no_grad():
        s = retained_mass(lbs)
        real = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths[:, None]
        ratio = float(s[real].max()) / m_global
        per_seq = per_sequence_retained(lbs, m_global, lengths)
        mean_lb = float(torch.stack([lb.mean() for lb in lbs]).mean())
    return loss, {"ce": float(ce.detach()), "kl": float(kl.detach()), "capacity": float(cap.detach()),
                  "retained_ratio": ratio, "mean_log_beta": mean_lb, "retained_mean": float(per_seq.mean()),
                  "budget": float(bud.detach()) if bud is not None else 0.0}


@torch.no_grad()
def validate(model: torch.nn.Module, gates: RetentionGates, targets: TeacherTargets, m_global: float,
             capacity_weight: float = 1.0, chunk: int = 4, budget_weight: float = 0.0) -> dict[str, float]:
    """The loss terms on fixed sequences (their cached teacher ``targets``), no grad, ``chunk``
    sequences per forward; means over the sequences' predicted positions (ce, kl) and over
    the sequences (capacity, ``retained_mean``: each sequence's ``max_t S_t / M_global``;
    ``retained_max``: the largest)."""
    n = int(targets.ids.shape[0])
    device = next(model.parameters()).device
    acc: dict[str, float] = {"ce": 0.0, "kl": 0.0, "capacity": 0.0}
    ratios: list[float] = []
    weight_sum = 0.0
    for s in range(0, n, chunk):
        part = targets.rows(list(range(s, min(n, s + chunk))), device)
        with gated_attention(model, gates) as record:
            student = model(input_ids=part.ids, use_cache=False).logits
        lbs = [record[l] for l in range(gates.spec.n_layers)]
        ce, kl = topk_distillation_terms(student, part.ids, part.lengths, part.top_idx, part.top_logp, part.tail_logp)
        positions = float((part.lengths - 1).clamp_min(0).sum())
        acc["ce"] += float(ce) * positions
        acc["kl"] += float(kl) * positions
        weight_sum += positions
        acc["capacity"] += float(capacity_loss(lbs, m_global, part.lengths)) * part.ids.shape[0]
        ratios += per_sequence_retained(lbs, m_global, part.lengths).tolist()
    out = {"ce": acc["ce"] / weight_sum, "kl": acc["kl"] / weight_sum, "capacity": acc["capacity"] / n,
           "retained_mean": sum(ratios) / n, "retained_max": max(ratios)}
    out["budget"] = (out["retained_mean"] - 1.0) ** 2
    out["loss"] = 0.5 * (out["ce"] + out["kl"]) + capacity_weight * out["capacity"] + budget_weight * out["budget"]
    return out


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
    teacher_cache: str | os.PathLike[str] | None = None,
    weights_digest: str | None = None,
) -> TrainResult:
    """Train gates for ``model`` into ``out`` (created if missing), resuming a checkpoint there.

    ``progress(log, step_done, total)`` is called after every step; ``note(text)`` with
    remarks (a resume, a resume on another device or thread count: it continues, but is not
    bit-identical to an uninterrupted run). ``stop_after``: return after that many steps of
    this call (with a checkpoint written), as an interrupted run would (tests use it).
    ``teacher_cache``: the folder of the cached teacher outputs (None: ``out``, where they
    are deleted once the gates are finished; another folder keeps them for the next run on
    the same sequences, e.g. the local ablation or another capacity). ``weights_digest``: the
    model's identity recorded in ``gates.json`` for ``gates=default``, i.e. the digest of its
    weights as the registry loads them (float32); pass it when ``model`` was cast to another
    dtype for training (``None``: the digest of ``model`` as it is). The caller holds the
    folder's write lock.
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
    validation: list[dict[str, float]] = []
    weight = float(recipe.capacity_weight)
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
        validation = [dict(v) for v in ckpt.get("validation", [])]
        weight = float(ckpt.get("capacity_weight", weight))
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
    ids_all, lengths_all = data.pool(recipe.pool, recipe.val)
    cache_dir = Path(teacher_cache) if teacher_cache is not None else out
    targets, teacher_file = teacher_targets(
        model, ids_all, lengths_all, recipe.topk, cache_dir,
        {"model": model_name, "data": recipe.data.to_dict(), "seed": recipe.seed, "pool": recipe.pool,
         "val": recipe.val}, chunk=recipe.batch, note=say)
    teacher_s = (time.perf_counter() - t0, _cpu_seconds() - c0)
    train_rows, val_rows = targets.rows(list(range(recipe.pool))), targets.rows(
        list(range(recipe.pool, recipe.pool + recipe.val)))

    def run_validation(step: int) -> None:
        if recipe.val and not any(v["step"] == step for v in validation):
            gates.eval()
            validation.append({"step": step, "capacity_weight": weight,
                               **validate(model, gates, val_rows, m_global, weight, chunk=recipe.batch,
                                          budget_weight=recipe.budget_weight)})
            gates.train()

    done_here = 0
    gates.train()
    with _Frozen(model):
        if start == 0:
            run_validation(0)
        for step in range(start, recipe.steps):
            ts, cs = time.perf_counter(), _cpu_seconds()
            lr = _lr(recipe, step)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = train_rows.rows(step_indices(recipe.seed, step, recipe.batch, recipe.pool), device)
            loss, terms = train_step(model, gates, batch.ids, batch.lengths, m_global, weight, teacher=batch,
                                     budget_weight=recipe.budget_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(gates.parameters(), recipe.grad_clip)
            opt.step()
            log = StepLog(step=step, loss=float(loss.detach()), lr=lr, wall_s=time.perf_counter() - ts,
                          cpu_s=_cpu_seconds() - cs, capacity_weight=weight, **terms)
            weight = _next_weight(recipe, weight, log.retained_mean)
            history.append(log)
            done_here += 1
            last = step + 1 == recipe.steps
            if (step + 1) % recipe.val_every == 0 or last:
                run_validation(step + 1)
            if (step + 1) % recipe.checkpoint_every == 0 or last or (stop_after is not None and done_here >= stop_after):
                files.save_checkpoint(out, {"step": step + 1, "gates": gates.state_dict(), "optimizer": opt.state_dict(),
                                            "rng": files.capture_rng(), "history": [asdict(h) for h in history],
                                            "validation": validation, "capacity_weight": weight,
                                            "fingerprint": fp, "environment": env})
            if progress is not None:
                progress(log, step + 1, recipe.steps)
            if stop_after is not None and done_here >= stop_after and not last:
                return TrainResult(out, history, start, time.perf_counter() - t0, _cpu_seconds() - c0)
        if recipe.val and start == recipe.steps:  # resumed at the end: the final validation may be missing
            run_validation(recipe.steps)
    gates.eval()
    wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    extra = {"validation": validation, "capacity_weight_final": weight,
             "teacher": {"file": teacher_file.name, "topk": recipe.topk, "sequences": recipe.pool + recipe.val,
                         "wall_s_this_call": round(teacher_s[0], 2), "cpu_s_this_call": round(teacher_s[1], 2)}}
    _finish(out, gates, recipe, model, model_name, history, start, env, wall, cpu, extra, weights_digest)
    if teacher_cache is None:
        teacher_file.unlink(missing_ok=True)
        teacher_file.with_suffix(".json").unlink(missing_ok=True)
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
            history: list[StepLog], resumed_from: int, env: dict[str, Any], wall: float, cpu: float,
            extra: dict[str, Any] | None = None, digest: str | None = None) -> None:
    """Write losses.parquet, then the gates (gates.json last), then drop the checkpoint."""
    import polars as pl

    from evictlab.io import write_checked_parquet
    from evictlab.models.geometry import model_geometry

    g = model_geometry(model)
    write_checked_parquet(pl.DataFrame([asdict(h) for h in history]), out / files.LOSSES_FILE)
    tail = history[-min(10, len(history)):]
    from evictlab.models.loading import weights_digest

    meta = {
        "model": model_name,
        #: identifies the model for gates=default (files.default_gates_for)
        "weights_digest": digest or weights_digest(model),
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
                            for k in ("loss", "ce", "kl", "capacity", "retained_ratio", "retained_mean",
                                      "mean_log_beta")} if tail else None,
            "tokens_seen": len(history) * recipe.batch * recipe.data.seq_len,
        },
        **(extra or {}),
    }
    files.save_gates(out, gates, meta)
    (out / files.CHECKPOINT_FILE).unlink(missing_ok=True)


def convergence(history: list[dict[str, Any]], validation: list[dict[str, Any]]) -> dict[str, Any]:
    """How converged a run is (docs/gates.md): the last validation's retained mass over the
    budget, and the KL over the last quarter of the steps.

    ``history``: the rows of ``losses.parquet`` (``step``, ``kl``, ...); ``validation``: the
    rows of ``gates.json``. ``kl_last_quarter``: the training batches' mean KL (nats) over
    the last ``ceil(steps / 4)`` steps, its least-squares slope (nats per step) and that
    slope times the quarter's length relative to the mean (``relative_change``: 0 = flat);
    ``kl_validation_last_quarter``: the validation KL at the first and last validation
    inside that quarter (same sequences each time, so no batch noise).
    """
    import numpy as np

    n = len(history)
    q = max(2, math.ceil(n / 4))
    tail = history[-q:]
    x = np.array([h["step"] for h in tail], dtype=float)
    y = np.array([h["kl"] for h in tail], dtype=float)
    slope = float(np.polyfit(x, y, 1)[0]) if len(tail) >= 2 else float("nan")
    mean = float(y.mean())
    first_q = int(tail[0]["step"]) if tail else 0
    vq = [v for v in validation if v["step"] >= first_q]
    last = validation[-1] if validation else None
    return {
        "steps": n,
        "retained_over_budget": None if last is None else {"mean": last["retained_mean"], "max": last["retained_max"],
                                                           "step": last["step"]},
        "kl_last_quarter": {"steps": [first_q, int(tail[-1]["step"]) if tail else 0], "mean": mean,
                            "slope_per_step": slope, "relative_change": slope * len(tail) / mean if mean else None},
        "kl_validation_last_quarter": ({"first": {"step": vq[0]["step"], "kl": vq[0]["kl"]},
                                        "last": {"step": vq[-1]["step"], "kl": vq[-1]["kl"]},
                                        "relative_change": (vq[-1]["kl"] - vq[0]["kl"]) / vq[0]["kl"]}
                                       if len(vq) >= 2 else None),
    }
