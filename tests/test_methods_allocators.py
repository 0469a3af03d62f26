"""Allocators (sums, floors, caps, monotonicity, errors), their inputs, factory and checker,
and select_keep invariants."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from evictlab.errors import InputError
from evictlab.methods import ALLOCATORS, AllocationError, AllocInputs, check_sizes, make_allocator, select_keep
from evictlab.methods.allocators import pyramid_weights
from evictlab.methods.testing import allocator_for_tests, with_needs


def allocate(name: str, scores, budget: int, *, floor: int, lengths=None, **params) -> np.ndarray:
    """One allocator call on hand-made inputs (the allocator's raw output, unchecked), with
    what the allocator needs from the decode loop (ContourKV online: a window profile)."""
    alloc = allocator_for_tests(name, **params)
    return alloc.allocate(with_needs(alloc, AllocInputs.build(scores, budget, floor=floor, lengths=lengths)))


def uniform(scores, budget, n_layers, kv_heads, *, floor, lengths=None):  # noqa: ANN001, ANN201
    return allocate("uniform", scores, budget, floor=floor, lengths=lengths)


def pyramidkv(scores, budget, n_layers, kv_heads, *, floor, beta=20.0, lengths=None):  # noqa: ANN001, ANN201
    return allocate("pyramidkv", scores, budget, floor=floor, lengths=lengths, beta=beta)


def adakv(scores, budget, n_layers, kv_heads, *, floor, alpha=0.2, lengths=None):  # noqa: ANN001, ANN201
    return allocate("adakv", scores, budget, floor=floor, lengths=lengths, alpha=alpha)


def random_scores(n_layers: int, kv_heads: int, lengths: list[int], seed: int, batch: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(batch, kv_heads, lengths[i % len(lengths)], generator=g) for i in range(n_layers)]


@st.composite
def problems(draw: st.DrawFn) -> tuple[list[torch.Tensor], int, int, int, int]:
    n_layers = draw(st.integers(1, 5))
    kv_heads = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 30), min_size=n_layers, max_size=n_layers))
    floor = draw(st.integers(0, 6))
    scores = random_scores(n_layers, kv_heads, lengths, draw(st.integers(0, 10_000)))
    lo = sum(min(floor, n) for n in lengths) * kv_heads
    hi = sum(lengths) * kv_heads
    budget = draw(st.integers(lo, hi))
    return scores, budget, n_layers, kv_heads, floor


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
@given(problem=problems())
def test_sizes_sum_floor_cap(name: str, problem) -> None:
    scores, budget, n_layers, kv_heads, floor = problem
    sizes = allocate(name, scores, budget, floor=floor)
    lengths = np.array([[s.shape[-1]] * kv_heads for s in scores])
    assert sizes.dtype == np.int64 and sizes.shape == (n_layers, kv_heads)
    assert sizes.sum() == budget
    assert (sizes >= np.minimum(floor, lengths)).all()
    assert (sizes <= lengths).all()


@pytest.mark.parametrize("name", ["uniform", "pyramidkv"])
@given(problem=problems())
def test_budget_monotone(name: str, problem) -> None:
    """One more token in the budget never takes a token from any cell."""
    scores, budget, n_layers, kv_heads, floor = problem
    if budget >= sum(s.shape[-1] for s in scores) * kv_heads:
        return
    a = allocate(name, scores, budget, floor=floor)
    b = allocate(name, scores, budget + 1, floor=floor)
    assert (b >= a).all() and b.sum() == a.sum() + 1


@given(problem=problems())
def test_adakv_layer_totals_monotone(problem) -> None:
    """AdaKV's per-head sizes may move, but a layer's total never shrinks as budget grows."""
    scores, budget, n_layers, kv_heads, floor = problem
    if budget >= sum(s.shape[-1] for s in scores) * kv_heads:
        return
    a = adakv(scores, budget, n_layers, kv_heads, floor=floor).sum(1)
    b = adakv(scores, budget + 1, n_layers, kv_heads, floor=floor).sum(1)
    assert (b >= a).all()


def test_uniform_equal_split_and_remainder_order() -> None:
    scores = random_scores(3, 2, [50], 0)
    sizes = uniform(scores, 6 * 10 + 4, 3, 2, floor=2)
    assert sizes.tolist() == [[11, 11], [11, 11], [10, 10]]


def test_uniform_short_cell_passes_surplus_on() -> None:
    scores = [torch.rand(1, 2, 3), torch.rand(1, 2, 40)]
    sizes = uniform(scores, 40, 2, 2, floor=1)
    assert sizes.tolist() == [[3, 3], [17, 17]]


def test_pyramid_schedule_formula() -> None:
    w = pyramid_weights(5, beta=4.0)
    np.testing.assert_allclose(w, [1.75, 1.375, 1.0, 0.625, 0.25])
    assert w.mean() == pytest.approx(1.0)
    assert pyramid_weights(1, 20.0).tolist() == [1.0]
    # floor 2 per cell; extra 5 * 2 * 8 = 80 shared 16 per layer on average, ~ w_l * 16.
    sizes = pyramidkv(random_scores(5, 2, [200], 0), 5 * 2 * 10, 5, 2, floor=2, beta=4.0)
    assert sizes.sum() == 100
    assert (np.diff(sizes.sum(1)) <= 0).all()  # decreasing with depth
    np.testing.assert_allclose(sizes.sum(1) - 4, w * 16, atol=1.0)
    assert (pyramidkv(random_scores(4, 2, [50], 0), 80, 4, 2, floor=2, beta=1.0) == 10).all()


def test_pyramid_rejects_beta_below_one() -> None:
    with pytest.raises(InputError, match="beta"):
        pyramidkv(random_scores(2, 1, [10], 0), 10, 2, 1, floor=1, beta=0.5)


def ref_adakv(scores: np.ndarray, b_l: int, floor: int, alpha: float, lengths: list[int] | None = None) -> np.ndarray:
    """AdaKV for one layer (hk, s), by a loop: reserve safeguards, then a global top-k."""
    hk, s = scores.shape
    lengths = lengths or [s] * hk
    safe = [min(n, max(min(floor, n), int(alpha * b_l / hk))) for n in lengths]
    cand = []
    for h in range(hk):
        order = sorted(range(lengths[h]), key=lambda k: (-scores[h, k], -k))
        cand += [(-scores[h, k], -k, h) for k in order[safe[h]:]]
    cand.sort()
    sizes = np.array(safe)
    for _, _, h in cand[: b_l - sum(safe)]:
        sizes[h] += 1
    return sizes


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_adakv_matches_loop_reference(alpha: float) -> None:
    g = torch.Generator().manual_seed(3)
    # Head 0 concentrated (a few large scores), head 2 flat: AdaKV gives head 0 less.
    layer = torch.rand(4, 64, generator=g) ** torch.tensor([[8.0], [2.0], [0.2], [1.0]])
    scores = [layer, layer.flip(0)]
    sizes = adakv(scores, 2 * 40, 2, 4, floor=3, alpha=alpha)
    for l in range(2):
        np.testing.assert_array_equal(sizes[l], ref_adakv(scores[l].double().numpy(), 40, 3, alpha))
    assert sizes.sum() == 80


def test_lengths_exclude_padding() -> None:
    """Ragged heads padded to one length: sizes respect the real lengths."""
    g = torch.Generator().manual_seed(2)
    scores = [torch.rand(3, 30, generator=g) for _ in range(2)]
    lengths = np.array([[30, 12, 5], [20, 30, 8]])
    for l in range(2):
        scores[l][torch.arange(30)[None, :] >= torch.as_tensor(lengths[l])[:, None]] = torch.finfo(torch.float32).min
    for name in ALLOCATORS:
        sizes = allocate(name, scores, 60, floor=6, lengths=lengths)
        assert sizes.sum() == 60 and (sizes <= lengths).all() and (sizes >= np.minimum(6, lengths)).all()
    assert uniform(scores, 60, 2, 3, floor=6, lengths=lengths).tolist() == [[12, 12, 5], [12, 11, 8]]
    sizes = adakv(scores, 60, 2, 3, floor=2, alpha=0.3, lengths=lengths)
    for l in range(2):
        np.testing.assert_array_equal(sizes[l], ref_adakv(scores[l].double().numpy(), 30, 2, 0.3, lengths[l].tolist()))
    with pytest.raises(InputError, match="lengths"):
        uniform(scores, 60, 2, 3, floor=6, lengths=lengths + 5)


def test_adakv_batch_mean_and_array_input() -> None:
    scores = random_scores(2, 3, [20], 1, batch=2)
    a = adakv(scores, 30, 2, 3, floor=1)
    b = adakv(np.stack([s.mean(0).numpy() for s in scores]), 30, 2, 3, floor=1)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
def test_budget_errors_name_the_field(name: str) -> None:
    scores = random_scores(2, 2, [10], 0)
    with pytest.raises(InputError, match="budget.*below the total floor"):
        allocate(name, scores, 4 * 3 - 1, floor=3)
    # The rule: a budget above everything held keeps everything (sizes = lengths).
    alloc = allocator_for_tests(name)
    inputs = with_needs(alloc, AllocInputs.build(scores, 41, floor=3))
    assert inputs.target == 40
    sizes = check_sizes(inputs, alloc.allocate(inputs))
    assert (sizes == 10).all()
    with pytest.raises(InputError, match="scores"):
        allocate(name, scores, 20, floor=3, lengths=np.full((3, 2), 10))
    with pytest.raises(InputError, match="scores"):
        allocate(name, scores, 20, floor=3, lengths=np.full((2, 4), 10))


def test_allocators_deterministic() -> None:
    scores = random_scores(4, 2, [33], 9)
    for name in ALLOCATORS:
        np.testing.assert_array_equal(allocate(name, scores, 101, floor=4), allocate(name, scores, 101, floor=4))


# ---------------------------------------------------------------- select_keep


def ref_select(scores: np.ndarray, size: int, pos: np.ndarray, sinks: int, recent: int) -> list[int]:
    s = len(scores)
    by_pos = sorted(range(s), key=lambda i: (pos[i], i))
    forced = set(by_pos[:sinks]) | (set(by_pos[s - recent:]) if recent else set())
    rest = sorted((i for i in range(s) if i not in forced), key=lambda i: (-scores[i], -pos[i], -i))
    return sorted(list(forced) + rest[: max(0, min(size, s) - len(forced))])


@given(
    s=st.integers(1, 40),
    sinks=st.integers(0, 4),
    recent=st.integers(0, 6),
    seed=st.integers(0, 1000),
    ties=st.booleans(),
    extra=st.integers(0, 50),
    ascending=st.booleans(),
)
def test_select_keep_matches_reference(s: int, sinks: int, recent: int, seed: int, ties: bool, extra: int,
                                       ascending: bool) -> None:
    """Both paths: positions ascending with the index (every store; the fast path) and in
    any order (the general path)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, 3, s, generator=g)
    if ties:  # few distinct values: exercises the recency tie-break
        scores = (scores * 3).floor()
    pos = torch.randperm(100, generator=g)[:s]
    if ascending:
        pos = pos.sort().values
    forced = min(s, sinks + recent)
    sizes = [forced + (extra + h) % (s + 3 - forced) for h in range(3)]
    keep = select_keep(scores, sizes, pos, sinks=sinks, recent=recent)
    for b in range(2):
        for h in range(3):
            got = keep[b][h]
            assert got.dtype == torch.int64
            assert got.tolist() == ref_select(scores[b, h].numpy(), sizes[h], pos.numpy(), sinks, recent)
            assert len(got) == min(sizes[h], s)


