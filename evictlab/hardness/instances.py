"""The two decision problems of the reduction, their validation, JSON form and certificates.

* **k-subset-sum** (the NP-complete source): integers ``x_1..x_n``, a count ``k`` with
  ``0 <= k <= n`` and a target ``T``; is there a set ``S`` of exactly ``k`` indices with
  ``sum(x_S) == T``?
* **ZERO-ES** (the eviction problem, uniform mass, d = 1): integers ``v_1..v_N`` and a
  budget ``s`` with ``1 <= s <= N``; is there a set ``A`` of exactly ``s`` indices whose
  mean equals the mean of all values, i.e. ``N * sum(v_A) == s * sum(v)``? With uniform
  ``p`` the forced output is ``mean(v_A)`` and the dense output is ``mean(v)``, so this is
  exactly ``ES(s) == 0``.

Everything here is pure Python ``int``: a float, a bool or a string where an integer is
expected is an :class:`~evictlab.errors.InputError`, never silently converted, because a
single rounded value can flip a yes into a no.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from evictlab.errors import InputError

SOURCE_PROBLEM = "k-subset-sum"
IMAGE_PROBLEM = "zero-es"

# CP-SAT stores every coefficient and every partial sum of a linear constraint as a signed
# 64-bit integer and refuses a model whose activity could overflow. We keep a factor-two
# margin below 2^63 on the sum of |coefficients| (+ |right-hand side|), so no intermediate
# sum the solver forms can overflow.
CPSAT_LIMIT = 2**62


def _is_int(x: object) -> bool:
    """True for a genuine integer (Python or numpy); ``bool`` is an ``int`` subclass but not a number here."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _check_int(field: str, x: object) -> int:
    if not _is_int(x):
        raise InputError(
            field,
            f"expected an integer, got {type(x).__name__} {x!r}",
            "write a plain JSON integer (no decimal point, quotes or true/false)",
        )
    return int(x)


def _check_values(field: str, values: object) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple, np.ndarray)) or (isinstance(values, np.ndarray) and values.ndim != 1):
        raise InputError(field, f"expected a list of integers, got {type(values).__name__}",
                         "give the values as a JSON list such as [3, -1, 4]")
    if len(values) == 0:
        raise InputError(field, "the list is empty", "give at least one integer value")
    return tuple(_check_int(f"{field}[{i}]", x) for i, x in enumerate(values))


def _check_certificate(field: str, kept: Iterable[object], n: int, size: int) -> tuple[int, ...]:
    """Validate a certificate: ``size`` distinct indices in ``0..n-1``; returns them sorted."""
    idx = [_check_int(f"{field}[{j}]", i) for j, i in enumerate(kept)]
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise InputError(field, f"index {bad[0]} is outside 0..{n - 1}", "use 0-based indices into values")
    if len(set(idx)) != len(idx):
        raise InputError(field, "an index appears twice", "list each kept index once")
    if len(idx) != size:
        raise InputError(field, f"holds {len(idx)} indices but the instance asks for {size}",
                         f"give exactly {size} indices")
    return tuple(sorted(idx))


@dataclass(frozen=True)
class KSubsetSum:
    """A k-subset-sum instance: is there ``S``, ``|S| = k``, with ``sum(values[S]) == target``?"""

    values: tuple[int, ...]
    k: int
    target: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", _check_values("values", self.values))
        k = _check_int("k", self.k)
        if not 0 <= k <= len(self.values):
            raise InputError("k", f"k = {k} is outside 0..n = 0..{len(self.values)}",
                             "choose how many values to pick, between 0 and the number of values")
        # Store Python ints even when given numpy integers (fixed width would overflow later).
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "target", _check_int("target", self.target))

    @property
    def n(self) -> int:
        return len(self.values)

    def is_certificate(self, chosen: Iterable[int]) -> bool:
        """Exact check of a source certificate (NP membership): k distinct indices summing to T."""
        chosen = tuple(chosen)
        if len(chosen) != self.k or len(set(chosen)) != self.k:
            return False
        if not all(_is_int(i) and 0 <= i < self.n for i in chosen):
            return False
        return sum(self.values[int(i)] for i in chosen) == self.target

    def to_json(self) -> dict[str, Any]:
        return {"problem": SOURCE_PROBLEM, "values": list(self.values), "k": self.k,
                "target": self.target}


@dataclass(frozen=True)
class ZeroES:
    """A ZERO-ES instance: uniform mass over ``values``, keep ``s``; does a zero-error subset exist?"""

    values: tuple[int, ...]
    s: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", _check_values("values", self.values))
        s = _check_int("s", self.s)
        if not 1 <= s <= len(self.values):
            raise InputError("s", f"s = {s} is outside 1..N = 1..{len(self.values)}",
                             "keep at least one and at most all of the values")
        object.__setattr__(self, "s", s)

    @property
    def n(self) -> int:
        return len(self.values)

    def is_certificate(self, kept: Iterable[int]) -> bool:
        """Exact check of an image certificate: s distinct indices with N*sum(v_A) == s*sum(v)."""
        kept = tuple(kept)
        if len(kept) != self.s or len(set(kept)) != self.s:
            return False
        if not all(_is_int(i) and 0 <= i < self.n for i in kept):
            return False
        # Cross-multiplied mean equality: no division, so no rounding.
        return self.n * sum(self.values[int(i)] for i in kept) == self.s * sum(self.values)

    def centred(self) -> tuple[int, ...]:
        """Coefficients ``c_i = N*v_i - sum(v)``: a size-s set A has zero error iff sum(c_A) == 0.

        (sum over A of c_i = N*sum(v_A) - s*sum(v) when |A| = s.)
        """
        total = sum(self.values)
        return tuple(self.n * v - total for v in self.values)

    def to_json(self) -> dict[str, Any]:
        return {"problem": IMAGE_PROBLEM, "values": list(self.values), "s": self.s}


