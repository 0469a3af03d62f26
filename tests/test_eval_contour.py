"""ContourKV against the allocators on hand-made result tables (no model): pairing, the
paper's rows, and the prompt-clustered intervals."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl
import pytest

from evictlab.eval.claims.contour import _counts, _share, contour_outcomes, contourkv_versus, share_design
from evictlab.eval.runner import RESULT_COLUMNS


def _rows(method: str, em: list[float], lp: list[float], *, budget: str = "128/cell", task: str = "needle",
          mode: str = "physical", model: str = "m", bytes_live: int = 100) -> list[dict[str, Any]]:
    full = method == "full"
    scorer, _, alloc = method.partition("+")
    out = []
    for i, (e, l) in enumerate(zip(em, lp)):
        out.append({c: None for c in RESULT_COLUMNS} | {
            "model": model, "task": task, "context": 1024, "method": method, "mode": "full" if full else mode,
            "scorer": None if full else scorer, "allocator": None if full else (alloc or "uniform"),
            "protocol": "none" if full else "query-agnostic", "budget": None if full else budget,
            "example": i, "exact_match": e, "answer_logprob": l, "bytes_live": bytes_live,
        })
    return out


def _frame(*parts: list[dict[str, Any]]) -> pl.DataFrame:
    return pl.DataFrame([r for p in parts for r in p], schema=RESULT_COLUMNS)


def test_outcomes_pair_contour_with_the_same_scorer_physical_from_contours_side() -> None:
    res = _frame(
        _rows("snapkv", [1, 0, 0], [-1, -2, -3]),                 # listed first: still arm B
        _rows("snapkv+contourkv", [0, 1, 0], [-1, -1, -3.05]),
        _rows("snapkv+adakv", [0, 0, 1], [-1, -1, -1]),
        _rows("kvzip", [1, 1, 1], [0, 0, 0]),                     # another scorer: never paired with snapkv's
        _rows("snapkv+adakv", [0, 0, 1], [-1, -1, -1], mode="masked", bytes_live=1000),
        _rows("full", [1, 1, 1], [0, 0, 0]),
    )
    o = contour_outcomes(res)
    assert set(o["baseline"]) == {"snapkv", "snapkv+adakv"} and set(o["method"]) == {"snapkv+contourkv"}
    vs_uniform = o.filter(pl.col("baseline") == "snapkv").sort("example")
    assert vs_uniform["outcome"].to_list() == [-1, 1, 0]        # em, em, log-prob within 0.1
    vs_ada = o.filter(pl.col("baseline") == "snapkv+adakv").sort("example")
    assert vs_ada["outcome"].to_list() == [0, 1, -1]
    assert vs_ada["baseline_masked_bytes"].to_list() == [1000] * 3  # the masked audit's bytes, beside
    assert (o["bytes_live"] == o["bytes_live_b"]).all()


def test_counts_and_the_paper_rows() -> None:
    res = _frame(
        # KVzip: contour wins at 64, ties at 128, loses at 256
        *[_rows("kvzip+contourkv", em, [-1] * 3, budget=b) for b, em in
          (("64/cell", [1, 1, 0]), ("128/cell", [1, 0, 0]), ("256/cell", [0, 0, 0]))],
        *[_rows("kvzip+adakv", em, [-1] * 3, budget=b) for b, em in
          (("64/cell", [0, 0, 0]), ("128/cell", [0, 1, 0]), ("256/cell", [1, 0, 0]))],
        # KVzip as kvpress runs it (one ranking over all layers and heads): contour wins at 64 and 128, ties at 256
        *[_rows("kvzip+global", em, [-1] * 3, budget=b) for b, em in
          (("64/cell", [0, 0, 0]), ("128/cell", [0, 0, 0]), ("256/cell", [0, 0, 0]))],
        # SnapKV at 128 on needle: contour wins 2 of 4 examples, loses 1
        _rows("snapkv+contourkv", [1, 1, 0, 0], [-1, -1, -1, -1]),
        _rows("snapkv", [0, 0, 1, 0], [-1, -1, -1, -1.05]),
        # Compactor: all ties
        _rows("compactor+contourkv", [1, 0], [-1, -2]), _rows("compactor", [1, 0], [-1, -2]),
        _rows("full", [1, 1, 1, 1], [0, 0, 0, 0]),
    )
    claims, detail = contourkv_versus(res, n_boot=200)
    by = {c.claim_id: c for c in claims}
    kv = by["contourkv:vs_kvzip"]  # the paper's row: KVzip = kvzip+global (kvpress's KVzipPress)
    assert "kvzip+contourkv vs kvzip+global: 2 wins / 1 ties / 0 losses over 3 comparisons" in kv.our_value
    assert "93 wins" in kv.paper_value and "layerwise=False" in kv.definitions
    ka = by["contourkv:vs_kvzip_adakv"]  # the same scores with AdaKV sizes
    assert "kvzip+contourkv vs kvzip+adakv: 1 wins / 1 ties / 1 losses over 3 comparisons" in ka.our_value
    assert "93 wins" in ka.paper_value
    sn = by["contourkv:vs_snapkv_retrieval_128"]
    assert "win rate 0.50-0.50 vs 0.25-0.25" in sn.our_value and "0.37-1.00" in sn.paper_value
    cp = by["contourkv:ties_compactor"]
    assert "0 wins / 1 ties / 0 losses over 1 comparison;" in cp.our_value and "share tied 1.00 [1.00, 1.00]" in cp.our_value
    assert "contourkv:contourkv_vs_adakv" in by and "contourkv:contourkv_vs_uniform" in by
    assert detail.height == 8 and set(detail["verdict"]) == {"win", "tie", "loss"}
    kz = detail.filter(pl.col("scorer") == "kvzip")
    assert kz.filter(pl.col("baseline") == "kvzip+adakv").sort("budget")["verdict"].to_list() == ["tie", "loss", "win"]  # 128, 256, 64
    assert kz.filter(pl.col("baseline") == "kvzip+global").sort("budget")["verdict"].to_list() == ["win", "tie", "win"]
    assert (detail["full_em"] == 1.0).all()


def test_missing_arms_say_not_run() -> None:
    res = _frame(_rows("snapkv+contourkv", [1], [-1], budget="64/cell"), _rows("snapkv", [0], [-1], budget="64/cell"))
    by = {c.claim_id: c for c in contourkv_versus(res, n_boot=50)[0]}
    assert by["contourkv:vs_kvzip"].our_value == "not run" and by["contourkv:ties_compactor"].verdict == "no data"
    assert by["contourkv:vs_kvzip_adakv"].our_value == "not run"
    assert by["contourkv:vs_snapkv_retrieval_128"].our_value == "not run"  # 64/cell only
    assert contourkv_versus(_frame(_rows("snapkv", [1], [-1])))[0] == []


def _boot_counts(o, seed: int, key: str, n_boot: int) -> np.ndarray:
    """(wins, ties, losses) over comparisons on each replicate of the shares' design, from the
    engine's SignShare statistics (shares times the number of comparisons)."""
    from evictlab.stats.bootstrap import SignShare, resample_counts, rng_for

    design, outcome, comparison = share_design(o)
    counts = np.concatenate(list(resample_counts(design, rng_for(seed, key), n_boot)))
    n_cmp = len(set(comparison.tolist()))
    return np.stack([np.rint(SignShare(outcome, comparison, sign).replicates(counts) * n_cmp) for sign in (1, 0, -1)],
                    axis=1).astype(np.int64), counts


