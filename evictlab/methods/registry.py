"""The method registries and their factories.

:data:`REGISTRY` maps scorer names to scorer dataclasses, :data:`ALLOCATORS` allocator names
to allocator dataclasses. :func:`make_scorer` and :func:`make_allocator` build one from a
name and parameters (strings from the command line or typed values), through the shared
:func:`evictlab.methods.params.build`: unknown parameters are refused, values are coerced by
the dataclass field types, and the dataclass validates them.

A **method text** (:func:`parse_method_text`) is ``SCORER`` or ``SCORER+ALLOCATOR``, each part
optionally with its own parameters in square brackets: ``snapkv[window=32]``,
``trimkv[gates=runs/gates/smollm2-local]+global``, ``snapkv+adakv[alpha=0.3]``,
``snapkv[window=64,pooling=max]+contourkv[ranking=query]``. Its canonical form
(:attr:`MethodText.text`) sorts each part's parameters by key and strips the spaces around
keys and values, so two spellings of one arm are one text; ``+uniform`` without parameters
is dropped (``snapkv+uniform`` is ``snapkv``). A bracket parameter is the arm's own: it
overrides a routed ``--scorer-param`` / ``--allocator-param`` of the same key for that arm
only (:func:`evictlab.methods.method.build_method` merges them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from evictlab.cliutil import split_outside_brackets
from evictlab.errors import InputError
from evictlab.methods import allocators, contour, scorers, trimkv
from evictlab.methods.oracle_labels import OracleLabels
from evictlab.methods.base import Allocator, Scorer
from evictlab.methods.params import build, settable_params
from evictlab.models.geometry import RopeSpec, rope_spec_of

__all__ = ["ALLOCATORS", "REGISTRY", "MethodText", "base_name", "canonical_method", "make_allocator", "make_scorer",
           "parse_method", "parse_method_text", "part_text", "route_params"]

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


Params = tuple[tuple[str, str], ...]
"""A part's bracket parameters: ``(key, value)`` pairs as typed (strings), sorted by key."""

GRAMMAR_FIX = ("write SCORER or SCORER+ALLOCATOR, each optionally with its parameters in brackets: "
               "SCORER[key=value,key2=value2]+ALLOCATOR[key=value], e.g. snapkv[window=32]+adakv[alpha=0.3]")


def part_text(name: str, params: Params) -> str:
    """One part of a method text: ``name`` or ``name[k=v,k2=v2]`` (``params`` as given)."""
    return name if not params else f"{name}[{','.join(f'{k}={v}' for k, v in params)}]"


def base_name(part: str) -> str:
    """The registry name of a part text: ``trimkv[gates=x]`` -> ``trimkv`` (``snapkv`` as is).
    What recognises a scorer or allocator family (e.g. the ContourKV claims)."""
    return part.partition("[")[0].strip()


@dataclass(frozen=True)
class MethodText:
    """A parsed method text (module docstring): registry names and each part's bracket
    parameters (sorted by key, strings as typed). :attr:`text` is the canonical text."""

    scorer: str
    allocator: str
    scorer_params: Params = ()
    allocator_params: Params = ()

    @property
    def scorer_text(self) -> str:
        """``snapkv[window=32]``: the scorer with its bracket parameters."""
        return part_text(self.scorer, self.scorer_params)

    @property
    def allocator_text(self) -> str:
        """``adakv[alpha=0.3]``: the allocator with its bracket parameters."""
        return part_text(self.allocator, self.allocator_params)

    @property
    def text(self) -> str:
        """The canonical method text: ``scorer[...]`` alone for a plain ``uniform``
        allocator, else ``scorer[...]+allocator[...]``."""
        if self.allocator == "uniform" and not self.allocator_params:
            return self.scorer_text
        return f"{self.scorer_text}+{self.allocator_text}"


