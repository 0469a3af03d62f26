"""ContourKV: the level search, the allocators, the profile file, the fit, and the trace.

References: the level search against an enumerate-and-sort reference; the allocator's rule
(exact total, floors, caps) and monotonicity for any profiles; the online estimate against
the offline fit of a dataset written from the same queries; the trace against
``evictlab.core.reference`` and the pool brute force of ``evictlab.solve.reference``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from evictlab.contour.fit import fit_profile
from evictlab.contour.level import envelope, top_increments, top_increments_reference
from evictlab.contour.profile import GRID, ContourProfile, relative_tail, tail_mass, window_stats
from evictlab.core import reference as ref
from evictlab.decode.trace import CompressionTrace
from evictlab.errors import CorruptFileError, InputError
from evictlab.methods import AllocInputs, WindowProfile, check_sizes, make_allocator
from evictlab.kv.attention import attention_probs
from evictlab.methods.testing import example_predictor, example_ranked_window, example_window
from evictlab.rows.writer import RowWriter
from evictlab.solve.reference import pool_bruteforce

# ---------------------------------------------------------------- the statistic


def test_tail_mass_is_dropped_mass_of_the_top_set() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 17, generator=g, dtype=torch.float64) * 3, -1)
    p[2, :4] = 0.0  # zeros and ties
    p[3] = 1.0 / 17
    p = p / p.sum(-1, keepdim=True)
    t = tail_mass(p)
    assert t.shape == (5, 18)
    for r in range(5):
        row = p[r].numpy()
        assert t[r, 0] == pytest.approx(1.0) and t[r, -1] == 0.0
        for b in range(1, 18):
            assert t[r, b] == pytest.approx(ref.dropped_mass(row, ref.top_mass_set(row, b)), abs=1e-15)
    assert (np.diff(t, axis=1) <= 0).all()
    # zero padding does not change a row's curve
    padded = torch.cat([p, torch.zeros(5, 6, dtype=torch.float64)], 1)
    np.testing.assert_allclose(tail_mass(padded)[:, :18], t, atol=1e-15)
    np.testing.assert_allclose(tail_mass(p.float()), t, atol=1e-7)  # float32 rows: sorted as float32, summed in float64


def test_relative_tail_interpolates_linearly_between_integers() -> None:
    tail = np.array([[1.0, 0.5, 0.2, 0.0, 0.0], [1.0, 0.4, 0.0, 0.0, 0.0]])
    n = np.array([3, 2])
    grid = np.array([0.0, 0.25, 0.5, 1.0])
    got = relative_tail(tail, n, grid)
    np.testing.assert_allclose(got[0], np.interp(grid * 3, np.arange(4), tail[0, :4]))
    np.testing.assert_allclose(got[1], np.interp(grid * 2, np.arange(3), tail[1, :3]))


# ---------------------------------------------------------------- the level search


@st.composite
def knot_sets(draw: st.DrawFn) -> tuple:
    m = draw(st.integers(1, 6))
    k = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    nk = rng.integers(1, k + 1, size=m)
    x, y = np.zeros((m, k)), np.zeros((m, k))
    plateaus = draw(st.booleans())
    for c in range(m):
        xs = np.sort(rng.choice(np.arange(0, 40), size=nk[c], replace=False)).astype(float) * rng.choice([1.0, 0.37])
        x[c, :nk[c]] = xs
        y[c, :nk[c]] = rng.choice([0.0, 0.25, 0.5, 1.0], size=nk[c]) if plateaus else rng.random(nk[c])
    room = rng.integers(0, 25, size=m)
    extra = draw(st.integers(0, int(room.sum())))
    return x, envelope(y), nk, room, extra


@given(case=knot_sets(), jump=st.sampled_from([None, 0, 5]))
def test_level_search_equals_enumeration(case, jump) -> None:
    """The merge alone (jump_min None: 64 x cells, above extra here) and with the
    bisection jump start (0, 5) give the enumerate-and-sort answer exactly."""
    x, y, nk, room, extra = case
    got = top_increments(x, y, nk, room, extra, jump_min=jump)
    np.testing.assert_array_equal(got, top_increments_reference(x, y, nk, room, extra))
    assert got.sum() == extra and (got >= 0).all() and (got <= room).all()
    if extra < room.sum():  # one more entry never takes one from any cell
        more = top_increments(x, y, nk, room, extra + 1, jump_min=jump)
        assert (more >= got).all() and more.sum() == extra + 1


def test_level_search_ties_go_round_robin() -> None:
    """Equal profiles: cells take turns (k ascending), the lower cell first at each k."""
    x = np.tile(np.arange(5.0), (3, 1))
    y = np.tile([1.0, 0.5, 0.5, 0.5, 0.0], (3, 1))
    room = np.array([4, 4, 4])
    for jump in (None, 0):
        assert top_increments(x, y, np.full(3, 5), room, 4, jump_min=jump).tolist() == [2, 1, 1]
        assert top_increments(x, y, np.full(3, 5), room, 7, jump_min=jump).tolist() == [3, 2, 2]


def test_level_search_refuses_bad_knots() -> None:
    with pytest.raises(InputError, match="strictly rising"):
        top_increments(np.array([[0.0, 0.0]]), np.array([[1.0, 0.5]]), np.array([2]), np.array([3]), 1)
    with pytest.raises(InputError, match="extra"):
        top_increments(np.array([[0.0, 1.0]]), np.array([[1.0, 0.5]]), np.array([2]), np.array([3]), 4)


# ---------------------------------------------------------------- the allocators


def _inputs(lengths: np.ndarray, budget: int, floor: int, windows=None, next_position=None, seed=0) -> AllocInputs:
    n_layers, hk = lengths.shape
    S = [int(lengths[l].max()) for l in range(n_layers)]
    scores = [torch.zeros(1, hk, s) for s in S]
    inp = AllocInputs.build(scores, budget, floor=floor, lengths=lengths, windows=windows,
                            next_position=next_position)
    return dataclasses.replace(inp, window=example_ranked_window(inp, seed))


def _profile(dropped: np.ndarray, windows=None, predictor=None) -> ContourProfile:
    n_layers, hk, _ = dropped.shape
    geometry = {"n_layers": n_layers, "kv_heads": hk, "q_heads": hk, "head_dim": 8,
                "windows": list(windows or [None] * n_layers)}
    ones = np.ones((n_layers, hk))
    return ContourProfile("hand-made", geometry, GRID.copy(), dropped, ones * 0.5, np.ones((n_layers, hk), np.int64),
                          ones * 100, {"rows": "hand-made"}, predictor=predictor)


def _random_profile(n_layers: int, hk: int, rng: np.random.Generator) -> np.ndarray:
    """Non-increasing profiles from 1 (r = 0) to 0 (r = 1), cells from peaked to flat."""
    power = rng.uniform(0.05, 3.0, size=(n_layers, hk, 1))
    return (1.0 - GRID[None, None, :]) ** (1.0 / power) * (GRID[None, None, :] < 1)


@st.composite
def problems(draw: st.DrawFn) -> tuple:
    n_layers = draw(st.integers(1, 4))
    hk = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 10_000)))
    windows = [draw(st.sampled_from([None, None, 6, 12])) for _ in range(n_layers)]
    lengths = rng.integers(0, 30, size=(n_layers, hk))
    for l, w in enumerate(windows):
        if w is not None:
            lengths[l] = np.minimum(lengths[l], w - 1)  # the loop drops out-of-window entries first
    floor = draw(st.integers(0, 5))
    floors = np.minimum(floor, lengths)
    for l, w in enumerate(windows):
        if w is not None:
            floors[l] = np.minimum(floors[l], w - 1)
    budget = draw(st.integers(int(floors.sum()), int(lengths.sum()) + 3))
    seen = draw(st.sampled_from([None, int(lengths.max()) + 1, 500]))
    return lengths.astype(np.int64), budget, floor, windows, seen, rng


@given(problem=problems(), offline=st.booleans(), pred=st.booleans())
def test_total_exact_floors_and_caps_for_any_profiles(problem, offline: bool, pred: bool, tmp_path_factory) -> None:
    lengths, budget, floor, windows, seen, rng = problem
    n_layers, hk = lengths.shape
    inp = _inputs(lengths, budget, floor, windows, seen, seed=int(rng.integers(1000)))
    params = {}
    if offline:
        path = tmp_path_factory.mktemp("p") / "profile.json"
        _profile(_random_profile(n_layers, hk, rng), windows).save(path)
        params["profile"] = path
    name = "contourkv_pred" if pred else "contourkv"
    if pred:
        params["predictor"] = example_predictor()
    alloc = make_allocator(name, **params)
    sizes = check_sizes(inp, alloc.allocate(inp), name)  # sum == min(budget, held), floors <= sizes <= lengths
    for l, w in enumerate(windows):
        if w is not None:
            assert (sizes[l] <= w - 1).all()
    if inp.target < inp.held:  # monotone in the budget
        bigger = dataclasses.replace(inp, budget=inp.target + 1)
        more = check_sizes(bigger, alloc.allocate(bigger), name)
        assert (more >= sizes).all()


def _hand_window(lengths: np.ndarray, curves: dict[tuple[int, int], np.ndarray]) -> AllocInputs:
    tails = []
    for l in range(lengths.shape[0]):
        t = np.zeros((1, lengths.shape[1], int(lengths[l].max()) + 1))
        for h in range(lengths.shape[1]):
            t[0, h, :lengths[l, h] + 1] = curves[(l, h)]
        tails.append(t)
    return WindowProfile(tuple(tails), np.zeros((1, *lengths.shape)))


def test_flat_cells_get_more_than_peaked_ones() -> None:
    """Two cells of 100 entries: one row peaked (mass on 3 keys), one flat (uniform)."""
    n = 100
    peaked = np.zeros(n)
    peaked[:3] = [0.8, 0.15, 0.05]
    flat = np.full(n, 1.0 / n)
    curves = {(0, 0): tail_mass(peaked[None])[0], (0, 1): tail_mass(flat[None])[0]}
    lengths = np.array([[n, n]])
    inp = dataclasses.replace(AllocInputs.build([torch.zeros(1, 2, n)], 60, floor=4), window=_hand_window(lengths, curves))
    alloc = make_allocator("contourkv_query")  # the per-query profile, the floor counted on top
    same = make_allocator("contourkv", ranking="query")
    sizes = check_sizes(inp, alloc.allocate(inp))
    # 52 extra entries: the flat cell's k-th has priority 1 - (k-1)/100, the peaked cell's
    # 1, 0.2, 0.05, 0, ...: the level lands at 0.49, which the peaked cell reaches with one key.
    assert sizes.tolist() == [[4 + 1, 4 + 51]]
    np.testing.assert_array_equal(same.allocate(inp), sizes)
    # At 99 extra the level is just below 0.05: the peaked cell's 3 keys, the flat cell's 96.
    more = dataclasses.replace(inp, budget=8 + 99)
    assert check_sizes(more, alloc.allocate(more)).tolist() == [[4 + 3, 4 + 96]]
    # Offline, the same shapes as relative profiles: the flat cell again gets more.
    dropped = np.stack([relative_tail(np.stack([curves[(0, 0)], curves[(0, 1)]]), np.array([n, n]))])
    prof = _profile(dropped)
    x, _ = prof.knots(np.full((1, 2), n))
    np.testing.assert_allclose(x[1], GRID * n)
    uniform = check_sizes(inp, make_allocator("uniform").allocate(inp))
    assert uniform.tolist() == [[30, 30]]


def test_flat_cells_get_more_offline(tmp_path: Path) -> None:
    """The same shapes as fitted relative profiles, read at 100 tokens seen."""
    n = 100
    rows = torch.zeros(2, n, dtype=torch.float64)
    rows[0, :3] = torch.tensor([0.8, 0.15, 0.05])
    rows[1] = 1.0 / n
    dropped = relative_tail(tail_mass(rows), np.array([n, n]))[None]
    _profile(dropped).save(tmp_path / "p.json")
    alloc = make_allocator("contourkv", profile=str(tmp_path / "p.json"))
    inp = AllocInputs.build([torch.zeros(1, 2, n)], 60, floor=4, next_position=n)
    sizes = check_sizes(inp, alloc.allocate(inp))
    assert sizes[0, 0] <= 4 + 3 and sizes[0, 1] >= 60 - 7
    # Once the flat cell holds everything, the rest goes to the peaked one (the sum rule wins).
    inp = dataclasses.replace(inp, budget=120)
    assert check_sizes(inp, alloc.allocate(inp)).tolist() == [[20, 100]]


def test_offline_profile_is_read_at_the_tokens_seen(tmp_path: Path) -> None:
    """Relative profiles scale with the context: D_c(b) = profile_c(b / n_ref), n_ref = seen
    (the window on sliding layers)."""
    rng = np.random.default_rng(1)
    prof = _profile(_random_profile(2, 2, rng), windows=[None, 8])
    prof.save(tmp_path / "p.json")
    alloc = make_allocator("contourkv", profile=str(tmp_path / "p.json"))
    inp = AllocInputs.build([torch.zeros(1, 2, 40), torch.zeros(1, 2, 7)], 50, floor=2,
                            windows=[None, 8], next_position=300)
    assert alloc.reference_lengths(inp).tolist() == [[300, 300], [8, 8]]
    x, y, nk = alloc.knots(inp)
    np.testing.assert_allclose(x[0], GRID * 300)  # full-attention cell: the tokens seen
    np.testing.assert_allclose(x[3], GRID * 8)  # sliding cell: its window
    sizes = check_sizes(inp, alloc.allocate(inp))
    assert (sizes[1] <= 7).all()


def test_predictor_weight_multiplies_the_profile(tmp_path: Path) -> None:
    """contourkv_pred runs the level on D * q with q the predictor's probability at D."""
    from evictlab.stats.predictors import Predictor

    rng = np.random.default_rng(2)
    pred_path = example_predictor(tmp_path)
    pred = Predictor.load(pred_path)
    prof = _profile(_random_profile(2, 2, rng), predictor=pred.to_dict())
    prof.save(tmp_path / "p.json")
    a = make_allocator("contourkv_pred", profile=str(tmp_path / "p.json"))  # embedded predictor
    b = make_allocator("contourkv_pred", profile=str(tmp_path / "p.json"), predictor=str(pred_path))
    inp = AllocInputs.build([torch.zeros(1, 2, 64)] * 2, 80, floor=4, next_position=64)
    x, y, _ = a.knots(inp)
    w = a.weights(inp, x, y)
    np.testing.assert_allclose(w, y * pred.predict_proba(y.reshape(-1, 1)).reshape(y.shape))
    np.testing.assert_array_equal(a.allocate(inp), b.allocate(inp))


