"""Fact labels at capture: exact token spans under the real tokenizers, the asked rule, the
row dataset's ``facts`` column (schema version 2), old datasets, bad labels, resumed captures."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from evictlab.capture import forward
from evictlab.tasks.sources import build_capture_prompt
from evictlab.tasks.synthetic import TASKS, Fact, fact_token_spans, locate_facts, make_task
from evictlab.capture.config import CaptureConfig
from evictlab.capture.runner import run_capture
from evictlab.capture.testing import ByteTokenizer, tiny_model
from evictlab.errors import InputError
from evictlab.io import sha256_file
from evictlab.rows.reader import RowStore
from evictlab.rows.writer import RowWriter


@cache
def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "bytes"])
@pytest.mark.parametrize("task", TASKS)
def test_spans_decode_to_the_fact_text(name: str, task: str, real_model_dir) -> None:
    # a registry model is pulled into the cache if it is not there (never skipped: a clean
    # clone runs these too)
    tok = ByteTokenizer() if name == "bytes" else _load_tokenizer(real_model_dir(name))
    context = 700 if name == "bytes" else 300  # one byte per token
    for index in range(4):
        prompt = build_capture_prompt(task, context, tok, seed=2, index=index)
        ex = make_task(task, context, tok, 2 * 1_000_003 + index)
        assert prompt.facts is not None and len(prompt.facts) == len(ex.facts) >= 1
        assert all(f["end"] <= prompt.n_context for f in prompt.facts)  # inside the context
        for fact, span in zip(ex.facts, prompt.facts):
            assert ex.context[fact.start:fact.end] == fact.text
            # the tokens give back the fact (a token may carry the space before it)
            assert tok.decode(prompt.tokens[span["start"]:span["end"]]).strip() == fact.text
            for part, (a, b) in (("key", fact.key), ("value", fact.value)):
                got = tok.decode(prompt.tokens[span[f"{part}_start"]:span[f"{part}_end"]]).strip()
                assert got == ex.context[a:b]
        # consecutive, non-overlapping
        ends = [f["end"] for f in prompt.facts][:-1]
        starts = [f["start"] for f in prompt.facts][1:]
        assert all(e <= s for e, s in zip(ends, starts))


def test_asked_rule_per_task() -> None:
    counts = {}
    for task in TASKS:
        ex = make_task(task, 500, None, 11)
        counts[task] = [f.asked for f in ex.facts]
        assert all(f.kind == ("assignment" if task in ("variable_tracking", "vt_chains") else "needle") for f in ex.facts)
    assert counts["needle"] == [True]
    assert counts["multi_needle"] == [True] * 4
    assert sorted(counts["multi_key"]) == [False, False, False, True]  # near-miss needles are not asked
    assert counts["variable_tracking"] == [True] * 5
    mk = make_task("multi_key", 500, None, 11)
    asked = [f for f in mk.facts if f.asked][0]
    assert mk.context[asked.value[0]:asked.value[1]] == mk.answer


def test_locate_facts_parses_templates_and_marks_whole_words() -> None:
    ctx = "noise VAR AB = 123. noise The special magic color for apple is red. One of it: x."
    facts = locate_facts(ctx, ["VAR AB = 123.", "The special magic color for apple is red.", "One of it: x."],
                         ("red",))
    assert [f.kind for f in facts] == ["assignment", "needle", "fact"]
    assert ctx[slice(*facts[0].key)] == "AB" and ctx[slice(*facts[0].value)] == "123"
    assert ctx[slice(*facts[1].key)] == "apple" and ctx[slice(*facts[1].value)] == "red"
    assert facts[2].key is None and [f.asked for f in facts] == [False, True, False]
    assert not locate_facts("credit.", ["credit."], ("red",))[0].asked  # 'red' inside a word is not a mention


class _MergingTokenizer:
    """Offsets where one token spans a fact boundary ('x.One' as one token)."""

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids, offs, i = [], [], 0
        for part in ["ab", "x.O", "ne", " two"]:
            ids.append(len(ids) + 3)
            offs.append((i, i + len(part)))
            i += len(part)
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = offs
        return out


def test_a_fact_boundary_inside_a_token_is_refused() -> None:
    tok = _MergingTokenizer()
    text = "abx.One two"
    fact = Fact("fact", "One two", 4, 11, None, None, True)
    ids = tok(text)["input_ids"]
    with pytest.raises(InputError, match="inside a token"):
        fact_token_spans(tok, text, (fact,), ids=ids)


class _NoOffsetsBPE:
    """No offset mapping, and the tokens of a prefix are not a prefix of the tokens."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [len(text)] + [ord(c) for c in text[::-1]]}


def test_incremental_encoding_refuses_a_tokenizer_whose_prefixes_differ() -> None:
    text = "ab cd"
    fact = Fact("fact", "cd", 3, 5, None, None, True)
    with pytest.raises(InputError, match="not a prefix"):
        fact_token_spans(_NoOffsetsBPE(), text, (fact,), ids=_NoOffsetsBPE()(text)["input_ids"])


# ----------------------------------------------------------------------------- row dataset


def _fact(start: int, end: int, **kw) -> dict:
    return {"kind": "needle", "start": start, "end": end, "key_start": -1, "key_end": -1, "value_start": -1,
            "value_end": -1, "asked": True, **kw}


def _write(path: Path, facts, tokens=10) -> None:
    with RowWriter(path, model="m", capture_mode="query-agnostic", head_dim=4) as w:
        w.add_prompt(0, list(range(tokens)), facts=facts)
        b = w.add_block(0, 0, 0, np.ones((3, 4)), np.ones((3, 4)), [0, 1, 2])
        w.add_query_rows(b, np.ones((1, 4)), [0], [2], [0], [3], 0.5)
        w.end_prompt(0)


