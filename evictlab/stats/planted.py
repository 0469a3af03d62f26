"""Planted solver-results tables with a known answer, for testing the statistics (not solver output).

:func:`planted_results` fabricates a table with every column of the solver-results contract
in which the dropped mass m is Uniform(0, 1) and the significant-gap label is drawn from a
known logistic model, P(kappa_hat > threshold | m) = sigmoid(a + b m). The AUC of m as a
score for that label is then a number computed by :func:`planted_auc` by quadrature, so a
test can check the AUC pipeline against a known value. Every row's model column says
``planted``-something; no statistic of a real model is ever computed from these tables.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from evictlab.stats.ceilings import DEFAULT_THRESHOLD


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def planted_auc(a: float, b: float, grid: int = 20001) -> float:
    """AUC of m for label ~ Bernoulli(sigmoid(a + b m)), m ~ U(0, 1), by trapezoid quadrature.

    AUC = P(m1 > m0 | y1 = 1, y0 = 0) = int_0^1 q(u) (1 - Q(u))... computed as
    int q(u) F0(u) du / (pi (1 - pi)) with F0(u) = int_0^u (1 - q), pi = int q.
    """
    u = np.linspace(0.0, 1.0, grid)
    q = _sigmoid(a + b * u)
    du = u[1] - u[0]
    neg = 1.0 - q
    F0 = np.concatenate([[0.0], np.cumsum((neg[1:] + neg[:-1]) * du / 2.0)])
    pi = np.trapezoid(q, u)
    return float(np.trapezoid(q * F0, u) / (pi * (1.0 - pi)))


def planted_results(
    n_rows: int = 2000,
    budgets: tuple[int, ...] = (4, 8, 16, 32),
    *,
    seed: int = 0,
    a: float = -2.0,
    b: float = 4.0,
    model: str = "planted",
    n_layers: int = 4,
    n_heads: int = 3,
    n_keys: int = 64,
    zero_frac: float = 0.01,
    threshold: float = DEFAULT_THRESHOLD,
    certify: bool = False,
    search_all: bool = False,
) -> pl.DataFrame:
    """A results table (one row per (row_id, s)) with a planted mass -> gap relation.

    ``zero_frac`` of observations get e_top = 0 (flagged ``e_top_zero``; gap_closed null),
    to exercise their separate reporting. ``search_all``: the all-key search's columns too
    (``es_ls`` = 0.92 ES_hat on a planted 30% of observations, else ES_hat); with
    ``certify`` the certified optimum is then at most ES_ls.
    """
    rng = np.random.default_rng(seed)
    N = n_rows * len(budgets)
    row_id = np.repeat(np.arange(n_rows), len(budgets))
    s = np.tile(np.asarray(budgets, dtype=np.int64), n_rows)
    layer = np.repeat(rng.integers(0, n_layers, n_rows), len(budgets))
    head = np.repeat(rng.integers(0, n_heads, n_rows), len(budgets))
    m = rng.uniform(0.0, 1.0, N)
    y = rng.uniform(size=N) < _sigmoid(a + b * m)
    # kappa above / below the threshold by a random log-margin
    kappa = np.where(y, threshold * np.exp(rng.exponential(0.3, N)), threshold * np.exp(-rng.exponential(0.05, N)))
    kappa = np.maximum(kappa, 1.0)
    e_top = rng.uniform(0.05, 1.0, N) * (0.2 + m)
    zero = rng.uniform(size=N) < zero_frac
    e_top[zero] = 0.0
    es_hat = np.where(zero, 0.0, e_top / kappa)
    e_bal = es_hat + rng.uniform(0, 1, N) * (e_top - es_hat) * (rng.uniform(size=N) < 0.5)
    gap = np.where(zero, np.nan, (e_top - es_hat) / np.where(zero, 1.0, e_top))
    pi_top = 1.0 + 0.02 * s + rng.gamma(2.0, 0.05, N)
    pi_opt = pi_top * rng.uniform(1.0, 1.2, N)
    n = np.full(N, n_keys, dtype=np.int64)
    entropy = np.log(n_keys) * np.clip(0.3 + 0.6 * m + rng.normal(0, 0.05, N), 0.01, 1.0)
    cols: dict[str, object] = {
        "row_id": row_id.astype(np.int64), "s": s, "n": n, "e_top": e_top, "es_hat": es_hat,
        "e_bal": e_bal, "gap_closed": pl.Series(gap, nan_to_null=True), "kappa_hat": np.where(zero, 0.0, kappa),
        "dropped_mass": m, "e_free_top": e_top / pi_top, "e_free_opt": es_hat / pi_opt,
        "pi_top": np.where(zero, np.nan, pi_top), "pi_opt": np.where(zero, np.nan, pi_opt),
        "kept": [list(range(int(k))) for k in s], "e_top_zero": zero,
        "prompt_id": (row_id // 64).astype(np.int64), "layer": layer.astype(np.int64),
        "q_head": head.astype(np.int64), "kv_head": (head // max(1, n_heads // 1)).astype(np.int64),
        "position": (row_id % 64).astype(np.int64) + n_keys, "model": [model] * N, "entropy": entropy,
    }
    es_ls = es_hat
    if search_all:
        es_ls = np.where(rng.uniform(size=N) < 0.3, 0.92 * es_hat, es_hat)
        cols["es_ls"] = es_ls
        cols["gap_closed_ls"] = pl.Series(np.where(zero, np.nan, (e_top - es_ls) / np.where(zero, 1.0, e_top)),
                                          nan_to_null=True)
    if certify:
        miss = rng.uniform(size=N) < 0.1
        cols["es_cert"] = np.minimum(np.where(miss, es_hat * 0.9, es_hat), es_ls)
        cols["cert_status"] = ["optimal"] * N
        if search_all:
            cols["cert_lb"] = cols["es_cert"]
    return pl.DataFrame(cols)
