"""The TRIM-KV retention-gate scorer: score ``(t - i) log beta_i`` from trained gates.

The gates (``evictlab gates train``, :mod:`evictlab.gates`) predict ``log beta`` of every KV
entry from its token's normed hidden state. At inference the hidden state is gone by the
time the cache is compressed, so each entry's ``log beta`` is recorded when it is appended
and kept beside the cache:

- :meth:`TrimKV.attach` (entered by the decode loop around a run, like the cache's own
  hooks) loads the gates and registers :func:`evictlab.gates.hooks.recording_gates` on the
  model; before a layer appends a forward's tokens the hook syncs that layer's
  :class:`~evictlab.gates.side.LogBetaTable` with what the KV store holds (evicted entries
  leave the table) and appends the new tokens' ``log beta``. The store (paged: it frees
  memory) stays the one that decides what is held; the table follows it by position.
- :meth:`TrimKV.score` reads the held entries' ``log beta`` from the table and returns
  ``(t - i) log beta_i`` with ``t`` the layer's next position: the log of the entry's
  retention ``beta_i ** (t - i)``. Higher (closer to 0) = keep.

With gates whose final projection is shared by all layers, the scores of every layer and
KV head are on one scale, which is what the ``global`` allocator needs
(``--method trimkv+global``); ``local`` gates (the ablation) are not calibrated across
layers. GQA: one ``beta`` per KV head, no group combination needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from evictlab.errors import InputError
from evictlab.methods.base import ScoreInputs, Scorer

__all__ = ["TrimKV"]


@dataclass
class TrimKV(Scorer):
    """TRIM-KV / DBTrimKV (Bui et al. 2025; paper B): learned retention, decayed with age.

    score[i] = (t - i) * log beta_i, ``beta_i`` from the gates in the folder ``gates`` (made
    by ``evictlab gates train``; checked when the scorer is built, matched against the
    model when the run starts), ``t`` the position of the next token. ``gates=default``:
    the gates shipped in ``data/gates/`` for the loaded model, picked when the run starts
    (:func:`evictlab.gates.files.default_gates_for`; another model's run is refused).

    Shapes: ``positions (s,)`` of one cell (``inputs.cell``) -> ``(1, 1, s)``; with
    ``inputs.cell`` None, ``keys (b, hk, s, d)`` -> ``(b, hk, s)``. Query-agnostic: the
    queries are not read.
    """

    gates: Path | None = None
    name: ClassVar[str] = "trimkv"
    #: the decode loop must enter :meth:`attach` for every evicting run
    needs: ClassVar[frozenset[str]] = frozenset({"gates"})
    _table: Any = field(default=None, init=False, repr=False, compare=False)
    _gates: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.gates is None:
            raise InputError("scorer_param", "trimkv needs trained gates", "pass --scorer-param gates=DIR "
                             "(a folder written by `evictlab gates train`)")

    def load(self) -> TrimKV:
        """Check the gates folder (the registry's factory calls this once): a missing or
        unfinished folder is refused now, before any model loads (``gates=default``: that
        gates are shipped at all; which set is picked when the model is known)."""
        from evictlab.gates.files import SHIPPED_DIR, read_config, shipped_folders

        if self.is_default:
            if not shipped_folders():
                raise InputError("gates", f"gates=default: no shipped gates under {SHIPPED_DIR}",
                                 "pass gates=DIR (a folder written by `evictlab gates train`)")
            return self
        read_config(self.gates, "gates")
        return self

    @property
    def is_default(self) -> bool:
        """``gates=default``: the shipped gates of the model the run loads."""
        from evictlab.gates.files import DEFAULT

        return self.gates is not None and str(self.gates) == DEFAULT

    def check_weights(self, model: torch.nn.Module) -> None:
        """``gates=default``: shipped gates for ``model``'s weights exist (see :meth:`folder_for`)."""
        self.folder_for(model)

    def folder_for(self, model: torch.nn.Module) -> Path:
        """The gates folder this scorer uses on ``model`` (resolves ``gates=default``)."""
        from evictlab.gates.files import default_gates_for

        assert self.gates is not None
        return default_gates_for(model) if self.is_default else self.gates

    @contextlib.contextmanager
    def attach(self, model: torch.nn.Module, cache: Any) -> Iterator[None]:
        """Record every appended token's ``log beta`` for the run of ``cache`` (an
        :class:`~evictlab.kv.cache.EvictionCache`); hooks removed and the table dropped on exit."""
        from evictlab.gates.files import load_gates
        from evictlab.gates.hooks import recording_gates
        from evictlab.gates.side import LogBetaTable

        device = next(model.parameters()).device
        gates, _ = load_gates(self.folder_for(model), "scorer_param", device=device)
        table = LogBetaTable(gates.spec.n_layers)
        empty = torch.empty(0, dtype=torch.int64, device=device)

        def on_log_beta(layer: int, log_beta: torch.Tensor) -> None:
            seen = cache.layers[layer].seen
            held = cache.store.layout_positions(layer, empty)
            table.record(layer, held, torch.arange(seen, seen + log_beta.shape[1], device=device), log_beta)

        with recording_gates(model, gates, on_log_beta):
            self._table, self._gates = table, gates
            try:
                yield
            finally:
                self._table = self._gates = None

    def record_context(self, model: torch.nn.Module, cache: Any, hidden: list[torch.Tensor] | None) -> None:
        """Inside :meth:`attach`: record the ``log beta`` of a context that was prefilled
        elsewhere (:class:`evictlab.decode.shared.SharedContext`, whose hidden states per layer
        ``(1, n, hidden)`` are the attention modules' inputs the gates read) and just
        injected into ``cache``'s store: what the hooks would have recorded had the context
        been fed through this run."""
        table, gates = self._table, self._gates
        if table is None or gates is None:
            raise RuntimeError("record_context runs inside TrimKV.attach")
        if hidden is None:
            raise InputError("scorer", "trimkv needs the context's hidden states",
                             "prefill the shared context with hidden=True")
        for layer, h in enumerate(hidden):
            with torch.no_grad():
                log_beta = gates.log_beta(layer, h)
            b, n, hk = log_beta.shape
            empty = torch.empty(b, hk, 0, dtype=torch.int64, device=h.device)
            table.record(layer, empty, torch.arange(n, device=h.device), log_beta)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        table = self._table
        if table is None:
            raise RuntimeError("trimkv scores entries from the log beta recorded during the forwards: run it "
                               "through the decode loop (which enters TrimKV.attach), not on bare ScoreInputs")
        lb = table.lookup(inputs.layer, inputs.positions, inputs.cell)
        t = table.next_position[inputs.layer]
        pos = inputs.positions.to(lb.device)
        age = (t - pos).clamp_min(0).to(torch.float32)
        age = age.reshape(1, 1, -1) if pos.ndim == 1 else age[:, None, :]
        if inputs.cell is None:
            b, hk = inputs.keys.shape[:2]
            lb = lb[:b, :hk]
        return (age * lb).to(inputs.keys.device)
