"""Dilution measures of attention rows, one (prompt, layer, KV head) block at a time.

Definitions and proofs: docs/theory.md section 7. The rows of one block share its keys and
values, so every quantity is computed on dense ``(R, L)`` arrays (R rows, L keys of the
block) with plain numpy, rows in parallel; :mod:`evictlab.dilution.reference` writes the
same quantities out for one row, and the tests compare the two.

Inputs (float64 unless noted):

- ``P`` ``(R, L)``: attention weights, row r's weights over the keys it sees, 0 elsewhere;
- ``logits`` ``(R, L)``: the same row's attention logits (any value where not visible);
- ``visible`` bool ``(R, L)``: the keys row r sees;
- ``useful`` bool ``(L,)``: the useful keys U (tokens of the asked facts); every other
  visible key is a distractor (D);
- ``values`` ``(L, d)``; ``kept`` bool ``(R, L)``: a kept set A per row (inside ``visible``).

Quantities per row are exact functions of these arrays; the bound checks compare them with
the inequalities of docs/theory.md to the tolerance :data:`TOL`.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit, logsumexp

#: Absolute tolerance of every check on masses (values in [0, 1]) and of the identities,
#: relative to the value scale for output errors. Rows are float64 recomputations from
#: float32 queries and keys, so rounding is ~1e-15; 1e-9 leaves room and still catches any
#: real violation.
TOL = 1e-9

__all__ = ["TOL", "kept_measures", "margin_bound", "row_measures"]


def margin_bound(margin: np.ndarray, n_useful: np.ndarray, n_distractors: np.ndarray) -> np.ndarray:
    """``1 / (1 + (|D| / |U|) e^{-margin})``, computed as ``expit(margin - log(|D|/|U|))``
    (no overflow for any margin); NaN where |U| = 0 or |D| = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.log(n_distractors.astype(np.float64)) - np.log(n_useful.astype(np.float64))
        out = expit(np.asarray(margin, np.float64) - ratio)
    return np.where((n_useful > 0) & (n_distractors > 0), out, np.nan)


def _masked(x: np.ndarray, mask: np.ndarray, fill: float) -> np.ndarray:
    return np.where(mask, x, fill)


def row_measures(P: np.ndarray, logits: np.ndarray, visible: np.ndarray, useful: np.ndarray,
                 stated_margin: float | None = None) -> dict[str, np.ndarray]:
    """Per-row dilution quantities of a block (every array ``(R,)``).

    ``n_useful``, ``n_distractors``: |U|, |D| among the visible keys; ``alpha`` = P(U) (on
    ``P`` normalised per row); ``alpha_logits``: the same from the logits
    (``exp(logsumexp(l_U) - logsumexp(l))``, an independent recomputation);
    ``distractor_mass`` = 1 - alpha; ``margin`` (Delta) = min l_U - max l_D;
    ``margin_mean`` = mean l_U - max l_D; ``spread`` (Gamma) = max l_U - min l_D;
    ``bound_margin``, ``bound_mean`` (lower bounds on alpha: Theorem 1 and its Jensen form),
    ``bound_upper`` (Theorem 1's upper bound, from the spread), and the slacks
    ``alpha - bound`` / ``bound_upper - alpha``. With ``stated_margin`` (a margin assumed,
    not measured), ``stated_holds`` (Delta >= the stated margin: the assumption) and
    ``bound_stated``. Rows with |U| = 0 or |D| = 0 get NaN bounds (``defined`` False).
    """
    vis_u = visible & useful[None, :]
    vis_d = visible & ~useful[None, :]
    n_u = vis_u.sum(1)
    n_d = vis_d.sum(1)
    defined = (n_u > 0) & (n_d > 0)
    tot = (P * visible).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = (P * vis_u).sum(1) / tot
        l_all = logsumexp(_masked(logits, visible, -np.inf), axis=1)
        l_u = logsumexp(_masked(logits, vis_u, -np.inf), axis=1)
        alpha_logits = np.exp(l_u - l_all)
        min_u = _masked(logits, vis_u, np.inf).min(1)
        max_u = _masked(logits, vis_u, -np.inf).max(1)
        mean_u = _masked(logits, vis_u, 0.0).sum(1) / n_u
        max_d = _masked(logits, vis_d, -np.inf).max(1)
        min_d = _masked(logits, vis_d, np.inf).min(1)
        margin = np.where(defined, min_u - max_d, np.nan)
        margin_mean = np.where(defined, mean_u - max_d, np.nan)
        spread = np.where(defined, max_u - min_d, np.nan)
    out = {
        "n_useful": n_u.astype(np.int64), "n_distractors": n_d.astype(np.int64), "defined": defined,
        "alpha": alpha, "alpha_logits": np.where(n_u > 0, alpha_logits, 0.0), "distractor_mass": 1.0 - alpha,
        "margin": margin, "margin_mean": margin_mean, "spread": spread,
        "bound_margin": margin_bound(margin, n_u, n_d), "bound_mean": margin_bound(margin_mean, n_u, n_d),
        "bound_upper": margin_bound(spread, n_u, n_d),
    }
    out["slack_margin"] = out["alpha"] - out["bound_margin"]
    out["slack_mean"] = out["alpha"] - out["bound_mean"]
    out["slack_upper"] = out["bound_upper"] - out["alpha"]
    if stated_margin is not None:
        out["stated_holds"] = defined & (margin >= stated_margin)
        out["bound_stated"] = margin_bound(np.full(margin.shape, float(stated_margin)), n_u, n_d)
        out["slack_stated"] = out["alpha"] - out["bound_stated"]
    return out


