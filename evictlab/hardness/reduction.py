"""The polynomial reduction k-subset-sum -> ZERO-ES and the certificate maps both ways.

Construction (proved in ``docs/theory.md``), for a source ``(x_1..x_n, k, T)`` with
``1 <= k <= n``:

* ``y_i = k*x_i - T``, ``R = sum(y) = k*sum(x) - n*T``, ``W = 1 + sum|y_i| + |R|``;
* image values, in this index order: ``n`` originals ``y_i + W`` (indices ``0..n-1``),
  ``n`` dummies ``-W`` (indices ``n..2n-1``) and one balancer ``-R`` (index ``2n``);
* ``s = 2k``.

The image values sum to 0, so a zero-error ``s``-subset is one whose values sum to 0. Because
``W`` exceeds every sum of ``y`` terms and the balancer, such a subset holds as many originals
as dummies, hence (``s`` even) no balancer, hence exactly ``k`` originals whose ``y`` sum to 0,
i.e. ``k*(sum x_S - T) = 0``.

``k = 0`` is handled apart, because ``s = 0`` keeps nothing and the forced output is undefined:
the source is then yes iff ``T == 0`` (the empty set), and it maps to the fixed yes-instance
``([0], s=1)`` or the fixed no-instance ``([0, 1], s=1)``.
"""

from __future__ import annotations

from typing import Iterable

from evictlab.errors import InputError
from evictlab.hardness.instances import KSubsetSum, ZeroES, validate_certificate

# Fixed images for k = 0 (decided in O(1) by looking at T).
_K0_YES = ZeroES(values=(0,), s=1)  # keep the only value: mean 0 == mean 0
_K0_NO = ZeroES(values=(0, 1), s=1)  # mean 1/2, but every single value is 0 or 1


def padding_weight(source: KSubsetSum) -> int:
    """``W = 1 + sum_i |k*x_i - T| + |k*sum(x) - n*T|`` (only meaningful for k >= 1)."""
    y = [source.k * x - source.target for x in source.values]
    return 1 + sum(abs(t) for t in y) + abs(sum(y))


def reduce_instance(source: KSubsetSum) -> ZeroES:
    """Map a k-subset-sum instance to a ZERO-ES instance with the same answer (a Karp reduction).

    Runs in time polynomial in the bit length of ``source``; see :func:`image_bit_bound`.
    """
    if source.k == 0:
        return _K0_YES if source.target == 0 else _K0_NO
    k, t = source.k, source.target
    y = [k * x - t for x in source.values]
    r = sum(y)
    w = 1 + sum(abs(v) for v in y) + abs(r)
    values = [v + w for v in y] + [-w] * source.n + [-r]
    return ZeroES(values=tuple(values), s=2 * k)


def source_to_image_certificate(source: KSubsetSum, chosen: Iterable[int]) -> tuple[int, ...]:
    """Turn a source certificate ``S`` (k indices summing to T) into an image certificate.

    The image certificate is the originals of ``S`` plus the first ``k`` dummies
    (indices ``n..n+k-1``): their values sum to ``sum(y_S) + k*W - k*W = k*(sum x_S - T) = 0``.
    Raises :class:`InputError` if ``chosen`` is not a valid source certificate.
    """
    chosen = validate_certificate(source, list(chosen))
    if not source.is_certificate(chosen):
        raise InputError("certificate", f"the chosen values do not sum to the target {source.target}",
                         "pass k indices whose values sum to the target")
    if source.k == 0:
        return (0,)
    return tuple(chosen) + tuple(range(source.n, source.n + source.k))


def image_to_source_certificate(source: KSubsetSum, kept: Iterable[int]) -> tuple[int, ...]:
    """Turn a zero-error subset of ``reduce_instance(source)`` into a source certificate.

    By the proof, any zero-error ``2k``-subset holds exactly ``k`` originals and they solve the
    source, so the map is "keep the original indices ``< n``". The result is re-verified.
    Raises :class:`InputError` if ``kept`` is not a zero-error subset of the image.
    """
    image = reduce_instance(source)
    kept = validate_certificate(image, list(kept))
    if not image.is_certificate(kept):
        raise InputError("certificate", "the kept values do not have the mean of all values",
                         "pass a zero-error subset of the image instance")
    if source.k == 0:
        return ()
    chosen = tuple(i for i in kept if i < source.n)
    if not source.is_certificate(chosen):  # impossible by the theorem; guard against a wrong proof
        raise AssertionError(f"reduction proof violated: image certificate {kept} maps to {chosen}")
    return chosen


def image_bit_bound(source: KSubsetSum) -> int:
    """Proved upper bound on the bit length of every image value (``docs/theory.md``).

    With ``M = max(|x_i|, |T|)`` and ``L(z) = z.bit_length()``: every image value ``u``
    satisfies ``|u| <= 1 + (2n+1)(k+1)M <= 2(n+1)^2 M`` (M >= 1; and ``|u| <= 1`` if M = 0),
    hence ``L(|u|) <= L(M) + 2*L(n+1) + 1``. The image has ``2n+1`` values and ``s = 2k``, so the
    image is polynomial (quadratic) in the source bit length.
    """
    m = max(max(abs(x) for x in source.values), abs(source.target))
    return m.bit_length() + 2 * (source.n + 1).bit_length() + 1
