"""Scorers: one small dataclass per eviction method, each with one ``score(inputs)``.

Every ``score`` takes a :class:`~evictlab.methods.base.ScoreInputs` for one layer and returns
``(b, hk, s)`` float32 scores, higher = keep (shapes: ``b`` batch, ``hq`` query heads, ``hk``
KV heads, ``s`` held keys, ``q`` chunk queries, ``d`` head dim). Sinks and the recency
window are kept by :func:`~evictlab.methods.base.select_keep` whatever the scores say.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evictlab.methods.base import ScoreInputs

__all__ = ["StreamingLLM"]


@dataclass
class StreamingLLM:
    """StreamingLLM (Xiao et al., 2023): keep the attention sinks and the most recent keys.

    The score is the key's absolute position, so with the sinks forced by ``select_keep`` the
    kept set is sinks + the newest ``size - sinks`` keys. Identical for every KV head (no
    GQA combination needed).

    Shapes: ``positions (s,)`` -> scores ``(b, hk, s)``.
    """

    name: str = "streaming_llm"
    needs: frozenset[str] = field(default_factory=frozenset)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        b, hk, s, _ = inputs.keys.shape
        pos = inputs.positions.to(inputs.keys.device, torch.float32)
        return pos.expand(b, hk, s).clone()
