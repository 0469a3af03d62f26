"""Seeded instance generators: planted yes-instances, exactly verified no-instances, adversarial families.

All randomness comes from ``numpy.random.default_rng(seed)``; every number handed to the
instances is converted to a Python ``int`` so no numpy integer (with its fixed width) reaches
the exact arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evictlab.errors import InputError
from evictlab.hardness.deciders import dp_subset
from evictlab.hardness.instances import CPSAT_LIMIT, KSubsetSum, ZeroES


@dataclass(frozen=True)
class Generated:
    """A generated source instance with its known answer (and the planted set for a yes)."""

    family: str
    source: KSubsetSum
    expected_yes: bool
    planted: tuple[int, ...] | None = None


def max_magnitude(n: int) -> int:
    """Largest ``|x_i|, |T|`` bound for which the image of any n-value source fits CP-SAT's int64.

    Generated targets satisfy ``|T| <= n*M + 1 <= (n+1)M``, so ``M' = max(|x_i|, |T|) <= (n+1)M``.
    Image values satisfy ``|u| <= 2(n+1)^2 M'`` (docs/theory.md); the image's centred coefficients
    ``N*u - sum(u)`` are at most ``2N max|u|`` each, ``N = 2n+1`` of them, so their absolute sum
    is at most ``4 N^2 (n+1)^3 M``, which must stay within 2^62.
    """
    big_n = 2 * n + 1
    return CPSAT_LIMIT // (4 * big_n * big_n * (n + 1) ** 3)


def default_magnitude(n: int) -> int:
    """Default value range ``[-M, M]``: ``M = 2^n`` (at least 8), capped so images fit CP-SAT.

    With ``2^n`` the ``C(n, k)`` subset sums are spread over a range of about ``k * 2^(n+1)``
    integers, so a random target in range is usually a no (and needs a full proof), while a
    planted target is a yes: both answers are exercised at every size.
    """
    return max(1, min(max(8, 2**n), max_magnitude(n)))


def _check_size(n: int, magnitude: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InputError("--size", f"size must be a positive integer, got {n!r}", "pass --size 1 or more")
    limit = max_magnitude(n)
    if limit < 1:
        raise InputError("--size", f"size {n} makes every image overflow CP-SAT's int64 arithmetic",
                         "use a smaller --size (images have 2n+1 values)")
    if isinstance(magnitude, bool) or not isinstance(magnitude, int) or not 1 <= magnitude <= limit:
        raise InputError("--magnitude", f"magnitude {magnitude!r} is outside 1..{limit} for size {n}",
                         f"pass a value range of at most {limit} so the image fits CP-SAT's int64 limit")


def _draw_values(rng: np.random.Generator, n: int, magnitude: int) -> list[int]:
    return [int(v) for v in rng.integers(-magnitude, magnitude + 1, size=n)]


def planted_yes(rng: np.random.Generator, n: int, magnitude: int | None = None) -> Generated:
    """A yes-instance: random values, random ``k`` in 1..n, target = sum of a random k-subset."""
    magnitude = default_magnitude(n) if magnitude is None else magnitude
    _check_size(n, magnitude)
    values = _draw_values(rng, n, magnitude)
    k = int(rng.integers(1, n + 1))
    planted = tuple(sorted(int(i) for i in rng.choice(n, size=k, replace=False)))
    target = sum(values[i] for i in planted)
    return Generated("planted-yes", KSubsetSum(tuple(values), k, target), True, planted)


def verified_no(rng: np.random.Generator, n: int, magnitude: int | None = None, attempts: int = 64) -> Generated:
    """A no-instance whose answer the exact DP has proved.

    The target is drawn inside ``[least k-sum, greatest k-sum]`` (so it is not ruled out by a
    range check) until the DP proves no k-subset reaches it. When every in-range target is
    reachable (tiny n, or k = n), the target becomes ``greatest k-sum + 1``: still a proved no.
    """
    magnitude = default_magnitude(n) if magnitude is None else magnitude
    _check_size(n, magnitude)
    values = _draw_values(rng, n, magnitude)
    k = int(rng.integers(1, n + 1))
    ordered = sorted(values)
    lo, hi = sum(ordered[:k]), sum(ordered[-k:])
    for _ in range(attempts):
        target = int(rng.integers(lo, hi + 1))
        if dp_subset(values, k, target) is None:
            return Generated("verified-no", KSubsetSum(tuple(values), k, target), False)
    return Generated("verified-no-out-of-range", KSubsetSum(tuple(values), k, hi + 1), False)


def balanced(seed: int, trials: int, n: int, magnitude: int | None = None) -> list[Generated]:
    """``trials`` instances of size ``n``, alternating planted yes and verified no (yes first)."""
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise InputError("--trials", f"trials must be a positive integer, got {trials!r}", "pass --trials 1 or more")
    rng = np.random.default_rng(seed)
    return [planted_yes(rng, n, magnitude) if t % 2 == 0 else verified_no(rng, n, magnitude) for t in range(trials)]


def adversarial_sources(rng: np.random.Generator, n: int) -> list[Generated]:
    """Edge-case k-subset-sum instances of size ``n``; answers known by construction.

    Families: k = 0 (T = 0 yes, T != 0 no), k = n (T = sum yes, sum + 1 no), k = 1, all-equal
    values, all zeros, all negative, heavy duplicates, and large magnitudes near the CP-SAT cap.
    """
    out: list[Generated] = []
    vals = _draw_values(rng, n, 9)
    out.append(Generated("k=0,T=0", KSubsetSum(tuple(vals), 0, 0), True, ()))
    out.append(Generated("k=0,T!=0", KSubsetSum(tuple(vals), 0, 1), False))
    out.append(Generated("k=n,T=sum", KSubsetSum(tuple(vals), n, sum(vals)), True, tuple(range(n))))
    out.append(Generated("k=n,T=sum+1", KSubsetSum(tuple(vals), n, sum(vals) + 1), False))
    j = int(rng.integers(0, n))
    out.append(Generated("k=1,hit", KSubsetSum(tuple(vals), 1, vals[j]), True, (j,)))
    miss = max(vals) + 1
    out.append(Generated("k=1,miss", KSubsetSum(tuple(vals), 1, miss), False))
    c = int(rng.integers(-5, 6))
    k = int(rng.integers(1, n + 1))
    out.append(Generated("all-equal,yes", KSubsetSum((c,) * n, k, k * c), True, tuple(range(k))))
    out.append(Generated("all-equal,no", KSubsetSum((c,) * n, k, k * c + 1), False))
    out.append(Generated("zeros,yes", KSubsetSum((0,) * n, k, 0), True, tuple(range(k))))
    out.append(Generated("zeros,no", KSubsetSum((0,) * n, k, -1), False))
    neg = [-abs(v) - 1 for v in vals]
    planted = tuple(range(0, n, 2))[:k] or (0,)
    out.append(Generated("negatives,yes", KSubsetSum(tuple(neg), len(planted), sum(neg[i] for i in planted)),
                         True, planted))
    # Negatives are all <= -1, so the k most negative sum is a floor: one below it is a no.
    kk = len(planted)
    out.append(Generated("negatives,no", KSubsetSum(tuple(neg), kk, sum(sorted(neg)[:kk]) - 1), False))
    dup = [int(v) for v in rng.choice(np.array([-2, 3]), size=n)]
    kd = int(rng.integers(1, n + 1))
    two_or_three = KSubsetSum(tuple(dup), kd, sum(dup[:kd]))
    out.append(Generated("duplicates,yes", two_or_three, True, tuple(range(kd))))
    big = max_magnitude(n)
    big_vals = [int(v) for v in rng.integers(-big, big + 1, size=n)]
    kb = int(rng.integers(1, n + 1))
    out.append(Generated("large,yes", KSubsetSum(tuple(big_vals), kb, sum(big_vals[-kb:])), True,
                         tuple(range(n - kb, n))))
    return out


def adversarial_images(rng: np.random.Generator, n: int) -> list[tuple[str, ZeroES]]:
    """Edge-case ZERO-ES instances with ``N = n`` values (answers left to the deciders).

    Families: s = 1, s = N-1, s = N, all-equal values, all zeros, negatives only, heavy
    duplicates, and equal-cardinality partition (s = N/2 for even N).
    """
    vals = tuple(_draw_values(rng, n, 6))
    out: list[tuple[str, ZeroES]] = [("s=1", ZeroES(vals, 1)), ("s=N", ZeroES(vals, n))]
    if n >= 2:
        out.append(("s=N-1", ZeroES(vals, n - 1)))
    s = int(rng.integers(1, n + 1))
    out.append(("all-equal", ZeroES((int(rng.integers(-9, 10)),) * n, s)))
    out.append(("zeros", ZeroES((0,) * n, s)))
    out.append(("negatives", ZeroES(tuple(-abs(v) - 1 for v in vals), s)))
    out.append(("duplicates", ZeroES(tuple(int(v) for v in rng.choice(np.array([-1, 0, 4]), size=n)), s)))
    if n % 2 == 0:
        out.append(("partition,s=N/2", ZeroES(vals, n // 2)))
    # Append -sum and 0: the total is 0 and the value 0 equals the mean, so s = 1 is a yes.
    out.append(("s=1,mean-present", ZeroES(vals + (-sum(vals), 0), 1)))
    return out
