"""The masked store: an audit of how others apply per-head budgets. It frees nothing.

kvpress (and AdaKV-style wrappers) apply per-head budgets by keeping the full K/V tensors
and masking evicted entries out of attention. This class reproduces that so the audit can
put it side by side with the physical store: attention sees exactly the kept entries (the
same outputs as :class:`evictlab.kv.paged.PagedKVStore` with the same keep sets), but every
K/V byte ever appended stays in memory. Its :meth:`MaskedKVStore.bytes` therefore reports
``held_tokens`` = every appended entry and ``bytes_live`` = the full cache; only
``live_tokens`` (entries attention may read) shrinks.

Storage per layer: ``k``, ``v`` ``(batch, kv_heads, capacity, head_dim)`` with the first
``n`` slots filled (all heads share ``n``: the tensors stay rectangular), and a boolean
``keep_mask`` ``(batch, kv_heads, capacity)``. Capacity doubles when full (a copy of the
layer's buffer, amortised O(1) per entry; DynamicCache instead copies every step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from evictlab.errors import InputError
from evictlab.kv.base import CellView, KVStore
from evictlab.kv.budget import ByteReport, dtype_size


class MaskedKVStore(KVStore):
    """Full K/V plus a keep mask (kind "masked"): bytes held are the full cache's."""

    kind = "masked"

    def __init__(
        self,
        n_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        initial_capacity: int = 256,
    ) -> None:
        self.n_layers, self.batch, self.kv_heads, self.head_dim = n_layers, batch, kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (batch, kv_heads, initial_capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(n_layers)]
        self.keep_mask = [torch.zeros(shape[:3], dtype=torch.bool, device=self.device) for _ in range(n_layers)]
        self.pos = torch.full((initial_capacity,), -1, dtype=torch.int64, device=self.device)
        self.n = [0] * n_layers
        self._last = [-1] * n_layers  # position of each layer's last appended slot (host side)

    def _grow(self, layer: int, need: int) -> None:
        cap = self.k[layer].shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for buf in (self.k, self.v):
            grown = torch.zeros((self.batch, self.kv_heads, new_cap, self.head_dim), dtype=self.dtype, device=self.device)
            grown[:, :, :cap] = buf[layer]
            buf[layer] = grown
        m = torch.zeros((self.batch, self.kv_heads, new_cap), dtype=torch.bool, device=self.device)
        m[:, :, :cap] = self.keep_mask[layer]
        self.keep_mask[layer] = m
        if self.pos.numel() < new_cap:
            p = torch.full((new_cap,), -1, dtype=torch.int64, device=self.device)
            p[: self.pos.numel()] = self.pos
            self.pos = p

    def lengths(self, layer: int) -> torch.Tensor:
        return self.keep_mask[layer][:, :, : self.n[layer]].sum(-1).cpu()

    def layout_positions(self, layer: int, new_positions: torch.Tensor) -> torch.Tensor:
        n, q = self.n[layer], int(new_positions.numel())
        old = torch.where(self.keep_mask[layer][:, :, :n], self.pos[:n], -1)
        new = new_positions.to(self.device).expand(self.batch, self.kv_heads, q)
        return torch.cat([old, new], -1)

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        q = keys.shape[2]
        n = self.n[layer]
        self._grow(layer, n + q)
        self.k[layer][:, :, n : n + q] = keys
        self.v[layer][:, :, n : n + q] = values
        self.keep_mask[layer][:, :, n : n + q] = True
        self.pos[n : n + q] = positions.to(self.device)
        self.n[layer] = n + q
        if q:
            self._last[layer] = int(positions.max())

    def append_gather(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.append(layer, keys, values, positions)
        n = self.n[layer]
        # Views, no copy: masked entries are excluded by the attention mask only.
        return self.k[layer][:, :, :n], self.v[layer][:, :, :n]

    def cell_views(self, layer: int) -> list[list[CellView]]:
        """Every cell's ``n`` appended slots as views (no copy); evicted slots have position
        ``-1`` (``holes``): attention reads, and masks, all of them, as a masked cache does."""
        n = self.n[layer]
        mask = self.keep_mask[layer][:, :, :n]
        pos = torch.where(mask, self.pos[:n], -1)  # (batch, kv_heads, n), one small tensor per call
        holes = (~mask).any(-1).tolist() if n else [[False] * self.kv_heads] * self.batch
        last = self._last[layer] if n else -1
        k, v = self.k[layer], self.v[layer]
        return [[CellView(k[b, h, :n], v[b, h, :n], pos[b, h], last, False, bool(holes[b][h]))
                 for h in range(self.kv_heads)] for b in range(self.batch)]

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kept entries left-aligned per head (a transient copy, used for scoring)."""
        n = self.n[layer]
        mask = self.keep_mask[layer][:, :, :n]
        s = int(mask.sum(-1).max()) if n else 0
        # Stable sort puts kept slots first, in order.
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :s]
        k = torch.gather(self.k[layer][:, :, :n], 2, order[..., None].expand(-1, -1, -1, self.head_dim))
        v = torch.gather(self.v[layer][:, :, :n], 2, order[..., None].expand(-1, -1, -1, self.head_dim))
        valid = torch.gather(mask, 2, order)
        pos = torch.where(valid, self.pos[:n][order], -1)
        return k, v, pos

    def keep(self, layer: int, keep: Sequence[Sequence[torch.Tensor]]) -> None:
        n = self.n[layer]
        mask = self.keep_mask[layer]
        for bi in range(self.batch):
            for hi in range(self.kv_heads):
                live = torch.nonzero(mask[bi, hi, :n]).flatten()
                idx = keep[bi][hi].to(self.device)
                if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= live.numel()):
                    raise InputError(f"keep[{bi}][{hi}]", f"indices must be in [0, {live.numel()})", "pass select_keep output")
                new = torch.zeros(n, dtype=torch.bool, device=self.device)
                new[live[idx]] = True
                mask[bi, hi, :n] = new

    def discard_recent(self, layer: int, count: int) -> None:
        """Forget the last ``count`` appended entries of ``layer`` entirely (not even held:
        a scoring pass is not part of the cache being audited)."""
        n = self.n[layer]
        if not 0 <= count <= n:
            raise InputError("count", f"{count} entries to discard from {n}", "discard at most what was appended")
        self.keep_mask[layer][:, :, n - count:n] = False
        self.n[layer] = n - count
        self._last[layer] = int(self.pos[n - count - 1]) if n > count else -1

    def bytes(self) -> ByteReport:
        per_entry = 2 * self.head_dim * dtype_size(self.dtype)
        cells = self.batch * self.kv_heads
        held = sum(self.n) * cells
        live = int(sum(int(self.keep_mask[l][:, :, : self.n[l]].sum()) for l in range(self.n_layers)))
        allocated = sum(k.shape[2] for k in self.k) * cells * per_entry
        index = sum(m.numel() for m in self.keep_mask) + self.pos.numel() * 8
        return ByteReport(
            kind=self.kind,
            live_tokens=live,
            held_tokens=held,
            bytes_live=held * per_entry,  # masked entries are still in memory
            bytes_in_use=held * per_entry,
            bytes_allocated=allocated,
            bytes_index=int(index),
        )
