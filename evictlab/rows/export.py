"""Export rows as one dense, zero/-1 padded ``.npz`` (the ``evictlab rows export`` contract).

Arrays (N rows, n_max = largest n among them, d head dim, P prompts, L_max tokens):

=================  ========================  ==============================================
name               dtype, shape              meaning
=================  ========================  ==============================================
``p``              float64 ``[N, n_max]``    attention weights, zero beyond column n_i
``values``         float64 ``[N, n_max, d]`` row i's value vectors, zero beyond n_i
``n``              int64 ``[N]``             keys per row
``row_id``         int64 ``[N]``             dataset row ids (the first N, in order)
``prompt_id``      int64 ``[N]``
``layer``          int64 ``[N]``
``q_head``         int64 ``[N]``
``kv_head``        int64 ``[N]``
``position``       int64 ``[N]``             query token position, -1 where n/a
``key_index``      int64 ``[N, n_max]``      absolute token position of each key, -1 padded
                                             (and -1 for synthetic keys)
``prompt_tokens``  int64 ``[P, L_max]``      row i holds the tokens of prompt_id i, -1
                                             padded; P = 1 + the largest exported
                                             prompt_id; ids absent from the export (or
                                             the dataset) are all -1 rows
=================  ========================  ==============================================
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import polars as pl

from evictlab.errors import InputError
from evictlab.io import DEFAULT_MAX_GIB, check_output_path, check_output_size, exclusive_lock, write_npz
from evictlab.rows.reader import RowStore

#: Refuse exports whose dense arrays would exceed this many bytes unless raised.
DEFAULT_MAX_BYTES = int(DEFAULT_MAX_GIB * 2**30)


def export_arrays(store: RowStore, limit: int | None = None,
                  max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, np.ndarray]:
    """The export arrays (see module docstring) for the first ``limit`` rows (all if None)."""
    if limit is not None and (not isinstance(limit, (int, np.integer)) or limit < 1):
        raise InputError("--limit", f"must be a positive integer, got {limit!r}",
                         "pass e.g. --limit 1000, or omit it to export every row")
    N = store.n_rows if limit is None else min(int(limit), store.n_rows)
    index = store.meta.head(N)
    n_max = int(index["n"].max())
    d = store.head_dim
    need = N * n_max * (d + 2) * 8
    check_output_size(need, max_bytes / 2**30, f"exporting {N} rows x {n_max} keys x d={d} as dense arrays",
                      "pass a smaller --limit (or raise --max-gib)", option="--limit")
    p = np.zeros((N, n_max), np.float64)
    values = np.zeros((N, n_max, d), np.float64)
    key_index = np.full((N, n_max), -1, np.int64)
    i0 = 0
    for b in store.iter_batches(max_rows=4096, filter=pl.col("row_id") < N):
        for j in range(b.n_rows):
            lo, hi = int(b.p_off[j]), int(b.p_off[j + 1])
            k = hi - lo
            s = int(b.v_start[j])
            p[i0 + j, :k] = b.p[lo:hi]
            values[i0 + j, :k] = b.values[s : s + k]
            key_index[i0 + j, :k] = b.key_index[lo:hi]
        i0 += b.n_rows
    out: dict[str, np.ndarray] = {"p": p, "values": values, "key_index": key_index}
    for col in ("n", "row_id", "prompt_id", "layer", "q_head", "kv_head", "position"):
        out[col] = index[col].to_numpy().astype(np.int64)
    pids = np.unique(out["prompt_id"])
    P = int(pids.max()) + 1
    prompts = store.prompts.filter(pl.col("prompt_id").is_in(pids.tolist()))
    toks = prompts["tokens"].to_list()
    L_max = max((len(t) for t in toks), default=0)
    pt = np.full((P, L_max), -1, np.int64)
    for pid, t in zip(prompts["prompt_id"].to_list(), toks):
        pt[pid, : len(t)] = t
    out["prompt_tokens"] = pt
    return out


def export_npz(path: str | os.PathLike[str], out: str | os.PathLike[str],
               limit: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
               overwrite: bool = False) -> dict[str, Any]:
    """Export the dataset at ``path`` to ``out`` (``.npz``, atomic); return a summary.

    ``out``'s parent folder must exist; an existing ``out`` is replaced only with
    ``overwrite``. The write holds ``out``'s lock, so two exports to one file cannot race.
    """
    out = check_output_path(out, "--out", directory=False)
    if out.suffix != ".npz":
        raise InputError("--out", f"{out} does not end in .npz", "name the file FILE.npz")
    with exclusive_lock(out, "--out"):
        if out.exists() and not overwrite:
            raise InputError("--out", f"{out} already exists",
                             "pass --overwrite to replace it, or choose another --out")
        store = RowStore.open(path)
        arrays = export_arrays(store, limit=limit, max_bytes=max_bytes)
        write_npz(out, arrays)
    return {
        "out": str(out), "rows": int(arrays["n"].shape[0]), "n_max": int(arrays["p"].shape[1]),
        "head_dim": store.head_dim, "prompts_rows": int(arrays["prompt_tokens"].shape[0]),
        "bytes": out.stat().st_size,
    }
