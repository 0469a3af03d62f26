"""Writing the attention-row dataset (format: ``docs/formats.md``).

:class:`RowWriter` appends prompts, key/value blocks and rows, and commits them shard by
shard (array shard, then ``index.parquet``, ``prompts.parquet``, and last ``manifest.json``,
each written atomically), so a crash loses at most the prompts not yet committed. The
manifest says ``complete: false`` from the moment a writer starts changing the dataset
until it closes normally; readers refuse an incomplete dataset. One writer at a time: the
writer holds the dataset's lock (:func:`evictlab.io.exclusive_lock`) while it is open.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from evictlab.errors import InputError
from evictlab.io import (
    atomic_path,
    atomic_write_json,
    check_output_path,
    exclusive_lock,
    remove_temp_files,
    sha256_file,
    write_npz,
)
from evictlab.rows.batch import ragged_offsets
from evictlab.rows.checks import check_facts, float_matrix, int_array
from evictlab.rows.reader import load_tables, read_manifest
from evictlab.rows.schema import (
    CAPTURE_MODES,
    DATASET_FILES,
    FORMAT_NAME,
    INDEX_FILE,
    INDEX_SCHEMA,
    MANIFEST_FILE,
    PROMPTS_FILE,
    SCHEMA_VERSION,
    is_complete,
    prompt_schema,
    shard_name,
)


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
    of an interrupted, uncommitted shard are discarded. A dataset keeps the schema version
    it was created with: resuming a version-1 dataset writes version-1 prompts, which have no
    fact labels (:attr:`writes_labels` is False and ``add_prompt(facts=...)`` is refused), so
    one dataset never mixes labelled and unlabelled layouts.

    Completion: the manifest says ``complete: false`` from the writer's first change to the
    dataset (a new dataset's first manifest; on a resumed complete dataset, a manifest
    written *before* its first new file) until :meth:`close` commits the rest and writes
    ``complete: true``. An exception inside ``with`` or a killed process leaves it false,
    and readers refuse the dataset until a writer resumes and closes it. ``expected``
    (e.g. ``{"rows": 50000}`` or ``{"prompts": 64}``) records the totals the run aims at,
    so ``rows inspect`` can say how far an incomplete dataset got.

    Paths and locking: ``path``'s parent folder must exist (``check_output_path``), and the
    writer holds the dataset's write lock from construction until :meth:`close` (or the
    end of ``with``); a second writer on the same path is refused at once.
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
        expected: dict[str, int] | None = None,
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
        if expected is not None and not (isinstance(expected, dict) and all(
                isinstance(v, (int, np.integer)) and v >= 0 for v in expected.values())):
            raise InputError("expected", f"must map names to non-negative integers, got {expected!r}",
                             "pass e.g. {'rows': 50000} or {'prompts': 64}")
        self.path = check_output_path(path, "--out", directory=True)
        self.model = model
        self.capture_mode = capture_mode
        self.head_dim = int(head_dim)
        self.rows_per_shard = int(rows_per_shard)
        self._pending = _Pending()
        self._open: int | None = None           # prompt id currently open
        self._open_buf = _Pending()             # blocks/rows of the open prompt
        self._closed = False
        self._lock = exclusive_lock(self.path, "--out").acquire()
        try:
            self._start(source, expected)
        except BaseException:
            self._closed = True
            self._lock.release()
            raise
        self._next_row = self._manifest["counts"]["rows"]
        self._next_block = self._manifest["counts"]["blocks"]

    @property
    def schema_version(self) -> int:
        """The dataset's schema version (this code's for a new dataset, the old one's when resuming)."""
        return int(self._manifest["schema_version"])

    @property
    def writes_labels(self) -> bool:
        """Whether prompts of this dataset can carry fact labels (schema version >= 2)."""
        return self.schema_version >= 2

    def _start(self, source: dict[str, Any] | None, expected: dict[str, int] | None) -> None:
        """Resume the dataset at ``self.path`` or create it (caller holds the lock)."""
        man_path = self.path / MANIFEST_FILE
        target = None if expected is None else {k: int(v) for k, v in expected.items()}
        if man_path.exists():
            self._resume(source)
            if target is not None:
                self._manifest["expected"] = target  # recorded at the next commit
        else:
            if self.path.exists():
                remove_temp_files(self.path, (MANIFEST_FILE,))  # a run killed while starting
                if any(self.path.iterdir()):
                    raise InputError("--out", f"{self.path} exists, is not empty and is not a "
                                     "row dataset", "choose a new output directory or delete "
                                     "this one")
            self.path.mkdir(exist_ok=True)
            now = _dt.datetime.now(_dt.timezone.utc).isoformat()
            self._manifest: dict[str, Any] = {
                "format": FORMAT_NAME,
                "schema_version": SCHEMA_VERSION,
                "model": self.model,
                "capture_mode": self.capture_mode,
                "head_dim": self.head_dim,
                "created": now,
                "updated": now,
                "source": dict(source or {}),
                "shards": [],
                "counts": {"rows": 0, "prompts": 0, "blocks": 0, "query_rows": 0,
                           "logit_rows": 0},
                "complete": False,
            }
            self._index_parts: list[pl.DataFrame] = []
            self._prompt_parts: list[pl.DataFrame] = []
            self._prompt_ids: set[int] = set()
            self._disk_complete = False
            if target is not None:
                self._manifest["expected"] = target
            atomic_write_json(man_path, self._manifest)

    # -- resume -------------------------------------------------------------------------

    def _resume(self, source: dict[str, Any] | None) -> None:
        man = read_manifest(self.path)
        for key, mine in (("model", self.model), ("capture_mode", self.capture_mode),
                          ("head_dim", self.head_dim)):
            if man[key] != mine:
                raise InputError(key, f"is {mine!r} but the existing dataset at {self.path} has "
                                 f"{man[key]!r}", "resume with the same settings or write to a "
                                 "new directory")
        if source:
            man["source"] = {**man["source"], **source}
        self._manifest = man
        # What the manifest on disk says; the first commit of new content marks it
        # incomplete before touching any other file (see _mark_incomplete).
        self._disk_complete = is_complete(man)
        index, prompts = load_tables(self.path, man)
        self._index_parts = [index] if index.height else []
        # the reader adds a null ``facts`` column to version-1 prompts; keep the disk layout
        prompts = prompts.select(list(prompt_schema(man["schema_version"])))
        self._prompt_parts = [prompts] if prompts.height else []
        self._prompt_ids = set(prompts["prompt_id"].to_list())
        if not self._disk_complete:
            self._repair_tables()
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
        remove_temp_files(self.path, DATASET_FILES)

    def _repair_tables(self) -> None:
        """Rewrite index and prompts to exactly the committed rows.

        In an incomplete dataset these files may be one commit ahead of the manifest (a
        crash between the table writes and the manifest write); rewriting them from the
        committed frames makes the checksums the next manifest records true.
        """
        man = self._manifest
        for name, parts, schema, key, used in (
                (INDEX_FILE, self._index_parts, INDEX_SCHEMA, "index_sha256", bool(man["shards"])),
                (PROMPTS_FILE, self._prompt_parts, prompt_schema(self.schema_version), "prompts_sha256",
                 man["counts"]["prompts"] > 0)):
            if used:
                man[key] = self._write_table(name, parts, schema)
            else:
                (self.path / name).unlink(missing_ok=True)
                man.pop(key, None)

    def _mark_incomplete(self) -> None:
        """Write ``complete: false`` before the first change to a complete dataset, so a
        crash mid-commit never leaves a manifest that says complete over changed files."""
        if self._disk_complete:
            self._manifest["complete"] = False
            atomic_write_json(self.path / MANIFEST_FILE, self._manifest)
            self._disk_complete = False

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
        facts: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        """Open prompt ``prompt_id`` (token ids ``tokens``, int ``[L]``, may be empty).

        ``source`` names where the prompt came from, ``mode`` its capture mode (defaults to
        the dataset's), ``text`` is free-form metadata. ``facts``: the prompt's fact labels
        (token spans inside ``tokens``, in order, not overlapping; checked by
        :func:`evictlab.rows.checks.check_facts`), or None for an unlabelled prompt; refused
        on a version-1 dataset (:attr:`writes_labels`). One prompt is open at a time.
        """
        self._check_not_closed()
        if self._open is not None:
            raise InputError("prompt_id", f"prompt {self._open} is still open",
                             f"call end_prompt({self._open}) before adding prompt {prompt_id}")
        pid = int_array(prompt_id, "prompt_id", length=1, lo=0)[0]
        if int(pid) in self._prompt_ids or any(p["prompt_id"] == pid for p in self._pending.prompts):
            raise InputError("prompt_id", f"prompt {int(pid)} already exists in {self.path}",
                             "use a new prompt id (skip ids in writer.completed_prompts)")
        toks = int_array(np.asarray(tokens, dtype=np.int64) if len(tokens) == 0 else tokens,
                          "tokens")
        labels = check_facts(facts, int(toks.shape[0]))
        if labels is not None and not self.writes_labels:
            raise InputError("facts", f"the dataset at {self.path} has schema version {self.schema_version}, "
                             "which has no fact labels", "write labelled prompts into a new dataset")
        self._open = int(pid)
        self._open_buf = _Pending()
        row: dict[str, Any] = {
            "prompt_id": int(pid), "tokens": toks.tolist(), "source": str(source),
            "mode": str(mode or self.capture_mode), "text": str(text),
        }
        if self.writes_labels:
            row["facts"] = labels
        self._open_buf.prompts.append(row)

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
        layer_ = int(int_array(layer, "layer", length=1, lo=0)[0])
        kv_ = int(int_array(kv_head, "kv_head", length=1, lo=0)[0])
        vals = float_matrix(values, "values", self.head_dim)
        if vals.shape[0] < 1:
            raise InputError("values", "has no rows (L = 0)", "a block needs at least one key")
        ks = None if keys is None else float_matrix(keys, "keys", self.head_dim, vals.shape[0])
        pos = int_array(positions, "positions", length=vals.shape[0], lo=-1)
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
        qh = int_array(q_heads, "q_heads", length=R, lo=0)
        pos = int_array(positions, "positions", length=R, lo=-1)
        lo = int_array(key_lo, "key_lo", length=R, lo=0)
        hi = int_array(key_hi, "key_hi", length=R, lo=1)
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
        q = float_matrix(queries, "queries", self.head_dim)
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
        hi = (int_array(lo, "key_lo", length=R) + lens) if key_hi is None else key_hi
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

        The open prompt (if any) is not touched. Writing nothing is a no-op. The dataset
        stays incomplete (``complete: false``) until :meth:`close`.
        """
        self._check_not_closed()
        self._commit(complete=False)

    def _commit(self, complete: bool) -> None:
        """Commit the ended prompts and write the manifest with ``complete``."""
        p = self._pending
        man = self._manifest
        now = _dt.datetime.now(_dt.timezone.utc).isoformat()
        if not p.prompts:
            if complete and not self._disk_complete:
                man.update(complete=True, updated=now)
                atomic_write_json(self.path / MANIFEST_FILE, man)
                self._disk_complete = True
            return
        self._mark_incomplete()
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
            # One chunk, so a resumed writer (which reads the index back as one frame)
            # writes the same bytes as an uninterrupted one.
            man["index_sha256"] = self._write_table(
                INDEX_FILE, self._index_parts, INDEX_SCHEMA)
        elif man["shards"] and "index_sha256" not in man:  # a dataset from before checksums
            man["index_sha256"] = sha256_file(self.path / INDEX_FILE)
        schema = prompt_schema(self.schema_version)
        self._prompt_parts.append(pl.DataFrame(p.prompts, schema=schema))
        man["prompts_sha256"] = self._write_table(PROMPTS_FILE, self._prompt_parts, schema)
        c = man["counts"]
        c["rows"] += p.n_rows
        c["prompts"] += len(p.prompts)
        c["blocks"] += len(p.blocks)
        c["query_rows"] += p.n_query
        c["logit_rows"] += p.n_logit
        man.update(complete=complete, updated=now)
        atomic_write_json(self.path / MANIFEST_FILE, man)  # the commit point
        self._disk_complete = complete
        self._prompt_ids.update(int(x["prompt_id"]) for x in p.prompts)
        self._next_row += p.n_rows
        self._next_block += len(p.blocks)
        self._pending = _Pending()

    def _write_table(self, name: str, parts: list[pl.DataFrame],
                     schema: dict[str, pl.DataType]) -> str:
        """Write ``concat(parts)`` as one-chunk Parquet ``name`` atomically; return its SHA-256."""
        df = pl.concat(parts, how="vertical").rechunk() if parts else pl.DataFrame(schema=schema)
        with atomic_path(self.path / name, suffix=".parquet") as tmp:
            df.write_parquet(tmp)
        return sha256_file(self.path / name)

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
            "val_off": ragged_offsets(np.array([b.values.shape[0] for b in bl], np.int64)),
            "values": np.concatenate([b.values for b in bl]),
            "positions": np.concatenate([b.positions for b in bl]),
            "key_off": ragged_offsets(np.array([0 if b.keys is None else b.keys.shape[0] for b in bl],
                                         np.int64)),
            "keys": np.concatenate([b.keys for b in bl if b.keys is not None] or
                                   [np.zeros((0, d), np.float32)]),
            "query_row_id": q_ids,
            "queries": np.concatenate(p.queries) if p.queries else np.zeros((0, d), np.float32),
            "logit_row_id": l_ids,
            "logit_off": ragged_offsets(np.array([x.size for x in p.logits], np.int64)),
            "logits": (np.concatenate([x.astype(logit_dtype) for x in p.logits]) if p.logits
                       else np.zeros(0, logit_dtype)),
        }

    def close(self, complete: bool = True) -> None:
        """Commit everything ended, mark the dataset complete (unless ``complete=False``)
        and release the lock; refuse if a prompt is still open."""
        if self._closed:
            return
        if self._open is not None:
            raise InputError("prompt_id", f"prompt {self._open} is still open at close()",
                             f"call end_prompt({self._open}) first")
        try:
            self._commit(complete)
        finally:
            self._closed = True
            self._lock.release()

    def abort_open_prompt(self) -> None:
        """Drop the open prompt's uncommitted blocks and rows (e.g. after an error)."""
        self._open, self._open_buf = None, _Pending()

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            # Commit what is complete; the failing prompt is dropped, to be redone on resume.
            # The dataset stays marked incomplete.
            self.abort_open_prompt()
            if self._closed:
                return
            try:
                self._commit(complete=False)
            finally:
                self._closed = True
                self._lock.release()
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
