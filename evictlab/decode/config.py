"""How one method runs through the decode loop: :class:`DecodeConfig` (mode, budget, method and
its parameters, chunking, the protocol), validated on construction, and the names of the modes
and protocols (docs/kv.md; the protocol: :mod:`evictlab.decode.loop`, point 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from evictlab.errors import InputError
from evictlab.kv.budget import Budget
from evictlab.methods.base import Allocator, Scorer
from evictlab.models.geometry import ModelGeometry

Mode = Literal["physical", "masked", "full"]
MODES: tuple[str, ...] = ("physical", "masked", "full")
ProtocolName = Literal["query-agnostic", "query-aware"]
PROTOCOLS: tuple[str, ...] = ("query-agnostic", "query-aware")
"""The two protocols (:mod:`evictlab.decode.loop`, point 2); ``DecodeConfig.protocol`` names a run's."""


@dataclass
class DecodeConfig:
    """How one method runs through the loop.

    ``mode``: ``"physical"`` (paged store, evicted entries freed), ``"masked"`` (full tensors +
    keep mask: the audit of others), or ``"full"`` (no eviction, stock ``DynamicCache``; the
    reference). ``budget`` is required unless ``mode == "full"``. ``scorer_params`` and
    ``allocator_params`` are the method's parameters (strings from the command line are
    typed by the method's dataclass fields, see :mod:`evictlab.methods.params`).

    Validated on construction (:class:`InputError` with the field's name): the mode, the
    sizes, and the method (names and parameters, by building it once).
    """

    mode: Mode = "physical"
    budget: Budget | None = None
    scorer: str = "snapkv"
    scorer_params: dict[str, Any] = field(default_factory=dict)
    allocator: str = "uniform"
    allocator_params: dict[str, Any] = field(default_factory=dict)
    sinks: int = 4
    recent: int = 16
    chunk_size: int = 256
    compress_every: int = 16
    window: int = 32
    block_size: int = 16
    query_aware: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError("mode", f"unknown mode {self.mode!r}", "use physical, masked or full")
        for name in ("chunk_size", "compress_every", "window", "block_size"):
            if int(getattr(self, name)) <= 0:
                raise InputError(name, f"must be positive, got {getattr(self, name)}", "pass a positive integer")
        for name in ("sinks", "recent"):
            if int(getattr(self, name)) < 0:
                raise InputError(name, f"must be >= 0, got {getattr(self, name)}", "pass 0 or more")
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise InputError("budget", f"{self.budget!r} is not a Budget", "pass Budget.parse('64') or similar")
        # Build the method once: unknown names/parameters and bad values fail here, and the
        # parameters are kept typed (what the run record shows).
        scorer = self.build_scorers(None)[0]
        self.scorer_params = {k: getattr(scorer, k) for k in self.scorer_params}
        allocator = self.build_allocator()
        self.allocator_params = {k: getattr(allocator, k) for k in self.allocator_params}

    @property
    def protocol(self) -> str:
        """``"query-aware"`` or ``"query-agnostic"`` (see :data:`PROTOCOLS`)."""
        return PROTOCOLS[1] if self.query_aware else PROTOCOLS[0]

    @property
    def method(self) -> str:
        """The method spec: ``scorer+allocator`` (``scorer`` alone for uniform)."""
        return self.scorer if self.allocator == "uniform" else f"{self.scorer}+{self.allocator}"

    def build_scorers(self, geometry: ModelGeometry | None) -> list[Scorer]:
        """One scorer per layer (one object for all layers, or, for scorers that undo RoPE,
        one per distinct RoPE base; with ``geometry=None`` one scorer with the dataclass
        defaults). An explicit ``rope_theta`` wins."""
        from evictlab.methods import make_scorer

        if geometry is None:
            return [make_scorer(self.scorer, **self.scorer_params)]
        from evictlab.methods.params import settable_params
        from evictlab.methods.registry import REGISTRY

        if "rope_theta" not in settable_params(REGISTRY[self.scorer]):  # one object for every layer
            return [make_scorer(self.scorer, **self.scorer_params)] * geometry.n_layers
        by_rope: dict[Any, Scorer] = {}
        for r in geometry.rope:
            if r not in by_rope:
                by_rope[r] = make_scorer(self.scorer, rope=r, **self.scorer_params)
        return [by_rope[r] for r in geometry.rope]

    def floors(self, geometry: ModelGeometry, total_tokens: int) -> np.ndarray:
        """int64 ``(n_layers, kv_heads)``: the entries ``select_keep`` always keeps per cell
        (sinks + recent), clipped to ``total_tokens`` and to ``window - 1`` on sliding
        layers (a sliding cell never holds more after a compression)."""
        keep = self.sinks + self.recent
        return np.array([[min(keep, total_tokens, w - 1 if w else total_tokens)] * geometry.kv_heads
                         for w in geometry.windows], dtype=np.int64)

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

    def build_allocator(self) -> Allocator:
        from evictlab.methods import make_allocator

        return make_allocator(self.allocator, **self.allocator_params)

    @property
    def needs_labels(self) -> bool:
        """Whether the scorer reads the task's labels (``oracle_labels``: they are passed per
        example by :meth:`with_labels`)."""
        return self.mode != "full" and "labels" in getattr(self.build_scorers(None)[0], "needs", ())

    def with_labels(self, useful: Callable[[], str | None]) -> DecodeConfig:
        """This config for one example: a scorer that reads the task's labels gets them as
        its ``useful`` parameter (``useful()``: the example's asked-fact token spans, e.g.
        :func:`evictlab.tasks.examples.useful_spec`, called only then); any other config is
        returned as is. :class:`InputError` (field ``task``) when the scorer needs labels and
        the example has none, (field ``scorer_param``) when ``useful`` was set by hand: the
        labels are the task's, never a default."""
        if not self.needs_labels:
            return self
        if "useful" in self.scorer_params:
            raise InputError("scorer_param", f"{self.scorer}'s useful keys are the task's fact labels, set per "
                             "example", "drop useful=... from the scorer parameters")
        spans = useful()
        if spans is None:
            raise InputError("task", f"{self.scorer} reads the task's fact labels and this example has none",
                             "use a task with facts (needle, multi_key, ...) or another method")
        return replace(self, scorer_params={**self.scorer_params, "useful": spans})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["budget"] = None if self.budget is None else {"unit": self.budget.unit, "value": self.budget.value}
        for key in ("scorer_params", "allocator_params"):
            d[key] = {k: str(v) if isinstance(v, Path) else v for k, v in d[key].items()}
        return d
