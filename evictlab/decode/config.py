"""How one method runs through the decode loop: :class:`LoopSettings` (the loop's sizes:
sinks, recency window, chunk, compression interval, observation window, page size; the one
settings type of ``decode``, ``audit``, the evaluation grid and the dilution sweep) and
:class:`DecodeConfig` (mode, budget, the built :class:`~evictlab.methods.method.Method`,
the settings, the protocol), validated on construction, and the names of the modes and
protocols (docs/kv.md; the protocol: :mod:`evictlab.decode.loop`, point 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

import numpy as np

from evictlab.errors import InputError
from evictlab.kv.budget import Budget
from evictlab.methods.method import Method
from evictlab.models.geometry import ModelGeometry

__all__ = ["MODES", "PROTOCOLS", "DecodeConfig", "LoopSettings", "Mode", "ProtocolName"]

Mode = Literal["physical", "masked", "full"]
MODES: tuple[str, ...] = ("physical", "masked", "full")
ProtocolName = Literal["query-agnostic", "query-aware"]
PROTOCOLS: tuple[str, ...] = ("query-agnostic", "query-aware")
"""The two protocols (:mod:`evictlab.decode.loop`, point 2); ``DecodeConfig.protocol`` names a run's."""


@dataclass(frozen=True)
class LoopSettings:
    """The decode loop's sizes, in tokens (validated: :class:`InputError` naming the field).

    ``sinks`` and ``recent``: entries every cell always keeps (the oldest and the newest);
    ``chunk_size``: context tokens fed between two prefill compressions (a chunk as long
    as the context is the one-pass prefill); ``compress_every``: decode steps between two
    compressions; ``window``: the observation window (the last queries the scorers read);
    ``block_size``: entries per page of the paged store.
    """

    sinks: int = 4
    recent: int = 16
    chunk_size: int = 256
    compress_every: int = 16
    window: int = 32
    block_size: int = 16

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise InputError(f.name, f"{v!r} is not a whole number", "pass an integer")
        for name in ("chunk_size", "compress_every", "window", "block_size"):
            if getattr(self, name) <= 0:
                raise InputError(name, f"must be positive, got {getattr(self, name)}", "pass a positive integer")
        for name in ("sinks", "recent"):
            if getattr(self, name) < 0:
                raise InputError(name, f"must be >= 0, got {getattr(self, name)}", "pass 0 or more")

    def floors(self, geometry: ModelGeometry, total_tokens: int) -> np.ndarray:
        """int64 ``(n_layers, kv_heads)``: the entries ``select_keep`` always keeps per cell
        (sinks + recent), clipped to ``total_tokens`` and to ``window - 1`` on sliding
        layers (a sliding cell never holds more after a compression)."""
        keep = self.sinks + self.recent
        return np.array([[min(keep, total_tokens, w - 1 if w else total_tokens)] * geometry.kv_heads
                         for w in geometry.windows], dtype=np.int64)


