"""The interface shared by the physical (paged) and the masked KV store.

A store holds, for every cell (layer, batch item, KV head), an ordered list of *live*
entries: the keys, values and absolute token positions attention may read. Entries are
appended in token order and removed only by :meth:`KVStore.keep`.

Layout returned to attention (``gather``/``append_gather``): per layer, rectangular
tensors ``(batch, kv_heads, S, head_dim)`` where each head's live entries come first in
append order and slots past its length are padding, marked by position ``-1``. The
attention mask is built from these positions (valid and causal), so heads of different
lengths share one tensor for the duration of one attention call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from evictlab.kv.budget import ByteReport


class CellView(NamedTuple):
    """One cell's entries as attention reads them (:meth:`KVStore.cell_views`), in append
    (= position) order; the last ``q_len`` entries are those appended by the current forward."""

    k: torch.Tensor  #: ``(n, head_dim)``
    v: torch.Tensor  #: ``(n, head_dim)``
    pos: torch.Tensor  #: int64 ``(n,)`` absolute positions, ascending; ``-1`` = not attendable (a hole)
    last: int  #: largest position held (``-1`` for an empty cell); an upper bound when ``holes``
    copied: bool  #: True when the entries had to be gathered (a transient copy of this cell)
    holes: bool = False  #: True when some ``pos`` are ``-1`` (the masked store's evicted entries)


class LayerView(NamedTuple):
    """All cells of one layer as rectangular views (:meth:`PagedKVStore.layer_view`): no copy.
    Slot ``j`` of cell ``(b, h)`` is live iff ``j < lengths[b, h]``; live slots are in
    position order and the last ``q_len`` of them are the current forward's keys."""

    k: torch.Tensor  #: ``(batch, kv_heads, S, head_dim)``, S = the longest cell
    v: torch.Tensor  #: ``(batch, kv_heads, S, head_dim)``
    pos: torch.Tensor  #: int64 ``(batch, kv_heads, S)``; meaningful only on live slots
    lengths: np.ndarray  #: int64 ``(batch, kv_heads)`` live entries per cell (host)
    last: np.ndarray  #: int64 ``(batch, kv_heads)`` position of each cell's last entry (host)


class KVStore(ABC):
    """Per-(layer, batch, KV head) ordered entries; see the module docstring for layout."""

    #: ``"physical"`` (evicted entries are freed) or ``"masked"`` (evicted entries stay in memory).
    kind: str
    n_layers: int
    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @abstractmethod
    def lengths(self, layer: int) -> torch.Tensor:
        """Live entries per cell of ``layer``: int64 ``(batch, kv_heads)`` on the CPU."""

    @abstractmethod
    def layout_positions(self, layer: int, new_positions: torch.Tensor) -> torch.Tensor:
        """Positions of the slots :meth:`append_gather` will return, without appending.

        ``new_positions``: int64 ``(q_len,)``, the absolute positions of the tokens about to
        be appended. Returns int64 ``(batch, kv_heads, S)`` with ``-1`` on padding/masked
        slots. Used by the attention pre-hook to build the mask before the keys exist.
        """

    @abstractmethod
    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append ``keys``/``values`` ``(batch, kv_heads, q_len, head_dim)`` at ``positions``
        ``(q_len,)`` to every cell of ``layer`` (after each cell's entries)."""

    @abstractmethod
    def cell_views(self, layer: int) -> list[list[CellView]]:
        """Every cell of ``layer`` as ``views[b][h]`` (:class:`CellView`), for attention that
        reads cells one by one (no layer gather, no padding)."""

    @abstractmethod
    def append_gather(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``keys``/``values`` ``(batch, kv_heads, q_len, head_dim)`` at ``positions``
        ``(q_len,)`` and return the layer's K and V ``(batch, kv_heads, S, head_dim)`` in the
        layout of :meth:`layout_positions`."""

    @abstractmethod
    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Live entries of ``layer``, left-aligned per head: K, V ``(batch, kv_heads, S, d)``
        and positions int64 ``(batch, kv_heads, S)`` (``-1`` past each head's length), with
        ``S`` = the longest head. Always a fresh (transient) tensor for the physical store."""

    def live_cells(self, layer: int) -> tuple[list[list[CellView]], torch.Tensor]:
        """Every cell's live entries (no holes) as ``views[b][h]`` (:class:`CellView`), and
        their positions left-aligned ``(batch, kv_heads, S)`` (``-1`` past a cell's length),
        for scoring. The default slices one :meth:`gather`; a store whose cells are views
        already (the paged store) avoids the copy."""
        k, v, pos = self.gather(layer)
        lens = self.lengths(layer).tolist()
        views = [[CellView(k[b, h, :n], v[b, h, :n], pos[b, h, :n], -1, True) for h, n in enumerate(row)]
                 for b, row in enumerate(lens)]
        return views, pos

    @abstractmethod
    def keep(self, layer: int, keep: Sequence[Sequence[torch.Tensor]]) -> None:
        """Keep only ``keep[b][h]`` (sorted int64 indices into cell (layer, b, h)'s live
        entries, in their order); every other live entry of that cell is evicted."""

    def reserve_index(self, tokens_per_cell: int) -> None:
        """Size the store's index as if a cell had held ``tokens_per_cell`` entries (what a
        skipped transient pass would have grown it to: the shared prefill's arms skip a
        reconstruction pass whose scores another arm computed, and still account for its
        index). Default: the store's index does not depend on past lengths."""

    def clone(self) -> KVStore:
        """An independent copy: the same entries, capacity and byte accounting (used to
        answer several questions, each from its own copy of one compressed cache)."""
        import copy

        return copy.deepcopy(self)

    def discard_recent(self, layer: int, count: int) -> None:
        """Remove the last ``count`` appended entries of every cell of ``layer`` (entries of a
        scoring pass that are not part of the cache, e.g. KVzip's reconstruction pass).
        The default keeps every other live entry; a store that holds evicted entries must
        also stop holding these."""
        lens = self.lengths(layer)
        self.keep(layer, [[torch.arange(int(lens[b, h]) - count) for h in range(self.kv_heads)]
                          for b in range(self.batch)])

    @abstractmethod
    def bytes(self) -> ByteReport:
        """Current byte accounting (see :class:`evictlab.kv.budget.ByteReport`)."""

    def total_live(self) -> int:
        """Live entries summed over every cell of every layer and batch item."""
        return int(sum(int(self.lengths(l).sum()) for l in range(self.n_layers)))
