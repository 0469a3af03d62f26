"""``oracle_labels`` gets the task's labels in every command that runs it (issue 28, item 1).

It used to be StreamingLLM outside ``dilution sweep``: its ``useful`` parameter defaulted to
``"0:1"`` and ``decode``, ``audit`` and ``eval run`` never passed the labels, so
``eval run --methods oracle_labels,streaming_llm`` gave both rows the same numbers. Now the
labels (the token spans of the facts the question asks for) are passed per example, and a
run without them (a ``heldout_ppl`` window, a hand-built config) is refused, never a default.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch

from evictlab import cli
from evictlab.tasks.synthetic import make_task
from evictlab.capture.testing import save_tiny_folder, tiny_model
from evictlab.decode.audit import Example, audit_configs, run_audit, task_examples
from evictlab.decode.config import DecodeConfig, LoopSettings
from evictlab.decode.loop import run_sequence
from evictlab.tasks.examples import eval_examples, tokenize_task, useful_spec
from evictlab.errors import InputError
from evictlab.eval.grid import RESULTS
from evictlab.eval.spec import GridSpec
from evictlab.kv.budget import Budget
from evictlab.kv.cache import register_ragged_attention

LOOP = dict(sinks=2, recent=8, chunk_size=64, compress_every=8, window=16, block_size=8)


def test_useful_spec_is_the_asked_needle_in_the_context_tokens() -> None:
    p = tokenize_task(make_task("multi_key", 300, None, 5), None)  # byte vocabulary: token = byte
    spans = [tuple(map(int, r.split(":"))) for r in useful_spec(p, None).split(",")]
    asked = [f for f in p.facts if f.asked]
    assert len(spans) == len(asked) == 1 and len(p.facts) == 4  # one asked needle, three near misses
    a, b = spans[0]
    assert bytes(p.context_ids[a:b]).decode() == asked[0].text
    (ex,) = eval_examples("heldout_ppl", 1, 64, None, 0, target_tokens=4)
    assert useful_spec(ex, None) is None  # a perplexity window has no fact


def test_the_loop_refuses_oracle_labels_without_labels_and_keeps_them_with() -> None:
    model, _ = tiny_model("llama", attn_implementation=register_ragged_attention())
    p = tokenize_task(make_task("needle", 200, None, 1), None)  # ~1000 byte tokens, a ~55-byte needle
    ctx, q = torch.tensor([p.context_ids]), torch.tensor([p.question_ids])
    ans = torch.tensor([list(b" " + p.answer.encode())])
    cfg = DecodeConfig.of(mode="physical", budget=Budget.parse("96"), scorer="oracle_labels", **LOOP)
    with pytest.raises(InputError, match="reads the task's fact labels and none were passed"):
        run_sequence(model, ctx, q, cfg, answer_ids=ans)
    lab = cfg.with_labels(lambda: useful_spec(p, None))
    a, b = map(int, lab.method.scorer_params["useful"].split(":"))
    out = run_sequence(model, ctx, q, lab, answer_ids=ans)
    stream = run_sequence(model, ctx, q, DecodeConfig.of(mode="physical", budget=Budget.parse("96"),
                                                      scorer="streaming_llm", **LOOP), answer_ids=ans)
    for layer, kept in enumerate(out.context_kept):
        for h in range(kept.shape[1]):
            held = set(kept[0, h].tolist()) - {-1}
            assert set(range(a, b)) <= held, (layer, h)  # the needle (96 - 10 floor > its tokens)
    assert not torch.equal(out.logits, stream.logits)  # not StreamingLLM in disguise
    with pytest.raises(InputError, match="useful keys are the task's fact labels"):
        DecodeConfig.of(mode="physical", budget=Budget.parse("96"), scorer="oracle_labels",
                     scorer_params={"useful": "0:1"}, **LOOP).with_labels(lambda: "3:4")
    assert DecodeConfig.of(mode="physical", budget=Budget.parse("96"), scorer="snapkv").with_labels(
        lambda: None).method.scorer_name == "snapkv"  # other scorers need no labels


def test_audit_passes_each_examples_labels() -> None:
    model, _ = tiny_model("llama", attn_implementation=register_ragged_attention())
    examples = task_examples(None, ["needle"], 1, 200, 0)
    loop = LoopSettings(**LOOP)
    df = run_audit(model, examples, audit_configs(["oracle_labels", "streaming_llm"], [Budget.parse("96")], loop=loop,
                                                  modes=("physical",)))
    ev = df.filter(pl.col("mode") == "physical").sort("method")
    assert ev["kl"][0] != ev["kl"][1]  # used to be equal: the same kept entries
    bare = [Example(e.task, e.context_ids, e.question_ids, e.answer_ids) for e in examples]
    with pytest.raises(InputError, match="this example has none"):
        run_audit(model, bare, audit_configs(["oracle_labels"], [Budget.parse("96")], loop=loop, modes=("physical",)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_folder(folder, "llama")
    return folder


def test_eval_run_passes_the_labels(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "evo"
    code = cli.run(["eval", "run", "--models", str(tiny), "--context", "160", "--n", "2", "--budget", "24",
                    "--methods", "oracle_labels,streaming_llm", "--sinks", "2", "--recent", "8",
                    "--out", str(out), "--quiet", "--threads", "1"])
    assert code == 0, capsys.readouterr().err
    res = pl.read_parquet(out / RESULTS)
    o = res.filter(pl.col("method") == "oracle_labels").sort("example")
    s = res.filter(pl.col("method") == "streaming_llm").sort("example")
    assert o.height == s.height == 2
    assert (o["answer_logprob"] != s["answer_logprob"]).any()  # used to be equal on every example


def test_eval_run_refuses_oracle_labels_on_a_task_without_labels(tiny: Path, tmp_path: Path, capsys) -> None:
    code = cli.run(["eval", "run", "--models", str(tiny), "--tasks", "needle,heldout_ppl", "--context", "160",
                    "--methods", "oracle_labels", "--budget", "24", "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and line.startswith("error: --methods: oracle_labels reads the task's fact labels")
    assert not (tmp_path / "g").exists()
    with pytest.raises(InputError):
        GridSpec.build(models=[str(tiny)], tasks=["heldout_ppl"], contexts=[160], methods=["oracle_labels"],
                       budgets=["24"])


def test_decode_runs_oracle_labels_with_the_example_labels(tiny: Path, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "t.parquet"
    code = cli.run(["decode", "--model", str(tiny), "--method", "oracle_labels", "--context", "160",
                    "--budget", "24", "--sinks", "2", "--recent", "8", "--chunk", "64", "--max-new-tokens", "2",
                    "--out", str(tmp_path / "d.json"), "--trace", str(trace), "--threads", "1"])
    assert code == 0, capsys.readouterr().err
    code = cli.run(["decode", "--model", str(tiny), "--method", "oracle_labels", "--scorer-param", "useful=0:1",
                    "--context", "160", "--budget", "24", "--out", str(tmp_path / "e.json")])
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert code == 2 and line[0].startswith("error: --scorer-param: ")
