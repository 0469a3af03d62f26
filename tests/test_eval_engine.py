"""The evaluation engine (issue 23): a one-pass grid (one prefill per context, shared by every
arm) gives the per-arm path's rows (run_sequence with a chunk as long as the prefix) to float
rounding with identical byte columns; several questions per context, one row each; --workers
gives one worker's results; --config files (the command line overrides them, unknown keys are
refused) and the experiments/ files expand to the cells they are meant to (the claim grids, ContourKV,
the dilution sweep, the gates comparison). Tiny local models,
and one short case on the real SmolLM2."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest

from cli_helpers import run_cli
from evictlab.errors import InputError
from evictlab.eval.grid import RESULTS, run_grid
from evictlab.eval.spec import GridSpec, LoopSettings

ROOT = Path(__file__).resolve().parents[1]
LOOP = LoopSettings(sinks=2, recent=8, compress_every=8, window=16, block_size=8)
VOLATILE = ["wall_s", "prefill_s"]
#: what pairs a one-pass row with its per-arm twin (the cell keys differ: prefill, chunk)
ROW = ["model", "task", "context", "method", "mode", "protocol", "budget", "example", "question"]
#: columns that must be identical between the two paths
EXACT = ["scorer", "allocator", "budget_unit", "budget_value", "example_seed", "questions", "context_tokens",
         "question_tokens", "answer_tokens", "budget_tokens", "budget_effective_tokens", "bytes_budget", "bytes_live",
         "bytes_live_peak", "bytes_allocated", "bytes_index", "bytes_transient", "bytes_full", "compressions"]
CLOSE = ["answer_logprob", "answer_nll", "kl", "top1_agreement"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the tiny-model fixture `tiny`: tests/conftest.py


def _spec(model: Path | str, **kw) -> GridSpec:
    base = dict(models=[str(model)], tasks=["needle"], contexts=[160],
                methods=["snapkv+adakv", "h2o", "kvzip", "expected_attention+pyramidkv", "oracle_labels"],
                budgets=["24"], modes=["physical", "uniform", "masked"], protocols=["query-agnostic", "query-aware"],
                n=2, seed=3, loop=LOOP)
    base.update(kw)
    return GridSpec.build(**base)


def _per_arm(spec: GridSpec) -> GridSpec:
    """The same grid on the per-arm path with a chunk as long as any prefix: one pass."""
    return replace(spec, prefill="chunked", loop=replace(spec.loop, chunk_size=4096))


def _assert_same_rows(one: pl.DataFrame, chunked: pl.DataFrame, *, atol: float = 2e-4) -> None:
    assert set(one["prefill"]) == {"one-pass"} and one["chunk_size"].null_count() == one.height
    assert set(chunked["prefill"]) == {"chunked"} and set(chunked["chunk_size"]) == {4096}
    assert one.height == chunked.height
    j = one.join(chunked, on=ROW, how="inner", suffix="_arm", nulls_equal=True)
    assert j.height == one.height  # every row has its twin
    for col in EXACT:
        assert j[col].equals(j[f"{col}_arm"], null_equal=True), col
    for col in CLOSE:
        worst = (j[col] - j[f"{col}_arm"]).abs().max()
        assert worst is not None and worst <= atol * max(1.0, float(j[col].abs().max())), (col, worst)
    assert (j["exact_match"] == j["exact_match_arm"]).all()


# ---------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def two_paths(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    spec = _spec(tiny)
    root = tmp_path_factory.mktemp("paths")
    run_grid(spec, root / "one")
    run_grid(_per_arm(spec), root / "arm")
    return spec, pl.read_parquet(root / "one" / RESULTS), pl.read_parquet(root / "arm" / RESULTS)


def test_one_pass_rows_equal_the_per_arm_path(two_paths) -> None:
    """Five methods (two allocators, a reconstruction scorer, the label ORACLE), three stores,
    both protocols, the full cache: the same rows to float rounding, the same bytes."""
    spec, one, arm = two_paths
    assert one.height == len(spec.cells()) * spec.n
    _assert_same_rows(one, arm)
    # the full-cache rows are the reference of both: KL 0, every held column the full cache's
    full = one.filter(pl.col("method") == "full")
    assert (full["kl"] == 0).all() and (full["bytes_live"] == full["bytes_full"]).all()


def test_rows_are_in_cell_order_then_example_then_question(two_paths) -> None:
    spec, one, _ = two_paths
    order = {c.key: i for i, c in enumerate(spec.cells())}
    keys = [(order[c], e, q) for c, e, q in one.select("cell", "example", "question").iter_rows()]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_wall_times_are_the_rows_own_and_the_prefill_is_named(two_paths) -> None:
    """A one-pass row's wall_s is its own work; the shared prefill is prefill_s, the same on
    every row of one context but the query-aware rows (their question's prefix added)."""
    _, one, arm = two_paths
    assert (one["wall_s"] > 0).all() and (one["prefill_s"] > 0).all()
    agnostic = one.filter(pl.col("protocol") != "query-aware")
    per_context = agnostic.group_by("example").agg(pl.col("prefill_s").n_unique())
    assert (per_context["prefill_s"] == 1).all()
    aware = one.filter(pl.col("protocol") == "query-aware")
    base = agnostic.group_by("example").agg(pl.col("prefill_s").first().alias("ctx"))
    assert (aware.join(base, on="example")["prefill_s"] > aware.join(base, on="example")["ctx"]).all()
    assert arm["prefill_s"].null_count() == arm.height  # the per-arm path's prefill is in its wall_s


def test_a_one_pass_cell_alone_is_the_grids_rows(two_paths, tiny: Path) -> None:
    """run_cell on one one-pass cell (its own prefill per example) gives the grid's rows, bit
    for bit: sharing a prefill, scores or a question prefix between arms changes nothing."""
    from evictlab.eval.runner import clear_caches, run_cell

    spec, one, _ = two_paths
    for cell in (spec.cells()[-1], [c for c in spec.cells() if c.method == "kvzip"][0]):
        clear_caches()
        alone = run_cell(cell).drop(VOLATILE)
        assert alone.equals(one.filter(pl.col("cell") == cell.key).drop(VOLATILE)), cell.key


# ---------------------------------------------------------------------------------- questions


def _with_questions(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """Every example asks ``k`` questions of its context: its own, then variants of the same
    lengths (the question's ids reversed; the answer's ids shifted by one), so the one-pass
    store sizes match the per-arm path's."""
    from evictlab.eval import runner
    from evictlab.tasks.examples import PromptQuestion

    real = runner.cell_examples

    def examples(cell, tokenizer):  # noqa: ANN001, ANN202
        out = []
        for ex in real(cell, tokenizer):
            (q,) = ex.questions
            variants = [q, PromptQuestion(q.question_ids[::-1], q.answer, q.answers, q.answer_ids, q.asked),
                        PromptQuestion(q.question_ids, "?", ("?",), [i + 1 for i in q.answer_ids], q.asked)]
            out.append(replace(ex, question_set=tuple(variants[:k])))
        return out

    monkeypatch.setattr(runner, "cell_examples", examples)


def test_several_questions_one_row_each_and_equal_to_the_per_arm_path(tiny: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Three questions per context: a row per (cell, example, question), each answered from its
    own copy of one compressed cache (query-agnostic) or compressed for it (query-aware, the
    label ORACLE with that question's labels), equal to running each question alone; with
    questions=2 the first two, the same rows."""
    _with_questions(monkeypatch, 3)
    spec = _spec(tiny, methods=["snapkv+adakv", "h2o", "oracle_labels"], modes=["physical", "masked"])
    run_grid(spec, tmp_path / "one")
    run_grid(_per_arm(spec), tmp_path / "arm")
    one, arm = (pl.read_parquet(tmp_path / d / RESULTS) for d in ("one", "arm"))
    assert one.height == len(spec.cells()) * spec.n * 3
    assert set(one["questions"]) == {3} and sorted(set(one["question"])) == [0, 1, 2]
    _assert_same_rows(one, arm)
    # the answers differ by question (the variants are other questions), not copies of one row
    agn = one.filter((pl.col("method") == "h2o") & (pl.col("protocol") == "query-agnostic")
                     & (pl.col("mode") == "physical") & (pl.col("example") == 0))
    assert agn["answer_logprob"].n_unique() == 3
    two = _spec(tiny, methods=["snapkv+adakv", "h2o", "oracle_labels"], modes=["physical", "masked"], questions=2)
    run_grid(two, tmp_path / "two")
    first = pl.read_parquet(tmp_path / "two" / RESULTS)
    assert set(first["questions"]) == {2} and first.height == len(two.cells()) * two.n * 2
    j = first.join(one, on=ROW, how="inner", suffix="_3", nulls_equal=True)
    assert j.height == first.height
    for col in ("exact_match", "answer_logprob", "kl", "bytes_live"):
        assert (j[col] - j[f"{col}_3"]).abs().max() < 1e-5, col


# ---------------------------------------------------------------------------------- workers


def test_workers_give_one_workers_results(tiny: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """``eval run --workers 2``: the units in two local processes of one thread each; the same
    rows, in the same order, as one worker (wall times aside); the record says 2 workers."""
    spec = _spec(tiny, methods=["snapkv+adakv", "h2o"], tasks=["needle", "multi_key"], protocols=["query-agnostic"])
    run_grid(spec, tmp_path / "one")
    args = ["eval", "run", "--models", str(tiny), "--tasks", "needle,multi_key", "--context", "160", "--budget", "24",
            "--methods", "snapkv+adakv,h2o", "--store", "physical,uniform,masked", "--n", "2", "--seed", "3",
            "--sinks", "2", "--recent", "8", "--compress-every", "8", "--window", "16", "--block-size", "8",
            "--workers", "2", "--quiet", "--out", str(tmp_path / "two")]
    code, out, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    assert f"{len(spec.cells())} cells over {len(spec.units())} contexts" in out
    a, b = (pl.read_parquet(tmp_path / d / RESULTS).drop(VOLATILE) for d in ("one", "two"))
    assert a.height == len(spec.cells()) * spec.n and a.equals(b)
    rec = json.loads((tmp_path / "two" / "run_record.json").read_text())
    assert rec["config"]["workers"] == 2 and rec["config"]["prefill"] == "one-pass"


# ---------------------------------------------------------------------------------- config files


def _grid_of(argv: list[str]):
    """What ``eval run ARGV`` would run (no model loaded): (spec, params, config file)."""
    import typer.main

    from evictlab import cli
    from evictlab.eval.commands import grid_of

    cmd = typer.main.get_command(cli.app).commands["eval"].commands["run"]
    with cmd.make_context("run", list(argv)) as ctx:
        return grid_of(ctx)


def test_the_smoke_config_runs_with_command_line_overrides(tiny: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """experiments/smoke.toml through the entry point, with --models (a tiny local model),
    --n and --out from the command line overriding the file: the file's grid otherwise; the
    run record keeps the file's path, SHA-256 and keys."""
    import hashlib

    smoke = ROOT / "experiments" / "smoke.toml"
    out = tmp_path / "smoke"
    code, _, err = run_cli(["eval", "run", "--config", str(smoke), "--models", str(tiny), "--n", "1", "--out", str(out),
                            "--quiet"], capsys, monkeypatch)
    assert code == 0, err
    res = pl.read_parquet(out / RESULTS)
    assert set(res["model"]) == {str(tiny)} and set(res["example"]) == {0}
    assert set(res["task"]) == {"needle", "multi_key"} and set(res["protocol"]) == {"none", "query-agnostic",
                                                                                   "query-aware"}
    rec = json.loads((out / "run_record.json").read_text())["config"]
    assert rec["config_file"]["path"] == str(smoke)
    assert rec["config_file"]["sha256"] == hashlib.sha256(smoke.read_bytes()).hexdigest()
    assert rec["config_file"]["keys"]["methods"] == ["snapkv+adakv", "h2o"]
    assert rec["n"] == 1 and rec["models"] == [str(tiny)]


def test_config_values_and_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('models = "smollm2-135m"\ntasks = ["needle", "multi_key"]\ncontext = [512, 1024]\n'
                   'budget = ["32", "2MiB"]\nmethods = ["snapkv", "h2o+adakv"]\nstore = "physical,masked"\n'
                   'questions = 2\nn = 7\nscorer_param = ["window=8"]\ncompress_every = 4\nout = "g"\n')
    spec, p, file = _grid_of(["--config", str(cfg)])
    assert (spec.tasks, spec.contexts, spec.budgets) == (("needle", "multi_key"), (512, 1024), ("32/cell", "2097152B"))
    assert (spec.methods, spec.modes, spec.n, spec.questions) == (("snapkv", "h2o+adakv"), ("physical", "masked"), 7, 2)
    assert spec.loop.compress_every == 4 and spec.scorer_params == (("window", "8"),) and p["out"] == Path("g")
    assert spec.prefill == "one-pass" and spec.protocols == ("query-agnostic",)  # defaults where the file is silent
    spec, _, _ = _grid_of(["--config", str(cfg), "--n", "3", "--budget", "16", "--store", "uniform"])
    assert (spec.n, spec.budgets, spec.modes) == (3, ("16/cell",), ("uniform",))  # the command line wins
    assert file.table["context"] == [512, 1024] and len(file.sha256) == 64


@pytest.mark.parametrize("text, words", [
    ('modle = "x"\n', "unknown key 'modle'"),
    ('budgets = ["64"]\n', "unknown key 'budgets'"),
    ('n = "ten"\n', "n in"),
    ('trace = 1\n', "trace in"),
    ('methods = [["snapkv"]]\n', "methods in"),
    ('n = \n', "not a TOML file"),
    ('chunk = 64\nout = "g"\n', "only applies with --prefill chunked"),
])
def test_bad_config_files_are_one_line_naming_the_key(tmp_path: Path, text: str, words: str, capsys,
                                                     monkeypatch) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    code, _, err = run_cli(["eval", "run", "--config", str(cfg), "--out", str(tmp_path / "g")], capsys, monkeypatch)
    assert code == 2 and words in err, err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    if "unknown key" in words:
        assert "models, tasks, context, budget" in err  # the valid keys are named
    assert not (tmp_path / "g").exists()


def test_a_chunked_config_keeps_its_chunk(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('prefill = "chunked"\nchunk = 64\nout = "g"\n')
    spec, _, _ = _grid_of(["--config", str(cfg)])
    assert spec.prefill == "chunked" and spec.loop.chunk_size == 64
    assert all(c.loop.chunk_size == 64 for c in spec.cells())


# ---------------------------------------------------------------------------------- experiments/

CLAIMS = {
    # file: (contexts, n, cells per (model, task, context) beside the full cell)
    "enforcement_cost.toml": ((1024, 2048), 50, 3 * 5 * 3),
    "enforcement_cost_4k.toml": ((4096,), 20, 3 * 5 * 3),
    "query_aware_margin.toml": ((1024, 2048), 50, 2 * 3 * 4),
    "query_aware_margin_4k.toml": ((4096,), 20, 2 * 3 * 4),
}


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_the_claim_configs_expand_to_their_grids(name: str) -> None:
    """Each claim's file at full size: both models, the task suite (its floor cells left out
    and listed), 3 budgets, the four scorers (SnapKV, KVzip-style, ExpectedAttention, H2O),
    n >= 50 at 1k/2k and >= 20 at 4k, one-pass, every question the tasks ask; parsed and
    expanded, never run here."""
    from evictlab.tasks.suite import SUITE_TASKS

    contexts, n, per = CLAIMS[name]
    spec, p, _ = _grid_of(["--config", str(ROOT / "experiments" / name)])
    assert spec.models == ("smollm2-135m", "gemma3-270m") and spec.tasks == SUITE_TASKS and len(spec.budgets) == 3
    assert spec.contexts == contexts and spec.n == n and spec.prefill == "one-pass" and spec.questions is None
    assert {c.scorer for c in spec.cells() if not c.is_full} == {"snapkv", "kvzip", "expected_attention", "h2o"}
    floors = {(m, t, c) for m, t, c, _ in spec.floors}
    assert floors and all(c in contexts for _, _, c in floors)
    groups = len(spec.models) * len(spec.tasks) * len(spec.contexts) - len(floors)
    assert len(spec.cells()) == groups * (1 + per) and len(spec.units()) == groups * n
    assert p["out"] == Path("runs/experiments") / name.removesuffix(".toml")
    if name.startswith("enforcement"):
        # the four scorers wrapped in AdaKV, and kvpress's KVzip (one ranking over all layers and heads)
        assert spec.modes == ("physical", "uniform", "masked")
        assert sorted(spec.evicting) == sorted([f"{s}+adakv" for s in ("snapkv", "kvzip", "expected_attention", "h2o")]
                                               + ["kvzip+global"])
    else:
        assert spec.protocols == ("query-agnostic", "query-aware")


def test_the_contourkv_config_expands_to_its_grid() -> None:
    """experiments/contourkv.toml: every ContourKV variant against uniform, PyramidKV, AdaKV
    and the global allocator with SnapKV and KVzip-style scores; both models, the task suite
    (its floor cells left out and listed), 1k and 2k, three budgets, n = 50, physical,
    query-agnostic, one-pass; the units example by example (a stopped run holds the same
    first examples of every cell)."""
    from evictlab.eval.claims.contour import CONTOUR_ALLOCATORS
    from evictlab.tasks.suite import SUITE_TASKS

    spec, p, _ = _grid_of(["--config", str(ROOT / "experiments" / "contourkv.toml")])
    assert spec.models == ("smollm2-135m", "gemma3-270m") and spec.contexts == (1024, 2048) and spec.n == 50
    assert spec.tasks == SUITE_TASKS and len(spec.budgets) == 3 and spec.floors
    assert spec.modes == ("physical",) and spec.protocols == ("query-agnostic",) and spec.prefill == "one-pass"
    arms = {(c.scorer, c.allocator) for c in spec.cells() if not c.is_full}
    for scorer in ("snapkv", "kvzip"):
        # every variant but contourkv_pred (it needs a fitted predictor no shipped profile embeds)
        # and contourkv_relerror (built after this grid ran: contourkv_relerror.toml)
        want = {*CONTOUR_ALLOCATORS, "pyramidkv", "adakv", "global", "uniform"} - {"contourkv_pred",
                                                                                   "contourkv_relerror"}
        assert {a for s_, a in arms if s_ == scorer} == want
    floors = {(m, t, c) for m, t, c, _ in spec.floors}
    groups = [(m, t, c) for m in spec.models for t in spec.tasks for c in spec.contexts if (m, t, c) not in floors]
    assert len(groups) + len(floors) == len(spec.models) * len(spec.tasks) * len(spec.contexts)
    assert len(spec.cells()) == len(groups) * (1 + 18 * 3) and len(spec.units()) == len(groups) * 50
    first = spec.units()[:len(groups)]
    assert {u.example for u in first} == {0} and {(u.cells[0].model, u.cells[0].task, u.cells[0].context)
                                              for u in first} == set(groups)
    assert p["out"] == Path("runs/experiments/contourkv")


def test_the_contourkv_scorers_config_expands_to_its_grid() -> None:
    """experiments/contourkv_scorers.toml: ExpectedAttention and Compactor-style scores with
    every allocator (uniform, PyramidKV, AdaKV, global, the ContourKV variants) at the
    paper's s = 128, on the same suite cells, contexts and n as contourkv.toml."""
    from evictlab.eval.claims.contour import CONTOUR_ALLOCATORS

    spec, p, _ = _grid_of(["--config", str(ROOT / "experiments" / "contourkv_scorers.toml")])
    main, _, _ = _grid_of(["--config", str(ROOT / "experiments" / "contourkv.toml")])
    assert (spec.models, spec.tasks, spec.contexts, spec.n, spec.floors) == (main.models, main.tasks, main.contexts,
                                                                          main.n, main.floors)
    assert len(spec.budgets) == 1 and spec.modes == ("physical",) and spec.protocols == ("query-agnostic",)
    arms = {(c.scorer, c.allocator) for c in spec.cells() if not c.is_full}
    want = {*CONTOUR_ALLOCATORS, "pyramidkv", "adakv", "global", "uniform"} - {"contourkv_pred"}
    assert arms == {(s_, a) for s_ in ("expected_attention", "compactor") for a in want}
    assert len(spec.units()) == len(main.units())


def test_the_contourkv_follow_up_configs_expand_to_their_grids() -> None:
    """contourkv_relerror.toml: the verdict grid's cells, budgets and n with the relative-error
    objective against uniform and AdaKV; contourkv_4k.toml: the suite's 4k cells at s = 128,
    n = 20, the per-model picks and relerror against uniform and AdaKV, both scorers."""
    rel, p, _ = _grid_of(["--config", str(ROOT / "experiments" / "contourkv_relerror.toml")])
    main, _, _ = _grid_of(["--config", str(ROOT / "experiments" / "contourkv.toml")])
    assert (rel.models, rel.tasks, rel.contexts, rel.n, rel.floors, rel.budgets) == (
        main.models, main.tasks, main.contexts, main.n, main.floors, main.budgets)
    arms = {(c.scorer, c.allocator) for c in rel.cells() if not c.is_full}
    assert arms == {(s_, a) for s_ in ("snapkv", "kvzip") for a in ("uniform", "adakv", "contourkv_relerror")}
    assert len(rel.units()) == len(main.units()) and p["out"] == Path("runs/experiments/contourkv_relerror")
    k4, p4, _ = _grid_of(["--config", str(ROOT / "experiments" / "contourkv_4k.toml")])
    assert k4.contexts == (4096,) and k4.n == 20 and len(k4.budgets) == 1 and k4.modes == ("physical",)
    arms = {(c.scorer, c.allocator) for c in k4.cells() if not c.is_full}
    picks = {"uniform", "adakv", "contourkv", "contourkv_error", "contourkv_relerror", "contourkv_query",
             "contourkv_offline"}
    assert arms == {(s_, a) for s_ in ("snapkv", "kvzip") for a in picks}
    assert len(k4.units()) == 20 * (len(k4.models) * len(k4.tasks) - len(k4.floors))
    facts, pf, _ = _grid_of(["--config", str(ROOT / "experiments" / "contourkv_facts.toml")])
    assert (facts.models, facts.contexts, facts.n, facts.budgets) == (main.models, main.contexts, main.n, main.budgets)
    assert facts.tasks == ("facts_word",) and not facts.floors and facts.questions is None
    arms = {(c.scorer, c.allocator) for c in facts.cells() if not c.is_full}
    main_arms = {(c.scorer, c.allocator) for c in main.cells() if not c.is_full}
    assert arms == main_arms  # the relative forced error on these cells: contourkv_relerror.toml (the suite)
    assert set(rel.tasks) >= {"facts_word"}
    assert len(facts.units()) == 2 * 2 * 50 and pf["out"] == Path("runs/experiments/contourkv_facts")


DILUTION_METHODS = {"oracle_labels", "snapkv", "snapkv+adakv", "expected_attention", "streaming_llm"}
#: the local gates of the gates ablation (gates_ablation.toml; relative to the working directory,
#: the repository root, as the scorer reads it): committed since 2026-12-06
LOCAL_GATES = Path("data/ablation/gates-smollm2-135m-local")


def test_the_dilution_configs_expand_to_their_grids() -> None:
    """dilution.toml: the distractor sweep on the engine: both models, both kinds x K = 0, 4,
    16, 64 (the families expanded by `distractors`), the sweep's default filler (512) and
    budget (128 per cell), the full cache, the label ORACLE and four query-agnostic methods,
    physical, query-agnostic, one-pass, n = 50; dilution_trimkv.toml: the same (both models,
    each with its shipped gates) plus trimkv+global and trimkv with the shipped gates
    (gates=default, the trimkv scorer's only)."""
    from evictlab.dilution.sweep import SweepConfig
    from evictlab.eval.spec import budget_text
    from evictlab.kv.budget import Budget

    tasks = tuple(f"dilution_{kind}_k{k}" for kind in ("near_miss", "filler") for k in (0, 4, 16, 64))
    sweep = SweepConfig()
    for name, models, methods in (
        ("dilution.toml", ("smollm2-135m", "gemma3-270m"), DILUTION_METHODS),
        ("dilution_trimkv.toml", ("smollm2-135m", "gemma3-270m"), DILUTION_METHODS | {"trimkv+global", "trimkv"}),
    ):
        spec, p, _ = _grid_of(["--config", str(ROOT / "experiments" / name)])
        assert spec.models == models and spec.tasks == tasks and spec.n == 50 and not spec.floors
        assert spec.contexts == (sweep.context,) and spec.budgets == (budget_text(Budget.parse(sweep.budget)),)
        assert spec.modes == ("physical",) and spec.protocols == ("query-agnostic",) and spec.prefill == "one-pass"
        assert set(spec.evicting) == methods and "full" in spec.methods
        assert len(spec.cells()) == len(models) * len(tasks) * (1 + len(methods))
        assert len(spec.units()) == len(models) * len(tasks) * 50
        for c in spec.cells():
            assert c.scorer_params == ((("gates", "default"),) if c.scorer == "trimkv" else ())
        assert p["out"] == Path("runs/experiments") / name.removesuffix(".toml")


def test_the_gates_configs_expand_to_their_grids(monkeypatch: pytest.MonkeyPatch) -> None:
    """gates.toml (issue 25, item 3): SmolLM2, the task suite's kept cells at 1k and 2k, the
    budgets of contourkv.toml, trimkv+global and trimkv (the shipped gates) against SnapKV,
    SnapKV + AdaKV and SnapKV + contourkv_error, physical, query-agnostic, one-pass, n = 50;
    gates_ablation.toml: the same cells in one grid with trimkv+global on the shipped and on the
    local gates and trimkv on the local gates, each arm's gates in brackets (the local gates
    committed under data/ablation/, named relative to the repository root)."""
    from evictlab.tasks.suite import SUITE_TASKS

    spec, p, _ = _grid_of(["--config", str(ROOT / "experiments" / "gates.toml")])
    contour, _, _ = _grid_of(["--config", str(ROOT / "experiments" / "contourkv.toml")])
    assert spec.models == ("smollm2-135m",) and spec.tasks == SUITE_TASKS and spec.contexts == (1024, 2048)
    assert spec.budgets == contour.budgets and spec.n == 50 and spec.prefill == "one-pass"
    assert spec.modes == ("physical",) and spec.protocols == ("query-agnostic",)
    assert set(spec.evicting) == {"trimkv+global", "trimkv", "snapkv", "snapkv+adakv", "snapkv+contourkv_error"}
    floors = {(m, t, c) for m, t, c, _ in spec.floors}
    groups = len(SUITE_TASKS) * 2 - len(floors)
    # SmolLM2's kept cells: needle, needle_word and facts_word at 1k and 2k, multi_key at 1k
    assert groups == 7 and len(spec.cells()) == groups * (1 + 3 * 5) and len(spec.units()) == groups * 50
    for c in spec.cells():
        assert c.scorer_params == ((("gates", "default"),) if c.scorer == "trimkv" else ())
    assert p["out"] == Path("runs/experiments/gates")
    gemma, p, _ = _grid_of(["--config", str(ROOT / "experiments" / "gates_gemma.toml")])
    assert gemma.models == ("gemma3-270m",) and (gemma.tasks, gemma.contexts, gemma.budgets, gemma.n) == (
        spec.tasks, spec.contexts, spec.budgets, spec.n)
    assert (gemma.modes, gemma.protocols, gemma.prefill) == (spec.modes, spec.protocols, spec.prefill)
    assert set(gemma.evicting) == {"trimkv+global", "trimkv", "snapkv", "snapkv+adakv", "snapkv+contourkv_offline",
                                   "kvzip+contourkv_offline"}
    # Gemma 3's kept cells: needle at 1k, needle_word, facts_word and keys_number at 1k and 2k, keys_tagged at 1k
    g_groups = len(SUITE_TASKS) * 2 - len(gemma.floors)
    assert g_groups == 8 and len(gemma.cells()) == g_groups * (1 + 3 * 6) and len(gemma.units()) == g_groups * 50
    assert p["out"] == Path("runs/experiments/gates_gemma")
    ablation_file = ["--config", str(ROOT / "experiments" / "gates_ablation.toml")]
    assert (ROOT / LOCAL_GATES / "gates.json").is_file()  # committed: the file runs as it is
    monkeypatch.chdir(ROOT)
    ablation, p, _ = _grid_of(ablation_file)
    assert (ablation.models, ablation.tasks, ablation.contexts, ablation.budgets, ablation.n, ablation.floors,
            ablation.modes, ablation.protocols, ablation.prefill) == (
        spec.models, spec.tasks, spec.contexts, spec.budgets, spec.n, spec.floors, spec.modes, spec.protocols,
        spec.prefill)
    local = f"trimkv[gates={LOCAL_GATES}]"
    assert ablation.evicting == ["trimkv[gates=default]+global", f"{local}+global", local]
    arms = {(c.scorer, c.allocator, c.scorer_params) for c in ablation.cells() if not c.is_full}
    assert arms == {("trimkv[gates=default]", "global", (("gates", "default"),)),
                    (local, "global", (("gates", str(LOCAL_GATES)),)), (local, "uniform", (("gates", str(LOCAL_GATES)),))}
    assert len(ablation.cells()) == groups * (1 + 3 * 3) and len(ablation.units()) == groups * 50
    assert p["out"] == Path("runs/experiments/gates_ablation")


def test_every_experiment_file_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    files = sorted((ROOT / "experiments").glob("*.toml"))
    assert {f.name for f in files} == {  # gpu_check: benchmarks/gpu_check.sh
        *CLAIMS, "smoke.toml", "gpu_check.toml", "contourkv.toml", "contourkv_scorers.toml", "contourkv_relerror.toml",
        "contourkv_4k.toml", "contourkv_facts.toml", "dilution.toml", "dilution_trimkv.toml", "gates.toml", "gates_ablation.toml",
        "gates_gemma.toml", "contourkv_safeguard.toml"}
    monkeypatch.chdir(ROOT)  # gates_ablation.toml names its local gates relative to the repository root
    for f in files:
        spec, _, _ = _grid_of(["--config", str(f)])
        assert spec.cells()


# ---------------------------------------------------------------------------------- real model


def test_real_model_one_pass_equals_the_per_arm_path(tmp_path: Path, real_model) -> None:
    """SmolLM2-135M, one needle context at 300 tokens, three arms under both protocols: the
    one-pass grid's rows are the per-arm path's to float rounding, the same bytes."""
    real_model("smollm2-135m", "ragged")  # the grid's load_cached finds the session's shared model
    spec = GridSpec.build(models=["smollm2-135m"], tasks=["needle"], contexts=[300],
                          methods=["snapkv+adakv", "h2o", "kvzip"], budgets=["32"], modes=["physical", "masked"],
                          protocols=["query-agnostic", "query-aware"], n=1, seed=0)
    run_grid(spec, tmp_path / "one")
    run_grid(_per_arm(spec), tmp_path / "arm")
    one, arm = (pl.read_parquet(tmp_path / d / RESULTS) for d in ("one", "arm"))
    _assert_same_rows(one, arm, atol=1e-3)
    assert one.filter(pl.col("method") == "full")["exact_match"].to_list() == [1.0]