def test_bootstrap_resamples_prompts_with_all_their_budgets() -> None:
    # example 0 wins at both budgets, example 1 loses at both: on every resample the two
    # comparisons move together (same draw of prompts), so (2,0,0), (0,2,0) or (0,0,2)
    res = _frame(*[_rows("snapkv+contourkv", [1, 0], [-1, -1], budget=b) for b in ("64/cell", "128/cell")],
                 *[_rows("snapkv", [0, 1], [-1, -1], budget=b) for b in ("64/cell", "128/cell")])
    o = contour_outcomes(res)
    assert _counts(o).tolist() == [0, 2, 0]
    boot, _ = _boot_counts(o, 0, "t", 500)
    assert {tuple(r) for r in boot.tolist()} == {(2, 0, 0), (0, 2, 0), (0, 0, 2)}
    assert (boot.sum(1) == 2).all()


@pytest.mark.parametrize("seed", range(3))
def test_bootstrap_counts_match_a_direct_resample(seed: int) -> None:
    rng = np.random.default_rng(seed)
    parts = []
    for b in ("32/cell", "64/cell", "128/cell"):
        parts += [_rows("snapkv+contourkv", rng.integers(0, 2, 5).tolist(), [-1] * 5, budget=b),
                  _rows("snapkv", rng.integers(0, 2, 5).tolist(), [-1] * 5, budget=b)]
    o = contour_outcomes(_frame(*parts))
    boot, counts = _boot_counts(o, seed, "k", 300)
    # the same draws, applied row by row: each example's multiplicity, recount each comparison
    rows = o.to_dicts()
    for c, got in zip(counts, boot):
        mult = {r["example"]: int(m) for r, m in zip(rows, c)}
        assert all(int(m) == mult[r["example"]] for r, m in zip(rows, c))  # an example moves with all its rows
        assert sum(mult.values()) == 5  # the group's examples, drawn as many as there are
        sums = [sum(r["outcome"] * m for r, m in zip(rows, c) if r["budget"] == b)
                for b in ("32/cell", "64/cell", "128/cell")]
        assert got.tolist() == [sum(s > 0 for s in sums), sum(s == 0 for s in sums), sum(s < 0 for s in sums)]


