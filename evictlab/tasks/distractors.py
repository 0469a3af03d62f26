"""Needle retrieval with k distractors, labelled: the examples of the dilution sweep (ours).

Example i with k distractors (seeded by ``(seed, i)`` and ``(seed, i, k)``):

- one **asked needle** "One of the special magic numbers for KEY is: VALUE." (KEY and VALUE
  drawn from ``default_rng([seed, i])``, the same for every k, so the k axis is paired);
- kind ``near_miss``: k **near-miss needles** with the same template, other keys (a key word
  other than KEY, alone or with a qualifier: "silver river") and other values; the first k
  of one seeded list of 270, so the distractors at k = 16 are among those at k = 64;
- kind ``filler``: no other needle, but the same number of extra filler tokens the near-miss
  needles would have taken (the haystack grows, nothing in it resembles the needle);
- the haystack: the tasks' noise filler (:func:`evictlab.tasks.synthetic.haystack`), about
  ``filler`` tokens besides the needles, needles at seeded depths (``default_rng([seed, i, k])``).

The question asks for KEY's number; the answer is VALUE. Every needle is a labelled fact
(:func:`evictlab.tasks.synthetic.locate_facts`); the useful keys are the asked needle's
tokens (exact spans, :func:`evictlab.tasks.synthetic.fact_token_spans`).

**On the evaluation engine** (``evictlab eval run``, docs/dilution.md): the task
``dilution_KIND_kK`` (``dilution_near_miss_k16``, ``dilution_filler_k0``; :func:`parse_task`)
is example ``i`` of kind KIND with K distractors, built by
:func:`evictlab.tasks.examples.dilution_example` from :func:`make_example` with the grid's
seed and its context length as the filler, so the engine's example ``i`` is the sweep's.
The families ``dilution_near_miss`` and ``dilution_filler`` expand to one task per count
(:func:`expand_families`, ``eval run --distractors``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evictlab.errors import InputError, refuse_duplicates
from evictlab.tasks.corpus import encode_text
from evictlab.tasks.synthetic import Fact, fact_token_spans, haystack, locate_facts

KINDS = ("near_miss", "filler")
#: Key words of the dilution needles (distinct from the filler's words).
WORDS = ("apple", "river", "candle", "tiger", "garden", "piano", "castle", "rocket",
         "forest", "mirror", "violin", "harbor", "lantern", "meadow", "falcon", "glacier")
QUALIFIERS = ("old", "tiny", "north", "silver", "quiet", "wild", "broken", "golden", "hidden",
              "early", "lucky", "frozen", "bright", "secret", "royal", "plain", "dusty")
MAX_DISTRACTORS = (len(WORDS) - 1) * (len(QUALIFIERS) + 1)  # 270

#: The engine's task families (one per kind): ``dilution_near_miss``, ``dilution_filler``.
FAMILIES: tuple[str, ...] = tuple(f"dilution_{k}" for k in KINDS)
_TASK = re.compile(r"^dilution_(?P<kind>near_miss|filler)_k(?P<k>\d+)$")

__all__ = ["FAMILIES", "KINDS", "MAX_DISTRACTORS", "DilutionExample", "expand_families", "make_example",
           "parse_task", "task_name"]


@dataclass(frozen=True)
class DilutionExample:
    """One tokenised example: ``context_ids`` are compressed, then ``question_ids`` are fed,
    then the model is scored on ``answer_ids`` (teacher forcing). ``useful``: the asked
    needle's token positions as ``(start, end)`` in ``context_ids``; ``facts``: every
    needle's token spans (:func:`~evictlab.tasks.synthetic.fact_token_spans`);
    ``context_text`` and ``labels``: the context's text and its needles as
    :class:`~evictlab.tasks.synthetic.Fact` (character spans; the asked one ``asked``), the
    labels the evaluation engine reads (:func:`evictlab.tasks.examples.dilution_example`)."""

    index: int
    distractors: int
    kind: str
    seed: int
    key: str
    value: str
    context_ids: list[int]
    question_ids: list[int]
    answer_ids: list[int]
    useful: tuple[int, int]
    facts: tuple[dict[str, Any], ...]
    context_text: str = ""
    labels: tuple[Fact, ...] = ()

    def useful_spec(self) -> str:
        """The ``oracle_labels`` scorer's ``useful`` parameter for this example."""
        return f"{self.useful[0]}:{self.useful[1]}"


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _count(tokenizer: Any, text: str) -> int:
    return len(encode_text(tokenizer, text, special=False))


