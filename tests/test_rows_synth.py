"""The seeded synthetic row generator: determinism, structure and peakedness knobs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.rows.batch import RowBatch
from evictlab.rows.reader import RowStore
from evictlab.rows.synth import SynthConfig, synthesize


def _all(path: Path) -> RowBatch:
    return RowBatch.concat(list(RowStore.open(path).iter_batches(max_rows=100_000)))


def _rows_p(b: RowBatch) -> list[np.ndarray]:
    return [b.p[b.p_off[i]:b.p_off[i + 1]] for i in range(b.n_rows)]


def _shards(path: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((path / "manifest.json").read_text())["shards"]]


@pytest.mark.parametrize("kind", ["query", "logits"])
def test_same_seed_same_files(tmp_path: Path, kind: str) -> None:
    cfg = SynthConfig(rows=300, keys=40, dim=8, seed=11, kind=kind, rows_per_block=64,
                      rows_per_shard=100, values="clustered")
    synthesize(tmp_path / "a", cfg)
    synthesize(tmp_path / "b", cfg)
    assert _shards(tmp_path / "a") == _shards(tmp_path / "b")  # byte-identical shards
    for name in ("index.parquet", "prompts.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    a, b = _all(tmp_path / "a"), _all(tmp_path / "b")
    assert np.array_equal(a.p, b.p) and np.array_equal(a.values, b.values)
    synthesize(tmp_path / "c", SynthConfig(**{**cfg.__dict__, "seed": 12}))
    assert _shards(tmp_path / "c") != _shards(tmp_path / "a")


def test_structure_blocks_prefixes_and_metadata(tmp_path: Path) -> None:
    synthesize(tmp_path / "s", SynthConfig(rows=250, keys=30, dim=4, seed=0, rows_per_block=100,
                                           spread=0.5))
    store = RowStore.open(tmp_path / "s")
    m = store.meta
    assert store.n_rows == 250 and store.manifest["counts"]["blocks"] == 3
    assert m["n"].min() >= 15 and m["n"].max() <= 30
    assert (m["key_lo"] == 0).all() and (m["position"] == -1).all()
    assert m["prompt_id"].to_list() == [0] * 100 + [1] * 100 + [2] * 50
    assert store.prompts["tokens"].to_list() == [[], [], []]
    assert store.manifest["capture_mode"] == "synthetic"
    assert store.manifest["source"]["seed"] == 0
    b = _all(tmp_path / "s")
    assert (b.key_index == -1).all()
    assert b.values.shape[0] == int(m.group_by("block").agg(pl.col("n").max())["n"].sum())
    np.testing.assert_allclose(np.add.reduceat(b.p, b.p_off[:-1]), 1.0, rtol=0, atol=1e-12)
    synthesize(tmp_path / "fixed", SynthConfig(rows=10, keys=7, dim=4, seed=0, spread=0.0))
    assert set(RowStore.open(tmp_path / "fixed").meta["n"].to_list()) == {7}


def _mean_top(path: Path) -> float:
    return float(np.mean([r.max() for r in _rows_p(_all(path))]))


def test_peakedness_knobs(tmp_path: Path) -> None:
    base = dict(rows=200, keys=100, dim=16, seed=5, rows_per_block=50, spread=0.0)
    synthesize(tmp_path / "peak", SynthConfig(**base, kind="logits", alpha=0.05))
    synthesize(tmp_path / "flat", SynthConfig(**base, kind="logits", alpha=50.0))
    assert _mean_top(tmp_path / "peak") > 0.2
    assert _mean_top(tmp_path / "flat") < 0.05
    synthesize(tmp_path / "cold", SynthConfig(**base, temperature=0.2, sinks=0))
    synthesize(tmp_path / "hot", SynthConfig(**base, temperature=4.0, sinks=0))
    assert _mean_top(tmp_path / "cold") > 5 * _mean_top(tmp_path / "hot")
    # tiny alpha must not underflow to log(0): every stored logit is finite
    synthesize(tmp_path / "tiny", SynthConfig(**base, kind="logits", alpha=1e-4))
    assert np.isfinite(_all(tmp_path / "tiny").p).all()


def test_dirichlet_moments(tmp_path: Path) -> None:
    """Dirichlet(alpha 1_n): E p_i = 1/n, Var p_i = (1/n)(1 - 1/n) / (n alpha + 1)."""
    n, alpha = 20, 0.5
    synthesize(tmp_path / "d", SynthConfig(rows=4000, keys=n, dim=2, seed=9, kind="logits",
                                           alpha=alpha, spread=0.0, rows_per_block=1000))
    P = np.stack(_rows_p(_all(tmp_path / "d")))
    var = (1 / n) * (1 - 1 / n) / (n * alpha + 1)
    assert abs(P.mean() - 1 / n) < 1e-12
    assert abs(P.var() / var - 1) < 0.05


def test_sinks_and_recency(tmp_path: Path) -> None:
    base = dict(rows=200, keys=64, dim=16, seed=2, rows_per_block=50, spread=0.0,
                temperature=1.0)
    synthesize(tmp_path / "sink", SynthConfig(**base, sinks=2, sink_boost=6.0))
    synthesize(tmp_path / "none", SynthConfig(**base, sinks=0))
    synthesize(tmp_path / "rec", SynthConfig(**base, sinks=0, recency=6.0))
    P = np.stack(_rows_p(_all(tmp_path / "sink")))
    P0 = np.stack(_rows_p(_all(tmp_path / "none")))
    Pr = np.stack(_rows_p(_all(tmp_path / "rec")))
    assert P[:, :2].mean() > 20 * P[:, 2:].mean()  # boost e^6 ~ 400 on the two sinks
    assert P0[:, :2].mean() < 3 * P0[:, 2:].mean()
    assert Pr[:, -8:].sum(axis=1).mean() > 20 * Pr[:, :8].sum(axis=1).mean()


def test_clustered_values_form_clusters(tmp_path: Path) -> None:
    for mode in ("clustered", "gaussian"):
        synthesize(tmp_path / mode, SynthConfig(rows=40, keys=60, dim=8, seed=1, spread=0.0,
                                                values=mode, clusters=4 if mode == "clustered" else None))
    def components(v: np.ndarray) -> int:
        dist = np.linalg.norm(v[:, None] - v[None], axis=-1)
        label = np.arange(len(v))
        for _ in range(len(v)):  # label propagation over the "closer than 2.0" graph
            label = np.where(dist < 2.0, label[None, :], len(v)).min(axis=1)
        return len(np.unique(label))
    assert components(_all(tmp_path / "clustered").values) <= 4
    assert components(_all(tmp_path / "gaussian").values) > 20


@pytest.mark.parametrize("kwargs, field", [
    (dict(rows=0), "--count"),
    (dict(keys=0), "--keys"),
    (dict(dim=-1), "--dim"),
    (dict(seed=-3), "--seed"),
    (dict(kind="mixed"), "--kind"),
    (dict(values="uniform"), "--values"),
    (dict(alpha=1.0), "--alpha"),                 # query kind: alpha does not apply
    (dict(kind="logits", temperature=1.0), "--temperature"),
    (dict(kind="logits", alpha=0.0), "--alpha"),
    (dict(temperature=0.0), "--temperature"),
    (dict(sinks=99), "--sinks"),
    (dict(dim=1), "--dim"),                      # d=1 cannot hold a separate sink direction
    (dict(spread=1.0), "--spread"),
    (dict(rows_per_block=0), "--rows-per-block"),
])
def test_bad_knobs_name_the_flag(tmp_path: Path, kwargs: dict, field: str) -> None:
    cfg = SynthConfig(**{**dict(rows=10, keys=8, dim=4, seed=0), **kwargs})
    with pytest.raises(InputError) as ei:
        synthesize(tmp_path / "x", cfg)
    assert ei.value.field == field
    assert not (tmp_path / "x").exists()


def test_existing_output_same_settings_is_kept_other_settings_refused(tmp_path: Path) -> None:
    cfg = SynthConfig(rows=5, keys=4, dim=4, seed=0)
    synthesize(tmp_path / "x", cfg)
    before = (tmp_path / "x" / "manifest.json").read_bytes()
    assert synthesize(tmp_path / "x", cfg).already_complete
    assert (tmp_path / "x" / "manifest.json").read_bytes() == before
    with pytest.raises(InputError, match="--out.*different settings.*--seed: 0 there, 1 now"):
        synthesize(tmp_path / "x", SynthConfig(rows=5, keys=4, dim=4, seed=1))
