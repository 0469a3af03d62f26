"""The physically evicting store: paged K/V with one block-table row per cell.

Storage
-------
One block pool for the whole model (all layers, batch items and KV heads):
:class:`evictlab.kv.blocks.BlockPool` (``store.pool``) holds the tensors and the free list;
this module holds the cells' layout over its blocks.

- ``kv_pool`` (= ``pool.kv``): ``(2, capacity_blocks + 1, block_size, head_dim)`` in the
  model dtype; ``pool.k = kv_pool[0]`` and ``pool.v = kv_pool[1]`` (one buffer, so one
  gather reads both). The extra last block is the *null block*: always empty, it stands in
  for unused block-table columns so a gather needs no branch;
- ``pos_pool`` (= ``pool.pos``): int64 ``(capacity_blocks + 1, block_size)``, the absolute
  token position of each slot, ``-1`` exactly when the slot holds no live entry (an
  invariant kept by append/keep); scorers and the causal mask read it after eviction.

The **block table** ``block_table``: int64 numpy array ``(n_layers, batch, kv_heads,
max_blocks)``. Row ``block_table[l, b, h]`` lists, in order, the pool blocks holding cell
(layer l, batch item b, KV head h); ``-1`` marks unused columns. Entry ``j`` of the cell
lives at block ``block_table[l, b, h, j // block_size]``, slot ``j % block_size``.
``cell_len[l, b, h]`` (int64, same leading shape) is the cell's number of live entries,
so a cell uses exactly ``ceil(len / block_size)`` blocks. Cells have independent lengths:
this is what makes per-head budgets physical.

Memory
------
The pool is allocated once with a fixed capacity (``capacity_blocks``) and never grows:
an append that needs a block when none is free raises :class:`BudgetExceededError`.
:meth:`PagedKVStore.keep` compacts a cell in place (its kept entries move to the front of
its own blocks; the transient copy is one layer's kept entries) and returns emptied blocks
to the free list. :meth:`PagedKVStore.for_budget` sizes the pool in tokens (a budget, a headroom per cell and
what the run can hold at most: the block arithmetic stays here), and
:meth:`PagedKVStore.reserve_headroom` resizes it to the budget plus a new headroom (used
after prefill to drop the prefill headroom). :meth:`PagedKVStore.resize` reallocates the
pool to a new capacity in blocks, copying only blocks in use; it lays each
cell out as one contiguous run of blocks with a gap of free blocks after it, and appends
take the adjacent free block when they can, so :meth:`PagedKVStore.cell_views` can hand
attention zero-copy per-cell views (fragmented cells fall back to a per-cell gather).
"""

from __future__ import annotations

from collections.abc import Sequence
import numpy as np
import torch

from evictlab.errors import BudgetExceededError, InputError
from evictlab.kv.base import CellView, KVStore, LayerView
from evictlab.kv.blocks import BlockPool, blocks_for
from evictlab.kv.budget import ByteReport, dtype_size
from evictlab.models.geometry import ModelGeometry


