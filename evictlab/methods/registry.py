"""The method registries and their factories.

:data:`REGISTRY` maps scorer names to scorer dataclasses, :data:`ALLOCATORS` allocator names
to allocator dataclasses. :func:`make_scorer` and :func:`make_allocator` build one from a
name and parameters (strings from the command line or typed values), through the shared
:func:`evictlab.methods.params.build`: unknown parameters are refused, values are coerced by
the dataclass field types, and the dataclass validates them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

from evictlab.errors import InputError
from evictlab.methods import allocators, contour, scorers, trimkv
from evictlab.methods.oracle_labels import OracleLabels
from evictlab.methods.base import Allocator, Scorer
from evictlab.methods.params import build, settable_params
from evictlab.models.geometry import RopeSpec, rope_spec_of

__all__ = ["ALLOCATORS", "REGISTRY", "make_allocator", "make_scorer", "parse_method", "route_params"]

REGISTRY: dict[str, Callable[..., Scorer]] = {
    "streaming_llm": scorers.StreamingLLM,
    "h2o": scorers.H2O,
    "snapkv": scorers.SnapKV,
    "expected_attention": scorers.ExpectedAttention,
    "kvzip": scorers.KVzip,
    "compactor": scorers.Compactor,
    "oracle": scorers.Oracle,
    "oracle_labels": OracleLabels,  # ORACLE: reads the task's labels (evictlab.dilution)
    "trimkv": trimkv.TrimKV,
}
"""Scorer name -> scorer dataclass; ``make_scorer(name, **params)`` builds one."""

ALLOCATORS: dict[str, type[Allocator]] = {
    "uniform": allocators.Uniform,
    "pyramidkv": allocators.PyramidKV,
    "adakv": allocators.AdaKV,
    "contourkv": contour.ContourKV,
    "contourkv_mass": contour.ContourKVMass,
    "contourkv_error": contour.ContourKVError,
    "contourkv_relerror": contour.ContourKVRelError,
    "contourkv_pred": contour.ContourKVPred,
    "contourkv_query": contour.ContourKVQuery,
    "contourkv_offline": contour.ContourKVOffline,
    "global": allocators.Global,
}
"""Allocator name -> allocator dataclass; ``make_allocator(name, **params)`` builds one."""


def _lookup(table: dict[str, Any], name: str, kind: str) -> Any:
    if name not in table:
        raise InputError(kind, f"unknown {kind} {name!r}", f"use one of: {', '.join(sorted(table))}")
    return table[name]


def make_scorer(name: str, config: Any | None = None, *, rope: RopeSpec | None = None, **params: Any) -> Scorer:
    """Build scorer ``name`` with ``params`` (see :mod:`evictlab.methods.params`).

    Scorers that undo RoPE (a ``rope_theta`` parameter: ExpectedAttention, Compactor) need
    the model's RoPE base: unless ``rope_theta`` is given it is taken from ``rope`` (one
    layer's :class:`~evictlab.models.geometry.RopeSpec`) or from a model ``config``; a scaled
    or missing base is then an :class:`InputError`. Without either, the dataclass default.
    """
    cls = _lookup(REGISTRY, name, "scorer")
    params = dict(params)
    if "rope_theta" in settable_params(cls) and "rope_theta" not in params:
        if rope is None and config is not None:
            rope = rope_spec_of(config)
        if rope is not None:
            params["rope_theta"] = rope.plain_theta()
    return _loaded(build(cls, params, kind="scorer", name=name), "scorer", name)


def make_allocator(name: str, **params: Any) -> Allocator:
    """Build allocator ``name`` with ``params`` (see :mod:`evictlab.methods.params`)."""
    return _loaded(build(_lookup(ALLOCATORS, name, "allocator"), params, kind="allocator", name=name),
                   "allocator", name)


def _loaded(obj: Any, kind: str, name: str) -> Any:
    """``obj.load()``: the files its parameters name are read here, once, after the
    dataclass was built (its construction reads nothing); a file's error names the
    parameter, as a bad value does."""
    try:
        return obj.load()
    except InputError as exc:
        if exc.field in settable_params(type(obj)):
            value = str(getattr(obj, exc.field))
            raise InputError(f"{kind}_param", f"{name} parameter {exc.field}={value!r}: {exc.problem}",
                             exc.fix) from None
        raise


def parse_method(spec: str) -> tuple[str, str]:
    """``"snapkv"`` -> ``("snapkv", "uniform")``; ``"snapkv+adakv"`` -> ``("snapkv", "adakv")``.

    Unknown names are an :class:`InputError` with field ``"method"``.
    """
    scorer, plus, alloc = spec.strip().partition("+")
    scorer, alloc = scorer.strip(), (alloc.strip() or ("" if plus else "uniform"))
    if scorer not in REGISTRY:
        raise InputError("method", f"unknown scorer {scorer!r} in {spec!r}",
                         f"write SCORER or SCORER+ALLOCATOR with a scorer from: {', '.join(sorted(REGISTRY))}")
    if alloc not in ALLOCATORS:
        raise InputError("method", f"unknown allocator {alloc!r} in {spec!r}",
                         f"write SCORER+ALLOCATOR with an allocator from: {', '.join(sorted(ALLOCATORS))}")
    return scorer, alloc


def route_params(params: Mapping[str, Any], names: Sequence[str], kind: str) -> dict[str, dict[str, Any]]:
    """Send ``params`` to the ``kind`` (``"scorer"`` or ``"allocator"``) methods ``names``.

    A key ``k`` goes to every method in ``names`` that has parameter ``k``; ``name.k`` only to
    method ``name``. A key no chosen method has is an :class:`InputError` (field
    ``"<kind>_param"``) listing what they have; with one method, that method's own
    "has no parameter" error. Returns ``{name: {k: value}}`` for every name.
    """
    table = REGISTRY if kind == "scorer" else ALLOCATORS
    field = f"{kind}_param"
    names = list(dict.fromkeys(names))
    have = {n: set(settable_params(_lookup(table, n, kind))) for n in names}
    out: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in params.items():
        scope, dot, k = key.rpartition(".")
        if dot:
            if scope not in have:
                raise InputError(field, f"{key}: {scope!r} is not a {kind} of the chosen methods "
                                 f"({', '.join(names)})", f"write {k}=... or NAME.{k}=... with NAME among them")
            out[scope][k] = value
            continue
        targets = [n for n in names if key in have[n]]
        if not targets and len(names) == 1:
            targets = names  # the method's own error lists its parameters
        if not targets:
            valid = sorted({f"{n}.{p}" for n in names for p in have[n]})
            raise InputError(field, f"no {kind} among {', '.join(names)} has a parameter {key!r}",
                             f"use: {', '.join(valid) or f'nothing (these {kind}s take no parameters)'}")
        for n in targets:
            out[n][key] = value
    return out
