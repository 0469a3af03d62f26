"""The teacher's outputs, computed once per training pool and reused: top-k, cached on disk.

Training distils the gated model (the student) toward the same frozen model without gates
(the teacher). The teacher never changes during a run, so its outputs on the run's fixed
sequences (the training pool and the validation set, :meth:`~evictlab.gates.data.
TrainingData.pool`) are computed once, before the first step, and every later step reads
them instead of running the teacher again (a third of a step's compute).

What is kept per position ``t`` that predicts a real next token: the teacher's ``k``
most likely next tokens (``top_idx`` int32) with their log-probabilities (``top_logp``
float32) and the log of the probability left outside them (``tail_logp``; ``-inf`` when
``k`` covers the vocabulary). The KL of :func:`evictlab.gates.loss.topk_distillation_terms`
compares the two distributions coarsened to those ``k + 1`` outcomes: it is a lower bound
of the full KL (coarsening never increases a KL divergence) and equals it when ``k`` is the
vocabulary size (tested).

On disk (``<dir>/teacher-<key>.safetensors`` and its ``.json`` sidecar, written
atomically): the tensors ``ids (n, T)`` int64, ``lengths (n,)`` int64, ``top_idx
(n, T-1, k)``, ``top_logp (n, T-1, k)``, ``tail_logp (n, T-1)``; the sidecar holds the key
(the model's weights digest, dtype, data spec, seed, pool and validation sizes, k) and the
file's sha256. A cached file is used only when its sidecar's key is this run's, its
checksum verifies and its ``ids`` are the sequences this run draws; anything else is
recomputed (a damaged or stale file named in one note line, then replaced).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["TEACHER_FORMAT", "TeacherTargets", "teacher_targets", "topk_of_logits"]

TEACHER_FORMAT = "evictlab-gates-teacher/1"


@dataclass
class TeacherTargets:
    """The teacher's top-k outputs on ``n`` fixed sequences (shapes in the module docstring)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    top_idx: torch.Tensor
    top_logp: torch.Tensor
    tail_logp: torch.Tensor

    def rows(self, index: torch.Tensor | list[int], device: torch.device | str = "cpu") -> TeacherTargets:
        """The targets of sequences ``index`` (a batch), on ``device``."""
        i = torch.as_tensor(index, dtype=torch.long)
        return TeacherTargets(*(t[i].to(device) for t in (self.ids, self.lengths, self.top_idx, self.top_logp,
                                                          self.tail_logp)))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"ids": self.ids, "lengths": self.lengths, "top_idx": self.top_idx, "top_logp": self.top_logp,
                "tail_logp": self.tail_logp}


def topk_of_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(top_idx (..., k) int32, top_logp (..., k) float32, tail_logp (...,) float32)`` of
    logits ``(..., V)``: the ``k`` most likely tokens, their log-probabilities and the log of
    the probability of all other tokens (``-inf`` when ``k >= V``)."""
    lp = F.log_softmax(logits.float(), dim=-1)
    k = min(int(k), lp.shape[-1])
    top_logp, top_idx = lp.topk(k, dim=-1)
    rest = lp.scatter(-1, top_idx, float("-inf")).logsumexp(-1)
    return top_idx.to(torch.int32), top_logp.contiguous(), rest


@torch.no_grad()
def _compute(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor, k: int, chunk: int,
             progress: Callable[[int, int], None] | None) -> TeacherTargets:
    device = next(model.parameters()).device
    n, T = ids.shape
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for s in range(0, n, chunk):
        logits = model(input_ids=ids[s:s + chunk].to(device), use_cache=False).logits[:, :-1]
        parts.append(tuple(t.cpu() for t in topk_of_logits(logits, k)))  # type: ignore[arg-type]
        if progress is not None:
            progress(min(n, s + chunk), n)
    return TeacherTargets(ids.clone(), lengths.clone(), *(torch.cat([p[i] for p in parts]) for i in range(3)))


def _key(model: torch.nn.Module, key: dict[str, Any]) -> tuple[dict[str, Any], str]:
    from evictlab.models.loading import weights_digest

    full = {"format": TEACHER_FORMAT, "weights": weights_digest(model),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), **key}
    text = json.dumps(full, sort_keys=True)
    return full, hashlib.sha256(text.encode()).hexdigest()[:16]


def teacher_targets(model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor, k: int,
                    folder: str | os.PathLike[str], key: dict[str, Any], *, chunk: int = 4,
                    note: Callable[[str], None] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> tuple[TeacherTargets, Path]:
    """The teacher's top-``k`` targets on ``ids (n, T)`` (right-padded, real ``lengths``),
    read from ``folder`` when a checked copy is there, else computed (``chunk`` sequences
    per forward, no grad) and written there. ``key``: what besides the model's weights and
    dtype decides the sequences (data spec, seed, pool sizes). Returns ``(targets, path)``.
    """
    from safetensors.torch import load_file, save_file

    from evictlab.errors import CorruptFileError
    from evictlab.io import atomic_path, atomic_write_json, read_json, sha256_file, check_sha256

    say = note or (lambda _t: None)
    full, digest = _key(model, {**key, "k": int(k), "n": int(ids.shape[0]), "seq_len": int(ids.shape[1])})
    folder = Path(folder)
    path = folder / f"teacher-{digest}.safetensors"
    side = path.with_suffix(".json")
    if path.is_file() and side.is_file():
        try:
            meta = read_json(side, "")
            if not isinstance(meta, dict) or meta.get("key") != full:
                raise CorruptFileError(str(side), "is for other sequences or another model", "")
            check_sha256(path, str(meta.get("sha256", "")), "")
            got = load_file(str(path))
            targets = TeacherTargets(**{name: got[name] for name in ("ids", "lengths", "top_idx", "top_logp",
                                                                       "tail_logp")})
            if not (torch.equal(targets.ids, ids.cpu()) and torch.equal(targets.lengths, lengths.cpu())):
                raise CorruptFileError(str(path), "holds other token ids than this run's sequences", "")
            return targets, path
        except (CorruptFileError, KeyError, OSError) as exc:
            say(f"the cached teacher outputs {path.name} cannot be used ({str(exc).splitlines()[0][:160]}): "
                "computing them again")
    targets = _compute(model, ids.cpu(), lengths.cpu(), k, chunk, progress)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(path, suffix=".safetensors") as tmp:
        save_file({n: t.contiguous() for n, t in targets.tensors().items()}, str(tmp),
                  metadata={"format": TEACHER_FORMAT})
    atomic_write_json(side, {"key": full, "sha256": sha256_file(path)})
    return targets, path
