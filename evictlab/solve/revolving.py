"""Revolving-door order of the t-subsets of {0, ..., m-1}: consecutive subsets differ by one swap.

The enumeration kernels walk every t-subset of a candidate pool and update their running
sums with one element out and one in per step, so each subset costs O(t) instead of O(t d).
The order is Knuth's Algorithm R (TAOCP 7.2.1.3, "revolving-door combinations"), the
Gray code of Nijenhuis and Wilf: it visits all C(m, t) subsets exactly once, each step
replacing exactly one element.

State layout (Numba-friendly, no objects): ``c`` is an int64 array of length ``t + 3``;
``c[1..t]`` hold the current subset (``c[t] > ... > c[1]``), ``c[t+1] = m`` and
``c[t+2] = m + 1`` are sentinels so every comparison of the algorithm stays in bounds.

:func:`revolving_door_reference` is an obviously-correct recursive construction of the same
kind of order, used by the tests to cross-check coverage and the one-swap property.
"""

from __future__ import annotations

from math import comb

import numpy as np
from numba import njit


@njit(cache=True)
def rd_init(m: int, t: int) -> np.ndarray:
    """First subset ``{0, ..., t-1}`` of the order, as the state array (length ``t + 3``)."""
    c = np.empty(t + 3, dtype=np.int64)
    c[0] = -1  # unused
    for j in range(1, t + 1):
        c[j] = j - 1
    c[t + 1] = m
    c[t + 2] = m + 1
    return c


@njit(cache=True)
def rd_next(c: np.ndarray, t: int) -> tuple[int, int]:
    """Advance ``c`` to the next subset in place; return ``(out, in)`` or ``(-1, -1)`` at the end.

    ``out`` is the element that left the subset and ``in`` the one that entered. The
    amortised cost is O(1). Requires ``t >= 1``.
    """
    if t % 2 == 1:
        # R3, t odd: the easy move raises c1 by one.
        if c[1] + 1 < c[2]:
            old = c[1]
            c[1] = old + 1
            return old, old + 1
        j = 2
        if j > t:
            return -1, -1
        state = 4
    else:
        # R3, t even: the easy move lowers c1 by one.
        if c[1] > 0:
            old = c[1]
            c[1] = old - 1
            return old, old - 1
        j = 2
        state = 5
    while j <= t:
        if state == 4:
            # R4: try to decrease c_j (here c_j = c_{j-1} + 1).
            if c[j] >= j:
                out = c[j]
                c[j] = c[j - 1]
                c[j - 1] = j - 2
                return out, j - 2
            j += 1
            state = 5
            if j > t:
                break
        # R5: try to increase c_j (here c_{j-1} = j - 2).
        if c[j] + 1 < c[j + 1]:
            out = c[j - 1]
            c[j - 1] = c[j]
            c[j] = c[j] + 1
            return out, c[j]
        j += 1
        state = 4
    return -1, -1


def revolving_door_sequence(m: int, t: int) -> list[tuple[int, ...]]:
    """All t-subsets of ``range(m)`` in the order :func:`rd_next` visits them (sorted tuples).

    A convenience for tests and small tables; ``t = 0`` gives ``[()]``.
    """
    if t == 0:
        return [()]
    c = rd_init(m, t)
    out = [tuple(int(x) for x in c[1 : t + 1])]
    while True:
        o, _ = rd_next(c, t)
        if o < 0:
            break
        out.append(tuple(int(x) for x in sorted(c[1 : t + 1])))
    return out


def revolving_door_reference(m: int, t: int) -> list[tuple[int, ...]]:
    """Recursive revolving-door list R(m, t) = R(m-1, t), reversed R(m-1, t-1) + {m-1}.

    Plain Python, exponential in size; only for tests on small ``m``.
    """
    if t == 0:
        return [()]
    if t == m:
        return [tuple(range(m))]
    head = revolving_door_reference(m - 1, t)
    tail = [s + (m - 1,) for s in reversed(revolving_door_reference(m - 1, t - 1))]
    return head + tail


def n_subsets(m: int, s: int) -> int:
    """Number of s-subsets of an m-element pool, ``C(m, s)`` (exact Python int)."""
    return comb(m, s)
