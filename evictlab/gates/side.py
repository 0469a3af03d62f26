"""The side array of ``log beta`` kept beside a KV store, keyed by position.

A retention score ``(t - i) log beta_i`` needs each held entry's ``log beta``, computed when
the entry was appended (from its hidden state, which is gone by the time the cache is
compressed). :class:`LogBetaTable` keeps, per layer, one row per cell (batch item, KV head):

    positions  int64   (batch, kv_heads, S)   ascending per row, -1 past the row's end
    values     float32 (batch, kv_heads, S)   log beta of the entry at that position

It never decides what is held: the KV store does (the paged store is the one that frees
memory). :meth:`LogBetaTable.record` is called once per forward and layer, before the layer
appends its new tokens: it first drops every row entry whose position the store no longer
holds in that cell (``held``: the store's positions, ``-1`` padding), then appends the new
tokens' values. So after any sequence of ``keep`` calls on the store (compressions, dropped
sliding-window entries, discarded passes) the table holds exactly the store's entries plus
the tokens of the current forward, and its memory follows the store's: 4 bytes per held
entry and cell, padded to the layer's longest cell. A held entry the table does not know
(it was appended while no gates were recording) is a :class:`RuntimeError`, never a guess.
"""

from __future__ import annotations

import torch

__all__ = ["LogBetaTable"]

_PAD = torch.iinfo(torch.int64).max  # sort key of padding: after every real position


class LogBetaTable:
    """Per-layer ``log beta`` of the entries a KV store holds (see the module docstring)."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.positions: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        #: per layer, the position after the last token recorded (the next token's position)
        self.next_position: dict[int, int] = {}

    def record(self, layer: int, held: torch.Tensor, new_positions: torch.Tensor, log_beta: torch.Tensor) -> None:
        """Sync ``layer`` with the store, then append a forward's tokens.

        Args:
            held: ``(b, hk, S)`` int64 positions the store holds now in each cell (``-1``
                padding), before the new tokens are appended.
            new_positions: ``(q,)`` int64 positions of the forward's tokens (every cell
                appends all of them).
            log_beta: ``(b, q, hk)`` their ``log beta``.
        """
        b, q, hk = log_beta.shape
        device = log_beta.device
        held = held.to(device)
        kept_pos, kept_val = self._select(layer, held, b, hk, device)
        new_pos = new_positions.to(device=device, dtype=torch.int64).expand(b, hk, q)
        pos = torch.cat([kept_pos, new_pos], dim=-1)
        val = torch.cat([kept_val, log_beta.to(torch.float32).transpose(1, 2)], dim=-1)
        key = torch.where(pos >= 0, pos, _PAD)
        key, order = torch.sort(key, dim=-1, stable=True)
        self.positions[layer] = torch.where(key == _PAD, -1, key)
        self.values[layer] = torch.gather(val, -1, order)
        if q:
            self.next_position[layer] = int(new_positions.max()) + 1

    def _select(self, layer: int, held: torch.Tensor, b: int, hk: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Values of the positions ``held`` ``(b, hk, S)`` from the layer's rows (padding kept as -1)."""
        if held.shape[-1] == 0 or not bool((held >= 0).any()):
            return (torch.empty(b, hk, 0, dtype=torch.int64, device=device),
                    torch.empty(b, hk, 0, dtype=torch.float32, device=device))
        return held, self._find(layer, self.positions.get(layer), self.values.get(layer), held)

    @staticmethod
    def _find(layer: int, rows_pos: torch.Tensor | None, rows_val: torch.Tensor | None,
              positions: torch.Tensor) -> torch.Tensor:
        """``rows_val`` at ``positions`` ``(b, hk, S)``, row by row (``-1`` gives NaN);
        RuntimeError for a real position its row does not hold."""
        real = positions >= 0
        if rows_pos is None or rows_val is None or rows_pos.shape[-1] == 0:
            if bool(real.any()):
                raise RuntimeError(f"layer {layer}: the KV store holds position {int(positions[real][0])} but no log "
                                   "beta was recorded for it (the gates must be attached whenever tokens are appended)")
            return torch.full(positions.shape, torch.nan, device=positions.device)
        key = torch.where(rows_pos >= 0, rows_pos, _PAD).contiguous()
        want = torch.where(real, positions, _PAD).contiguous()
        idx = torch.searchsorted(key, want).clamp_max(key.shape[-1] - 1)
        found = torch.gather(key, -1, idx) == want
        if bool((real & ~found).any()):
            raise RuntimeError(f"layer {layer}: the KV store holds position {int(positions[real & ~found][0])} but no "
                               "log beta was recorded for it (the gates must be attached whenever tokens are appended)")
        return torch.where(real, torch.gather(rows_val, -1, idx), torch.nan)

    def lookup(self, layer: int, positions: torch.Tensor, cell: tuple[int, int] | None = None) -> torch.Tensor:
        """``log beta`` of held entries.

        Args:
            positions: ``(s,)`` or ``(b, s)`` int64 positions.
            cell: ``(batch item, KV head)`` when ``positions`` are one cell's; None when
                every cell holds ``positions``.

        Returns:
            ``(1, 1, s)`` for a cell, else ``(b, hk, s)``, float32.
        """
        rows_pos, rows_val = self.positions.get(layer), self.values.get(layer)
        if rows_pos is None or rows_val is None:
            raise RuntimeError(f"layer {layer}: no log beta recorded (attach the gates before the forward)")
        b, hk = rows_pos.shape[:2]
        pos = positions.to(rows_pos.device, torch.int64)
        if cell is not None:
            i, h = cell
            return self._find(layer, rows_pos[i:i + 1, h:h + 1], rows_val[i:i + 1, h:h + 1], pos.reshape(1, 1, -1))
        p = pos.reshape(1, 1, -1).expand(b, hk, -1) if pos.ndim == 1 else pos[:, None, :].expand(b, hk, -1)
        return self._find(layer, rows_pos, rows_val, p.contiguous())

    def held_entries(self) -> int:
        """Entries the table holds now, over every layer and cell (its memory is 12 bytes each)."""
        return int(sum(int((p >= 0).sum()) for p in self.positions.values()))
