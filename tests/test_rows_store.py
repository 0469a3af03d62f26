"""Round trip, streaming and resume of the row dataset (evictlab.rows.writer, evictlab.rows.reader)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.rows.batch import RowBatch
from evictlab.rows.reader import RowStore
from evictlab.rows.schema import META_COLUMNS
from evictlab.rows.writer import RowWriter

D = 6


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def _write_mixed(path: Path, seed: int = 0, rows_per_shard: int = 5, prompts=(0, 1, 2, 3)):
    """Write a small dataset with query rows (prefixes and sliding windows) and logits rows
    (float32 and float64); return the expected per-row (p, values, key_index, meta)."""
    rng = np.random.default_rng(seed)
    expected = []
    with RowWriter(path, model="toy", capture_mode="query-agnostic", head_dim=D,
                   source={"test": True}, rows_per_shard=rows_per_shard) as w:
        for pid in prompts:
            L = 7 + pid
            w.add_prompt(pid, list(range(100 + pid, 100 + pid + L)), source="toy", text=f"p{pid}")
            for layer in (0, 3):
                for kv in (0, 1):
                    K = rng.standard_normal((L, D)).astype(np.float32)
                    V = rng.standard_normal((L, D)).astype(np.float32)
                    pos = np.arange(L, dtype=np.int64) + 10
                    b = w.add_block(pid, layer, kv, K, V, pos)
                    # causal prefixes and one sliding window [2, L)
                    lo = np.array([0, 0, 2])
                    hi = np.array([1, L - 1, L])
                    q = rng.standard_normal((3, D)).astype(np.float32)
                    qh = np.array([2 * kv, 2 * kv + 1, 2 * kv])
                    qpos = hi + 9
                    scale = 0.5
                    w.add_query_rows(b, q, qh, qpos, lo, hi, scale)
                    for r in range(3):
                        z = scale * (K[lo[r]:hi[r]].astype(np.float64) @ q[r].astype(np.float64))
                        expected.append(dict(
                            p=_softmax(z), values=V[lo[r]:hi[r]].astype(np.float64),
                            key_index=pos[lo[r]:hi[r]],
                            meta=(pid, layer, int(qh[r]), kv, int(qpos[r]), int(hi[r] - lo[r]))))
                    if layer == 3:  # logits rows reading the same block
                        lg = [rng.standard_normal(L).astype(np.float32),
                              rng.standard_normal(3).astype(np.float64)]
                        w.add_logit_rows(b, lg, [5, 6], [-1, -1], key_lo=[0, 4], key_hi=[L, 7])
                        for r, (a, c) in enumerate(((0, L), (4, 7))):
                            expected.append(dict(
                                p=_softmax(lg[r].astype(np.float64)),
                                values=V[a:c].astype(np.float64), key_index=pos[a:c],
                                meta=(pid, layer, 5 + r, kv, -1, c - a)))
            w.end_prompt(pid)
    return expected


def _check_rows(batch: RowBatch, expected: list[dict], first_row: int) -> None:
    assert list(batch.meta.columns[:7]) == list(META_COLUMNS)
    for i in range(batch.n_rows):
        rid = int(batch.meta["row_id"][i])
        exp = expected[rid]
        p, v = batch.row(i)
        np.testing.assert_allclose(p, exp["p"], rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(v, exp["values"])  # float32 -> float64 is exact
        lo, hi = batch.p_off[i], batch.p_off[i + 1]
        np.testing.assert_array_equal(batch.key_index[lo:hi], exp["key_index"])
        assert tuple(batch.meta.row(i)[1:7]) == exp["meta"]
    assert batch.p.dtype == np.float64 and batch.values.dtype == np.float64
    assert batch.p_off.dtype == np.int64 and batch.v_start.dtype == np.int64
    assert batch.key_index.dtype == np.int64


def test_round_trip_exact(tmp_path: Path) -> None:
    expected = _write_mixed(tmp_path / "ds")
    store = RowStore.open(tmp_path / "ds")
    assert store.n_rows == len(expected)
    assert store.manifest["counts"]["prompts"] == 4
    assert len(store.manifest["shards"]) >= 2  # rows_per_shard=5 forces one shard per prompt
    batches = list(store.iter_batches(max_rows=10_000))
    assert len(batches) == 1
    _check_rows(batches[0], expected, 0)
    assert batches[0].meta["row_id"].to_list() == list(range(len(expected)))
    # prompts: tokens and metadata survive
    pr = store.prompts.sort("prompt_id")
    assert pr["tokens"][2].to_list() == list(range(102, 111))
    assert pr["text"].to_list() == ["p0", "p1", "p2", "p3"]
    assert pr["mode"].to_list() == ["query-agnostic"] * 4
    assert store.manifest["source"] == {"test": True}
    assert store.verify()["rows"] == len(expected)


def test_values_shared_per_block_not_per_row(tmp_path: Path) -> None:
    _write_mixed(tmp_path / "ds", prompts=(0,))
    store = RowStore.open(tmp_path / "ds")
    b = next(store.iter_batches(max_rows=1000))
    # 4 blocks of 7 keys, rows read them through v_start, not copies
    assert b.values.shape == (4 * 7, D)
    assert b.n_rows == 4 * 3 + 2 * 2


@pytest.mark.parametrize("max_rows", [1, 3, 7, 16, 1000])
def test_streaming_crosses_shards(tmp_path: Path, max_rows: int) -> None:
    expected = _write_mixed(tmp_path / "ds", rows_per_shard=3)
    store = RowStore.open(tmp_path / "ds")
    seen = []
    sizes = []
    for b in store.iter_batches(max_rows=max_rows):
        _check_rows(b, expected, 0)
        seen += b.meta["row_id"].to_list()
        sizes.append(b.n_rows)
    assert seen == list(range(len(expected)))
    assert all(s == max_rows for s in sizes[:-1]) and 1 <= sizes[-1] <= max_rows


def test_filter_columns_keys_and_get_rows(tmp_path: Path) -> None:
    expected = _write_mixed(tmp_path / "ds")
    store = RowStore.open(tmp_path / "ds")
    got = list(store.iter_batches(max_rows=4, filter=pl.col("layer") == 3,
                                  columns=["kind", "shard"]))
    meta = pl.concat([b.meta for b in got])
    assert set(meta["layer"].to_list()) == {3}
    assert "kind" in meta.columns and "shard" in meta.columns
    want = store.meta.filter(pl.col("layer") == 3)["row_id"].to_list()
    assert meta["row_id"].to_list() == want
    for b in got:
        _check_rows(b, expected, 0)
        assert b.keys is None  # not requested
    qb = next(store.iter_batches(max_rows=3, filter=pl.col("kind") == "query", with_keys=True))
    assert qb.keys is not None and qb.keys.shape == qb.values.shape
    ids = [17, 0, 40, 3]
    g = store.get_rows(ids)
    assert g.meta["row_id"].to_list() == ids
    _check_rows(g, expected, 0)
    with pytest.raises(InputError, match="row_ids"):
        store.get_rows([10_000])
    with pytest.raises(InputError, match="max_rows"):
        next(store.iter_batches(max_rows=0))
    with pytest.raises(InputError, match="columns"):
        next(store.iter_batches(columns=["nope"]))


def test_take_and_concat_preserve_rows(tmp_path: Path) -> None:
    expected = _write_mixed(tmp_path / "ds")
    store = RowStore.open(tmp_path / "ds")
    a, b = list(store.iter_batches(max_rows=20))[:2]
    c = RowBatch.concat([b, a]).take([25, 0, 3])
    _check_rows(c, expected, 0)
    assert c.meta["row_id"].to_list() == [5, 20, 23]


def test_resume_continues_without_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "ds"
    rng = np.random.default_rng(3)

    def add(w: RowWriter, pid: int, fail: bool = False) -> None:
        w.add_prompt(pid, [pid])
        b = w.add_block(pid, 0, 0, rng.standard_normal((4, D)), rng.standard_normal((4, D)),
                        np.arange(4))
        w.add_query_rows(b, rng.standard_normal((2, D)), [0, 1], [3, 3], [0, 0], [4, 4], 1.0)
        if fail:
            raise RuntimeError("simulated crash inside a prompt")
        w.end_prompt(pid)

    with RowWriter(path, model="toy", capture_mode="query-aware", head_dim=D,
                   rows_per_shard=1) as w:
        for pid in range(3):
            add(w, pid)
    with pytest.raises(RuntimeError):
        with RowWriter(path, model="toy", capture_mode="query-aware", head_dim=D) as w:
            assert w.completed_prompts == {0, 1, 2}
            add(w, 3)
            add(w, 4, fail=True)  # prompt 4 is open when the crash happens
    w = RowWriter(path, model="toy", capture_mode="query-aware", head_dim=D)
    assert w.completed_prompts == {0, 1, 2, 3}  # 3 ended, committed on exit; 4 dropped
    for pid in range(5):
        if pid not in w.completed_prompts:
            add(w, pid)
    w.close()
    store = RowStore.open(path)
    assert store.n_rows == 10
    assert store.meta["row_id"].to_list() == list(range(10))
    assert sorted(store.meta["prompt_id"].to_list()) == sorted([0, 1, 2, 3, 4] * 2)
    assert store.meta.select("prompt_id", "q_head").is_duplicated().sum() == 0
    assert store.prompts["prompt_id"].to_list() == [0, 1, 2, 3, 4]
    store.verify()
    with pytest.raises(InputError, match="head_dim"):
        RowWriter(path, model="toy", capture_mode="query-aware", head_dim=D + 1)
    with pytest.raises(InputError, match="model"):
        RowWriter(path, model="other", capture_mode="query-aware", head_dim=D)


def test_interrupted_commit_is_ignored_and_repaired(tmp_path: Path) -> None:
    """A crash after the shard/index/prompts were written but before the manifest:
    the manifest still lists the old shards and says incomplete (a writer marks a complete
    dataset incomplete before its first new file); readers refuse it unless they opt in,
    then see the previous commit; a resumed writer discards the orphan shard."""
    path = tmp_path / "ds"
    _write_mixed(path, prompts=(0, 1))
    marked = json.loads((path / "manifest.json").read_text())
    assert marked["complete"] is True
    marked["complete"] = False  # what the writer writes before changing anything
    n_old = RowStore.open(path).n_rows
    with RowWriter(path, model="toy", capture_mode="query-agnostic", head_dim=D) as w:
        w.add_prompt(7, [1, 2])
        b = w.add_block(7, 0, 0, np.ones((2, D)), np.ones((2, D)), [0, 1])
        w.add_query_rows(b, np.ones((1, D)), [0], [1], [0], [2], 1.0)
        w.end_prompt(7)
    new_manifest = json.loads((path / "manifest.json").read_text())
    orphan = path / new_manifest["shards"][-1]["file"]
    (path / "manifest.json").write_text(json.dumps(marked))  # roll back the commit point
    with pytest.raises(InputError, match="incomplete row dataset.*rerun the same"):
        RowStore.open(path)
    store = RowStore.open(path, allow_incomplete=True)
    assert store.n_rows == n_old and 7 not in store.prompts["prompt_id"].to_list()
    assert not store.complete
    store.verify()
    w = RowWriter(path, model="toy", capture_mode="query-agnostic", head_dim=D)
    assert not orphan.exists() and 7 not in w.completed_prompts
    w.close()
    assert RowStore.open(path).n_rows == n_old


def test_writer_marks_complete_only_on_close(tmp_path: Path) -> None:
    """complete is false from the first manifest (or, on a complete dataset, from the first
    change) until close(); an exception inside `with` leaves it false."""
    path = tmp_path / "ds"

    def manifest() -> dict:
        return json.loads((path / "manifest.json").read_text())

    def add(w: RowWriter, pid: int) -> None:
        w.add_prompt(pid, [pid])
        w.add_logit_rows(w.add_block(pid, 0, 0, None, np.ones((3, D)), [0, 1, 2]),
                         [np.zeros(3)], [0], [2])
        w.end_prompt(pid)

    w = RowWriter(path, model="toy", capture_mode="synthetic", head_dim=D, rows_per_shard=1,
                  expected={"prompts": 3})
    assert manifest()["complete"] is False and manifest()["expected"] == {"prompts": 3}
    add(w, 0)
    add(w, 1)  # both committed (rows_per_shard=1), still incomplete
    assert manifest()["counts"]["prompts"] == 2 and manifest()["complete"] is False
    with pytest.raises(InputError, match=r"incomplete row dataset \(2 of 3 prompts committed\)"):
        RowStore.open(path)
    add(w, 2)
    w.close()
    assert manifest()["complete"] is True
    assert RowStore.open(path).n_rows == 3
    # reopening a complete dataset without changes leaves the manifest as it was
    before = (path / "manifest.json").read_bytes()
    RowWriter(path, model="toy", capture_mode="synthetic", head_dim=D).close()
    assert (path / "manifest.json").read_bytes() == before
    with pytest.raises(RuntimeError):
        with RowWriter(path, model="toy", capture_mode="synthetic", head_dim=D,
                       rows_per_shard=1) as w:
            add(w, 3)
            raise RuntimeError("crash")
    assert manifest()["complete"] is False and manifest()["counts"]["prompts"] == 4
    assert RowStore.open(path, allow_incomplete=True).n_rows == 4
    RowWriter(path, model="toy", capture_mode="synthetic", head_dim=D).close()
    assert RowStore.open(path).n_rows == 4


def test_dataset_without_completion_fields_still_opens(tmp_path: Path) -> None:
    """Schema compatibility: a manifest written before `complete`, `expected` and the table
    checksums existed (evictlab's first writer) reads as a complete dataset, and a writer
    resuming it adds the fields."""
    path = tmp_path / "ds"
    expected = _write_mixed(path)
    man = json.loads((path / "manifest.json").read_text())
    for key in ("complete", "expected", "index_sha256", "prompts_sha256"):
        man.pop(key, None)
    (path / "manifest.json").write_text(json.dumps(man))
    store = RowStore.open(path)
    assert store.complete and store.summary()["complete"]
    _check_rows(next(store.iter_batches(max_rows=1000)), expected, 0)
    RowWriter(path, model="toy", capture_mode="query-agnostic", head_dim=D).close()
    assert "complete" not in json.loads((path / "manifest.json").read_text())  # untouched
    with RowWriter(path, model="toy", capture_mode="query-agnostic", head_dim=D) as w:
        w.add_prompt(99, [])
        w.end_prompt(99)
    man = json.loads((path / "manifest.json").read_text())
    assert man["complete"] is True and "prompts_sha256" in man and "index_sha256" in man
    assert RowStore.open(path).prompts["prompt_id"].to_list()[-1] == 99


def test_writer_protocol_errors(tmp_path: Path) -> None:
    w = RowWriter(tmp_path / "ds", model="toy", capture_mode="synthetic", head_dim=D)
    with pytest.raises(InputError, match="prompt_id"):
        w.add_block(0, 0, 0, None, np.ones((2, D)), [0, 1])  # no open prompt
    w.add_prompt(0, [])
    with pytest.raises(InputError, match="prompt_id"):
        w.add_prompt(1, [])  # 0 still open
    b = w.add_block(0, 0, 0, None, np.ones((2, D)), [0, 1])
    with pytest.raises(InputError, match="block"):
        w.add_query_rows(b, np.ones((1, D)), [0], [0], [0], [2], 1.0)  # no keys
    with pytest.raises(InputError, match="close"):
        w.close()
    w.end_prompt(0)
    with pytest.raises(InputError, match="prompt_id"):
        w.add_prompt(0, [])  # duplicate id
    w.close()
    with pytest.raises(InputError, match="closed"):
        w.add_prompt(3, [])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("x")
    with pytest.raises(InputError, match="not empty"):
        RowWriter(tmp_path / "junk", model="toy", capture_mode="synthetic", head_dim=D)
    with pytest.raises(InputError, match="capture_mode"):
        RowWriter(tmp_path / "x", model="toy", capture_mode="nope", head_dim=D)


def test_copy_of_dataset_reads_identically(tmp_path: Path) -> None:
    """Datasets are relocatable: the manifest stores only file names."""
    expected = _write_mixed(tmp_path / "ds")
    shutil.copytree(tmp_path / "ds", tmp_path / "moved")
    b = next(RowStore.open(tmp_path / "moved").iter_batches(max_rows=1000))
    _check_rows(b, expected, 0)


def test_prompts_and_blocks_without_rows(tmp_path: Path) -> None:
    """A prompt with no rows, and a block no row reads, are committed consistently."""
    path = tmp_path / "ds"
    with RowWriter(path, model="toy", capture_mode="synthetic", head_dim=D,
                   rows_per_shard=1) as w:
        w.add_prompt(0, [7])
        w.end_prompt(0)  # no blocks, no rows
        w.add_prompt(1, [8])
        w.add_block(1, 0, 0, None, np.ones((3, D)), [0, 1, 2])  # block 0, unused
        w.end_prompt(1)
        w.flush()
        w.add_prompt(2, [9])
        b = w.add_block(2, 0, 1, None, np.ones((2, D)), [0, 1])
        assert b == 1
        w.add_logit_rows(b, [np.zeros(2)], [0], [1])
        w.end_prompt(2)
    store = RowStore.open(path)
    assert store.manifest["counts"] == {"rows": 1, "prompts": 3, "blocks": 2,
                                        "query_rows": 0, "logit_rows": 1}
    assert store.meta["block"].to_list() == [1]
    store.verify()
    np.testing.assert_allclose(store.get_rows([0]).p, [0.5, 0.5])
