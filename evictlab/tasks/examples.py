"""Tasks for the decode loop: tokenised prompts, exact-match scoring, seeded suites, and
held-out Shakespeare windows for perplexity.

The examples themselves come from :mod:`evictlab.tasks.synthetic` (``make_task``) and
:mod:`evictlab.tasks.corpus` (the Shakespeare corpus); this module only turns them into what the decode loop consumes:
context ids and question ids *separately*. The protocol (query-agnostic: the context is
compressed before the question is appended; query-aware: the compression runs after the
question; docs/theory.md section 9) is the decode loop's (``DecodeConfig.query_aware``,
docs/kv.md), not the prompt's: both protocols get the same split.

Tokenizer None means the byte-level vocabulary of the tiny test models
(:func:`evictlab.capture.testing.tiny_model`, 256 ids): token ids are the UTF-8 bytes.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evictlab.tasks.corpus import encode_text, heldout_split
from evictlab.tasks.distractors import make_example, parse_task
from evictlab.tasks.synthetic import TASKS, Fact, Question, TaskExample, check_questions, fact_token_spans, make_task
from evictlab.errors import InputError

__all__ = [
    "PerplexityWindow",
    "PromptQuestion",
    "TaskPrompt",
    "tokenize_task",
    "EVAL_TASKS",
    "EvalExample",
    "HELDOUT_PPL",
    "RETRIEVAL_TASKS",
    "decode_ids",
    "dilution_example",
    "encode_text",
    "eval_examples",
    "heldout_windows",
    "is_eval_task",
    "normalize_answer",
    "score_exact_match",
    "task_suite",
    "useful_spec",
]

def decode_ids(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of generated ids (special tokens dropped); the inverse of :func:`encode_text`."""
    if tokenizer is None:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")
    return tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass(frozen=True)
class PromptQuestion:
    """One tokenised question of a context: ``question_ids`` (fed after the context, no
    BOS), ``answer`` and its parts ``answers``, ``answer_ids`` (the answer's ids as the
    continuation of the answer prefix; empty where not tokenised) and ``asked``, the indices
    into the example's ``facts`` that the question asks for."""

    question_ids: list[int]
    answer: str
    answers: tuple[str, ...] = ()
    answer_ids: list[int] = field(default_factory=list)
    asked: tuple[int, ...] = ()


def _asked(facts: Sequence[Fact]) -> tuple[int, ...]:
    return tuple(i for i, f in enumerate(facts) if f.asked)


@dataclass(frozen=True)
class TaskPrompt:
    """One example ready for the decode loop.

    ``context_ids`` (the haystack, with the tokenizer's BOS) are fed first, then
    ``question_ids`` (``"\\n\\n" + question``, ending with an answer prefix); the model's
    continuation is compared with ``answer``. When the cache is compressed relative to the
    question is the decode loop's protocol (``DecodeConfig.query_aware``), not the prompt's.
    ``context_text`` and ``facts`` (the inserted needles, :class:`~evictlab.tasks.synthetic.Fact`)
    give the example's labels (:func:`useful_spec`).
    """

    task: str
    seed: int
    context_ids: list[int]
    question_ids: list[int]
    answer: str
    answers: tuple[str, ...]
    context_text: str = ""
    facts: tuple[Fact, ...] = ()
    #: every question when the context is asked several (the first is the fields above)
    question_set: tuple[PromptQuestion, ...] = ()

    @property
    def questions(self) -> tuple[PromptQuestion, ...]:
        """Every question of this context (at least one; the first is ``question_ids``)."""
        return self.question_set or (PromptQuestion(list(self.question_ids), self.answer, self.answers,
                                                    [], _asked(self.facts)),)


def _tokenize_question(q: Question, tokenizer: Any) -> PromptQuestion:
    return PromptQuestion(encode_text(tokenizer, "\n\n" + q.question, special=False), q.answer,
                          q.answers or (q.answer,), encode_text(tokenizer, " " + q.answer, special=False), q.asked)


