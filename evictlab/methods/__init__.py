"""Eviction methods: scorers (dataclasses with one ``score``) and allocators (pure functions).

Add a scorer: write a dataclass with ``name``, ``needs`` and ``score(inputs)`` in
``scorers.py`` and add one line to :data:`REGISTRY`. Add an allocator: write a pure function
in ``allocators.py`` and add one line to :data:`ALLOCATORS`. See ``docs/methods.md``.
"""

from __future__ import annotations

from typing import Callable

from evictlab.methods import allocators, scorers
from evictlab.methods.base import Allocator, Scorer, ScoreInputs, attention_probs, combine_groups, select_keep

REGISTRY: dict[str, Callable[..., Scorer]] = {
    "streaming_llm": scorers.StreamingLLM,
}
"""Scorer name -> factory (the dataclass); ``REGISTRY[name](**params)`` builds one."""

ALLOCATORS: dict[str, Allocator] = {
    "uniform": allocators.uniform,
    "pyramidkv": allocators.pyramidkv,
    "adakv": allocators.adakv,
}
"""Allocator name -> pure function ``(cell_scores, budget_tokens, n_layers, kv_heads, *, floor, **params)``."""

__all__ = [
    "ALLOCATORS",
    "REGISTRY",
    "Allocator",
    "ScoreInputs",
    "Scorer",
    "attention_probs",
    "combine_groups",
    "select_keep",
]
