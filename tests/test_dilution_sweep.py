"""The distractor sweep: labelled examples, the ORACLE that evicts distractors only, the sweep on
a tiny model (against an independent attention recomputation; resume; refusals) and on the
real default model at a short context."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from cli_helpers import run_cli
from evictlab.capture.testing import ByteTokenizer, tiny_model
from evictlab.dilution import sweep as sweep_mod
from evictlab.dilution.sweep import RESULT_COLUMNS, SweepConfig, run_sweep, verdicts
from evictlab.tasks.distractors import MAX_DISTRACTORS, make_example
from evictlab.errors import InputError
from evictlab.methods import make_scorer
from evictlab.methods.base import ScoreInputs, select_keep
from evictlab.methods.oracle_labels import parse_spans

TOK = ByteTokenizer()


# ----------------------------------------------------------------------------- examples


def test_examples_are_labelled_and_paired_across_k() -> None:
    exs = {k: make_example(TOK, 3, k, filler=96, seed=1) for k in (0, 4, 16)}
    keys = set()
    for k, ex in exs.items():
        text = TOK.decode(ex.context_ids[ex.useful[0]:ex.useful[1]]).strip()
        assert text == f"One of the special magic numbers for {ex.key} is: {ex.value}."
        assert TOK.decode(ex.answer_ids).strip() == ex.value
        assert ex.value not in TOK.decode(ex.question_ids) and ex.key in TOK.decode(ex.question_ids)
        near = [f for f in ex.facts if not f["asked"]]
        assert len(near) == k and len([f for f in ex.facts if f["asked"]]) == 1
        vals = [TOK.decode(ex.context_ids[f["value_start"]:f["value_end"]]) for f in near]
        assert len(set(vals)) == k and ex.value not in vals  # other keys, other values
        ks = [TOK.decode(ex.context_ids[f["key_start"]:f["key_end"]]) for f in near]
        assert ex.key not in ks
        assert keys <= set(ks) or not keys  # the distractors at k are among those at a larger k
        keys = set(ks)
    assert len({(e.key, e.value) for e in exs.values()}) == 1  # the same asked needle for every k
    assert len(exs[16].context_ids) > len(exs[4].context_ids) > len(exs[0].context_ids)


def test_filler_kind_has_the_same_length_and_no_near_miss() -> None:
    near = make_example(TOK, 0, 16, filler=96, kind="near_miss")
    fill = make_example(TOK, 0, 16, filler=96, kind="filler")
    assert len(fill.facts) == 1 and (fill.key, fill.value) == (near.key, near.value)
    assert abs(len(fill.context_ids) - len(near.context_ids)) <= 0.05 * len(near.context_ids)


def test_example_refusals() -> None:
    with pytest.raises(InputError, match="--distractors"):
        make_example(TOK, 0, MAX_DISTRACTORS + 1)
    with pytest.raises(InputError, match="--kind"):
        make_example(TOK, 0, 1, kind="random")
    with pytest.raises(InputError, match="--context"):
        make_example(TOK, 0, 1, filler=10)
    with pytest.raises(InputError, match="--context: 64 filler tokens are fewer than one passage"):
        make_example(TOK, 0, 0, filler=64)  # byte tokens: one filler passage is ~90 tokens


# ----------------------------------------------------------------------------- ORACLE


def test_oracle_labels_keeps_sinks_useful_and_recent_only() -> None:
    n, s = 60, 20
    sc = make_scorer("oracle_labels", useful="10:14,30:33")
    pos = torch.arange(n)
    inp = ScoreInputs(layer=0, n_layers=1, keys=torch.zeros(1, 2, n, 4), values=torch.zeros(1, 2, n, 4),
                      positions=pos, queries=torch.zeros(1, 2, 0, 4), q_positions=torch.zeros(0, dtype=torch.long),
                      scaling=1.0, state={})
    scores = sc.score(inp)
    assert scores.shape == (1, 2, n)
    keep = select_keep(scores, [s, s], pos, sinks=2, recent=4)[0]
    for h in range(2):
        got = set(keep[h].tolist())
        useful = set(range(10, 14)) | set(range(30, 33))
        assert useful <= got and {0, 1} <= got and set(range(n - 4, n)) <= got
        rest = got - useful - {0, 1}
        assert sorted(rest) == list(range(n - len(rest), n))  # the newest, nothing else


@pytest.mark.parametrize("bad", ["", "10", "10:5", "a:b", "1:2;3:4"])
def test_oracle_labels_refuses_bad_spans(bad: str) -> None:
    with pytest.raises(InputError, match="useful"):
        parse_spans(bad)


# ----------------------------------------------------------------------------- tiny sweep

CFG = SweepConfig(model="tiny-llama", distractors=(0, 3), n=2, methods=("full", "oracle_labels", "streaming_llm",
                  "snapkv"), budget="96", context=160, sinks=2, recent=4, chunk=64, window=4, compress_every=8)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=7)[0]


@pytest.fixture(scope="module")
def swept(llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "s"
    run_sweep(CFG, out, progress=False, model=llama, tokenizer=TOK)
    return out


def _attention_on_span(model, ids: list[int], span: tuple[int, int], layers=None) -> float:
    """Mean over layers and query heads of the last token's attention on ``span``, from the
    stock eager forward (output_attentions): independent of the sweep's capture hooks."""
    with torch.no_grad():
        att = model(torch.tensor([ids]), output_attentions=True).attentions
    return float(np.mean([a[0, :, -1, span[0]:span[1]].double().sum(-1).numpy() for i, a in enumerate(att)
                          if layers is None or i in layers]))