def test_select_keep_sinks_and_recent_always_kept() -> None:
    scores = torch.zeros(1, 1, 10)
    scores[0, 0, 4] = 5.0
    scores[0, 0, 0] = -float("inf")
    scores[0, 0, 9] = -1e9
    keep = select_keep(scores, [4], torch.arange(10), sinks=1, recent=2)
    # sink 0 and recent 8, 9 forced; then the top score 4.
    assert keep[0][0].tolist() == [0, 4, 8, 9]
    # All-equal scores: the most recent non-forced keys win.
    keep = select_keep(torch.zeros(1, 1, 10), [5], torch.arange(10), sinks=1, recent=2)
    assert keep[0][0].tolist() == [0, 6, 7, 8, 9]


def test_select_keep_inf_scores_do_not_displace_forced() -> None:
    scores = torch.full((1, 1, 8), float("inf"))
    keep = select_keep(scores, [3], torch.arange(8), sinks=2, recent=1)
    assert keep[0][0].tolist() == [0, 1, 7]


def test_select_keep_errors() -> None:
    with pytest.raises(InputError, match="sizes"):
        select_keep(torch.rand(1, 2, 10), [2, 5], torch.arange(10), sinks=2, recent=1)
    with pytest.raises(InputError, match="sizes"):
        select_keep(torch.rand(1, 2, 10), [5], torch.arange(10), sinks=0, recent=0)
    with pytest.raises(InputError, match="NaN"):
        select_keep(torch.full((1, 1, 3), float("nan")), [1], torch.arange(3), sinks=0, recent=0)
    with pytest.raises(InputError, match="positions"):
        select_keep(torch.rand(1, 1, 3), [1], torch.arange(4), sinks=0, recent=0)