def test_the_share_interval_is_the_engines_percentile_interval() -> None:
    from evictlab.stats.bootstrap import percentile_interval

    rng = np.random.default_rng(5)
    parts = [_rows("snapkv+contourkv", rng.integers(0, 2, 6).tolist(), [-1] * 6, budget=b) for b in ("32/cell", "64/cell")]
    parts += [_rows("snapkv", rng.integers(0, 2, 6).tolist(), [-1] * 6, budget=b) for b in ("32/cell", "64/cell")]
    o = contour_outcomes(_frame(*parts))
    e = _share(o, 0, 3, "k", 400)
    boot, _ = _boot_counts(o, 3, "k", 400)
    assert e.value == _counts(o)[0] / 2
    assert (e.lo, e.hi) == percentile_interval(boot[:, 0] / 2, 0.95)


def test_clear_verdicts_are_the_resampling_stability_of_each_comparison() -> None:
    """A comparison won on all 8 examples is a clear win; one won by a single example of 8
    (the rest tied) is a win that most prompt resamples undo: undecided, with p_win the share
    of resamples that draw the won example (1 - (7/8)^8 = 0.66)."""
    res = _frame(_rows("snapkv+contourkv", [1] * 8, [-1] * 8, budget="64/cell"),
                 _rows("snapkv", [0] * 8, [-1] * 8, budget="64/cell"),
                 _rows("snapkv+contourkv", [1] + [0] * 7, [-1] * 8, budget="128/cell"),
                 _rows("snapkv", [0] * 8, [-1] * 8, budget="128/cell"))
    claims, detail = contourkv_versus(res, n_boot=4000)
    d = {r["budget"]: r for r in detail.iter_rows(named=True)}
    assert d["64/cell"]["verdict"] == "win" and d["64/cell"]["clear"] == "win" and d["64/cell"]["p_win"] == 1.0
    assert d["128/cell"]["verdict"] == "win" and d["128/cell"]["clear"] == "undecided"
    assert d["128/cell"]["p_win"] == pytest.approx(1 - (7 / 8) ** 8, abs=0.03) and d["128/cell"]["p_loss"] == 0.0
    row = {c.claim_id: c for c in claims}["contourkv:contourkv_vs_uniform"]
    assert "2 wins / 0 ties / 0 losses" in row.our_value and "1 won / 0 lost, 1 undecided" in row.our_value


