"""Property tests of the row format round trip, and the batch contract with evictlab.core."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from evictlab.rows.batch import RowBatch
from evictlab.rows.reader import RowStore
from evictlab.rows.synth import SynthConfig, synthesize
from evictlab.rows.writer import RowWriter


@st.composite
def datasets(draw):
    """A random dataset spec: prompts -> blocks -> query/logits row groups, and read knobs."""
    d = draw(st.integers(1, 5))
    prompts = []
    for _ in range(draw(st.integers(1, 4))):
        blocks = []
        for _ in range(draw(st.integers(0, 3))):
            L = draw(st.integers(1, 9))
            with_keys = draw(st.booleans())
            groups = []
            for _ in range(draw(st.integers(0, 3))):
                R = draw(st.integers(1, 4))
                ranges = [tuple(sorted(draw(st.lists(st.integers(0, L), min_size=2, max_size=2,
                                                     unique=True)))) for _ in range(R)]
                kind = "query" if with_keys and draw(st.booleans()) else "logits"
                groups.append((kind, ranges))
            blocks.append((L, with_keys, groups))
        prompts.append(blocks)
    return dict(d=d, prompts=prompts, seed=draw(st.integers(0, 2**31)),
                rows_per_shard=draw(st.integers(1, 12)), max_rows=draw(st.integers(1, 15)),
                logit_dtype=draw(st.sampled_from([np.float32, np.float64])))


def _write(path: Path, spec: dict) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Write ``spec``; return per row (p reference, values, key positions) in row order."""
    rng = np.random.default_rng(spec["seed"])
    d = spec["d"]
    expected = []
    with RowWriter(path, model="prop", capture_mode="query-aware", head_dim=d,
                   rows_per_shard=spec["rows_per_shard"]) as w:
        for pid, blocks in enumerate(spec["prompts"]):
            w.add_prompt(pid * 3, rng.integers(0, 1000, size=rng.integers(0, 5)))
            for layer, (L, with_keys, groups) in enumerate(blocks):
                K = rng.standard_normal((L, d)).astype(np.float32)
                V = rng.standard_normal((L, d)).astype(np.float32)
                pos = rng.integers(-1, 10_000, size=L)
                b = w.add_block(pid * 3, layer, 0, K if with_keys else None, V, pos)
                for kind, ranges in groups:
                    lo = np.array([r[0] for r in ranges])
                    hi = np.array([r[1] for r in ranges])
                    R = len(ranges)
                    if kind == "query":
                        Q = (3 * rng.standard_normal((R, d))).astype(np.float32)
                        scale = float(rng.uniform(0.1, 2.0))
                        w.add_query_rows(b, Q, np.arange(R), np.full(R, -1), lo, hi, scale)
                        zs = [scale * (K[a:c].astype(np.float64) @ Q[r].astype(np.float64))
                              for r, (a, c) in enumerate(ranges)]
                    else:
                        zs = [(4 * rng.standard_normal(c - a)).astype(spec["logit_dtype"])
                              for a, c in ranges]
                        w.add_logit_rows(b, zs, np.arange(R), np.full(R, -1), lo, hi)
                    for z, (a, c) in zip(zs, ranges):
                        z = np.asarray(z, np.float64)
                        e = np.exp(z - z.max())
                        expected.append((e / e.sum(), V[a:c].astype(np.float64), pos[a:c]))
            w.end_prompt(pid * 3)
    return expected


def _check(batch: RowBatch, expected: list) -> None:
    for i in range(batch.n_rows):
        p_ref, v_ref, k_ref = expected[int(batch.meta["row_id"][i])]
        p, v = batch.row(i)
        np.testing.assert_allclose(p, p_ref, rtol=1e-12, atol=1e-300)
        assert np.array_equal(v, v_ref)
        assert np.array_equal(batch.key_index[batch.p_off[i]:batch.p_off[i + 1]], k_ref)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=datasets())
def test_round_trip_property(spec: dict) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rows_prop_"))
    try:
        expected = _write(tmp / "ds", spec)
        event(f"rows: {'0' if not expected else '1-9' if len(expected) < 10 else '10+'}")
        if not expected:
            return
        store = RowStore.open(tmp / "ds")
        assert store.n_rows == len(expected)
        batches = list(store.iter_batches(max_rows=spec["max_rows"]))
        whole = RowBatch.concat(batches)
        assert whole.meta["row_id"].to_list() == list(range(len(expected)))
        _check(whole, expected)
        # the same rows read in one batch have the same bits (p does not depend on batching)
        one = next(store.iter_batches(max_rows=len(expected)))
        assert np.array_equal(one.p, whole.p)
        order = np.random.default_rng(spec["seed"]).permutation(len(expected))[:5]
        got = store.get_rows(order)
        assert got.meta["row_id"].to_list() == order.tolist()
        _check(got, expected)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("kind", ["query", "logits"])
def test_batches_satisfy_core_contract(tmp_path: Path, kind: str) -> None:
    """Every batch the store yields passes evictlab.core's own ragged-batch validation."""
    validate_batch = pytest.importorskip("evictlab.core.validate").validate_batch
    synthesize(tmp_path / "s", SynthConfig(rows=300, keys=50, dim=8, seed=3, kind=kind,
                                           rows_per_block=40, rows_per_shard=100))
    n = 0
    for b in RowStore.open(tmp_path / "s").iter_batches(max_rows=64):
        validate_batch(b.p, b.p_off, b.values, b.v_start)
        n += b.n_rows
    assert n == 300
