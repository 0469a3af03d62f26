"""Bad files and bad inputs of the row dataset: each raises a clear, field-naming error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from evictlab.errors import CorruptFileError, InputError
from evictlab.io import sha256_file, write_npz
from evictlab.rows.reader import RowStore
from evictlab.rows.synth import SynthConfig, synthesize
from evictlab.rows.writer import RowWriter

D = 4


@pytest.fixture()
def ds(tmp_path: Path) -> Path:
    """Two shards of query rows plus one shard of logits rows."""
    path = tmp_path / "ds"
    synthesize(path, SynthConfig(rows=60, keys=12, dim=D, seed=0, rows_per_block=20,
                                 rows_per_shard=30))
    rng = np.random.default_rng(1)
    with RowWriter(path, model="synthetic", capture_mode="synthetic", head_dim=D) as w:
        w.add_prompt(50, [])
        b = w.add_block(50, 0, 0, None, rng.standard_normal((5, D)), [-1] * 5)
        w.add_logit_rows(b, [rng.standard_normal(5), rng.standard_normal(3)], [0, 0], [-1, -1])
        w.end_prompt(50)
    return path


def _read_all(path: Path) -> int:
    return sum(b.n_rows for b in RowStore.open(path).iter_batches(max_rows=7))


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _rewrite_shard(path: Path, k: int, edit) -> None:
    """Rewrite shard k with ``edit(arrays)`` applied and re-seal its checksum, so only the
    content checks (not the SHA-256) can catch the damage."""
    f = path / f"shard-{k:05d}.npz"
    with np.load(f) as z:
        arrays = {n: z[n] for n in z.files}
    edit(arrays)
    write_npz(f, arrays)
    man = _manifest(path)
    man["shards"][k].update(sha256=sha256_file(f), bytes=f.stat().st_size)
    (path / "manifest.json").write_text(json.dumps(man))


def _reseal_tables(path: Path) -> None:
    """Record the current index/prompts checksums in the manifest, so only the content
    checks (not the SHA-256) can catch a damage made to those files."""
    man = _manifest(path)
    man.update(index_sha256=sha256_file(path / "index.parquet"),
               prompts_sha256=sha256_file(path / "prompts.parquet"))
    (path / "manifest.json").write_text(json.dumps(man))


def test_fixture_reads(ds: Path) -> None:
    assert _read_all(ds) == 62
    assert len(_manifest(ds)["shards"]) == 3


def test_truncated_shard(ds: Path) -> None:
    f = ds / "shard-00001.npz"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CorruptFileError, match="shard-00001.npz.*truncated"):
        _read_all(ds)


def test_flipped_bytes_fail_checksum(ds: Path) -> None:
    f = ds / "shard-00000.npz"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptFileError, match="shard-00000.npz.*SHA-256"):
        _read_all(ds)
    with pytest.raises(CorruptFileError, match="SHA-256"):
        RowStore.open(ds).verify()


def test_unreadable_shard_without_checksum(ds: Path) -> None:
    f = ds / "shard-00000.npz"
    f.write_bytes(b"not a zip file at all" * 10)
    store = RowStore.open(ds)
    with pytest.raises(CorruptFileError, match="shard-00000.npz.*cannot be read"):
        next(store.iter_batches(verify=False))


def test_missing_shard(ds: Path) -> None:
    (ds / "shard-00002.npz").unlink()
    with pytest.raises(CorruptFileError, match="shard-00002.npz.*missing"):
        _read_all(ds)


@pytest.mark.parametrize("version", [0, 3, 99, "1", None])
def test_unknown_schema_version(ds: Path, version) -> None:
    man = _manifest(ds)
    man["schema_version"] = version
    (ds / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptFileError, match="schema_version.*unknown schema version") as ei:
        RowStore.open(ds)
    assert "upgrade evictlab" in str(ei.value)
    with pytest.raises(CorruptFileError, match="schema"):
        RowWriter(ds, model="synthetic", capture_mode="synthetic", head_dim=D)


@pytest.mark.parametrize("damage, match", [
    (lambda m: m.pop("head_dim"), "head_dim"),
    (lambda m: m.update(capture_mode="psychic"), "capture_mode"),
    (lambda m: m.update(format="something-else"), "not an evictlab"),
    (lambda m: m["counts"].update(rows=-1), "counts.rows"),
    (lambda m: m["shards"][1].update(file="shard-00007.npz"), r"shards\[1\]"),
    (lambda m: m["counts"].update(rows=1000), "index.parquet.*committed rows"),
])
def test_damaged_manifest_fields(ds: Path, damage, match: str) -> None:
    man = _manifest(ds)
    damage(man)
    (ds / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CorruptFileError, match=match):
        RowStore.open(ds)


def test_manifest_not_json_or_missing(ds: Path, tmp_path: Path) -> None:
    (ds / "manifest.json").write_text("{ truncated")
    with pytest.raises(CorruptFileError, match="manifest.json.*JSON"):
        RowStore.open(ds)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(InputError, match="not a row dataset"):
        RowStore.open(tmp_path / "empty_dir")
    with pytest.raises(InputError, match="not a directory"):
        RowStore.open(tmp_path / "nowhere")


def test_corrupt_index_and_prompts(ds: Path) -> None:
    (ds / "index.parquet").write_bytes(b"PAR1garbagePAR1")
    with pytest.raises(CorruptFileError, match="index.parquet.*SHA-256"):
        RowStore.open(ds)
    _reseal_tables(ds)  # past the checksum, the Parquet decoder's failure is reported
    with pytest.raises(CorruptFileError, match="index.parquet.*cannot be read as Parquet"):
        RowStore.open(ds)


@pytest.mark.parametrize("name", ["index.parquet", "prompts.parquet"])
def test_one_flipped_bit_in_a_table_is_a_corrupt_file_error(ds: Path, name: str) -> None:
    """Most single-bit flips in a Parquet file decode to different numbers without any
    error (and some make polars panic); the manifest's checksum catches every one."""
    f = ds / name
    raw = bytearray(f.read_bytes())
    for pos in (8, len(raw) // 2, len(raw) - 12):
        damaged = bytearray(raw)
        damaged[pos] ^= 0x10
        f.write_bytes(bytes(damaged))
        with pytest.raises(CorruptFileError, match=f"{name}.*SHA-256.*Fix: re-create"):
            RowStore.open(ds)


def test_polars_panic_becomes_corrupt_file_error(tmp_path: Path, monkeypatch) -> None:
    """The guarded reader converts every decoder failure, including pyo3's
    PanicException (a BaseException), but never a KeyboardInterrupt."""
    from evictlab.io import read_parquet

    f = tmp_path / "t.parquet"
    pl.DataFrame({"a": [1]}).write_parquet(f)

    def boom(exc):
        def read(*args, **kwargs):
            raise exc
        return read

    monkeypatch.setattr(pl, "read_parquet", boom(pl.exceptions.PanicException("index out of bounds")))
    with pytest.raises(CorruptFileError, match="t.parquet.*PanicException.*out of bounds.*Fix: redo"):
        read_parquet(f, "redo it")
    monkeypatch.setattr(pl, "read_parquet", boom(pl.exceptions.ComputeError("bad page")))
    with pytest.raises(CorruptFileError, match="ComputeError"):
        read_parquet(f, "redo it")
    monkeypatch.setattr(pl, "read_parquet", boom(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        read_parquet(f, "redo it")


def test_index_missing_column_and_prompts_truncated(ds: Path) -> None:
    idx = pl.read_parquet(ds / "index.parquet")
    idx.drop("scale").write_parquet(ds / "index.parquet")
    _reseal_tables(ds)
    with pytest.raises(CorruptFileError, match="lacks columns.*scale"):
        RowStore.open(ds)
    idx.write_parquet(ds / "index.parquet")
    pl.read_parquet(ds / "prompts.parquet").head(1).write_parquet(ds / "prompts.parquet")
    _reseal_tables(ds)
    with pytest.raises(CorruptFileError, match="prompts.parquet.*holds 1 prompts"):
        RowStore.open(ds)


def test_index_disagrees_with_shard(ds: Path) -> None:
    idx = pl.read_parquet(ds / "index.parquet")
    idx.with_columns(
        pl.when(pl.col("row_id") == 3).then(pl.col("key_hi") + 50).otherwise(pl.col("key_hi"))
        .alias("key_hi")
    ).write_parquet(ds / "index.parquet")
    _reseal_tables(ds)
    with pytest.raises(CorruptFileError, match="shard-00000.npz.*disagrees with index"):
        _read_all(ds)


def test_empty_dataset(tmp_path: Path) -> None:
    RowWriter(tmp_path / "e", model="m", capture_mode="query-aware", head_dim=D).close()
    with pytest.raises(InputError, match="empty dataset") as ei:
        RowStore.open(tmp_path / "e")
    assert "evictlab rows synth" in ei.value.fix
    assert RowStore.open(tmp_path / "e", allow_empty=True).summary()["rows"] == 0


@pytest.mark.parametrize("array, row_kind", [
    ("queries", "query"), ("keys", "query"), ("values", "query"), ("logits", "logits"),
])
def test_nan_in_stored_arrays_names_the_row(ds: Path, array: str, row_kind: str) -> None:
    k = 2 if row_kind == "logits" else 1
    def poison(a: dict) -> None:
        a[array] = a[array].copy()
        a[array][1] = np.nan  # second query / key / value / logit of the shard
    _rewrite_shard(ds, k, poison)
    store = RowStore.open(ds)
    with pytest.raises(InputError, match=r"row_id \d+") as ei:
        _read_all(ds)
    rid = int(ei.value.field.split()[1])
    assert store.meta["shard"][rid] == k
    if array == "queries":
        assert rid == int(store.meta.filter((pl.col("shard") == k) & (pl.col("local") == 1))
                          ["row_id"][0])
    with pytest.raises(InputError, match="row_id"):
        store.verify()


@pytest.mark.parametrize("edit, match", [
    (lambda a: a.update(values=a["values"][:, :2]), "values has shape"),
    (lambda a: a.update(queries=a["queries"][:-1]), "query_row_id is not aligned"),
    (lambda a: a.update(positions=a["positions"][:-1]), "positions"),
    (lambda a: a.update(val_off=a["val_off"] + 1), "val_off"),
    (lambda a: a.pop("keys"), "lacks arrays"),
    (lambda a: a.update(positions=a["positions"].astype(np.float64)), "positions has dtype"),
    (lambda a: a.update(queries=a["queries"][:, 0].copy()), "queries has shape"),
    (lambda a: a.update(query_row_id=a["query_row_id"][::-1].copy()), "row ids stored"),
    (lambda a: a.update(block_layer=a["block_layer"] + 1), "layer of a row"),
])
def test_shape_mismatch_in_stored_arrays(ds: Path, edit, match: str) -> None:
    _rewrite_shard(ds, 0, edit)
    with pytest.raises(CorruptFileError, match=f"shard-00000.npz.*{match}"):
        _read_all(ds)


# --- writer-side bad inputs ------------------------------------------------------------


@pytest.fixture()
def writer(tmp_path: Path):
    w = RowWriter(tmp_path / "w", model="m", capture_mode="query-agnostic", head_dim=D)
    w.add_prompt(0, [1, 2, 3])
    return w


def _blk(w: RowWriter, L: int = 5) -> int:
    return w.add_block(0, 0, 0, np.ones((L, D)), np.ones((L, D)), np.arange(L))


@pytest.mark.parametrize("call, field", [
    (lambda w, b: w.add_query_rows(b, np.array([[1, 2, 3, np.nan]] * 2), [0, 0], [1, 1],
                                   [0, 0], [2, 2], 1.0), "queries[0]"),
    (lambda w, b: w.add_query_rows(b, np.ones((2, D + 1)), [0, 0], [1, 1], [0, 0], [2, 2], 1.0),
     "queries"),
    (lambda w, b: w.add_query_rows(b, np.ones((2, D)), [0], [1, 1], [0, 0], [2, 2], 1.0),
     "q_heads"),
    (lambda w, b: w.add_query_rows(b, np.ones((2, D)), [0, -1], [1, 1], [0, 0], [2, 2], 1.0),
     "q_heads"),
    (lambda w, b: w.add_query_rows(b, np.ones((2, D)), [0, 0], [1, 1], [0, 0], [2, 9], 1.0),
     "key_hi[1]"),
    (lambda w, b: w.add_query_rows(b, np.ones((2, D)), [0, 0], [1, 1], [3, 0], [3, 2], 1.0),
     "key_hi[0]"),
    (lambda w, b: w.add_query_rows(b, np.ones((2, D)), [0, 0], [1, 1], [0, 0], [2, 2], 0.0),
     "scale"),
    (lambda w, b: w.add_query_rows(b, np.ones((2, D)), [0.5, 0], [1, 1], [0, 0], [2, 2], 1.0),
     "q_heads"),
    (lambda w, b: w.add_query_rows(b + 1, np.ones((1, D)), [0], [1], [0], [2], 1.0), "block"),
    (lambda w, b: w.add_logit_rows(b, [np.array([0.0, np.inf])], [0], [1]), "logits[0]"),
    (lambda w, b: w.add_logit_rows(b, [np.zeros(3)], [0], [1], key_lo=[0], key_hi=[2]),
     "logits[0]"),
    (lambda w, b: w.add_logit_rows(b, [np.zeros(9)], [0], [1]), "key_hi[0]"),
    (lambda w, b: w.add_logit_rows(b, [np.zeros((2, 2))], [0], [1]), "logits[0]"),
    (lambda w, b: w.add_block(0, 0, 0, np.ones((3, D)), np.ones((2, D)), [0, 1]), "keys"),
    (lambda w, b: w.add_block(0, 0, 0, None, np.full((2, D), np.inf), [0, 1]), "values[0]"),
    (lambda w, b: w.add_block(0, 0, 0, None, np.ones((2, D)), [0, 1, 2]), "positions"),
    (lambda w, b: w.add_block(0, -1, 0, None, np.ones((2, D)), [0, 1]), "layer"),
    (lambda w, b: w.add_block(0, 0, 0, None, np.ones((0, D)), []), "values"),
])
def test_writer_rejects_bad_rows(writer: RowWriter, call, field: str) -> None:
    b = _blk(writer)
    with pytest.raises(InputError) as ei:
        call(writer, b)
    assert ei.value.field == field
    assert ei.value.fix  # every error says how to fix it


def test_writer_rejects_bad_prompt_and_settings(tmp_path: Path) -> None:
    w = RowWriter(tmp_path / "w", model="m", capture_mode="query-agnostic", head_dim=D)
    with pytest.raises(InputError, match="tokens"):
        w.add_prompt(0, [1.5, 2.0])
    with pytest.raises(InputError, match="prompt_id"):
        w.add_prompt(-1, [])
    for kwargs, field in ((dict(head_dim=0), "head_dim"), (dict(rows_per_shard=0), "rows_per_shard"),
                          (dict(model=""), "model")):
        args = dict(model="m", capture_mode="synthetic", head_dim=D) | kwargs
        with pytest.raises(InputError) as ei:
            RowWriter(tmp_path / f"x{field}", **args)
        assert ei.value.field == field
