"""Pairing, the tie rule and the claims on hand-made result tables (no model)."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.eval.claims.common import versus
from evictlab.eval.claims.enforcement import enforcement_cost
from evictlab.eval.claims.margin import query_aware_margin
from evictlab.eval.compare import (CONFIG_COLUMNS, CONFIG_RULE, TieRule, accuracy_verdict, compare,
                                   configuration_lines, configurations, context_design, example_outcomes, paired_mean,
                                   with_question_columns, wtl_table)
from evictlab.stats.bootstrap import Design, bootstrap_mean
from evictlab.eval.runner import RESULT_COLUMNS


def _rows(method: str, mode: str, em: list[float | None], lp: list[float], *, protocol: str = "query-agnostic",
          budget: str | None = "64/cell", task: str = "needle", kl: float = 0.1, bytes_live: int = 100,
          allocator: str | None = None, scorer: str | None = None) -> list[dict[str, Any]]:
    full = method == "full"
    scorer = scorer or (None if full else method.split("+")[0])
    alloc = allocator or (None if full else ("uniform" if mode == "uniform" or "+" not in method
                                             else method.split("+")[1]))
    out = []
    for i, (e, l) in enumerate(zip(em, lp)):
        out.append({c: None for c in RESULT_COLUMNS} | {
            "model": "m", "task": task, "context": 1024, "method": method, "mode": mode,
            "scorer": scorer, "allocator": alloc,
            "protocol": "none" if full else protocol, "budget": None if full else budget,
            "budget_unit": None if full else "tokens_per_cell", "budget_value": None if full else 64,
            "example": i, "exact_match": e, "answer_logprob": l, "kl": 0.0 if full else kl,
            "bytes_live": bytes_live, "bytes_live_peak": bytes_live, "bytes_full": 1000, "bytes_budget": 100,
            "ppl": float(np.exp(-l)),
        })
    return out


def _frame(*parts: list[dict[str, Any]]) -> pl.DataFrame:
    return pl.DataFrame([r for p in parts for r in p], schema=RESULT_COLUMNS)


def test_example_outcomes_exact_match_first_then_logprob_within_tolerance() -> None:
    em_a = np.array([1, 0, 1, 1, 0, np.nan, np.nan])
    em_b = np.array([0, 1, 1, 1, 0, np.nan, np.nan])
    lp_a = np.array([-9.0, 0.0, -1.0, -1.0, -2.0, -3.0, -3.0])
    lp_b = np.array([0.0, -9.0, -1.1, -1.3, -1.9, -3.2, -2.95])
    # em decides; equal em: |d| <= 0.1 ties (boundary included), else the higher wins; no em: log-prob only
    assert example_outcomes(em_a, em_b, lp_a, lp_b, 0.1).tolist() == [1, -1, 0, 1, 0, 1, 0]
    assert example_outcomes(em_a, em_b, lp_a, lp_b, 0.0).tolist() == [1, -1, 1, 1, -1, 1, -1]


def test_pairs_count_wins_ties_losses_per_example_and_state_the_rule() -> None:
    # A beats B on examples 0, 1 (exact match), ties on 2 (log-prob within 0.1), loses 3 (log-prob)
    res = _frame(_rows("snapkv", "physical", [1, 1, 0, 0], [-1, -1, -5.00, -6]),
                 _rows("h2o", "physical", [0, 0, 0, 0], [-2, -2, -5.05, -5]),
                 _rows("full", "full", [1, 1, 1, 0], [-0.5, -0.5, -1, -4]))
    pairs = compare(res, TieRule(tolerance=0.1))
    m = pairs.filter(pl.col("kind") == "method").row(0, named=True)
    assert (m["a_method"], m["b_method"], m["n"]) == ("snapkv", "h2o", 4)
    assert (m["wins"], m["ties"], m["losses"]) == (2, 1, 1)
    assert m["verdict"] == "win" and "0.1 nats" in m["rule"]
    assert m["d_em"] == pytest.approx(0.5) and m["em_a"] == 0.5 and m["em_b"] == 0.0
    assert m["d_logprob"] == pytest.approx(np.mean([1, 1, 0.05, -1]))
    assert m["full_em"] == pytest.approx(0.75) and m["regime"] == "open"
    # each arm against the full cache, on the same examples
    f = pairs.filter(pl.col("kind") == "full")
    assert set(f["a_method"]) == {"snapkv", "h2o"} and set(f["b_method"]) == {"full"}
    h2o = f.filter(pl.col("a_method") == "h2o").row(0, named=True)
    assert (h2o["wins"], h2o["ties"], h2o["losses"]) == (0, 0, 4) and h2o["verdict"] == "loss"


def test_examples_are_matched_by_index_not_row_order() -> None:
    a = _rows("snapkv", "physical", [1, 0, 0], [-1, -3, -3])
    b = _rows("h2o", "physical", [0, 0, 1], [-2, -3, -1])
    res = _frame(list(reversed(a)), b)
    m = compare(res, kinds=("method",)).row(0, named=True)
    assert (m["wins"], m["ties"], m["losses"]) == (1, 1, 1)


def test_mode_pairs_and_regimes() -> None:
    res = _frame(_rows("snapkv+adakv", "physical", [1, 1], [-1, -1], bytes_live=100),
                 _rows("snapkv+adakv", "masked", [1, 1], [-1, -1], bytes_live=1000),
                 _rows("snapkv+adakv", "uniform", [1, 1], [-1.5, -1.01], bytes_live=100))
    pairs = compare(res, kinds=("mode",))
    got = {(r["a_mode"], r["b_mode"]): r for r in pairs.to_dicts()}
    assert set(got) == {("physical", "uniform"), ("masked", "uniform"), ("physical", "masked")}
    pm = got[("physical", "masked")]
    assert (pm["wins"], pm["ties"], pm["losses"]) == (0, 2, 0) and pm["verdict"] == "tie"
    assert pm["bytes_live_a"] == 100 and pm["bytes_live_b"] == 1000
    mu = got[("masked", "uniform")]
    # both at the exact-match ceiling: the log-prob ranks them (one win, one tie)
    assert mu["regime"] == "ceiling" and (mu["wins"], mu["ties"], mu["losses"]) == (1, 1, 0)
    floor = compare(_frame(_rows("a", "physical", [0, 0], [-3, -3]), _rows("b", "physical", [0, 0], [-3, -4])),
                    kinds=("method",)).row(0, named=True)
    assert floor["regime"] == "floor" and floor["verdict"] == "win"


def test_bootstrap_rule_interval_containing_zero_is_a_tie() -> None:
    rule = TieRule(kind="bootstrap", n_boot=500)
    always = compare(_frame(_rows("a", "physical", [1] * 6, [-1] * 6), _rows("b", "physical", [0] * 6, [-1] * 6)),
                     rule, kinds=("method",)).row(0, named=True)
    assert always["verdict"] == "win" and always["d_em_lo"] == always["d_em_hi"] == 1.0
    mixed = compare(_frame(_rows("a", "physical", [1, 0, 1, 0, 1, 0], [-1] * 6),
                           _rows("b", "physical", [0, 1, 0, 1, 0, 1], [-1] * 6)), rule, kinds=("method",))
    m = mixed.row(0, named=True)
    assert m["verdict"] == "tie" and m["d_em_lo"] < 0 < m["d_em_hi"] and "bootstrap" in m["rule"]
    # exact match tied everywhere: the log-prob interval decides
    lp = compare(_frame(_rows("a", "physical", [0] * 5, [-1, -1.2, -0.9, -1.1, -1]),
                        _rows("b", "physical", [0] * 5, [-3, -3.1, -2.8, -3.3, -3])), rule, kinds=("method",))
    assert lp.row(0, named=True)["verdict"] == "win"
    # deterministic: same seed, same bits
    assert mixed.equals(compare(_frame(_rows("a", "physical", [1, 0, 1, 0, 1, 0], [-1] * 6),
                                       _rows("b", "physical", [0, 1, 0, 1, 0, 1], [-1] * 6)), rule, kinds=("method",)))


def test_tie_rule_is_validated() -> None:
    for kw, field in (({"kind": "coin"}, "tie_rule"), ({"tolerance": -1}, "tolerance"), ({"level": 1.0}, "level"),
                      ({"n_boot": 0}, "n_boot")):
        with pytest.raises(InputError) as e:
            TieRule(**kw)  # type: ignore[arg-type]
        assert e.value.field == field


def test_whole_example_bootstrap_resamples_whole_examples() -> None:
    x = np.array([1.0, 1.0, 1.0, 0.0])
    e = bootstrap_mean(x, clusters=Design.whole_clusters(["a", "a", "a", "b"]), seed=0, key="k", n_boot=400)
    assert e.value == 0.75
    # two clusters (means 1 and 0): a resample holds a, b or both, so the mean is 1, 0 or 0.75
    assert e.lo == 0.0 and e.hi == 1.0
    rule = TieRule(n_boot=300)
    assert all(np.isnan(paired_mean(np.array([]), rule, "k")))  # no data: (nan, nan, nan)
    assert paired_mean(x, rule, "k") == paired_mean(x, rule, "k")
    assert paired_mean(x, rule, "k")[0] == float(x.mean())  # the point estimate is the plain mean, to the bits


def test_wtl_table_is_pairs_by_task_and_budget() -> None:
    parts = []
    for task in ("needle", "multi_key"):
        for budget in ("32/cell", "64/cell"):
            parts += [_rows("snapkv", "physical", [1, 0], [-1, -2], task=task, budget=budget),
                      _rows("h2o", "physical", [0, 0], [-2, -2], task=task, budget=budget)]
    wide = wtl_table(compare(_frame(*parts), kinds=("method",)))
    assert wide.height == 1 and wide["pair"][0] == "snapkv [physical] vs h2o [physical]"
    assert [c for c in wide.columns if "@" in c] == ["needle @ 32/cell", "needle @ 64/cell", "multi_key @ 32/cell",
                                                     "multi_key @ 64/cell"]
    assert wide.columns[:5] == ["model", "context", "protocol", "prefill", "pair"] and wide["prefill"][0] == "chunked"
    assert set(wide.row(0)[5:]) == {"1/1/0"}


def test_enforcement_cost_points_and_bytes() -> None:
    res = _frame(_rows("snapkv+adakv", "masked", [1, 1, 1, 0], [-1] * 4, bytes_live=1000),
                 _rows("snapkv+adakv", "uniform", [0, 1, 0, 0], [-2] * 4, bytes_live=100),
                 _rows("snapkv+adakv", "physical", [1, 1, 1, 0], [-1] * 4, bytes_live=100),
                 _rows("snapkv", "masked", [1] * 4, [-1] * 4),  # uniform allocator: not a per-head selection
                 _rows("full", "full", [1, 1, 1, 1], [-0.5] * 4))
    claims, detail = enforcement_cost(res, n_boot=300)
    assert len(claims) == 1 and detail.height == 1
    d = detail.row(0, named=True)
    assert d["points_lost"] == pytest.approx(50.0) and d["physical_minus_masked"] == 0.0
    assert d["MiB_masked"] * 2**20 == pytest.approx(1000) and d["MiB_uniform"] * 2**20 == pytest.approx(100)
    assert d["full_em"] == 1.0
    c = claims[0]
    assert c.paper_value.startswith("14.1-62.2") and "+50.0" in c.our_value and "snapkv+adakv" in c.claim


def test_query_aware_margin_on_retrieval_tasks_only() -> None:
    res = _frame(_rows("snapkv", "physical", [1, 1, 0], [-1] * 3, protocol="query-aware"),
                 _rows("snapkv", "physical", [0, 0, 0], [-3] * 3, protocol="query-agnostic"),
                 _rows("snapkv", "physical", [1, 1, 1], [-1] * 3, protocol="query-aware", task="variable_tracking"),
                 _rows("snapkv", "physical", [0, 0, 0], [-1] * 3, protocol="query-agnostic", task="variable_tracking"),
                 _rows("streaming_llm", "physical", [1] * 3, [-1] * 3, protocol="query-aware"),
                 _rows("streaming_llm", "physical", [0] * 3, [-1] * 3, protocol="query-agnostic"),
                 _rows("full", "full", [1, 1, 1], [-0.5] * 3))
    claims, detail = query_aware_margin(res, n_boot=300)
    assert detail["task"].to_list() == ["needle"] and detail["method"].to_list() == ["snapkv"]
    assert detail["margin"][0] == pytest.approx(200 / 3)
    assert len(claims) == 1 and "87.6" in claims[0].paper_value


def test_versus_places_our_interval_against_the_paper() -> None:
    from evictlab.stats import claims

    assert versus is claims.versus  # one verdict function for the statistics and the evaluation claims
    assert versus(10, 20, 14.1, 62.2) == "overlaps paper"
    assert versus(0, 5, 14.1, 62.2) == "ours below paper"
    assert versus(70, 90, 14.1, 62.2) == "ours above paper"
    assert versus(0, 100, 14.1, 62.2) == "paper within ours"
    assert versus(1.0, 1.2, 1.07, 1.07) == "paper within ours"  # a single paper value inside our CI
    assert versus(1.07, 1.2, 1.07, 1.07) == "paper within ours"  # boundaries count as inside
    assert versus(float("nan"), 1, 1, 2) == "no data"
    assert {versus(*a) for a in ((10, 20, 14.1, 62.2), (0, 5, 14.1, 62.2), (70, 90, 14.1, 62.2), (0, 100, 14.1, 62.2),
                                 (float("nan"), 1, 1, 2))} == set(claims.VERDICTS)


def test_compare_refuses_a_table_that_is_not_grid_results() -> None:
    with pytest.raises(InputError) as e:
        compare(pl.DataFrame({"x": [1]}))
    assert e.value.field == "results"


# ----------------------------------------------------------------- several questions per context (issue 23, item 5)


def _qframe(arms: dict[tuple[str, str], list[list[float]]], *, budget: str = "64/cell", task: str = "needle",
            model: str = "m", protocol: str = "query-agnostic", prefill: str = "one-pass",
            lp: float = -1.0) -> pl.DataFrame:
    """Rows with the new columns: ``arms[(method, mode)][example][question]`` = exact match."""
    cols = {**RESULT_COLUMNS, "prefill": pl.Utf8, "question": pl.Int64, "questions": pl.Int64}
    rows = []
    for (method, mode), per_example in arms.items():
        full = method == "full"
        scorer, _, alloc = method.partition("+")
        for i, qs in enumerate(per_example):
            for q, e in enumerate(qs):
                rows.append({c: None for c in cols} | {
                    "model": model, "task": task, "context": 1024, "method": method, "mode": mode,
                    "scorer": None if full else scorer, "allocator": None if full else (alloc or "uniform"),
                    "protocol": "none" if full else protocol, "budget": None if full else budget,
                    "budget_unit": None if full else "tokens_per_cell", "budget_value": None if full else 64,
                    "prefill": prefill, "example": i, "question": q, "questions": len(qs), "exact_match": e,
                    "answer_logprob": lp, "kl": 0.0 if full else 0.1, "bytes_live": 100, "bytes_live_peak": 100,
                    "bytes_full": 1000, "bytes_budget": 100, "ppl": 1.0})
    return pl.DataFrame(rows, schema=cols)


def test_answers_pair_by_example_and_question_with_contexts_counted() -> None:
    res = _qframe({("snapkv", "physical"): [[1, 0, 1], [0, 0]], ("h2o", "physical"): [[0, 0, 1], [1, 0]],
                   ("full", "full"): [[1, 1, 1], [1, 0]]})
    shuffled = res.sample(fraction=1.0, shuffle=True, seed=3)  # pairing is by key, not by row order
    pairs = compare(shuffled)
    m = pairs.filter(pl.col("kind") == "method").row(0, named=True)
    # answers (0,0): win, (0,1): tie (equal em, equal log-prob), (0,2): tie, (1,0): loss, (1,1): tie
    assert (m["n"], m["contexts"], m["wins"], m["ties"], m["losses"]) == (5, 2, 1, 3, 1)
    assert m["prefill"] == "one-pass" and m["a_scorer"] == "snapkv" and m["b_allocator"] == "uniform"
    assert m["d_em"] == pytest.approx(0.0) and m["full_em"] == pytest.approx(0.8)
    f = pairs.filter((pl.col("kind") == "full") & (pl.col("a_method") == "snapkv")).row(0, named=True)
    assert (f["n"], f["contexts"], f["losses"]) == (5, 2, 2)
    # an arm listed twice under two prefills is two arms, never paired across prefills
    both = pl.concat([res, _qframe({("snapkv", "physical"): [[0, 0, 0], [0, 0]], ("h2o", "physical"):
                                    [[1, 1, 1], [1, 1]]}, prefill="chunked")])
    mp = compare(both, kinds=("method",))
    assert sorted(mp["prefill"].to_list()) == ["chunked", "one-pass"] and set(mp["n"]) == {5}


def test_old_frames_without_the_question_columns_read_as_one_question_chunked() -> None:
    nulls = _frame(_rows("snapkv", "physical", [1, 1, 0, 0], [-1, -1, -5.00, -6]),
                   _rows("h2o", "physical", [0, 0, 0, 0], [-2, -2, -5.05, -5]),
                   _rows("full", "full", [1, 1, 1, 0], [-0.5, -0.5, -1, -4]))
    old = nulls.drop("prefill", "question", "questions")  # a results.parquet of an earlier version
    new = old.with_columns(prefill=pl.lit("chunked"), question=pl.lit(0, pl.Int64), questions=pl.lit(1, pl.Int64))
    a, b = compare(old, TieRule(n_boot=200)), compare(new, TieRule(n_boot=200))
    assert a.equals(b) and set(a["contexts"]) == {4} and set(a["n"]) == {4}
    assert compare(nulls, TieRule(n_boot=200)).equals(a)  # the columns present but empty read the same
    got = with_question_columns(old)
    assert got["question"].to_list() == [0] * 12 and got["questions"].to_list() == [1] * 12
    assert with_question_columns(new) is new  # frames that have them are left alone


def test_context_cluster_bootstrap_equals_its_hand_computed_distribution() -> None:
    # context 0 asks two questions, both won (d = 1, 1); context 1 one question, tied (d = 0).
    # Drawing 2 contexts with replacement: {0, 0} -> mean 1 (p 1/4), {0, 1} -> 2/3 (p 1/2),
    # {1, 1} -> 0 (p 1/4). An answer bootstrap would also give 1/3 (two zeros... one zero drawn twice).
    from evictlab.stats.bootstrap import Mean, percentile_interval, resample_counts, rng_for

    d = np.array([1.0, 1.0, 0.0])
    examples = np.array([0, 0, 1])
    design = context_design(examples)
    reps = np.concatenate([Mean(d).replicates(c) for c in resample_counts(design, rng_for(0, "k"), 20000)])
    values, counts = np.unique(np.round(reps, 9), return_counts=True)
    assert values.tolist() == [0.0, round(2 / 3, 9), 1.0]
    assert counts / reps.size == pytest.approx([0.25, 0.5, 0.25], abs=0.015)
    # paired_mean with the examples is exactly that engine computation (same seed and key)
    rule = TieRule(n_boot=20000, level=0.9)
    v, lo, hi = paired_mean(d, rule, "k", examples)
    assert v == pytest.approx(2 / 3) and (lo, hi) == percentile_interval(reps, 0.9) == (0.0, 1.0)
    # and compare() uses it: a pair built from those answers has that interval
    res = _qframe({("a", "physical"): [[1, 1], [0]], ("b", "physical"): [[0, 0], [0]]}, lp=-1.0)
    row = compare(res, TieRule(n_boot=4000), kinds=("method",)).row(0, named=True)
    assert (row["n"], row["contexts"], row["d_em"]) == (3, 2, pytest.approx(2 / 3))
    assert (row["d_em_lo"], row["d_em_hi"]) == (0.0, 1.0)


def test_configuration_counts_by_hand_with_the_one_answer_tie_rule() -> None:
    # contourkv vs adakv under two scorers, three budgets: 6 configurations of 4 answers each
    # (2 contexts x 2 questions). Correct answers (contour, ada) per configuration:
    #   snapkv  64: (3, 0) win;  128: (2, 1) tie (one answer apart);  256: (0, 2) loss
    #   kvzip   64: (4, 4) tie;  128: (4, 2) win;                      256: (1, 1) tie
    spec = {("snapkv", "64/cell"): ([[1, 1], [1, 0]], [[0, 0], [0, 0]]),
            ("snapkv", "128/cell"): ([[1, 0], [1, 0]], [[0, 0], [0, 1]]),
            ("snapkv", "256/cell"): ([[0, 0], [0, 0]], [[1, 1], [0, 0]]),
            ("kvzip", "64/cell"): ([[1, 1], [1, 1]], [[1, 1], [1, 1]]),
            ("kvzip", "128/cell"): ([[1, 1], [1, 1]], [[1, 0], [0, 1]]),
            ("kvzip", "256/cell"): ([[0, 1], [0, 0]], [[0, 0], [1, 0]])}
    res = pl.concat([_qframe({(f"{s}+contourkv", "physical"): c, (f"{s}+adakv", "physical"): a}, budget=b)
                     for (s, b), (c, a) in spec.items()])
    every = compare(res, TieRule(n_boot=100), kinds=("method",))
    assert every.height == 18  # at each budget every pair of the 4 methods; the unit keeps the scorer fixed
    pairs = every.filter(pl.col("a_scorer") == pl.col("b_scorer"))
    assert pairs.height == 6 and set(pairs["n"]) == {4} and set(pairs["contexts"]) == {2}
    got = {(r["a_scorer"], r["budget"]): r["accuracy_verdict"] for r in pairs.to_dicts()}
    assert got == {("snapkv", "64/cell"): "win", ("snapkv", "128/cell"): "tie", ("snapkv", "256/cell"): "loss",
                   ("kvzip", "64/cell"): "tie", ("kvzip", "128/cell"): "win", ("kvzip", "256/cell"): "tie"}
    c = configurations(pairs)
    assert c.columns == list(CONFIG_COLUMNS) and c.height == 1
    r = c.row(0, named=True)
    assert (r["a"], r["b"], r["scorers"]) == ("+contourkv", "+adakv", "snapkv, kvzip")
    assert (r["configurations"], r["wins"], r["ties"], r["losses"], r["unscored"]) == (6, 2, 3, 1, 0)
    assert (r["answers"], r["contexts"]) == (24, 12)
    assert r["counts"] == "2 wins / 3 ties / 1 losses over 6 comparisons" and r["rule"] == CONFIG_RULE
    assert configuration_lines(c) == [
        "method: +contourkv [physical] vs +adakv [physical] (query-agnostic, prefill one-pass): 2 wins / 3 ties / "
        "1 losses over 6 comparisons"]
    per_scorer = configurations(pairs, pool_scorers=False)
    assert per_scorer["a"].to_list() == ["snapkv+contourkv", "kvzip+contourkv"]
    assert per_scorer.select("wins", "ties", "losses").rows() == [(1, 1, 1), (1, 2, 0)]


def test_accuracy_verdict_rule_and_unscored_configurations() -> None:
    assert [accuracy_verdict(a, b, 10) for a, b in ((5, 4), (5, 3), (3, 5), (4, 4))] == ["tie", "win", "loss", "tie"]
    assert accuracy_verdict(float("nan"), 1, 3) == "n/a" and accuracy_verdict(0, 0, 0) == "n/a"
    # heldout_ppl has no exact match: the configuration is not counted
    ppl = _qframe({("a", "physical"): [[None]], ("b", "physical"): [[None]]}, task="heldout_ppl")
    pairs = compare(ppl, TieRule(n_boot=50), kinds=("method",))
    assert pairs["accuracy_verdict"].to_list() == ["n/a"]
    r = configurations(pairs).row(0, named=True)
    assert (r["configurations"], r["unscored"], r["answers"]) == (0, 1, 0)
    assert configurations(pairs.clear()).columns == list(CONFIG_COLUMNS)
    # a mode pair (one method, two stores) reads the method's allocator on both sides
    modes = _qframe({("snapkv+adakv", "masked"): [[1, 1, 1]], ("snapkv+adakv", "uniform"): [[0, 0, 1]]})
    m = configurations(compare(modes, TieRule(n_boot=50), kinds=("mode",))).row(0, named=True)
    assert (m["a"], m["a_mode"], m["b"], m["b_mode"], m["wins"]) == ("+adakv", "masked", "+adakv", "uniform", 1)


def test_report_shows_the_configuration_counts() -> None:
    from evictlab.eval.report import evaluation_markdown

    res = pl.concat([_qframe({("snapkv+contourkv", "physical"): [[1, 1], [1, 0]],
                              ("snapkv+adakv", "physical"): [[0, 0], [0, 0]], ("full", "full"): [[1, 1], [1, 1]]})])
    pairs = compare(res, TieRule(n_boot=100))
    md = evaluation_markdown(res, pairs, rule=TieRule().describe(), n_boot=100)
    assert "## Configurations: the papers' unit" in md and CONFIG_RULE in md
    assert "1 wins / 0 ties / 0 losses over 1 comparisons" in md
    assert "whole contexts" in md


def test_claims_pair_answers_by_question() -> None:
    # two questions per context: joined on the example alone, each context would give 4 pairs
    res = _qframe({("snapkv", "physical"): [[1, 0], [1, 0]], ("full", "full"): [[1, 1], [1, 1]]},
                  protocol="query-aware")
    res = pl.concat([res, _qframe({("snapkv", "physical"): [[0, 1], [0, 0]]}, protocol="query-agnostic")])
    claims, detail = query_aware_margin(res, n_boot=200)
    d = detail.row(0, named=True)
    assert (d["n"], d["contexts"]) == (4, 2) and d["margin"] == pytest.approx(25.0)
    assert "4 paired answers (2 contexts)" in claims[0].rows
    from evictlab.eval.claims.contour import contour_outcomes

    c = pl.concat([_qframe({("snapkv+contourkv", "physical"): [[1, 0]], ("snapkv", "physical"): [[0, 1]]})])
    o = contour_outcomes(c).sort("question")
    assert o["outcome"].to_list() == [1, -1] and o["question"].to_list() == [0, 1]
    e = pl.concat([_qframe({("snapkv+adakv", "masked"): [[1, 1]], ("snapkv+adakv", "uniform"): [[1, 0]],
                            ("snapkv+adakv", "physical"): [[1, 1]]})])
    _, det = enforcement_cost(e, n_boot=100)
    r = det.row(0, named=True)
    assert (r["n"], r["contexts"], r["points_lost"], r["physical_minus_masked"]) == (2, 1, 50.0, 0.0)
