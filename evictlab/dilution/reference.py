"""Plain-numpy reference of the dilution quantities for ONE row (docs/theory.md section 7).

Written the way the definitions read, with no vectorisation across rows, so that the
block computation of :mod:`evictlab.dilution.measures` can be tested against it.
"""

from __future__ import annotations

import math

import numpy as np


def softmax(logits: np.ndarray) -> np.ndarray:
    """``p = softmax(logits)`` in float64."""
    z = np.asarray(logits, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def useful_mass(logits: np.ndarray, useful: np.ndarray) -> float:
    """alpha = Z_U / (Z_U + Z_D), from the logits."""
    p = softmax(logits)
    return float(sum(p[i] for i in range(len(p)) if useful[i]))


def margin_lower_bound(logits: np.ndarray, useful: np.ndarray, margin: float | None = None) -> float:
    """Theorem 1: 1 / (1 + (|D| / |U|) e^{-Delta}), with Delta the row's own margin
    (min useful logit - max distractor logit) unless ``margin`` is given."""
    lu = [float(x) for x, u in zip(logits, useful) if u]
    ld = [float(x) for x, u in zip(logits, useful) if not u]
    delta = (min(lu) - max(ld)) if margin is None else margin
    r = len(ld) / len(lu)
    t = math.log(r) - delta
    return 1.0 / (1.0 + math.exp(t)) if t < 700 else 0.0


def spread_upper_bound(logits: np.ndarray, useful: np.ndarray) -> float:
    """Theorem 1 (upper): 1 / (1 + (|D| / |U|) e^{-Gamma}), Gamma = max useful - min distractor logit."""
    lu = [float(x) for x, u in zip(logits, useful) if u]
    ld = [float(x) for x, u in zip(logits, useful) if not u]
    t = math.log(len(ld) / len(lu)) - (max(lu) - min(ld))
    return 1.0 / (1.0 + math.exp(t)) if t < 700 else 0.0


def kept_useful_mass(logits: np.ndarray, useful: np.ndarray, kept: np.ndarray) -> float:
    """alpha_A: the useful mass of the renormalised softmax over the kept keys A."""
    p = softmax(logits)
    pa = sum(p[i] for i in range(len(p)) if kept[i])
    pua = sum(p[i] for i in range(len(p)) if kept[i] and useful[i])
    return float(pua / pa)


def distractor_fraction(logits: np.ndarray, useful: np.ndarray, kept: np.ndarray) -> float:
    """rho = Z_{D n A} / Z_D."""
    z = np.exp(np.asarray(logits, np.float64) - max(logits))
    zd = sum(z[i] for i in range(len(z)) if not useful[i])
    zda = sum(z[i] for i in range(len(z)) if not useful[i] and kept[i])
    return float(zda / zd)


def useful_error(logits: np.ndarray, useful: np.ndarray, values: np.ndarray, kept: np.ndarray | None = None) -> float:
    """||m_A - m_U|| (A = every key when ``kept`` is None): how far the (forced) output is from
    the output of the useful keys alone."""
    p = softmax(logits)
    a = np.ones(len(p), bool) if kept is None else np.asarray(kept, bool)
    m_a = sum(p[i] * values[i] for i in range(len(p)) if a[i]) / sum(p[i] for i in range(len(p)) if a[i])
    m_u = sum(p[i] * values[i] for i in range(len(p)) if useful[i]) / sum(p[i] for i in range(len(p)) if useful[i])
    return float(np.linalg.norm(m_a - m_u))
