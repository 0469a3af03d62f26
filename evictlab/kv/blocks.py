"""The block pool of the paged store: fixed-capacity K/V and position tensors and their free list.

One pool for the whole model (all layers, batch items and KV heads):

- ``kv``: ``(2, capacity + 1, block_size, head_dim)`` in the model dtype; ``k = kv[0]`` and
  ``v = kv[1]`` (one buffer, so one gather reads both). The extra last block is the *null
  block* (:attr:`BlockPool.null_block`): always empty, it stands in for unused block-table
  columns so a gather needs no branch;
- ``pos``: int64 ``(capacity + 1, block_size)``, the absolute token position of each slot,
  ``-1`` exactly when the slot holds no live entry (an invariant the store keeps).

The pool knows blocks, not cells: which block belongs to which cell, and where a cell's
entries sit, is the block table of :class:`evictlab.kv.paged.PagedKVStore`. It never grows
by itself: taking a block when none is free raises :class:`BudgetExceededError`, and only
:meth:`BlockPool.reallocate` (the store's ``resize``) changes its capacity.
"""

from __future__ import annotations

import numpy as np
import torch

from evictlab.errors import BudgetExceededError


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed by one cell of ``tokens`` entries."""
    return -(-int(tokens) // block_size)


class BlockPool:
    """``capacity`` blocks of ``block_size`` slots of K, V (``head_dim``) and position, plus
    the null block, and which blocks are free."""

    def __init__(self, capacity: int, block_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.block_size, self.head_dim, self.dtype, self.device = int(block_size), head_dim, dtype, device
        self._allocate(int(capacity))
        # Free blocks as a mask (O(1) to take or return a given block).
        self.free_mask = np.ones(self.capacity, dtype=bool)
        self.n_free = self.capacity

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.kv = torch.zeros(2, capacity + 1, self.block_size, self.head_dim, dtype=self.dtype, device=self.device)
        self.k, self.v = self.kv[0], self.kv[1]
        self.pos = torch.full((capacity + 1, self.block_size), -1, dtype=torch.int64, device=self.device)

    @property
    def null_block(self) -> int:
        """The always-empty block (the last one) that unused block-table columns point to."""
        return self.capacity

    @property
    def in_use(self) -> int:
        """Blocks taken (not free)."""
        return self.capacity - self.n_free

    def take(self, want: int) -> int:
        """Take block ``want`` if it is free, else the lowest free block; return it.

        Raises :class:`BudgetExceededError` when no block is free (the pool never grows).
        """
        if not self.n_free:
            raise BudgetExceededError(
                f"paged KV pool is full ({self.capacity} blocks of {self.block_size} "
                "entries): appending would exceed the budget plus its headroom; compress "
                "more often or raise the budget"
            )
        if not (0 <= want < self.capacity and self.free_mask[want]):
            want = int(np.argmax(self.free_mask))
        self.free_mask[want] = False
        self.n_free -= 1
        return want

    def release(self, block: int) -> None:
        """Return ``block`` to the free list (its slots' positions are the store's to clear)."""
        self.free_mask[block] = True
        self.n_free += 1

    def reallocate(self, capacity: int, src: np.ndarray, dst: np.ndarray) -> None:
        """New tensors of ``capacity`` blocks; block ``src[i]`` of the old ones is copied to
        ``dst[i]``, and exactly the ``dst`` blocks are taken. Transient memory: old and new
        tensors coexist during the copy."""
        src_t = torch.from_numpy(src).to(self.device)
        dst_t = torch.from_numpy(dst).to(self.device)
        old_kv, old_pos = self.kv, self.pos
        self._allocate(int(capacity))
        self.kv.index_copy_(1, dst_t, old_kv.index_select(1, src_t))
        self.pos.index_copy_(0, dst_t, old_pos.index_select(0, src_t))
        del old_kv, old_pos
        self.free_mask = np.ones(self.capacity, dtype=bool)
        self.free_mask[dst] = False
        self.n_free = self.capacity - int(dst.size)
