"""Useful keys from a row dataset's fact labels (schema version 2, ``prompts.facts``).

A prompt's *useful* keys U are the token positions of the facts its question asks for
(``asked``); which part of a fact counts is ``useful``: ``fact`` (the whole sentence,
default), ``value`` (the value's tokens, e.g. the magic number) or ``key_value`` (key and
value tokens). Every other key a row sees is a distractor; for reports the distractors are
split into the other facts (near-miss needles), the first token (the attention sink), the
question (query-aware rows) and the filler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from evictlab.errors import InputError

USEFUL_PARTS = ("fact", "value", "key_value")

__all__ = ["USEFUL_PARTS", "PromptLabels", "prompt_labels", "require_labels"]


@dataclass(frozen=True)
class PromptLabels:
    """Positions (sorted int64) of one prompt's useful keys and of its other facts' keys;
    ``n_context``: tokens before the question (None if the prompt does not say)."""

    useful: np.ndarray
    other_facts: np.ndarray
    n_context: int | None


def _spans(fact: dict[str, Any], part: str) -> list[tuple[int, int]]:
    whole = [(fact["start"], fact["end"])]
    key = [(fact["key_start"], fact["key_end"])] if fact["key_start"] >= 0 else []
    value = [(fact["value_start"], fact["value_end"])] if fact["value_start"] >= 0 else []
    if part == "value":
        return value or whole
    if part == "key_value":
        return (key + value) or whole
    return whole


def _positions(spans: list[tuple[int, int]]) -> np.ndarray:
    if not spans:
        return np.zeros(0, np.int64)
    return np.unique(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans]))


def require_labels(store: Any) -> None:
    """InputError (one line, naming the dataset) unless every prompt of ``store`` is labelled."""
    prompts = store.prompts
    missing = prompts.filter(prompts["facts"].is_null())
    if missing.height == 0:
        return
    sources = ", ".join(sorted(set(missing["source"].to_list())))
    version = store.manifest["schema_version"]
    why = (f"was written with schema version {version}, before fact labels existed" if version < 2 else
           f"has prompts without fact labels ({missing.height} of {prompts.height}, source {sources}): "
           "text prompts have no useful keys to measure")
    raise InputError(str(store.path), why,
                     "capture a task source, which records fact spans: evictlab capture --source needle "
                     "(or multi_needle, multi_key, variable_tracking) --out NEW_FOLDER")


def prompt_labels(store: Any, useful: str = "fact") -> dict[int, PromptLabels]:
    """``{prompt_id: PromptLabels}`` of every prompt (after :func:`require_labels`)."""
    if useful not in USEFUL_PARTS:
        raise InputError("--useful", f"unknown part {useful!r}", f"use one of: {', '.join(USEFUL_PARTS)}")
    require_labels(store)
    out: dict[int, PromptLabels] = {}
    for pid, facts, text in store.prompts.select("prompt_id", "facts", "text").iter_rows():
        asked = [f for f in facts if f["asked"]]
        other = [f for f in facts if not f["asked"]]
        try:
            n_ctx = json.loads(text).get("n_context") if text else None
        except (ValueError, AttributeError):
            n_ctx = None
        out[int(pid)] = PromptLabels(
            useful=_positions([sp for f in asked for sp in _spans(f, useful)]),
            other_facts=_positions([(f["start"], f["end"]) for f in other]),
            n_context=int(n_ctx) if isinstance(n_ctx, int) else None)
    return out
