"""ORACLE scorer that reads the task's labels: it never evicts a useful key.

Used by the dilution sweep (:mod:`evictlab.dilution.sweep`) as the reference "evict
distractors only": the useful keys are the tokens of the fact the question asks for, given
as absolute token positions; every other key is a distractor. It is labelled an oracle
everywhere because no real method knows which keys the question will need.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from evictlab.errors import InputError
from evictlab.methods.base import ScoreInputs, Scorer

_SPANS = re.compile(r"^\s*\d+:\d+\s*(,\s*\d+:\d+\s*)*$")
#: Score added to a useful key: far above any position, exact in float32 with it.
USEFUL_BONUS = 1.0e7


def parse_spans(text: str) -> list[tuple[int, int]]:
    """``"12:20,40:45"`` -> ``[(12, 20), (40, 45)]`` (half-open token position ranges)."""
    if not _SPANS.match(text or ""):
        raise InputError("useful", f"{text!r} is not a list of START:END position ranges",
                         "pass e.g. useful=120:139,400:419")
    out = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    bad = [f"{a}:{b}" for a, b in out if not a < b]
    if bad:
        raise InputError("useful", f"empty range {bad[0]}", "use START < END")
    return out  # type: ignore[return-value]


@dataclass
class OracleLabels(Scorer):
    """ORACLE (labelled): keep the useful keys, then the most recent ones.

    ``useful``: the useful keys' absolute positions as ``START:END`` ranges, comma-separated:
    the task's labels, which the commands pass per example
    (:meth:`evictlab.decode.config.DecodeConfig.with_labels`). There is no default: without
    labels the scorer refuses to score (it would silently be StreamingLLM).
    score[k] = position(k) + 1e7 if k is useful else position(k): with the sinks and the
    recency window that :func:`~evictlab.methods.base.select_keep` always keeps, the kept
    set is sinks + every useful key (while the budget allows) + the most recent keys, so the
    evicted keys are distractors only. Identical for every KV head.

    Shapes: ``positions (s,)`` -> scores ``(b, hk, s)``.
    """

    useful: str | None = None
    name: ClassVar[str] = "oracle_labels"
    needs: ClassVar[frozenset[str]] = frozenset({"labels"})

    def __post_init__(self) -> None:
        self.spans = None if self.useful is None else parse_spans(self.useful)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        if self.spans is None:
            raise InputError("useful", "oracle_labels has no labels (no useful=START:END ranges)",
                             "pass the task's labels (DecodeConfig.with_labels)")
        b, hk, s, _ = inputs.keys.shape
        pos = inputs.positions.to(inputs.keys.device)
        hit = torch.zeros(s, dtype=torch.bool, device=pos.device)
        for a, z in self.spans:
            hit |= (pos >= a) & (pos < z)
        score = pos.double() + USEFUL_BONUS * hit.double()
        return score.float().expand(b, hk, s).clone()
