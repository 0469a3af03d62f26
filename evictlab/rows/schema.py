"""The on-disk schema of the attention-row dataset (see ``docs/formats.md``).

A dataset is a directory::

    manifest.json          schema version, model, capture mode, head dim, committed shards
    index.parquet          one row per attention row (columns: :data:`INDEX_SCHEMA`)
    prompts.parquet        one row per prompt (columns: :data:`PROMPT_SCHEMA`)
    shard-00000.npz ...    array shards (arrays: :data:`SHARD_ARRAYS`)

The manifest is the commit point: a shard, and the index rows that point into it, count
only once the manifest lists the shard. Its ``complete`` flag says whether the run that
wrote the dataset finished (readers refuse an incomplete dataset). This module holds the
names, dtypes and the manifest check; :mod:`evictlab.rows.writer` writes and
:mod:`evictlab.rows.reader` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from evictlab.errors import CorruptFileError

#: Format name written into every manifest, so a stray JSON file is not mistaken for one.
FORMAT_NAME = "evictlab-rows"
#: The schema version this code writes. Readers accept exactly the versions in
#: :data:`SUPPORTED_SCHEMA_VERSIONS`; a change to any file layout, dtype or meaning bumps it.
#: Version 2 added the ``facts`` column of prompts.parquet (fact labels); a version-1
#: dataset is read with ``facts`` null on every prompt (unlabelled), and a writer that
#: resumes one keeps writing version 1 (:func:`prompt_schema`).
SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = frozenset({1, 2})

MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.parquet"
PROMPTS_FILE = "prompts.parquet"
RECORD_FILE = "run_record.json"  # = evictlab.record.RECORD_NAME (the one run-record name)

#: Names of the files a writer writes (shards by prefix), for cleaning up after a crash.
DATASET_FILES = (MANIFEST_FILE, INDEX_FILE, PROMPTS_FILE, "shard-")

#: The fix named by every error about a damaged dataset file.
REGEN_FIX = ("re-create the dataset: rerun the command that wrote it (`evictlab rows synth ... "
             "--overwrite`, or `evictlab capture` into a new --out)")

#: Capture modes a manifest may declare. "synthetic" marks generated rows (no model).
CAPTURE_MODES = ("query-agnostic", "query-aware", "synthetic")
#: Row kinds: "query" rows store a query vector and compute p = softmax(scale * q.K^T);
#: "logits" rows store the logits directly (p = softmax(logits)).
ROW_KINDS = ("query", "logits")

#: index.parquet columns, in order, with their dtypes.
INDEX_SCHEMA: dict[str, pl.DataType] = {
    "row_id": pl.Int64(),      # unique, dense from 0, in commit order
    "prompt_id": pl.Int64(),
    "layer": pl.Int64(),
    "q_head": pl.Int64(),
    "kv_head": pl.Int64(),
    "position": pl.Int64(),    # absolute token position of the query, -1 if n/a
    "n": pl.Int64(),           # keys the row sees = key_hi - key_lo
    "shard": pl.Int64(),       # shard number (file shard-{shard:05d}.npz)
    "block": pl.Int64(),       # dataset-wide block id (one per (prompt, layer, kv_head))
    "key_lo": pl.Int64(),      # the row sees keys [key_lo, key_hi) of its block
    "key_hi": pl.Int64(),
    "kind": pl.String(),       # "query" or "logits"
    "scale": pl.Float64(),     # logit scale of a query row (NaN for logits rows)
    "local": pl.Int64(),       # index of the row's query / logits inside its shard
}

#: The columns of ``RowBatch.meta`` (the contract in docs/architecture.md).
META_COLUMNS = ("row_id", "prompt_id", "layer", "q_head", "kv_head", "position", "n")

#: Kinds of labelled facts (``facts[].kind``): a needle ("... for KEY is VALUE."), a
#: variable assignment ("VAR KEY = VALUE."), or another fact (span only).
FACT_KINDS = ("needle", "assignment", "fact")

#: One labelled fact of a prompt (schema version 2): token positions in the prompt's
#: ``tokens``; the fact is ``tokens[start:end]``, its key ``[key_start, key_end)`` and its
#: value ``[value_start, value_end)`` (-1, -1 when absent); ``asked``: the question asks
#: for it (its keys are the *useful* keys of docs/theory.md section 7).
FACT_STRUCT = pl.Struct({
    "kind": pl.String(), "start": pl.Int64(), "end": pl.Int64(),
    "key_start": pl.Int64(), "key_end": pl.Int64(),
    "value_start": pl.Int64(), "value_end": pl.Int64(), "asked": pl.Boolean(),
})

#: prompts.parquet columns of schema version 1.
PROMPT_SCHEMA_V1: dict[str, pl.DataType] = {
    "prompt_id": pl.Int64(),
    "tokens": pl.List(pl.Int64()),
    "source": pl.String(),     # where the prompt came from (dataset name, generator)
    "mode": pl.String(),       # capture mode of this prompt
    "text": pl.String(),       # free-form metadata (e.g. a short description), may be ""
}
#: prompts.parquet columns (this version), in commit order of the prompts. ``facts`` is
#: null for an unlabelled prompt (text sources, synthetic rows, every version-1 prompt).
PROMPT_SCHEMA: dict[str, pl.DataType] = {**PROMPT_SCHEMA_V1, "facts": pl.List(FACT_STRUCT)}


def prompt_schema(version: int) -> dict[str, pl.DataType]:
    """The prompts.parquet columns a dataset of schema ``version`` has on disk."""
    return PROMPT_SCHEMA_V1 if version == 1 else PROMPT_SCHEMA

#: Arrays inside one shard-XXXXX.npz, with dtype and shape (B blocks, Rq query rows,
#: Rl logits rows, d head dim). Blocks are stored once, rows point into them.
SHARD_ARRAYS: dict[str, tuple[str, str]] = {
    "block_id": ("int64", "[B]"),
    "block_prompt": ("int64", "[B]"),
    "block_layer": ("int64", "[B]"),
    "block_kv_head": ("int64", "[B]"),
    "val_off": ("int64", "[B+1]"),
    "values": ("float32", "[sum L_b, d]"),
    "positions": ("int64", "[sum L_b]"),
    "key_off": ("int64", "[B+1]"),
    "keys": ("float32", "[sum Lk_b, d]"),
    "query_row_id": ("int64", "[Rq]"),
    "queries": ("float32", "[Rq, d]"),
    "logit_row_id": ("int64", "[Rl]"),
    "logit_off": ("int64", "[Rl+1]"),
    "logits": ("float32|float64", "[sum n over logits rows]"),
}


def shard_name(shard: int) -> str:
    """File name of shard number ``shard``."""
    return f"shard-{shard:05d}.npz"


def check_manifest(man: Any, path: Path) -> dict[str, Any]:
    """Check a parsed manifest's structure and schema version; return it.

    Raises :class:`CorruptFileError` naming ``path`` on anything a reader cannot trust.
    """
    fix_regen = REGEN_FIX
    if not isinstance(man, dict) or man.get("format") != FORMAT_NAME:
        raise CorruptFileError(
            str(path), f"is not an evictlab row-dataset manifest (format != {FORMAT_NAME!r})",
            "point at a dataset directory written by evictlab, or " + fix_regen,
        )
    version = man.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise CorruptFileError(
            f"{path}: schema_version",
            f"unknown schema version {version!r} (this evictlab reads "
            f"{sorted(SUPPORTED_SCHEMA_VERSIONS)})",
            "upgrade evictlab to a version that reads it, or " + fix_regen,
        )
    required = {
        "model": str, "capture_mode": str, "head_dim": int, "created": str,
        "shards": list, "counts": dict, "source": dict,
    }
    for key, typ in required.items():
        if not isinstance(man.get(key), typ):
            raise CorruptFileError(
                f"{path}: {key}", f"missing or not a {typ.__name__}", fix_regen
            )
    if man["capture_mode"] not in CAPTURE_MODES:
        raise CorruptFileError(
            f"{path}: capture_mode", f"{man['capture_mode']!r} is not one of {CAPTURE_MODES}",
            fix_regen,
        )
    if man["head_dim"] < 1:
        raise CorruptFileError(f"{path}: head_dim", "must be >= 1", fix_regen)
    # Optional keys (absent in datasets written before they existed; see is_complete).
    if "complete" in man and not isinstance(man["complete"], bool):
        raise CorruptFileError(f"{path}: complete", "is not true/false", fix_regen)
    expected = man.get("expected", {})
    if not isinstance(expected, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in expected.values()):
        raise CorruptFileError(f"{path}: expected", "is not a map of non-negative integers",
                               fix_regen)
    for key in ("index_sha256", "prompts_sha256"):
        if key in man and not isinstance(man[key], str):
            raise CorruptFileError(f"{path}: {key}", "is not a hex string", fix_regen)
    for key in ("rows", "prompts", "blocks", "query_rows", "logit_rows"):
        if not isinstance(man["counts"].get(key), int) or man["counts"][key] < 0:
            raise CorruptFileError(
                f"{path}: counts.{key}", "missing or not a non-negative integer", fix_regen
            )
    for i, sh in enumerate(man["shards"]):
        ok = (
            isinstance(sh, dict)
            and sh.get("file") == shard_name(i)
            and isinstance(sh.get("sha256"), str)
            and all(isinstance(sh.get(k), int) for k in ("bytes", "rows", "blocks"))
        )
        if not ok:
            raise CorruptFileError(
                f"{path}: shards[{i}]",
                f"malformed entry (expected file {shard_name(i)!r}, sha256, bytes, rows, blocks)",
                fix_regen,
            )
    return man


def is_complete(man: dict[str, Any]) -> bool:
    """Whether the run that wrote the dataset finished.

    ``complete`` is written ``false`` when a writer starts changing a dataset and ``true``
    only when it closes normally. A manifest without the key was written before the key
    existed (the first writer) and counts as complete: such a dataset cannot be told
    apart from a finished one, so it is read as before.
    """
    return bool(man.get("complete", True))