def test_useful_mass_of_chosen_layers(llama) -> None:
    ex = make_example(TOK, 1, 2, filler=CFG.context, seed=4)
    ids = ex.context_ids + ex.question_ids
    for layers in ([1], [0, 1]):
        ref = sweep_mod.reference(llama, TOK, ex, CFG, layers)
        assert ref.layers == layers and len(ref.rows) == len(layers)
        mass, _, kept = sweep_mod.useful_mass(ref, ex, None)
        assert mass == pytest.approx(_attention_on_span(llama, ids, ex.useful, layers), rel=1e-4) and kept == 1


def test_sweep_results(swept: Path, llama) -> None:
    res = pl.read_parquet(swept / "results.parquet")
    assert res.height == 2 * 2 * 4 and res.schema == pl.Schema(RESULT_COLUMNS)
    full = res.filter(pl.col("method") == "full").sort("distractors", "example")
    for row in full.iter_rows(named=True):
        ex = make_example(TOK, row["example"], row["distractors"], filler=CFG.context, seed=CFG.seed)
        want = _attention_on_span(llama, ex.context_ids + ex.question_ids, ex.useful)
        assert row["useful_mass"] == pytest.approx(want, rel=1e-4)
        assert row["kl"] == 0 and row["useful_kept"] == 1 and row["bytes_live"] == row["bytes_full"]
    evict = res.filter(pl.col("method") != "full")
    assert (evict["bytes_live"] < evict["bytes_full"]).all()
    assert evict.group_by("distractors", "example").agg(pl.col("bytes_live").n_unique())["bytes_live"].max() == 1
    assert set(evict["protocol"]) == {"query-agnostic"} and set(evict["mode"]) == {"physical"}
    oracle = res.filter(pl.col("method") == "oracle_labels").sort("distractors", "example")
    assert (oracle["useful_kept"] == 1).all() and oracle["oracle"].all()
    # Theorem 2: every useful key kept => alpha_A >= alpha in every head, so in the mean too
    assert (oracle["useful_mass"] >= full["useful_mass"] - 1e-12).all()
    assert (res.filter(pl.col("method") == "streaming_llm")["useful_kept"] < 1).any()
    assert set(res["exact_match"].unique()) <= {0.0, 1.0}
    v = pl.read_parquet(swept / "verdict.parquet")
    assert v.height == 2 * 3 and set(v["verdict"]) == {"too few examples"}
    report = (swept / "report.md").read_text()
    assert "ORACLE" in report and "query-agnostic" in report and (swept / "sweep.png").is_file()
    assert not (swept / "results.parts").exists()


