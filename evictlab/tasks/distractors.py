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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from evictlab.errors import InputError
from evictlab.tasks.examples import encode_text
from evictlab.tasks.synthetic import fact_token_spans, haystack, locate_facts

KINDS = ("near_miss", "filler")
#: Key words of the dilution needles (distinct from the filler's words).
WORDS = ("apple", "river", "candle", "tiger", "garden", "piano", "castle", "rocket",
         "forest", "mirror", "violin", "harbor", "lantern", "meadow", "falcon", "glacier")
QUALIFIERS = ("old", "tiny", "north", "silver", "quiet", "wild", "broken", "golden", "hidden",
              "early", "lucky", "frozen", "bright", "secret", "royal", "plain", "dusty")
MAX_DISTRACTORS = (len(WORDS) - 1) * (len(QUALIFIERS) + 1)  # 270

__all__ = ["KINDS", "MAX_DISTRACTORS", "DilutionExample", "make_example"]


@dataclass(frozen=True)
class DilutionExample:
    """One tokenised example: ``context_ids`` are compressed, then ``question_ids`` are fed,
    then the model is scored on ``answer_ids`` (teacher forcing). ``useful``: the asked
    needle's token positions as ``(start, end)`` in ``context_ids``; ``facts``: every
    needle's token spans (:func:`~evictlab.tasks.synthetic.fact_token_spans`)."""

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
        useful=(asked_spans[0]["start"], asked_spans[0]["end"]), facts=spans)