def test_the_glance_splits_by_model_show_a_model_the_pooled_row_hides() -> None:
    """One model wins every answer, the other loses more: pooled the variant loses, split by
    model (and model x scorer) each model's own difference shows, counted on its rows only."""
    from evictlab.eval.claims.contour import contour_summary

    res = _frame(_rows("kvzip+contourkv_error", [1] * 4 + [0] * 4, [-1] * 8, model="a"),
                 _rows("kvzip", [0] * 4 + [0] * 4, [-1] * 8, model="a"),
                 _rows("kvzip+contourkv_error", [0] * 8, [-1] * 8, model="b"),
                 _rows("kvzip", [1] * 8, [-1] * 8, model="b"))
    by = {r["split"]: r for r in contour_summary(res, n_boot=300).iter_rows(named=True)}
    assert by["all"]["d_em"] == pytest.approx(-25.0) and by["all"]["answers"] == 16
    assert by["model=a"]["d_em"] == 50.0 and by["model=a"]["wins"] == 1 and by["model=a"]["answers"] == 8
    assert by["model=b"]["d_em"] == -100.0 and by["model=b"]["losses"] == 1
    assert by["model=a,scorer=kvzip"]["d_em"] == 50.0 and "model=a,scorer=snapkv" not in by
    assert by["model=a"]["d_em_lo"] <= 50.0 <= by["model=a"]["d_em_hi"]


def test_the_glance_table_pools_and_splits_by_scorer() -> None:
    from evictlab.eval.claims.contour import contour_summary
    from evictlab.eval.report import glance_table

    res = _frame(_rows("snapkv+contourkv", [1] * 8, [-1] * 8, budget="64/cell"),
                 _rows("snapkv", [0] * 8, [-1] * 8, budget="64/cell"),
                 _rows("kvzip+contourkv", [0] * 8, [-1] * 8, budget="64/cell"),
                 _rows("kvzip", [1, 1] + [0] * 6, [-1] * 8, budget="64/cell"))
    s = contour_summary(res, n_boot=500)
    by = {r["split"]: r for r in s.iter_rows(named=True)}
    assert set(by) == {"all", "scorer=snapkv", "scorer=kvzip", "model=m", "model=m,scorer=snapkv",
                       "model=m,scorer=kvzip"} and (s["baseline"] == "uniform").all()
    assert by["model=m,scorer=kvzip"]["d_em"] == by["scorer=kvzip"]["d_em"]
    assert (by["all"]["wins"], by["all"]["losses"], by["all"]["comparisons"]) == (1, 1, 2)
    assert by["scorer=snapkv"]["d_em"] == 100.0 and by["scorer=snapkv"]["clear_wins"] == 1
    assert by["scorer=kvzip"]["d_em"] == -25.0 and by["scorer=kvzip"]["losses"] == 1
    assert by["all"]["d_em"] == pytest.approx(37.5) and by["all"]["answers"] == 16
    assert by["scorer=kvzip"]["d_em_lo"] <= -25.0 <= by["scorer=kvzip"]["d_em_hi"] <= 0.0
    shown = glance_table(s).row(0, named=True)
    assert shown["W / T / L"] == "1 / 0 / 1" and shown["EM diff (points)"].startswith("+37.5 [")
    # the pooled row is the claim row's share, the same resamples: one interval for one number
    rng = np.random.default_rng(11)
    parts = [_rows(m, rng.integers(0, 2, 10).tolist(), [-1] * 10, budget=f"{b}/cell")
             for b in range(8, 88, 8) for m in ("snapkv+contourkv", "snapkv")]  # 10 comparisons
    res = _frame(*parts)
    pooled = glance_table(contour_summary(res, n_boot=300)).row(0, named=True)
    claim = {c.claim_id: c for c in contourkv_versus(res, n_boot=300)[0]}["contourkv:contourkv_vs_uniform"]
    assert pooled["split"] == "all" and f"share won {pooled['share won']};" in claim.our_value


