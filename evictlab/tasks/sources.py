"""Capture prompts: one tokenised prompt per index from a text source or a synthetic task.

:func:`build_capture_prompt` picks the source: a text window (:mod:`evictlab.tasks.texts`) or a task
with its question (:mod:`evictlab.tasks.synthetic`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from evictlab.errors import InputError
from evictlab.tasks.corpus import encode
from evictlab.tasks.synthetic import TASKS, fact_token_spans, make_task
from evictlab.tasks.texts import (
    ORDER_KEY,
    Origin,
    encode_with_offsets,
    is_text_source,
    load_text_source,
    text_window,
    tokens_sha256,
)

SOURCES = ("shakespeare", *TASKS)
#: What ``--source`` accepts, for help texts and error messages.
SOURCES_HELP = "shakespeare, file:PATH, jsonl:PATH:FIELD, " + ", ".join(TASKS)


@dataclass(frozen=True)
class PromptTokens:
    """A tokenised prompt for capture: ``tokens[:n_context]`` is the context.

    ``origin`` (text sources): where the tokens came from, as
    :meth:`evictlab.tasks.texts.Origin.to_dict` (source, document, line, character
    offsets, SHA-256 of the document and of the tokens). ``facts`` (task sources): the
    token spans of the inserted facts (:func:`fact_token_spans`, positions in ``tokens``);
    None for text sources, whose prompts carry no labels.
    """

    prompt_id: str
    source: str
    tokens: list[int]
    n_context: int
    answer: str | None = None
    origin: dict[str, Any] | None = None
    facts: tuple[dict[str, Any], ...] | None = None


def check_source(source: str) -> None:
    """InputError naming ``--source`` unless it is a task, ``shakespeare``, ``file:PATH`` or ``jsonl:PATH:FIELD``.

    Only the form is checked here (the files are read when the first prompt is built).
    """
    if source in TASKS or is_text_source(source):
        return
    raise InputError("--source", f"unknown source {source!r}", f"use one of: {SOURCES_HELP}")


def build_capture_prompt(source: str, context_tokens: int, tokenizer: Any, seed: int, index: int) -> PromptTokens:
    """Prompt ``index`` of a capture run: a text window (:mod:`evictlab.tasks.texts`), or a task with its question.

    Seeds: a text window is drawn by ``default_rng([seed, index])`` (see
    :mod:`evictlab.tasks.texts`); task ``index`` uses ``seed * 1_000_003 + index``. Either
    way prompts are independent and a resumed run rebuilds exactly the same ones.
    """
    if tokenizer is None:
        raise InputError("tokenizer", "capture needs a tokenizer", "load the model with its tokenizer")
    if is_text_source(source):
        return build_text_prompt(source, context_tokens, tokenizer, seed, index)
    if source not in TASKS:
        raise InputError("--source", f"unknown source {source!r}", f"use one of: {SOURCES_HELP}")
    s = seed * 1_000_003 + index
    ex = make_task(source, context_tokens, tokenizer, s)
    ctx = encode(tokenizer, ex.context)
    q = encode(tokenizer, "\n\n" + ex.question, special=False)
    facts = fact_token_spans(tokenizer, ex.context, ex.facts, ids=ctx)
    return PromptTokens(f"{source}-s{seed}-i{index}", source, ctx + q, len(ctx), ex.answer, facts=facts)


def build_text_prompt(spec: str, n_tokens: int, tokenizer: Any, seed: int, index: int) -> Any:
    """Prompt ``index`` of a text source: a :class:`PromptTokens` with its origin."""
    if n_tokens < 8:
        raise InputError("--context", f"{n_tokens} tokens is too short", "use at least 8 tokens")
    src = load_text_source(spec)
    order = np.random.default_rng([int(seed), ORDER_KEY]).permutation(len(src.documents))
    rng = np.random.default_rng([int(seed), int(index)])
    # the documents long enough are found lazily, in the seeded order, from this prompt's slot on
    tried = 0
    longest = 0
    while tried < len(order):
        slot = (index + tried) % len(order)
        doc = src.documents[int(order[slot])]
        win = text_window(tokenizer, doc, n_tokens, rng)
        if win is not None:
            break
        longest = max(longest, len(encode_with_offsets(tokenizer, doc.text)[0]))
        tried += 1
    else:
        what = src.documents[0].name if len(src.documents) == 1 else f"every one of the {len(src.documents)} documents"
        raise InputError("--context", f"{n_tokens} tokens is longer than {what} of {spec} "
                         f"(longest: {longest} tokens)", f"use --context {max(8, longest)} or less, or longer texts")
    ids, start, end = win
    origin = Origin(spec, doc.name, doc.line, start, end, doc.sha256, tokens_sha256(ids))
    return PromptTokens(f"{src.kind}-s{seed}-i{index}", spec, ids, len(ids), None, origin.to_dict())