def _forced(W: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(mass (R,), forced output (R, d))`` of weights ``W`` ``(R, L)``; NaN output where mass is 0."""
    mass = W.sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return mass, (W @ values) / mass[:, None]


def kept_measures(P: np.ndarray, logits: np.ndarray, visible: np.ndarray, useful: np.ndarray,
                  values: np.ndarray, kept: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row quantities of a kept set A (every array ``(R,)``; docs/theory.md section 7).

    Counts ``kept``, ``kept_useful`` |U n A|, ``kept_distractors`` |D n A|; ``contains_useful``
    (U <= A among the visible keys); ``sigma_useful`` = P(U n A) / P(U) and ``sigma_distractor``
    (= rho) = P(D n A) / P(D): the shares of useful and distractor weight kept;
    ``alpha_kept`` = P(U n A) / P(A), the useful mass after renormalisation;
    ``alpha_rho`` = P(U) / (P(U) + rho P(D)) (equals ``alpha_kept`` when U <= A);
    ``error_scaling`` = (1 - alpha_kept) / (1 - alpha); the margin bound over the kept keys
    (``margin_kept``, ``bound_margin_kept``) and its slack.

    Output errors measured from the useful keys' own output m_U (ours): ``err_full`` =
    ||mu - m_U||, ``err_kept`` = ||m_A - m_U||, ``err_ratio`` = err_kept / err_full,
    ``value_shift`` = ||m_{D n A} - m_U|| / ||m_D - m_U||; ``identity_gap`` = |err_kept -
    (1 - alpha_kept) ||m_{D n A} - m_U||| (0 to rounding when U <= A, Theorem 3);
    ``err_bound`` = (1 - alpha_kept) max_{i in D n A} ||v_i - m_U|| >= err_kept.
    """
    kept = kept & visible
    vis_u = visible & useful[None, :]
    vis_d = visible & ~useful[None, :]
    ku, kd = kept & useful[None, :], kept & ~useful[None, :]
    tot = (P * visible).sum(1)
    Pn = P * visible / tot[:, None]
    p_u, m_u = _forced(Pn * vis_u, values)
    p_d, m_d = _forced(Pn * vis_d, values)
    p_a, m_a = _forced(Pn * kept, values)
    p_ua = (Pn * ku).sum(1)
    p_da, m_da = _forced(Pn * kd, values)
    mu = Pn @ values
    n_ku, n_kd = ku.sum(1), kd.sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = p_u
        alpha_kept = p_ua / p_a
        sigma_u = p_ua / p_u
        sigma_d = p_da / p_d
        alpha_rho = p_u / (p_u + sigma_d * p_d)
        scaling = (1.0 - alpha_kept) / (1.0 - alpha)
        min_u = _masked(logits, ku, np.inf).min(1)
        max_d = _masked(logits, kd, -np.inf).max(1)
        margin_kept = np.where((n_ku > 0) & (n_kd > 0), min_u - max_d, np.nan)
        err_full = np.linalg.norm(mu - m_u, axis=1)
        err_kept = np.linalg.norm(m_a - m_u, axis=1)
        shift_kept = np.linalg.norm(m_da - m_u, axis=1)
        err_ratio = err_kept / err_full
        value_shift = shift_kept / np.linalg.norm(m_d - m_u, axis=1)
        identity_gap = np.abs(err_kept - (1.0 - alpha_kept) * np.where(n_kd > 0, shift_kept, 0.0))
        # distances ||v_i - m_U|| for every (row, key): ||v||^2 - 2 v.m + ||m||^2
        sq = (values * values).sum(1)[None, :] - 2.0 * (m_u @ values.T) + (m_u * m_u).sum(1)[:, None]
        far = np.sqrt(np.maximum(_masked(sq, kd, -np.inf).max(1), 0.0))
        err_bound = (1.0 - alpha_kept) * np.where(n_kd > 0, far, 0.0)
    contains = ~(vis_u & ~kept).any(1)
    bound_kept = margin_bound(margin_kept, n_ku, n_kd)
    return {
        "kept": kept.sum(1).astype(np.int64), "kept_useful": n_ku.astype(np.int64),
        "kept_distractors": n_kd.astype(np.int64), "contains_useful": contains,
        "sigma_useful": sigma_u, "sigma_distractor": sigma_d, "alpha_kept": alpha_kept, "alpha_rho": alpha_rho,
        "error_scaling": scaling, "margin_kept": margin_kept, "bound_margin_kept": bound_kept,
        "slack_margin_kept": alpha_kept - bound_kept,
        "err_full": err_full, "err_kept": err_kept, "err_ratio": err_ratio, "value_shift": value_shift,
        "identity_gap": identity_gap, "err_bound": err_bound,
        "value_scale": np.sqrt(np.maximum(_masked(sq, visible, 0.0).max(1), 0.0)),
    }
