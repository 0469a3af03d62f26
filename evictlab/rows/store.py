"""Writer and reader of the attention-row dataset (format: ``docs/formats.md``).

:class:`RowWriter` appends prompts, key/value blocks and rows, and commits them shard by
shard (array shard, then ``index.parquet``, ``prompts.parquet``, and last ``manifest.json``,
each written atomically), so a crash loses at most the prompts not yet committed.

:class:`RowStore` opens a dataset, checks the manifest, and streams
:class:`RowBatch` objects (the ragged-batch contract of ``docs/architecture.md``), loading
one shard at a time and verifying each shard's SHA-256 when it is first loaded.

Attention weights are never stored for query rows: they are recomputed in float64 as
``p = softmax(scale * q . K[key_lo:key_hi]^T)``. Logits rows store logits, ``p = softmax``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from evictlab.errors import CorruptFileError, InputError
from evictlab.io import atomic_path, atomic_write_json, sha256_file
from evictlab.rows.schema import (
    CAPTURE_MODES,
    FORMAT_NAME,
    INDEX_FILE,
    INDEX_SCHEMA,
    MANIFEST_FILE,
    META_COLUMNS,
    PROMPT_SCHEMA,
    PROMPTS_FILE,
    SCHEMA_VERSION,
    SHARD_ARRAYS,
    check_manifest,
    shard_name,
)

_REGEN = "re-run the capture or `evictlab rows synth` that produced this dataset"


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------


def ragged_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat indices ``concat([arange(s, s + l) for s, l in zip(starts, lengths)])``.

    ``starts``, ``lengths``: int64 ``[N]``; returns int64 ``[sum lengths]``. Vectorised
    (no Python loop), used to gather ragged segments.
    """
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    seg_first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(starts - seg_first, lengths) + np.arange(total, dtype=np.int64)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """``[0, cumsum(lengths)]`` as int64 ``[len+1]``."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def write_npz(dest: str | os.PathLike[str], arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as an uncompressed ``.npz`` atomically, byte-reproducibly.

    ``numpy.savez`` stamps each member with the current time, so equal arrays give
    different files; here every member gets a fixed timestamp and the members are written
    in sorted name order, so equal arrays give byte-identical files (and equal SHA-256).
    """
    with atomic_path(dest, suffix=".npz") as tmp:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name in sorted(arrays):
                info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
                with zf.open(info, "w", force_zip64=True) as fh:
                    np.lib.format.write_array(
                        fh, np.ascontiguousarray(arrays[name]), allow_pickle=False
                    )


def _int_array(x: Any, field_name: str, length: int | None = None, lo: int | None = None) -> np.ndarray:
    """Coerce ``x`` to a 1-D int64 array, checking length and lower bound."""
    arr = np.asarray(x)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InputError(field_name, f"must be a 1-D integer array, got dtype {arr.dtype} "
                         f"shape {arr.shape}", "pass integer ids/positions")
    arr = arr.astype(np.int64)
    if length is not None and arr.shape[0] != length:
        raise InputError(field_name, f"has length {arr.shape[0]}, expected {length}",
                         "pass one entry per row")
    if lo is not None and arr.size and int(arr.min()) < lo:
        raise InputError(field_name, f"has value {int(arr.min())} < {lo}",
                         f"use values >= {lo}")
    return arr


def _float_matrix(x: Any, field_name: str, d: int, rows: int | None = None) -> np.ndarray:
    """Coerce ``x`` to a float32 ``[R, d]`` array with only finite entries."""
    arr = np.asarray(x)
    if arr.ndim != 2 or arr.shape[1] != d or not np.issubdtype(arr.dtype, np.number):
        raise InputError(field_name, f"has shape {arr.shape} (dtype {arr.dtype}), expected "
                         f"[{'R' if rows is None else rows}, {d}] numbers",
                         f"pass a 2-D float array with head_dim={d} columns")
    if rows is not None and arr.shape[0] != rows:
        raise InputError(field_name, f"has {arr.shape[0]} rows, expected {rows}",
                         "pass one vector per entry")
    bad = ~np.isfinite(arr).all(axis=1)
    if bad.any():
        raise InputError(f"{field_name}[{int(np.argmax(bad))}]", "contains NaN or inf",
                         "drop or fix that row before writing")
    return arr.astype(np.float32)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(str(path.parent), f"is not a row dataset (no {MANIFEST_FILE})",
                         "pass the directory written by `evictlab rows synth` or capture") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptFileError(str(path), f"cannot be parsed as JSON ({exc})", _REGEN) from None


def _read_parquet(path: Path) -> pl.DataFrame:
    try:
        return pl.read_parquet(path)
    except FileNotFoundError:
        raise CorruptFileError(str(path), "is missing", _REGEN) from None
    except Exception as exc:  # polars raises several error types for damaged files
        raise CorruptFileError(str(path), f"cannot be read as Parquet ({type(exc).__name__}: "
                               f"{exc})", _REGEN) from None


