"""The training objective of retention gates (definitions: docs/theory.md section 13, docs/gates.md).

Three pieces, each a pure function of tensors:

- :func:`retention_bias`: the additive attention bias ``(t - i) log beta_i`` a query at
  position ``t`` puts on key ``i <= t`` (0 for ``i = t``, and for masked ``i > t``). Adding
  it to the logits multiplies key ``i``'s unnormalised weight by its retention
  ``beta_i ** (t - i)``: ``beta -> 0`` evicts the key for every later query, ``beta = 1``
  changes nothing.
- :func:`capacity_loss`: with ``S_t = sum over layers l, KV heads h and j <= t of
  beta_{l,h,j} ** (t - j)`` (the expected number of entries still retained at step ``t``),
  the mean over steps of ``max(0, S_t - M_global) / (C_t - M_global)``, where
  ``C_t = L x H x (t + 1)`` is ``S_t``'s largest value (every beta = 1), over the steps with
  ``C_t > M_global`` (earlier steps cannot overshoot). Each term lies in [0, 1]: 0 when the
  retained mass fits the budget, 1 when nothing decays.
- :func:`topk_distillation_terms`: the same two terms against the teacher's cached top-k
  outputs (:mod:`evictlab.gates.teacher`), the KL taken between the two distributions
  coarsened to the teacher's ``k`` tokens plus one bucket for the rest (a lower bound of
  the full KL; equal to it when ``k`` is the vocabulary). Training uses this one.
- :func:`distillation_terms`: the next-token cross-entropy of the gated student and
  ``KL(teacher || student)`` against the same frozen model without the bias, averaged over
  the positions that predict a real next token.

The loss of a step is ``(ce + kl) / 2 + capacity_weight x capacity`` (:mod:`evictlab.gates.train`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["budget_loss", "capacity_loss", "distillation_terms", "per_sequence_retained", "retained_mass",
           "retention_bias", "topk_distillation_terms"]


def _ages(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """``(T_q, T_k)`` float32 ages ``t - i`` (negative above the diagonal)."""
    return (q_positions[:, None] - k_positions[None, :]).to(torch.float32)


def _decay_exponent(log_beta: torch.Tensor, age: torch.Tensor) -> torch.Tensor:
    """``(b, hk, T_q, T_k)``: ``age x log beta`` where ``age > 0``, else 0 (never ``0 x -inf``).

    ``log_beta`` ``(b, T_k, hk)``; ``age`` ``(T_q, T_k)``. The inner ``where`` keeps the
    gradient finite where the outer one discards a value.
    """
    lb = log_beta.to(torch.float32).transpose(1, 2)[:, :, None, :]  # (b, hk, 1, T_k)
    past = (age > 0)[None, None]
    return torch.where(past, age.clamp_min(0)[None, None] * torch.where(past, lb, 0.0), 0.0)


def retention_bias(log_beta: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """The additive attention bias of retention gates.

    Args:
        log_beta: ``(b, T_k, hk)`` float ``log beta`` of every key (in ``[-inf, 0]``).
        q_positions: ``(T_q,)`` int64 positions of the queries.
        k_positions: ``(T_k,)`` int64 positions of the keys.

    Returns:
        ``(b, hk, T_q, T_k)`` float32: ``(t - i) log beta_i`` where ``i < t``, else 0 (a key
        at the query's own position is never decayed; keys after it are masked anyway).
        ``log beta = -inf`` gives ``-inf`` for every later query (exact eviction), never NaN.
    """
    return _decay_exponent(log_beta, _ages(q_positions.to(log_beta.device), k_positions.to(log_beta.device)))


def retained_mass(log_betas: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """``S_t``: ``(b, T)`` float32, ``sum_{l, h, j <= t} beta_{l,h,j} ** (t - j)``.

    ``log_betas``: per layer ``(b, T, hk)`` (a sequence, or one ``(L, b, T, hk)`` tensor),
    positions ``0..T-1``.
    """
    total: torch.Tensor | None = None
    for lb in log_betas:
        pos = torch.arange(lb.shape[1], device=lb.device)
        age = _ages(pos, pos)
        r = torch.exp(_decay_exponent(lb, age)) * (age >= 0)[None, None]  # retention of key j at step t
        part = r.sum(dim=(1, 3))  # over heads and keys -> (b, T)
        total = part if total is None else total + part
    if total is None:
        raise ValueError("no layers")
    return total


def capacity_loss(log_betas: Sequence[torch.Tensor] | torch.Tensor, m_global: float,
                  lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The normalised capacity overshoot (see the module docstring); a scalar tensor.

    Args:
        log_betas: per layer ``(b, T, hk)`` ``log beta`` (positions ``0..T-1``).
        m_global: the global budget ``M_global`` in entries (``L x H x M``).
        lengths: ``(b,)`` int64 real lengths of right-padded sequences (None: all ``T``);
            padded steps are left out of the mean.
    """
    lbs = list(log_betas)
    n_layers = len(lbs)
    b, T, hk = lbs[0].shape
    device = lbs[0].device
    # Right padding: for a real step t < length every key j <= t is real, so S_t needs no
    # correction; padded steps are only left out of the mean.
    s = retained_mass(lbs)
    t = torch.arange(T, device=device, dtype=torch.float32)
    rng = n_layers * hk * (t + 1) - float(m_global)  # C_t - M_global
    use = (rng > 0)[None, :].expand(b, T)
    if lengths is not None:
        use = use & (torch.arange(T, device=device)[None, :] < lengths.to(device)[:, None])
    if not bool(use.any()):
        return s.sum() * 0.0
    over = torch.relu(s - float(m_global)) / torch.where(rng > 0, rng, 1.0)[None, :]
    return over[use].mean()


def distillation_terms(student_logits: torch.Tensor, teacher_logits: torch.Tensor, ids: torch.Tensor,
                       lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce, kl)`` scalars: the student's next-token cross-entropy on ``ids`` and
    ``KL(teacher || student)``, both in nats, averaged over positions ``t`` with a real next
    token (``t + 1 < length``).

    Shapes: logits ``(b, T, V)``, ids ``(b, T)`` int64, lengths ``(b,)`` or None.
    """
    b, T, _ = student_logits.shape
    valid = torch.ones(b, T - 1, dtype=torch.bool, device=ids.device)
    if lengths is not None:
        valid = torch.arange(T - 1, device=ids.device)[None, :] + 1 < lengths.to(ids.device)[:, None]
    ls = F.log_softmax(student_logits[:, :-1].float(), dim=-1)[valid]  # (n, V)
    lt = F.log_softmax(teacher_logits[:, :-1].float(), dim=-1)[valid]
    ce = F.nll_loss(ls, ids[:, 1:][valid])
    kl = (lt.exp() * (lt - ls)).sum(-1).mean()
    return ce, kl


def topk_distillation_terms(student_logits: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor | None,
                            top_idx: torch.Tensor, top_logp: torch.Tensor,
                            tail_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce, kl)`` scalars (nats) against cached teacher targets, averaged like
    :func:`distillation_terms` over the positions with a real next token.

    ``kl = sum_{i in K} p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)``: ``K`` the
    teacher's top-k tokens, ``rest`` every other token (``q_rest`` from the student's full
    softmax). Shapes: logits ``(b, T, V)``, ids ``(b, T)``, lengths ``(b,)`` or None,
    ``top_idx``/``top_logp`` ``(b, T-1, k)``, ``tail_logp`` ``(b, T-1)``.
    """
    b, T, _ = student_logits.shape
    valid = torch.ones(b, T - 1, dtype=torch.bool, device=ids.device)
    if lengths is not None:
        valid = torch.arange(T - 1, device=ids.device)[None, :] + 1 < lengths.to(ids.device)[:, None]
    ls = F.log_softmax(student_logits[:, :-1].float(), dim=-1)[valid]  # (n, V)
    idx = top_idx[valid].long()
    lp = top_logp[valid].float()
    tail = tail_logp[valid].float()
    ce = F.nll_loss(ls, ids[:, 1:][valid])
    lq = ls.gather(-1, idx)
    kl_top = (lp.exp() * (lp - lq)).sum(-1)
    if idx.shape[-1] >= ls.shape[-1]:  # k covers the vocabulary: no rest (and no -inf logsumexp to differentiate)
        return ce, kl_top.mean()
    lq_tail = ls.scatter(-1, idx, float("-inf")).logsumexp(-1)
    p_tail = tail.exp()
    kl = (kl_top + p_tail * (tail - lq_tail)).mean()
    return ce, kl


def per_sequence_retained(log_betas: Sequence[torch.Tensor], m_global: float, lengths: torch.Tensor) -> torch.Tensor:
    """``(b,)`` float32: each sequence's ``max_t S_t / M_global`` over its real steps
    (1 = its retained mass peaks exactly at the budget). Differentiable (the gradient
    reaches the step of the peak)."""
    s = retained_mass(log_betas)
    real = torch.arange(s.shape[1], device=s.device)[None, :] < lengths.to(s.device)[:, None]
    return torch.where(real, s, float("-inf")).amax(dim=1) / float(m_global)


def budget_loss(log_betas: Sequence[torch.Tensor], m_global: float, lengths: torch.Tensor) -> torch.Tensor:
    """``(mean over sequences of max_t S_t / M_global - 1)^2``: the two-sided budget term
    (0 exactly at the budget; it pulls the retained mass up as well as down, where the
    capacity hinge only pushes it down and lets it sink below the budget)."""
    return (per_sequence_retained(log_betas, m_global, lengths).mean() - 1.0) ** 2
