"""Eviction methods: scorers (dataclasses with one ``score``) and allocators (pure functions).

Add a scorer: write a dataclass with ``name``, ``needs`` and ``score(inputs)`` in
``scorers.py`` and add one line to :data:`REGISTRY`. Add an allocator: write a pure function
in ``allocators.py`` and add one line to :data:`ALLOCATORS`. See ``docs/methods.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from evictlab.errors import InputError
from evictlab.methods import allocators, scorers
from evictlab.methods.base import Allocator, Scorer, ScoreInputs, attention_probs, combine_groups, select_keep

REGISTRY: dict[str, Callable[..., Scorer]] = {
    "streaming_llm": scorers.StreamingLLM,
    "h2o": scorers.H2O,
    "snapkv": scorers.SnapKV,
    "expected_attention": scorers.ExpectedAttention,
    "kvzip": scorers.KVzip,
    "compactor": scorers.Compactor,
    "oracle": scorers.Oracle,
}
"""Scorer name -> factory (the dataclass); ``REGISTRY[name](**params)`` builds one."""

ALLOCATORS: dict[str, Allocator] = {
    "uniform": allocators.uniform,
    "pyramidkv": allocators.pyramidkv,
    "adakv": allocators.adakv,
}
"""Allocator name -> pure function ``(cell_scores, budget_tokens, n_layers, kv_heads, *, floor, **params)``."""



def rope_theta_of(config: Any) -> float:
    """The RoPE base of a transformers config (``rope_theta``, or ``rope_parameters`` in v5)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = getattr(config, "rope_theta", None) or (params.get("rope_theta") if isinstance(params, dict) else None)
    if theta is None:
        raise InputError("model.config", "has no rope_theta", "pass rope_theta=... to make_scorer explicitly")
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if rope_type not in ("default", None):
        raise InputError("model.config", f"RoPE type {rope_type!r} is scaled; the scorers undo plain RoPE only",
                         "use a model with default RoPE or a scorer that needs no rope_theta")
    return float(theta)


def make_scorer(name: str, config: Any | None = None, **params: Any) -> Scorer:
    """Build ``REGISTRY[name](**params)``; fills ``rope_theta`` from a model ``config``.

    Scorers that undo RoPE (ExpectedAttention, Compactor) need the model's RoPE base; with a
    ``config`` it is read from there unless given explicitly.
    """
    if name not in REGISTRY:
        raise InputError("method", f"unknown scorer {name!r}", f"use one of {sorted(REGISTRY)}")
    factory = REGISTRY[name]
    names = {f.name for f in dataclasses.fields(factory)} if dataclasses.is_dataclass(factory) else set()
    unknown = set(params) - names if names else set()
    if unknown:
        raise InputError("params", f"{name} has no parameter(s) {sorted(unknown)}", f"use some of {sorted(names)}")
    if "rope_theta" in names and "rope_theta" not in params and config is not None:
        params["rope_theta"] = rope_theta_of(config)
    return factory(**params)


__all__ = [
    "ALLOCATORS",
    "make_scorer",
    "rope_theta_of",
    "REGISTRY",
    "Allocator",
    "ScoreInputs",
    "Scorer",
    "attention_probs",
    "combine_groups",
    "select_keep",
]