def tokenize_task(example: TaskExample, tokenizer: Any) -> TaskPrompt:
    """Tokenise ``example`` into separate context and question ids (see :class:`TaskPrompt`).

    The context gets the tokenizer's special prefix (BOS), the question none; the question
    text is ``"\\n\\n" + example.question``, as in capture's prompts.
    """
    ctx = encode_text(tokenizer, example.context)
    q = encode_text(tokenizer, "\n\n" + example.question, special=False)
    qs = tuple(_tokenize_question(x, tokenizer) for x in example.question_set)
    return TaskPrompt(task=example.task, seed=example.seed, context_ids=ctx, question_ids=q,
                      answer=example.answer, answers=example.answers or (example.answer,),
                      context_text=example.context, facts=example.facts, question_set=qs)


def useful_spec(example: Any, tokenizer: Any, question: int = 0) -> str | None:
    """The task's labels as the ``useful`` parameter of the ``oracle_labels`` scorer: the
    token spans, in ``example.context_ids``, of the facts question number ``question`` asks
    for (``"120:139,400:419"``, half-open); None when it asks for no fact (a ``heldout_ppl``
    window). ``example``: a :class:`TaskPrompt` or :class:`EvalExample`.
    Computed on demand (only a run of ``oracle_labels`` needs it)."""
    qs = example.questions
    if not 0 <= question < len(qs):
        raise InputError("question", f"question {question} of an example with {len(qs)}",
                         f"use 0..{len(qs) - 1}")
    asked = tuple(example.facts[i] for i in qs[question].asked)
    if not asked:
        return None
    spans = fact_token_spans(tokenizer, example.context_text, asked, ids=list(example.context_ids))
    return ",".join(f"{s['start']}:{s['end']}" for s in spans)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NON_WORD = re.compile(r"[^0-9a-z]+")


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: NFKC, lower case, punctuation -> space, drop a/an/the,
    collapse whitespace. ``" The  number: 12,345."`` -> ``"number 12 345"``."""
    t = unicodedata.normalize("NFKC", text).lower()
    t = _NON_WORD.sub(" ", t)
    t = _ARTICLES.sub(" ", t)
    return " ".join(t.split())


def score_exact_match(prediction: str, answer: str) -> float:
    """1.0 if the prediction's first sentence of its first non-empty line equals the answer
    after normalisation.

    Only that much counts, because a greedy continuation runs on past the answer, onto the
    next line (``" 7312345.\\nWhat is ..."``) or, after a sentence that completes a fact,
    into the next sentence on the same line (``" gold. The grass is green."``: ``facts_word``,
    whose answer ends a sentence of the haystack's kind); a sentence ends at ``.``, ``!`` or
    ``?`` followed by a space. Both sides go through :func:`normalize_answer`, so case,
    punctuation, articles and spacing do not matter but every word and digit does. (For
    RULER's lenient "all parts found anywhere" score use ``TaskExample.score``.)
    """
    lines = [ln for ln in prediction.strip().splitlines() if ln.strip()]
    first = re.split(r"(?<=[.!?])\s", lines[0].strip(), maxsplit=1)[0] if lines else ""
    return float(normalize_answer(first) == normalize_answer(answer) and normalize_answer(answer) != "")


def task_suite(
    names: Sequence[str], n: int, context_tokens: int, tokenizer: Any, seed: int, *, questions: int | None = None,
) -> list[TaskPrompt]:
    """``n`` seeded examples of each task in ``names``, tokenised (ordered by task, then index).

    Example ``i`` of a suite with ``seed`` uses ``seed * 1_000_003 + i`` (``make_task`` also
    mixes in the task), so suites are reproducible and a larger ``n`` extends a smaller one.
    ``questions``: questions per context of the multi-question families
    (:func:`~evictlab.tasks.synthetic.check_questions`; None: each task's default, 1 for the
    single-question tasks).
    """
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise InputError("tasks", f"unknown task(s) {unknown}", f"use some of: {', '.join(TASKS)}")
    if n < 1:
        raise InputError("n", f"{n} examples", "use n >= 1")
    return [tokenize_task(make_task(t, context_tokens, tokenizer, seed * 1_000_003 + i, questions=questions),
                          tokenizer)
            for t in names for i in range(n)]


@dataclass(frozen=True)
class PerplexityWindow:
    """A held-out Shakespeare window: ``context_ids`` are compressed, then the model is scored
    on predicting each of ``target_ids`` (teacher forcing) from the compressed cache."""

    seed: int
    context_ids: list[int]
    target_ids: list[int]


def heldout_windows(
    tokenizer: Any, n: int, context_tokens: int, target_tokens: int, seed: int, *, text: str | None = None
) -> list[PerplexityWindow]:
    """``n`` seeded windows of ``context_tokens + target_tokens`` tokens from held-out text.

    Each window starts at a seeded line start of ``text`` (default: the held-out part of
    :func:`heldout_split`); the context gets the tokenizer's special prefix (BOS). Window
    ``i`` uses ``numpy.random.default_rng([seed, i])``.
    """
    if n < 1 or context_tokens < 1 or target_tokens < 1:
        raise InputError("windows", f"n={n}, context={context_tokens}, target={target_tokens}",
                         "use positive counts")
    if text is None:
        text = heldout_split()[1]
    need = context_tokens + target_tokens
    windows = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        span = 8 * need + 256  # ~4 characters per token; twice that so one tokenisation suffices
        if span >= len(text):
            raise InputError("context_tokens", f"{need} tokens is longer than the held-out text",
                             "use shorter windows")
        start = int(rng.integers(0, len(text) - span))
        start = text.find("\n", start) + 1
        ids = encode_text(tokenizer, text[start:start + span])
        if len(ids) < need:
            raise InputError("context_tokens", f"{need} tokens did not fit in {span} characters",
                             "use shorter windows")
        windows.append(PerplexityWindow(seed=seed, context_ids=ids[:context_tokens],
                                        target_ids=ids[context_tokens:need]))
    return windows


# --------------------------------------------------------------------------- evaluation examples

HELDOUT_PPL = "heldout_ppl"
"""The fidelity task of the evaluation grid: perplexity on held-out Shakespeare windows."""
EVAL_TASKS: tuple[str, ...] = (*TASKS, HELDOUT_PPL)
"""The fixed task names the evaluation grid accepts: the synthetic task families and
``heldout_ppl``; beside them the dilution tasks ``dilution_KIND_kK`` (:func:`is_eval_task`)."""
RETRIEVAL_TASKS: tuple[str, ...] = tuple(t for t in TASKS if t not in ("variable_tracking", "vt_chains"))
"""The tasks whose answer is copied from one or more inserted facts found by their key (the
needle family, ``lines`` included; not the variable-tracking tasks, whose answer needs a chain
of facts followed)."""


def is_eval_task(task: str) -> bool:
    """Whether the evaluation grid runs ``task``: one of :data:`EVAL_TASKS` or a dilution task
    ``dilution_KIND_kK`` (:func:`evictlab.tasks.distractors.parse_task`, which refuses a
    malformed one: InputError, field ``tasks``)."""
    return task in EVAL_TASKS or parse_task(task) is not None


@dataclass(frozen=True)
class EvalExample:
    """One example of the evaluation grid, as token ids for the decode loop.

    ``context_ids`` are fed first, then ``question_ids``; ``answer_ids`` are teacher-forced
    and scored (``answer`` is their text). ``index`` is the example's position in its suite,
    ``seed`` the seed that built it. For ``heldout_ppl`` the "question" is the window's last
    context token and the "answer" the target tokens (there is no question to be aware of).
    ``context_text`` and ``facts`` give the labels, as :class:`TaskPrompt`'s (none for
    ``heldout_ppl``).
    """

    task: str
    index: int
    seed: int
    context_ids: list[int]
    question_ids: list[int]
    answer_ids: list[int]
    answer: str
    context_text: str = ""
    facts: tuple[Fact, ...] = ()
    #: every question when the context is asked several (the first is the fields above)
    question_set: tuple[PromptQuestion, ...] = ()

    @property
    def questions(self) -> tuple[PromptQuestion, ...]:
        """Every question of this context (at least one; the first is ``question_ids``)."""
        return self.question_set or (PromptQuestion(list(self.question_ids), self.answer, (self.answer,),
                                                    list(self.answer_ids), _asked(self.facts)),)


def eval_examples(task: str, n: int, context_tokens: int, tokenizer: Any, seed: int, *,
                  target_tokens: int = 32, questions: int | None = None) -> list[EvalExample]:
    """``n`` seeded examples of ``task`` (one of :data:`EVAL_TASKS`) for the evaluation grid.

    Synthetic tasks: example ``i`` is :func:`task_suite`'s (seed ``seed * 1_000_003 + i``),
    the answer ids are ``encode_text(" " + answer)`` (no BOS: the continuation of the
    answer prefix). A multi-question family (``questions`` per context, its default when
    None) fills ``question_set`` with every question's ``question_ids`` and ``answer_ids``
    (the same rule), the first equal to the example's own fields. ``heldout_ppl``:
    :func:`heldout_windows` of ``context_tokens + target_tokens`` tokens (window ``i`` from
    ``default_rng([seed, i])``), split as context = all but the last context token, question
    = that token, answer = the targets (one question; ``questions`` must be None or 1).
    A dilution task ``dilution_KIND_kK``: example ``i`` is
    :func:`evictlab.tasks.distractors.make_example`'s (``context_tokens`` filler tokens
    besides the needles, drawn from ``(seed, i)``: the sweep's example), with its labels
    (:func:`dilution_example`; one question).
    """

    if task == HELDOUT_PPL:
        check_questions(task, questions)
        if context_tokens < 2:
            raise InputError("context_tokens", f"{context_tokens} tokens", "use at least 2 context tokens")
        wins = heldout_windows(tokenizer, n, context_tokens, target_tokens, seed)
        return [EvalExample(task, i, seed, w.context_ids[:-1], w.context_ids[-1:], list(w.target_ids),
                            decode_ids(tokenizer, w.target_ids)) for i, w in enumerate(wins)]
    if parse_task(task) is not None:
        if questions not in (None, 1):
            raise InputError("questions", f"{task} asks one question per context, not {questions}",
                             "use 1, or leave it out")
        if n < 1:
            raise InputError("n", f"{n} examples", "use n >= 1")
        return [dilution_example(tokenizer, task, i, context_tokens, seed) for i in range(n)]
    if task not in TASKS:
        raise InputError("task", f"unknown task {task!r}", f"use one of: {', '.join(EVAL_TASKS)}")
    return [EvalExample(task, i, seed * 1_000_003 + i, p.context_ids, p.question_ids,
                        encode_text(tokenizer, " " + p.answer, special=False), p.answer,
                        context_text=p.context_text, facts=p.facts, question_set=p.question_set)
            for i, p in enumerate(task_suite([task], n, context_tokens, tokenizer, seed, questions=questions))]


def dilution_example(tokenizer: Any, task: str, index: int, filler: int, seed: int) -> EvalExample:
    """Example ``index`` of the dilution task ``task`` (``dilution_KIND_kK``) as an
    :class:`EvalExample`: :func:`evictlab.tasks.distractors.make_example` with ``K``
    distractors of ``KIND``, ``filler`` filler tokens (the grid's context length) and the
    grid's ``seed`` (``seed`` here is that seed: the example is drawn from ``(seed, index)``,
    as the sweep's), with its labels (the needles as facts, the asked one marked), so the
    label ORACLE and the trace's fact columns read them. InputError (field ``tasks``) for a
    name :func:`~evictlab.tasks.distractors.parse_task` refuses, (field ``contexts``) for a
    filler the haystack cannot fill."""
    parsed = parse_task(task)
    if parsed is None:
        raise InputError("tasks", f"{task!r} is not a dilution task", "name one like dilution_near_miss_k16")
    kind, k = parsed
    if filler < 64:
        raise InputError("contexts", f"{filler} filler tokens is too short", "use at least 64")
    try:
        ex = make_example(tokenizer, index, k, filler=filler, kind=kind, seed=seed)
    except InputError as exc:
        raise InputError("contexts", exc.problem, exc.fix) from None
    return EvalExample(task=task, index=index, seed=seed, context_ids=ex.context_ids, question_ids=ex.question_ids,
                       answer_ids=ex.answer_ids, answer=ex.value, context_text=ex.context_text, facts=ex.labels)
