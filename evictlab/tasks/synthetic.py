"""Synthetic tasks and their fact labels.

Synthetic tasks (in the style of RULER; ours)
    The haystack is RULER's "noise" filler (the same five short sentences repeated), so
    tasks need no download and the only salient content is the needles. Needle depths, keys
    and values come from ``numpy.random.default_rng(seed)``; the same (task, context length,
    tokenizer, seed) always gives the same example. Answers are short strings scored by exact
    string match (:meth:`TaskExample.score`).

    - ``needle``: one "special magic number" for a key word; asked for it.
    - ``multi_needle``: four magic numbers for the *same* key at different depths; asked for
      all of them (RULER's multi-value), answer = the values in order of appearance.
    - ``multi_key``: four needles with different keys; asked for one key's number.
    - ``variable_tracking``: ``VAR A = 12345`` then a chain of four assignments
      ``VAR B = VAR A`` ... scattered in the haystack; asked which variables hold 12345,
      answer = the five names in chain order.

    Easier variants (ours), added because the 135M-270M models sit at the floor on
    ``multi_needle`` and ``variable_tracking`` (and Gemma 3 270M on ``multi_key``, whose
    answers it prefixes with the needles' colon) with the full cache (docs/evaluation.md,
    the context-length sweep). Their answer follows the question in the needles' own format:

    - ``needle_word``: "The special magic color for KEY is COLOR." once; asked for it. The
      answer is one token (a colour word absent from the haystack's filler) in both models.
    - ``multi_key_word``: four such needles with different keys and colours; asked for one.
    - ``multi_value``: two magic numbers for the same key (``multi_needle`` with two values);
      the question ends with the needles' colon, answer = both values in order.

Fact labels (ours; used by :mod:`evictlab.dilution`)
    Every inserted needle or assignment is a :class:`Fact`: its character span in the
    context, the spans of its key and value where the template has them, and whether the
    question asks for it (:func:`locate_facts`). :func:`fact_token_spans` turns the character
    spans into exact token spans under the prompt's tokenizer (from the tokenizer's offset
    mapping, or by incremental encoding for tokenizers without one), and checks that the
    tokens cover the fact and nothing but whitespace besides. Text sources have no facts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evictlab.errors import InputError
from evictlab.tasks.corpus import encode

TASKS = ("needle", "multi_needle", "multi_key", "variable_tracking", "needle_word", "multi_key_word", "multi_value")

# RULER's noise haystack: content-free, so attention to it is a pure distractor.
_NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
# Key words for needles: common, single-token-ish nouns, distinct from the noise words.
_KEYS = ("apple", "river", "candle", "tiger", "garden", "piano", "castle", "rocket",
         "forest", "mirror", "violin", "harbor", "lantern", "meadow", "falcon", "glacier")
# Single-token colour words (SmolLM2 and Gemma 3 tokenizers, with a leading space), none of
# them in the filler (which says green, blue and yellow).
_COLORS = ("red", "gold", "pink", "gray", "black", "white", "brown", "purple", "orange", "silver", "violet", "amber")
_VARS = ("QXR", "BLM", "TZK", "WFP", "NDV", "HGS", "YCJ", "PUE", "KRO", "MZA", "SLT", "VOB")


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Question:
    """One question asked of a context: ``question`` (ends with an answer prefix),
    ``answer`` (the exact string expected; ``answers`` its parts when there are several) and
    ``asked``, the indices into the example's ``facts`` that this question asks for."""

    question: str
    answer: str
    answers: tuple[str, ...] = ()
    asked: tuple[int, ...] = ()


@dataclass(frozen=True)
class TaskExample:
    """One synthetic long-context example.

    ``context`` is the haystack with the needles (about ``context_tokens`` tokens);
    ``question`` ends with an answer prefix so the model's continuation is the answer;
    ``answer`` is the exact string expected (``answers`` lists its parts when there are
    several, e.g. multi-value needles); ``seed`` reproduces the example. ``facts`` are the
    inserted needles / assignments in order of appearance (:func:`locate_facts`).
    """

    task: str
    context: str
    question: str
    answer: str
    seed: int
    answers: tuple[str, ...] = field(default=())
    facts: tuple[Fact, ...] = field(default=())
    #: the questions asked of this context; empty means the one (question, answer, answers)
    #: above. A multi-question task lists them all, the first equal to the fields above.
    question_set: tuple[Question, ...] = field(default=())

    @property
    def questions(self) -> tuple[Question, ...]:
        """Every question of this context (at least one; the first is ``question``)."""
        if self.question_set:
            return self.question_set
        asked = tuple(i for i, f in enumerate(self.facts) if f.asked)
        return (Question(self.question, self.answer, self.answers or (self.answer,), asked),)

    def score(self, prediction: str) -> float:
        """Fraction of the expected answer parts found verbatim in ``prediction`` (RULER)."""
        parts = self.answers or (self.answer,)
        return sum(p in prediction for p in parts) / len(parts)


