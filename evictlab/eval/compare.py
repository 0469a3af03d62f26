"""Paired comparisons: two arms of the grid on the same answers, at two levels.

An **arm** is a (method, mode) in one comparison group, a group being one (model, task,
context, protocol, prefill, budget). Pairs (:func:`compare`):

- ``kind="method"``: two methods in the same mode (matched bytes in ``physical`` and
  ``uniform`` modes: the same budget);
- ``kind="mode"``: one method in two modes (``physical`` vs ``uniform``, ``masked`` vs
  ``uniform``, ``physical`` vs ``masked``): the enforcement cost;
- ``kind="full"``: an arm against the full cache on the same answers.

**Level 1: per answer, clustered by context.** A row of the grid is one (cell, example,
question): an example is one context, asked ``questions`` questions (``question`` = 0 ..
questions - 1). Answers are paired by ``(example, question)`` (same seed, same n; a frame
written before the question columns existed has one question per example: question 0,
questions 1, prefill ``chunked``, :func:`with_question_columns`). The answers of one context
share its keys and values, so they are never treated as independent: every interval is a
**whole-context cluster bootstrap** (:func:`evictlab.stats.bootstrap.Design.whole_clusters`
over the example index: a drawn context brings all its questions), the resampling engine of
:mod:`evictlab.stats.bootstrap`. ``n`` counts paired answers, ``contexts`` the contexts
they come from.

**The per-answer tie rule** (:class:`TieRule`, written in every row's ``rule`` column):

- per answer (always): the higher exact match wins; at equal exact match (and on
  ``heldout_ppl``, which has none) the answer log-probabilities decide, a difference
  within ``tolerance`` nats (default 0.1) being a tie. So where exact match sits at a floor
  or a ceiling the log-probability still ranks the two. ``wins`` / ``ties`` / ``losses``
  count answers from arm A's side.
- per comparison (``verdict``), by ``kind``: ``"em-logprob"`` (default): win if A has more
  answer wins than losses, loss if fewer, tie if equal; ``"bootstrap"``: the paired
  percentile-bootstrap interval (``level``, ``n_boot`` resamples of whole contexts) of the
  mean exact-match difference decides if it excludes 0, else that of the mean answer
  log-probability difference, and an interval containing 0 on both is a tie.

**Level 2: per configuration, the papers' unit.** Papers count one comparison per (model,
task, context, budget, scorer[, store, protocol]) and report e.g. "93 wins / 22 ties / 22
losses over 160 comparisons". A pair row is exactly one such configuration (the store is
the mode, the scorer is part of the method); its ``accuracy_verdict``
(:func:`accuracy_verdict`, :data:`CONFIG_RULE`) compares the two arms' accuracy (exact
match over the configuration's paired answers): **a tie when the numbers of correct answers
differ by at most one** (``|difference in accuracy| <= 1 / n``), else the higher accuracy
wins (why this rule: docs/evaluation.md, "Configurations"). :func:`configurations` counts
them per comparison family (columns :data:`CONFIG_COLUMNS`).

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
from evictlab.stats.bootstrap import Design, bootstrap_mean

__all__ = ["CONFIG_COLUMNS", "CONFIG_RULE", "PAIR_COLUMNS", "PAIR_ON", "QUESTION_COLUMNS", "TieRule",
           "accuracy_verdict", "compare", "configuration_lines", "configurations", "context_design", "example_outcomes", "paired_mean",
           "with_question_columns", "wtl_table"]

GROUP = ("model", "task", "context", "protocol", "prefill", "budget")
PAIR_ON = ("example", "question")
"""Columns that pair the answers of two arms: the context (example index) and the question."""
QUESTION_COLUMNS: dict[str, tuple[Any, Any]] = {
    "prefill": ("chunked", pl.Utf8), "question": (0, pl.Int64), "questions": (1, pl.Int64)}
"""Columns a grid's rows gained with shared prefills and several questions per context, with
the value a frame written before them implies (today's per-arm path, one question)."""
MODE_PAIRS: tuple[tuple[str, str], ...] = (("physical", "uniform"), ("masked", "uniform"), ("physical", "masked"))
"""Mode comparisons of one method, as (A, B)."""

PAIR_COLUMNS: dict[str, Any] = {
    "kind": pl.Utf8, "model": pl.Utf8, "task": pl.Utf8, "context": pl.Int64, "protocol": pl.Utf8,
    "prefill": pl.Utf8, "budget": pl.Utf8, "budget_unit": pl.Utf8, "budget_value": pl.Int64,
    "a_method": pl.Utf8, "a_mode": pl.Utf8, "b_method": pl.Utf8, "b_mode": pl.Utf8,
    "a_scorer": pl.Utf8, "a_allocator": pl.Utf8, "b_scorer": pl.Utf8, "b_allocator": pl.Utf8,
    "n": pl.Int64, "contexts": pl.Int64, "wins": pl.Int64, "ties": pl.Int64, "losses": pl.Int64,
    "verdict": pl.Utf8, "accuracy_verdict": pl.Utf8, "rule": pl.Utf8,
    "em_a": pl.Float64, "em_b": pl.Float64, "d_em": pl.Float64, "d_em_lo": pl.Float64, "d_em_hi": pl.Float64,
    "logprob_a": pl.Float64, "logprob_b": pl.Float64, "d_logprob": pl.Float64, "d_logprob_lo": pl.Float64,
    "d_logprob_hi": pl.Float64,
    "kl_a": pl.Float64, "kl_b": pl.Float64, "d_kl": pl.Float64, "d_kl_lo": pl.Float64, "d_kl_hi": pl.Float64,
    "bytes_live_a": pl.Float64, "bytes_live_b": pl.Float64, "bytes_peak_a": pl.Float64, "bytes_peak_b": pl.Float64,
    "full_em": pl.Float64, "regime": pl.Utf8,
}
"""Columns of :func:`compare`'s table: one row per pair of arms in one group (a
configuration). ``n``: paired answers; ``contexts``: the contexts (examples) they come from;
``wins``/``ties``/``losses``: answers under the per-answer rule; ``verdict``: the pair under
:class:`TieRule`; ``accuracy_verdict``: the configuration under :data:`CONFIG_RULE`
(``n/a`` without exact match); ``d_*``: mean differences A - B with their whole-context
cluster-bootstrap intervals."""

CONFIG_RULE = ("configuration = one (model, task, context, budget, scorer, store, protocol, prefill); score = "
               "accuracy (exact match over its paired answers); a tie when the two arms' correct answers differ by "
               "at most one (|difference in accuracy| <= 1/n answers), else the higher accuracy wins")
"""The per-configuration tie rule in words (the ``rule`` column of :func:`configurations`)."""

CONFIG_COLUMNS: dict[str, Any] = {
    "kind": pl.Utf8, "a": pl.Utf8, "a_mode": pl.Utf8, "b": pl.Utf8, "b_mode": pl.Utf8, "protocol": pl.Utf8,
    "prefill": pl.Utf8, "scorers": pl.Utf8, "configurations": pl.Int64, "wins": pl.Int64, "ties": pl.Int64,
    "losses": pl.Int64, "unscored": pl.Int64, "answers": pl.Int64, "contexts": pl.Int64, "counts": pl.Utf8,
    "rule": pl.Utf8,
}
"""Columns of :func:`configurations`: one row per comparison family, arm ``a`` (mode
``a_mode``) against ``b`` under one protocol and prefill, pooled over models, tasks, context
lengths, budgets and (for two allocators under the same scorer: ``a`` / ``b`` read
``+allocator``) scorers, listed in ``scorers``. ``configurations``: the configurations
counted, each a pair row of :func:`compare`; ``wins`` / ``ties`` / ``losses``: configurations
by ``accuracy_verdict`` from ``a``'s side (their sum is ``configurations``); ``unscored``:
configurations without exact match (``heldout_ppl``), not counted; ``answers`` /
``contexts``: paired answers and contexts summed over the counted configurations;
``counts``: "W wins / T ties / L losses over N comparisons" (the papers' wording);
``rule``: :data:`CONFIG_RULE`."""


def with_question_columns(results: pl.DataFrame) -> pl.DataFrame:
    """``results`` with the columns of :data:`QUESTION_COLUMNS`, each filled with its implied
    value where a frame written before it existed lacks it or holds nulls (``prefill``
    "chunked", ``question`` 0, ``questions`` 1); frames with every value are returned unchanged."""
    fill = []
    for c, (v, t) in QUESTION_COLUMNS.items():
        if c not in results.columns:
            fill.append(pl.lit(v, dtype=t).alias(c))
        elif results[c].null_count():
            fill.append(pl.col(c).cast(t).fill_null(pl.lit(v, dtype=t)))
    return results.with_columns(fill) if fill else results


@dataclass(frozen=True)
class TieRule:
    """How a pair of arms is scored (module docstring). ``tolerance``: nats of answer
    log-probability within which two answers tie; ``level``, ``n_boot``, ``seed``: the
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
        per_example = (f"per answer: higher exact match wins; equal (or none): answer log-prob within "
                       f"+-{self.tolerance:g} nats ties, else the higher wins")
        if self.kind == "em-logprob":
            return per_example + "; comparison: more answer wins than losses"
        return (per_example + f"; comparison: paired {self.level:.0%} percentile bootstrap over whole contexts "
                f"({self.n_boot} resamples) of the mean difference in exact match, then in answer log-prob; "
                "an interval containing 0 on both is a tie")


def example_outcomes(em_a: np.ndarray, em_b: np.ndarray, lp_a: np.ndarray, lp_b: np.ndarray,
                     tolerance: float) -> np.ndarray:
    """Per answer ``+1`` (A wins), ``0`` (tie), ``-1`` (A loses) under the per-answer rule.

    ``em_*``: exact match per answer (NaN = none, e.g. a perplexity window); ``lp_*``:
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


def context_design(examples: np.ndarray | Sequence[object]) -> Design:
    """The whole-context cluster design over paired answers: ``examples`` ``(n,)`` labels
    each answer's context (within one comparison the example index); a replicate draws as
    many contexts as there are, with replacement, each with all its answers."""
    return Design.whole_clusters(np.asarray(examples), "context")


def paired_mean(d: np.ndarray, rule: TieRule, key: str,
                examples: np.ndarray | Sequence[object] | None = None) -> tuple[float, float, float]:
    """``(mean, lo, hi)`` of the paired differences ``d`` (one per answer) with the percentile
    interval of ``rule`` (its level, resamples and seed) from the resampling engine
    (:func:`evictlab.stats.bootstrap.bootstrap_mean`, keyed by ``key``): whole contexts
    (:func:`context_design` of ``examples``, one label per answer) when given, else the
    bootstrap over answers (one answer per context)."""
    d = np.asarray(d, dtype=np.float64)
    clusters = None if examples is None else context_design(examples)
    e = bootstrap_mean(d, seed=rule.seed, key=key, n_boot=rule.n_boot, level=rule.level, clusters=clusters)
    return e.value, e.lo, e.hi


def accuracy_verdict(correct_a: float, correct_b: float, n: int) -> str:
    """The configuration's verdict from arm A's side under :data:`CONFIG_RULE`: ``correct_*``
    are the numbers of correct answers (sums of exact match, NaN when there is none) over the
    ``n`` paired answers; ``"tie"`` when they differ by at most one, else ``"win"`` /
    ``"loss"``; ``"n/a"`` without exact match or answers."""
    if n <= 0 or not (np.isfinite(correct_a) and np.isfinite(correct_b)):
        return "n/a"
    d = correct_a - correct_b
    if abs(d) <= 1 + 1e-9:  # exact match is 0/1, so the sums are whole numbers up to rounding
        return "tie"
    return "win" if d > 0 else "loss"


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
    j = a.join(b, on=list(PAIR_ON), suffix="_b", how="inner").sort(list(PAIR_ON))
    em_a = j["exact_match"].to_numpy().astype(np.float64)
    em_b = j["exact_match_b"].to_numpy().astype(np.float64)
    lp_a, lp_b = j["answer_logprob"].to_numpy(), j["answer_logprob_b"].to_numpy()
    kl_a, kl_b = j["kl"].to_numpy(), j["kl_b"].to_numpy()
    examples = j["example"].to_numpy()
    o = example_outcomes(em_a, em_b, lp_a, lp_b, rule.tolerance)
    tag = "|".join(str(v) for v in (kind, *key.values(), a["method"][0], a["mode"][0], b["method"][0], b["mode"][0]))
    scored = j.height > 0 and not (np.isnan(em_a).all() or np.isnan(em_b).all())
    d_em = paired_mean(em_a - em_b, rule, tag + "|em", examples) if scored else (np.nan,) * 3
    d_lp = paired_mean(lp_a - lp_b, rule, tag + "|logprob", examples)
    d_kl = paired_mean(kl_a - kl_b, rule, tag + "|kl", examples)
    wins, ties, losses = int((o > 0).sum()), int((o == 0).sum()), int((o < 0).sum())
    ema, emb = _mean(em_a), _mean(em_b)
    regime = "n/a" if not scored else "floor" if ema == emb == 0 else "ceiling" if ema == emb == 1 else "open"
    acc = (accuracy_verdict(float(np.nansum(em_a)), float(np.nansum(em_b)), j.height) if scored else "n/a")
    return {
        "kind": kind, **key, "a_method": a["method"][0], "a_mode": a["mode"][0], "b_method": b["method"][0],
        "b_mode": b["mode"][0], "a_scorer": a["scorer"][0], "a_allocator": a["allocator"][0],
        "b_scorer": b["scorer"][0], "b_allocator": b["allocator"][0],
        "n": j.height, "contexts": int(np.unique(examples).size), "wins": wins, "ties": ties, "losses": losses,
        "verdict": _verdict(rule, wins, losses, d_em, d_lp), "accuracy_verdict": acc, "rule": rule.describe(),
        "em_a": ema, "em_b": emb, "d_em": d_em[0], "d_em_lo": d_em[1], "d_em_hi": d_em[2],
        "logprob_a": _mean(lp_a), "logprob_b": _mean(lp_b), "d_logprob": d_lp[0], "d_logprob_lo": d_lp[1],
        "d_logprob_hi": d_lp[2], "kl_a": _mean(kl_a), "kl_b": _mean(kl_b), "d_kl": d_kl[0], "d_kl_lo": d_kl[1],
        "d_kl_hi": d_kl[2],
        "bytes_live_a": _mean(j["bytes_live"].to_numpy()), "bytes_live_b": _mean(j["bytes_live_b"].to_numpy()),
        "bytes_peak_a": _mean(j["bytes_live_peak"].to_numpy()),
        "bytes_peak_b": _mean(j["bytes_live_peak_b"].to_numpy()),
        "full_em": full_em, "regime": regime,
    }


_NEEDED = ("model", "task", "context", "method", "scorer", "allocator", "mode", "protocol", "budget", "budget_unit",
           "budget_value", "example", "exact_match", "answer_logprob", "kl", "bytes_live", "bytes_live_peak")


def compare(results: pl.DataFrame, rule: TieRule | None = None,
            kinds: Sequence[str] = ("method", "mode", "full")) -> pl.DataFrame:
    """Every pair of arms on the same answers (module docstring); one row per pair and
    group, columns :data:`PAIR_COLUMNS`. ``results``: ``results.parquet`` of a grid (one row
    per (cell, example, question); frames without the question columns: one question per
    example, :func:`with_question_columns`)."""
    rule = rule or TieRule()
    missing = [c for c in _NEEDED if c not in results.columns]
    if missing:
        raise InputError("results", f"lacks columns {missing}", "pass the results.parquet of `evictlab eval run`")
    res = with_question_columns(results).select([*_NEEDED, *QUESTION_COLUMNS])
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
            # one full-cache reference per answer, whichever prefill labelled it
            ref = full.filter((pl.col("model") == key["model"]) & (pl.col("task") == key["task"])
                              & (pl.col("context") == key["context"])).unique(list(PAIR_ON), keep="first",
                                                                                maintain_order=True)
            if ref.height:
                for arm in order:
                    rows.append(_pair_row("full", key, arms[arm], ref, rule, fem))
    return pl.DataFrame(rows, schema=PAIR_COLUMNS)


def configurations(pairs: pl.DataFrame, *, pool_scorers: bool = True) -> pl.DataFrame:
    """Wins / ties / losses over configurations, the papers' unit (module docstring): one row
    per comparison family of ``pairs`` (:func:`compare`'s table), columns
    :data:`CONFIG_COLUMNS`. With ``pool_scorers``, two arms with the same scorer and
    different allocators are labelled by their allocators (``+contourkv`` vs ``+adakv``; a
    mode pair, one method in two stores, by the method's: ``+adakv`` [masked] vs ``+adakv``
    [uniform]) and pooled over scorers, as the papers pool
    "ContourKV vs KVzip" over their settings; otherwise (and for pairs of different scorers
    or against the full cache) arms are their methods."""
    if pairs.height == 0:
        return pl.DataFrame(schema=CONFIG_COLUMNS)
    same = (pl.col("a_scorer") == pl.col("b_scorer")) & (pl.col("kind") != "full")
    pooled = same if pool_scorers else pl.lit(False)
    p = pairs.with_columns(
        a=pl.when(pooled).then(pl.format("+{}", "a_allocator")).otherwise(pl.col("a_method")),
        # a mode pair is one method in two stores: both sides read the method's allocator
        b=pl.when(pooled & (pl.col("kind") == "mode")).then(pl.format("+{}", "a_allocator"))
        .when(pooled).then(pl.format("+{}", "b_allocator")).otherwise(pl.col("b_method")),
        scored=pl.col("accuracy_verdict") != "n/a")
    out = (p.group_by(["kind", "a", "a_mode", "b", "b_mode", "protocol", "prefill"], maintain_order=True)
           .agg(scorers=pl.col("a_scorer").unique(maintain_order=True).str.join(", "),
                configurations=pl.col("scored").sum().cast(pl.Int64),
                wins=(pl.col("accuracy_verdict") == "win").sum().cast(pl.Int64),
                ties=(pl.col("accuracy_verdict") == "tie").sum().cast(pl.Int64),
                losses=(pl.col("accuracy_verdict") == "loss").sum().cast(pl.Int64),
                unscored=(~pl.col("scored")).sum().cast(pl.Int64),
                answers=pl.col("n").filter(pl.col("scored")).sum().cast(pl.Int64),
                contexts=pl.col("contexts").filter(pl.col("scored")).sum().cast(pl.Int64))
           .with_columns(counts=pl.format("{} wins / {} ties / {} losses over {} comparisons", "wins", "ties",
                                          "losses", "configurations"),
                         rule=pl.lit(CONFIG_RULE)))
    return out.select(list(CONFIG_COLUMNS)).cast(CONFIG_COLUMNS)


def configuration_lines(configs: pl.DataFrame) -> list[str]:
    """One line per row of :func:`configurations`' table, for a command's output:
    ``kind: a [a_mode] vs b [b_mode] (protocol, prefill prefill): W wins / T ties / L losses
    over N comparisons``."""
    return [f"{r['kind']}: {r['a']} [{r['a_mode']}] vs {r['b']} [{r['b_mode']}] ({r['protocol']}, prefill "
            f"{r['prefill']}): {r['counts']}" for r in configs.iter_rows(named=True)]


def wtl_table(pairs: pl.DataFrame, kind: str = "method") -> pl.DataFrame:
    """The paper's layout: one row per (model, context, protocol, prefill, pair), one column
    per ``task @ budget`` with ``W/T/L`` (answer counts, arm A's side)."""
    p = pairs.filter(pl.col("kind") == kind)
    if p.height == 0:
        return pl.DataFrame()
    if "prefill" not in p.columns:
        p = p.with_columns(prefill=pl.lit(QUESTION_COLUMNS["prefill"][0]))
    p = p.with_columns(
        pair=pl.format("{} [{}] vs {} [{}]", "a_method", "a_mode", "b_method", "b_mode"),
        col=pl.format("{} @ {}", "task", "budget"),
        wtl=pl.format("{}/{}/{}", "wins", "ties", "losses"),
    )
    cols = list(dict.fromkeys(p["col"].to_list()))
    index = ["model", "context", "protocol", "prefill", "pair"]
    wide = p.pivot(on="col", index=index, values="wtl", aggregate_function="first")
    return wide.select([*index, *[c for c in cols if c in wide.columns]])
