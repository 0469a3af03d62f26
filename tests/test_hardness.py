"""ZERO-ES reduction: both directions on thousands of instances, certificates, size bound, validation.

Three exact methods (CP-SAT, the (count, sum) DP, plain enumeration) decide every source and
every image independently; a single disagreement fails the test.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from evictlab.errors import InputError
from evictlab.hardness.check import Summary, run_check
from evictlab.hardness.deciders import decide_image, decide_source, dp_subset, enumerate_subset
from evictlab.hardness.generators import (
    adversarial_images,
    adversarial_sources,
    balanced,
    default_magnitude,
    max_magnitude,
    planted_yes,
    verified_no,
)
from evictlab.hardness.instances import (
    CPSAT_LIMIT,
    KSubsetSum,
    ZeroES,
    check_cpsat_limits,
    parse_instance,
    within_cpsat_limits,
)
from evictlab.hardness.reduction import (
    image_bit_bound,
    image_to_source_certificate,
    padding_weight,
    reduce_instance,
    source_to_image_certificate,
)


def _brute_zero_es(image: ZeroES) -> bool:
    """The definition, verbatim: some s-subset with N*sum(v_A) == s*sum(v)."""
    total = sum(image.values)
    return any(image.n * sum(image.values[i] for i in a) == image.s * total
               for a in itertools.combinations(range(image.n), image.s))


def _assert_round_trips(source: KSubsetSum, image: ZeroES, src_certs, img_certs) -> None:
    for cert in src_certs:
        assert source.is_certificate(cert)
        mapped = source_to_image_certificate(source, cert)
        assert image.is_certificate(mapped)
        # Forward then back returns the same source certificate.
        assert image_to_source_certificate(source, mapped) == tuple(sorted(cert))
    for cert in img_certs:
        assert image.is_certificate(cert)
        assert source.is_certificate(image_to_source_certificate(source, cert))


# --------------------------------------------------------------------------------------------
# thousands of random instances, every method on both sides


def test_random_sources_every_method_agrees_on_both_sides() -> None:
    rng = random.Random(20260401)
    tried = yes = 0
    for n in range(1, 11):
        for _ in range(250):
            values = [rng.randint(-7, 7) for _ in range(n)]
            k = rng.randint(0, n)
            target = rng.randint(-4 * k - 3, 4 * k + 3)
            source = KSubsetSum(tuple(values), k, target)
            image = reduce_instance(source)
            answers = [decide_source(source, m) for m in ("cpsat", "dp", "enumerate")]
            answers += [decide_image(image, m) for m in ("cpsat", "dp")]
            if image.n <= 15:
                answers.append(decide_image(image, "enumerate"))
            assert len({d.yes for d in answers}) == 1, (source, [(d.method, d.yes) for d in answers])
            if answers[0].yes:
                yes += 1
                _assert_round_trips(source, image, [d.certificate for d in answers[:3]],
                                    [d.certificate for d in answers[3:]])
            tried += 1
    assert tried == 2500
    # Both answers well represented, so agreement is not a run of trivial no's.
    assert 500 < yes < 2000


def test_random_images_every_method_agrees() -> None:
    rng = np.random.default_rng(7)
    yes = 0
    for trial in range(1500):
        n = int(rng.integers(1, 13))
        width = int(rng.choice([1, 3, 10, 1000]))
        image = ZeroES(tuple(int(v) for v in rng.integers(-width, width + 1, size=n)), int(rng.integers(1, n + 1)))
        ds = [decide_image(image, m) for m in ("cpsat", "dp", "enumerate")]
        assert len({d.yes for d in ds}) == 1, (image, [(d.method, d.yes) for d in ds])
        assert ds[0].yes == _brute_zero_es(image)
        for d in ds:
            assert (d.certificate == ()) != d.yes and (not d.yes or image.is_certificate(d.certificate))
        yes += ds[0].yes
    assert 300 < yes < 1400


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 11])
def test_balanced_check_has_zero_disagreements(n: int) -> None:
    table = run_check(balanced(seed=n, trials=120, n=n))
    summary = Summary.of(table)
    assert summary.tried == 120 and summary.yes == 60 and summary.no == 60
    assert summary.disagreed == 0, table.filter(~table["agreed"])["error"].to_list()
    # Every yes trial checked planted + 2 source + 2 image certificates.
    assert summary.certificates_checked == 60 * 5
    assert (table["image_max_bits"] <= table["bit_bound"]).all()


@given(st.lists(st.integers(-20, 20), min_size=0, max_size=9), st.integers(0, 9), st.integers(-60, 60))
def test_dp_matches_enumeration(values: list[int], count: int, target: int) -> None:
    found = dp_subset(values, count, target)
    ref = enumerate_subset(values, count, target)
    assert (found is None) == (ref is None)
    if found is not None:
        assert len(set(found)) == count and sum(values[i] for i in found) == target


def test_dp_handles_numbers_beyond_int64() -> None:
    big = 2**100
    values = [big + 3, -big, 7, big * 5, -big * 5 + 1]
    assert dp_subset(values, 2, 3) == (0, 1)
    assert dp_subset(values, 2, 1) == (3, 4)
    assert dp_subset(values, 2, 4) is None
    assert dp_subset(values, 3, 5 * big + 3) == (0, 1, 3)


# --------------------------------------------------------------------------------------------
# adversarial families


@pytest.mark.parametrize("n", range(1, 10))
def test_adversarial_sources_have_their_known_answers(n: int) -> None:
    for gen in adversarial_sources(np.random.default_rng(100 + n), n):
        source = gen.source
        image = reduce_instance(source)
        assert within_cpsat_limits(image), gen.family
        ds = [decide_source(source, "cpsat"), decide_source(source, "dp"),
              decide_image(image, "cpsat"), decide_image(image, "dp")]
        assert all(d.yes == gen.expected_yes for d in ds), (gen.family, source, [d.yes for d in ds])
        if gen.expected_yes:
            assert source.is_certificate(gen.planted)
            _assert_round_trips(source, image, [gen.planted, ds[0].certificate, ds[1].certificate],
                                [ds[2].certificate, ds[3].certificate])


@pytest.mark.parametrize("n", range(1, 11))
def test_adversarial_images_agree_with_the_definition(n: int) -> None:
    for family, image in adversarial_images(np.random.default_rng(200 + n), n):
        ds = [decide_image(image, m) for m in ("cpsat", "dp", "enumerate")]
        truth = _brute_zero_es(image)
        assert all(d.yes == truth for d in ds), (family, image)
        if family in ("s=N", "all-equal", "zeros", "s=1,mean-present"):
            assert truth, family
        if family in ("s=1", "s=N-1"):
            # Keeping one value (or dropping one) has zero error iff that value equals the mean.
            assert truth == any(image.n * v == sum(image.values) for v in image.values)


def test_duplicates_negatives_and_zeros_images() -> None:
    # -W dummies are all equal: the DP must not confuse equal values with equal indices.
    image = ZeroES((-3, 1, -3, -3, 9, -1), 4)  # only {-3, -3, -3, 9} sums to 0
    for m in ("cpsat", "dp", "enumerate"):
        d = decide_image(image, m)
        assert d.yes and d.certificate == (0, 2, 3, 4) and image.is_certificate(d.certificate)
    assert not decide_image(ZeroES((-4, -2, -2, -1), 2), "dp").yes  # mean -9/4: no pair sums to -4.5
    assert not decide_image(ZeroES((-4, -2, -2, -1), 2), "cpsat").yes


def test_equal_cardinality_partition_is_zero_es_at_half() -> None:
    rng = random.Random(3)
    for _ in range(300):
        n = 2 * rng.randint(1, 5)
        values = tuple(rng.randint(-9, 9) for _ in range(n))
        partition = any(2 * sum(values[i] for i in a) == sum(values)
                        for a in itertools.combinations(range(n), n // 2))
        image = ZeroES(values, n // 2)
        assert decide_image(image, "dp").yes == partition == decide_image(image, "cpsat").yes


# --------------------------------------------------------------------------------------------
# the construction itself


def test_worked_example() -> None:
    source = KSubsetSum((3, -1, 4, 1, 5), k=2, target=9)
    image = reduce_instance(source)
    # y = 2x - 9 = (-3, -11, -1, -7, 1); R = -21; W = 1 + 23 + 21 = 45.
    assert image.values == (42, 34, 44, 38, 46, -45, -45, -45, -45, -45, 21)
    assert image.s == 4 and sum(image.values) == 0
    assert source_to_image_certificate(source, (2, 4)) == (2, 4, 5, 6)
    assert image_to_source_certificate(source, (2, 4, 8, 9)) == (2, 4)


def test_k_zero_maps_to_fixed_instances() -> None:
    yes = KSubsetSum((5, 6), 0, 0)
    no = KSubsetSum((5, 6), 0, 3)
    assert decide_image(reduce_instance(yes), "dp").yes and decide_source(yes, "cpsat").yes
    assert not decide_image(reduce_instance(no), "cpsat").yes and not decide_source(no, "dp").yes
    assert source_to_image_certificate(yes, ()) == (0,)
    assert image_to_source_certificate(yes, (0,)) == ()


_big = st.integers(-(2**200), 2**200)


@given(st.lists(_big, min_size=1, max_size=12), st.data())
def test_image_size_is_polynomial(values: list[int], data: st.DataObject) -> None:
    n = len(values)
    k = data.draw(st.integers(1, n))
    target = data.draw(_big)
    source = KSubsetSum(tuple(values), k, target)
    image = reduce_instance(source)
    assert image.n == 2 * n + 1 and image.s == 2 * k
    assert sum(image.values) == 0
    m = max(max(abs(x) for x in values), abs(target))
    # The two proved inequalities, then the bit-length bound they give.
    assert all(abs(u) <= 1 + (2 * n + 1) * (k + 1) * m for u in image.values)
    assert all(abs(u) <= max(1, 2 * (n + 1) ** 2 * m) for u in image.values)
    bound = image_bit_bound(source)
    assert bound == m.bit_length() + 2 * (n + 1).bit_length() + 1
    assert max(abs(u).bit_length() for u in image.values) <= bound
    # Total image size in bits is O(n * (bits of M + log n)): quadratic in the source size.
    source_bits = sum(abs(x).bit_length() + 1 for x in values) + abs(target).bit_length() + n.bit_length()
    image_bits = sum(abs(u).bit_length() + 1 for u in image.values)
    assert image_bits <= (2 * n + 1) * (bound + 1) <= 3 * (source_bits + 10) ** 2


def test_certificate_maps_reject_non_certificates() -> None:
    source = KSubsetSum((3, -1, 4, 1, 5), k=2, target=9)
    for bad in [(0, 1), (2,), (2, 2), (2, 9), (2, 4, 0)]:
        with pytest.raises(InputError):
            source_to_image_certificate(source, bad)
    for bad in [(0, 1, 5, 6), (2, 4, 5), (2, 4, 5, 5), (2, 4, 5, 11), (2, 4, 5, 10)]:
        with pytest.raises(InputError):
            image_to_source_certificate(source, bad)
    with pytest.raises(InputError, match="integer"):
        source_to_image_certificate(source, (2.0, 4))


def test_every_zero_error_image_subset_maps_back() -> None:
    """All zero-error subsets of small images, not only the ones the solvers return."""
    rng = random.Random(11)
    seen = 0
    for _ in range(120):
        n = rng.randint(1, 5)
        source = KSubsetSum(tuple(rng.randint(-4, 4) for _ in range(n)), rng.randint(1, n), rng.randint(-6, 6))
        image = reduce_instance(source)
        for a in itertools.combinations(range(image.n), image.s):
            if image.is_certificate(a):
                seen += 1
                back = image_to_source_certificate(source, a)
                assert source.is_certificate(back)
                assert 2 * source.n not in a  # the balancer is never kept (parity argument)
    assert seen > 50


# --------------------------------------------------------------------------------------------
# generators, determinism, validation


def test_generators_are_seeded_and_correct() -> None:
    a = balanced(seed=5, trials=30, n=6)
    b = balanced(seed=5, trials=30, n=6)
    assert a == b and a != balanced(seed=6, trials=30, n=6)
    rng = np.random.default_rng(0)
    for n in (1, 2, 4, 7):
        yes = planted_yes(rng, n)
        assert yes.source.is_certificate(yes.planted)
        no = verified_no(rng, n)
        assert enumerate_subset(no.source.values, no.source.k, no.source.target) is None
    assert default_magnitude(3) == 8 and default_magnitude(10) == 1024
    for n in (1, 5, 20, 40):
        assert max_magnitude(n) >= default_magnitude(n) >= 1


def test_cpsat_certificate_is_deterministic() -> None:
    image = reduce_instance(KSubsetSum(tuple(range(-6, 7)), 4, 2))
    assert len({decide_image(image, "cpsat").certificate for _ in range(3)}) == 1


def test_generators_reject_bad_sizes() -> None:
    with pytest.raises(InputError, match="--trials"):
        balanced(seed=0, trials=0, n=3)
    with pytest.raises(InputError, match="--size"):
        balanced(seed=0, trials=2, n=0)
    with pytest.raises(InputError, match="--magnitude"):
        balanced(seed=0, trials=2, n=3, magnitude=max_magnitude(3) + 1)
    with pytest.raises(InputError, match="--size"):
        balanced(seed=0, trials=2, n=10**6)


@pytest.mark.parametrize(
    "obj, field",
    [
        ({"problem": "zero-es", "values": [1, 2.0], "s": 1}, "values[1]"),
        ({"problem": "zero-es", "values": [1, True], "s": 1}, "values[1]"),
        ({"problem": "zero-es", "values": [1, "2"], "s": 1}, "values[1]"),
        ({"problem": "zero-es", "values": [], "s": 1}, "values"),
        ({"problem": "zero-es", "values": "12", "s": 1}, "values"),
        ({"problem": "zero-es", "values": [1, 2], "s": 0}, "s"),
        ({"problem": "zero-es", "values": [1, 2], "s": 3}, "s"),
        ({"problem": "zero-es", "values": [1, 2], "s": 1.0}, "s"),
        ({"problem": "zero-es", "values": [1, 2]}, "s"),
        ({"problem": "zero-es", "values": [1, 2], "s": 1, "k": 1}, "k"),
        ({"problem": "k-subset-sum", "values": [1, 2], "k": 3, "target": 1}, "k"),
        ({"problem": "k-subset-sum", "values": [1, 2], "k": -1, "target": 1}, "k"),
        ({"problem": "k-subset-sum", "values": [1, 2], "k": 1, "target": 0.5}, "target"),
        ({"problem": "k-subset-sum", "values": [1, 2], "k": False, "target": 1}, "k"),
        ({"problem": "subset-sum", "values": [1], "k": 1, "target": 1}, "problem"),
        ({"values": [1], "s": 1}, "problem"),
        ([1, 2, 3], "instance"),
    ],
)
def test_malformed_instances_name_the_field(obj: object, field: str) -> None:
    with pytest.raises(InputError) as info:
        parse_instance(obj)
    assert info.value.field == field and info.value.fix


def test_numpy_integers_become_python_ints() -> None:
    source = KSubsetSum(np.array([2**40, -3, 5], dtype=np.int64), np.int64(2), np.int64(2))
    assert all(type(v) is int for v in (*source.values, source.k, source.target))
    # Products of int64 values would wrap around; Python ints do not.
    assert reduce_instance(source).values[0] == 2 * 2**40 - 2 + padding_weight(source)
    assert source.is_certificate(np.array([1, 2]))
    with pytest.raises(InputError, match=r"values\[0\]"):
        ZeroES(np.array([0.5, 1.0]), 1)
    with pytest.raises(InputError, match="values"):
        ZeroES(np.zeros((2, 2), dtype=np.int64), 1)


def test_wrong_problem_for_the_command() -> None:
    with pytest.raises(InputError, match="needs a 'zero-es'"):
        parse_instance({"problem": "k-subset-sum", "values": [1], "k": 1, "target": 1}, expect="zero-es")


def test_cpsat_limit_is_enforced_with_the_bound_in_the_message() -> None:
    image = ZeroES((2**61, -(2**61), 5), 1)
    with pytest.raises(InputError, match=r"2\^62"):
        check_cpsat_limits(image)
    with pytest.raises(InputError, match=r"2\^62"):
        decide_image(image, "cpsat")
    assert not decide_image(image, "dp").yes  # the DP has no such limit
    source = KSubsetSum((2**62, 1), 1, 1)
    with pytest.raises(InputError, match="values"):
        decide_source(source, "cpsat")
    with pytest.raises(InputError, match="target"):
        decide_source(KSubsetSum((1, 2), 1, CPSAT_LIMIT + 1), "cpsat")
    assert decide_source(source, "dp").certificate == (1,)
    # Right at the limit CP-SAT accepts and answers.
    edge = ZeroES((CPSAT_LIMIT // 4, -(CPSAT_LIMIT // 4)), 1)
    assert within_cpsat_limits(edge)
    assert decide_image(edge, "cpsat").yes == decide_image(edge, "dp").yes
