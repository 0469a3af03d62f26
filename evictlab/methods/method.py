"""One eviction method, built once: :class:`Method` (scorer, allocator, what they need).

A method text is ``SCORER`` or ``SCORER+ALLOCATOR`` (``snapkv`` is ``snapkv+uniform``), each
part optionally with its own parameters in brackets (``snapkv[window=32]+adakv[alpha=0.3]``,
:func:`evictlab.methods.registry.parse_method_text`), plus ``k=v`` parameters given beside it
(routed ``--scorer-param`` / ``--allocator-param``; a bracket parameter overrides one of the
same key). :func:`build_method` turns it into a :class:`Method`
once: the registry builds the scorer and the allocator (validating every parameter and
reading the files they name, :mod:`evictlab.methods.params`), and the method's needs are
read from their classes' declarations (:class:`~evictlab.methods.base.Scorer`'s
``needs``/``uses_all_queries``, :attr:`Allocator.needs`) into fields, so the decode loop,
``decode``, ``audit``, the evaluation grid and the dilution sweep read fields instead of
probing objects, and nothing is built twice.

A method is model-independent until :meth:`Method.for_model` binds it to a model's
:class:`~evictlab.models.geometry.ModelGeometry`: then every layer gets its scorer (one
object for all layers, or, for scorers that undo RoPE, one per distinct RoPE base unless a
``rope_theta`` was given) and the allocator checks the model (e.g. a profile fitted on
another geometry is refused). Bound methods are cached per geometry, so a run over many
examples binds once.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evictlab.errors import InputError
from evictlab.methods.base import Allocator, Scorer
from evictlab.methods.params import settable_params
from evictlab.methods.registry import REGISTRY, MethodText, Params, make_allocator, make_scorer, parse_method_text

if TYPE_CHECKING:  # pragma: no cover - typing only
    from evictlab.models.geometry import ModelGeometry

__all__ = ["Method", "build_method", "param_text"]


def param_text(value: Any) -> Any:
    """A parameter value as a run record shows it (paths as text, the rest unchanged)."""
    return str(value) if isinstance(value, Path) else value


@dataclass(frozen=True)
class Method:
    """A scorer and an allocator built once, with what they need from the decode loop.

    Attributes:
        scorer_name, allocator_name: registry names (``uniform`` for a bare scorer).
        scorer_params, allocator_params: the parameters given, typed by the dataclasses
            (only those given: the bracket parameters merged over the routed ones; the rest
            are the defaults the objects carry).
        scorer: the scorer built with its parameters (the dataclass defaults otherwise).
        allocator: the allocator built with its parameters.
        needs: what the scorer and the allocator need beyond held keys and recent queries
            (``"reconstruction"``, ``"future"``, ``"gates"``, ``"labels"``,
            ``"window_profile"``; see :data:`evictlab.methods.base.NEEDS`).
        all_queries: True when the scorer reads every query since its previous call, False
            for the last ``window`` queries (:attr:`Scorer.uses_all_queries`).
        layer_scorers: per layer, the scorer of a method bound to a model
            (:meth:`for_model`); empty for an unbound one.
        geometry: the model geometry a bound method was bound to (None unbound).
        scorer_inline, allocator_inline: the bracket parameters of the method text
            (``snapkv[window=32]``: ``(("window", "32"),)``), part of :attr:`spec`.
    """

    scorer_name: str
    allocator_name: str
    scorer_params: Mapping[str, Any]
    allocator_params: Mapping[str, Any]
    scorer: Scorer
    allocator: Allocator
    needs: frozenset[str]
    all_queries: bool
    layer_scorers: tuple[Scorer, ...] = ()
    geometry: ModelGeometry | None = None
    scorer_inline: Params = ()
    allocator_inline: Params = ()
    _bound: dict[Any, Method] = field(default_factory=dict, repr=False, compare=False)
    _lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def of(cls, scorer_name: str, allocator_name: str, scorer_params: Mapping[str, Any],
           allocator_params: Mapping[str, Any], scorer: Scorer, allocator: Allocator, *,
           scorer_inline: Params = (), allocator_inline: Params = ()) -> Method:
        """A method from built parts (what :func:`build_method` returns); the needs are read
        from the parts' declarations here, once."""
        needs = frozenset(type(scorer).needs) | frozenset(allocator.needs)
        return cls(scorer_name, allocator_name, dict(scorer_params), dict(allocator_params), scorer, allocator,
                   needs, bool(type(scorer).uses_all_queries), scorer_inline=tuple(scorer_inline),
                   allocator_inline=tuple(allocator_inline))

    # -- names ---------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        """The canonical method text (:attr:`evictlab.methods.registry.MethodText.text`):
        ``scorer`` for uniform sizes, else ``scorer+allocator``, each part with its bracket
        parameters (``snapkv[window=32]+adakv``)."""
        return MethodText(self.scorer_name, self.allocator_name, self.scorer_inline, self.allocator_inline).text

    @property
    def reconstruction(self) -> bool:
        """KVzip-style: the loop runs a context-reconstruction pass before compressing."""
        return "reconstruction" in self.needs

    @property
    def future(self) -> bool:
        """The ORACLE: the loop passes the true future queries (question and answer)."""
        return "future" in self.needs

    @property
    def labels(self) -> bool:
        """The label ORACLE: the scorer reads the task's useful-token positions."""
        return "labels" in self.needs

    @property
    def gates(self) -> bool:
        """The scorer records data during every forward (TrimKV's gates): a context
        prefilled elsewhere must bring its hidden states (:meth:`Scorer.record_context`)."""
        return "gates" in self.needs

    @property
    def window_profile(self) -> bool:
        """The allocator reads the observation window's statistics (:class:`~evictlab.methods.
        base.WindowProfile`): any of ``"window_profile"``, ``"window_ranked"``, ``"window_error"``."""
        return bool({"window_profile", "window_ranked", "window_error"} & self.needs)

    @property
    def window_ranked(self) -> bool:
        """The allocator reads the window's dropped mass along the scorer's keep order."""
        return bool({"window_ranked", "window_error"} & self.needs)

    @property
    def window_error(self) -> bool:
        """The allocator reads the window's forced error along the scorer's keep order."""
        return "window_error" in self.needs

    @property
    def question_specific(self) -> bool:
        """The kept set depends on the question (the ORACLEs): one compression per
        question, never one compressed cache shared by several questions."""
        return self.future or self.labels

    def with_scorer_params(self, **params: Any) -> Method:
        """This method with its scorer rebuilt with ``params`` added (the allocator, and the
        files it read, are kept): e.g. one example's labels for the label ORACLE."""
        merged = {**self.scorer_params, **params}
        scorer = make_scorer(self.scorer_name, **merged)
        typed = {k: getattr(scorer, k) for k in merged}
        return Method.of(self.scorer_name, self.allocator_name, typed, self.allocator_params, scorer, self.allocator,
                         scorer_inline=self.scorer_inline, allocator_inline=self.allocator_inline)

    def record(self) -> dict[str, Any]:
        """The method as a run record shows it."""
        return {"method": self.spec, "scorer": self.scorer_name, "allocator": self.allocator_name,
                "scorer_params": {k: param_text(v) for k, v in self.scorer_params.items()},
                "allocator_params": {k: param_text(v) for k, v in self.allocator_params.items()}}

    # -- binding to a model --------------------------------------------------------------
    def check_weights(self, model: Any) -> None:
        """The checks that need the model's weights, not only its geometry: a scorer reading
        files chosen by the model (``trimkv`` with ``gates=default``: the shipped gates whose
        weights digest is the model's) finds them. :class:`InputError` (``scorer_param``)
        naming what is shipped otherwise; call it before any run writes anything."""
        self.scorer.check_weights(model)

    def for_model(self, geometry: ModelGeometry) -> Method:
        """This method bound to a model (module docstring): per-layer scorers, the
        allocator checked against ``geometry`` (:class:`InputError` when it cannot serve
        it). Cached per geometry; a bound method binds to its own geometry as itself."""
        if self.geometry is not None:
            if self.geometry == geometry:
                return self
            raise ValueError("this method is bound to another model; bind the unbound method")
        with self._lock:
            hit = self._bound.get(geometry)
        if hit is not None:
            return hit
        self.allocator.check(geometry)
        if "rope_theta" in self.scorer_params or "rope_theta" not in settable_params(REGISTRY[self.scorer_name]):
            layers = (self.scorer,) * geometry.n_layers  # one object for every layer
        else:
            by_rope: dict[Any, Scorer] = {}
            for r in geometry.rope:
                if r not in by_rope:
                    by_rope[r] = make_scorer(self.scorer_name, rope=r, **self.scorer_params)
            layers = tuple(by_rope[r] for r in geometry.rope)
        bound = Method(self.scorer_name, self.allocator_name, self.scorer_params, self.allocator_params,
                       layers[0], self.allocator, self.needs, self.all_queries, layers, geometry,
                       self.scorer_inline, self.allocator_inline)
        with self._lock:
            self._bound[geometry] = bound
        return bound

    def distinct_scorers(self) -> list[Scorer]:
        """The distinct scorer objects of a bound method (each attached once per run)."""
        return list({id(s): s for s in (self.layer_scorers or (self.scorer,))}.values())


