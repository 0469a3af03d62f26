"""Exact deciders for both problems: OR-Tools CP-SAT, a (count, sum) DP, and plain enumeration.

All three find a subset of exactly ``count`` indices whose values sum to ``target`` (or prove
there is none) in integer arithmetic only:

* :func:`cpsat_subset` builds a 0/1 model with two integer linear equalities and lets CP-SAT
  (one worker, fixed seed, so runs are deterministic) prove feasibility or infeasibility.
* :func:`dp_subset` is a dynamic programme over reachable ``(count, sum)`` pairs with parent
  pointers, pruned by the exact range of sums the remaining items can still add. It shares no
  code with CP-SAT, which is the point: two independent exact methods must agree.
* :func:`enumerate_subset` tries every combination; the obviously-correct reference for tests.

:func:`decide_source` and :func:`decide_image` apply them to the two problems, with *different
formulations* on the image side (CP-SAT: centred coefficients ``N*v_i - sum(v)`` summing to 0;
DP and enumeration: raw values summing to ``s*sum(v)/N``, which must be an integer), so a slip
in either formulation also shows up as a disagreement. Every certificate a decider returns is
re-verified exactly before it is reported.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Sequence

from evictlab.errors import EvictlabError, InputError
from evictlab.hardness.instances import KSubsetSum, ZeroES, check_cpsat_limits

METHODS: tuple[str, ...] = ("cpsat", "dp", "enumerate")


class UndecidedError(EvictlabError, RuntimeError):
    """CP-SAT stopped (time limit) without proving either answer; no answer is reported."""


class WrongCertificateError(EvictlabError, RuntimeError):
    """A decider returned a certificate that fails the exact check (a solver or formulation bug)."""


class DisagreementError(EvictlabError, RuntimeError):
    """CP-SAT and the exact DP gave different answers on one instance (a bug)."""


#: What ``evictlab hardness decide --method`` (and :func:`decide_checked`) accept.
DECIDE_METHODS: tuple[str, ...] = ("both", "cpsat", "dp")


@dataclass(frozen=True)
class Decision:
    """One exact answer: ``yes`` with a verified certificate (sorted indices), or ``no`` with ``()``."""

    yes: bool
    certificate: tuple[int, ...]
    method: str
    seconds: float

    @property
    def answer(self) -> str:
        return "yes" if self.yes else "no"


# --------------------------------------------------------------------------------------------
# generic subset-with-cardinality finders


def cpsat_subset(
    coeffs: Sequence[int], count: int, target: int, *, time_limit_s: float | None = None, seed: int = 0
) -> tuple[int, ...] | None:
    """Indices of ``count`` items whose ``coeffs`` sum to ``target``, or None; decided by CP-SAT.

    Callers must have checked the int64 limits (:func:`~evictlab.hardness.instances.check_cpsat_limits`).
    Raises :class:`UndecidedError` if ``time_limit_s`` ran out before a proof.
    """
    from ortools.sat.python import cp_model  # heavy import, only when CP-SAT is used

    n = len(coeffs)
    if not 0 <= count <= n:
        return None
    model = cp_model.CpModel()
    b = [model.new_bool_var(f"b{i}") for i in range(n)]
    model.add(sum(b) == count)
    model.add(cp_model.LinearExpr.weighted_sum(b, [int(c) for c in coeffs]) == int(target))
    solver = cp_model.CpSolver()
    # One worker and a fixed seed: the search (and so the certificate found) is reproducible.
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    if time_limit_s is not None:
        solver.parameters.max_time_in_seconds = float(time_limit_s)
    status = solver.solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return tuple(i for i in range(n) if solver.boolean_value(b[i]))
    if status == cp_model.INFEASIBLE:
        return None
    if status == cp_model.MODEL_INVALID:  # only if the int64 limit check was skipped
        raise UndecidedError(f"CP-SAT rejected the model: {model.validate()}")
    raise UndecidedError(f"CP-SAT returned {solver.status_name(status)} within {time_limit_s} s")


def _suffix_bounds(values: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """``lo[i][r]`` / ``hi[i][r]``: least / greatest sum of ``r`` items taken from ``values[i:]``."""
    n = len(values)
    lo: list[list[int]] = []
    hi: list[list[int]] = []
    for i in range(n + 1):
        tail = sorted(values[i:])
        lo_i, hi_i = [0], [0]
        for r in range(1, len(tail) + 1):
            lo_i.append(lo_i[-1] + tail[r - 1])
            hi_i.append(hi_i[-1] + tail[-r])
        lo.append(lo_i)
        hi.append(hi_i)
    return lo, hi


def dp_subset(values: Sequence[int], count: int, target: int) -> tuple[int, ...] | None:
    """Indices of ``count`` items summing to ``target``, or None: exact DP over (count, sum).

    ``layers[c]`` maps each sum reachable with ``c`` items among those seen so far to its parent
    ``(item, previous sum)``. A new state is created only if the items still to come can close
    the remaining gap to ``target`` with exactly the remaining count (their least and greatest
    possible sums bound it exactly), so the DP never explores a state that cannot finish.
    Parents always point to a strictly earlier item, so the reconstructed set has distinct
    indices. Pure Python integers: any magnitude, no overflow, no rounding.
    """
    n = len(values)
    if not 0 <= count <= n:
        return None
    if count == 0:
        return () if target == 0 else None
    lo, hi = _suffix_bounds(values)
    if not lo[0][count] <= target <= hi[0][count]:
        return None
    layers: list[dict[int, tuple[int, int] | None]] = [{} for _ in range(count + 1)]
    layers[0][0] = None
    for i, v in enumerate(values):
        left = n - i - 1  # items after i
        # Descending c: layer c+1 is written after it was read in this pass (0/1, each item once).
        for c in range(min(count - 1, i), -1, -1):
            need = count - c - 1  # items still needed after taking item i
            if need > left:
                break  # smaller c needs even more items
            lo_r, hi_r = lo[i + 1][need], hi[i + 1][need]
            nxt = layers[c + 1]
            for t in layers[c]:
                u = t + v
                gap = target - u
                if lo_r <= gap <= hi_r and u not in nxt:
                    nxt[u] = (i, t)
        if target in layers[count]:
            break
    if target not in layers[count]:
        return None
    chosen: list[int] = []
    c, t = count, target
    while c > 0:
        parent = layers[c][t]
        assert parent is not None
        i, t = parent
        chosen.append(i)
        c -= 1
    return tuple(sorted(chosen))


def enumerate_subset(values: Sequence[int], count: int, target: int) -> tuple[int, ...] | None:
    """Reference: try every ``count``-combination in lexicographic order (tiny inputs only)."""
    if not 0 <= count <= len(values):
        return None
    for combo in itertools.combinations(range(len(values)), count):
        if sum(values[i] for i in combo) == target:
            return combo
    return None


# --------------------------------------------------------------------------------------------
# the two problems


def _finish(instance: KSubsetSum | ZeroES, found: tuple[int, ...] | None, method: str, t0: float) -> Decision:
    seconds = time.perf_counter() - t0
    if found is None:
        return Decision(False, (), method, seconds)
    cert = tuple(sorted(found))
    if not instance.is_certificate(cert):
        raise WrongCertificateError(f"{method} returned {cert}, which fails the exact check on {instance}")
    return Decision(True, cert, method, seconds)


def decide_source(source: KSubsetSum, method: str = "cpsat", *, time_limit_s: float | None = None) -> Decision:
    """Decide k-subset-sum exactly: is there ``S``, ``|S| = k``, ``sum(x_S) == T``?"""
    t0 = time.perf_counter()
    if method == "cpsat":
        check_cpsat_limits(source)
        found = cpsat_subset(source.values, source.k, source.target, time_limit_s=time_limit_s)
    elif method == "dp":
        found = dp_subset(source.values, source.k, source.target)
    elif method == "enumerate":
        found = enumerate_subset(source.values, source.k, source.target)
    else:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    return _finish(source, found, method, t0)


def decide_image(image: ZeroES, method: str = "cpsat", *, time_limit_s: float | None = None) -> Decision:
    """Decide ZERO-ES exactly: is there ``A``, ``|A| = s``, with ``N*sum(v_A) == s*sum(v)``?"""
    t0 = time.perf_counter()
    if method == "cpsat":
        check_cpsat_limits(image)
        found = cpsat_subset(image.centred(), image.s, 0, time_limit_s=time_limit_s)
    elif method in ("dp", "enumerate"):
        num = image.s * sum(image.values)
        if num % image.n != 0:
            found = None  # the kept sum would have to be the non-integer s*sum(v)/N
        else:
            finder = dp_subset if method == "dp" else enumerate_subset
            found = finder(image.values, image.s, num // image.n)
    else:
        raise ValueError(f"unknown method {method!r}; use one of {METHODS}")
    return _finish(image, found, method, t0)


def check_decide_options(method: str, time_limit_s: float | None) -> None:
    """:class:`InputError` for a ``--method`` outside :data:`DECIDE_METHODS` or a
    non-positive ``--time-limit`` (checked before an instance is read)."""
    if method not in DECIDE_METHODS:
        raise InputError("--method", f"unknown method {method!r}", f"use one of {', '.join(DECIDE_METHODS)}")
    check_time_limit(time_limit_s)


def check_time_limit(time_limit_s: float | None) -> None:
    """:class:`InputError` (``--time-limit``) unless None or positive (seconds)."""
    if time_limit_s is not None and not time_limit_s > 0:
        raise InputError("--time-limit", f"must be positive, got {time_limit_s}",
                         "pass a positive number of seconds or omit it")


def decide_checked(image: ZeroES, method: str = "both", *, time_limit_s: float | None = None) -> Decision:
    """Decide ZERO-ES with ``method`` (``both``: CP-SAT and the DP, cross-checked): what
    ``evictlab hardness decide`` answers. CP-SAT's int64 limits are checked before any
    solving (:class:`InputError`); :class:`UndecidedError` when CP-SAT hit the time limit;
    :class:`DisagreementError` when the two methods differ."""
    check_decide_options(method, time_limit_s)
    if method in ("both", "cpsat"):
        check_cpsat_limits(image)  # a clear InputError before any solving
    names = ("cpsat", "dp") if method == "both" else (method,)
    decisions = [decide_image(image, name, time_limit_s=time_limit_s) for name in names]
    if len({d.yes for d in decisions}) > 1:
        raise DisagreementError("CP-SAT and the exact DP disagree: "
                                + ", ".join(f"{d.method}={d.answer}" for d in decisions))
    return decisions[0]