def _parse_part(part: str, spec: str, kind: str, table: Mapping[str, Any]) -> tuple[str, Params]:
    """``"snapkv[window=32]"`` -> ``("snapkv", (("window", "32"),))``; every refusal is an
    :class:`InputError` with field ``method`` naming ``spec``."""
    name, bracket, rest = part.partition("[")
    name = name.strip()
    if "]" in name:
        raise InputError("method", f"{spec!r} has a ']' without its '['", GRAMMAR_FIX)
    if name not in table:
        raise InputError("method", f"unknown {kind} {name!r} in {spec!r}",
                         f"write SCORER or SCORER+ALLOCATOR with a {kind} from: {', '.join(sorted(table))}")
    if not bracket:
        return name, ()
    rest = rest.rstrip()
    if not rest.endswith("]"):
        where = "is not closed" if "]" not in rest else "is followed by other text"
        raise InputError("method", f"the '[' after {name} in {spec!r} {where}", GRAMMAR_FIX)
    inner = rest[:-1]
    if "[" in inner or "]" in inner:
        raise InputError("method", f"{spec!r} has brackets inside {name}'s parameters", GRAMMAR_FIX)
    if not inner.strip():
        raise InputError("method", f"{name}[] in {spec!r} has no parameters", f"drop the brackets, or {GRAMMAR_FIX}")
    allowed = settable_params(table[name])
    out: dict[str, str] = {}
    for item in inner.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            what = "an empty key" if eq and not key else ("an empty value" if eq else "no '='")
            raise InputError("method", f"{name} parameter {item.strip()!r} in {spec!r} has {what}",
                             f"write each as key=value, e.g. {name}[{next(iter(allowed), 'key')}=...]"
                             if allowed else f"{name} takes no parameters: drop the brackets")
        if key not in allowed:
            valid = ", ".join(sorted(allowed))
            raise InputError("method", f"{kind} {name} has no parameter {key!r} (in {spec!r})",
                             f"use: {valid}" if valid else f"{name} takes no parameters: drop the brackets")
        if key in out:
            raise InputError("method", f"{name} parameter {key} is given twice in {spec!r} ({key}={out[key]} and "
                             f"{key}={value})", "give each parameter once")
        out[key] = value
    return name, tuple(sorted(out.items()))


def parse_method_text(spec: str) -> MethodText:
    """Parse a method text (module docstring): ``"snapkv[window=32]+adakv"`` ->
    ``MethodText("snapkv", "adakv", (("window", "32"),), ())``. A scorer alone means
    ``+uniform``. Unknown names, bad brackets (unclosed, empty, nested), a parameter the
    part does not have, an empty key or value and a key given twice are an
    :class:`InputError` with field ``"method"`` (values are typed when the method is built,
    :func:`evictlab.methods.method.build_method`)."""
    parts = split_outside_brackets(spec.strip(), "+")
    if len(parts) > 2:
        raise InputError("method", f"{spec!r} has more than one '+'", GRAMMAR_FIX)
    scorer, sp = _parse_part(parts[0], spec, "scorer", REGISTRY)
    if len(parts) == 1:
        return MethodText(scorer, "uniform", sp, ())
    if not parts[1].strip():
        raise InputError("method", f"unknown allocator '' in {spec!r}",
                         f"write SCORER+ALLOCATOR with an allocator from: {', '.join(sorted(ALLOCATORS))}")
    alloc, ap = _parse_part(parts[1], spec, "allocator", ALLOCATORS)
    return MethodText(scorer, alloc, sp, ap)


def parse_method(spec: str) -> tuple[str, str]:
    """The registry names of a method text (:func:`parse_method_text`, which checks all of
    it): ``"snapkv"`` -> ``("snapkv", "uniform")``; ``"snapkv[window=32]+adakv"`` ->
    ``("snapkv", "adakv")``. Errors are :class:`InputError` with field ``"method"``."""
    parsed = parse_method_text(spec)
    return parsed.scorer, parsed.allocator


def canonical_method(spec: str) -> str:
    """The canonical text of a method (:attr:`MethodText.text`): what counts as the same
    method in a list (``snapkv+uniform`` is ``snapkv``; parameters sorted by key)."""
    return parse_method_text(spec).text


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
