"""Retention gates: one small MLP per layer, the last projection shared by all layers.

For layer ``l`` and a token with normed hidden state ``x`` (the input of the attention
block, after its input layernorm; shape ``(hidden_size,)``):

    a_l(x)     = silu(W1_l x + b1_l)                       (intermediate,)
    logit_l(x) = W2 a_l(x) + b2                            (kv_heads,)   shared W2, b2
    log beta   = logsigmoid(logit_l(x))                    (kv_heads,)   in (-inf, 0)

``beta = sigmoid(logit)`` is the entry's retention per KV head. With ``shared=True`` (the
DBTrimKV design) ``W2`` and ``b2`` are ONE :class:`GateProjection` used by every layer, so
the scores of every layer and head come out of the same calibrated map: that is what lets
one global budget rank entries across layers. ``shared=False`` (the ``local`` ablation)
gives every layer its own projection. ``b2`` starts at ``bias_init`` (8 by default:
``beta = sigmoid(8) = 0.99966``, so an untrained gate keeps about everything: retention
after 256 steps ``0.917``), ``W1`` and ``W2`` at ``N(0, init_std^2)``, ``b1`` at 0, all drawn
from a generator seeded by ``seed`` (never torch's global RNG).

Everything runs in float32 whatever the model's dtype; log-space (``logsigmoid``) keeps
``log beta`` finite and accurate for ``beta`` near 1 (where ``log(sigmoid)`` would round to 0).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from evictlab.errors import InputError

__all__ = ["GateProjection", "GateSpec", "RetentionGates"]


@dataclass(frozen=True)
class GateSpec:
    """The architecture of a set of gates (what the weights mean; stored in gates.json).

    Attributes:
        n_layers: decoder layers of the model (one first layer per model layer).
        hidden_size: width of the model's hidden state (the gate's input).
        kv_heads: KV heads per layer (one ``log beta`` per KV head and token).
        intermediate: width of the gate's hidden layer.
        shared: True: one final projection and bias for all layers (DBTrimKV, "global
            calibration"); False: one per layer (the ``local`` ablation).
        bias_init: initial final bias (``beta = sigmoid(bias_init)`` at start).
        init_std: standard deviation of the initial weights.
    """

    n_layers: int
    hidden_size: int
    kv_heads: int
    intermediate: int = 64
    shared: bool = True
    bias_init: float = 8.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden_size", "kv_heads", "intermediate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InputError(name, f"must be a positive integer, got {v!r}", f"pass {name} >= 1")
        if not isinstance(self.shared, bool):
            raise InputError("shared", f"must be true or false, got {self.shared!r}", "pass a boolean")
        if not self.init_std > 0:
            raise InputError("init_std", f"must be positive, got {self.init_std}", "use e.g. 0.02")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GateSpec:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def for_model(cls, model: torch.nn.Module, **kw: Any) -> GateSpec:
        """The spec for a transformers model (layers, hidden size, KV heads from its config)."""
        from evictlab.models.geometry import model_geometry, text_config

        g = model_geometry(model)
        return cls(n_layers=g.n_layers, hidden_size=int(text_config(model).hidden_size), kv_heads=g.kv_heads, **kw)


class GateProjection(nn.Module):
    """The final projection and bias of a gate: ``(…, intermediate) -> (…, kv_heads)``."""

    def __init__(self, intermediate: int, kv_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(kv_heads, intermediate))
        self.bias = nn.Parameter(torch.empty(kv_heads))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return F.linear(a, self.weight, self.bias)


class RetentionGates(nn.Module):
    """All gates of one model: per layer a first linear layer, and the final projection(s).

    ``shared``: :attr:`projection` is the one :class:`GateProjection` every layer uses
    (:meth:`projection_of` returns that same object for every layer); ``local``:
    :attr:`projections` holds one per layer. Parameter names (the safetensors keys):
    ``first.{l}.weight`` ``(intermediate, hidden)``, ``first.{l}.bias`` ``(intermediate,)``,
    and ``projection.weight`` ``(kv_heads, intermediate)``, ``projection.bias``
    ``(kv_heads,)`` (shared) or ``projections.{l}.weight`` / ``.bias`` (local).
    """

    def __init__(self, spec: GateSpec, seed: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.first = nn.ModuleList(nn.Linear(spec.hidden_size, spec.intermediate) for _ in range(spec.n_layers))
        if spec.shared:
            self.projection: GateProjection | None = GateProjection(spec.intermediate, spec.kv_heads)
            self.projections: nn.ModuleList | None = None
        else:
            self.projection = None
            self.projections = nn.ModuleList(GateProjection(spec.intermediate, spec.kv_heads)
                                             for _ in range(spec.n_layers))
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic initialisation from ``seed`` (see the module docstring)."""
        gen = torch.Generator().manual_seed(int(seed))
        std = self.spec.init_std
        for lin in self.first:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * std)
            lin.bias.zero_()
        projs = [self.projection] if self.projection is not None else list(self.projections or [])
        for p in projs:
            p.weight.copy_(torch.randn(p.weight.shape, generator=gen) * std)
            p.bias.fill_(self.spec.bias_init)

    def projection_of(self, layer: int) -> GateProjection:
        """The final projection layer ``layer`` uses (the same object for all layers when shared)."""
        if self.projection is not None:
            return self.projection
        assert self.projections is not None
        return self.projections[layer]  # type: ignore[return-value]

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Gate logits ``(..., kv_heads)`` float32 of normed hidden states ``(..., hidden_size)``."""
        if hidden.shape[-1] != self.spec.hidden_size:
            raise InputError("gates", f"layer {layer}: hidden states of width {hidden.shape[-1]}, the gates expect "
                             f"{self.spec.hidden_size}", "use gates trained for this model")
        w = self.first[layer].weight
        a = F.silu(F.linear(hidden.to(w.dtype), w, self.first[layer].bias))
        return self.projection_of(layer)(a)

    def log_beta(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``log beta`` ``(..., kv_heads)`` float32, in (-inf, 0): ``logsigmoid`` of the logits."""
        return F.logsigmoid(self.logits(layer, hidden))

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.log_beta(layer, hidden)
