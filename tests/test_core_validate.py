"""Every bad row or batch input raises InputError naming the offending field."""

from __future__ import annotations

import numpy as np
import pytest

from evictlab.core import kernels as K
from evictlab.core import reference as R
from evictlab.core.validate import check_budget, validate_batch, validate_kept, validate_row
from evictlab.errors import InputError

P = np.array([0.5, 0.3, 0.2])
V = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])


def field_of(call) -> str:
    with pytest.raises(InputError) as exc:
        call()
    assert exc.value.fix  # every error says how to fix it
    return exc.value.field


@pytest.mark.parametrize(
    ("p", "values", "field"),
    [
        (np.array([0.5, np.nan, 0.5]), V, "row.p[1]"),
        (np.array([0.5, np.inf, 0.5]), V, "row.p[1]"),
        (P, np.array([[1.0, 0.0], [0.0, np.nan], [1.0, 1.0]]), "row.values[1, 1]"),
        (P, np.array([[1.0, 0.0], [0.0, -np.inf], [1.0, 1.0]]), "row.values[1, 1]"),
        (P, np.array([[1.0, 0.0], [0.0, 1.0], [1e200, 1.0]]), "row.values[2, 0]"),  # would overflow
        (np.array([0.6, 0.3, 0.2]), V, "row.p"),  # sums to 1.1
        (np.array([0.5, 0.3, 0.2 - 2e-6]), V, "row.p"),  # just beyond 1e-6
        (np.array([0.7, -0.1, 0.4]), V, "row.p[1]"),
        (P, V[:2], "row.values"),  # shape mismatch
        (P, V.ravel(), "row.values"),  # wrong ndim
        (P[None, :], V, "row.p"),
        (np.array([]), np.zeros((0, 2)), "row.p"),  # empty row
        (P, np.zeros((3, 0)), "row.values"),  # d = 0
        (np.array(["a", "b", "c"]), V, "row.p"),
    ],
)
def test_bad_row_names_field(p, values, field):
    assert field_of(lambda: validate_row(p, values)) == field
    # the reference functions run the same checks
    assert field_of(lambda: R.dense_output(p, values)) == field


def test_masses_within_tolerance_are_accepted():
    p = np.array([0.5, 0.3, 0.2 + 5e-7], dtype=np.float32)
    out, _ = validate_row(p, V)
    assert out.dtype == np.float64


@pytest.mark.parametrize(
    ("kept", "field"),
    [([], "kept"), ([0, 3], "kept[1]"), ([-1], "kept[0]"), ([1, 1], "kept"), ([0.5], "kept"), ([[0, 1]], "kept")],
)
def test_bad_kept_names_field(kept, field):
    assert field_of(lambda: validate_kept(kept, 3)) == field
    assert field_of(lambda: R.forced_error(P, V, kept)) == field


@pytest.mark.parametrize(("s", "n"), [(0, 3), (-2, 3), (4, 3), (1.5, 3), (True, 3), ("2", 3)])
def test_bad_budget_names_field(s, n):
    assert field_of(lambda: check_budget(s, n, "budget")) == "budget"
    assert field_of(lambda: R.top_mass_set(P, s)) == "s"


def test_bad_pool_extensions():
    assert field_of(lambda: R.candidate_pool(P, V, 1, r_m=-1)) == "r_m"
    assert field_of(lambda: R.candidate_pool(P, V, 1, r_e=1.5)) == "r_e"


# A good two-row batch: rows of 3 and 2 keys sharing one value block.
BP = np.array([0.5, 0.3, 0.2, 0.4, 0.6])
BOFF = np.array([0, 3, 5])
BV = np.arange(8.0).reshape(4, 2)
BVS = np.array([0, 2])


def _with(**kw):
    args = {"p": BP, "p_off": BOFF, "values": BV, "v_start": BVS}
    args.update(kw)
    return args


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (_with(p=np.array([0.5, 0.3, np.nan, 0.4, 0.6])), "p[2]"),
        (_with(p=np.array([0.5, 0.3, 0.2, -0.4, 1.4])), "p[3]"),
        (_with(p=np.array([0.5, 0.3, 0.2, 0.4, 0.7])), "p (row 1)"),
        (_with(values=np.where(np.arange(8.0).reshape(4, 2) == 5, np.inf, BV)), "values[2, 1]"),
        (_with(p_off=np.array([0])), "p_off"),  # no rows
        (_with(p_off=np.array([1, 3, 5])), "p_off[0]"),
        (_with(p_off=np.array([0, 3, 4])), "p_off[2]"),  # does not cover p
        (_with(p_off=np.array([0, 3, 3, 5]), v_start=np.array([0, 0, 2])), "p_off[2]"),  # empty row 1
        (_with(p_off=np.array([0, 4, 3, 5]), v_start=np.array([0, 0, 2])), "p_off[2]"),  # decreasing
        (_with(v_start=np.array([0, 3])), "v_start[1]"),  # reads past the values
        (_with(v_start=np.array([-1, 2])), "v_start[0]"),
        (_with(v_start=np.array([0])), "v_start"),
        (_with(values=np.arange(8.0)), "values"),
    ],
)
def test_bad_batch_names_field(args, field):
    assert field_of(lambda: validate_batch(**args)) == field
    assert field_of(lambda: K.batch_dense_output(args["p"], args["p_off"], args["values"], args["v_start"])) == field


@pytest.mark.parametrize(
    ("kept", "field"),
    [
        (np.array([[0, 1, 3], [0, -1, -1]]), "kept[0, 2]"),  # 3 >= n_0
        (np.array([[0, 1, -1], [2, -1, -1]]), "kept[1, 0]"),  # 2 >= n_1
        (np.array([[0, -2, -1], [0, -1, -1]]), "kept[0, 1]"),
        (np.array([[-1, -1, -1], [0, -1, -1]]), "kept[0]"),  # empty
        (np.array([[1, 1, -1], [0, -1, -1]]), "kept[0]"),  # repeated
        (np.array([[0, 1, -1]]), "kept"),  # one row for a two-row batch
        (np.array([0, 1]), "kept"),  # 1-D
    ],
)
def test_bad_batch_kept_names_field(kept, field):
    assert field_of(lambda: K.batch_forced_error(BP, BOFF, BV, BVS, kept)) == field
    assert field_of(lambda: K.batch_dropped_mass(BP, BOFF, kept)) == field
    assert field_of(lambda: K.batch_free_weight_error(BP, BOFF, BV, BVS, kept)) == field


def test_good_batch_passes_and_converts():
    b = validate_batch(BP.astype(np.float32), BOFF.astype(np.int32), BV, BVS.tolist())
    assert b.p.dtype == np.float64 and b.p_off.dtype == np.int64 and b.v_start.dtype == np.int64
    assert K.batch_top_mass(BP, BOFF, 2).tolist() == [[0, 1], [1, 0]]
