"""Reading the attention-row dataset (format: ``docs/formats.md``).

:class:`RowStore` opens a dataset, checks the manifest (and refuses a dataset whose writer
did not finish), verifies the index and prompts tables against the manifest's checksums,
and streams :class:`~evictlab.rows.batch.RowBatch` objects, loading one shard at a time and
verifying each shard's SHA-256 when it is first loaded. Every file is read through the
guarded readers of :mod:`evictlab.io`, so a damaged file is one ``CorruptFileError``
naming it.

Attention weights are never stored for query rows: they are recomputed in float64 as
``p = softmax(scale * q . K[key_lo:key_hi]^T)``. Logits rows store logits, ``p = softmax``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from evictlab.errors import CorruptFileError, InputError
from evictlab.io import check_sha256, load_npz, read_json, read_parquet
from evictlab.rows.batch import RowBatch, ragged_index, ragged_offsets
from evictlab.rows.checks import int_array
from evictlab.rows.kernels import compiled
from evictlab.rows.schema import (
    INDEX_FILE,
    INDEX_SCHEMA,
    MANIFEST_FILE,
    META_COLUMNS,
    PROMPT_SCHEMA,
    PROMPTS_FILE,
    REGEN_FIX,
    SHARD_ARRAYS,
    check_manifest,
    is_complete,
    prompt_schema,
    shard_name,
)


def read_manifest(path: Path) -> dict[str, Any]:
    """The checked manifest of the dataset directory ``path``.

    Raises :class:`InputError` if ``path`` is not a dataset directory and
    :class:`CorruptFileError` if the manifest cannot be trusted.
    """
    if path.exists() and not path.is_dir():
        raise InputError(str(path), "is a file, not a row dataset directory",
                         "pass the directory written by `evictlab rows synth` or `evictlab capture`")
    if not path.is_dir():
        raise InputError(str(path), "is not a directory (no such row dataset)",
                         "pass the directory written by `evictlab rows synth` or `evictlab capture`")
    man_path = path / MANIFEST_FILE
    if not man_path.is_file():
        raise InputError(str(path), f"is not a row dataset (no {MANIFEST_FILE})",
                         "pass the directory written by `evictlab rows synth` or `evictlab capture`")
    return check_manifest(read_json(man_path, REGEN_FIX), man_path)


def writer_command(man: dict[str, Any]) -> str:
    """The command that writes datasets like this one (from the manifest's ``source``)."""
    src = man.get("source", {})
    if src.get("generator") == "evictlab.rows.synth":
        return "`evictlab rows synth`"
    if "capture" in src:
        return "`evictlab capture`"
    return "`evictlab rows synth` or `evictlab capture`"


def progress_text(man: dict[str, Any]) -> str:
    """``"12288 of 50000 rows"``-style committed/expected counts of a manifest."""
    counts, expected = man["counts"], man.get("expected", {})
    parts = [f"{counts.get(k, 0)} of {v} {k}" for k, v in sorted(expected.items())]
    return ", ".join(parts) or f"{counts['rows']} rows, {counts['prompts']} prompts"


def incomplete_error(path: Path, man: dict[str, Any]) -> InputError:
    """The error for reading a dataset whose writer did not finish."""
    return InputError(
        str(path), f"is an incomplete row dataset ({progress_text(man)} committed): the run "
        "writing it was interrupted or is still running",
        f"rerun the same {writer_command(man)} command (same arguments, same --out) to resume "
        f"it; `evictlab rows inspect {path}` shows what is there")


def _check_columns(df: pl.DataFrame, schema: dict[str, pl.DataType], path: Path) -> pl.DataFrame:
    missing = [c for c in schema if c not in df.columns]
    if missing:
        raise CorruptFileError(str(path), f"lacks columns {missing}", REGEN_FIX)
    try:
        return df.select([pl.col(c).cast(t, strict=True) for c, t in schema.items()])
    except Exception as exc:
        raise CorruptFileError(str(path), f"has columns of the wrong type ({exc})",
                               REGEN_FIX) from None


def _read_table(path: Path, schema: dict[str, pl.DataType], sha: str | None) -> pl.DataFrame:
    """A committed table, checksum-verified first when the manifest records one."""
    if sha is not None:
        check_sha256(path, sha, REGEN_FIX)
    return _check_columns(read_parquet(path, REGEN_FIX), schema, path)


def load_tables(path: Path, man: dict[str, Any]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Index and prompts restricted to what the manifest committed; checked for consistency.

    The prompts always have the columns of :data:`PROMPT_SCHEMA`: a version-1 dataset's
    prompts (written before fact labels existed) get a null ``facts`` column (unlabelled).

    The files' SHA-256 are checked against the manifest when it is complete and records
    them. In an incomplete dataset the files may legitimately be one commit ahead of the
    manifest (a commit interrupted between the table writes and the manifest write), so
    only the structural checks apply there.
    """
    n_shards = len(man["shards"])
    counts = man["counts"]
    sums = man if is_complete(man) else {}
    if n_shards:
        index = _read_table(path / INDEX_FILE, INDEX_SCHEMA, sums.get("index_sha256"))
        index = index.filter(pl.col("shard") < n_shards)
    else:
        index = pl.DataFrame(schema=INDEX_SCHEMA)
    if counts["prompts"]:
        prompts = _read_table(path / PROMPTS_FILE, prompt_schema(man["schema_version"]), sums.get("prompts_sha256"))
        prompts = prompts.head(counts["prompts"])
        if "facts" not in prompts.columns:  # version 1: no labels
            prompts = prompts.with_columns(pl.lit(None, dtype=PROMPT_SCHEMA["facts"]).alias("facts"))
    else:
        prompts = pl.DataFrame(schema=PROMPT_SCHEMA)
    if index.height != counts["rows"]:
        raise CorruptFileError(str(path / INDEX_FILE), f"holds {index.height} committed rows, "
                               f"the manifest says {counts['rows']}", REGEN_FIX)
    if prompts.height != counts["prompts"]:
        raise CorruptFileError(str(path / PROMPTS_FILE), f"holds {prompts.height} prompts, the "
                               f"manifest says {counts['prompts']}", REGEN_FIX)
    if index.height and not np.array_equal(index["row_id"].to_numpy(),
                                           np.arange(index.height, dtype=np.int64)):
        raise CorruptFileError(str(path / INDEX_FILE), "row_id is not 0..N-1 in order", REGEN_FIX)
    if prompts["prompt_id"].n_unique() != prompts.height:
        raise CorruptFileError(str(path / PROMPTS_FILE), "has duplicate prompt_id", REGEN_FIX)
    per_shard = index.group_by("shard").len().sort("shard")
    want = {i: sh["rows"] for i, sh in enumerate(man["shards"])}
    got = dict(zip(per_shard["shard"].to_list(), per_shard["len"].to_list()))
    for i, r in want.items():
        if got.get(i, 0) != r:
            raise CorruptFileError(str(path / INDEX_FILE), f"has {got.get(i, 0)} rows for "
                                   f"{shard_name(i)}, the manifest says {r}", REGEN_FIX)
    return index, prompts


class _Shard:
    """The arrays of one loaded, structurally checked shard."""

    def __init__(self, path: Path, arrays: dict[str, np.ndarray], d: int) -> None:
        self.path = path
        a = arrays
        self.a = a

        def bad(what: str) -> CorruptFileError:
            return CorruptFileError(str(path), what, REGEN_FIX)

        missing = [k for k in SHARD_ARRAYS if k not in a]
        if missing:
            raise bad(f"lacks arrays {missing}")
        for k, (dtypes, _shape) in SHARD_ARRAYS.items():
            if a[k].dtype.name not in dtypes.split("|"):
                raise bad(f"array {k} has dtype {a[k].dtype}, expected {dtypes}")
            if a[k].ndim != (2 if k in ("values", "keys", "queries") else 1):
                raise bad(f"array {k} has shape {a[k].shape}, expected {_shape}")
        B = a["block_id"].shape[0]
        for k in ("block_prompt", "block_layer", "block_kv_head"):
            if a[k].shape != (B,):
                raise bad(f"array {k} has shape {a[k].shape}, expected ({B},)")
        for off, data, key in (("val_off", "values", "values"), ("key_off", "keys", "keys")):
            o = a[off]
            if o.shape != (B + 1,) or o[0] != 0 or (np.diff(o) < 0).any() or o[-1] != a[data].shape[0]:
                raise bad(f"offsets {off} do not match array {key} ({a[data].shape[0]} entries)")
        for k in ("values", "keys", "queries"):
            if a[k].ndim != 2 or a[k].shape[1] != d:
                raise bad(f"array {k} has shape {a[k].shape}, expected [*, {d}] (head_dim)")
        if a["positions"].shape != (a["values"].shape[0],):
            raise bad("positions is not aligned with values")
        klen = np.diff(a["key_off"])
        vlen = np.diff(a["val_off"])
        if ((klen != 0) & (klen != vlen)).any():
            raise bad("a block has a different number of keys and values")
        if a["query_row_id"].shape != (a["queries"].shape[0],):
            raise bad("query_row_id is not aligned with queries")
        lo = a["logit_off"]
        R = a["logit_row_id"].shape[0]
        if lo.shape != (R + 1,) or lo[0] != 0 or (np.diff(lo) < 1).any() or lo[-1] != a["logits"].shape[0]:
            raise bad("logit_off does not match logits / logit_row_id")
        self.block_id = a["block_id"]
        self.vlen = vlen
        self.klen = klen
        if B and (np.diff(self.block_id) <= 0).any():
            raise bad("block_id is not increasing")

    def block_local(self, blocks: np.ndarray) -> np.ndarray:
        j = np.searchsorted(self.block_id, blocks)
        j = np.minimum(j, max(len(self.block_id) - 1, 0))
        if len(self.block_id) == 0 or (self.block_id[j] != blocks).any():
            raise CorruptFileError(str(self.path), "index.parquet points at blocks this shard "
                                   "does not hold", REGEN_FIX)
        return j


class RowStore:
    """Read access to an attention-row dataset directory.

    ``RowStore.open(path)`` checks the manifest (format, schema version, counts) and the
    index; shard files are checked (SHA-256, structure, agreement with the index) when
    first loaded, and :meth:`verify` checks all of them.
    """

    def __init__(self, path: Path, manifest: dict[str, Any], index: pl.DataFrame,
                 prompts: pl.DataFrame) -> None:
        self.path = path
        self.manifest = manifest
        self._index = index
        self._prompts = prompts
        self._verified: set[int] = set()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, allow_empty: bool = False,
             allow_incomplete: bool = False) -> RowStore:
        """Open the dataset at ``path``.

        Raises :class:`InputError` for an empty dataset unless ``allow_empty``, and for an
        incomplete one (its writer was interrupted or is still running; manifest
        ``complete: false``) unless ``allow_incomplete``, which then reads the rows
        committed so far (``rows inspect`` does this to report progress).
        """
        path = Path(path)
        man = read_manifest(path)
        if not is_complete(man) and not allow_incomplete:
            raise incomplete_error(path, man)
        index, prompts = load_tables(path, man)
        if index.height == 0 and not allow_empty:
            raise InputError(str(path), "is an empty dataset (0 rows)",
                             "add rows (capture or `evictlab rows synth`) before reading")
        return cls(path, man, index, prompts)

    # -- metadata -------------------------------------------------------------------------

    @property
    def meta(self) -> pl.DataFrame:
        """The index: one row per attention row (columns in ``schema.INDEX_SCHEMA``)."""
        return self._index

    @property
    def prompts(self) -> pl.DataFrame:
        """The prompts table (``prompt_id, tokens, source, mode, text, facts``; ``facts`` null
        on unlabelled prompts, docs/formats.md)."""
        return self._prompts

    @property
    def complete(self) -> bool:
        """Whether the run that wrote the dataset finished (see ``schema.is_complete``)."""
        return is_complete(self.manifest)

    @property
    def head_dim(self) -> int:
        """Head dimension d."""
        return int(self.manifest["head_dim"])

    @property
    def n_rows(self) -> int:
        """Number of rows."""
        return self._index.height

    def __len__(self) -> int:
        return self._index.height

    def summary(self) -> dict[str, Any]:
        """Counts and ranges for ``evictlab rows inspect``."""
        ix, man = self._index, self.manifest
        n = ix["n"]
        return {
            "path": str(self.path),
            "schema_version": man["schema_version"],
            "model": man["model"],
            "models": [man["model"]],
            "capture_mode": man["capture_mode"],
            "capture_modes": sorted(set(self._prompts["mode"].to_list()) | {man["capture_mode"]}),
            "head_dim": man["head_dim"],
            "d_min": man["head_dim"],
            "d_max": man["head_dim"],
            "rows": ix.height,
            "query_rows": man["counts"]["query_rows"],
            "logit_rows": man["counts"]["logit_rows"],
            "prompts": self._prompts.height,
            "labelled_prompts": int(self._prompts["facts"].is_not_null().sum()),
            "blocks": man["counts"]["blocks"],
            "shards": len(man["shards"]),
            "bytes": sum(sh["bytes"] for sh in man["shards"]),
            "n_min": int(n.min()) if ix.height else None,
            "n_max": int(n.max()) if ix.height else None,
            "n_mean": float(n.mean()) if ix.height else None,
            "layers": sorted(ix["layer"].unique().to_list()),
            "q_heads": sorted(ix["q_head"].unique().to_list()),
            "kv_heads": sorted(ix["kv_head"].unique().to_list()),
            "created": man["created"],
            "source": man["source"],
            "complete": self.complete,
            "expected": dict(man.get("expected", {})),
        }

    # -- shards ---------------------------------------------------------------------------

    def _load_shard(self, k: int, verify: bool = True) -> _Shard:
        entry = self.manifest["shards"][k]
        fpath = self.path / entry["file"]
        fix = REGEN_FIX
        if not fpath.exists():
            raise CorruptFileError(str(fpath), "is missing", fix)
        if verify and k not in self._verified:
            size = fpath.stat().st_size
            if size != entry["bytes"]:
                raise CorruptFileError(str(fpath), f"has {size} bytes, the manifest says "
                                       f"{entry['bytes']} (truncated or replaced)", fix)
            check_sha256(fpath, entry["sha256"], fix)
        sh = _Shard(fpath, load_npz(fpath, fix), self.head_dim)
        self._check_shard_index(k, sh)
        self._verified.add(k)
        return sh

    def _check_shard_index(self, k: int, sh: _Shard) -> None:
        rows = self._index.filter(pl.col("shard") == k)
        a = sh.a

        def bad(what: str) -> CorruptFileError:
            return CorruptFileError(str(sh.path), f"disagrees with index.parquet: {what}", REGEN_FIX)

        bl = sh.block_local(rows["block"].to_numpy())
        for col, arr in (("prompt_id", "block_prompt"), ("layer", "block_layer"),
                         ("kv_head", "block_kv_head")):
            if not np.array_equal(rows[col].to_numpy(), a[arr][bl]):
                raise bad(f"{col} of a row differs from its block's")
        hi = rows["key_hi"].to_numpy()
        lo = rows["key_lo"].to_numpy()
        if (lo < 0).any() or (hi <= lo).any() or (hi > sh.vlen[bl]).any():
            raise bad("a row's key range lies outside its block")
        if not np.array_equal(rows["n"].to_numpy(), hi - lo):
            raise bad("n != key_hi - key_lo")
        kind = rows["kind"].to_numpy()
        local = rows["local"].to_numpy()
        rid = rows["row_id"].to_numpy()
        isq = kind == "query"
        if not np.isin(kind, ["query", "logits"]).all():
            raise bad("unknown row kind")
        nq, nl = a["query_row_id"].shape[0], a["logit_row_id"].shape[0]
        if isq.sum() != nq or (~isq).sum() != nl:
            raise bad("numbers of query/logits rows differ")
        ql, ll = local[isq], local[~isq]
        if ((ql < 0) | (ql >= nq)).any() or ((ll < 0) | (ll >= nl)).any():
            raise bad("a row's local index is out of range")
        if not np.array_equal(a["query_row_id"][ql], rid[isq]) or not np.array_equal(
                a["logit_row_id"][ll], rid[~isq]):
            raise bad("row ids stored in the shard differ")
        if (sh.klen[bl[isq]] == 0).any():
            raise bad("a query row's block has no keys")
        lg = np.diff(a["logit_off"])[ll]
        if not np.array_equal(lg, rows["n"].to_numpy()[~isq]):
            raise bad("a logits row's length differs from n")

    def _batch_from_shard(self, sh: _Shard, rows: pl.DataFrame, with_keys: bool,
                          extra: Sequence[str], with_queries: bool = False) -> RowBatch:
        """Build the RowBatch for ``rows`` (index rows, all in shard ``sh``)."""
        a = sh.a
        n = rows["n"].to_numpy()
        lo = rows["key_lo"].to_numpy()
        hi = rows["key_hi"].to_numpy()
        rid = rows["row_id"].to_numpy()
        kind = rows["kind"].to_numpy()
        local = rows["local"].to_numpy()
        p_off = ragged_offsets(n)
        ublocks, inv = np.unique(rows["block"].to_numpy(), return_inverse=True)
        bl = sh.block_local(ublocks)
        vlen = sh.vlen[bl]
        pool_off = ragged_offsets(vlen)
        vidx = ragged_index(a["val_off"][bl], vlen)
        values = a["values"][vidx].astype(np.float64)
        pos = a["positions"][vidx]
        bad_v = ~np.isfinite(values).all(axis=1)
        if bad_v.any():
            b = int(np.searchsorted(pool_off, int(np.argmax(bad_v)), side="right") - 1)
            r = int(rid[np.argmax(inv == b)])
            raise InputError(f"row_id {r}", f"block {int(ublocks[b])} holds NaN/inf values "
                             f"({sh.path.name})", "re-capture or drop that block's rows (filter)")
        v_start = pool_off[inv] + lo
        gidx = ragged_index(v_start, n)
        key_index = pos[gidx]
        p = np.empty(int(p_off[-1]), np.float64)
        keys = None
        has_keys = bool((sh.klen[bl] > 0).all())
        if with_keys and has_keys:
            kidx = ragged_index(a["key_off"][bl], vlen)
            keys = a["keys"][kidx].astype(np.float64)
        # logits rows: softmax of the stored logits, row by row (numba)
        isl = kind == "logits"
        if isl.any():
            li = np.flatnonzero(isl)
            bad = compiled("logits")(a["logits"], a["logit_off"][local[li]], n[li], p, p_off[li])
            if bad >= 0:
                raise InputError(f"row_id {int(rid[li[bad]])}", "has NaN/inf logits",
                                 "re-generate the dataset or filter that row out")
        # query rows: per block, p = softmax(scale * q . K[lo:hi]^T) row by row (numba)
        qi_all = np.flatnonzero(~isl)
        if qi_all.size:
            scale = rows["scale"].to_numpy()
            order = np.argsort(inv[qi_all], kind="stable")
            qi_sorted = qi_all[order]
            bounds = np.flatnonzero(np.diff(inv[qi_sorted])) + 1
            for grp in np.split(qi_sorted, bounds):
                b = int(inv[grp[0]])
                k0 = int(a["key_off"][bl[b]])
                Q = a["queries"][local[grp]]
                badq = ~np.isfinite(Q).all(axis=1)
                if badq.any():
                    raise InputError(f"row_id {int(rid[grp[np.argmax(badq)]])}",
                                     "has a NaN/inf query", "re-capture or filter that row out")
                c0, c1 = int(lo[grp].min()), int(hi[grp].max())
                Kt = np.ascontiguousarray(a["keys"][k0 + c0 : k0 + c1].T, dtype=np.float64)
                if not np.isfinite(Kt).all():
                    raise InputError(f"row_id {int(rid[grp[0]])}", f"block "
                                     f"{int(ublocks[b])} holds NaN/inf keys ({sh.path.name})",
                                     "re-capture or filter those rows out")
                bad = compiled("query")(Kt, Q, scale[grp], lo[grp] - c0, hi[grp] - c0, p, p_off[grp])
                if bad >= 0:
                    raise InputError(f"row_id {int(rid[grp[bad]])}",
                                     "its attention logits overflow (not finite)",
                                     "check the stored query, keys and scale")
        meta = rows.select([*META_COLUMNS, *[c for c in extra if c not in META_COLUMNS]])
        queries = None
        if with_queries:  # logits rows have no query: NaN
            queries = np.full((rows.height, self.head_dim), np.nan)
            queries[qi_all] = a["queries"][local[qi_all]]
        return RowBatch(p=p, p_off=p_off, values=values, v_start=v_start, key_index=key_index,
                        meta=meta, keys=keys, queries=queries)

    # -- public reads ---------------------------------------------------------------------

    def iter_batches(
        self,
        max_rows: int = 4096,
        *,
        filter: pl.Expr | None = None,
        columns: Sequence[str] = (),
        with_keys: bool = False,
        verify: bool = True,
        with_queries: bool = False,
    ) -> Iterator[RowBatch]:
        """Stream the rows in ``row_id`` order as batches of at most ``max_rows`` rows.

        One shard is held in memory at a time; a batch may span two shards (every batch
        but the last has exactly ``max_rows`` rows). ``filter``: a polars expression on the
        index columns selecting rows (e.g. ``pl.col("layer") == 3``); ``columns``: extra
        index columns to carry in ``meta``; ``with_keys``: also return float64 keys;
        ``verify``: check each shard's size and SHA-256 before first use; ``with_queries``:
        also return each row's float64 query (NaN for logits rows).
        """
        if not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
            raise InputError("max_rows", f"must be a positive integer, got {max_rows!r}",
                             "pass e.g. max_rows=4096")
        unknown = [c for c in columns if c not in INDEX_SCHEMA]
        if unknown:
            raise InputError("columns", f"unknown index columns {unknown}",
                             f"choose from {list(INDEX_SCHEMA)}")
        index = self._index if filter is None else self._filter(filter)
        if index.height == 0:
            return
        carry: list[RowBatch] = []
        carried = 0
        for (k,), rows in index.group_by("shard", maintain_order=True):
            sh = self._load_shard(int(k), verify=verify)
            start = 0
            while start < rows.height:
                take = min(max_rows - carried, rows.height - start)
                carry.append(self._batch_from_shard(sh, rows.slice(start, take), with_keys, columns,
                                                    with_queries))
                carried += take
                start += take
                if carried == max_rows:
                    yield RowBatch.concat(carry)
                    carry, carried = [], 0
            del sh
        if carry:
            yield RowBatch.concat(carry)

    def _filter(self, expr: pl.Expr) -> pl.DataFrame:
        try:
            return self._index.filter(expr)
        except Exception as exc:
            raise InputError("filter", f"cannot be applied to the index ({exc})",
                             f"use a boolean polars expression on {list(INDEX_SCHEMA)}") from None

    def get_rows(self, row_ids: Sequence[int] | np.ndarray, *, with_keys: bool = False,
                 columns: Sequence[str] = ()) -> RowBatch:
        """Random access: one RowBatch holding ``row_ids`` in the order given."""
        ids = int_array(np.asarray(row_ids, dtype=np.int64) if len(row_ids) == 0 else row_ids,
                         "row_ids", lo=0)
        if ids.size == 0:
            raise InputError("row_ids", "is empty", "pass at least one row id")
        if int(ids.max()) >= self.n_rows:
            raise InputError("row_ids", f"contains {int(ids.max())} but the dataset has "
                             f"{self.n_rows} rows", f"use ids in [0, {self.n_rows})")
        uniq = np.unique(ids)
        rows = self._index[uniq.tolist()]  # row_id == position in the index
        parts = []
        for (k,), grp in rows.group_by("shard", maintain_order=True):
            parts.append(self._batch_from_shard(self._load_shard(int(k)), grp, with_keys, columns))
        batch = RowBatch.concat(parts)
        pos = {int(r): i for i, r in enumerate(batch.meta["row_id"].to_list())}
        return batch.take([pos[int(r)] for r in ids])

    def verify(self) -> dict[str, Any]:
        """Check every shard (size, SHA-256, structure, agreement with the index) and
        every stored number (finite), prompts referenced by rows; return the summary."""
        self._verified.clear()
        for k in range(len(self.manifest["shards"])):
            sh = self._load_shard(k, verify=True)
            for name in ("values", "keys", "queries", "logits"):
                arr = sh.a[name]
                if arr.size and not np.isfinite(arr).all():
                    # name the first affected row precisely via a batch build
                    rows = self._index.filter(pl.col("shard") == k)
                    self._batch_from_shard(sh, rows, False, ())
                    raise CorruptFileError(str(sh.path), f"array {name} holds NaN/inf",
                                           REGEN_FIX)
        missing = set(self._index["prompt_id"].unique().to_list()) - set(
            self._prompts["prompt_id"].to_list())
        if missing:
            raise CorruptFileError(str(self.path / PROMPTS_FILE), f"lacks prompts "
                                   f"{sorted(missing)[:5]} referenced by rows", REGEN_FIX)
        return self.summary()