def test_labels_round_trip_and_unlabelled_prompts_read_as_null(tmp_path: Path) -> None:
    facts = [_fact(1, 3, value_start=2, value_end=3), _fact(5, 9, asked=False, kind="assignment")]
    _write(tmp_path / "a", facts)
    st = RowStore.open(tmp_path / "a")
    assert st.manifest["schema_version"] == 2
    got = st.prompts["facts"].to_list()[0]
    assert got == facts
    assert st.summary()["labelled_prompts"] == 1
    _write(tmp_path / "b", None)
    st = RowStore.open(tmp_path / "b")
    assert st.prompts["facts"].to_list() == [None] and st.summary()["labelled_prompts"] == 0


@pytest.mark.parametrize(("facts", "match"), [
    ([_fact(8, 12)], r"facts\[0\].*outside the prompt's 10 tokens"),
    ([_fact(-1, 2)], r"facts\[0\].*outside"),
    ([_fact(3, 3)], r"facts\[0\].*empty"),
    ([_fact(1, 5), _fact(4, 7)], r"facts\[1\].*overlaps"),
    ([_fact(4, 7), _fact(1, 3)], r"facts\[1\].*precedes"),
    ([_fact(1, 5, value_start=4, value_end=6)], r"facts\[0\].*value span"),
    ([_fact(1, 5, key_start=2, key_end=-1)], r"facts\[0\].*key span"),
    ([_fact(1, 5, kind="opinion")], r"facts\[0\].*kind"),
    ([_fact(1, 5, asked="yes")], r"facts\[0\].*asked"),
    ([{"start": 1, "end": 2}], r"facts\[0\].*fields"),
    ("1:2", r"facts.*list"),
])
def test_bad_labels_are_refused(tmp_path: Path, facts, match: str) -> None:
    with pytest.raises(InputError, match=match):
        _write(tmp_path / "x", facts)


def _downgrade_to_v1(path: Path) -> None:
    """Rewrite a version-2 dataset as the version-1 writer wrote it (no facts column)."""
    man = json.loads((path / "manifest.json").read_text())
    pl.read_parquet(path / "prompts.parquet").drop("facts").write_parquet(path / "prompts.parquet")
    man["schema_version"] = 1
    man["prompts_sha256"] = sha256_file(path / "prompts.parquet")
    (path / "manifest.json").write_text(json.dumps(man))


def test_version_1_datasets_read_unlabelled_and_stay_version_1(tmp_path: Path) -> None:
    _write(tmp_path / "old", None)
    _downgrade_to_v1(tmp_path / "old")
    st = RowStore.open(tmp_path / "old")
    assert st.manifest["schema_version"] == 1 and st.prompts["facts"].to_list() == [None]
    with RowWriter(tmp_path / "old", model="m", capture_mode="query-agnostic", head_dim=4) as w:
        assert not w.writes_labels and w.schema_version == 1
        with pytest.raises(InputError, match="schema version 1.*no fact labels"):
            w.add_prompt(1, [1, 2, 3], facts=[_fact(0, 2)])
        w.add_prompt(1, [1, 2, 3])
        w.end_prompt(1)
    st = RowStore.open(tmp_path / "old")
    assert st.manifest["schema_version"] == 1 and st.prompts["facts"].to_list() == [None, None]
    assert "facts" not in pl.read_parquet(tmp_path / "old" / "prompts.parquet").columns


# ----------------------------------------------------------------------------- capture

CFG = CaptureConfig(model="tiny-llama", source="multi_key", context=600, positions=4, prompts=3, seed=3,
                    mode="query-aware")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=5)[0]


def test_labels_survive_a_resumed_capture(tmp_path: Path, llama, monkeypatch) -> None:
    tok = ByteTokenizer()
    run_capture(CFG, tmp_path / "full", model=llama, tokenizer=tok, progress=False)
    real, calls = forward.capture_batch, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(forward, "capture_batch", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_capture(CFG, tmp_path / "part", model=llama, tokenizer=tok, progress=False)
    monkeypatch.setattr(forward, "capture_batch", real)
    s = run_capture(CFG, tmp_path / "part", model=llama, tokenizer=tok, progress=False)
    assert s.prompts_skipped == 1 and s.prompts_written == 2
    a, b = RowStore.open(tmp_path / "full").prompts, RowStore.open(tmp_path / "part").prompts
    assert a.select("prompt_id", "tokens", "facts").equals(b.select("prompt_id", "tokens", "facts"))
    for toks, facts, pid in zip(b["tokens"].to_list(), b["facts"].to_list(), b["prompt_id"].to_list()):
        prompt = build_capture_prompt(CFG.source, CFG.context, tok, CFG.seed, pid)
        assert facts == list(prompt.facts)
        asked = [f for f in facts if f["asked"]]
        assert len(asked) == 1 and tok.decode(toks[asked[0]["value_start"]:asked[0]["value_end"]]) == prompt.answer


def test_text_sources_capture_unlabelled(tmp_path: Path, llama) -> None:
    text = tmp_path / "t.txt"
    text.write_text("All the world's a stage, and all the men and women merely players. " * 40)
    cfg = replace(CFG, source=f"file:{text}", mode="query-agnostic", prompts=1, context=200)
    run_capture(cfg, tmp_path / "r", model=llama, tokenizer=ByteTokenizer(), progress=False)
    assert RowStore.open(tmp_path / "r").prompts["facts"].to_list() == [None]
