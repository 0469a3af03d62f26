"""Seeded percentile bootstrap for medians and ROC AUC.

Every resample comes from ``numpy.random.default_rng`` seeded from the caller's seed and a
stable key (CRC-32 of the group's name), so a confidence interval is a pure function of
(data, seed, key, number of resamples): the same on every run and machine, and independent
of the order in which groups are processed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from evictlab.errors import InputError

_CHUNK_ELEMS = 4_000_000  # resample at most this many indices at once (memory bound)


@dataclass(frozen=True)
class Estimate:
    """A point estimate with a percentile-bootstrap confidence interval.

    ``lo``/``hi`` are NaN when the sample is empty (or, for AUC, one class is absent).
    ``n`` is the number of observations the estimate used.
    """

    value: float
    lo: float
    hi: float
    n: int

    def fmt(self, digits: int = 3) -> str:
        """``0.031 [0.027, 0.036]`` (or ``n/a`` when there is no data)."""
        if not np.isfinite(self.value):
            return "n/a"
        if not (np.isfinite(self.lo) and np.isfinite(self.hi)):
            return f"{self.value:.{digits}f}"
        return f"{self.value:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


def rng_for(seed: int, key: str = "") -> np.random.Generator:
    """A generator seeded by ``seed`` and a stable hash of ``key`` (not Python's ``hash``)."""
    return np.random.default_rng([int(seed), zlib.crc32(key.encode("utf-8"))])


def _check(n_boot: int, level: float) -> None:
    if n_boot < 1:
        raise InputError("n_boot", f"must be >= 1, got {n_boot}", "use e.g. 1000 resamples")
    if not 0.0 < level < 1.0:
        raise InputError("level", f"must be in (0, 1), got {level}", "use e.g. 0.95")


def _percentile_ci(
    x: np.ndarray, point: float, stat: Callable[..., np.ndarray], rng: np.random.Generator,
    n_boot: int, level: float,
) -> Estimate:
    """Percentile-bootstrap CI of ``stat(x)``: ``n_boot`` resamples of ``x`` with replacement,
    drawn in chunks of at most ``_CHUNK_ELEMS`` indices (memory bound); ``stat`` is applied
    along axis 1 of the ``(b, n)`` resample matrix."""
    n = x.size
    per = max(1, _CHUNK_ELEMS // n)
    stats = np.empty(n_boot)
    done = 0
    while done < n_boot:
        b = min(per, n_boot - done)
        idx = rng.integers(0, n, size=(b, n))
        stats[done : done + b] = stat(x[idx], axis=1)
        done += b
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(stats, [a, 1.0 - a])
    return Estimate(point, float(lo), float(hi), n)


def bootstrap_median(
    x: np.ndarray, *, seed: int, key: str = "", n_boot: int = 1000, level: float = 0.95
) -> Estimate:
    """Median of ``x`` with a percentile-bootstrap CI (non-finite values must be removed first)."""
    _check(n_boot, level)
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    if not np.all(np.isfinite(x)):
        raise InputError("x", "contains NaN or inf", "filter non-finite values and count them")
    point = float(np.median(x))
    if n == 1:
        return Estimate(point, point, point, 1)
    return _percentile_ci(x, point, np.median, rng_for(seed, key), n_boot, level)


def bootstrap_mean(
    x: np.ndarray, *, seed: int, key: str = "", n_boot: int = 1000, level: float = 0.95
) -> Estimate:
    """Mean of ``x`` (e.g. a 0/1 indicator: a fraction) with a percentile-bootstrap CI."""
    _check(n_boot, level)
    x = np.asarray(x, dtype=np.float64)
    n = x.size
    if n == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    point = float(np.mean(x))
    return _percentile_ci(x, point, np.mean, rng_for(seed, key), n_boot, level)


def roc_auc(y: np.ndarray, score: np.ndarray) -> float:
    """ROC AUC by the Mann-Whitney rank statistic (ties count one half); NaN if one class is absent.

    Equals ``sklearn.metrics.roc_auc_score`` (tested) but needs no Python loop per resample.
    """
    y = np.asarray(y, dtype=bool)
    score = np.asarray(score, dtype=np.float64)
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(score)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _average_ranks(a: np.ndarray) -> np.ndarray:
    """1-based ranks with ties replaced by their average rank (like scipy's rankdata)."""
    order = np.argsort(a, kind="mergesort")
    sa = a[order]
    # boundaries of runs of equal values
    new = np.empty(sa.size, dtype=bool)
    new[0] = True
    np.not_equal(sa[1:], sa[:-1], out=new[1:])
    run_id = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], sa.size)
    avg = (starts + ends + 1) / 2.0  # mean of 1-based positions start+1..end
    ranks = np.empty(a.size)
    ranks[order] = avg[run_id]
    return ranks


def bootstrap_auc(
    y: np.ndarray,
    score: np.ndarray,
    *,
    seed: int,
    key: str = "",
    n_boot: int = 1000,
    level: float = 0.95,
) -> Estimate:
    """ROC AUC of ``score`` for labels ``y`` with a percentile-bootstrap CI over rows.

    Vectorised: the scores are reduced once to sorted tie levels; each resample is a vector
    of multiplicities per observation, and its AUC is
    sum_l pos_l (neg_below_l + neg_l / 2) / (P N) over tie levels l (the Mann-Whitney
    statistic with multiplicities). Resamples in which one class is absent are skipped.
    """
    _check(n_boot, level)
    y = np.asarray(y, dtype=bool)
    score = np.asarray(score, dtype=np.float64)
    n = y.size
    point = roc_auc(y, score)
    if not np.isfinite(point):
        return Estimate(float("nan"), float("nan"), float("nan"), n)
    levels, lvl = np.unique(score, return_inverse=True)
    L = levels.size
    code = lvl * 2 + y  # (level, class) cell of each observation
    rng = rng_for(seed, key)
    per = max(1, _CHUNK_ELEMS // max(n, 2 * L))
    vals = np.empty(n_boot)
    done = 0
    while done < n_boot:
        b = min(per, n_boot - done)
        idx = rng.integers(0, n, size=(b, n))
        cells = code[idx] + (np.arange(b) * 2 * L)[:, None]
        counts = np.bincount(cells.ravel(), minlength=b * 2 * L).reshape(b, L, 2).astype(np.float64)
        neg, pos = counts[:, :, 0], counts[:, :, 1]
        below = np.cumsum(neg, axis=1) - neg
        P, N = pos.sum(axis=1), neg.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            vals[done : done + b] = (pos * (below + 0.5 * neg)).sum(axis=1) / (P * N)
        done += b
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return Estimate(point, float("nan"), float("nan"), n)
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(vals, [a, 1.0 - a])
    return Estimate(point, float(lo), float(hi), n)
