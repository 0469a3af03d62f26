"""Multi-question task families (evictlab.tasks.synthetic.MULTI_TASKS) and the suite's floor rule.

Checked against the text itself (an independent, exact method): every question's answer
occurs in the context as a whole word only inside the facts it asks for; the token spans of
those facts decode to them under both registry tokenizers and the byte vocabulary; answers
are 1-3 tokens and sit at the asked facts' value spans; examples are seeded; a context
carries the questions asked for, the first equal to the single-question fields.
"""

from __future__ import annotations

import os
import re
from functools import cache

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evictlab.errors import InputError
from evictlab.tasks.examples import RETRIEVAL_TASKS, EVAL_TASKS, encode_text, eval_examples, useful_spec
from evictlab.tasks.suite import KEEP_ACCURACY, SUITE_TASKS, kept_cells, label_floors, suite_tasks
from evictlab.tasks.synthetic import MULTI_TASKS, QUESTIONS, TASKS, fact_token_spans, make_task

MULTI = tuple(MULTI_TASKS)


@cache
def _tokenizer(name: str, folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m", None], ids=["smollm2", "gemma3", "bytes"])
def tok(request, real_model_dir):
    if request.param is None:
        return None
    return _tokenizer(request.param, os.fspath(real_model_dir(request.param)))


def _occurrences(text: str, part: str) -> list[int]:
    return [m.start() for m in re.finditer(rf"(?<!\w){re.escape(part)}(?!\w)", text)]


def _check_answers_in_asked_facts(ex) -> None:
    for q in ex.questions:
        assert q.asked and all(0 <= i < len(ex.facts) for i in q.asked)
        spans = [(ex.facts[i].start, ex.facts[i].end) for i in q.asked]
        for part in q.answers:
            hits = _occurrences(ex.context, part)
            assert hits, (ex.task, part)
            # every occurrence lies inside one of the asked facts, and each part is some asked fact's value
            assert all(any(a <= h < b for a, b in spans) for h in hits), (ex.task, part, hits, spans)
            assert any(ex.facts[i].value and ex.context[slice(*ex.facts[i].value)] == part for i in q.asked)
        assert q.question not in ex.context


@pytest.mark.parametrize("task", MULTI)
def test_families_are_registered(task: str) -> None:
    assert task in TASKS and task in EVAL_TASKS
    assert (task in RETRIEVAL_TASKS) == (task != "vt_chains")
    assert MULTI_TASKS[task] >= QUESTIONS


@settings(max_examples=40)
@given(task=st.sampled_from(MULTI), seed=st.integers(0, 2**31 - 1), context=st.integers(200, 900),
       questions=st.integers(1, 6))
def test_answers_occur_only_in_their_asked_facts(task: str, seed: int, context: int, questions: int) -> None:
    q = min(questions, MULTI_TASKS[task])
    ex = make_task(task, context, None, seed, questions=q)
    assert len(ex.questions) == q and ex.question_set == ex.questions
    assert len(ex.context.split()) <= context  # words are the tokens without a tokenizer
    first = ex.questions[0]
    assert (first.question, first.answer, first.answers) == (ex.question, ex.answer, ex.answers)
    assert tuple(i for i, f in enumerate(ex.facts) if f.asked) == tuple(sorted(first.asked))
    for f in ex.facts:
        assert ex.context[f.start:f.end] == f.text
    # the questions ask different things
    assert len({x.question for x in ex.questions}) == q and len({x.answer for x in ex.questions}) == q
    _check_answers_in_asked_facts(ex)
    assert ex.score(ex.answer) == 1.0 and ex.score("none") == 0.0


@pytest.mark.parametrize("task", MULTI)
def test_deterministic_per_seed(task: str) -> None:
    a = make_task(task, 400, None, 11)
    assert a == make_task(task, 400, None, 11)
    assert a != make_task(task, 400, None, 12)
    assert make_task(task, 400, None, 11, questions=2) != a


@pytest.mark.parametrize("task", MULTI)
def test_spans_answers_and_useful_spec_under_each_tokenizer(task: str, tok) -> None:
    context = 1200 if tok is not None else 500
    for index, ex in enumerate(eval_examples(task, 2, context, tok, seed=3)):
        assert ex == eval_examples(task, 2, context, tok, seed=3)[index]
        qs = ex.questions
        assert len(qs) == QUESTIONS and ex.question_set == qs
        if tok is not None:
            assert len(ex.context_ids) <= context
        synthetic = make_task(task, context, tok, ex.seed)
        # the first question is the single-question fields
        assert (qs[0].question_ids, qs[0].answer, qs[0].answer_ids) == (ex.question_ids, ex.answer, ex.answer_ids)
        spans = fact_token_spans(tok, ex.context_text, ex.facts, ids=ex.context_ids)
        for fact, s in zip(ex.facts, spans):
            got = _decode(tok, ex.context_ids[s["start"]:s["end"]]).strip()
            assert got == fact.text
            va, vb = fact.value
            assert _decode(tok, ex.context_ids[s["value_start"]:s["value_end"]]).strip() == ex.context_text[va:vb]
        for j, q in enumerate(qs):
            assert q.question_ids == encode_text(tok, "\n\n" + synthetic.questions[j].question, special=False)
            assert q.answer_ids == encode_text(tok, " " + q.answer, special=False)
            if tok is not None:
                assert 1 <= len(q.answer_ids) <= 3, (task, q.answer, len(q.answer_ids))
            # every answer part's tokens sit at the end of an asked fact's value span
            for part in q.answers:
                want = encode_text(tok, " " + part, special=False)
                ends = [spans[i]["value_end"] for i in q.asked]
                assert any(ex.context_ids[e - len(want):e] == want for e in ends), (task, part)
            spec = useful_spec(ex, tok, question=j)
            assert spec == ",".join(f"{spans[i]['start']}:{spans[i]['end']}" for i in q.asked)
        with pytest.raises(InputError, match="question"):
            useful_spec(ex, tok, question=len(qs))


def _decode(tok, ids) -> str:
    if tok is None:
        return bytes(ids).decode("utf-8")
    return tok.decode(ids)


def test_line_words_and_tagged_keys_are_single_tokens(real_model_dir) -> None:
    from tokenizers import Tokenizer

    from evictlab.tasks import synthetic

    for m in ("smollm2-135m", "gemma3-270m"):
        t = Tokenizer.from_file(os.fspath(real_model_dir(m) / "tokenizer.json"))
        for w in synthetic._LINE_WORDS + synthetic._COLORS:
            assert len(t.encode(" " + w, add_special_tokens=False).ids) == 1, (m, w)
        for v in (10, 57, 99):  # two-digit numbers: the space and two digits
            assert len(t.encode(f" {v}", add_special_tokens=False).ids) == 3, (m, v)


def test_family_shapes() -> None:
    kw = make_task("keys_word", 600, None, 1)
    assert len(kw.facts) == QUESTIONS + 2 and len({i for q in kw.questions for i in q.asked}) == QUESTIONS
    tagged = make_task("keys_tagged", 600, None, 1)
    for q in tagged.questions:  # each asked key has a near miss: same noun, other qualifier
        key = tagged.context[slice(*tagged.facts[q.asked[0]].key)]
        noun = key.split()[1]
        others = [f for i, f in enumerate(tagged.facts) if i != q.asked[0]
                  and tagged.context[slice(*f.key)].split()[1] == noun]
        assert len(others) == 1
    vw = make_task("values_word", 600, None, 1)
    assert all(len(q.asked) == 2 and q.answer == ", ".join(q.answers) for q in vw.questions)
    vt = make_task("vt_chains", 600, None, 1)
    assert all(f.kind == "assignment" for f in vt.facts)
    for q in vt.questions:  # a chain in order: the value, then two copies, the last one asked about
        texts = [vt.facts[i].text for i in q.asked]
        assert texts[0].endswith(f"= {q.answer}.") and list(q.asked) == sorted(q.asked)
        names = [t.split()[1] for t in texts]
        assert texts[1] == f"VAR {names[1]} = VAR {names[0]}." and texts[2] == f"VAR {names[2]} = VAR {names[1]}."
        assert f"VAR {names[2]}?" in q.question
    ln = make_task("lines", 600, None, 1)
    assert all(f.text.startswith(f"line {i + 1}: ") for i, f in enumerate(ln.facts))
    prose = make_task("keys_word_prose", 600, None, 1)
    assert "The grass is green" not in prose.context and len(prose.facts) == QUESTIONS + 2


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), questions=st.integers(1, MULTI_TASKS["facts_word"]))
def test_facts_word_answer_prefixes_continue_in_one_place(seed: int, questions: int) -> None:
    """facts_word's point: each question's words before the answer occur once in the context,
    inside its fact, and are followed there by the answer; every fact has a template of its own."""
    from evictlab.tasks import synthetic

    ex = make_task("facts_word", 900, None, seed, questions=questions)
    assert len(ex.facts) == questions + 2
    templates = [next(i for i, p in enumerate(synthetic._FACTS) if p.match(f.text)) for f in ex.facts]
    assert len(set(templates)) == len(templates)
    for q in ex.questions:
        prefix = q.question.split("Answer: ", 1)[1]
        (i,) = q.asked
        assert ex.context.count(prefix) == 1 and ex.facts[i].text == f"{prefix} {q.answer}."
        assert ex.context[slice(*ex.facts[i].key)] in prefix.split()


