"""ContourKV's variants (issue 24) against brute force.

* the scorer-ranked curves (:func:`evictlab.contour.profile.ranked_curves`) against the exact
  per-set quantities of ``evictlab.core.reference`` on the sets ``select_keep`` keeps;
* every variant's allocation against exhaustive enumeration of the integer splits
  ``floors <= b <= caps``, ``sum b = target``: its stated objective is the minimum (level:
  ``max_c D_c``; mass: ``sum_c D_c``; error: ``sum_c e_c``), the total is exact and the
  per-cell bounds hold (floors; lengths; ``window - 1`` on sliding layers);
* the exact split (:func:`evictlab.contour.level.min_sum_increments`, pruned by convex-hull
  bounds) against enumeration on arbitrary cost curves, and count for count against the
  unpruned programme :func:`evictlab.contour.level.min_sum_reference` (ties included).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from evictlab.contour.level import min_sum_increments, min_sum_reference
from evictlab.contour.profile import GRID, forced_error_reference, ranked_curves, ranked_window_stats
from evictlab.core import reference as ref
from evictlab.errors import InputError
from evictlab.kv.attention import attention_probs
from evictlab.methods import AllocInputs, check_sizes, make_allocator
from evictlab.methods.base import keep_order, select_keep_ordered
from evictlab.methods.testing import example_predictor, example_profile, example_ranked_window, with_needs

# ---------------------------------------------------------------- the curves


@given(s=st.integers(1, 12), sinks=st.integers(0, 3), recent=st.integers(0, 4), seed=st.integers(0, 999),
       ties=st.booleans())
def test_keep_order_prefixes_are_what_select_keep_keeps(s: int, sinks: int, recent: int, seed: int, ties: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    sc = torch.randint(0, 3, (s,), generator=g).float() if ties else torch.randn(s, generator=g)
    order = keep_order(sc, sinks=sinks, recent=recent)
    assert sorted(order.tolist()) == list(range(s))
    for b in range(min(s, sinks + recent), s + 1):
        kept = select_keep_ordered(sc[None, None], [b], sinks=sinks, recent=recent)[0][0]
        assert sorted(order[:b].tolist()) == kept.tolist()


@given(n=st.integers(1, 10), rows=st.integers(1, 4), d=st.integers(1, 3), seed=st.integers(0, 999))
def test_ranked_curves_are_the_kept_sets_dropped_mass_and_forced_error(n: int, rows: int, d: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, n, generator=g, dtype=torch.float64) * 3, -1)
    p[0, : n // 2] = 0.0  # a row with zeros (a prefix of its kept set may hold no mass)
    p[0] = p[0] / p[0].sum() if p[0].sum() > 0 else torch.full((n,), 1.0 / n, dtype=torch.float64)
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    order = torch.randperm(n, generator=g)
    dropped, error = ranked_curves(p, v, order)
    assert dropped[0] == pytest.approx(1.0) and error[0] == pytest.approx(np.linalg.norm(p.numpy() @ v.numpy(), axis=1).mean())
    for b in range(1, n + 1):
        kept = np.sort(order[:b].numpy())
        want_d = np.mean([ref.dropped_mass(p[r].numpy(), kept) for r in range(rows)])
        assert dropped[b] == pytest.approx(want_d, abs=1e-12)
        errs = []
        for r in range(rows):
            row = p[r].numpy()
            if row[kept].sum() > 0:
                errs.append(ref.forced_error(row, v.numpy(), kept))
            else:  # nothing kept that the row attends: the output is 0
                errs.append(float(np.linalg.norm(row @ v.numpy())))
        assert error[b] == pytest.approx(np.mean(errs), abs=1e-12)
        if b and all(p[r, kept].sum() > 0 for r in range(rows)):  # the identity e(A) = D(A) ||m_Ac - m_A||
            rhs = np.mean([ref.identity_rhs(p[r].numpy(), v.numpy(), kept) for r in range(rows)])
            assert error[b] == pytest.approx(rhs, abs=1e-10)


@given(n=st.integers(0, 40), rows=st.integers(1, 6), d=st.integers(1, 8), zero_rows=st.booleans(),
       seed=st.integers(0, 10_000))
def test_the_forced_error_kernel_is_its_reference(n: int, rows: int, d: int, zero_rows: bool, seed: int) -> None:
    """The Numba kernel behind ranked_curves' error curve against the plain-torch block of
    prefix sums beside it (rows with leading zeros and all-zero rows included)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, n, generator=g, dtype=torch.float64) * 4, -1) if n else torch.zeros(rows, 0,
                                                                                                           dtype=torch.float64)
    if zero_rows and n:
        p[0] = 0.0
        p[-1, : n // 2] = 0.0
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    order = torch.randperm(n, generator=g)
    _, error = ranked_curves(p, v, order)
    np.testing.assert_allclose(error, forced_error_reference(p, v, order), rtol=1e-10, atol=1e-12)


def test_ranked_window_stats_are_causal() -> None:
    """A query sees only the held keys at or before it: the curves of the causal rows."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 4, generator=g), torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g))
    qpos, kpos = torch.tensor([3, 4, 5]), torch.arange(6)
    order = torch.tensor([0, 5, 2, 1, 4, 3])
    d, e = ranked_window_stats(q, k, v, 0.5, qpos, kpos, order)
    probs = attention_probs(q[None], k[None, None], 0.5, qpos, kpos).reshape(6, 6).double()
    for r in range(6):  # row r: query head r // 3 at position qpos[r % 3] sees keys 0..qpos
        assert (probs[r, int(qpos[r % 3]) + 1:] == 0).all() and (probs[r, :int(qpos[r % 3]) + 1] > 0).all()
    want_d, want_e = ranked_curves(probs / probs.sum(-1, keepdim=True), v.double(), order)
    np.testing.assert_allclose(d, want_d, atol=1e-12)
    np.testing.assert_allclose(e, want_e, atol=1e-12)


# ---------------------------------------------------------------- the exact split


@given(m=st.integers(1, 4), seed=st.integers(0, 10_000), data=st.data())
def test_min_sum_split_is_the_enumerated_minimum(m: int, seed: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    room = rng.integers(0, 6, size=m)
    F = rng.choice([0.0, 0.5, 1.0], size=(m, 7)) if seed % 3 == 0 else rng.random((m, 7))
    extra = data.draw(st.integers(0, int(room.sum())))
    got = min_sum_increments(F, room, extra)
    assert got.sum() == extra and (got >= 0).all() and (got <= room).all()
    best = min(sum(F[c, k[c]] for c in range(m))
               for k in itertools.product(*[range(r + 1) for r in room]) if sum(k) == extra)
    assert sum(F[c, got[c]] for c in range(m)) == pytest.approx(best, abs=1e-12)
    np.testing.assert_array_equal(got, min_sum_reference(F, room, extra))


@st.composite
def cost_curves(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    """Up to 12 cells with room up to 40: noisy falling curves (like the dropped mass and the
    forced error along a scorer's order), plateaus of exact ties, convex and concave ones."""
    m = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    room = rng.integers(0, 41, size=m)
    K = int(room.max()) + 1
    kind = draw(st.sampled_from(["falling", "ties", "convex", "concave", "noise"]))
    k = np.arange(K)[None, :]
    if kind == "falling":
        F = np.exp(-k / rng.uniform(1, 20, (m, 1))) + 0.05 * rng.random((m, K))
    elif kind == "ties":
        F = rng.integers(0, 3, (m, K)).astype(np.float64)
    elif kind == "convex":
        F = (k - rng.uniform(0, K, (m, 1))) ** 2 * rng.uniform(0.1, 2, (m, 1))
    elif kind == "concave":
        F = -(k ** 2) * rng.uniform(0.1, 2, (m, 1))
    else:
        F = rng.normal(size=(m, K)) * 1e3
    extra = draw(st.integers(0, int(room.sum())))
    return F, room, extra


@settings(max_examples=300)
@given(problem=cost_curves())
def test_the_pruned_split_is_the_unpruned_programme(problem: tuple[np.ndarray, np.ndarray, int]) -> None:
    """Pruning by the hulls' bounds changes nothing: the same counts as the plain programme
    (so the same tie-breaking), summing to ``extra`` within the rooms."""
    F, room, extra = problem
    got = min_sum_increments(F, room, extra)
    assert got.sum() == extra and (got >= 0).all() and (got <= room).all()
    np.testing.assert_array_equal(got, min_sum_reference(F, room, extra))


def test_min_sum_split_refuses_bad_input() -> None:
    with pytest.raises(InputError, match="extra"):
        min_sum_increments(np.zeros((2, 3)), np.array([1, 1]), 3)
    with pytest.raises(InputError, match="NaN or inf"):
        min_sum_increments(np.array([[0.0, np.nan]]), np.array([1]), 1)
    with pytest.raises(InputError, match="room"):
        min_sum_increments(np.zeros((1, 2)), np.array([2]), 1)


# ---------------------------------------------------------------- the allocators


@st.composite
def small_problems(draw: st.DrawFn) -> tuple[AllocInputs, int]:
    """Up to 4 cells of up to 7 entries, sinks/recent, sliding windows, budgets from the floor up."""
    n_layers = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    windows = [draw(st.sampled_from([None, None, 5])) for _ in range(n_layers)]
    lengths = rng.integers(0, 8, size=(n_layers, hk))
    for l, w in enumerate(windows):
        if w is not None:
            lengths[l] = np.minimum(lengths[l], w - 1)
    sinks, recent = draw(st.integers(0, 1)), draw(st.integers(0, 2))
    S = [max(1, int(lengths[l].max())) for l in range(n_layers)]
    scores = [torch.from_numpy(rng.integers(0, 3, size=(1, hk, s)).astype(np.float32)) if seed % 2
              else torch.randn(1, hk, s, generator=torch.Generator().manual_seed(seed)) for s in S]
    floors_probe = AllocInputs.build(scores, 10**6, floor=sinks + recent, lengths=lengths, windows=windows)
    lo, hi = int(floors_probe.floors.sum()), int(lengths.sum())
    budget = draw(st.integers(lo, hi + 2))
    inp = AllocInputs.build(scores, budget, floor=sinks + recent, lengths=lengths, windows=windows, sinks=sinks,
                            recent=recent, next_position=int(lengths.max()) + draw(st.integers(0, 3)))
    return dataclasses.replace(inp, window=example_ranked_window(inp, seed)), seed


def _caps(inp: AllocInputs) -> np.ndarray:
    caps = inp.lengths.copy()
    for l, w in enumerate(inp.windows):
        if w is not None:
            caps[l] = np.minimum(caps[l], w - 1)
    return caps.reshape(-1)


def _splits(inp: AllocInputs):
    """Every integer split floors <= b <= caps summing to the target (flat, layer-major)."""
    lo, hi = inp.floors.reshape(-1), _caps(inp)
    for b in itertools.product(*[range(a, z + 1) for a, z in zip(lo, hi)]):
        if sum(b) == inp.target:
            yield np.array(b)


def _curve(arrays: tuple[np.ndarray, ...], inp: AllocInputs) -> list[np.ndarray]:
    """Per cell (layer-major), the batch-mean curve over b = 0..length."""
    out = []
    for l, t in enumerate(arrays):
        for h in range(inp.kv_heads):
            out.append(np.asarray(t, dtype=np.float64).mean(0)[h, :int(inp.lengths[l, h]) + 1])
    return out


def _running_min_from(curve: np.ndarray, start: int, b: int) -> float:
    """min over b' in [start, b] of curve(b'): the value an exact level search can reach at b."""
    return float(curve[start:b + 1].min())


def _objective(name: str, inp: AllocInputs, alloc) -> callable:
    """The stated objective of ``name`` as a function of a flat split (independent of the
    allocator's code path: read from the window curves or the fitted profile directly)."""
    floors = inp.floors.reshape(-1)
    w = inp.window
    if name == "contourkv":  # minimax of the scorer-ranked dropped mass at the cell's size
        D = _curve(w.ranked, inp)
        return lambda b: max((_running_min_from(D[c], floors[c], b[c]) for c in range(len(b))), default=0.0)
    if name == "contourkv_mass":
        D = _curve(w.ranked, inp)
        return lambda b: sum(D[c][b[c]] for c in range(len(b)))
    if name == "contourkv_error":
        E = _curve(w.error, inp)
        return lambda b: sum(E[c][b[c]] for c in range(len(b)))
    if name == "contourkv_relerror":  # each cell's error over its error keeping nothing
        E = _curve(w.error, inp)
        R = [e / e[0] if e[0] > 0 else np.zeros_like(e) for e in E]
        return lambda b: sum(R[c][b[c]] for c in range(len(b)))
    if name == "contourkv_query":  # minimax of the per-query tail at b - floor (the floor on top)
        T = _curve(w.tail, inp)
        return lambda b: max((_running_min_from(T[c], 0, b[c] - floors[c]) for c in range(len(b))), default=0.0)
    if name == "contourkv_pred":  # minimax of D * q (q from the mass-only predictor)
        D = _curve(w.ranked, inp)
        pred = alloc._predictor
        Q = [d * pred.predict_proba(d.reshape(-1, 1)) for d in D]
        return lambda b: max((_running_min_from(Q[c], floors[c], b[c]) for c in range(len(b))), default=0.0)
    if name in ("contourkv_offline", "contourkv_offline_mass"):  # the fitted profile read at k / n_ref
        prof = alloc.fitted(inp.geometry)
        nref = alloc.reference_lengths(inp).reshape(-1)
        P = [np.interp(np.arange(int(nref[c]) + 8), GRID * nref[c], prof.dropped.reshape(len(nref), -1)[c])
             for c in range(len(nref))]
        if name == "contourkv_offline":
            return lambda b: max((_running_min_from(P[c], 0, b[c] - floors[c]) for c in range(len(b))), default=0.0)
        return lambda b: sum(P[c][b[c] - floors[c]] for c in range(len(b)))
    raise AssertionError(name)


VARIANTS = ["contourkv", "contourkv_mass", "contourkv_error", "contourkv_relerror", "contourkv_query",
            "contourkv_pred", "contourkv_offline", "contourkv_offline_mass"]


@pytest.mark.parametrize("name", VARIANTS)
@settings(max_examples=60, deadline=None)
@given(problem=small_problems())
def test_each_variant_optimises_its_objective(name: str, problem) -> None:
    inp, seed = problem
    if name == "contourkv_pred":
        alloc = make_allocator(name, predictor=example_predictor())
    elif name == "contourkv_offline_mass":
        alloc = make_allocator("contourkv_mass", profile="default")
    else:
        alloc = make_allocator(name)
    inp = with_needs(alloc, inp, seed)  # a hand-made profile for profile=default, and its geometry
    sizes = check_sizes(inp, alloc.allocate(inp), name)  # exact total, floors <= sizes <= lengths
    flat = sizes.reshape(-1)
    assert (flat <= _caps(inp)).all() and (flat >= inp.floors.reshape(-1)).all()
    f = _objective(name, inp, alloc)
    best = min(f(b) for b in _splits(inp))
    assert f(flat) == pytest.approx(best, abs=1e-9)


def _safeguard_floors(inp: AllocInputs, safeguard: float) -> np.ndarray:
    """The raised floors, written independently of ContourKV.safeguarded: s = floor(safeguard x
    target / cells), lowered one entry at a time until max(floor, min(cap, s)) fits the target."""
    lo, caps = inp.floors.reshape(-1), _caps(inp)
    s = int(safeguard * inp.target / lo.size)
    while s > 0 and np.maximum(lo, np.minimum(caps, s)).sum() > inp.target:
        s -= 1
    return np.maximum(lo, np.minimum(caps, s))


@pytest.mark.parametrize("name", ["contourkv", "contourkv_mass", "contourkv_error", "contourkv_relerror"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(problem=small_problems(), safeguard=st.sampled_from([0.25, 0.5, 1.0]))
def test_the_safeguard_keeps_each_cell_its_share_and_optimises_the_rest(name: str, problem, safeguard: float) -> None:
    """With ``safeguard``, every cell keeps at least its share of a uniform split (capped, and
    never below its floor), and the split is the objective's optimum among those that do.
    Only problems where the safeguard raises some floor (else it is the test above)."""
    inp, seed = problem
    raised = _safeguard_floors(inp, safeguard)
    assume((raised > inp.floors.reshape(-1)).any())
    alloc = make_allocator(name, safeguard=safeguard)
    inp = with_needs(alloc, inp, seed)
    flat = check_sizes(inp, alloc.allocate(inp), name).reshape(-1)
    assert (flat >= raised).all() and (flat <= _caps(inp)).all()
    f = _objective(name, inp, alloc)
    best = min(f(b) for b in _splits(inp) if (b >= raised).all())
    assert f(flat) == pytest.approx(best, abs=1e-9)


def test_the_safeguard_bounds_how_far_a_cell_falls() -> None:
    """The relative-error case below gives cell 0 the floor alone (1 of 4 extra); with
    safeguard = 1 each cell keeps its uniform share (2 each of 4), nothing is left to move."""
    inp = AllocInputs.build([torch.zeros(1, 2, 4)], 4, floor=1, lengths=np.array([[4, 4]]), sinks=1, recent=0)
    error = np.array([[[20.0, 0.2, 0.15, 0.1, 0.0], [0.2, 0.1, 0.1, 0.01, 0.0]]])
    inp = dataclasses.replace(inp, window=dataclasses.replace(example_ranked_window(inp), error=(error,)))
    assert make_allocator("contourkv_relerror").allocate(inp).tolist() == [[1, 3]]
    assert make_allocator("contourkv_relerror", safeguard=1.0).allocate(inp).tolist() == [[2, 2]]
    assert make_allocator("contourkv_relerror", safeguard=0.0).allocate(inp).tolist() == [[1, 3]]
    # hand-made unequal floors: the share is lowered until the raised floors fit the target
    odd = AllocInputs.build([torch.zeros(1, 2, 6)], 6, floor=0, lengths=np.array([[6, 6]]))
    odd = dataclasses.replace(odd, floors=np.array([[5, 0]]), window=example_ranked_window(odd))
    assert make_allocator("contourkv", safeguard=1.0).safeguarded(odd, np.array([[6, 6]])).floors.tolist() == [[5, 1]]


def test_the_safeguard_is_validated() -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(InputError, match="safeguard.*not a fraction in"):
            make_allocator("contourkv", safeguard=bad)
    for name, params in (("contourkv_query", {}), ("contourkv_offline", {}), ("contourkv", {"profile": "default"})):
        with pytest.raises(InputError, match="safeguard.*reads its curves above the floor"):
            make_allocator(name, safeguard=0.5, **params)


def test_objectives_pick_different_splits() -> None:
    """Two cells of 4 entries, 1 sink each, 4 kept in all: splits (1, 3), (2, 2), (3, 1).
    Cell 0 drops much mass whatever it keeps, but its dropped values lie close to its kept
    ones (small forced error); cell 1's drop falls fast, its error slowly."""
    inp = AllocInputs.build([torch.zeros(1, 2, 4)], 4, floor=1, lengths=np.array([[4, 4]]), sinks=1, recent=0)
    ranked = np.array([[[1.0, 0.6, 0.5, 0.45, 0.0], [1.0, 0.4, 0.1, 0.05, 0.0]]])
    error = np.array([[[2.0, 0.05, 0.04, 0.03, 0.0], [2.0, 0.9, 0.2, 0.1, 0.0]]])
    window = dataclasses.replace(example_ranked_window(inp), ranked=(ranked,), error=(error,))
    inp = dataclasses.replace(inp, window=window)
    # level: max(0.45, 0.4) = 0.45 beats max(0.5, 0.1) and max(0.6, 0.05)
    assert make_allocator("contourkv").allocate(inp).tolist() == [[3, 1]]
    # summed mass: 0.5 + 0.1 = 0.6 beats 0.6 + 0.05 and 0.45 + 0.4
    assert make_allocator("contourkv_mass").allocate(inp).tolist() == [[2, 2]]
    # summed error: 0.05 + 0.1 = 0.15 beats 0.04 + 0.2 and 0.03 + 0.9
    assert make_allocator("contourkv_error").allocate(inp).tolist() == [[1, 3]]
    # relative error: the same curves over e(0) = 2 each: the same split
    assert make_allocator("contourkv_relerror").allocate(inp).tolist() == [[1, 3]]


def test_relative_error_discounts_a_cell_that_is_large_in_value_units() -> None:
    """Cell 0's outputs are 100x cell 1's (e(0) = 20 vs 0.2) with the same relative curve
    shifted: in value units any entry of cell 0 outweighs cell 1 and the absolute objective
    gives it everything; relative to its own output cell 0 is already at 1% at size 1 while
    cell 1 keeps losing 50% until it gets 2 more."""
    inp = AllocInputs.build([torch.zeros(1, 2, 4)], 4, floor=1, lengths=np.array([[4, 4]]), sinks=1, recent=0)
    error = np.array([[[20.0, 0.2, 0.15, 0.1, 0.0], [0.2, 0.1, 0.1, 0.01, 0.0]]])
    window = dataclasses.replace(example_ranked_window(inp), error=(error,))
    inp = dataclasses.replace(inp, window=window)
    # absolute: (3, 1) costs 0.1 + 0.1 = 0.2, (1, 3) 0.2 + 0.01 = 0.21, (2, 2) 0.15 + 0.1 = 0.25
    assert make_allocator("contourkv_error").allocate(inp).tolist() == [[3, 1]]
    # relative: (1, 3) 0.01 + 0.05 = 0.06 beats (3, 1) 0.005 + 0.5 and (2, 2) 0.0075 + 0.5
    assert make_allocator("contourkv_relerror").allocate(inp).tolist() == [[1, 3]]
    zero = dataclasses.replace(inp, window=dataclasses.replace(window, error=(error * np.array([0.0, 1.0])[None, :, None],)))
    # a cell with no output (e(0) = 0) costs nothing: the other cell takes every entry it can
    assert make_allocator("contourkv_relerror").allocate(zero).tolist() == [[1, 3]]


def test_variant_parameters_are_validated(tmp_path) -> None:
    with pytest.raises(InputError, match="ranking=.*own top-b"):
        make_allocator("contourkv", profile="default", ranking="scorer")
    with pytest.raises(InputError, match="contourkv_error parameter profile=.*holds no forced error"):
        make_allocator("contourkv_error", profile="default")
    with pytest.raises(InputError, match="contourkv_error parameter ranking=.*forced error"):
        make_allocator("contourkv_error", ranking="query")
    with pytest.raises(InputError, match="contourkv_relerror parameter profile=.*holds no forced error"):
        make_allocator("contourkv_relerror", profile="default")
    with pytest.raises(InputError, match="ranking='sideways' is not one of scorer, query or none"):
        make_allocator("contourkv", ranking="sideways")
    with pytest.raises(InputError, match="contourkv_offline parameter profile=.*reads a fitted profile"):
        make_allocator("contourkv_offline", profile="none")
    assert make_allocator("contourkv").ranked == "scorer" and make_allocator("contourkv_query").ranked == "query"
    assert make_allocator("contourkv_offline").ranked == "query" and make_allocator("contourkv_offline").needs == set()
    inp = AllocInputs.build([torch.zeros(1, 2, 6)], 8, floor=1)
    with pytest.raises(InputError, match="no model"):  # profile=default needs the model's geometry
        make_allocator("contourkv_offline").allocate(inp)
    with pytest.raises(InputError, match=r"window\.ranked"):
        make_allocator("contourkv").allocate(dataclasses.replace(inp, window=dataclasses.replace(
            example_ranked_window(inp), ranked=None)))