def _check_columns(df: pl.DataFrame, schema: dict[str, pl.DataType], path: Path) -> pl.DataFrame:
    missing = [c for c in schema if c not in df.columns]
    if missing:
        raise CorruptFileError(str(path), f"lacks columns {missing}", _REGEN)
    try:
        return df.select([pl.col(c).cast(t, strict=True) for c, t in schema.items()])
    except Exception as exc:
        raise CorruptFileError(str(path), f"has columns of the wrong type ({exc})", _REGEN) from None


# --------------------------------------------------------------------------------------
# RowBatch: the ragged batch contract
# --------------------------------------------------------------------------------------


@dataclass
class RowBatch:
    """A ragged batch of N attention rows sharing value blocks (docs/architecture.md).

    Attributes:
        p: float64 ``[sum n_i]``, attention weights of every row, concatenated.
        p_off: int64 ``[N+1]``; row i's weights are ``p[p_off[i]:p_off[i+1]]``.
        values: float64 ``[K, d]``, the pooled value vectors of the blocks the rows use.
        v_start: int64 ``[N]``; row i's values are ``values[v_start[i] : v_start[i]+n_i]``.
        key_index: int64 ``[sum n_i]``, absolute token position of each key (-1 synthetic).
        meta: polars frame, one row per attention row, columns ``row_id, prompt_id, layer,
            q_head, kv_head, position, n`` (plus any extra index columns asked for).
        keys: float64 ``[K, d]`` aligned with ``values`` (post-RoPE keys) when requested
            and every block in the batch has keys; otherwise ``None``.
    """

    p: np.ndarray
    p_off: np.ndarray
    values: np.ndarray
    v_start: np.ndarray
    key_index: np.ndarray
    meta: pl.DataFrame
    keys: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        """Number of rows N."""
        return int(self.p_off.shape[0] - 1)

    @property
    def n(self) -> np.ndarray:
        """int64 ``[N]``: keys per row."""
        return np.diff(self.p_off)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(p [n_i], values [n_i, d])`` of row ``i`` (views, float64)."""
        lo, hi = int(self.p_off[i]), int(self.p_off[i + 1])
        s = int(self.v_start[i])
        return self.p[lo:hi], self.values[s : s + hi - lo]

    def take(self, order: Sequence[int] | np.ndarray) -> RowBatch:
        """The rows ``order`` (indices into this batch), sharing this batch's value pool."""
        order = np.asarray(order, dtype=np.int64)
        n = np.diff(self.p_off)[order]
        idx = ragged_index(self.p_off[:-1][order], n)
        return RowBatch(
            p=self.p[idx], p_off=_offsets(n), values=self.values, v_start=self.v_start[order],
            key_index=self.key_index[idx], meta=self.meta[order.tolist()] if len(order) else
            self.meta.clear(), keys=self.keys,
        )

    @staticmethod
    def concat(batches: Sequence[RowBatch]) -> RowBatch:
        """Concatenate batches (rows in order; value pools stacked, ``v_start`` shifted)."""
        if len(batches) == 1:
            return batches[0]
        p_parts, off_parts, v_parts, vs_parts, k_parts = [], [np.zeros(1, np.int64)], [], [], []
        p_base = v_base = 0
        for b in batches:
            p_parts.append(b.p)
            off_parts.append(b.p_off[1:] + p_base)
            vs_parts.append(b.v_start + v_base)
            v_parts.append(b.values)
            k_parts.append(b.keys)
            p_base += b.p.shape[0]
            v_base += b.values.shape[0]
        keys = None if any(k is None for k in k_parts) else np.concatenate(k_parts)
        return RowBatch(
            p=np.concatenate(p_parts), p_off=np.concatenate(off_parts),
            values=np.concatenate(v_parts), v_start=np.concatenate(vs_parts),
            key_index=np.concatenate([b.key_index for b in batches]),
            meta=pl.concat([b.meta for b in batches], how="vertical"), keys=keys,
        )


# --------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------


@dataclass
class _Block:
    block_id: int
    prompt_id: int
    layer: int
    kv_head: int
    values: np.ndarray          # float32 [L, d]
    positions: np.ndarray       # int64 [L]
    keys: np.ndarray | None     # float32 [L, d] or None (logits-only block)


@dataclass
class _Pending:
    """Everything not yet committed: blocks, rows (as index columns) and arrays."""

    blocks: list[_Block] = field(default_factory=list)
    rows: list[dict[str, np.ndarray]] = field(default_factory=list)
    queries: list[np.ndarray] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    prompts: list[dict[str, Any]] = field(default_factory=list)
    n_rows: int = 0
    n_query: int = 0
    n_logit: int = 0