def test_facts_word_patterns_claim_no_other_familys_needles() -> None:
    """The template patterns added for facts_word leave every other task's facts as they were."""
    from evictlab.tasks import synthetic

    for task in TASKS:
        if task == "facts_word":
            continue
        for seed in range(3):
            for f in make_task(task, 600, None, seed).facts:
                assert not any(p.match(f.text) for p in synthetic._FACTS), (task, f.text)


def test_questions_are_checked() -> None:
    with pytest.raises(InputError, match="questions"):
        make_task("needle", 400, None, 0, questions=2)
    with pytest.raises(InputError, match="questions"):
        make_task("keys_word", 400, None, 0, questions=0)
    with pytest.raises(InputError, match="questions"):
        make_task("values_word", 400, None, 0, questions=MULTI_TASKS["values_word"] + 1)
    with pytest.raises(InputError, match="questions"):
        eval_examples("heldout_ppl", 1, 64, None, 0, questions=3)
    assert make_task("needle", 400, None, 0, questions=1) == make_task("needle", 400, None, 0)
    # a single-question task has one question, from its own fields
    one = eval_examples("needle_word", 1, 300, None, 0)[0]
    assert len(one.questions) == 1 and one.questions[0].answer_ids == one.answer_ids


# --------------------------------------------------------------------------- the suite