def check_cpsat_limits(instance: KSubsetSum | ZeroES) -> None:
    """Raise :class:`InputError` when CP-SAT's 64-bit arithmetic could overflow on ``instance``.

    Source: ``sum |x_i|`` and ``|T|`` must each be at most ``CPSAT_LIMIT`` (2^62). Image: the
    CP-SAT model uses the centred coefficients ``N*v_i - sum(v)``; the sum of their absolute
    values must be at most 2^62. The exact DP has no such limit (Python integers).
    """
    if isinstance(instance, KSubsetSum):
        mag = sum(abs(x) for x in instance.values)
        if mag > CPSAT_LIMIT:
            raise InputError("values", f"sum of |values| is {mag}, beyond CP-SAT's limit 2^62 = {CPSAT_LIMIT}",
                             "use smaller integers, or decide with the exact DP only (--method dp)")
        if abs(instance.target) > CPSAT_LIMIT:
            raise InputError("target", f"|target| = {abs(instance.target)} is beyond CP-SAT's limit 2^62",
                             "use a smaller target, or decide with the exact DP only (--method dp)")
    else:
        mag = sum(abs(c) for c in instance.centred())
        if mag > CPSAT_LIMIT:
            raise InputError(
                "values",
                f"sum of |N*v_i - sum(v)| is {mag}, beyond CP-SAT's int64 limit 2^62 = {CPSAT_LIMIT}",
                "use smaller integers or fewer values, or decide with the exact DP only (--method dp)",
            )


def within_cpsat_limits(instance: KSubsetSum | ZeroES) -> bool:
    """True when :func:`check_cpsat_limits` would accept ``instance``."""
    try:
        check_cpsat_limits(instance)
    except InputError:
        return False
    return True


def parse_instance(obj: object, expect: str | None = None) -> KSubsetSum | ZeroES:
    """Build an instance from a decoded JSON object, checking every field.

    ``expect`` (``"k-subset-sum"`` or ``"zero-es"``) rejects the other problem with a clear error.
    Unknown keys are rejected rather than ignored, so a typo (``"traget"``) never passes.
    """
    if not isinstance(obj, dict):
        raise InputError("instance", f"expected a JSON object, got {type(obj).__name__}",
                         'write an object such as {"problem": "zero-es", "values": [1, 2, 3], "s": 1}')
    problem = obj.get("problem")
    known = {SOURCE_PROBLEM: ("problem", "values", "k", "target"),
             IMAGE_PROBLEM: ("problem", "values", "s")}
    if problem not in known:
        raise InputError("problem", f"unknown problem {problem!r}",
                         f'set "problem" to "{SOURCE_PROBLEM}" or "{IMAGE_PROBLEM}"')
    if expect is not None and problem != expect:
        raise InputError("problem", f"this command needs a {expect!r} instance, got {problem!r}",
                         f'pass a file whose "problem" is "{expect}"')
    fields = known[problem]
    extra = sorted(set(obj) - set(fields))
    if extra:
        raise InputError(extra[0], f"unknown field for a {problem} instance",
                         f"use only the fields {', '.join(fields)}")
    missing = [f for f in fields if f not in obj]
    if missing:
        raise InputError(missing[0], "missing", f"add the field {missing[0]!r}")
    if problem == SOURCE_PROBLEM:
        return KSubsetSum(values=obj["values"], k=obj["k"], target=obj["target"])
    return ZeroES(values=obj["values"], s=obj["s"])


def load_instance(path: str | os.PathLike[str], expect: str | None = None) -> KSubsetSum | ZeroES:
    """Read and validate an instance file (see :func:`parse_instance`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(str(path), "file not found", "check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(path), f"cannot be read ({exc})", "pass a readable UTF-8 JSON file") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(str(path), f"is not valid JSON ({exc})", "fix the JSON syntax") from None
    except ValueError as exc:  # Python refuses to parse integers of more than 4300 digits
        raise InputError(str(path), f"holds an integer too long to parse ({exc})",
                         "use integers of at most 4300 digits (CP-SAT needs them within 2^62)") from None
    return parse_instance(obj, expect=expect)


def validate_certificate(instance: KSubsetSum | ZeroES, kept: Sequence[object]) -> tuple[int, ...]:
    """Check the shape of a certificate (distinct in-range indices, right size); return it sorted."""
    size = instance.k if isinstance(instance, KSubsetSum) else instance.s
    return _check_certificate("certificate", kept, instance.n, size)
