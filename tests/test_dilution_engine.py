"""The distractor sweep on the evaluation engine: the tasks ``dilution_near_miss_kK`` /
``dilution_filler_kK`` (names parsed and refused), their examples (the sweep's, with the
labels), ``eval run --distractors`` (the families expanded; refused without one, one line,
exit 2), a small one-pass grid on a tiny random model with the full cache, the label ORACLE
and SnapKV (the ORACLE keeps every useful entry), and the traced grid's ``fact_held`` /
``fact_kept`` on the engine path (one-pass and chunked, several questions, no labels)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest

from cli_helpers import run_cli
from evictlab.errors import InputError
from evictlab.eval.grid import RESULTS, TRACE, run_grid
from evictlab.eval.spec import GridSpec, LoopSettings
from evictlab.methods.oracle_labels import parse_spans
from evictlab.tasks.distractors import FAMILIES, MAX_DISTRACTORS, expand_families, make_example, parse_task, task_name
from evictlab.tasks.examples import dilution_example, eval_examples, useful_spec

LOOP = LoopSettings(sinks=2, recent=8, compress_every=8, window=16, block_size=8)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the tiny-model fixture `tiny`: tests/conftest.py


def _tokenizer(model: Path):
    """The tokenizer the engine loads with the model (the process's cached pair)."""
    from evictlab.eval.runner import load_cached
    from evictlab.kv.cache import register_ragged_attention

    return load_cached(str(model), "cpu", attn_implementation=register_ragged_attention())[1]


# ----------------------------------------------------------------------------- task names


@pytest.mark.parametrize("name, want", [
    ("dilution_near_miss_k16", ("near_miss", 16)), ("dilution_filler_k0", ("filler", 0)),
    (f"dilution_near_miss_k{MAX_DISTRACTORS}", ("near_miss", MAX_DISTRACTORS)), ("needle", None),
])
def test_task_names_parse(name: str, want) -> None:
    assert parse_task(name) == want
    if want is not None:
        assert task_name(*want) == name


@pytest.mark.parametrize("name, words", [
    ("dilution_near_miss", "needs a distractor count"),
    ("dilution_filler", "needs a distractor count"),
    (f"dilution_near_miss_k{MAX_DISTRACTORS + 1}", f"more than the {MAX_DISTRACTORS}"),
    ("dilution_filler_k04", "leading zero"),
    ("dilution_nearmiss_k4", "unknown dilution task"),
    ("dilution_near_miss_k-1", "unknown dilution task"),
])
def test_bad_task_names_are_refused_naming_the_fix(name: str, words: str) -> None:
    with pytest.raises(InputError, match=words) as exc:
        parse_task(name)
    assert exc.value.field == "tasks" and exc.value.fix
    with pytest.raises(InputError, match=words):  # the grid refuses it before any model loads
        GridSpec.build(models=["smollm2-135m"], tasks=[name], contexts=[512], methods=["snapkv"])


def test_families_expand_in_place_and_refusals() -> None:
    assert FAMILIES == ("dilution_near_miss", "dilution_filler")
    assert expand_families(["needle", "dilution_near_miss", "dilution_filler_k4"], [0, 16]) == [
        "needle", "dilution_near_miss_k0", "dilution_near_miss_k16", "dilution_filler_k4"]
    assert expand_families(["dilution_near_miss"], None) == ["dilution_near_miss"]
    spec = GridSpec.build(models=["smollm2-135m"], tasks=["dilution_near_miss", "dilution_filler"], contexts=[512],
                          methods=["oracle_labels"], budgets=["128"], distractors=[0, 4])
    assert spec.tasks == ("dilution_near_miss_k0", "dilution_near_miss_k4", "dilution_filler_k0", "dilution_filler_k4")
    assert "distractors" not in spec.to_dict()  # the manifest keeps the expanded tasks only
    for tasks, counts, words in ((["needle"], [4], "no task is one"), (["dilution_filler"], [4, 4], "given twice"),
                                 (["dilution_filler"], [MAX_DISTRACTORS + 1], "outside"),
                                 (["dilution_filler"], [], "empty")):
        with pytest.raises(InputError, match=words) as exc:
            expand_families(tasks, counts)
        assert exc.value.field == "distractors"
    with pytest.raises(InputError, match="dilution_near_miss_k4 is given twice"):
        GridSpec.build(models=["smollm2-135m"], tasks=["dilution_near_miss", "dilution_near_miss_k4"],
                       contexts=[512], methods=["snapkv"], distractors=[4])


# ----------------------------------------------------------------------------- examples


@pytest.mark.parametrize("kind", ["near_miss", "filler"])
def test_engine_examples_are_the_sweeps_with_their_labels(kind: str) -> None:
    """The engine's examples of dilution_KIND_k4 (tasks.examples.eval_examples, what every
    cell builds) are make_example's for the same seed, token for token, and their labels
    give the ORACLE the asked needle's span (the sweep's useful_spec)."""
    task = task_name(kind, 4)
    exs = eval_examples(task, 3, 96, None, 5)
    assert [e.index for e in exs] == [0, 1, 2] and {e.task for e in exs} == {task} and {e.seed for e in exs} == {5}
    for ex in exs:
        ref = make_example(None, ex.index, 4, filler=96, kind=kind, seed=5)
        assert (ex.context_ids, ex.question_ids, ex.answer_ids) == (ref.context_ids, ref.question_ids, ref.answer_ids)
        assert ex.answer == ref.value and len(ex.questions) == 1
        assert useful_spec(ex, None) == ref.useful_spec()
        assert len(ex.facts) == (5 if kind == "near_miss" else 1) and sum(f.asked for f in ex.facts) == 1
    assert dilution_example(None, task, 1, 96, 5) == exs[1]
    with pytest.raises(InputError, match="one question"):
        eval_examples(task, 1, 96, None, 5, questions=2)
    with pytest.raises(InputError) as exc:
        eval_examples(task, 1, 32, None, 5)
    assert exc.value.field == "contexts"


# ----------------------------------------------------------------------------- the command line


def test_distractors_without_a_family_is_one_line_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    for args, option, words in (
        (["--tasks", "needle", "--distractors", "0,4"], "--distractors", "no task is one"),
        (["--tasks", "dilution_near_miss_k4", "--distractors", "0,4"], "--distractors", "no task is one"),
        (["--tasks", "dilution_near_miss"], "--tasks", "needs a distractor count"),
        (["--tasks", "dilution_filler", "--distractors", "4,x"], "--distractors", "not a whole number"),
    ):
        code, _, err = run_cli(["eval", "run", *args, "--out", str(tmp_path / "g")], capsys, monkeypatch)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {option}: "), err
        assert words in lines[0] and "Fix: " in lines[0]
    assert not (tmp_path / "g").exists()


def _grid_of(argv: list[str]):
    """What ``eval run ARGV`` would run (no model loaded): (spec, params, config file)."""
    import typer.main

    from evictlab import cli
    from evictlab.eval.commands import grid_of

    cmd = typer.main.get_command(cli.app).commands["eval"].commands["run"]
    with cmd.make_context("run", list(argv)) as ctx:
        return grid_of(ctx)


def test_distractors_in_a_config_file_and_on_the_command_line(tmp_path: Path) -> None:
    cfg = tmp_path / "d.toml"
    cfg.write_text('tasks = ["dilution_filler"]\ndistractors = [0, 16]\ncontext = [512]\nbudget = ["128"]\n'
                   'methods = ["oracle_labels"]\nout = "g"\n')
    spec, _, _ = _grid_of(["--config", str(cfg)])
    assert spec.tasks == ("dilution_filler_k0", "dilution_filler_k16")
    spec, _, _ = _grid_of(["--config", str(cfg), "--distractors", "64"])  # the command line wins
    assert spec.tasks == ("dilution_filler_k64",)


# ----------------------------------------------------------------------------- a grid on a tiny model


@pytest.fixture(scope="module")
def dilution_grid(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    spec = GridSpec.build(models=[str(tiny)], tasks=["dilution_near_miss"], distractors=[0, 3], contexts=[160],
                          methods=["full", "oracle_labels", "snapkv"], budgets=["24"], n=2, seed=1, loop=LOOP,
                          trace=True)
    out = tmp_path_factory.mktemp("dilution") / "g"
    run_grid(spec, out)
    return spec, pl.read_parquet(out / RESULTS), pl.read_parquet(out / TRACE)


def test_a_dilution_grid_runs_full_oracle_and_snapkv(dilution_grid, tiny: Path) -> None:
    """Every (task, method, example) row, named by its protocol, store and prefill; the
    contexts are the sweep's examples; the ORACLE keeps every useful entry (fact_kept =
    fact_held = the asked needle's tokens, in every layer and KV head) while SnapKV is
    counted too."""
    spec, res, trace = dilution_grid
    assert spec.tasks == ("dilution_near_miss_k0", "dilution_near_miss_k3")
    assert res.height == len(spec.cells()) * spec.n == 2 * 3 * 2
    assert set(res["method"]) == {"full", "oracle_labels", "snapkv"} and set(res["prefill"]) == {"one-pass"}
    full, arms = res.filter(pl.col("method") == "full"), res.filter(pl.col("method") != "full")
    assert set(full["protocol"]) == {"none"} and set(full["mode"]) == {"full"} and (full["kl"] == 0).all()
    assert set(arms["protocol"]) == {"query-agnostic"} and set(arms["mode"]) == {"physical"}
    assert (arms["bytes_live"] < arms["bytes_full"]).all() and (arms["compressions"] >= 1).all()
    tok = _tokenizer(tiny)
    spans = {}
    for row in full.iter_rows(named=True):
        k = parse_task(row["task"])[1]
        ex = make_example(tok, row["example"], k, filler=160, seed=1)
        assert row["context_tokens"] == len(ex.context_ids) and row["answer_tokens"] == len(ex.answer_ids)
        spans[(row["task"], row["example"])] = ex.useful[1] - ex.useful[0]
    oracle = trace.filter(pl.col("method") == "oracle_labels")
    assert oracle.height and oracle["fact_held"].null_count() == 0
    assert (oracle["fact_kept"] == oracle["fact_held"]).all()  # fact kept = 1: only distractors evicted
    first = oracle.filter(pl.col("compression") == 0)
    assert all(r["fact_held"] == spans[(r["task"], r["example"])] for r in first.iter_rows(named=True))
    snap = trace.filter(pl.col("method") == "snapkv")
    assert snap["fact_kept"].null_count() == 0 and (snap["fact_kept"] <= snap["fact_held"]).all()


# ----------------------------------------------------------------------------- fact columns of the trace


def _expected_positions(ex, tok, questions: range) -> int:
    """Tokens of the facts the questions ask for (their union), from the labels' spans."""
    pos = set()
    for i in questions:
        for a, b in parse_spans(useful_spec(ex, tok, question=i)):
            pos.update(range(a, b))
    return len(pos)


@pytest.mark.parametrize("prefill", ["one-pass", "chunked"])
def test_traced_engine_rows_count_the_facts(tiny: Path, tmp_path: Path, prefill: str) -> None:
    """eval run --trace fills fact_held / fact_kept wherever the example has labels (as
    `decode --trace` does): each question's compressions count its own facts, the context's
    compression that a query-agnostic arm's questions share counts the union of theirs;
    heldout_ppl (no labels) leaves them null."""
    from evictlab.eval.runner import cell_examples

    loop = LOOP if prefill == "one-pass" else replace(LOOP, chunk_size=64)
    spec = GridSpec.build(models=[str(tiny)], tasks=["keys_word", "heldout_ppl"], contexts=[160],
                          methods=["snapkv"], budgets=["24"], protocols=["query-agnostic", "query-aware"], n=1,
                          seed=2, loop=loop, trace=True, prefill=prefill, questions=2, target_tokens=8)
    run_grid(spec, tmp_path / "g")
    trace = pl.read_parquet(tmp_path / "g" / TRACE)
    ppl = trace.filter(pl.col("task") == "heldout_ppl")
    assert ppl.height and ppl["fact_held"].null_count() == ppl.height == ppl["fact_kept"].null_count()
    kw = trace.filter(pl.col("task") == "keys_word")
    assert kw["fact_held"].null_count() == 0 and (kw["fact_kept"] <= kw["fact_held"]).all()
    tok = _tokenizer(tiny)
    cell = next(c for c in spec.cells() if c.task == "keys_word")
    ex = cell_examples(cell, tok)[0]
    union, own = _expected_positions(ex, tok, range(2)), [_expected_positions(ex, tok, range(i, i + 1)) for i in (0, 1)]
    assert all(n > 0 for n in own) and union > max(own)  # two questions, two different facts
    assert (kw["fact_held"] <= union).all()
    agnostic = kw.filter(pl.col("protocol") == "query-agnostic")
    if prefill == "one-pass":  # the whole context is held at the first compression: every fact token
        shared = agnostic.filter(pl.col("compression") == 0)
        assert shared.height and shared["question"].null_count() == shared.height
        assert (shared["fact_held"] == union).all()
    else:  # chunk by chunk, once per question: each compression counts its question's facts only
        assert agnostic["question"].null_count() == 0
        for q in (0, 1):
            assert (agnostic.filter(pl.col("question") == q)["fact_held"] <= own[q]).all()
    # query-aware (either prefill): one compression per question, the whole prefix held
    aware = kw.filter((pl.col("protocol") == "query-aware") & (pl.col("compression") == 0))
    for q in (0, 1):
        assert set(aware.filter(pl.col("question") == q)["fact_held"]) == {own[q]}