# ---------------------------------------------------------------- contract: inputs, factory, checker


def test_alloc_inputs_floors_clip_to_length_and_window() -> None:
    scores = [torch.rand(1, 2, 30), torch.rand(1, 2, 30)]
    lengths = np.array([[30, 3], [7, 30]])
    inputs = AllocInputs.build(scores, 40, floor=12, lengths=lengths, windows=[None, 9])
    assert inputs.floors.tolist() == [[12, 3], [7, 8]]  # min(floor, length, window - 1)
    assert inputs.held == 70 and inputs.target == 40
    assert AllocInputs.build(scores, 500, floor=0).target == 120  # everything held
    assert AllocInputs.build(scores, 10, floor=0, head_dim=64, dtype_bytes=2).bytes_per_entry == 256
    with pytest.raises(InputError, match="head_dim"):
        _ = inputs.bytes_per_entry
    with pytest.raises(InputError, match="floors"):
        AllocInputs(tuple(scores), lengths, lengths + 1, (None, None), 40)
    with pytest.raises(InputError, match="phase"):
        AllocInputs.build(scores, 40, phase="later")
    with pytest.raises(InputError, match="positions"):
        AllocInputs.build(scores, 40, positions=(torch.zeros(1, 2, 5), torch.zeros(1, 2, 5)))