def build_method(spec: str, scorer_params: Mapping[str, Any] | None = None,
                 allocator_params: Mapping[str, Any] | None = None) -> Method:
    """The :class:`~evictlab.methods.method.Method` of ``spec`` (a method text,
    :func:`evictlab.methods.registry.parse_method_text`: ``SCORER[k=v,...]+ALLOCATOR[k=v,...]``)
    with each part's parameters (strings from the command line or typed values): the bracket
    parameters of ``spec`` are merged over ``scorer_params`` / ``allocator_params`` (a bracket
    key overrides the same key given beside it, for this method only); both parts built once,
    every parameter validated and the files they name read (:class:`InputError` with field
    ``method`` for the method text and its bracket parameters, ``scorer_param`` or
    ``allocator_param`` for the others)."""
    text = parse_method_text(spec)
    sp = {**dict(scorer_params or {}), **dict(text.scorer_params)}
    ap = {**dict(allocator_params or {}), **dict(text.allocator_params)}
    scorer = _built(make_scorer, text.scorer, sp, text.scorer_params, spec)
    allocator = _built(make_allocator, text.allocator, ap, text.allocator_params, spec)
    typed_s = {k: getattr(scorer, k) for k in sp}
    typed_a = {k: getattr(allocator, k) for k in ap}
    return Method.of(text.scorer, text.allocator, typed_s, typed_a, scorer, allocator,
                     scorer_inline=text.scorer_params, allocator_inline=text.allocator_params)


def _built(make: Any, name: str, params: Mapping[str, Any], inline: Params, spec: str) -> Any:
    """``make(name, **params)``; a bad value of a bracket parameter (its type, the
    dataclass's own check, a file it names) is re-raised under ``method``, where it was
    written (the factories' messages start ``NAME parameter KEY=``)."""
    try:
        return make(name, **params)
    except InputError as exc:
        if exc.field in ("scorer_param", "allocator_param") and any(
                exc.problem.startswith(f"{name} parameter {k}=") for k, _ in inline):
            raise InputError("method", f"{exc.problem} (in {spec!r})", exc.fix) from None
        raise