def test_verdict_lines_apply_the_stated_rule(tmp_path) -> None:
    from evictlab.eval.claims.contour import BEATS_RULE, shipped_summary, verdict_lines
    from evictlab.io import write_checked_parquet

    def row(variant: str, base: str, cw: int, cl: int, lo: float, hi: float, split: str = "all") -> dict:
        return {"variant": variant, "baseline": base, "split": split, "comparisons": 10, "wins": cw, "ties": 0,
                "losses": 10 - cw, "share_won": cw / 10, "share_lo": 0.0, "share_hi": 1.0, "clear_wins": cw,
                "clear_losses": cl, "d_em": (lo + hi) / 2, "d_em_lo": lo, "d_em_hi": hi, "d_logprob": 0.0,
                "answers": 500}

    s = pl.DataFrame([row("contourkv", "uniform", 6, 2, -1.0, 3.0), row("contourkv", "adakv", 5, 1, 0.5, 2.0),
                      row("contourkv_mass", "uniform", 6, 1, -9.0, -2.0),   # more clear wins, but fewer answers
                      row("contourkv_mass", "adakv", 1, 5, -5.0, 1.0),
                      row("contourkv_mass", "uniform", 9, 0, 1.0, 2.0, split="scorer=snapkv")])  # splits don't count
    lines = verdict_lines(s)
    assert lines[0] == f"Variants that beat uniform and adakv: contourkv. Rule: {BEATS_RULE}."
    assert lines[2].startswith("`contourkv_mass`: vs uniform 6/0/4 (clear 6/1), exact match -5.5 [-9.0, -2.0] points")
    assert verdict_lines(s.filter(pl.col("variant") != "contourkv"))[0].startswith("No ContourKV variant beats both")
    # within each model: the rule on that model's rows only (here the pooled loser wins on model a)
    per_model = pl.concat([s, pl.DataFrame([row("contourkv_mass", "uniform", 7, 1, 1.0, 3.0, split="model=a"),
                                            row("contourkv_mass", "adakv", 4, 2, -0.5, 2.0, split="model=a"),
                                            row("contourkv", "uniform", 2, 5, -3.0, -1.0, split="model=a"),
                                            row("contourkv", "adakv", 6, 1, 1.0, 2.0, split="model=a"),
                                            row("contourkv", "uniform", 2, 5, -3.0, 1.0, split="model=b"),
                                            row("contourkv", "adakv", 6, 1, 1.0, 2.0, split="model=b"),
                                            row("contourkv", "uniform", 9, 0, 1.0, 3.0,
                                                split="model=b,scorer=kvzip")])])
    lines = verdict_lines(per_model)
    assert lines[1] == ("The same rule within each model (a choice made on this grid, not confirmed on held-out "
                        "cells): a: `contourkv_mass`; b: none.")
    assert lines[2].startswith("`contourkv`: vs uniform 6/0/4") and len(lines) == 4
    assert shipped_summary(tmp_path) is None
    write_checked_parquet(s, tmp_path / "pairs_contour.parquet")
    assert shipped_summary(tmp_path).equals(s)


def test_traced_grid_writes_the_per_compression_diagnostics(tmp_path) -> None:
    """``trace=True``: every evicting cell's compressions, labelled by cell, example and
    question, in parts/<unit key>.trace.parquet (one-pass: a context unit's cells) and
    trace.parquet; the cell keys of untraced grids are unchanged."""
    import torch

    from evictlab.capture.testing import save_tiny_folder
    from evictlab.eval.grid import TRACE, run_grid, trace_path
    from evictlab.eval.spec import GridSpec, LoopSettings

    torch.set_num_threads(1)
    model = tmp_path / "llama"
    save_tiny_folder(model, "llama")
    # small pools (12 kept of a short window) keep the trace's ES_hat enumeration cheap
    kw = dict(models=[str(model)], tasks=["needle"], contexts=[128], methods=["snapkv+contourkv", "snapkv"],
              budgets=["12"], n=2, seed=1, loop=LoopSettings(chunk_size=64, recent=4, window=8))
    plain, traced = GridSpec.build(**kw), GridSpec.build(**kw, trace=True)
    assert "trace" not in plain.to_dict() and all("trace" not in c.to_dict() for c in plain.cells())
    assert [c.key for c in plain.cells()][0] == [c.key for c in traced.cells()][0]  # the full cell: no trace
    run_grid(traced, tmp_path / "g")
    t = pl.read_parquet(tmp_path / "g" / TRACE)
    cells = [c for c in traced.cells() if not c.is_full]
    assert set(t["cell"]) == {c.key for c in cells} and set(t["example"]) == {0, 1}
    for u in traced.units():
        assert pl.read_parquet(trace_path(tmp_path / "g", u)).equals(
            t.filter(pl.col("example") == u.example))  # the unit's part: its example's compressions
    for c in cells:
        part = t.filter(pl.col("cell") == c.key)
        assert part.height and (part["kept"] <= part["held"]).all()
        # the context's compression is shared by the questions (question null), the rest are each question's
        assert part.filter(pl.col("compression") == 0)["question"].null_count() == part.filter(
            pl.col("compression") == 0).height
        # after each compression the cells hold the budget in total (12 per cell on average)
        per = part.group_by(["example", "question", "compression"]).agg(pl.col("kept").sum())
        assert (per["kept"] == 12 * part.select("layer", "kv_head").unique().height).all()
        assert part["es_hat"].drop_nulls().len() > 0  # the selection ceiling was measured
    res = pl.read_parquet(tmp_path / "g" / "results.parquet")
    assert res.filter(pl.col("method") != "full")["compressions"].min() >= 1