def test_check_sizes_enforces_the_rule() -> None:
    inputs = AllocInputs.build([torch.rand(1, 2, 10)], 12, floor=2)
    ok = np.array([[6, 6]])
    assert check_sizes(inputs, ok).tolist() == [[6, 6]]
    for bad in (np.array([[6, 5]]), np.array([[11, 1]]), np.array([[1, 11]]), np.array([6, 6]), ok.astype(float)):
        with pytest.raises(AllocationError):
            check_sizes(inputs, bad, "test")


def test_make_allocator_types_and_validates_parameters() -> None:
    assert make_allocator("adakv", alpha="0.35").alpha == 0.35  # strings from the CLI are typed
    assert make_allocator("pyramidkv", beta="4").beta == 4.0
    with pytest.raises(InputError, match="unknown allocator 'nope'.*adakv, contourkv, contourkv_error, contourkv_mass, contourkv_offline, contourkv_pred, contourkv_query, contourkv_relerror, global, pyramidkv, uniform"):
        make_allocator("nope")
    with pytest.raises(InputError, match=r"allocator_param: allocator adakv has no parameter bet.*alpha"):
        make_allocator("adakv", bet="1")
    with pytest.raises(InputError, match=r"allocator_param: adakv parameter alpha='x' is not float"):
        make_allocator("adakv", alpha="x")
    with pytest.raises(InputError, match=r"allocator_param: adakv parameter alpha='1.5': 1.5 is outside"):
        make_allocator("adakv", alpha="1.5")
    with pytest.raises(InputError, match="takes no parameters"):
        make_allocator("uniform", alpha="0.1")
    with pytest.raises(InputError, match="beta"):  # direct construction validates too
        ALLOCATORS["pyramidkv"](beta=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_allocator("adakv").alpha = 0.5  # type: ignore[misc]


def test_params_parsing_and_coercion() -> None:
    from evictlab.methods import make_scorer, parse_assignments
    from evictlab.methods.params import build

    assert parse_assignments(["a=1", " b = x=y "], "--p") == {"a": "1", "b": "x=y"}
    for bad in (["a"], ["=1"], ["a=1", "a=2"]):
        with pytest.raises(InputError, match="--p"):
            parse_assignments(bad, "--p")
    s = make_scorer("compactor", sketch_dim="none", blend="0.5", seed="3")
    assert (s.sketch_dim, s.blend, s.seed) == (None, 0.5, 3)
    assert make_scorer("compactor", sketch_dim="8").sketch_dim == 8
    assert make_scorer("snapkv", pooling="max").pooling == "max"
    assert make_scorer("expected_attention", use_vnorm="False").use_vnorm is False
    with pytest.raises(InputError, match="scorer_param: snapkv parameter pooling='mean' is not one of avg, max"):
        make_scorer("snapkv", pooling="mean")
    with pytest.raises(InputError, match="window='1.5' is not int"):
        make_scorer("snapkv", window="1.5")
    with pytest.raises(InputError, match="scorer_param: snapkv parameter kernel='4'"):
        make_scorer("snapkv", kernel="4")  # the dataclass's own check, with the option's field

    @dataclasses.dataclass(frozen=True)
    class Toy:
        path: Path | None = None
        flag: bool = False
        mode: Literal["a", "b"] = "a"
        name: str = "toy"

    t = build(Toy, {"path": "~/x", "flag": "yes", "mode": "b"}, kind="allocator", name="toy")
    assert t.path == Path("~/x").expanduser() and t.flag is True and t.mode == "b"
    with pytest.raises(InputError, match="has no parameter name"):  # name/needs are not parameters
        build(Toy, {"name": "other"}, kind="allocator", name="toy")
    with pytest.raises(InputError, match="flag=2 is not bool"):
        build(Toy, {"flag": 2}, kind="allocator", name="toy")


def test_route_params_to_the_methods_that_have_them() -> None:
    from evictlab.methods.registry import route_params

    out = route_params({"alpha": "0.3"}, ["adakv", "uniform", "pyramidkv"], "allocator")
    assert out == {"adakv": {"alpha": "0.3"}, "uniform": {}, "pyramidkv": {}}
    out = route_params({"pyramidkv.beta": "4", "alpha": "0.1"}, ["adakv", "pyramidkv"], "allocator")
    assert out == {"adakv": {"alpha": "0.1"}, "pyramidkv": {"beta": "4"}}
    with pytest.raises(InputError, match="no allocator among adakv, uniform has a parameter 'beta'"):
        route_params({"beta": "4"}, ["adakv", "uniform"], "allocator")
    with pytest.raises(InputError, match="'h2o' is not a scorer of the chosen methods"):
        route_params({"h2o.window": "4"}, ["snapkv"], "scorer")
    # One method: its own parameters decide (the factory's error lists them).
    assert route_params({"windw": "3"}, ["snapkv"], "scorer") == {"snapkv": {"windw": "3"}}
