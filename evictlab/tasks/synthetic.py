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

Multi-question families (ours, in the style of RULER; :data:`MULTI_TASKS`)
    One context is asked ``questions`` questions (default :data:`QUESTIONS`; each is answered
    from its own copy of the same compressed cache by the evaluation engine). Every question
    is a :class:`Question` whose ``asked`` lists the facts it needs; its answer is 1-3 tokens
    in both registry tokenizers and occurs in the context only inside those facts (as a whole
    word), so it is unambiguous. The first question is the example's own ``question`` /
    ``answer`` / ``answers`` and the facts' ``asked`` flags are the first question's.

    - ``keys_word`` (RULER's multi-key): ``questions + 2`` needles "The special magic color
      for KEY is COLOR." with distinct keys and colours; each question asks one key (one token).
    - ``keys_number``: the same with two-digit numbers, "The special magic number for KEY is
      42." (three tokens: the space and two digits).
    - ``keys_tagged``: ``keys_number`` whose keys are tagged, "QUALIFIER NOUN"; every asked key
      has a near-miss needle with the same noun and another qualifier ("north apple" asked,
      "quiet apple" a distractor), other numbers.
    - ``values_word`` (RULER's multi-value): two needles "One of the special magic colors for
      KEY is COLOR." per key; a question asks for both, answer "COLOR and COLOR" in order of
      appearance (three tokens).
    - ``query_word`` (RULER's multi-query): ``2 * questions`` keys_word needles; a question asks
      for two keys at once, answer "COLOR and COLOR" in the question's order.
    - ``vt_chains`` (variable tracking with several chains): per question a chain ``VAR A =
      COLOR.``, ``VAR B = VAR A.``, ``VAR C = VAR B.`` (chains interleaved, each in order);
      asked for the value of the chain's last variable (one token); all three assignments are
      asked.
    - ``lines`` (line retrieval): the whole context is lines "line N: WORD" (N = 1, 2, ...);
      asked for the word of a line (one token). Asked words occur once; the other lines draw
      theirs from the rest of the word list (repeats allowed).
    - ``keys_word_prose``: ``keys_word`` in a window of Shakespeare's plays
      (:mod:`evictlab.tasks.texts`, the captured part before the held-out boundary) instead of
      the noise filler, the needles on lines of their own; colours that occur in the window
      (any case) are never used.
    - ``keys_number_prose``: ``keys_number`` in such a window (two-digit numbers; the plays
      hold no digits in the windows we draw, and none of the asked numbers is in the window,
      tested).
    - ``facts_word`` (associative recall): ``questions + 2`` facts in the noise filler, each
      a sentence of its *own* template (:data:`_FACT_TEMPLATES`: "Last spring the KEY was
      painted COLOR.", "After the storm the KEY turned COLOR.", ...) with distinct keys and
      colours; a question repeats its fact's words up to the colour ("... Answer: Last
      spring the apple was painted"), one token. Why: in ``keys_word`` every needle shares
      one template, so the words before each answer differ in the key alone and the
      135M-270M models confuse the keys (exact match 0.3-0.5 with the full cache at 1k); a
      template per fact leaves one place in the context that continues the question's
      words, the copying that small models do reliably, while the answer still has to be
      kept through compression like any needle's.

Fact labels (ours; used by :mod:`evictlab.dilution`)
    Every inserted needle or assignment is a :class:`Fact`: its character span in the
    context, the spans of its key and value where the template has them, and whether the
    question asks for it (:func:`locate_facts`). :func:`fact_token_spans` turns the character
    spans into exact token spans under the prompt's tokenizer (from the tokenizer's offset
    mapping, or by incremental encoding for tokenizers without one), and checks that the
    tokens cover the fact and nothing but whitespace besides. Text sources have no facts.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evictlab.errors import InputError
from evictlab.tasks.corpus import encode

#: The multi-question families (module docstring) and the most questions one context can carry.
MULTI_TASKS: dict[str, int] = {"keys_word": 10, "keys_number": 14, "keys_tagged": 8, "values_word": 6,
                               "query_word": 6, "vt_chains": 8, "lines": 20, "keys_word_prose": 10,
                               "keys_number_prose": 14, "facts_word": 10}
#: Questions per context of a multi-question family when none is asked for.
QUESTIONS = 4
TASKS = ("needle", "multi_needle", "multi_key", "variable_tracking", "needle_word", "multi_key_word", "multi_value",
         *MULTI_TASKS)

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
#: Qualifiers of ``keys_tagged``'s keys (no colour among them: colours are answers elsewhere).
_QUALIFIERS = ("old", "tiny", "north", "quiet", "wild", "broken", "hidden", "early", "lucky", "frozen",
               "bright", "secret", "royal", "plain", "dusty", "south")
#: Variable names of ``vt_chains`` (three per chain, so 24 names for its 8 chains at most).
_CHAIN_VARS = (*_VARS, "DQA", "FEX", "GWI", "JNU", "LPY", "RVC", "UBH", "XKM", "ZOT", "CIW", "EYN", "ASF")
#: ``facts_word``'s sentences, one per fact of a context: each names its key as "the {k}" and
#: ends with its colour, and no two share the words before the colour (so a question's
#: answer prefix continues in one place of the context only). The question repeats the
#: sentence up to the colour.
_FACT_TEMPLATES = ("Last spring the {k} was painted {v}.", "After the storm the {k} turned {v}.",
                   "In the old photograph the {k} looks {v}.", "Grandma always kept the {k} wrapped in {v}.",
                   "On the top shelf the {k} glows {v}.", "The children agreed that the {k} should be {v}.",
                   "At the village fair the ribbon on the {k} was {v}.", "Every morning the light on the {k} shines {v}.",
                   "Nobody believed that the {k} had become {v}.", "The label under the {k} is printed in {v}.",
                   "During the long winter the {k} stays {v}.", "The painter mixed a new shade for the {k} called {v}.")
#: Words of ``lines``: one token after a space in both registry tokenizers (tested), none in the filler.
_LINE_WORDS = ("table", "chair", "window", "door", "bottle", "pencil", "camera", "radio", "laptop", "pizza",
               "robot", "taxi", "coffee", "cookie", "guitar", "drum", "wallet", "ticket", "bridge", "tunnel",
               "island", "desert", "valley", "ocean", "planet", "comet", "engine", "wheel", "hammer", "ladder",
               "basket", "blanket", "pillow", "jacket", "button", "carpet", "helmet", "magnet", "mango", "lemon",
               "banana", "cherry", "onion", "pepper", "tomato", "potato", "carrot", "salad", "bread", "butter",
               "cheese", "sugar", "honey", "kettle", "spoon", "knife", "plate", "towel", "phone", "truck")


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


def check_questions(task: str, questions: int | None) -> int:
    """The number of questions ``task`` asks per context: ``questions``, or the task's default
    (:data:`QUESTIONS` for a multi-question family, 1 otherwise). InputError (field
    ``questions``) when it is below 1, above the family's :data:`MULTI_TASKS` limit, or above
    1 for a single-question task."""
    if task not in MULTI_TASKS:
        if questions not in (None, 1):
            raise InputError("questions", f"{task} asks one question per context, not {questions}",
                             f"use 1, or a multi-question task: {', '.join(MULTI_TASKS)}")
        return 1
    if questions is None:
        return QUESTIONS
    top = MULTI_TASKS[task]
    if isinstance(questions, bool) or not isinstance(questions, (int, np.integer)) or not 1 <= questions <= top:
        raise InputError("questions", f"{questions!r} questions for {task}", f"use 1 to {top}")
    return int(questions)


def make_task(task: str, context_tokens: int, tokenizer: Any, seed: int, *, field: str = "--context",
              questions: int | None = None) -> TaskExample:
    """A seeded RULER-style example whose context is at most ``context_tokens`` tokens.

    ``tokenizer`` counts tokens (a Hugging Face tokenizer, or None to count words). An
    unknown ``task`` is an InputError with the neutral field ``task`` (capture checks its
    ``--source`` before calling; ``decode``/``audit`` report it as ``--task``). A context too
    short for the task is an InputError naming ``field``: the caller's option that sets the
    length (``--context`` by default; ``gates train`` passes ``--seq-len``). ``questions``:
    how many questions a multi-question family asks of the context (:func:`check_questions`;
    default :data:`QUESTIONS`); the example's ``question_set`` lists them.
    """
    if task not in TASKS:
        raise InputError("task", f"unknown task {task!r}", f"use one of: {', '.join(TASKS)}")
    q_count = check_questions(task, questions)
    if context_tokens < 64:
        raise InputError(field, f"{context_tokens} tokens is too short for a task",
                         "use at least 64 tokens")
    rng = np.random.default_rng([seed, TASKS.index(task)])
    if task in MULTI_TASKS:
        return _make_multi(task, context_tokens, tokenizer, seed, q_count, rng, field)
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


# --------------------------------------------------------------------------- multi-question families


def _pick(rng: np.random.Generator, pool: tuple[str, ...], k: int) -> list[str]:
    return [str(x) for x in rng.choice(pool, size=k, replace=False)]


_NUMBERS = tuple(range(10, 100))


def _key_needles(task: str, rng: np.random.Generator, q: int, colors: tuple[str, ...],
                 numbers: tuple[int, ...] = _NUMBERS) -> tuple[list[str], list[Question]]:
    """Needles and questions of the needle families (all but ``lines``), needles in order of
    appearance, values drawn from ``colors`` or ``numbers``; a question's ``asked`` indexes
    ``needles``."""
    color_q = "What is the special magic color for {k}? Answer: The special magic color for {k} is"
    if task in ("keys_word", "keys_word_prose", "keys_number", "keys_number_prose"):
        keys = _pick(rng, _KEYS, q + 2)
        if task in ("keys_number", "keys_number_prose"):
            vals = [str(v) for v in rng.choice(np.asarray(numbers), size=len(keys), replace=False)]
            needle = "The special magic number for {k} is {v}."
            ask = "What is the special magic number for {k}? Answer: The special magic number for {k} is"
        else:
            vals, needle, ask = _pick(rng, colors, len(keys)), "The special magic color for {k} is {v}.", color_q
        needles = [needle.format(k=k, v=v) for k, v in zip(keys, vals)]
        order = rng.choice(len(keys), size=q, replace=False)
        return needles, [Question(ask.format(k=keys[i]), vals[i], (vals[i],), (int(i),)) for i in order]
    if task == "facts_word":
        keys, vals = _pick(rng, _KEYS, q + 2), _pick(rng, colors, q + 2)
        templates = _pick(rng, _FACT_TEMPLATES, q + 2)
        needles = [t.format(k=k, v=v) for t, k, v in zip(templates, keys, vals)]
        prefixes = [t.removesuffix(" {v}.").format(k=k) for t, k in zip(templates, keys)]  # the words before v
        order = rng.choice(len(keys), size=q, replace=False)
        return needles, [Question(f"What colour is mentioned for the {keys[i]}? Answer: {prefixes[i]}", vals[i],
                                  (vals[i],), (int(i),)) for i in order]
    if task == "keys_tagged":
        # key i: "QUALIFIER NOUN" (asked), and its near miss: the same noun, another qualifier
        nouns = _pick(rng, _KEYS, q)
        quals = _pick(rng, _QUALIFIERS, 2 * q)
        vals = [str(v) for v in rng.choice(np.arange(10, 100), size=2 * q, replace=False)]
        recs = [(f"{quals[i]} {nouns[i % q]}", vals[i]) for i in range(2 * q)]
        recs = [recs[j] for j in rng.permutation(2 * q)]
        needles = [f"The special magic number for {k} is {v}." for k, v in recs]
        where = {k: j for j, (k, _) in enumerate(recs)}
        ask = "What is the special magic number for {k}? Answer: The special magic number for {k} is"
        out = []
        for i in rng.permutation(q):
            k = f"{quals[i]} {nouns[i]}"
            out.append(Question(ask.format(k=k), vals[i], (vals[i],), (where[k],)))
        return needles, out
    if task == "values_word":
        keys, vals = _pick(rng, _KEYS, q), _pick(rng, colors, 2 * q)
        owner = [i % q for i in range(2 * q)]
        perm = rng.permutation(2 * q)
        owner = [owner[j] for j in perm]
        vals = [vals[j] for j in perm]
        needles = [f"One of the special magic colors for {keys[o]} is {v}." for o, v in zip(owner, vals)]
        out = []
        for i in rng.permutation(q):
            at = tuple(j for j, o in enumerate(owner) if o == i)
            parts = tuple(vals[j] for j in at)
            out.append(Question(f"What are the special magic colors for {keys[i]}? Answer: The special magic "
                                f"colors for {keys[i]} are:", ", ".join(parts), parts, at))
        return needles, out
    if task == "query_word":
        keys, vals = _pick(rng, _KEYS, 2 * q), _pick(rng, colors, 2 * q)
        needles = [f"The special magic color for {k} is {v}." for k, v in zip(keys, vals)]
        pairs = rng.permutation(2 * q).reshape(q, 2)
        out = []
        for a, b in (tuple(int(x) for x in p) for p in pairs):
            both = f"{keys[a]} and {keys[b]}"
            out.append(Question(f"What are the special magic colors for {both}? Answer: The special magic colors "
                                f"for {both} are:", f"{vals[a]}, {vals[b]}", (vals[a], vals[b]), (a, b)))
        return needles, out
    # vt_chains: q chains of three assignments, interleaved, each chain in order
    names, vals = _pick(rng, _CHAIN_VARS, 3 * q), _pick(rng, colors, q)
    slots = rng.permutation(np.repeat(np.arange(q), 3))
    needles, at = [], [[] for _ in range(q)]
    for c in (int(x) for x in slots):
        step = len(at[c])
        name = names[3 * c + step]
        needles.append(f"VAR {name} = {vals[c]}." if step == 0 else f"VAR {name} = VAR {names[3 * c + step - 1]}.")
        at[c].append(len(needles) - 1)
    out = []
    for c in rng.permutation(q):
        last = names[3 * c + 2]
        out.append(Question(f"What is the value of VAR {last}? Follow the chain of assignments. Answer: The value "
                            f"of VAR {last} is", vals[c], (vals[c],), tuple(at[c])))
    return needles, out


@functools.cache
def _plays() -> tuple[Any, ...]:
    """The built-in plays, read once (the built-in corpus: no user path, so no --source error)."""
    from evictlab.tasks.texts import shakespeare_plays

    return tuple(shakespeare_plays())


def _prose_window(context_tokens: int, rng: np.random.Generator, need: int, field: str
                  ) -> tuple[list[str], tuple[str, ...], tuple[int, ...]]:
    """Whole lines of a seeded Shakespeare window (about ``context_tokens`` tokens, more than
    enough), the colours absent from them (case-insensitive whole words), at least ``need``
    of them (windows with fewer are drawn again, at most 32 tries), and the two-digit
    numbers absent from them."""
    docs = _plays()
    chars = 8 * context_tokens + 512  # ~4 characters per token, doubled
    usable = [d for d in docs if len(d.text) > chars + 1]
    if not usable:
        raise InputError(field, f"{context_tokens} tokens is longer than every play", "use a shorter context")
    for _ in range(32):
        doc = usable[int(rng.integers(len(usable)))]
        start = int(rng.integers(0, len(doc.text) - chars))
        start = doc.text.find("\n", start) + 1
        lines = [ln.rstrip() for ln in doc.text[start:start + chars].split("\n")[:-1]]
        lines = [ln for ln in lines if ln.strip()]
        text = "\n".join(lines)
        free = tuple(c for c in _COLORS if not re.search(rf"(?<!\w){c}(?!\w)", text, re.IGNORECASE))
        if len(free) >= need:
            nums = tuple(v for v in _NUMBERS if not re.search(rf"(?<!\w){v}(?!\w)", text))
            return lines, free, nums
    raise RuntimeError("32 Shakespeare windows in a row held too many colour words")  # never seen


def _fit_lines(tokenizer: Any, head: list[str], needles: list[str], depths: np.ndarray, context_tokens: int,
               field: str) -> tuple[str, int]:
    """The longest text of the first n lines of ``head`` with ``needles`` as lines of their
    own (needle k before line ``round(depths[k] * n)``, as :func:`_haystack` places them)
    within ``context_tokens`` tokens: ``(text, n)``."""
    def build(n: int) -> str:
        slots = [int(round(d * n)) for d in depths]
        out: list[str] = []
        k = 0
        for i in range(n + 1):
            while k < len(needles) and slots[k] == i:
                out.append(needles[k])
                k += 1
            if i < n:
                out.append(head[i])
        return "\n".join(out)

    if _count(tokenizer, build(0)) > context_tokens:
        raise InputError(field, f"{context_tokens} tokens cannot hold the task's facts", "use a longer context")
    lo, hi = 0, len(head)
    while lo < hi:  # the largest n within budget (token counts grow with n)
        mid = (lo + hi + 1) // 2
        if _count(tokenizer, build(mid)) <= context_tokens:
            lo = mid
        else:
            hi = mid - 1
    return build(lo), lo


def _make_multi(task: str, context_tokens: int, tokenizer: Any, seed: int, q: int, rng: np.random.Generator,
                field: str) -> TaskExample:
    if task == "lines":
        context, needles, qs = _lines_context(tokenizer, context_tokens, rng, q, field)
    elif task in ("keys_word_prose", "keys_number_prose"):
        lines, free, nums = _prose_window(context_tokens, rng, q + 2 if task == "keys_word_prose" else 0, field)
        needles, qs = _key_needles(task, rng, q, free, nums)
        depths = np.sort(rng.uniform(0.05, 0.95, size=len(needles)))
        context, _ = _fit_lines(tokenizer, lines, needles, depths, context_tokens, field)
    else:
        needles, qs = _key_needles(task, rng, q, _COLORS)
        context = _haystack(tokenizer, needles, context_tokens, rng, field)
    first = qs[0]
    facts = locate_facts(context, needles, first.answers, asked=first.asked)
    return TaskExample(task=task, context=context, question=first.question, answer=first.answer, seed=seed,
                       answers=first.answers, facts=facts, question_set=tuple(qs))


def _lines_context(tokenizer: Any, context_tokens: int, rng: np.random.Generator, q: int, field: str
                   ) -> tuple[str, list[str], list[Question]]:
    """``lines``: the context, its lines (every one a fact) and the questions."""
    asked_words = _pick(rng, _LINE_WORDS, q)
    rest = np.array([w for w in _LINE_WORDS if w not in asked_words])
    words = [str(w) for w in rng.choice(rest, size=context_tokens)]  # more lines than can fit
    head = [f"line {i + 1}: {w}" for i, w in enumerate(words)]
    none = np.zeros(0)
    _, n = _fit_lines(tokenizer, head, [], none, context_tokens, field)
    if n < 2 * q + 2:
        raise InputError(field, f"{context_tokens} tokens hold {n} lines, too few for {q} questions",
                         "use a longer context or fewer questions")
    # asked lines at seeded depths in the middle 90%, distinct
    lo, hi = int(0.05 * n), max(int(0.05 * n) + q, int(0.95 * n))
    picks = [int(x) for x in rng.choice(np.arange(lo, hi), size=q, replace=False)]
    for i, w in zip(picks, asked_words):
        words[i] = w
    head = [f"line {i + 1}: {w}" for i, w in enumerate(words[:n])]
    # an asked word longer than the one it replaced may push the end out: drop lines from the end
    context, n2 = _fit_lines(tokenizer, head, [], none, context_tokens, field)
    if n2 <= max(picks):
        raise InputError(field, f"{context_tokens} tokens cannot hold the asked lines", "use a longer context")
    qs = [Question(f"What is the word on line {i + 1}? Answer: line {i + 1}:", w, (w,), (i,))
          for i, w in zip(picks, asked_words)]
    return context, head[:n2], qs


# --------------------------------------------------------------------------- fact labels

#: Kinds of inserted facts: a magic-number (or any "... for KEY is VALUE.") needle, and a
#: variable assignment ``VAR KEY = VALUE.``. A template neither pattern parses is a
#: ``fact`` (its span only, no key or value span).
FACT_KINDS = ("needle", "assignment", "fact")
_ASSIGNMENT = re.compile(r"^VAR (?P<key>\S+) = (?P<value>.+?)\.$")
_NEEDLE = re.compile(r"^.* for (?P<key>.+?) is:? (?P<value>\S+?)\.$")
_LINE = re.compile(r"^line (?P<key>\d+): (?P<value>\S+)$")
#: facts_word's sentences as patterns (fixed words, so no other family's needle matches one).
_FACTS = tuple(re.compile("^" + re.escape(t).replace(re.escape("{k}"), r"(?P<key>\w+)")
                          .replace(re.escape("{v}"), r"(?P<value>\w+)") + "$") for t in _FACT_TEMPLATES)


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


def locate_facts(context: str, needles: list[str], answers: tuple[str, ...], *,
                 asked: Sequence[int] | None = None) -> tuple[Fact, ...]:
    """The :class:`Fact` of every needle of ``needles`` (in the order they appear in ``context``).

    ``asked``: the indices into ``needles`` the question asks for (the multi-question
    families say so explicitly); None applies the rule below.

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
        for name, pattern in (("assignment", _ASSIGNMENT), ("needle", _NEEDLE), ("needle", _LINE),
                              *(("needle", f) for f in _FACTS)):
            m = pattern.match(text)
            if m:
                kind = name
                key = (start + m.start("key"), start + m.end("key"))
                value = (start + m.start("value"), start + m.end("value"))
                break
        is_asked = len(facts) in asked if asked is not None else any(_mentions(text, a) for a in answers)
        facts.append(Fact(kind, text, start, end, key, value, bool(is_asked)))
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
    # the non-empty tokens; when their starts and ends both rise (every tokenizer we use) a
    # span is found by bisection, else by a scan of every token (same answer, slower)
    live = [i for i, (x, y) in enumerate(offsets or ()) if y > x]
    starts = [offsets[i][0] for i in live] if offsets else []
    ends = [offsets[i][1] for i in live] if offsets else []
    rising = all(p <= q for p, q in zip(starts, starts[1:])) and all(p <= q for p, q in zip(ends, ends[1:]))

    def span(a: int, b: int) -> tuple[int, int]:
        if offsets is None:
            return _span_by_prefix(tokenizer, text, special, ids, a, b)
        if rising:  # tokens with end > a and start < b
            j0, j1 = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
            hit = [live[j0], live[j1 - 1]] if j0 < j1 else []
        else:
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