class PagedKVStore(KVStore):
    """Ragged per-(layer, batch, KV head) store that frees evicted entries (kind "physical")."""

    kind = "physical"

    def __init__(
        self,
        n_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        *,
        capacity_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if block_size <= 0:
            raise InputError("block_size", f"must be positive, got {block_size}", "use e.g. 16")
        if capacity_blocks <= 0:
            raise InputError("capacity_blocks", f"must be positive, got {capacity_blocks}", "size the pool from the budget")
        self.n_layers, self.batch, self.kv_heads, self.head_dim = n_layers, batch, kv_heads, head_dim
        self.block_size = int(block_size)
        self.dtype = dtype
        self.device = torch.device(device)
        #: the K/V/position blocks and their free list (:mod:`evictlab.kv.blocks`)
        self.pool = BlockPool(capacity_blocks, self.block_size, head_dim, dtype, self.device)
        self._scratch = torch.empty(0, dtype=dtype, device=self.device)
        self.block_table = np.full((n_layers, batch, kv_heads, 0), -1, dtype=np.int64)
        self.cell_len = np.zeros((n_layers, batch, kv_heads), dtype=np.int64)
        # Each cell's home block: the pool is split into one equal region per cell (cell-major)
        # and an empty cell takes its region's first block, so cells that stay within their
        # region's size (budget + headroom under uniform sizes) stay contiguous while the
        # chunks of every cell are appended in turn (prefill): zero-copy cell views.
        self._home = self._regions(capacity_blocks)
        self._table_dev: dict[int, torch.Tensor] = {}
        self._views: dict[int, list[list[CellView]]] = {}
        self._layout: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: position of each cell's last live entry (its largest), -1 when empty
        self.cell_last = np.full((n_layers, batch, kv_heads), -1, dtype=np.int64)
        # Set by for_budget: the kept entries per sequence and the cap on blocks ever in use.
        self._kept_tokens: int | None = None
        self._max_cell_blocks: int | None = None

    @classmethod
    def for_budget(
        cls,
        geometry: ModelGeometry,
        batch: int,
        *,
        kept_tokens: int,
        headroom_tokens_per_cell: int,
        max_cell_tokens: Sequence[int] | None = None,
        block_size: int = 16,
        device: str | torch.device = "cpu",
    ) -> PagedKVStore:
        """A store for ``batch`` sequences of a model, sized in tokens (the blocks are ours).

        ``kept_tokens``: entries per sequence kept after a compression (the budget);
        ``headroom_tokens_per_cell``: entries a cell may gain between two compressions;
        ``max_cell_tokens``: per layer, the most entries one cell of that layer can ever hold
        at once (what the run feeds, or a sliding window plus the headroom), None if unknown.
        The pool gets the smaller of two upper bounds on the blocks ever in use:

        - the budget: ``ceil(kept x batch / block_size)`` blocks, plus one partial block per
          cell, plus ``ceil(headroom / block_size)`` blocks per cell;
        - what can be held: ``sum over cells of ceil(max_cell_tokens / block_size)``.

        So a budget above what the run can ever hold allocates no more than the full cache
        plus one partial block per cell (and the null block), and the headroom is never
        more than what is fed. The pool never grows (:class:`BudgetExceededError`).
        """
        if kept_tokens <= 0 or headroom_tokens_per_cell < 0:
            raise InputError("kept_tokens", f"{kept_tokens} kept and {headroom_tokens_per_cell} headroom tokens",
                             "pass a positive budget and a non-negative headroom")
        cap = None
        if max_cell_tokens is not None:
            if len(max_cell_tokens) != geometry.n_layers:
                raise InputError("max_cell_tokens", f"{len(max_cell_tokens)} values for {geometry.n_layers} layers",
                                 "pass one maximum per layer")
            cap = batch * geometry.kv_heads * sum(blocks_for(t, block_size) for t in max_cell_tokens)
        cells = geometry.n_layers * batch * geometry.kv_heads
        blocks = cls._plan(cells, int(kept_tokens) * batch, headroom_tokens_per_cell, block_size, cap, in_use=0)
        store = cls(geometry.n_layers, batch, geometry.kv_heads, geometry.head_dim, capacity_blocks=blocks,
                    block_size=block_size, dtype=geometry.dtype, device=device)
        store._kept_tokens, store._max_cell_blocks = int(kept_tokens), cap
        return store

    @classmethod
    def _plan(cls, cells: int, kept: int, headroom: int, block_size: int, cap: int | None, in_use: int) -> int:
        """Pool blocks for ``kept`` entries (all sequences) plus ``headroom`` per cell (see
        :meth:`for_budget`), capped by ``cap``, never below the ``in_use`` blocks."""
        blocks = max(in_use, blocks_for(kept, block_size) + cells) + cells * blocks_for(headroom, block_size)
        if cap is not None:
            blocks = min(blocks, cap)
        return max(1, blocks, in_use)

    def reserve_headroom(self, tokens_per_cell: int) -> None:
        """Resize the pool to the kept budget plus ``tokens_per_cell`` per cell (a pool made
        by :meth:`for_budget`); after prefill this releases the prefill headroom. Copies only
        the blocks in use (see :meth:`resize`)."""
        if self._kept_tokens is None:
            raise InputError("store", "reserve_headroom needs a pool sized by PagedKVStore.for_budget",
                             "build the store with for_budget, or call resize(capacity_blocks)")
        cells = self.n_layers * self.batch * self.kv_heads
        self.resize(self._plan(cells, self._kept_tokens * self.batch, tokens_per_cell, self.block_size,
                               self._max_cell_blocks, self.blocks_in_use))

    # -- the pool's tensors (see evictlab.kv.blocks) --------------------------------------
    @property
    def kv_pool(self) -> torch.Tensor:
        """``(2, capacity_blocks + 1, block_size, head_dim)``: keys ``[0]`` and values ``[1]``."""
        return self.pool.kv

    @property
    def pos_pool(self) -> torch.Tensor:
        """int64 ``(capacity_blocks + 1, block_size)``: each slot's position, -1 when not live."""
        return self.pool.pos

    @property
    def capacity_blocks(self) -> int:
        return self.pool.capacity

    # -- bookkeeping -------------------------------------------------------------------
    @property
    def blocks_in_use(self) -> int:
        return self.pool.in_use

    def _regions(self, capacity_blocks: int, used: np.ndarray | None = None) -> np.ndarray:
        """int64 ``(n_layers, batch, kv_heads)``: the first block of each cell's region, the
        pool split cell-major into runs of each cell's ``used`` blocks followed by an equal
        share of the spare blocks; when the cells are equal (or empty) these are equal
        regions, so :meth:`layer_view` sees equally spaced cells."""
        cells = self.n_layers * self.batch * self.kv_heads
        nb = np.zeros(cells, dtype=np.int64) if used is None else used.reshape(-1)
        region = capacity_blocks // cells
        gap = max(0, (capacity_blocks - int(nb.sum())) // cells)  # spare blocks each cell gets
        if region > 0 and int(nb.max(initial=0)) + gap <= region:  # equal regions, same spare for all
            start = np.arange(cells, dtype=np.int64) * region
        else:  # unequal cells: a run of each cell's blocks followed by its share of the spare
            start = np.concatenate([[0], np.cumsum(nb + gap)[:-1]]).astype(np.int64)
        return np.minimum(start, capacity_blocks - 1).reshape(self.n_layers, self.batch, self.kv_heads)

    def lengths(self, layer: int) -> torch.Tensor:
        return torch.from_numpy(self.cell_len[layer].copy())

    def _ensure_columns(self, n_cols: int) -> None:
        cur = self.block_table.shape[-1]
        if n_cols > cur:
            pad = np.full((*self.block_table.shape[:-1], n_cols - cur), -1, dtype=np.int64)
            self.block_table = np.concatenate([self.block_table, pad], axis=-1)
            self._table_dev.clear()
            self._layout.clear()

    def _table(self, layer: int) -> torch.Tensor:
        """Device copy of ``block_table[layer]`` with -1 replaced by the null block."""
        t = self._table_dev.get(layer)
        if t is None:
            tbl = self.block_table[layer]
            t = torch.from_numpy(np.where(tbl >= 0, tbl, self.pool.null_block)).to(self.device)
            self._table_dev[layer] = t
        return t

    def _alloc_block(self, after: int = -1, home: int = -1) -> int:
        """Take a free block: ``after + 1`` if it is free (keeps the cell's run contiguous),
        else ``home`` if it is free (an empty cell starts its region), else the lowest free block."""
        return self.pool.take(after + 1 if after >= 0 else home)

    # -- append / gather ---------------------------------------------------------------
    def _flat_slots(self, layer: int, start: np.ndarray, count: int) -> np.ndarray:
        """Flat pool slot ids ``(batch, kv_heads, count)`` of entries start..start+count-1."""
        j = start[..., None] + np.arange(count)[None, None, :]
        blocks = np.take_along_axis(self.block_table[layer], j // self.block_size, axis=-1)
        return blocks * self.block_size + j % self.block_size

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append ``keys``/``values`` ``(batch, kv_heads, q_len, head_dim)`` to every cell of ``layer``.

        Raises :class:`BudgetExceededError` (and changes nothing) if the pool lacks blocks.
        """
        b, h, q, d = keys.shape
        if (b, h, d) != (self.batch, self.kv_heads, self.head_dim):
            raise InputError("keys", f"shape {tuple(keys.shape)} does not match the store", "build the store for this model and batch")
        start = self.cell_len[layer].copy()
        need = -(-(start + q) // self.block_size)
        have = -(-start // self.block_size)
        extra = int((need - have).sum())
        if extra > self.pool.n_free:
            raise BudgetExceededError(
                f"layer {layer}: appending {q} entries per cell needs {extra} more blocks but only "
                f"{self.pool.n_free} of {self.capacity_blocks} are free; the store never grows past its budget"
            )
        if extra:  # only when some cell crosses into a new block (every block_size decode steps)
            self._ensure_columns(int(need.max()))
            for bi in range(b):
                for hi in range(h):
                    for col in range(int(have[bi, hi]), int(need[bi, hi])):
                        prev = int(self.block_table[layer, bi, hi, col - 1]) if col else -1
                        self.block_table[layer, bi, hi, col] = self._alloc_block(prev, int(self._home[layer, bi, hi]))
            self._table_dev.pop(layer, None)
            self._layout.pop(layer, None)
        contig, first, _ = self._layout_of(layer)
        if contig.all():  # every cell one run: entry j of a cell sits at its first slot + j
            slots = (first + start)[..., None] + np.arange(q)
        else:
            slots = self._flat_slots(layer, start, q)
        flat = torch.from_numpy(slots.reshape(-1)).to(self.device)
        # Keys and values in one copy: (2, batch * kv_heads * q_len, d) into the (2, slots, d) pool.
        self.kv_pool.view(2, -1, d).index_copy_(1, flat, torch.stack([keys, values]).reshape(2, -1, d).to(self.dtype))
        host = positions.numpy() if positions.device.type == "cpu" else None  # no device sync for the last position
        if q == 1 and host is not None:  # one decode token: the same position in every cell
            self.pos_pool.view(-1).index_fill_(0, flat, int(host[0]))
        else:
            self.pos_pool.view(-1).index_copy_(0, flat, positions.to(self.device).expand(b, h, q).reshape(-1))
        self.cell_len[layer] = start + q
        if q:
            self.cell_last[layer] = int(host.max() if host is not None else positions.max())
        self._views.pop(layer, None)

    def _gather_layer(self, layer: int, s: int, *, scratch: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block-wise gather of the first ``s`` slots of every cell (one index_select per pool).

        With ``scratch=True`` K/V are written into a buffer the store reuses (no fresh
        allocation, so no page faults on every step); the returned K/V then stay valid only
        until the next scratch gather. Positions are always a fresh tensor.
        """
        table = self._table(layer)  # (batch, kv_heads, max_blocks)
        n_blocks = blocks_for(s, self.block_size)
        idx = table[..., :n_blocks].reshape(-1)
        b, h, d, bs = self.batch, self.kv_heads, self.head_dim, self.block_size
        if scratch:
            need = 2 * idx.numel() * bs * d
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need, dtype=self.dtype, device=self.device)
            out = self._scratch[:need].view(2, idx.numel(), bs, d)
            torch.index_select(self.kv_pool, 1, idx, out=out)
            kv = out.view(2, b, h, n_blocks * bs, d)[:, :, :, :s]
        else:
            kv = self.kv_pool.index_select(1, idx).view(2, b, h, n_blocks * bs, d)[:, :, :, :s]
        # Non-live slots already hold position -1 (pool invariant): no length mask needed.
        pos = self.pos_pool.index_select(0, idx).view(b, h, n_blocks * bs)[:, :, :s]
        return kv[0], kv[1], pos

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = int(self.cell_len[layer].max())
        return self._gather_layer(layer, s)

    def gather_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Like :meth:`gather`, but K/V live in the store's reusable scratch buffer: valid
        until the next ``gather_view``/``append_gather`` (one layer's attention call)."""
        s = int(self.cell_len[layer].max())
        return self._gather_layer(layer, s, scratch=True)

    def cell_views(self, layer: int) -> list[list[CellView]]:
        """Each cell's live K, V ``(n, d)`` and positions ``(n,)``, without a layer gather.

        Returns ``views[b][h]``, a :class:`CellView`. When the cell's blocks form one
        contiguous run of the pool (the layout :meth:`resize` produces and that compaction
        preserves), ``k``/``v``/``pos`` are zero-copy views of the pool and ``copied`` is
        False. A fragmented cell falls back to a gather of that cell's blocks only (a
        transient copy of one cell, ``copied`` True, freed once the caller drops it). A layer
        whose cells are all views is cached until the next append/keep/resize of the store;
        a layer with copies is not cached (so no copy outlives the caller).
        """
        cached = self._views.get(layer)
        if cached is not None:
            return cached
        bs, d = self.block_size, self.head_dim
        kv_flat = self.kv_pool.view(2, -1, d)
        pos_flat = self.pos_pool.view(-1)
        lens = self.cell_len[layer]
        nbs = -(-lens // bs)
        table = self.block_table[layer]
        contig, first, _ = self._layout_of(layer)
        lasts = self.cell_last[layer]
        out: list[list[CellView]] = []
        for bi in range(self.batch):
            row: list[CellView] = []
            for hi in range(self.kv_heads):
                n = int(lens[bi, hi])
                last = int(lasts[bi, hi]) if n else -1
                if contig[bi, hi]:
                    start = int(first[bi, hi])
                    kv = kv_flat[:, start:start + n]
                    row.append(CellView(kv[0], kv[1], pos_flat[start:start + n], last, False))
                else:
                    nb = int(nbs[bi, hi])
                    idx = torch.from_numpy(np.ascontiguousarray(table[bi, hi, :nb])).to(self.device)
                    kv = self.kv_pool.index_select(1, idx).view(2, nb * bs, d)[:, :n]
                    row.append(CellView(kv[0], kv[1], self.pos_pool.index_select(0, idx).view(-1)[:n], last, True))
            out.append(row)
        if not any(cv.copied for row in out for cv in row):
            self._views[layer] = out  # views only; per-cell copies are never kept alive
        return out

    def _layout_of(self, layer: int) -> tuple[np.ndarray, np.ndarray, int | None]:
        """``(contiguous, first_slot, stride)`` of the layer's cells, recomputed only when its
        block table changed: whether each cell's used blocks are one run, the flat slot of each
        cell's first entry, and the slot distance between consecutive cells (batch-major) when
        every cell is contiguous and they start equally spaced (None otherwise)."""
        layout = self._layout.get(layer)
        if layout is not None:
            return layout
        bs, table = self.block_size, self.block_table[layer]
        # A cell is contiguous iff every used column (a prefix of the row; -1 after it)
        # follows its predecessor by one block.
        if table.shape[-1] > 1:
            contig = ((np.diff(table, axis=-1) == 1) | (table[..., 1:] < 0)).all(-1)
        else:
            contig = np.ones(table.shape[:-1], dtype=bool)
        has = table[..., 0] >= 0 if table.shape[-1] else np.zeros(table.shape[:-1], dtype=bool)
        first = np.maximum(table[..., 0], 0) * bs if table.shape[-1] else np.zeros(table.shape[:-1], dtype=np.int64)
        stride: int | None = None
        starts = first.reshape(-1)
        if contig.all() and has.all():
            steps = np.diff(starts)
            if steps.size == 0:
                stride = 0
            elif steps[0] > 0 and (steps == steps[0]).all():
                stride = int(steps[0])
        layout = self._layout[layer] = (contig, first, stride)
        return layout

    def layer_view(self, layer: int) -> LayerView | None:
        """The layer's cells as one zero-copy strided view of the pool, or None.

        Possible when every cell of the layer is one contiguous run, the runs start equally
        spaced (``stride`` slots apart, batch-major, as the per-cell regions of
        :meth:`for_budget` and :meth:`resize` lay them out) and the longest cell ``S`` fits in
        that spacing: then ``k``/``v`` ``(batch, kv_heads, S, d)`` and ``pos`` ``(batch,
        kv_heads, S)`` are ``as_strided`` views (no copy), and slot ``j`` of a cell is live
        iff ``j < lengths[b, h]`` (slots past a cell's length hold whatever that part of its
        region holds: mask them by length, never by position). Attention then runs one
        kernel per layer over exactly the bytes a dense cache of the longest cell would read.
        """
        _, first, stride = self._layout_of(layer)
        lens = self.cell_len[layer]
        s = int(lens.max()) if lens.size else 0
        if stride is None or s == 0 or (stride and s > stride):
            return None
        start = int(first.reshape(-1)[0])
        if start + stride * (lens.size - 1) + s > self.pos_pool.numel():
            return None
        b, h, d = self.batch, self.kv_heads, self.head_dim
        kv = self.kv_pool.view(2, -1, d)
        shape, strides = (b, h, s, d), (h * stride * d, stride * d, d, 1)
        k = kv[0].as_strided(shape, strides, kv[0].storage_offset() + start * d)
        v = kv[1].as_strided(shape, strides, kv[1].storage_offset() + start * d)
        pos = self.pos_pool.view(-1).as_strided((b, h, s), (h * stride, stride, 1), start)
        return LayerView(k, v, pos, lens.copy(), self.cell_last[layer].copy())

    def live_cells(self, layer: int) -> tuple[list[list[CellView]], torch.Tensor]:
        """:meth:`cell_views` (zero-copy when contiguous) and the left-aligned positions
        ``(batch, kv_heads, S)``: no K/V gather (see :meth:`KVStore.live_cells`)."""
        return self.cell_views(layer), self.layout_positions(layer, torch.empty(0, dtype=torch.int64))

    def contiguous_cells(self, layer: int | None = None) -> tuple[int, int]:
        """``(contiguous, total)`` cells (of ``layer``, or of every layer) whose blocks form one run."""
        layers = range(self.n_layers) if layer is None else [layer]
        ok = total = 0
        for l in layers:
            for bi in range(self.batch):
                for hi in range(self.kv_heads):
                    nb = blocks_for(int(self.cell_len[l, bi, hi]), self.block_size)
                    blocks = self.block_table[l, bi, hi, :nb]
                    total += 1
                    ok += int(nb <= 1 or bool(np.all(np.diff(blocks) == 1)))
        return ok, total

    def layout_positions(self, layer: int, new_positions: torch.Tensor) -> torch.Tensor:
        q = int(new_positions.numel())
        start = torch.from_numpy(self.cell_len[layer].copy()).to(self.device)
        s = int(self.cell_len[layer].max()) + q
        if self.block_table.shape[-1] == 0 or int(self.cell_len[layer].max()) == 0:
            pos = torch.full((self.batch, self.kv_heads, s), -1, dtype=torch.int64, device=self.device)
        else:
            n_blocks = blocks_for(int(self.cell_len[layer].max()), self.block_size)
            idx = self._table(layer)[..., :n_blocks].reshape(-1)
            pos = self.pos_pool.index_select(0, idx).view(self.batch, self.kv_heads, -1)[:, :, : int(self.cell_len[layer].max())]
            pos = torch.cat([pos, torch.full((self.batch, self.kv_heads, q), -1, dtype=torch.int64, device=self.device)], -1)
        # New entries land right after each cell's live entries.
        cols = start[..., None] + torch.arange(q, device=self.device)
        return pos.scatter(-1, cols, new_positions.to(self.device).expand(self.batch, self.kv_heads, q).contiguous())

    def append_gather(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.append(layer, keys, values, positions)
        # The model consumes this layer's K/V before the next layer's update: reuse scratch.
        k, v, _ = self.gather_view(layer)
        return k, v

    # -- eviction ----------------------------------------------------------------------
    def keep(self, layer: int, keep: Sequence[Sequence[torch.Tensor]]) -> None:
        """Compact every cell of ``layer`` to its kept entries and free emptied blocks.

        Kept entries move, in order, to the cell's first slots (``keep`` is sorted and
        ``keep[j] >= j``); all sources are read into one transient tensor before any write,
        so overlapping moves are safe.
        """
        src_all: list[np.ndarray] = []
        dst_all: list[np.ndarray] = []
        new_len = self.cell_len[layer].copy()
        for bi in range(self.batch):
            for hi in range(self.kv_heads):
                idx = np.asarray(keep[bi][hi].detach().cpu().numpy(), dtype=np.int64)
                n = int(self.cell_len[layer, bi, hi])
                if idx.size and (idx.min() < 0 or idx.max() >= n or np.any(np.diff(idx) <= 0)):
                    raise InputError(
                        f"keep[{bi}][{hi}]", f"indices must be sorted, unique and in [0, {n})",
                        "pass the output of select_keep for this cell",
                    )
                new_len[bi, hi] = idx.size
                if idx.size == n:
                    continue
                row = self.block_table[layer, bi, hi]
                src_all.append(row[idx // self.block_size] * self.block_size + idx % self.block_size)
                j = np.arange(idx.size)
                dst_all.append(row[j // self.block_size] * self.block_size + j % self.block_size)
        if src_all:
            src = torch.from_numpy(np.concatenate(src_all)).to(self.device)
            dst = torch.from_numpy(np.concatenate(dst_all)).to(self.device)
            kv = self.kv_pool.view(2, -1, self.head_dim)  # keys and values move together
            kv.index_copy_(1, dst, kv.index_select(1, src))
            pos = self.pos_pool.view(-1)
            pos.index_copy_(0, dst, pos.index_select(0, src))
        # Clear the positions of slots past each cell's new length and free emptied blocks.
        stale: list[np.ndarray] = []
        freed: list[int] = []
        for bi in range(self.batch):
            for hi in range(self.kv_heads):
                used = blocks_for(int(new_len[bi, hi]), self.block_size)
                row = self.block_table[layer, bi, hi]
                j = np.arange(int(new_len[bi, hi]), min(int(self.cell_len[layer, bi, hi]), used * self.block_size))
                if j.size:
                    stale.append(row[j // self.block_size] * self.block_size + j % self.block_size)
                gone = row[used:]
                gone = gone[gone >= 0]
                if gone.size:
                    freed.extend(gone.tolist())
                    row[used:] = -1
        for block in freed:
            self.pool.release(block)
        if freed:
            self.pos_pool.index_fill_(0, torch.tensor(freed, dtype=torch.int64, device=self.device), -1)
        if stale:
            self.pos_pool.view(-1).index_fill_(0, torch.from_numpy(np.concatenate(stale)).to(self.device), -1)
        self.cell_len[layer] = new_len
        self._table_dev.pop(layer, None)
        self._views.pop(layer, None)
        self._layout.pop(layer, None)
        # Last position of every cell after compaction (one read for the layer).
        last_slot = [int(self.block_table[layer, bi, hi, (n - 1) // self.block_size]) * self.block_size
                     + (n - 1) % self.block_size if n else self.capacity_blocks * self.block_size
                     for bi, row in enumerate(new_len) for hi, n in enumerate(row.tolist())]
        self.cell_last[layer] = np.asarray(
            self.pos_pool.view(-1)[torch.tensor(last_slot, dtype=torch.int64, device=self.device)].tolist(),
            dtype=np.int64).reshape(new_len.shape)

    def resize(self, capacity_blocks: int) -> None:
        """Reallocate the pool with ``capacity_blocks`` blocks, copying only blocks in use.

        Used after prefill to release the prefill headroom. Transient memory: old and new
        pools coexist during the copy. Raises :class:`BudgetExceededError` if the blocks in
        use do not fit.
        """
        used = self.block_table[self.block_table >= 0]
        if used.size > capacity_blocks:
            raise BudgetExceededError(f"{used.size} blocks in use do not fit in {capacity_blocks}")
        # Cell-major order (layer, batch, head, column): every cell becomes one contiguous
        # run of blocks, so attention reads it as a zero-copy view (see cell_views). The
        # spare capacity is spread as equal gaps of free blocks after each cell's run, so a
        # later append that needs a block takes the adjacent one and the cell stays
        # contiguous (same capacity, same bytes: only the placement of free blocks changes).
        order = used
        nb = (self.block_table >= 0).sum(-1).reshape(-1)
        run_start = self._regions(capacity_blocks, nb).reshape(-1)
        used_start = np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(np.int64)
        new_ids = np.repeat(run_start, nb) + np.arange(order.size) - np.repeat(used_start, nb)
        remap = np.full(self.capacity_blocks, -1, dtype=np.int64)
        remap[order] = new_ids
        self.pool.reallocate(capacity_blocks, order, new_ids)
        self.block_table = np.where(self.block_table >= 0, remap[np.maximum(self.block_table, 0)], -1)
        self._home = run_start.reshape(self.cell_len.shape)
        self._table_dev.clear()
        self._views.clear()
        self._layout.clear()

    # -- accounting --------------------------------------------------------------------
    def bytes(self) -> ByteReport:
        size = dtype_size(self.dtype)
        live = int(self.cell_len.sum())
        per_entry = 2 * self.head_dim * size
        index = self.block_table.nbytes + self.cell_len.nbytes + self.pos_pool.numel() * 8
        return ByteReport(
            kind=self.kind,
            live_tokens=live,
            held_tokens=live,
            bytes_live=live * per_entry,
            bytes_in_use=self.blocks_in_use * self.block_size * per_entry,
            bytes_allocated=int(self.kv_pool.numel()) * size,  # capacity + the null block
            bytes_index=int(index),
            bytes_transient=int(self._scratch.numel()) * size,
        )