def test_claim_script_runs_model_grids_and_publishes_rows(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """paper_repro/claim_contourkv.py on the tiny model: one grid per model plus its masked
    grid, ContourKV's rows in claims.json (replaced, not duplicated, on a rerun)."""
    import importlib
    import json
    from pathlib import Path

    import torch

    from evictlab.capture.testing import save_tiny_folder

    torch.set_num_threads(1)
    model = tmp_path / "llama"
    save_tiny_folder(model, "llama")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "paper_repro"))
    script = importlib.import_module("claim_contourkv")
    argv = ["--models", str(model), "--tasks", "needle", "--contexts", "160", "--budget", "24", "--n", "2",
            "--methods", "snapkv+contourkv,snapkv,snapkv+adakv", "--masked-methods", "snapkv+adakv",
            "--chunk", "64", "--n-boot", "50", "--grid", str(tmp_path / "g"), "--out", str(tmp_path / "out"),
            "--figures", str(tmp_path / "figs")]
    assert script.main(argv) == 0
    assert (tmp_path / "g" / "llama" / "results.parquet").is_file()
    assert (tmp_path / "g" / "llama-masked" / "results.parquet").is_file()
    rows = json.loads((tmp_path / "out" / "claims.json").read_text())
    ids = {r["claim_id"] for r in rows}
    assert {"contourkv:contourkv_vs_uniform", "contourkv:contourkv_vs_adakv", "contourkv:vs_kvzip"} <= ids
    detail = (tmp_path / "out" / "contourkv_detail.md").read_text()
    assert "snapkv+adakv" in detail and "MiB_baseline_masked" in detail
    assert (tmp_path / "figs" / "contourkv_accuracy_vs_bytes.png").is_file()
    assert script.main(argv) == 0
    assert len(json.loads((tmp_path / "out" / "claims.json").read_text())) == len(rows)


def test_the_main_jobs_verdict_paragraph_reads_the_committed_grid() -> None:
    """``data/grids/contourkv/`` is committed: the main job's ContourKV section ends with its
    verdict (pooled, then per model), not with "not committed"."""
    from evictlab.eval.claims.contour import VERDICT_DIR
    from evictlab.pipeline.report import _contour_verdict

    assert (VERDICT_DIR / "pairs_contour.parquet").is_file()
    text = "".join(_contour_verdict())
    assert "What the ContourKV grids found" in text and "not committed" not in text
    first = text.split("**`data/grids/contourkv_scorers/`**")[0]
    assert "**`data/grids/contourkv/`**" in first and "No ContourKV variant beats both uniform and adakv" in first
    assert "within each model" in text and "smollm2-135m: " in text and "gemma3-270m: " in text


def test_the_main_jobs_verdict_quotes_every_committed_grid_in_order(tmp_path) -> None:
    """One paragraph per committed grid of SHIPPED_GRIDS, in their order, each with its own
    verdict; grids not committed are left out; none committed says so."""
    import shutil

    from evictlab.eval.claims.contour import GRIDS_DIR, SHIPPED_GRIDS
    from evictlab.pipeline.report import _contour_verdict

    assert "not committed" in "".join(_contour_verdict(tmp_path))
    src = GRIDS_DIR / "contourkv" / "pairs_contour.parquet"
    names = [n for n, _ in SHIPPED_GRIDS]
    for name in (names[-1], names[0]):
        (tmp_path / name).mkdir()
        shutil.copy(src, tmp_path / name / "pairs_contour.parquet")
    text = "".join(_contour_verdict(tmp_path))
    assert text.index(f"`data/grids/{names[0]}/`") < text.index(f"`data/grids/{names[-1]}/`")
    assert f"`data/grids/{names[1]}/`" not in text and text.count("No ContourKV variant beats both") == 2