class RowWriter:
    """Append prompts, blocks and rows to a dataset directory; commit shard by shard.

    Protocol, one prompt at a time::

        w = RowWriter(path, model="smollm2-135m", capture_mode="query-agnostic", head_dim=64)
        w.add_prompt(pid, tokens)                      # opens prompt pid
        b = w.add_block(pid, layer, kv_head, keys, values, positions)
        w.add_query_rows(b, queries, q_heads, positions, key_lo, key_hi, scale)
        w.end_prompt(pid)                              # prompt complete (commits later)
        ...
        w.close()

    A prompt is *complete* once :meth:`end_prompt` was called and the shard holding its rows
    was committed (manifest written). Every row of a prompt lands in the same shard, so a
    committed prompt has all its rows on disk and an uncommitted one has none: a crash
    (or an exception inside ``with RowWriter(...)``) drops only unfinished prompts, and
    :attr:`completed_prompts` tells a resumed capture which prompts to skip. Shards are cut
    at prompt boundaries once ``rows_per_shard`` rows are pending.

    Opening a writer on an existing dataset resumes it (the model, capture mode and head dim
    must match): row ids, block ids and shard numbers continue; index rows and shard files
    of an interrupted, uncommitted shard are discarded.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        model: str,
        capture_mode: str,
        head_dim: int,
        source: dict[str, Any] | None = None,
        rows_per_shard: int = 16384,
    ) -> None:
        if capture_mode not in CAPTURE_MODES:
            raise InputError("capture_mode", f"{capture_mode!r} is not one of {CAPTURE_MODES}",
                             "pick one of those")
        if not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
            raise InputError("head_dim", f"must be a positive integer, got {head_dim!r}",
                             "pass the attention head dimension d")
        if not isinstance(rows_per_shard, (int, np.integer)) or rows_per_shard < 1:
            raise InputError("rows_per_shard", f"must be >= 1, got {rows_per_shard!r}",
                             "pass a positive integer (e.g. 16384)")
        if not isinstance(model, str) or not model:
            raise InputError("model", "must be a non-empty string", "pass the model name")
        self.path = Path(path)
        self.model = model
        self.capture_mode = capture_mode
        self.head_dim = int(head_dim)
        self.rows_per_shard = int(rows_per_shard)
        self._pending = _Pending()
        self._open: int | None = None           # prompt id currently open
        self._open_buf = _Pending()             # blocks/rows of the open prompt
        self._closed = False
        man_path = self.path / MANIFEST_FILE
        if man_path.exists():
            self._resume(source)
        else:
            if self.path.exists() and any(self.path.iterdir()):
                raise InputError(str(self.path), "exists, is not empty and is not a row dataset",
                                 "choose a new output directory or delete this one")
            self.path.mkdir(parents=True, exist_ok=True)
            now = _dt.datetime.now(_dt.timezone.utc).isoformat()
            self._manifest: dict[str, Any] = {
                "format": FORMAT_NAME,
                "schema_version": SCHEMA_VERSION,
                "model": model,
                "capture_mode": capture_mode,
                "head_dim": self.head_dim,
                "created": now,
                "updated": now,
                "source": dict(source or {}),
                "shards": [],
                "counts": {"rows": 0, "prompts": 0, "blocks": 0, "query_rows": 0,
                           "logit_rows": 0},
            }
            self._index_parts: list[pl.DataFrame] = []
            self._prompt_parts: list[pl.DataFrame] = []
            self._prompt_ids: set[int] = set()
            atomic_write_json(man_path, self._manifest)
        self._next_row = self._manifest["counts"]["rows"]
        self._next_block = self._manifest["counts"]["blocks"]

    # -- resume -------------------------------------------------------------------------

    def _resume(self, source: dict[str, Any] | None) -> None:
        man = check_manifest(_read_json(self.path / MANIFEST_FILE), self.path / MANIFEST_FILE)
        for key, mine in (("model", self.model), ("capture_mode", self.capture_mode),
                          ("head_dim", self.head_dim)):
            if man[key] != mine:
                raise InputError(key, f"is {mine!r} but the existing dataset at {self.path} has "
                                 f"{man[key]!r}", "resume with the same settings or write to a "
                                 "new directory")
        if source:
            man["source"] = {**man["source"], **source}
        self._manifest = man
        index, prompts = _load_tables(self.path, man)
        self._index_parts = [index] if index.height else []
        self._prompt_parts = [prompts] if prompts.height else []
        self._prompt_ids = set(prompts["prompt_id"].to_list())
        # Files of an interrupted commit (a shard written, manifest not yet) are garbage.
        n_shards = len(man["shards"])
        for f in self.path.iterdir():
            if f.name.startswith("shard-") and f.suffix == ".npz":
                try:
                    k = int(f.stem.split("-")[1])
                except ValueError:
                    continue
                if k >= n_shards:
                    f.unlink()
            elif f.name.startswith(".") and f.name.endswith(".tmp"):
                f.unlink()

    # -- public state ---------------------------------------------------------------------

    @property
    def completed_prompts(self) -> frozenset[int]:
        """Prompt ids whose rows are all committed (safe to skip when resuming)."""
        return frozenset(self._prompt_ids)

    @property
    def n_rows(self) -> int:
        """Rows committed so far."""
        return int(self._manifest["counts"]["rows"])

    # -- adding content ------------------------------------------------------------------

    def add_prompt(
        self,
        prompt_id: int,
        tokens: Sequence[int] | np.ndarray,
        source: str = "",
        mode: str = "",
        text: str = "",
    ) -> None:
        """Open prompt ``prompt_id`` (token ids ``tokens``, int ``[L]``, may be empty).

        ``source`` names where the prompt came from, ``mode`` its capture mode (defaults to
        the dataset's), ``text`` is free-form metadata. One prompt is open at a time.
        """
        self._check_not_closed()
        if self._open is not None:
            raise InputError("prompt_id", f"prompt {self._open} is still open",
                             f"call end_prompt({self._open}) before adding prompt {prompt_id}")
        pid = _int_array(prompt_id, "prompt_id", length=1, lo=0)[0]
        if int(pid) in self._prompt_ids or any(p["prompt_id"] == pid for p in self._pending.prompts):
            raise InputError("prompt_id", f"prompt {int(pid)} already exists in {self.path}",
                             "use a new prompt id (skip ids in writer.completed_prompts)")
        toks = _int_array(np.asarray(tokens, dtype=np.int64) if len(tokens) == 0 else tokens,
                          "tokens")
        self._open = int(pid)
        self._open_buf = _Pending()
        self._open_buf.prompts.append({
            "prompt_id": int(pid), "tokens": toks.tolist(), "source": str(source),
            "mode": str(mode or self.capture_mode), "text": str(text),
        })

    def add_block(
        self,
        prompt_id: int,
        layer: int,
        kv_head: int,
        keys: np.ndarray | None,
        values: np.ndarray,
        positions: Sequence[int] | np.ndarray,
    ) -> int:
        """Store one (prompt, layer, KV head) block once; return its dataset-wide block id.

        ``keys``: post-RoPE keys float ``[L, d]`` (``None`` for a block used only by logits
        rows); ``values``: float ``[L, d]``; ``positions``: int ``[L]``, the absolute token
        position of each key (-1 when not applicable, e.g. synthetic).
        """
        self._check_open(prompt_id, "prompt_id")
        layer_ = int(_int_array(layer, "layer", length=1, lo=0)[0])
        kv_ = int(_int_array(kv_head, "kv_head", length=1, lo=0)[0])
        vals = _float_matrix(values, "values", self.head_dim)
        if vals.shape[0] < 1:
            raise InputError("values", "has no rows (L = 0)", "a block needs at least one key")
        ks = None if keys is None else _float_matrix(keys, "keys", self.head_dim, vals.shape[0])
        pos = _int_array(positions, "positions", length=vals.shape[0], lo=-1)
        bid = self._next_block + len(self._pending.blocks) + len(self._open_buf.blocks)
        self._open_buf.blocks.append(_Block(bid, int(prompt_id), layer_, kv_, vals, pos, ks))
        return bid

    def _open_block(self, block: int) -> _Block:
        base = self._next_block + len(self._pending.blocks)
        j = int(block) - base
        if not 0 <= j < len(self._open_buf.blocks):
            raise InputError("block", f"block {block} is not a block of the open prompt",
                             "add rows right after add_block, before end_prompt")
        return self._open_buf.blocks[j]

    def _row_common(self, blk: _Block, R: int, q_heads: Any, positions: Any, key_lo: Any,
                    key_hi: Any) -> dict[str, np.ndarray]:
        qh = _int_array(q_heads, "q_heads", length=R, lo=0)
        pos = _int_array(positions, "positions", length=R, lo=-1)
        lo = _int_array(key_lo, "key_lo", length=R, lo=0)
        hi = _int_array(key_hi, "key_hi", length=R, lo=1)
        L = blk.values.shape[0]
        bad = (hi <= lo) | (hi > L)
        if bad.any():
            i = int(np.argmax(bad))
            raise InputError(f"key_hi[{i}]", f"range [{lo[i]}, {hi[i]}) is empty or exceeds the "
                             f"block's {L} keys", "use 0 <= key_lo < key_hi <= L")
        return {
            "prompt_id": np.full(R, blk.prompt_id, np.int64), "layer": np.full(R, blk.layer, np.int64),
            "q_head": qh, "kv_head": np.full(R, blk.kv_head, np.int64), "position": pos,
            "n": hi - lo, "block": np.full(R, blk.block_id, np.int64), "key_lo": lo, "key_hi": hi,
        }

    def add_query_rows(
        self,
        block: int,
        queries: np.ndarray,
        q_heads: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        key_lo: Sequence[int] | np.ndarray,
        key_hi: Sequence[int] | np.ndarray,
        scale: float,
    ) -> None:
        """Add R query rows reading block ``block``.

        ``queries``: post-RoPE queries float ``[R, d]``; ``q_heads``, ``positions`` (query
        token position, -1 if n/a), ``key_lo``, ``key_hi``: int ``[R]``; row r sees keys
        ``[key_lo[r], key_hi[r])`` of the block. ``scale``: the model's logit scale (e.g.
        ``1/sqrt(d)``), so ``p = softmax(scale * q . K^T)`` is the model's attention row.
        """
        blk = self._open_block(block)
        if blk.keys is None:
            raise InputError("block", f"block {block} was stored without keys",
                             "pass keys to add_block, or use add_logit_rows")
        q = _float_matrix(queries, "queries", self.head_dim)
        R = q.shape[0]
        sc = float(scale)
        if not np.isfinite(sc) or sc <= 0:
            raise InputError("scale", f"must be finite and > 0, got {scale!r}",
                             "pass the attention logit scale (e.g. 1/sqrt(head_dim))")
        cols = self._row_common(blk, R, q_heads, positions, key_lo, key_hi)
        buf = self._open_buf
        cols["kind"] = np.full(R, "query", dtype=object)
        cols["scale"] = np.full(R, sc, np.float64)
        cols["local"] = np.arange(buf.n_query, buf.n_query + R, dtype=np.int64)  # rebased at flush
        buf.rows.append(cols)
        buf.queries.append(q)
        buf.n_query += R
        buf.n_rows += R

    def add_logit_rows(
        self,
        block: int,
        logits: Sequence[np.ndarray],
        q_heads: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        key_lo: Sequence[int] | np.ndarray | None = None,
        key_hi: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Add R rows given by their logits (``p = softmax(logits)``) over block ``block``.

        ``logits``: R float arrays, row r of length ``key_hi[r] - key_lo[r]``, stored as
        float32 or float64 (whichever is given; float64 if mixed). ``key_lo`` defaults to 0,
        ``key_hi`` to ``key_lo + len(logits[r])``.
        """
        blk = self._open_block(block)
        R = len(logits)
        rows = [np.asarray(x) for x in logits]
        for r, x in enumerate(rows):
            if x.ndim != 1 or x.size == 0 or not np.issubdtype(x.dtype, np.floating):
                raise InputError(f"logits[{r}]", f"must be a non-empty 1-D float array, got "
                                 f"dtype {x.dtype} shape {x.shape}", "pass one float vector per row")
            if not np.isfinite(x).all():
                raise InputError(f"logits[{r}]", "contains NaN or inf",
                                 "drop or fix that row before writing")
        lens = np.array([x.size for x in rows], dtype=np.int64)
        lo = np.zeros(R, np.int64) if key_lo is None else key_lo
        hi = (_int_array(lo, "key_lo", length=R) + lens) if key_hi is None else key_hi
        cols = self._row_common(blk, R, q_heads, positions, lo, hi)
        mism = cols["n"] != lens
        if mism.any():
            r = int(np.argmax(mism))
            raise InputError(f"logits[{r}]", f"has {lens[r]} entries but the row sees "
                             f"{cols['n'][r]} keys", "make len(logits[r]) == key_hi - key_lo")
        buf = self._open_buf
        cols["kind"] = np.full(R, "logits", dtype=object)
        cols["scale"] = np.full(R, np.nan, np.float64)
        cols["local"] = np.arange(buf.n_logit, buf.n_logit + R, dtype=np.int64)
        buf.rows.append(cols)
        buf.logits.extend(rows)
        buf.n_logit += R
        buf.n_rows += R

    def end_prompt(self, prompt_id: int) -> None:
        """Mark the open prompt complete; it is committed with the next shard."""
        self._check_open(prompt_id, "prompt_id")
        p, b = self._pending, self._open_buf
        # rebase the open prompt's local indices onto the pending shard's
        for cols in b.rows:
            q = cols["kind"] == "query"
            cols["local"] = cols["local"] + np.where(q, p.n_query, p.n_logit)
        p.blocks += b.blocks
        p.rows += b.rows
        p.queries += b.queries
        p.logits += b.logits
        p.prompts += b.prompts
        p.n_rows += b.n_rows
        p.n_query += b.n_query
        p.n_logit += b.n_logit
        self._open, self._open_buf = None, _Pending()
        if p.n_rows >= self.rows_per_shard:
            self.flush()

    # -- committing -----------------------------------------------------------------------

    def flush(self) -> None:
        """Commit every ended prompt: write its shard, index, prompts, then the manifest.

        The open prompt (if any) is not touched. Writing nothing is a no-op.
        """
        self._check_not_closed()
        p = self._pending
        if not p.prompts:
            return
        man = self._manifest
        shard_no = len(man["shards"])
        if p.blocks:  # blocks without rows are still stored (counted, ids stay dense)
            index = self._build_index(p, shard_no)
            fname = shard_name(shard_no)
            write_npz(self.path / fname, self._shard_arrays(p))
            man["shards"].append({
                "file": fname, "sha256": sha256_file(self.path / fname),
                "bytes": (self.path / fname).stat().st_size, "rows": p.n_rows,
                "blocks": len(p.blocks), "first_row": self._next_row,
                "first_block": self._next_block,
            })
            if index.height:
                self._index_parts.append(index)
            # The index and prompts only ever grow; readers ignore rows of shards the
            # manifest does not list yet, so writing them before the manifest is safe.
            with atomic_path(self.path / INDEX_FILE, suffix=".parquet") as tmp:
                (pl.concat(self._index_parts, how="vertical") if self._index_parts
                 else pl.DataFrame(schema=INDEX_SCHEMA)).write_parquet(tmp)
        prompts = pl.DataFrame(p.prompts, schema=PROMPT_SCHEMA)
        self._prompt_parts.append(prompts)
        with atomic_path(self.path / PROMPTS_FILE, suffix=".parquet") as tmp:
            pl.concat(self._prompt_parts, how="vertical").write_parquet(tmp)
        c = man["counts"]
        c["rows"] += p.n_rows
        c["prompts"] += len(p.prompts)
        c["blocks"] += len(p.blocks)
        c["query_rows"] += p.n_query
        c["logit_rows"] += p.n_logit
        man["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat()
        atomic_write_json(self.path / MANIFEST_FILE, man)  # the commit point
        self._prompt_ids.update(int(x["prompt_id"]) for x in p.prompts)
        self._next_row += p.n_rows
        self._next_block += len(p.blocks)
        self._pending = _Pending()

    def _build_index(self, p: _Pending, shard_no: int) -> pl.DataFrame:
        if not p.rows:
            return pl.DataFrame(schema=INDEX_SCHEMA)
        cols = {k: np.concatenate([r[k] for r in p.rows]) for k in p.rows[0]}
        cols["row_id"] = np.arange(self._next_row, self._next_row + p.n_rows, dtype=np.int64)
        cols["shard"] = np.full(p.n_rows, shard_no, np.int64)
        cols["kind"] = cols["kind"].astype(str)
        return pl.DataFrame({k: cols[k] for k in INDEX_SCHEMA}, schema=INDEX_SCHEMA)

    def _shard_arrays(self, p: _Pending) -> dict[str, np.ndarray]:
        d = self.head_dim
        bl = p.blocks
        kinds = np.concatenate([r["kind"] for r in p.rows] or [np.zeros(0, object)])
        row_ids = np.arange(self._next_row, self._next_row + p.n_rows, dtype=np.int64)
        local = np.concatenate([r["local"] for r in p.rows] or [np.zeros(0, np.int64)])
        is_q = kinds == "query"
        q_ids = np.empty(p.n_query, np.int64)
        q_ids[local[is_q]] = row_ids[is_q]
        l_ids = np.empty(p.n_logit, np.int64)
        l_ids[local[~is_q]] = row_ids[~is_q]
        logit_dtype = (np.float32 if p.logits and all(x.dtype == np.float32 for x in p.logits)
                       else np.float64)
        return {
            "block_id": np.array([b.block_id for b in bl], np.int64),
            "block_prompt": np.array([b.prompt_id for b in bl], np.int64),
            "block_layer": np.array([b.layer for b in bl], np.int64),
            "block_kv_head": np.array([b.kv_head for b in bl], np.int64),
            "val_off": _offsets(np.array([b.values.shape[0] for b in bl], np.int64)),
            "values": np.concatenate([b.values for b in bl]),
            "positions": np.concatenate([b.positions for b in bl]),
            "key_off": _offsets(np.array([0 if b.keys is None else b.keys.shape[0] for b in bl],
                                         np.int64)),
            "keys": np.concatenate([b.keys for b in bl if b.keys is not None] or
                                   [np.zeros((0, d), np.float32)]),
            "query_row_id": q_ids,
            "queries": np.concatenate(p.queries) if p.queries else np.zeros((0, d), np.float32),
            "logit_row_id": l_ids,
            "logit_off": _offsets(np.array([x.size for x in p.logits], np.int64)),
            "logits": (np.concatenate([x.astype(logit_dtype) for x in p.logits]) if p.logits
                       else np.zeros(0, logit_dtype)),
        }

    def close(self) -> None:
        """Commit everything ended; refuse if a prompt is still open."""
        if self._closed:
            return
        if self._open is not None:
            raise InputError("prompt_id", f"prompt {self._open} is still open at close()",
                             f"call end_prompt({self._open}) first")
        self.flush()
        self._closed = True

    def abort_open_prompt(self) -> None:
        """Drop the open prompt's uncommitted blocks and rows (e.g. after an error)."""
        self._open, self._open_buf = None, _Pending()

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            # Commit what is complete; the failing prompt is dropped, to be redone on resume.
            self.abort_open_prompt()
            try:
                self.flush()
            finally:
                self._closed = True
            return
        self.close()

    def _check_not_closed(self) -> None:
        if self._closed:
            raise InputError("RowWriter", "is closed", "open a new RowWriter to append (it resumes)")

    def _check_open(self, prompt_id: int, field_name: str) -> None:
        self._check_not_closed()
        if self._open is None or int(prompt_id) != self._open:
            raise InputError(field_name, f"prompt {prompt_id} is not the open prompt "
                             f"(open: {self._open})", "call add_prompt(prompt_id, tokens) first")


# --------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------


def _load_tables(path: Path, man: dict[str, Any]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Index and prompts restricted to what the manifest committed; checked for consistency."""
    n_shards = len(man["shards"])
    counts = man["counts"]
    if n_shards:
        index = _check_columns(_read_parquet(path / INDEX_FILE), INDEX_SCHEMA, path / INDEX_FILE)
        index = index.filter(pl.col("shard") < n_shards)
    else:
        index = pl.DataFrame(schema=INDEX_SCHEMA)
    if counts["prompts"]:
        prompts = _check_columns(_read_parquet(path / PROMPTS_FILE), PROMPT_SCHEMA,
                                 path / PROMPTS_FILE)
        prompts = prompts.head(counts["prompts"])
    else:
        prompts = pl.DataFrame(schema=PROMPT_SCHEMA)
    if index.height != counts["rows"]:
        raise CorruptFileError(str(path / INDEX_FILE), f"holds {index.height} committed rows, "
                               f"the manifest says {counts['rows']}", _REGEN)
    if prompts.height != counts["prompts"]:
        raise CorruptFileError(str(path / PROMPTS_FILE), f"holds {prompts.height} prompts, the "
                               f"manifest says {counts['prompts']}", _REGEN)
    if index.height and not np.array_equal(index["row_id"].to_numpy(),
                                           np.arange(index.height, dtype=np.int64)):
        raise CorruptFileError(str(path / INDEX_FILE), "row_id is not 0..N-1 in order", _REGEN)
    if prompts["prompt_id"].n_unique() != prompts.height:
        raise CorruptFileError(str(path / PROMPTS_FILE), "has duplicate prompt_id", _REGEN)
    per_shard = index.group_by("shard").len().sort("shard")
    want = {i: sh["rows"] for i, sh in enumerate(man["shards"])}
    got = dict(zip(per_shard["shard"].to_list(), per_shard["len"].to_list()))
    for i, r in want.items():
        if got.get(i, 0) != r:
            raise CorruptFileError(str(path / INDEX_FILE), f"has {got.get(i, 0)} rows for "
                                   f"{shard_name(i)}, the manifest says {r}", _REGEN)
    return index, prompts


class _Shard:
    """The arrays of one loaded, structurally checked shard."""

    def __init__(self, path: Path, arrays: dict[str, np.ndarray], d: int) -> None:
        self.path = path
        a = arrays
        self.a = a

        def bad(what: str) -> CorruptFileError:
            return CorruptFileError(str(path), what, _REGEN)

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
                                   "does not hold", _REGEN)
        return j


def _query_p_py(Kt: np.ndarray, Q: np.ndarray, scale: np.ndarray, lo: np.ndarray,
                hi: np.ndarray, out: np.ndarray, out_off: np.ndarray) -> int:  # pragma: no cover
    """p of query rows reading one block, written into ``out``; returns -1 or a bad row.

    ``Kt``: float64 ``[d, W]`` (the block's keys, transposed, columns c0..c0+W);
    ``Q``: float32 ``[r, d]``; ``scale``: float64 ``[r]``; ``lo``, ``hi``: int64 ``[r]``
    relative to c0; row i's weights go to ``out[out_off[i] : out_off[i] + hi[i] - lo[i]]``.
    Each row is computed on its own, summing over d in a fixed order (no BLAS, no
    reassociation), so a row's p has the same bits whatever batch it is read in.
    """
    d = Kt.shape[0]
    for i in range(Q.shape[0]):
        a = lo[i]
        m = hi[i] - a
        o = out_off[i]
        z = np.zeros(m)
        for k in range(d):
            qk = np.float64(Q[i, k])
            kr = Kt[k, a : a + m]  # a slice keeps the inner loop free of index arithmetic (SIMD)
            for j in range(m):
                z[j] += qk * kr[j]
        mx = -np.inf
        for j in range(m):
            z[j] *= scale[i]
            if not np.isfinite(z[j]):
                return i
            if z[j] > mx:
                mx = z[j]
        tot = 0.0
        for j in range(m):
            z[j] = np.exp(z[j] - mx)
            tot += z[j]
        for j in range(m):
            out[o + j] = z[j] / tot
    return -1


def _logits_p_py(x: np.ndarray, starts: np.ndarray, n: np.ndarray, out: np.ndarray,
                 out_off: np.ndarray) -> int:  # pragma: no cover (numba-compiled)
    """p = softmax of stored logits ``x[starts[i] : starts[i] + n[i]]`` (float32/64) into
    ``out[out_off[i]:...]``, float64, one row at a time; returns -1 or the first bad row."""
    for i in range(n.shape[0]):
        a = starts[i]
        o = out_off[i]
        mx = -np.inf
        for j in range(n[i]):
            v = np.float64(x[a + j])
            if not np.isfinite(v):
                return i
            if v > mx:
                mx = v
        tot = 0.0
        for j in range(n[i]):
            e = np.exp(np.float64(x[a + j]) - mx)
            out[o + j] = e
            tot += e
        for j in range(n[i]):
            out[o + j] /= tot
    return -1


_JIT: dict[str, Any] = {}


def _jit(name: str) -> Any:
    """The numba-compiled kernel ``name`` (compiled on first use, cached on disk)."""
    if name not in _JIT:
        import numba

        fn = {"query": _query_p_py, "logits": _logits_p_py}[name]
        _JIT[name] = numba.njit(cache=True, nogil=True)(fn)
    return _JIT[name]


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
    def open(cls, path: str | os.PathLike[str], *, allow_empty: bool = False) -> RowStore:
        """Open the dataset at ``path``. An empty dataset raises unless ``allow_empty``."""
        path = Path(path)
        if not path.is_dir():
            raise InputError(str(path), "is not a directory", "pass a row dataset directory")
        man = check_manifest(_read_json(path / MANIFEST_FILE), path / MANIFEST_FILE)
        index, prompts = _load_tables(path, man)
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
        """The prompts table (``prompt_id, tokens, source, mode, text``)."""
        return self._prompts

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
        }

    # -- shards ---------------------------------------------------------------------------

    def _load_shard(self, k: int, verify: bool = True) -> _Shard:
        entry = self.manifest["shards"][k]
        fpath = self.path / entry["file"]
        fix = _REGEN
        if not fpath.exists():
            raise CorruptFileError(str(fpath), "is missing", fix)
        if verify and k not in self._verified:
            size = fpath.stat().st_size
            if size != entry["bytes"]:
                raise CorruptFileError(str(fpath), f"has {size} bytes, the manifest says "
                                       f"{entry['bytes']} (truncated or replaced)", fix)
            if sha256_file(fpath) != entry["sha256"]:
                raise CorruptFileError(str(fpath), "fails its SHA-256 checksum (corrupt)", fix)
        try:
            with np.load(fpath, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
        except Exception as exc:  # BadZipFile, ValueError, OSError, EOFError...
            raise CorruptFileError(str(fpath), f"cannot be loaded ({type(exc).__name__}: {exc})",
                                   fix) from None
        sh = _Shard(fpath, arrays, self.head_dim)
        self._check_shard_index(k, sh)
        self._verified.add(k)
        return sh

    def _check_shard_index(self, k: int, sh: _Shard) -> None:
        rows = self._index.filter(pl.col("shard") == k)
        a = sh.a

        def bad(what: str) -> CorruptFileError:
            return CorruptFileError(str(sh.path), f"disagrees with index.parquet: {what}", _REGEN)

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
                          extra: Sequence[str]) -> RowBatch:
        """Build the RowBatch for ``rows`` (index rows, all in shard ``sh``)."""
        a = sh.a
        n = rows["n"].to_numpy()
        lo = rows["key_lo"].to_numpy()
        hi = rows["key_hi"].to_numpy()
        rid = rows["row_id"].to_numpy()
        kind = rows["kind"].to_numpy()
        local = rows["local"].to_numpy()
        p_off = _offsets(n)
        ublocks, inv = np.unique(rows["block"].to_numpy(), return_inverse=True)
        bl = sh.block_local(ublocks)
        vlen = sh.vlen[bl]
        pool_off = _offsets(vlen)
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
            bad = _jit("logits")(a["logits"], a["logit_off"][local[li]], n[li], p, p_off[li])
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
                k0, k1 = int(a["key_off"][bl[b]]), int(a["key_off"][bl[b] + 1])
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
                bad = _jit("query")(Kt, Q, scale[grp], lo[grp] - c0, hi[grp] - c0, p, p_off[grp])
                if bad >= 0:
                    raise InputError(f"row_id {int(rid[grp[bad]])}",
                                     "its attention logits overflow (not finite)",
                                     "check the stored query, keys and scale")
        meta = rows.select([*META_COLUMNS, *[c for c in extra if c not in META_COLUMNS]])
        return RowBatch(p=p, p_off=p_off, values=values, v_start=v_start, key_index=key_index,
                        meta=meta, keys=keys)

    # -- public reads ---------------------------------------------------------------------

    def iter_batches(
        self,
        max_rows: int = 4096,
        *,
        filter: pl.Expr | None = None,
        columns: Sequence[str] = (),
        with_keys: bool = False,
        verify: bool = True,
    ) -> Iterator[RowBatch]:
        """Stream the rows in ``row_id`` order as batches of at most ``max_rows`` rows.

        One shard is held in memory at a time; a batch may span two shards (every batch
        but the last has exactly ``max_rows`` rows). ``filter``: a polars expression on the
        index columns selecting rows (e.g. ``pl.col("layer") == 3``); ``columns``: extra
        index columns to carry in ``meta``; ``with_keys``: also return float64 keys;
        ``verify``: check each shard's size and SHA-256 before first use.
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
                carry.append(self._batch_from_shard(sh, rows.slice(start, take), with_keys, columns))
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
        ids = _int_array(np.asarray(row_ids, dtype=np.int64) if len(row_ids) == 0 else row_ids,
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
                                           _REGEN)
        missing = set(self._index["prompt_id"].unique().to_list()) - set(
            self._prompts["prompt_id"].to_list())
        if missing:
            raise CorruptFileError(str(self.path / PROMPTS_FILE), f"lacks prompts "
                                   f"{sorted(missing)[:5]} referenced by rows", _REGEN)
        return self.summary()
