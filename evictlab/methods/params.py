"""Method parameters: ``k=v`` strings from the command line, typed by the method's dataclass.

Scorers and allocators are dataclasses; their settable parameters are their ``init``
fields (except ``name`` and ``needs``, which say what the method is). Both factories
(:func:`evictlab.methods.make_scorer`, :func:`evictlab.methods.make_allocator`) go through
:func:`build`, which refuses unknown parameters (listing the valid ones) and coerces string
values by the field's annotation:

| annotation | accepted strings |
|---|---|
| ``int`` | ``12``, ``-3`` (no fractions) |
| ``float`` | ``0.2``, ``1e-3``, ``20`` |
| ``bool`` | ``true/false``, ``1/0``, ``yes/no``, ``on/off`` (any case) |
| ``str``, ``Path`` | the text (a ``Path`` is expanded: ``~`` works) |
| ``Literal["a", "b"]`` | one of the listed values |
| ``X | None`` | ``none`` / ``null`` for None, else as ``X`` |

Values that are not strings (the Python API) are checked against the same annotations
(an ``int`` is accepted for a ``float``; a ``bool`` is never an ``int``).

Errors are :class:`~evictlab.errors.InputError` with a neutral field, ``"<kind>_param"``
(``scorer_param``, ``allocator_param``); the ``decode``/``audit`` commands report them as
their ``--scorer-param`` / ``--allocator-param`` options.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from evictlab.errors import InputError

__all__ = ["build", "parse_assignments", "settable_params"]

T = TypeVar("T")
_NOT_PARAMS = frozenset({"name", "needs"})
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_assignments(items: Sequence[str], field: str) -> dict[str, str]:
    """``["k=v", ...]`` -> ``{"k": "v"}`` (values stay strings; :func:`build` types them).

    ``field`` names the option in errors. A missing ``=``, an empty key or a key given
    twice is an :class:`InputError`.
    """
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise InputError(field, f"{item!r} is not of the form key=value", "write e.g. alpha=0.3")
        if key in out:
            raise InputError(field, f"{key} is given twice ({key}={out[key]} and {key}={value.strip()})",
                             "give each parameter once")
        out[key] = value.strip()
    return out


def settable_params(cls: type) -> dict[str, Any]:
    """``{parameter: annotation}`` of a method dataclass (its init fields but name/needs)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)
            if f.init and f.name not in _NOT_PARAMS}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if _is_optional(tp):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in inner) + " or none"
    return getattr(tp, "__name__", str(tp))


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` converted to ``tp``; ValueError if it cannot be."""
    if _is_optional(tp):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(value, a)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors))
    if typing.get_origin(tp) is Literal:
        for lit in typing.get_args(tp):
            if value == lit or (isinstance(value, str) and value.strip() == str(lit)):
                return lit
        raise ValueError(f"not {_type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError("not a boolean")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            return int(value.strip())
        raise ValueError("not an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            return float(value.strip())
        raise ValueError("not a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError("not a string")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value).expanduser()
        raise ValueError("not a path")
    raise ValueError(f"type {_type_name(tp)} cannot be set as a parameter")


def build(cls: type[T], params: Mapping[str, Any], *, kind: str, name: str) -> T:
    """``cls(**typed params)``: unknown names and untypable values are InputErrors.

    ``kind`` is ``"scorer"`` or ``"allocator"`` (the error field is ``"<kind>_param"``),
    ``name`` the registry name (for the message). A validation error the dataclass raises
    itself (``__post_init__``, naming its parameter) is re-raised with that field, the
    parameter and the value, so the message says which option to change.
    """
    field = f"{kind}_param"
    allowed = settable_params(cls)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        valid = ", ".join(sorted(allowed)) or "none (it takes no parameters)"
        raise InputError(field, f"{kind} {name} has no parameter {', '.join(unknown)}", f"use: {valid}")
    typed: dict[str, Any] = {}
    for key, raw in params.items():
        try:
            typed[key] = _coerce(raw, allowed[key])
        except ValueError:
            raise InputError(field, f"{name} parameter {key}={raw!r} is not {_type_name(allowed[key])}",
                             f"write {key}=<{_type_name(allowed[key])}>") from None
    try:
        return cls(**typed)
    except InputError as exc:
        if exc.field in typed:
            raise InputError(field, f"{name} parameter {exc.field}={params[exc.field]!r}: {exc.problem}",
                             exc.fix) from None
        raise