def test_allocator_parameter_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"allocator_param: contourkv parameter profile=.*no such profile file"):
        make_allocator("contourkv", profile=str(tmp_path / "missing.json"))
    with pytest.raises(InputError, match=r"allocator_param: contourkv_pred parameter predictor=.*no such predictor"):
        make_allocator("contourkv_pred", predictor=str(tmp_path / "missing.json"))
    with pytest.raises(InputError, match="contourkv_pred needs a fitted dropped-mass predictor"):
        make_allocator("contourkv_pred")
    (tmp_path / "other.json").write_text('{"format": "evictlab.predictor", "version": 1}')
    with pytest.raises(InputError, match="is not a ContourKV profile"):
        make_allocator("contourkv", profile=str(tmp_path / "other.json"))
    online = make_allocator("contourkv")
    assert online.needs == {"window_profile", "window_ranked"} and make_allocator("contourkv", profile=None).needs
    assert make_allocator("contourkv_query").needs == {"window_profile"}
    assert make_allocator("contourkv_error").needs == {"window_profile", "window_error"}
    with pytest.raises(InputError, match="observation window"):
        online.allocate(AllocInputs.build([torch.zeros(1, 2, 10)], 8, floor=1))


# ---------------------------------------------------------------- the profile file


def test_profile_round_trip_and_refusals(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    prof = _profile(_random_profile(3, 2, rng), windows=[None, 16, None])
    path = prof.save(tmp_path / "p.json")
    back = ContourProfile.load(path)
    np.testing.assert_array_equal(back.dropped, prof.dropped)
    np.testing.assert_array_equal(back.grid, prof.grid)
    assert back.geometry == prof.geometry and back.model == prof.model and back.to_dict() == prof.to_dict()
    d = json.loads(path.read_text())
    for change, match, err in ((lambda d: d.update(version=2), "version 2 is not supported", InputError),
                               (lambda d: d.update(format="x"), "not a ContourKV profile", CorruptFileError),
                               (lambda d: d["cells"].pop(), "describes 5 of 3 x 2 cells", CorruptFileError),
                               (lambda d: d["cells"][0].update(dropped=[2.0] * GRID.size), "lie in", CorruptFileError),
                               (lambda d: d.update(grid=d["grid"][::-1]), "grid", CorruptFileError),
                               (lambda d: d.pop("geometry"), "missing or malformed", CorruptFileError)):
        bad = json.loads(json.dumps(d))
        change(bad)
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(err, match=match):
            ContourProfile.load(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(CorruptFileError, match="not valid JSON"):
        ContourProfile.load(tmp_path / "junk.json")


def test_geometry_mismatch_names_the_file_and_the_difference(tmp_path: Path) -> None:
    from evictlab.capture.testing import tiny_model
    from evictlab.models.geometry import model_geometry

    model, _ = tiny_model("llama")
    g = model_geometry(model)
    rng = np.random.default_rng(4)
    good = _profile(_random_profile(g.n_layers, g.kv_heads, rng))
    good.geometry.update(q_heads=g.q_heads, head_dim=g.head_dim)
    good.save(tmp_path / "good.json")
    make_allocator("contourkv", profile=str(tmp_path / "good.json")).check(g)
    bad = _profile(_random_profile(g.n_layers + 1, g.kv_heads, rng))
    bad.geometry.update(q_heads=g.q_heads, head_dim=g.head_dim * 2)
    bad.save(tmp_path / "bad.json")
    alloc = make_allocator("contourkv", profile=str(tmp_path / "bad.json"))
    with pytest.raises(InputError, match=rf"allocator_param: profile {tmp_path / 'bad.json'} was fitted on another "
                       rf"model geometry \(n_layers {g.n_layers + 1} in the profile, {g.n_layers} in the model; "
                       rf"head_dim {2 * g.head_dim} in the profile, {g.head_dim} in the model"):
        alloc.check(g)
    sliding = dataclasses.replace(g, windows=(None,) * (g.n_layers - 1) + (8,))
    with pytest.raises(InputError, match=rf"windows none sliding \({g.n_layers} layers\) in the profile, sliding 8 "
                       rf"on 1 of {g.n_layers} layers in the model"):
        make_allocator("contourkv", profile=str(tmp_path / "good.json")).check(sliding)
    with pytest.raises(InputError, match="n_layers"):  # hand-made inputs: the shape is checked
        alloc.allocate(AllocInputs.build([torch.zeros(1, g.kv_heads, 10)] * g.n_layers, 30, floor=1))


# ---------------------------------------------------------------- online == offline


def _write_rows(path: Path, keys, values, queries, scaling: float, q_pos: np.ndarray) -> None:
    """A dataset whose rows are exactly the window's rows: cell (l, h) holds keys[l][h], and
    query head j of the group reads it at every window position."""
    n_layers, hk = len(keys), len(keys[0])
    g = queries[0].shape[0] // hk
    d = keys[0][0].shape[1]
    source = {"gqa": {str(l): [g * hk, hk] for l in range(n_layers)},
              "sliding_window": {str(l): None for l in range(n_layers)}}
    with RowWriter(path, model="hand-made", capture_mode="query-agnostic", head_dim=d, source=source) as w:
        w.add_prompt(0, [])
        for l in range(n_layers):
            for h in range(hk):
                n = keys[l][h].shape[0]
                b = w.add_block(0, l, h, keys[l][h], values[l][h], np.arange(n))
                q = queries[l][h * g:(h + 1) * g]  # (g, window, d)
                W = q.shape[1]
                w.add_query_rows(b, q.reshape(g * W, d), np.repeat(np.arange(h * g, (h + 1) * g), W),
                                 np.tile(q_pos, g), np.zeros(g * W, np.int64), np.full(g * W, n), scaling)
        w.end_prompt(0)


def test_online_estimate_equals_offline_fit_on_the_same_queries(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    n_layers, hk, g, W, d = 2, 2, 3, 5, 8
    lengths = [[40, 33], [27, 40]]
    keys = [[rng.standard_normal((lengths[l][h], d)).astype(np.float32) * (1 + 2 * l + h) for h in range(hk)]
            for l in range(n_layers)]
    values = [[rng.standard_normal((lengths[l][h], d)).astype(np.float32) for h in range(hk)] for l in range(n_layers)]
    queries = [rng.standard_normal((g * hk, W, d)).astype(np.float32) for _ in range(n_layers)]
    scaling = d ** -0.5
    q_pos = np.arange(100, 100 + W)  # after every key: each row sees its whole cell
    _write_rows(tmp_path / "rows", keys, values, queries, scaling, q_pos)
    prof = fit_profile(tmp_path / "rows")
    assert prof.geometry == {"n_layers": 2, "kv_heads": 2, "q_heads": 6, "head_dim": 8, "windows": [None, None]}
    assert prof.rows.tolist() == [[g * W] * hk] * n_layers
    for l in range(n_layers):
        for h in range(hk):
            n = lengths[l][h]
            tail, ent = window_stats(torch.from_numpy(queries[l][h * g:(h + 1) * g]), torch.from_numpy(keys[l][h]),
                                     scaling, torch.from_numpy(q_pos), torch.arange(n))
            # float32 attention online vs the reader's float64 softmax: agreement to ~1e-7
            np.testing.assert_allclose(prof.dropped[l, h], np.interp(GRID * n, np.arange(n + 1), tail), atol=2e-6)
            assert prof.entropy_norm[l, h] == pytest.approx(ent, abs=2e-6)
            assert prof.n_mean[l, h] == n


def test_fit_refuses_missing_cells_and_foreign_results(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    d = 4
    source = {"gqa": {"0": [2, 2], "1": [2, 2]}, "sliding_window": {"0": None, "1": None}}
    with RowWriter(tmp_path / "rows", model="m", capture_mode="query-agnostic", head_dim=d, source=source) as w:
        w.add_prompt(0, [])
        for h in range(2):  # layer 1 never captured
            b = w.add_block(0, 0, h, rng.standard_normal((9, d)), rng.standard_normal((9, d)), np.arange(9))
            w.add_query_rows(b, rng.standard_normal((3, d)), [h] * 3, [9] * 3, [0] * 3, [9] * 3, 0.5)
        w.end_prompt(0)
    with pytest.raises(InputError, match=r"no rows for 2 of 4 cells \(layer, kv_head\): \(1, 0\), \(1, 1\)"):
        fit_profile(tmp_path / "rows")
    with pytest.raises(InputError, match="no such row dataset"):
        fit_profile(tmp_path / "nope")


def test_fit_records_selection_ceilings_and_refuses_other_rows(tmp_path: Path) -> None:
    import polars as pl

    from evictlab.rows.synth import SynthConfig, synthesize
    from evictlab.rows.reader import RowStore
    from evictlab.solve import SolveConfig, solve_rows

    synthesize(tmp_path / "a", SynthConfig(rows=300, keys=24, dim=8, seed=0))
    synthesize(tmp_path / "b", SynthConfig(rows=300, keys=20, dim=8, seed=1))
    solve_rows(tmp_path / "a", tmp_path / "ra.parquet", SolveConfig(budgets=(2, 4)), progress=False)
    solve_rows(tmp_path / "b", tmp_path / "rb.parquet", SolveConfig(budgets=(2, 4)), progress=False)
    prof = fit_profile(tmp_path / "a", tmp_path / "ra.parquet", example_predictor(tmp_path))
    sel = prof.selection
    assert sel["budgets"] == [2, 4] and sel["cells"][0]["s"] == [2, 4] and sel["cells"][0]["rows"] == [300, 300]
    res = pl.read_parquet(tmp_path / "ra.parquet").filter(pl.col("s") == 4, pl.col("e_top") > 0)
    assert sel["cells"][0]["significant_rate"][1] == pytest.approx(float((res["kappa_hat"] > 1.11).mean()))
    assert prof.predictor["features"] == ["dropped_mass"] and prof.predictor["source"]["sha256"]
    assert prof.source["rows_used"] == 300 and len(prof.source["manifest_sha256"]) == 64
    assert prof.rows.tolist() == [[300]] and RowStore.open(tmp_path / "a").n_rows == 300
    with pytest.raises(InputError, match=r"were not solved from ROWS: row_id \d+ has layer 0, kv_head 0, n \d+ there"):
        fit_profile(tmp_path / "a", tmp_path / "rb.parquet")


# ---------------------------------------------------------------- the trace


def test_trace_equals_the_core_reference_on_the_held_rows() -> None:
    """One hand-made compression: every per-cell mean equals the reference definitions on
    the same attention rows (causal prefixes, kept entries the query can see)."""
    gen = torch.Generator().manual_seed(7)
    hk, g, W, S, d = 2, 2, 4, 14, 6
    lengths = np.array([14, 10])
    keys = torch.randn(1, hk, S, d, generator=gen)
    values = torch.randn(1, hk, S, d, generator=gen)
    positions = torch.stack([torch.sort(torch.randperm(40, generator=gen)[:S]).values for _ in range(hk)])[None]
    queries = torch.randn(1, hk * g, W, d, generator=gen) * 2
    q_pos = torch.tensor([20, 26, 33, 45])
    keep = [[torch.tensor([0, 1, 3, 6, 9, 12, 13]), torch.tensor([0, 2, 5, 8, 9])]]
    tr = CompressionTrace(max_subsets=10_000)
    tr.label(run="hand-made")
    tr.record(3, "prefill", 46, 5, keys, values, positions, lengths, keep, queries, q_pos, 0.4)
    table = tr.table()
    assert table.height == 2 and table["run"].to_list() == ["hand-made"] * 2
    for h in range(hk):
        row = table.row(h, named=True)
        n = int(lengths[h])
        pos = positions[0, h, :n]
        probs = attention_probs(queries[:, h * g:(h + 1) * g], keys[:, h:h + 1, :n], 0.4, q_pos, pos)[0].double()
        V = values[0, h, :n].double().numpy()
        kept = keep[0][h].numpy()
        want = {k: [] for k in ("dk", "dt", "ek", "et", "es")}
        for j in range(g):
            for t in range(W):
                n_r = int((pos <= q_pos[t]).sum())
                a = kept[kept < n_r]
                if a.size == 0:
                    continue
                p = probs[j, t, :n_r].numpy()
                top = ref.top_mass_set(p, a.size)
                want["dk"].append(ref.dropped_mass(p, a))
                want["dt"].append(ref.dropped_mass(p, top))
                want["ek"].append(ref.forced_error(p, V[:n_r], a))
                want["et"].append(ref.forced_error(p, V[:n_r], top))
                want["es"].append(pool_bruteforce(p, V[:n_r], ref.candidate_pool(p, V[:n_r], a.size), a.size)[0])
        assert row["rows"] == len(want["ek"]) > 0
        assert (row["layer"], row["kv_head"], row["held"], row["kept"]) == (5, h, n, kept.size)
        for col, key in (("dropped_kept", "dk"), ("dropped_top", "dt"), ("e_kept", "ek"), ("e_top", "et"),
                         ("es_hat", "es")):
            assert row[col] == pytest.approx(float(np.mean(want[key])), rel=1e-9, abs=1e-12), col
        assert row["es_hat"] <= row["e_top"] + 1e-12 and row["es_hat_note"] is None


def test_trace_counts_the_facts_entries_held_and_kept() -> None:
    """``fact_held`` / ``fact_kept`` count a cell's entries at the fact's positions, by
    position (not by index), before and after the compression; null without facts; the
    facts of one label do not leak into the next."""
    gen = torch.Generator().manual_seed(9)
    hk, S, d = 2, 8, 4
    keys, values = torch.randn(1, hk, S, d, generator=gen), torch.randn(1, hk, S, d, generator=gen)
    positions = torch.tensor([[[0, 1, 2, 5, 6, 7, 9, 11], [0, 3, 4, 5, 8, 9, 10, 11]]])
    keep = [[torch.tensor([0, 3, 4, 7]), torch.tensor([0, 1, 2, 6])]]
    args = (keys, values, positions, np.array([8, 8]), keep, torch.randn(1, hk, 2, d, generator=gen),
            torch.tensor([11, 12]), 0.5)
    tr = CompressionTrace(max_subsets=1)
    tr.label(facts="5:7,9:10", run="a")  # positions 5, 6, 9
    tr.record(0, "prefill", 12, 0, *args)
    tr.label(facts=lambda: "3:5", run="b")  # a callable, as the audit passes it
    tr.record(0, "prefill", 12, 0, *args)
    tr.label(run="c")
    tr.record(0, "prefill", 12, 0, *args)
    t = tr.table()
    # head 0 holds 5, 6, 9 and keeps positions 0, 5, 6, 11; head 1 holds 5, 9, keeps 0, 3, 4, 10
    assert t.filter(pl.col("run") == "a").select("fact_held", "fact_kept").rows() == [(3, 2), (2, 0)]
    assert t.filter(pl.col("run") == "b").select("fact_held", "fact_kept").rows() == [(0, 0), (2, 2)]
    assert t.filter(pl.col("run") == "c").select("fact_held", "fact_kept").rows() == [(None, None)] * 2
    assert "facts" not in t.columns
    with pytest.raises(InputError, match="useful"):
        tr.label(facts="5-7")


def test_trace_reports_why_es_hat_is_missing() -> None:
    gen = torch.Generator().manual_seed(8)
    keys, values = torch.randn(1, 1, 30, 4, generator=gen), torch.randn(1, 1, 30, 4, generator=gen)
    tr = CompressionTrace(max_subsets=10)
    tr.record(0, "prefill", 30, 0, keys, values, torch.arange(30)[None, None], np.array([30]),
              [[torch.arange(0, 30, 2)]], torch.randn(1, 1, 2, 4, generator=gen), torch.tensor([30, 31]), 0.5)
    row = tr.table().row(0, named=True)
    assert row["es_hat"] is None and row["gap_closed"] is None
    assert "C(19, 15) = 3,876 subsets per row > max_subsets 10" in row["es_hat_note"]
    assert row["e_kept"] >= row["e_top"] >= 0
    with pytest.raises(InputError, match="max_subsets"):
        CompressionTrace(max_subsets=0)


# ---------------------------------------------------------------- in the decode loop (tiny model)


@pytest.fixture(scope="module")
def tiny():
    from evictlab.capture.testing import tiny_model

    torch.set_num_threads(1)
    model, _ = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, 256, (2, 160), generator=g)
    q = torch.randint(3, 256, (2, 5), generator=g)
    a = torch.randint(3, 256, (2, 12), generator=g)
    return model, ctx, q, a


def _tiny_cfg(**kw):
    from evictlab.decode.config import DecodeConfig
    from evictlab.kv.budget import Budget

    base = dict(mode="physical", budget=Budget("tokens_per_cell", 24), scorer="snapkv", allocator="contourkv",
                chunk_size=48, compress_every=4, block_size=8, sinks=2, recent=6, window=8)
    base.update(kw)
    return DecodeConfig.of(**base)


def _tiny_profile(model, path: Path, seed: int = 0, **geometry) -> Path:
    from evictlab.models.geometry import model_geometry

    g = model_geometry(model)
    prof = _profile(_random_profile(g.n_layers, g.kv_heads, np.random.default_rng(seed)), list(g.windows))
    prof.geometry.update({"q_heads": g.q_heads, "head_dim": g.head_dim, **geometry})
    return prof.save(path)


@pytest.mark.parametrize("offline", [False, True])
def test_contourkv_in_the_loop_holds_exactly_the_budget(tiny, offline: bool, tmp_path: Path) -> None:
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import kv_bytes
    from evictlab.models.geometry import model_geometry

    model, ctx, q, a = tiny
    g = model_geometry(model)
    params = {"profile": str(_tiny_profile(model, tmp_path / "p.json"))} if offline else {}
    outs = {}
    for mode in ("physical", "masked"):
        tr = CompressionTrace(max_subsets=2_000)
        outs[mode] = (run_sequence(model, ctx, q, _tiny_cfg(mode=mode, allocator_params=params), answer_ids=a,
                                   compression_trace=tr), tr.table())
    phys, table = outs["physical"]
    budget = 24 * g.cells
    assert phys.compressions >= 4
    assert phys.after_compression("live_tokens") == budget * 2  # two sequences
    assert phys.after_compression("bytes_live") == kv_bytes(budget * 2, g.head_dim, g.dtype)
    torch.testing.assert_close(phys.logits, outs["masked"][0].logits, rtol=1e-5, atol=1e-5)
    # one trace row per (compression, item, layer, KV head); each compression keeps the budget
    assert table.height == phys.compressions * 2 * g.cells
    per = table.group_by("compression", "item").agg(pl_sum("kept"), pl_sum("held"))
    assert set(per["kept"].to_list()) == {budget} and (per["held"] > budget).all()
    assert table["kept"].n_unique() > 1  # ragged: the profile moved entries between cells
    assert (table["dropped_kept"] >= table["dropped_top"] - 1e-12).all()  # T_s is the mass optimum
    has = table.filter(table["es_hat"].is_not_null())
    assert (has["es_hat"] <= has["e_top"] + 1e-9).all()
    masked = outs["masked"][1]  # the same kept sets, so the same trace (floats to rounding)
    for col in ("compression", "layer", "kv_head", "held", "kept", "rows"):
        assert masked[col].to_list() == table[col].to_list(), col
    np.testing.assert_allclose(masked["e_kept"].to_numpy(), table["e_kept"].to_numpy(), rtol=1e-4)


def pl_sum(col: str):
    import polars as pl

    return pl.col(col).sum()


def test_trace_off_changes_nothing(tiny) -> None:
    from evictlab.decode.loop import run_sequence

    model, ctx, q, a = tiny
    cfg = _tiny_cfg(allocator="adakv")
    plain = run_sequence(model, ctx, q, cfg, answer_ids=a)
    traced = run_sequence(model, ctx, q, cfg, answer_ids=a, compression_trace=CompressionTrace())
    assert torch.equal(plain.logits, traced.logits)


def test_profile_of_another_geometry_is_refused_before_the_run(tiny, tmp_path: Path) -> None:
    from evictlab.decode.loop import run_sequence

    model, ctx, q, a = tiny
    path = _tiny_profile(model, tmp_path / "other.json", head_dim=256)
    with pytest.raises(InputError, match=r"allocator_param: profile .*other.json was fitted on another model "
                       r"geometry \(head_dim 256 in the profile, 16 in the model"):
        run_sequence(model, ctx, q, _tiny_cfg(allocator_params={"profile": str(path)}), answer_ids=a)


@pytest.mark.parametrize("offline", [False, True])
def test_contourkv_on_sliding_layers_and_a_bytes_budget(offline: bool, tmp_path: Path) -> None:
    """Tiny Gemma 3 (layer 0 slides with window 8): a sliding cell never keeps more than
    window - 1; a byte budget is spent exactly (floored to whole entries)."""
    from evictlab.capture.testing import TINY_SLIDING_WINDOW, tiny_model
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import Budget, kv_bytes
    from evictlab.models.geometry import model_geometry

    model, _ = tiny_model("gemma3")
    g = model_geometry(model)
    gen = torch.Generator().manual_seed(3)
    ctx, q, a = (torch.randint(3, 256, (1, n), generator=gen) for n in (120, 4, 8))
    entry = kv_bytes(1, g.head_dim, g.dtype)
    budget = Budget("bytes", 13 * g.cells * entry + entry // 2)  # 52 entries and half of one
    params = {"profile": str(_tiny_profile(model, tmp_path / "p.json"))} if offline else {}
    tr = CompressionTrace(max_subsets=1)
    out = run_sequence(model, ctx, q, _tiny_cfg(budget=budget, allocator_params=params, sinks=1, recent=2),
                       answer_ids=a, compression_trace=tr)
    table = tr.table()
    assert out.compressions >= 3
    assert out.after_compression("bytes_live") == kv_bytes(13 * g.cells, g.head_dim, g.dtype)
    sliding = table.filter(table["layer"] == 0)
    assert (sliding["kept"] <= TINY_SLIDING_WINDOW - 1).all()
    full = table.filter(table["layer"] == 1)
    assert (full["kept"] > TINY_SLIDING_WINDOW - 1).any()  # what sliding cells cannot hold goes elsewhere
