"""Decode metrics: perplexity, next-token KL to the full cache, top-1 agreement, exact match.

Pure functions of tensors (computed in float64, so the comparison of two nearly equal
caches is not swamped by float32 rounding). Logits are ``(..., n, vocab)``: any leading
batch axes, ``n`` scored positions. A ``mask`` ``(..., n)`` bool selects the positions that
count (e.g. answer tokens only); None counts all. Natural logarithms throughout (nats).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

from evictlab.errors import InputError

__all__ = [
    "KLResult",
    "aggregate_exact_match",
    "next_token_kl",
    "perplexity",
    "token_nll",
    "top1_agreement",
]


def _check_pair(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise InputError(name_b, f"shape {tuple(b.shape)} differs from {name_a} {tuple(a.shape)}",
                         "score the same positions with both caches")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> float:
    if mask is None:
        return float(x.mean()) if x.numel() else float("nan")
    if mask.shape != x.shape:
        raise InputError("mask", f"shape {tuple(mask.shape)}, expected {tuple(x.shape)}", "pass one flag per position")
    m = mask.to(x.device, torch.bool)
    return float(x[m].mean()) if m.any() else float("nan")


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target token, nats.

    Args:
        logits: ``(..., n, V)``; ``logits[..., t, :]`` predicts ``targets[..., t]`` (already
            shifted: the caller pairs the logits at position t with the token at t + 1).
        targets: ``(..., n)`` int64 token ids.

    Returns:
        ``(..., n)`` float64 ``-log softmax(logits)[target]``.
    """
    if logits.shape[:-1] != targets.shape:
        raise InputError("targets", f"shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}",
                         "pass one target per scored position (logits[..., t] predicts targets[..., t])")
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets.to(logits.device).long().unsqueeze(-1)).squeeze(-1)


def perplexity(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """``exp(mean NLL)`` over the (masked) positions; ``logits (..., n, V)``, ``targets (..., n)``."""
    return math.exp(_masked_mean(token_nll(logits, targets), mask))


@dataclass(frozen=True)
class KLResult:
    """Next-token KL(full || compressed): ``per_token`` ``(..., n)`` float64 nats and its mean."""

    per_token: torch.Tensor
    mean: float


def next_token_kl(
    full_logits: torch.Tensor, compressed_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> KLResult:
    """KL divergence of the compressed model's next-token distribution from the full one.

    ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` with ``p = softmax(full_logits)`` and
    ``q = softmax(compressed_logits)``: the expected extra nats per token of sampling from
    the compressed cache when the full cache is the truth. Zero iff the two distributions
    are equal; never negative (clamped at 0 against rounding).

    Args:
        full_logits, compressed_logits: ``(..., n, V)``, same shape, same positions.
        mask: ``(..., n)`` bool or None; positions that count towards ``mean``.
    """
    _check_pair(full_logits, compressed_logits, "full_logits", "compressed_logits")
    logp = torch.log_softmax(full_logits.double(), dim=-1)
    logq = torch.log_softmax(compressed_logits.double().to(full_logits.device), dim=-1)
    # p * (logp - logq) with p = 0 contributes 0 even where logq = -inf.
    terms = torch.where(logp > -math.inf, logp.exp() * (logp - logq), torch.zeros_like(logp))
    kl = terms.sum(dim=-1).clamp_min(0.0)
    return KLResult(per_token=kl, mean=_masked_mean(kl, mask))


def top1_agreement(
    full_logits: torch.Tensor, compressed_logits: torch.Tensor, mask: torch.Tensor | None = None
) -> float:
    """Fraction of positions where both caches' argmax tokens agree; logits ``(..., n, V)``.

    Ties in the argmax go to the lowest token id in both (``torch.argmax``'s rule), so two
    identical logit tensors always agree fully.
    """
    _check_pair(full_logits, compressed_logits, "full_logits", "compressed_logits")
    same = (full_logits.argmax(-1) == compressed_logits.to(full_logits.device).argmax(-1)).double()
    return _masked_mean(same, mask)


def aggregate_exact_match(tasks: Sequence[str], scores: Sequence[float]) -> pl.DataFrame:
    """Exact match per task and overall: one row per task, plus ``task == "all"``.

    Columns: ``task, n, exact_match`` (mean of the per-example scores, 0/1 for exact match)
    and ``stderr`` (standard error of that mean, ``std(ddof=1) / sqrt(n)``; 0 for one example).
    """
    if len(tasks) != len(scores):
        raise InputError("scores", f"{len(scores)} scores for {len(tasks)} tasks", "pass one score per example")
    if len(tasks) == 0:
        raise InputError("scores", "no examples", "run at least one example")
    df = pl.DataFrame({"task": list(tasks), "score": np.asarray(scores, dtype=np.float64)})
    rows = []
    for name in sorted(set(tasks)) + ["all"]:
        s = df["score"] if name == "all" else df.filter(pl.col("task") == name)["score"]
        n = len(s)
        se = float(s.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0
        rows.append({"task": name, "n": n, "exact_match": float(s.mean()), "stderr": se})
    return pl.DataFrame(rows, schema={"task": pl.Utf8, "n": pl.Int64, "exact_match": pl.Float64, "stderr": pl.Float64})