def test_interrupted_sweep_resumes_to_the_same_rows(swept: Path, llama, tmp_path: Path, monkeypatch) -> None:
    real, calls = sweep_mod.run_unit, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    out = tmp_path / "s"
    monkeypatch.setattr(sweep_mod, "run_unit", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(CFG, out, progress=False, model=llama, tokenizer=TOK)
    assert not (out / "results.parquet").exists() and (out / "results.parts").is_dir()
    monkeypatch.setattr(sweep_mod, "run_unit", real)
    with pytest.raises(InputError, match="other settings"):
        run_sweep(replace(CFG, n=3), out, progress=False, model=llama, tokenizer=TOK)
    s = run_sweep(CFG, out, progress=False, model=llama, tokenizer=TOK)
    assert s.units_skipped == 5
    a, b = (pl.read_parquet(p / "results.parquet").drop("wall_s") for p in (swept, out))
    assert a.equals(b)  # same seed, same bits
    # a finished sweep is refused unless --overwrite
    with pytest.raises(InputError, match="finished sweep"):
        run_sweep(CFG, out, progress=False, model=llama, tokenizer=TOK)


def test_verdict_rule() -> None:
    rows = []
    for i in range(8):
        for method, em, lp in (("full", 0.0, -2.0), ("a", 1.0, -1.0), ("b", 0.0, -1.0 - 0.01 * i),
                               ("c", 0.0, -2.0 + (0.5 if i % 2 else -0.5))):
            rows.append({"model": "m", "kind": "near_miss", "distractors": 4, "example": i, "method": method,
                         "oracle": False, "exact_match": em, "answer_logprob": lp})
    v = {r["method"]: r["verdict"] for r in verdicts(pl.DataFrame(rows)).to_dicts()}
    assert v == {"a": "beats full", "b": "beats full (log-prob)", "c": "tie"}


# ----------------------------------------------------------------------------- entry point


@pytest.mark.parametrize(("extra", "option"), [
    (["--distractors", "0,x"], "--distractors"),
    (["--distractors", "0,999"], "--distractors"),
    (["--distractors", "4,4"], "--distractors"),
    (["--n", "0"], "--n"),
    (["--kind", "noise"], "--kind"),
    (["--context", "10"], "--context"),
    (["--methods", "full,snapkvv"], "--methods"),
    (["--methods", "full,full"], "--methods"),
    (["--budget", "lots"], "--budget"),
    (["--device", "tpu"], "--device"),
    (["--chunk", "0"], "--chunk"),
    (["--layers", "1-x"], "--layers"),
    (["--threads", "-1"], "--threads"),
])
def test_bad_options_are_one_line_before_any_model_loads(tmp_path: Path, capsys, monkeypatch, extra, option):
    monkeypatch.setattr("evictlab.models.loading.load_model", lambda *a, **k: pytest.fail("model loaded"))
    code, _, err = run_cli(["dilution", "sweep", "--out", str(tmp_path / "s"), *extra], capsys, monkeypatch)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"error: {option}: ") and "Fix:" in lines[0]
    assert not list(tmp_path.iterdir())