def test_the_verdict_forest_draws_pooled_model_and_model_scorer_panels(tmp_path) -> None:
    from evictlab.eval.claims.contour import contour_summary
    from evictlab.errors import InputError
    from evictlab.plots.contour import verdict_forest

    res = _frame(_rows("kvzip+contourkv_error", [1] * 4 + [0] * 4, [-1] * 8, model="a"),
                 _rows("kvzip", [0] * 8, [-1] * 8, model="a"),
                 _rows("kvzip+contourkv_error", [0] * 8, [-1] * 8, model="b"),
                 _rows("kvzip", [1] * 8, [-1] * 8, model="b"))
    s = contour_summary(res, n_boot=200)
    fig = verdict_forest(s, tmp_path / "forest")
    assert fig.png.stat().st_size > 3000 and fig.pdf.exists() and "per model x scorer" in fig.caption
    with pytest.raises(InputError, match="no ContourKV comparison against 'adakv'"):
        verdict_forest(s, tmp_path / "none", baseline="adakv")


def test_compare_writes_the_glance_and_its_forest(tmp_path) -> None:
    """``eval compare`` on a grid with ContourKV and uniform arms writes pairs_contour.parquet
    and draws the verdict forest (pairs_contour.png), listed in the report's figures."""
    from evictlab.eval.commands import write_comparison
    from evictlab.eval.compare import TieRule

    res = _frame(_rows("snapkv+contourkv", [1] * 6 + [0] * 2, [-1] * 8), _rows("snapkv", [0] * 8, [-1] * 8),
                 _rows("full", [1] * 8, [0] * 8))
    written, _ = write_comparison(res, tmp_path / "pairs.parquet", TieRule(n_boot=200), {"spec": {}})
    names = {p.name for p in written}
    assert {"pairs_contour.parquet", "pairs_contour.png", "pairs_contour.pdf"} <= names
    assert "pairs_contour.png" in (tmp_path / "pairs.md").read_text()


def test_across_grids_names_only_variants_that_win_every_grid_that_ran_them() -> None:
    """A variant that wins one grid and loses another is no winner across grids; one grid alone
    names its winners; the main job's verdict ends with the sentence over every committed grid."""
    from evictlab.eval.claims.contour import GRIDS_DIR, SHIPPED_GRIDS, across_grids_line, shipped_summary
    from evictlab.pipeline.report import _contour_verdict

    grids = {n: shipped_summary(GRIDS_DIR / n) for n in ("contourkv", "contourkv_scorers", "contourkv_relerror")}
    assert all(s is not None for s in grids.values())
    one = across_grids_line([("contourkv_scorers", grids["contourkv_scorers"])])
    assert "`contourkv` (1 of 1 grids that ran it)" in one and "`contourkv_relerror` (1 of 1" in one
    both = across_grids_line([("contourkv_scorers", grids["contourkv_scorers"]),
                              ("contourkv_relerror", grids["contourkv_relerror"])])
    # contourkv ran only in the held-out grid (and won it); contourkv_relerror won one of two
    assert "`contourkv` (1 of 1" in both and "`contourkv_relerror` (1 of 2)" in both
    every = across_grids_line(list(grids.items()))
    assert every.startswith("Across the 3 grids: no ContourKV variant beats uniform and adakv")
    assert "`contourkv` (1 of 2)" in every and "scorer-ranked level" in every
    shipped = across_grids_line([(n, shipped_summary(GRIDS_DIR / n)) for n, _ in SHIPPED_GRIDS])
    # every grid the report names is committed, and the closing line counts them all
    assert all((GRIDS_DIR / n / "pairs_contour.parquet").is_file() for n, _ in SHIPPED_GRIDS)
    assert shipped.startswith(f"Across the {len(SHIPPED_GRIDS)} grids: no ContourKV variant beats")
    assert f"**All together.** {shipped}" in "".join(_contour_verdict())
