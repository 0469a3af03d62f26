"""KV budgets and byte accounting (definitions: docs/kv.md, docs/theory.md).

One convention everywhere: a budget counts what is **kept** after a compression, summed
over the cells of one sequence. A cell is (layer, KV head); all query heads of a GQA group
read the same kept set.

Bytes held by kept entries = ``kept_tokens x 2 (K and V) x head_dim x dtype size``. The
index (block tables, lengths, token positions) is overhead and is reported separately,
never folded into the K/V bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from evictlab.errors import InputError

BudgetUnit = Literal["tokens_per_cell", "total_tokens", "bytes"]
_UNITS: tuple[str, ...] = ("tokens_per_cell", "total_tokens", "bytes")


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (e.g. 4 for float32, 2 for bfloat16)."""
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes(tokens: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for ``tokens`` entries of one head: tokens x 2 x head_dim x size."""
    return int(tokens) * 2 * int(head_dim) * dtype_size(dtype)


@dataclass(frozen=True)
class Budget:
    """A kept-entry budget for one sequence, in one of three units.

    ``unit``:
      - ``"tokens_per_cell"``: ``value`` kept entries per (layer, KV head) on average; the
        total is ``value x n_layers x kv_heads`` (an allocator may spread it unevenly);
      - ``"total_tokens"``: ``value`` kept entries summed over all cells;
      - ``"bytes"``: ``value`` bytes of kept K and V over all cells (index overhead not
        counted), converted to tokens by flooring to whole entries.
    """

    unit: BudgetUnit
    value: int

    def __post_init__(self) -> None:
        if self.unit not in _UNITS:
            raise InputError("budget.unit", f"unknown unit {self.unit!r}", f"use one of {_UNITS}")
        if int(self.value) <= 0:
            raise InputError("budget.value", f"must be positive, got {self.value}", "pass a positive budget")

    def total_tokens(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Kept entries summed over the ``n_layers x kv_heads`` cells of one sequence."""
        if self.unit == "tokens_per_cell":
            return int(self.value) * n_layers * kv_heads
        if self.unit == "total_tokens":
            return int(self.value)
        per_entry = kv_bytes(1, head_dim, dtype)
        tokens = int(self.value) // per_entry
        if tokens <= 0:
            raise InputError(
                "budget.value", f"{self.value} bytes hold no entry ({per_entry} bytes each)",
                "pass a larger byte budget",
            )
        return tokens

    def bytes(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Analytic bytes of the kept K and V of one sequence at this budget."""
        return kv_bytes(self.total_tokens(n_layers, kv_heads, head_dim, dtype), head_dim, dtype)

    @staticmethod
    def parse(text: str) -> "Budget":
        """Parse ``"128"`` (tokens per cell), ``"128/cell"``, ``"4096total"`` or ``"2MiB"``/``"1000000B"``."""
        t = text.strip().lower().replace(" ", "")
        try:
            if t.endswith("/cell"):
                return Budget("tokens_per_cell", int(t[:-5]))
            if t.endswith("total"):
                return Budget("total_tokens", int(t[:-5]))
            for suffix, mult in (("gib", 1 << 30), ("mib", 1 << 20), ("kib", 1 << 10), ("b", 1)):
                if t.endswith(suffix):
                    return Budget("bytes", int(float(t[: -len(suffix)]) * mult))
            return Budget("tokens_per_cell", int(t))
        except InputError as exc:  # a well-formed number the budget refuses (0, negative)
            raise InputError("--budget", f"{text!r}: {exc.problem}", exc.fix) from None
        except (ValueError, OverflowError):  # not a number ("1.5", "lots", "infMiB")
            raise InputError(
                "--budget", f"cannot parse {text!r}",
                "write 128 or 128/cell (kept tokens per cell), 4096total, or 2MiB",
            ) from None


@dataclass(frozen=True)
class ByteReport:
    """What a KV store holds right now (all counts over the whole store, every batch item).

    - ``live_tokens``: entries that attention can read (kept entries, summed over cells).
    - ``held_tokens``: entries whose K/V are still in memory. Physical store: == live.
      Masked store: every entry ever appended (masking frees nothing).
    - ``bytes_live``: ``held_tokens x 2 x head_dim x size``, the K/V bytes really held by
      entries. For a masked store this is the full cache, by design.
    - ``bytes_in_use``: bytes of the storage units holding those entries (whole pages for a
      paged store, so page slack is counted).
    - ``bytes_allocated``: bytes of the K/V buffers the store owns (pool capacity,
      including free pages or unused buffer capacity).
    - ``bytes_index``: block tables, lengths, per-slot positions and masks (overhead).
    - ``bytes_transient``: reusable working buffers (the paged store's gather scratch, one
      layer's padded K/V); not cache contents, reported so nothing held is hidden.
    """

    kind: str
    live_tokens: int
    held_tokens: int
    bytes_live: int
    bytes_in_use: int
    bytes_allocated: int
    bytes_index: int
    bytes_transient: int = 0
