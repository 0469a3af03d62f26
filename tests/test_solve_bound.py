"""The lower bound on ES(s) at any n (solve/bound.py) against independent exact methods.

* the bound never exceeds the brute-force optimum (itertools over all keys), at every node
  limit, and equals it when the search closes;
* each node's bound never exceeds the best completion of that node, is at most the exact
  continuous relaxation (the min-norm point of the hull of every completion's m_A - mu,
  enumerated and solved by scipy's NNLS) and reaches it on these small nodes, and the
  relaxation is at least the certificate's axis and direction bounds at the same node;
* ``evictlab solve --bound`` end to end: columns, the chain es_lb <= ES <= es_bb, agreement
  with the certificate, the other columns unchanged, refusals.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import nnls

from evictlab.errors import InputError
from evictlab.rows.synth import SynthConfig, synthesize
from evictlab.solve import reference as sref
from evictlab.solve.bound import (
    STATUS_CLOSED, batch_bound, bound_search, bound_setup, node_bound,
)
from evictlab.solve.certify import CERT_REL_TOL, _node_lb, certify_setup
from evictlab.solve.runner import BOUND_COLUMNS, RESULT_COLUMNS, SolveConfig, check_config

EVICTLAB = str(Path(sys.executable).with_name("evictlab"))


def _instance(seed: int, n: int, d: int, ties: bool, dup: bool, zero: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(n, 0.6))
    if ties:
        p = np.round(p * 6) + 1.0
    if zero and n >= 3:
        p[0] = 0.0  # a key without mass (sets of such keys have no forced output)
    p = p / p.sum()
    V = rng.integers(-3, 4, size=(n, d)).astype(float) if ties else rng.normal(size=(n, d))
    if dup and n >= 3:
        V[2] = V[1]
    return p, V


instances = st.builds(
    _instance, seed=st.integers(0, 10_000), n=st.integers(1, 10), d=st.integers(1, 4),
    ties=st.booleans(), dup=st.booleans(), zero=st.booleans(),
)


def _scale(V: np.ndarray) -> float:
    return max(1.0, float(np.abs(V).max()))


@given(inst=instances, s=st.integers(1, 10), limit=st.sampled_from([1, 2, 3, 7, 25, 10**5]))
@settings(max_examples=120, deadline=None)
def test_bound_never_above_bruteforce_and_equal_when_closed(inst, s, limit) -> None:
    p, V = inst
    n = p.shape[0]
    s = min(s, n)
    bf, _ = sref.all_keys_bruteforce(p, V, s)
    tol = 1e-12 * _scale(V)
    lb, ub, kept, status, nodes = bound_search(p, V, bound_setup(p, V), s, -np.ones((1, s), dtype=np.int64), limit)
    assert 0.0 <= lb <= bf * (1 + 1e-12) + tol
    assert nodes <= max(limit, 1)
    assert ub >= bf - tol  # the search's best set is a feasible set, exactly recomputed
    assert sref.forced_error(p, V, kept) == pytest.approx(ub, rel=1e-12, abs=1e-14 * _scale(V))
    if status == STATUS_CLOSED:
        assert ub == pytest.approx(bf, rel=1e-8, abs=tol)
        assert lb >= ub * (1 - 2 * CERT_REL_TOL) - tol
    if limit == 10**5:  # enough nodes to enumerate these rows: the search always closes
        assert status == STATUS_CLOSED


def _exact_relaxation(pw: np.ndarray, Y: np.ndarray, F: list[int], j: int, k: int) -> tuple[float, float]:
    """dist(0, conv{(S_F + S_K) / (P_F + P_K)}) over every k-subset K of the suffix, bracketed.

    scipy's NNLS on the augmented system gives the weights; for ``y`` their point,
    ``[max(0, min_i <y, q_i>) / ||y||, ||y||]`` contains the distance (separating hyperplane).
    """
    pts = []
    for K in itertools.combinations(range(j, Y.shape[0]), k):
        A = list(F) + list(K)
        P = pw[A].sum()
        if P > 0:
            pts.append(Y[A].sum(0) / P)
    Q = np.array(pts)
    M = 1e3 * (1.0 + np.abs(Q).max())
    w, _ = nnls(np.vstack([Q.T, M * np.ones((1, Q.shape[0]))]), np.concatenate([np.zeros(Q.shape[1]), [M]]))
    y = Q.T @ (w / w.sum())
    ub = float(np.linalg.norm(y))
    lo = max(0.0, float((Q @ y).min())) / ub if ub > 0 else 0.0
    return lo, ub


def _best_completion(pw: np.ndarray, Y: np.ndarray, F: list[int], j: int, k: int) -> float:
    best = np.inf
    for K in itertools.combinations(range(j, Y.shape[0]), k):
        A = list(F) + list(K)
        P = pw[A].sum()
        if P > 0:
            best = min(best, float(np.linalg.norm(Y[A].sum(0))) / P)
    return best


@given(seed=st.integers(0, 10_000), n=st.integers(4, 9), d=st.integers(1, 4), data=st.data())
@settings(max_examples=80, deadline=None)
def test_node_bound_is_the_relaxation_and_dominates_the_certificates_bounds(seed, n, d, data) -> None:
    p, V = _instance(seed, n, d, False, False, False)
    mu, order, Y, pw, SY, SP = bound_setup(p, V)
    s = data.draw(st.integers(2, n - 1))
    j = data.draw(st.integers(0, n - s))
    f = data.draw(st.integers(0, min(j, s - 2)))  # k = s - f >= 2: the relaxation's nodes
    F = sorted(data.draw(st.lists(st.integers(0, j - 1), min_size=f, max_size=f, unique=True))) if j else []
    k = s - len(F)
    if n - j < k or k < 2 or n - j == k:
        return
    Farr = np.zeros(s, dtype=np.int64)
    Farr[:len(F)] = F
    best_set = np.zeros(s, dtype=np.int64)
    lb, exact, e_best = node_bound(Y, pw, SY, SP, Farr, len(F), j, k, np.inf, np.zeros(Y.shape[1]),
                                   np.zeros(Y.shape[1]), best_set)
    assert not exact
    tol = 1e-12 * max(1.0, float(np.abs(Y).max()) / max(pw.min(), 1e-300))
    best = _best_completion(pw, Y, F, j, k)
    relax_lo, relax_hi = _exact_relaxation(pw, Y, F, j, k)
    assert relax_hi >= relax_lo * (1 - 1e-12) and relax_hi - relax_lo <= 1e-5 * relax_hi + tol
    assert lb <= best * (1 + 1e-12) + tol
    assert relax_lo <= best * (1 + 1e-9) + tol
    assert lb <= relax_hi * (1 + 1e-9) + tol  # a dual bound of the relaxation
    assert lb >= relax_lo * (1 - 1e-4) - tol  # ... and it solves it on these nodes
    assert e_best >= best * (1 - 1e-12) - tol  # the oracle's completion is a real set
    # the certificate's bounds at the same node (same order and coordinates)
    cs = certify_setup(p, V, s)
    assert np.array_equal(cs[1], order) and np.array_equal(cs[2], Y)
    G = cs[4]
    S = Y[F].sum(0) if F else np.zeros(Y.shape[1])
    R = G[F].sum(0) if F else np.zeros(n)
    w, buf, idx = np.empty(n), np.empty(k), np.empty(k, dtype=np.int64)
    cert = _node_lb(S, float(pw[F].sum()), R, float(S @ S), j, k, pw, cs[5], cs[6], cs[7], w, buf, idx)
    assert relax_hi >= cert * (1 - 1e-9) - tol
    assert lb >= cert * (1 - 1e-4) - tol


def test_node_bound_solves_the_relaxation_without_an_incumbent() -> None:
    """With no incumbent (``thr = inf``) Wolfe's iteration still runs to the gap: the stop
    'below BOUND_SMALL of the incumbent' once fired on ``ny <= 1e-3 * inf`` after one cycle
    (hypothesis found it: this instance gave 0.5753 against the relaxation's 0.5815)."""
    p, V = _instance(0, 4, 2, False, False, False)
    _, _, Y, pw, SY, SP = bound_setup(p, V)
    j, k = 1, 2
    lb, exact, _ = node_bound(Y, pw, SY, SP, np.zeros(k, dtype=np.int64), 0, j, k, np.inf, np.zeros(Y.shape[1]),
                              np.zeros(Y.shape[1]), np.zeros(k, dtype=np.int64))
    relax_lo, relax_hi = _exact_relaxation(pw, Y, [], j, k)
    assert not exact and relax_lo * (1 - 1e-4) <= lb <= relax_hi * (1 + 1e-9)


def test_bound_is_informative_on_long_rows_with_a_sink() -> None:
    """n = 300, a sink holding most of the mass with a distant value (the shape of real rows):
    the root relaxation is 0, yet 64 nodes bound ES(s) to within 10% of the best set found."""
    rows = []
    rng = np.random.default_rng(3)
    for _ in range(6):
        n, d = 300, 8
        logits = rng.normal(size=n)
        logits[0] = np.log(n)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        V = rng.normal(size=(n, d))
        V[0] += 6.0
        rows.append((p, V))
    p = np.concatenate([r[0] for r in rows])
    V = np.concatenate([r[1] for r in rows])
    off = np.cumsum([0] + [r[0].shape[0] for r in rows])
    bud = np.array([4, 8], dtype=np.int64)
    seeds = -np.ones((1, len(rows), 2, 8), dtype=np.int64)
    lb, ub, status, nodes = batch_bound(p, off, V, off[:-1].copy(), bud, seeds, 64)
    assert (nodes <= 64).all()
    assert (lb <= ub).all()
    assert (lb >= 0.9 * ub).all()
    for r, (pr, Vr) in enumerate(rows):  # the root alone: 0 (one node, the relaxation at the root)
        l1, _, _, _, n1 = bound_search(pr, Vr, bound_setup(pr, Vr), 4, -np.ones((1, 4), dtype=np.int64), 1)
        assert n1 == 1 and l1 == 0.0


def test_bound_nodes_is_checked() -> None:
    for bad in (0, -1, 10**6, True, 2.5):
        with pytest.raises(InputError, match="--bound-nodes"):
            check_config(SolveConfig(budgets=(2,), bound=True, bound_nodes=bad), 10, 10)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bound") / "rows"
    synthesize(path, SynthConfig(rows=30, keys=24, dim=5, seed=11, rows_per_block=10, spread=0.4))
    return path


def test_cli_bound_columns_and_chain(rows: Path, tmp_path: Path) -> None:
    plain, out = tmp_path / "plain.parquet", tmp_path / "bound.parquet"
    base = [EVICTLAB, "solve", str(rows), "--keep", "2", "4", "--threads", "1", "--quiet"]
    r = subprocess.run(base + ["--out", str(plain)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(base + ["--certify", "--bound", "--bound-nodes", "200", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    a, b = pl.read_parquet(plain), pl.read_parquet(out)
    assert a.columns == list(RESULT_COLUMNS)
    assert b.columns[-len(BOUND_COLUMNS):] == list(BOUND_COLUMNS)
    assert b.select(a.columns).equals(a)  # --bound adds columns, changes none
    assert (b["lb_nodes"] <= 200).all() and (b["lb_nodes"] >= 1).all()
    assert set(b["lb_status"].unique()) <= {"closed", "limit"}
    assert (b["es_lb"] <= b["es_bb"]).all() and (b["es_bb"] <= b["es_hat"]).all()
    opt = b.filter(pl.col("cert_status") == "optimal")
    assert opt.height > 0
    assert (opt["es_lb"] <= opt["es_cert"] * (1 + 1e-12)).all()  # never above the proved optimum
    assert (opt["es_bb"] >= opt["cert_lb"]).all()
    closed = opt.filter(pl.col("lb_status") == "closed")
    assert closed.height > 0
    np.testing.assert_allclose(closed["es_lb"], closed["es_cert"], rtol=1e-8)
    live = b.filter(~pl.col("e_top_zero"))
    assert (live["gap_closed_ub"] >= live["gap_closed_bb"]).all()
    assert (live["gap_closed_bb"] >= live["gap_closed"] - 1e-12).all()
    np.testing.assert_allclose(live["gap_closed_ub"], (live["e_top"] - live["es_lb"]) / live["e_top"], rtol=1e-12)


@pytest.mark.parametrize("args, match", [
    (["--bound", "--bound-nodes", "0"], "--bound-nodes"),
    (["--bound", "--bound-nodes", "1000001"], "--bound-nodes"),
    (["--bound-nodes", "10"], "--bound"),
])
def test_cli_bad_bound_nodes_is_one_line_exit_2(rows: Path, tmp_path: Path, args: list[str], match: str) -> None:
    out = tmp_path / "x.parquet"
    r = subprocess.run([EVICTLAB, "solve", str(rows), "--keep", "2", *args, "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    err = r.stderr.strip()
    assert match in err and "Traceback" not in r.stderr and len(err.splitlines()) == 1
    assert not out.exists()


def test_batch_bound_is_deterministic_across_threads_and_batches() -> None:
    import numba

    rng = np.random.default_rng(8)
    rows = [(rng.dirichlet(np.full(n, 0.3)), rng.normal(size=(n, 4))) for n in (30, 45, 60, 33)]
    p = np.concatenate([r[0] for r in rows])
    V = np.concatenate([r[1] for r in rows])
    off = np.cumsum([0] + [r[0].shape[0] for r in rows])
    bud = np.array([3, 6], dtype=np.int64)
    seeds = -np.ones((1, len(rows), 2, 6), dtype=np.int64)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = batch_bound(p, off, V, off[:-1].copy(), bud, seeds, 40)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = batch_bound(p, off, V, off[:-1].copy(), bud, seeds, 40)
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one, two):
        assert np.array_equal(a, b)
    # a row's bound does not depend on the other rows of the batch
    alone = batch_bound(p[off[2]:off[3]], np.array([0, off[3] - off[2]]), V[off[2]:off[3]], np.array([0]), bud,
                        seeds[:, 2:3], 40)
    assert np.array_equal(alone[0][0], one[0][2]) and np.array_equal(alone[3][0], one[3][2])