def make_example(tokenizer: Any, index: int, distractors: int, *, filler: int = 512, kind: str = "near_miss",
                 seed: int = 0) -> DilutionExample:
    """Example ``index`` with ``distractors`` distractors (module docstring); ``tokenizer``
    None means the byte vocabulary of the tiny test models."""
    if kind not in KINDS:
        raise InputError("--kind", f"unknown distractor kind {kind!r}", f"use one of: {', '.join(KINDS)}")
    if not 0 <= distractors <= MAX_DISTRACTORS:
        raise InputError("--distractors", f"{distractors} is outside 0..{MAX_DISTRACTORS}",
                         f"use counts up to {MAX_DISTRACTORS} (distinct near-miss keys available)")
    if filler < 64:
        raise InputError("--context", f"{filler} filler tokens is too short", "use at least 64")
    rng = np.random.default_rng([seed, index])
    key = str(rng.choice(WORDS))
    value = str(int(rng.integers(1_000_000, 10_000_000)))
    others = [w for w in WORDS if w != key]
    pool = others + [f"{q} {w}" for q in QUALIFIERS for w in others]
    order = rng.permutation(len(pool))
    values: list[str] = []
    while len(values) < len(pool):  # distinct values, none equal to the asked one
        v = str(int(rng.integers(1_000_000, 10_000_000)))
        if v != value and v not in values:
            values.append(v)
    near = [_needle(pool[j], values[t]) for t, j in enumerate(order[:distractors])]
    asked = _needle(key, value)
    extra = sum(_count(tokenizer, n + " ") for n in near)
    needles = [asked] + (near if kind == "near_miss" else [])
    # the asked needle's place among the distractors is seeded too
    place = np.random.default_rng([seed, index, distractors])
    pos = int(place.integers(0, len(needles)))
    needles.insert(pos, needles.pop(0))
    budget = filler + sum(_count(tokenizer, n + " ") for n in needles) + (extra if kind == "filler" else 0)
    try:
        context = haystack(tokenizer, needles, budget, place)
    except InputError:
        raise InputError("--context", f"{filler} filler tokens are fewer than one passage of the filler text",
                         f"use a larger --context (e.g. {2 * filler})") from None
    facts = locate_facts(context, needles, (value,))
    ctx = encode_text(tokenizer, context)
    spans = fact_token_spans(tokenizer, context, facts, ids=ctx)
    asked_spans = [f for f in spans if f["asked"]]
    if len(asked_spans) != 1:  # values are distinct by construction
        raise RuntimeError(f"expected one asked needle, found {len(asked_spans)}")
    question = (f"What is the special magic number for {key} mentioned in the provided text? "
                f"Answer: The special magic number for {key} mentioned in the provided text is")
    return DilutionExample(
        index=index, distractors=distractors, kind=kind, seed=seed, key=key, value=value, context_ids=ctx,
        question_ids=encode_text(tokenizer, "\n\n" + question, special=False),
        answer_ids=encode_text(tokenizer, " " + value, special=False),
        useful=(asked_spans[0]["start"], asked_spans[0]["end"]), facts=spans, context_text=context, labels=facts)


# --------------------------------------------------------------------------- engine tasks


def task_name(kind: str, distractors: int) -> str:
    """The engine's task of ``kind`` with ``distractors`` distractors: ``dilution_near_miss_k16``."""
    return f"dilution_{kind}_k{distractors}"


def parse_task(name: str) -> tuple[str, int] | None:
    """``(kind, K)`` of an engine task ``dilution_KIND_kK``; None for a name that does not
    start with ``dilution_`` (another task). InputError (field ``tasks``) for a family
    without its count (``dilution_near_miss``), K outside 0..:data:`MAX_DISTRACTORS`, or
    another spelling (``dilution_near_miss_k016``, ``dilution_misc_k4``)."""
    if not name.startswith("dilution_"):
        return None
    m = _TASK.match(name)
    examples = ", ".join(task_name(k, 16) for k in KINDS)
    if m is None:
        if name in FAMILIES:
            raise InputError("tasks", f"{name} needs a distractor count",
                             f"name {name}_kK (K in 0..{MAX_DISTRACTORS}, e.g. {name}_k16), or give the counts "
                             "with --distractors 0,4,16,64")
        raise InputError("tasks", f"unknown dilution task {name!r}",
                         f"write dilution_KIND_kK with KIND one of {', '.join(KINDS)} and K in 0..{MAX_DISTRACTORS} "
                         f"(e.g. {examples})")
    kind, digits = m["kind"], m["k"]
    k = int(digits)
    if str(k) != digits:
        raise InputError("tasks", f"{name!r} writes its count with a leading zero", f"write {task_name(kind, k)}")
    if k > MAX_DISTRACTORS:
        raise InputError("tasks", f"{name}: {k} distractors is more than the {MAX_DISTRACTORS} distinct near-miss "
                         "keys", f"use K in 0..{MAX_DISTRACTORS}, e.g. {task_name(kind, 64)}")
    return kind, k


def expand_families(tasks: Sequence[str], distractors: Sequence[int] | None) -> list[str]:
    """``tasks`` with each family of :data:`FAMILIES` replaced, in place, by one task per
    count of ``distractors`` (``dilution_near_miss`` with ``(0, 4)`` ->
    ``dilution_near_miss_k0, dilution_near_miss_k4``); other names are kept as written.
    ``distractors`` None: nothing is expanded (a family left in ``tasks`` is refused by
    :func:`parse_task`). InputError (field ``distractors``) for counts with no family to
    expand, an empty list, a repeated count or one outside 0..:data:`MAX_DISTRACTORS`."""
    if distractors is None:
        return list(tasks)
    counts = [int(k) for k in distractors]
    if not counts:
        raise InputError("distractors", "the list is empty", "give distractor counts, e.g. 0,4,16,64")
    if not any(t in FAMILIES for t in tasks):
        raise InputError("distractors", f"the counts expand the dilution task families ({', '.join(FAMILIES)}) "
                         "and no task is one", f"add {' or '.join(FAMILIES)} to the tasks, or drop the distractor "
                         "counts")
    bad = [k for k in counts if not 0 <= k <= MAX_DISTRACTORS]
    if bad:
        raise InputError("distractors", f"{bad[0]} is outside 0..{MAX_DISTRACTORS}",
                         f"use counts up to {MAX_DISTRACTORS} (distinct near-miss keys available)")
    refuse_duplicates(counts, "distractors", "distractor count")
    out: list[str] = []
    for t in tasks:
        out.extend([task_name(t.removeprefix("dilution_"), k) for k in counts] if t in FAMILIES else [t])
    return out