@dataclass(frozen=True)
class DecodeConfig:
    """How one method runs through the loop.

    ``mode``: ``"physical"`` (paged store, evicted entries freed), ``"masked"`` (full tensors +
    keep mask: the audit of others), or ``"full"`` (no eviction, stock ``DynamicCache``; the
    reference). ``budget`` and ``method`` (built once by
    :func:`evictlab.methods.build_method`) are required unless ``mode == "full"``.
    :meth:`of` builds one from a method's names and parameters.
    """

    mode: Mode = "physical"
    budget: Budget | None = None
    method: Method | None = None
    loop: LoopSettings = field(default_factory=LoopSettings)
    query_aware: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError("mode", f"unknown mode {self.mode!r}", "use physical, masked or full")
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise InputError("budget", f"{self.budget!r} is not a Budget", "pass Budget.parse('64') or similar")
        if not isinstance(self.loop, LoopSettings):
            raise InputError("loop", f"{self.loop!r} is not LoopSettings", "pass LoopSettings(...)")
        if self.mode != "full" and self.method is None:
            raise InputError("method", "an evicting mode needs a method", "pass method=build_method('snapkv')")

    @classmethod
    def of(cls, *, mode: Mode = "physical", budget: Budget | None = None, scorer: str = "snapkv",
           allocator: str = "uniform", scorer_params: dict[str, Any] | None = None,
           allocator_params: dict[str, Any] | None = None, query_aware: bool = False,
           **loop: Any) -> DecodeConfig:
        """A config from the method's names and parameters (the method is built here, once;
        ``loop`` are :class:`LoopSettings` fields). A full-cache config builds no method."""
        from evictlab.methods import build_method

        unknown = sorted(set(loop) - {f.name for f in fields(LoopSettings)})
        if unknown:
            raise TypeError(f"unknown loop settings {unknown}")
        spec = scorer if allocator == "uniform" else f"{scorer}+{allocator}"
        method = None if mode == "full" else build_method(spec, scorer_params, allocator_params)
        return cls(mode=mode, budget=budget, method=method, loop=LoopSettings(**loop), query_aware=query_aware)

    @property
    def protocol(self) -> str:
        """``"query-aware"`` or ``"query-agnostic"`` (see :data:`PROTOCOLS`)."""
        return PROTOCOLS[1] if self.query_aware else PROTOCOLS[0]

    @property
    def spec(self) -> str:
        """The method text: ``scorer+allocator`` (``scorer`` alone for uniform), ``full``."""
        return "full" if self.method is None else self.method.spec

    def floors(self, geometry: ModelGeometry, total_tokens: int) -> np.ndarray:
        """See :meth:`LoopSettings.floors`."""
        return self.loop.floors(geometry, total_tokens)

    def budget_tokens(self, geometry: ModelGeometry, total_tokens: int) -> int:
        """Kept entries per sequence for ``geometry``; :class:`InputError` (field ``budget``)
        when there is no budget or it is below the summed always-kept floors."""
        if self.budget is None:
            raise InputError("budget", "a budget is required in physical and masked modes", "pass a budget")
        tokens = self.budget.total_tokens(geometry.n_layers, geometry.kv_heads, geometry.head_dim, geometry.dtype)
        floor_total = int(self.floors(geometry, total_tokens).sum())
        if tokens < floor_total:
            raise InputError("budget", f"{tokens} kept tokens per sequence is below the {floor_total} always-kept "
                             f"sinks + recent entries ({geometry.cells} cells)", "raise the budget or lower sinks/recent")
        return tokens

    @property
    def needs_labels(self) -> bool:
        """Whether the scorer reads the task's labels (``oracle_labels``: they are passed per
        example by :meth:`with_labels`)."""
        return self.method is not None and self.method.labels

    def with_labels(self, useful: Callable[[], str | None]) -> DecodeConfig:
        """This config for one example: a scorer that reads the task's labels gets them as
        its ``useful`` parameter (``useful()``: the example's asked-fact token spans, e.g.
        :func:`evictlab.tasks.examples.useful_spec`, called only then; only the scorer is
        rebuilt); any other config is returned as is. :class:`InputError` (field ``task``)
        when the scorer needs labels and the example has none, (field ``scorer_param``) when
        ``useful`` was set by hand: the labels are the task's, never a default."""
        if not self.needs_labels:
            return self
        assert self.method is not None
        if "useful" in self.method.scorer_params:
            raise InputError("scorer_param", f"{self.method.scorer_name}'s useful keys are the task's fact labels, "
                             "set per example", "drop useful=... from the scorer parameters")
        spans = useful()
        if spans is None:
            raise InputError("task", f"{self.method.scorer_name} reads the task's fact labels and this example has "
                             "none", "use a task with facts (needle, multi_key, ...) or another method")
        return replace(self, method=self.method.with_scorer_params(useful=spans))

    def to_dict(self) -> dict[str, Any]:
        """The config as a run record shows it."""
        d: dict[str, Any] = {"mode": self.mode,
                             "budget": None if self.budget is None else {"unit": self.budget.unit,
                                                                         "value": self.budget.value}}
        d.update(self.method.record() if self.method is not None else {"method": "full"})
        d.update(asdict(self.loop))
        d["query_aware"] = self.query_aware
        return d
