"""Paired comparisons: two arms of the grid on the same examples, wins / ties / losses.

An **arm** is a (method, mode) in one comparison group, a group being one (model, task,
context, protocol, budget). Pairs (:func:`compare`):

- ``kind="method"``: two methods in the same mode (matched bytes in ``physical`` and
  ``uniform`` modes: the same budget);
- ``kind="mode"``: one method in two modes (``physical`` vs ``uniform``, ``masked`` vs
  ``uniform``, ``physical`` vs ``masked``): the enforcement cost;
- ``kind="full"``: an arm against the full cache on the same examples.

Examples are matched by their index (same seed, same n); rows of one example are never
treated as independent of each other: every interval resamples examples (the resampling
engine, :mod:`evictlab.stats.bootstrap`).

**The tie rule** (:class:`TieRule`, written in every row's ``rule`` column):

- per example (always): the higher exact match wins; at equal exact match (and on
  ``heldout_ppl``, which has none) the answer log-probabilities decide, a difference
  within ``tolerance`` nats (default 0.1) being a tie. So where exact match sits at a floor
  or a ceiling the log-probability still ranks the two. ``wins`` / ``ties`` / ``losses``
  count examples from arm A's side.
- per comparison (``verdict``), by ``kind``: ``"em-logprob"`` (default): win if A has more
  example wins than losses, loss if fewer, tie if equal; ``"bootstrap"``: the paired
  percentile-bootstrap interval (``level``, ``n_boot`` resamples of the examples) of the
  mean exact-match difference decides if it excludes 0, else that of the mean answer
  log-probability difference, and an interval containing 0 on both is a tie.

Columns of the pairs table: :data:`PAIR_COLUMNS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import polars as pl

from evictlab.errors import InputError
from evictlab.eval.spec import FULL
from evictlab.stats.bootstrap import bootstrap_mean

__all__ = ["PAIR_COLUMNS", "TieRule", "compare", "example_outcomes", "paired_mean", "wtl_table"]

GROUP = ("model", "task", "context", "protocol", "budget")
MODE_PAIRS: tuple[tuple[str, str], ...] = (("physical", "uniform"), ("masked", "uniform"), ("physical", "masked"))
"""Mode comparisons of one method, as (A, B)."""

PAIR_COLUMNS: dict[str, Any] = {
    "kind": pl.Utf8, "model": pl.Utf8, "task": pl.Utf8, "context": pl.Int64, "protocol": pl.Utf8,
    "budget": pl.Utf8, "budget_unit": pl.Utf8, "budget_value": pl.Int64,
    "a_method": pl.Utf8, "a_mode": pl.Utf8, "b_method": pl.Utf8, "b_mode": pl.Utf8,
    "n": pl.Int64, "wins": pl.Int64, "ties": pl.Int64, "losses": pl.Int64, "verdict": pl.Utf8, "rule": pl.Utf8,
    "em_a": pl.Float64, "em_b": pl.Float64, "d_em": pl.Float64, "d_em_lo": pl.Float64, "d_em_hi": pl.Float64,
    "logprob_a": pl.Float64, "logprob_b": pl.Float64, "d_logprob": pl.Float64, "d_logprob_lo": pl.Float64,
    "d_logprob_hi": pl.Float64,
    "kl_a": pl.Float64, "kl_b": pl.Float64, "d_kl": pl.Float64, "d_kl_lo": pl.Float64, "d_kl_hi": pl.Float64,
    "bytes_live_a": pl.Float64, "bytes_live_b": pl.Float64, "bytes_peak_a": pl.Float64, "bytes_peak_b": pl.Float64,
    "full_em": pl.Float64, "regime": pl.Utf8,
}


@dataclass(frozen=True)
class TieRule:
    """How a pair of arms is scored (module docstring). ``tolerance``: nats of answer
    log-probability within which two examples tie; ``level``, ``n_boot``, ``seed``: the
    paired bootstrap's interval level, resamples and seed (also used for the intervals of
    every row, whatever ``kind``)."""

    kind: Literal["em-logprob", "bootstrap"] = "em-logprob"
    tolerance: float = 0.1
    level: float = 0.95
    n_boot: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("em-logprob", "bootstrap"):
            raise InputError("tie_rule", f"unknown rule {self.kind!r}", "use em-logprob or bootstrap")
        if not self.tolerance >= 0:
            raise InputError("tolerance", f"{self.tolerance} nats is not a tolerance", "use a tolerance >= 0 (nats)")
        if not 0 < self.level < 1:
            raise InputError("level", f"{self.level} is not an interval level", "use a level in (0, 1), e.g. 0.95")
        if self.n_boot < 1:
            raise InputError("n_boot", f"{self.n_boot} resamples", "use at least 1 resample, e.g. 2000")

    def describe(self) -> str:
        """The rule in words (the ``rule`` column)."""
        per_example = (f"per example: higher exact match wins; equal (or none): answer log-prob within "
                       f"+-{self.tolerance:g} nats ties, else the higher wins")
        if self.kind == "em-logprob":
            return per_example + "; comparison: more example wins than losses"
        return (per_example + f"; comparison: paired {self.level:.0%} percentile bootstrap over examples "
                f"({self.n_boot} resamples) of the mean difference in exact match, then in answer log-prob; "
                "an interval containing 0 on both is a tie")


def example_outcomes(em_a: np.ndarray, em_b: np.ndarray, lp_a: np.ndarray, lp_b: np.ndarray,
                     tolerance: float) -> np.ndarray:
    """Per example ``+1`` (A wins), ``0`` (tie), ``-1`` (A loses) under the per-example rule.

    ``em_*``: exact match per example (NaN = none, e.g. a perplexity window); ``lp_*``:
    answer log-probabilities (nats). Shapes ``(n,)``.
    """
    em_a, em_b, lp_a, lp_b = (np.asarray(x, dtype=np.float64) for x in (em_a, em_b, lp_a, lp_b))
    d_lp = lp_a - lp_b
    # "within the tolerance" includes the boundary; the slack absorbs the rounding of the
    # subtraction (-1.0 - -1.1 is 0.10000000000000009)
    out = np.where(np.abs(d_lp) <= tolerance * (1 + 1e-9) + 1e-12, 0, np.sign(d_lp)).astype(np.int64)
    decided = ~np.isnan(em_a) & ~np.isnan(em_b) & (em_a != em_b)
    out[decided] = np.sign(em_a - em_b)[decided].astype(np.int64)
    return out


def paired_mean(d: np.ndarray, rule: TieRule, key: str) -> tuple[float, float, float]:
    """``(mean, lo, hi)`` of the paired differences ``d`` (one per example) with the percentile
    interval of ``rule`` (its level, resamples and seed): the paired bootstrap over examples
    of the resampling engine (:func:`evictlab.stats.bootstrap.bootstrap_mean`, keyed by ``key``)."""
    e = bootstrap_mean(np.asarray(d, dtype=np.float64), seed=rule.seed, key=key, n_boot=rule.n_boot,
                       level=rule.level)
    return e.value, e.lo, e.hi


def _verdict(rule: TieRule, wins: int, losses: int, em: tuple[float, float, float],
             lp: tuple[float, float, float]) -> str:
    if rule.kind == "em-logprob":
        return "win" if wins > losses else "loss" if losses > wins else "tie"
    for _, lo, hi in (em, lp):
        if np.isfinite(lo) and (lo > 0 or hi < 0):
            return "win" if lo > 0 else "loss"
    return "tie"


def _mean(x: np.ndarray) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(np.nanmean(x)) if x.size and not np.isnan(x).all() else float("nan")


def _pair_row(kind: str, key: dict[str, Any], a: pl.DataFrame, b: pl.DataFrame, rule: TieRule,
              full_em: float) -> dict[str, Any]:
    j = a.join(b, on="example", suffix="_b", how="inner").sort("example")
    em_a = j["exact_match"].to_numpy().astype(np.float64)
    em_b = j["exact_match_b"].to_numpy().astype(np.float64)
    lp_a, lp_b = j["answer_logprob"].to_numpy(), j["answer_logprob_b"].to_numpy()
    kl_a, kl_b = j["kl"].to_numpy(), j["kl_b"].to_numpy()
    o = example_outcomes(em_a, em_b, lp_a, lp_b, rule.tolerance)
    tag = "|".join(str(v) for v in (kind, *key.values(), a["method"][0], a["mode"][0], b["method"][0], b["mode"][0]))
    scored = not (np.isnan(em_a).all() or np.isnan(em_b).all())
    d_em = paired_mean(em_a - em_b, rule, tag + "|em") if scored else (np.nan,) * 3
    d_lp = paired_mean(lp_a - lp_b, rule, tag + "|logprob")
    d_kl = paired_mean(kl_a - kl_b, rule, tag + "|kl")
    wins, ties, losses = int((o > 0).sum()), int((o == 0).sum()), int((o < 0).sum())
    ema, emb = _mean(em_a), _mean(em_b)
    regime = "n/a" if not scored else "floor" if ema == emb == 0 else "ceiling" if ema == emb == 1 else "open"
    return {
        "kind": kind, **key, "a_method": a["method"][0], "a_mode": a["mode"][0], "b_method": b["method"][0],
        "b_mode": b["mode"][0], "n": j.height, "wins": wins, "ties": ties, "losses": losses,
        "verdict": _verdict(rule, wins, losses, d_em, d_lp), "rule": rule.describe(),
        "em_a": ema, "em_b": emb, "d_em": d_em[0], "d_em_lo": d_em[1], "d_em_hi": d_em[2],
        "logprob_a": _mean(lp_a), "logprob_b": _mean(lp_b), "d_logprob": d_lp[0], "d_logprob_lo": d_lp[1],
        "d_logprob_hi": d_lp[2], "kl_a": _mean(kl_a), "kl_b": _mean(kl_b), "d_kl": d_kl[0], "d_kl_lo": d_kl[1],
        "d_kl_hi": d_kl[2],
        "bytes_live_a": _mean(j["bytes_live"].to_numpy()), "bytes_live_b": _mean(j["bytes_live_b"].to_numpy()),
        "bytes_peak_a": _mean(j["bytes_live_peak"].to_numpy()),
        "bytes_peak_b": _mean(j["bytes_live_peak_b"].to_numpy()),
        "full_em": full_em, "regime": regime,
    }


_NEEDED = ("model", "task", "context", "method", "mode", "protocol", "budget", "budget_unit", "budget_value",
           "example", "exact_match", "answer_logprob", "kl", "bytes_live", "bytes_live_peak")


def compare(results: pl.DataFrame, rule: TieRule | None = None,
            kinds: Sequence[str] = ("method", "mode", "full")) -> pl.DataFrame:
    """Every pair of arms on the same examples (module docstring); one row per pair and
    group, columns :data:`PAIR_COLUMNS`. ``results``: ``results.parquet`` of a grid."""
    rule = rule or TieRule()
    missing = [c for c in _NEEDED if c not in results.columns]
    if missing:
        raise InputError("results", f"lacks columns {missing}", "pass the results.parquet of `evictlab eval run`")
    cols = list(_NEEDED)
    res = results.select(cols)
    full = res.filter(pl.col("method") == FULL)
    full_em = {k: _mean(g["exact_match"].to_numpy().astype(np.float64))
               for k, g in full.group_by(["model", "task", "context"], maintain_order=True)}
    ev = res.filter(pl.col("method") != FULL)
    rows: list[dict[str, Any]] = []
    for gkey, g in ev.group_by(list(GROUP), maintain_order=True):
        key = dict(zip(GROUP, gkey))
        key.update(budget_unit=g["budget_unit"][0], budget_value=g["budget_value"][0])
        fem = full_em.get((key["model"], key["task"], key["context"]), float("nan"))
        arms = {(m, md): a for (m, md), a in g.group_by(["method", "mode"], maintain_order=True)}
        order = list(arms)
        if "method" in kinds:
            for i, (ma, mda) in enumerate(order):
                for mb, mdb in order[i + 1:]:
                    if mda == mdb:
                        rows.append(_pair_row("method", key, arms[(ma, mda)], arms[(mb, mdb)], rule, fem))
        if "mode" in kinds:
            for method in dict.fromkeys(m for m, _ in order):
                for ma, mb in MODE_PAIRS:
                    if (method, ma) in arms and (method, mb) in arms:
                        rows.append(_pair_row("mode", key, arms[(method, ma)], arms[(method, mb)], rule, fem))
        if "full" in kinds:
            ref = full.filter((pl.col("model") == key["model"]) & (pl.col("task") == key["task"])
                              & (pl.col("context") == key["context"]))
            if ref.height:
                for arm in order:
                    rows.append(_pair_row("full", key, arms[arm], ref, rule, fem))
    return pl.DataFrame(rows, schema=PAIR_COLUMNS)


def wtl_table(pairs: pl.DataFrame, kind: str = "method") -> pl.DataFrame:
    """The paper's layout: one row per (model, context, protocol, pair), one column per
    ``task @ budget`` with ``W/T/L`` (example counts, arm A's side)."""
    p = pairs.filter(pl.col("kind") == kind)
    if p.height == 0:
        return pl.DataFrame()
    p = p.with_columns(
        pair=pl.format("{} [{}] vs {} [{}]", "a_method", "a_mode", "b_method", "b_mode"),
        col=pl.format("{} @ {}", "task", "budget"),
        wtl=pl.format("{}/{}/{}", "wins", "ties", "losses"),
    )
    cols = list(dict.fromkeys(p["col"].to_list()))
    wide = p.pivot(on="col", index=["model", "context", "protocol", "pair"], values="wtl", aggregate_function="first")
    return wide.select(["model", "context", "protocol", "pair", *[c for c in cols if c in wide.columns]])