def test_bad_out_paths(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("evictlab.models.loading.load_model", lambda *a, **k: pytest.fail("model loaded"))
    (tmp_path / "file").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    for out, what in ((tmp_path / "no" / "s", "does not exist"), (tmp_path / "file", "is a file"),
                      (tmp_path / "busy", "holds no sweep")):
        code, _, err = run_cli(["dilution", "sweep", "--out", str(out)], capsys, monkeypatch)
        assert code == 2 and "Traceback" not in err and "error: --out: " in err and what in err, err


# ----------------------------------------------------------------------------- real model


@pytest.mark.model
@pytest.mark.slow
def test_sweep_on_the_default_model_at_a_short_context(tmp_path: Path, real_model) -> None:
    model, tok = real_model("smollm2-135m")  # the session's shared model (pulled if not in the cache)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = SweepConfig(distractors=(0, 2), n=1, methods=("full", "oracle_labels", "streaming_llm"), budget="40",
                          context=64)
        run_sweep(cfg, tmp_path / "s", progress=False, model=model, tokenizer=tok)
    finally:
        torch.set_num_threads(old)
    res = pl.read_parquet(tmp_path / "s" / "results.parquet")
    assert res.height == 6
    full = res.filter(pl.col("method") == "full").sort("distractors")
    # the real model answers the plain needle with the full cache
    assert full["exact_match"][0] == 1.0 and full["answer_logprob"][0] > -2.0
    assert (full["useful_mass"] > 0).all() and (full["useful_mass"] < 1).all()
    oracle = res.filter(pl.col("method") == "oracle_labels").sort("distractors")
    assert (oracle["useful_kept"] == 1).all() and (oracle["useful_mass"] >= full["useful_mass"] - 1e-12).all()
    assert (oracle["bytes_live"] < oracle["bytes_full"]).all()


def test_claim_rows_name_where_eviction_beats_full() -> None:
    from evictlab.dilution.claim import beats_full_claims

    base = {"model": "m", "kind": "near_miss", "n": 8, "em_full": 0.5, "em": 0.5, "em_diff_lo": -0.1,
            "em_diff_hi": 0.1, "logprob_diff": 0.0, "logprob_diff_lo": -1.0, "logprob_diff_hi": 1.0}
    v = pl.DataFrame([
        {**base, "distractors": 4, "method": "snapkv", "oracle": False, "em_diff": -0.25, "verdict": "loses to full"},
        {**base, "distractors": 16, "method": "snapkv", "oracle": False, "em_diff": 0.0, "verdict": "tie"},
        {**base, "distractors": 16, "method": "oracle_labels", "oracle": True, "em_diff": 0.25,
         "verdict": "beats full"},
    ])
    rows = {r.claim_id: r for r in beats_full_claims(v)}
    assert rows["dilution-beats-full"].verdict == "not reproduced on this model and task"
    assert "beats full: never" in rows["dilution-beats-full"].our_value
    assert rows["dilution-beats-full-oracle"].verdict.startswith("reproduced")
    assert "oracle_labels at k=16" in rows["dilution-beats-full-oracle"].our_value
    few = beats_full_claims(v.with_columns(pl.lit("too few examples").alias("verdict")))
    assert {r.verdict for r in few} == {"not tested (too few examples per cell)"}


def test_a_second_sweep_on_the_same_folder_is_refused_at_once(tmp_path: Path) -> None:
    """While one run holds DIR (here: a thread holding its lock), another is refused, no model loaded."""
    import threading

    from evictlab.io import exclusive_lock

    out = tmp_path / "s"
    out.mkdir()
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with exclusive_lock(out / "results.parquet", "--out"):
            held.set()
            release.wait(60)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(60)
        with pytest.raises(InputError, match="being written by another evictlab run") as exc:
            run_sweep(CFG, out, progress=False, model=object(), tokenizer=TOK)
        assert exc.value.field == "--out"
    finally:
        release.set()
        t.join(60)


def test_a_refused_sweep_leaves_nothing_that_blocks_the_corrected_one(llama, tmp_path: Path) -> None:
    """Issue 28, item 6: `dilution sweep --budget 4 --out D` (below the always-kept floor) used
    to leave D/results.parts, so the corrected command was refused as "other settings"."""
    from dataclasses import replace

    cfg = replace(CFG, distractors=(0,), n=1, methods=("full", "streaming_llm"))
    out = tmp_path / "s"
    with pytest.raises(InputError) as e:
        run_sweep(replace(cfg, budget="4"), out, progress=False, model=llama, tokenizer=TOK)
    assert e.value.field == "--budget" and "always-kept" in e.value.problem
    assert not (out / "results.parts").exists() and [p.name for p in out.iterdir()] == []
    s = run_sweep(cfg, out, progress=False, model=llama, tokenizer=TOK)
    assert s.units == 2 and (out / "results.parquet").is_file()
