"""Decode tasks: prompt layout per mode, exact-match normalisation, seeded suites, windows."""

from __future__ import annotations

import pytest

from evictlab.tasks.synthetic import TASKS, make_task
from evictlab.tasks.examples import (
    tokenize_task,
    decode_ids,
    encode_text,
    heldout_windows,
    normalize_answer,
    score_exact_match,
    task_suite,
)
from evictlab.errors import InputError


def test_byte_tokenizer_round_trip() -> None:
    ids = encode_text(None, "VAR QXR = 12345.")
    assert all(0 <= i < 256 for i in ids)
    assert decode_ids(None, ids) == "VAR QXR = 12345."


@pytest.mark.parametrize("task", TASKS)
def test_tokenize_task_splits_context_and_question(task: str) -> None:
    """One split for both protocols (the loop decides when to compress)."""
    ex = make_task(task, 200, None, seed=3)
    p = tokenize_task(ex, None)
    assert p.context_ids == encode_text(None, ex.context)
    assert p.question_ids == encode_text(None, "\n\n" + ex.question, special=False)
    assert p.answer == ex.answer and p.answers == ex.answers


def test_normalize_answer() -> None:
    assert normalize_answer(" The  Number: 12,345.") == "number 12 345"
    assert normalize_answer("ＡＢＣ") == "abc"  # NFKC folds full-width letters
    assert normalize_answer("an apple") == "apple"


@pytest.mark.parametrize(
    ("prediction", "answer", "expect"),
    [
        (" 7312345.", "7312345", 1.0),
        (" 7312345.\nWhat is the next", "7312345", 1.0),
        ("\n\n 7312345\n", "7312345", 1.0),
        (" 7312346.", "7312345", 0.0),
        (" 7312345 or 42", "7312345", 0.0),
        (" QXR BLM, tzk WFP ndv.", "QXR BLM TZK WFP NDV", 1.0),
        (" gold. The grass is green. The sky is blue.", "gold", 1.0),  # facts_word: the next sentence
        (" gold and red. The grass is green.", "gold", 0.0),
        (" 1234567, 7654321. The grass", "1234567, 7654321", 1.0),
        (" gold.The grass", "gold", 0.0),  # no space: not a sentence end
        ("", "7312345", 0.0),
        ("", "", 0.0),
    ],
)
def test_score_exact_match(prediction: str, answer: str, expect: float) -> None:
    assert score_exact_match(prediction, answer) == expect


def test_task_suite_deterministic_ordered_and_extends() -> None:
    a = task_suite(["needle", "variable_tracking"], 3, 150, None, seed=5)
    b = task_suite(["needle", "variable_tracking"], 3, 150, None, seed=5)
    assert a == b
    assert [p.task for p in a] == ["needle"] * 3 + ["variable_tracking"] * 3
    assert len({tuple(p.context_ids) for p in a}) == 6  # distinct examples
    bigger = task_suite(["needle"], 4, 150, None, seed=5)
    assert bigger[:3] == a[:3]
    assert task_suite(["needle"], 1, 150, None, seed=6)[0] != a[0]
    with pytest.raises(InputError, match="tasks"):
        task_suite(["haystack"], 1, 150, None, seed=0)
    with pytest.raises(InputError, match="n"):
        task_suite(["needle"], 0, 150, None, seed=0)


def test_answer_is_in_context_for_needle() -> None:
    p = task_suite(["needle"], 1, 300, None, seed=1)[0]
    assert p.answer in decode_ids(None, p.context_ids)


TEXT = "".join(f"Line {i}: to be or not to be, that is the question.\n" for i in range(400))


def test_heldout_windows_seeded_and_sized() -> None:
    w1 = heldout_windows(None, 3, 60, 20, seed=2, text=TEXT)
    w2 = heldout_windows(None, 3, 60, 20, seed=2, text=TEXT)
    assert w1 == w2
    for w in w1:
        assert len(w.context_ids) == 60 and len(w.target_ids) == 20
        assert decode_ids(None, w.context_ids).startswith("Line ")  # starts at a line start
        assert decode_ids(None, w.context_ids + w.target_ids) in TEXT
    assert len({tuple(w.context_ids) for w in w1}) == 3
    with pytest.raises(InputError, match="context_tokens"):
        heldout_windows(None, 1, 10_000, 10, seed=0, text=TEXT)


@pytest.mark.parametrize("task", ["needle_word", "multi_key_word", "multi_value"])
def test_easy_variants_answer_in_the_needles_format(task: str) -> None:
    from evictlab.tasks.synthetic import _NOISE  # same package family: the filler the needles hide in

    for seed in range(5):
        ex = make_task(task, 300, None, seed=seed)
        for part in ex.answers:
            assert part in ex.context and part not in _NOISE
        if task == "multi_value":
            assert len(ex.answers) == 2 and ex.answer == ", ".join(ex.answers) and ex.question.endswith("are:")
            assert all(f"is: {v}." in ex.context for v in ex.answers)
        else:  # colour words: the needle says "is COLOR." and the question ends with "is"
            assert len(ex.answers) == 1 and f"is {ex.answer}." in ex.context and ex.question.endswith("is")


def test_colour_answers_are_one_token_in_the_registry_models(real_model_dir) -> None:
    import os

    from tokenizers import Tokenizer

    from evictlab.tasks import synthetic

    for m in ("smollm2-135m", "gemma3-270m"):  # pulled into the cache if not there (never skipped)
        # the fast tokenizer's own file: what AutoTokenizer wraps, without its start-up
        tok = Tokenizer.from_file(os.fspath(real_model_dir(m) / "tokenizer.json"))
        for c in synthetic._COLORS:
            assert len(tok.encode(" " + c, add_special_tokens=False).ids) == 1, (m, c)