def _count(tokenizer: Any, text: str) -> int:
    if tokenizer is None:  # no tokenizer (tiny test models): whitespace words as tokens
        return len(text.split())
    return len(encode(tokenizer, text))


def _haystack(tokenizer: Any, needles: list[str], context_tokens: int, rng: np.random.Generator,
              field: str = "--context") -> str:
    """Noise filler with ``needles`` inserted at seeded, increasing depths, fitted to the budget."""
    needle_tokens = sum(_count(tokenizer, n) for n in needles)
    per_noise = max(1, _count(tokenizer, _NOISE * 20) // 20)
    n_noise = max(len(needles) + 1, (context_tokens - needle_tokens) // per_noise)
    # depths as fractions of the haystack, distinct, sorted: needles appear in this order
    depths = np.sort(rng.uniform(0.05, 0.95, size=len(needles)))

    def build(n: int) -> str:
        slots = [int(round(d * n)) for d in depths]
        out: list[str] = []
        k = 0
        for i in range(n + 1):
            while k < len(needles) and slots[k] == i:
                out.append(needles[k] + " ")
                k += 1
            if i < n:
                out.append(_NOISE)
        return "".join(out).strip()

    text = build(n_noise)
    # shrink until within budget (token counts of the repeated filler are near-linear in n)
    while (over := _count(tokenizer, text) - context_tokens) > 0:
        if n_noise <= 1:
            raise InputError(field, f"{context_tokens} tokens cannot hold the task's needles "
                             "and any filler", f"use a longer context (at least {context_tokens + over + per_noise})")
        n_noise = max(1, n_noise - max(1, over // per_noise))
        text = build(n_noise)
    return text


def _number(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def make_task(task: str, context_tokens: int, tokenizer: Any, seed: int, *, field: str = "--context") -> TaskExample:
    """A seeded RULER-style example whose context is at most ``context_tokens`` tokens.

    ``tokenizer`` counts tokens (a Hugging Face tokenizer, or None to count words). An
    unknown ``task`` is an InputError with the neutral field ``task`` (capture checks its
    ``--source`` before calling; ``decode``/``audit`` report it as ``--task``). A context too
    short for the task is an InputError naming ``field``: the caller's option that sets the
    length (``--context`` by default; ``gates train`` passes ``--seq-len``).
    """
    if task not in TASKS:
        raise InputError("task", f"unknown task {task!r}", f"use one of: {', '.join(TASKS)}")
    if context_tokens < 64:
        raise InputError(field, f"{context_tokens} tokens is too short for a task",
                         "use at least 64 tokens")
    rng = np.random.default_rng([seed, TASKS.index(task)])
    if task == "needle":
        key, val = str(rng.choice(_KEYS)), _number(rng)
        needles = [f"One of the special magic numbers for {key} is: {val}."]
        question = (f"What is the special magic number for {key} mentioned in the provided text? "
                    f"Answer: The special magic number for {key} mentioned in the provided text is")
        answers: tuple[str, ...] = (val,)
    elif task in ("multi_needle", "multi_value"):
        key = str(rng.choice(_KEYS))
        vals = [_number(rng) for _ in range(4 if task == "multi_needle" else 2)]
        needles = [f"One of the special magic numbers for {key} is: {v}." for v in vals]
        # multi_value ends with the needles' colon, so the answer follows in their format
        question = (f"What are all the special magic numbers for {key} mentioned in the provided text? "
                    f"Answer: The special magic numbers for {key} mentioned in the provided text are"
                    + (":" if task == "multi_value" else ""))
        answers = tuple(vals)
    elif task in ("multi_key", "multi_key_word"):
        keys = [str(k) for k in rng.choice(_KEYS, size=4, replace=False)]
        if task == "multi_key":
            vals = [_number(rng) for _ in keys]
            needle = "One of the special magic numbers for {k} is: {v}."
            ask_for = ("What is the special magic number for {k} mentioned in the provided text? "
                       "Answer: The special magic number for {k} mentioned in the provided text is")
        else:
            vals = [str(c) for c in rng.choice(_COLORS, size=4, replace=False)]
            needle = "The special magic color for {k} is {v}."
            ask_for = "What is the special magic color for {k}? Answer: The special magic color for {k} is"
        needles = [needle.format(k=k, v=v) for k, v in zip(keys, vals)]
        ask = int(rng.integers(0, len(keys)))
        question = ask_for.format(k=keys[ask])
        answers = (vals[ask],)
    elif task == "needle_word":
        key, color = str(rng.choice(_KEYS)), str(rng.choice(_COLORS))
        needles = [f"The special magic color for {key} is {color}."]
        question = f"What is the special magic color for {key}? Answer: The special magic color for {key} is"
        answers = (color,)
    else:  # variable_tracking
        names = [str(v) for v in rng.choice(_VARS, size=5, replace=False)]
        val = str(int(rng.integers(10_000, 100_000)))
        needles = [f"VAR {names[0]} = {val}."] + [
            f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
        question = (f"Find all variables that are assigned the value {val} in the text above. "
                    f"Answer: According to the chain(s) of variable assignment in the text above, "
                    f"5 variables are assigned the value {val}, they are:")
        answers = tuple(names)
    context = _haystack(tokenizer, needles, context_tokens, rng, field)
    return TaskExample(task=task, context=context, question=question,
                       answer=" ".join(answers) if task == "variable_tracking" else ", ".join(answers),
                       seed=seed, answers=answers, facts=locate_facts(context, needles, answers))


# --------------------------------------------------------------------------- fact labels

#: Kinds of inserted facts: a magic-number (or any "... for KEY is VALUE.") needle, and a
#: variable assignment ``VAR KEY = VALUE.``. A template neither pattern parses is a
#: ``fact`` (its span only, no key or value span).
FACT_KINDS = ("needle", "assignment", "fact")
_ASSIGNMENT = re.compile(r"^VAR (?P<key>\S+) = (?P<value>.+?)\.$")
_NEEDLE = re.compile(r"^.* for (?P<key>.+?) is:? (?P<value>\S+?)\.$")


@dataclass(frozen=True)
class Fact:
    """One inserted fact of a task context, as character spans of ``TaskExample.context``.

    ``context[start:end] == text``; ``key`` and ``value`` are the ``(start, end)`` character
    spans of the fact's key (the needle's key word, the assigned variable) and value (the
    magic number, the right-hand side), or None when the template has none. ``asked``: the
    question asks for this fact (:func:`locate_facts`).
    """

    kind: str
    text: str
    start: int
    end: int
    key: tuple[int, int] | None
    value: tuple[int, int] | None
    asked: bool


def _mentions(text: str, part: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(part)}(?!\w)", text) is not None


def locate_facts(context: str, needles: list[str], answers: tuple[str, ...]) -> tuple[Fact, ...]:
    """The :class:`Fact` of every needle of ``needles`` (in the order they appear in ``context``).

    Rule (ours): a fact is **asked** when its text states part of the answer, i.e. one of
    ``answers`` occurs in it as a whole word. So the one needle of ``needle``, all four of
    ``multi_needle``, the asked key's needle of ``multi_key`` (the other three are near-miss
    distractors: other keys, other values) and all five assignments of
    ``variable_tracking`` (each names one answer variable) are asked.
    """
    facts: list[Fact] = []
    at = 0
    for text in needles:
        start = context.find(text, at)
        if start < 0:  # _haystack keeps every needle, in order: this is a bug, not bad input
            raise RuntimeError(f"needle {text!r} is not in the context after character {at}")
        end = start + len(text)
        kind, key, value = "fact", None, None
        for name, pattern in (("assignment", _ASSIGNMENT), ("needle", _NEEDLE)):
            m = pattern.match(text)
            if m:
                kind = name
                key = (start + m.start("key"), start + m.end("key"))
                value = (start + m.start("value"), start + m.end("value"))
                break
        facts.append(Fact(kind, text, start, end, key, value, any(_mentions(text, a) for a in answers)))
        at = end
    return tuple(facts)


def haystack(tokenizer: Any, needles: list[str], context_tokens: int, rng: np.random.Generator) -> str:
    """Noise filler with ``needles`` at seeded increasing depths, at most ``context_tokens`` tokens
    (the tasks' own haystack, for task generators elsewhere, e.g. :mod:`evictlab.tasks.distractors`)."""
    return _haystack(tokenizer, needles, context_tokens, rng)


def _char_offsets(tokenizer: Any, text: str, special: bool, ids: list[int]) -> list[tuple[int, int]] | None:
    """Character ``(start, end)`` of every token of ``ids`` from the tokenizer's offset mapping,
    or None when the tokenizer has none (then :func:`fact_token_spans` encodes prefixes)."""
    if tokenizer is None:  # the byte vocabulary: token i is byte i of the UTF-8 text
        out = []
        for pos, ch in enumerate(text):
            out += [(pos, pos + 1)] * len(ch.encode("utf-8"))
        return out
    try:
        enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (TypeError, NotImplementedError, KeyError, ValueError):
        return None
    if list(enc["input_ids"]) != ids:
        return None
    return [(int(a), int(b)) for a, b in offsets]


def _span_by_prefix(tokenizer: Any, text: str, special: bool, ids: list[int], a: int, b: int) -> tuple[int, int]:
    """Token span of characters ``[a, b)`` by incremental encoding: the tokens of ``text[:a]``
    and of ``text[:b]`` must be prefixes of ``ids`` (true of byte and character vocabularies;
    a tokenizer that merges across the boundary is refused)."""
    lo = encode(tokenizer, text[:a], special=special)
    hi = encode(tokenizer, text[:b], special=special)
    if ids[:len(lo)] != lo or ids[:len(hi)] != hi:
        raise InputError("tokenizer", f"tokens of the text before character {a} or {b} are not a prefix of the "
                         "text's tokens, and the tokenizer has no offset mapping",
                         "use a fast (Rust) tokenizer, which reports offsets")
    return len(lo), len(hi)


def fact_token_spans(tokenizer: Any, text: str, facts: tuple[Fact, ...], *, ids: list[int],
                     special: bool = True) -> tuple[dict[str, Any], ...]:
    """Exact token spans of ``facts`` in ``ids`` = the tokens of ``text`` (``special``: with the
    tokenizer's prefix, as :func:`encode`; ``tokenizer=None``: UTF-8 bytes, no prefix).

    Returns one dict per fact: ``kind``, ``start``, ``end`` (the fact's tokens are
    ``ids[start:end]``), ``key_start``, ``key_end``, ``value_start``, ``value_end`` (-1 when
    absent) and ``asked`` (the row dataset's ``facts`` column, docs/formats.md). A span is
    the tokens whose characters overlap the fact's; they must cover nothing but whitespace
    outside it (a leading space is part of a token like ``" One"``), else
    :class:`InputError` (field ``tokenizer``): a fact boundary inside a token has no exact span.
    """
    if tokenizer is None:
        special = False
    offsets = _char_offsets(tokenizer, text, special, ids)

    def span(a: int, b: int) -> tuple[int, int]:
        if offsets is None:
            return _span_by_prefix(tokenizer, text, special, ids, a, b)
        hit = [i for i, (x, y) in enumerate(offsets) if y > x and x < b and y > a]
        if not hit:
            raise InputError("tokenizer", f"no token covers characters [{a}, {b})", "use a tokenizer with offsets")
        lo, hi = hit[0], hit[-1] + 1
        x0, y1 = offsets[lo][0], offsets[hi - 1][1]
        if text[x0:a].strip() or text[b:y1].strip():
            raise InputError("tokenizer", f"the fact {text[a:b]!r} starts or ends inside a token "
                             f"(tokens cover {text[x0:y1]!r})", "use a tokenizer whose tokens respect the fact's boundaries")
        return lo, hi

    out = []
    for f in facts:
        s0, s1 = span(f.start, f.end)
        k0, k1 = span(*f.key) if f.key else (-1, -1)
        v0, v1 = span(*f.value) if f.value else (-1, -1)
        out.append({"kind": f.kind, "start": s0, "end": s1, "key_start": k0, "key_end": k1,
                    "value_start": v0, "value_end": v1, "asked": bool(f.asked)})
    return tuple(out)
