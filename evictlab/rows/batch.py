"""The ragged batch of attention rows (:class:`RowBatch`) and its index helpers.

This is the in-memory contract between the row reader and every consumer (solvers,
statistics, export); ``docs/architecture.md`` ("Ragged batches") states it in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl


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


def ragged_offsets(lengths: np.ndarray) -> np.ndarray:
    """Segment offsets ``[0, cumsum(lengths)]``: int64 ``[len(lengths) + 1]``."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


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
        queries: float64 ``[N, d]``, row i's post-RoPE query (NaN for a logits row), when
            requested (``with_queries=True``); otherwise ``None``.
    """

    p: np.ndarray
    p_off: np.ndarray
    values: np.ndarray
    v_start: np.ndarray
    key_index: np.ndarray
    meta: pl.DataFrame
    keys: np.ndarray | None = None
    queries: np.ndarray | None = None

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
            p=self.p[idx], p_off=ragged_offsets(n), values=self.values,
            v_start=self.v_start[order], key_index=self.key_index[idx],
            meta=self.meta[order.tolist()] if len(order) else self.meta.clear(), keys=self.keys,
            queries=None if self.queries is None else self.queries[order],
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
        queries = (None if any(b.queries is None for b in batches)
                   else np.concatenate([b.queries for b in batches]))
        return RowBatch(
            p=np.concatenate(p_parts), p_off=np.concatenate(off_parts),
            values=np.concatenate(v_parts), v_start=np.concatenate(vs_parts),
            key_index=np.concatenate([b.key_index for b in batches]),
            meta=pl.concat([b.meta for b in batches], how="vertical"), keys=keys, queries=queries,
        )