def _table(accs: dict[tuple[str, str, int], float]) -> pl.DataFrame:
    rows = [{"model": m, "task": t, "context": c, "accuracy": a, "lo": max(0.0, a - 0.1), "hi": min(1.0, a + 0.1)}
            for (m, t, c), a in accs.items()]
    return pl.DataFrame(rows)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12), st.floats(0, 1))
def test_label_floors_keeps_cells_at_the_threshold(accs: list[float], keep: float) -> None:
    table = _table({("m", f"t{i}", 1024): a for i, a in enumerate(accs)})
    out = label_floors(table, keep)
    assert out.columns[:6] == table.columns and out.height == table.height
    for a, kept, label in zip(accs, out["kept"], out["label"]):
        assert kept == (a >= keep) and label == ("kept" if a >= keep else "floor")
    assert kept_cells(table, keep) == [("m", f"t{i}", 1024) for i, a in enumerate(accs) if a >= keep]


def test_suite_constants_and_bad_tables() -> None:
    assert KEEP_ACCURACY == 0.8 and len(SUITE_TASKS) >= 5 and set(SUITE_TASKS) <= set(TASKS)
    t = _table({("a", "x", 1024): 0.8, ("a", "x", 2048): 0.79, ("b", "x", 1024): 1.0, ("a", "y", 1024): 0.9,
                ("b", "y", 1024): 0.5})
    assert label_floors(t)["label"].to_list() == ["kept", "floor", "kept", "kept", "floor"]
    assert suite_tasks(t, models=("a", "b")) == ["x"]
    with pytest.raises(InputError, match="missing"):
        label_floors(t.drop("lo"))
    with pytest.raises(InputError, match="appears 2 times"):
        label_floors(pl.concat([t, t.head(1)]))
    with pytest.raises(InputError, match=r"not in \[0, 1\]"):
        label_floors(t.with_columns(accuracy=pl.Series([1.5, 0, 0, 0, 0])))


def test_task_floor_table_uses_the_clustered_bootstrap() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "task_floor.py"
    spec = importlib.util.spec_from_file_location("task_floor", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from evictlab.stats.bootstrap import Design, bootstrap_mean

    rng = np.random.default_rng(0)
    rows = []
    for ex in range(6):
        for q in range(4):
            rows.append({"model": "m", "task": "keys_word", "context": 1024, "example": ex, "example_seed": ex,
                         "question": q, "context_tokens": 1000, "question_tokens": 20, "answer_tokens": 1,
                         "exact_match": float(rng.random() < 0.7), "first_token": 1.0, "answer_logprob": -0.5})
    frame = pl.DataFrame(rows, schema=mod.ROW_SCHEMA)
    table = mod.floor_table(frame, seed=0, n_boot=300)
    want = bootstrap_mean(frame["exact_match"].to_numpy(), seed=0, key="m/keys_word/1024", n_boot=300,
                          clusters=Design.whole_clusters(frame["example"].to_numpy(), name="context"))
    r = table.row(0, named=True)
    assert (r["accuracy"], r["lo"], r["hi"]) == (want.value, want.lo, want.hi)
    assert r["contexts"] == 6 and r["answers"] == 24 and r["label"] == ("kept" if want.value >= 0.8 else "floor")
    assert "context" in r["interval"]
    assert "| m | `keys_word` | 1024 | 6 (24 answers) |" in mod.markdown(table)
