"""Per-compression diagnostics: the selection ceiling measured inside the decode loop.

``evictlab decode --trace trace.parquet`` (and ``audit --trace``) hands a
:class:`CompressionTrace` to :func:`~evictlab.decode.loop.run_sequence`; at every
compression, for every layer, the loop calls :meth:`CompressionTrace.record` with the held
keys, values and positions, the kept indices the method chose, and the observation window
(the scorers' last ``window`` queries), *before* the store evicts. Off by default: nothing
is computed or kept when no trace is given.

**Rows.** A cell's observation rows are its window queries x the query heads of its GQA
group, each attending (the scorers' float32 attention, then normalised in float64) over the
held keys it can see (positions at or before its own: a prefix of the cell, since a cell
holds its entries in position order). For a row, ``A`` = the kept entries it can see and
``s = |A|``; rows that see no kept entry are left out.

**One table row per (run, compression, batch item, layer, KV head)** with ``held`` (entries
before the compression), ``kept`` (after), ``rows``, and means over the rows of:

| column | per row | computed by |
|---|---|---|
| ``dropped_kept`` | ``D(A)``, the mass outside the kept set | ``core.kernels.batch_dropped_mass`` |
| ``dropped_top`` | ``D(T_s)``, outside the row's own top-``s`` keys | ``core.kernels.batch_top_mass`` + ``batch_dropped_mass`` |
| ``e_kept`` | ``e(A)``, the forced error of the kept set | ``core.kernels.batch_forced_error`` |
| ``e_top`` | ``e(T_s)`` | ``core.kernels.batch_forced_error`` |
| ``es_hat`` | ``ES_hat(s)``, exact minimum over the s-subsets of the pool ``C_s(r_m, r_e)`` | ``solve.kernels.batch_solve`` |

plus ``gap_closed`` = median over rows with ``e_top > 0`` of ``(e_top - es_hat) / e_top``
(the selection ceiling g(s)) and ``rows_e_top_zero``. Where the run is labelled with the
task's facts (``label(facts=...)``: the token positions of the fact the question asks for,
as the ``oracle_labels`` spans ``"120:139,400:419"``), ``fact_held`` and ``fact_kept`` count
the cell's entries at those positions before and after the compression (null without
facts): the direct check of whether an allocation starved the cells that hold the answer. ``es_hat`` is computed only where the
pool enumeration is small: ``C(min(n, s + r_m + r_e), s) <= max_subsets`` for every row of
the cell; otherwise it (and ``gap_closed``) is null and ``es_hat_note`` says why. Run
labels (method, mode, budget, example, ...) are constant columns set by :meth:`label`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import comb
from typing import Any

import numpy as np
import polars as pl
import torch

from evictlab.errors import InputError

__all__ = ["CompressionTrace", "TRACE_COLUMNS", "fact_positions"]

#: Columns of the trace table after the run labels, in order.
TRACE_COLUMNS: tuple[str, ...] = (
    "compression", "phase", "seen", "item", "layer", "kv_head", "held", "kept", "rows", "dropped_kept",
    "dropped_top", "e_kept", "e_top", "es_hat", "gap_closed", "rows_e_top_zero", "es_hat_note",
    "fact_held", "fact_kept",
)


def fact_positions(spans: str | None) -> np.ndarray | None:
    """The token positions (int64, sorted, unique) of ``START:END`` ranges (half-open,
    comma-separated, as :func:`evictlab.tasks.examples.useful_spec` writes them); None for
    None or an empty text (no facts)."""
    from evictlab.methods.oracle_labels import parse_spans

    if not spans:
        return None
    return np.unique(np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in parse_spans(spans)]))


@dataclass
class _Rows:
    """The observation rows of one layer, as the ragged batch core/solve kernels take."""

    p: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    v_start: list[int] = field(default_factory=list)
    kept: list[np.ndarray] = field(default_factory=list)
    cell: list[int] = field(default_factory=list)
    v_used: int = 0


@dataclass
class CompressionTrace:
    """Collects one row per (compression, batch item, layer, KV head); see the module docstring.

    ``max_subsets``: the largest pool enumeration per row for ``es_hat``; ``r_m``, ``r_e``:
    the candidate pool ``C_s(r_m, r_e)`` (the project's defaults, 2 and 2).
    """

    max_subsets: int = 20_000
    r_m: int = 2
    r_e: int = 2
    labels: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    facts: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("max_subsets", "r_m", "r_e"):
            v = getattr(self, name)
            lo = 1 if name == "max_subsets" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InputError(name, f"must be an integer >= {lo}, got {v!r}", f"pass an integer >= {lo}")

    def label(self, facts: str | Callable[[], str | None] | np.ndarray | None = None, **labels: Any) -> None:
        """Constant columns for the records that follow (e.g. ``method=..., example=0``).

        ``facts``: the asked fact's token positions as ``START:END`` ranges (half-open,
        comma-separated; :func:`evictlab.tasks.examples.useful_spec`), or a callable
        returning them (called here, once per run), or the positions themselves (int
        array, as :attr:`facts` holds them), or None: then ``fact_held`` and ``fact_kept``
        are null. Not a column itself."""
        self.labels = dict(labels)
        if isinstance(facts, np.ndarray):
            self.facts = np.unique(facts.astype(np.int64))
            return
        self.facts = fact_positions(facts() if callable(facts) else facts)

    def record(self, compression: int, phase: str, seen: int, layer: int, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, lengths: np.ndarray, keep: list[list[torch.Tensor]],
               queries: torch.Tensor, q_positions: torch.Tensor, scaling: float) -> None:
        """One layer of one compression, before eviction.

        Args:
            compression: index of the compression in the run (0-based); ``phase`` its phase;
                ``seen`` tokens fed so far.
            keys, values: ``(batch, kv_heads, S, d)`` held entries (padded past ``lengths``).
            positions: ``(batch, kv_heads, S)`` their positions (ascending within a cell).
            lengths: int ``(kv_heads,)`` entries each cell holds.
            keep: ``keep[i][h]`` sorted int64 indices of the kept entries.
            queries: ``(batch, q_heads, w, d)`` the observation window; ``q_positions`` ``(w,)``.
            scaling: the attention logit scale.
        """
        from evictlab.kv.attention import attention_probs

        batch, hk = keys.shape[0], keys.shape[1]
        g = queries.shape[1] // hk
        qpos = q_positions.cpu()
        rows = _Rows()
        cells: list[dict[str, Any]] = []
        for i in range(batch):
            for h in range(hk):
                n = int(lengths[h])
                pos = positions[i, h, :n].cpu()
                if n > 1 and not bool((pos[1:] > pos[:-1]).all()):
                    raise RuntimeError(f"layer {layer} cell {h}: held positions are not ascending")
                probs = attention_probs(queries[i:i + 1, h * g:(h + 1) * g], keys[i:i + 1, h:h + 1, :n], scaling,
                                        q_positions, positions[i, h, :n])[0].to("cpu", torch.float64).numpy()
                visible = (pos[None, :] <= qpos[:, None]).sum(-1).numpy()  # (w,) prefix lengths
                kept = keep[i][h].cpu().numpy()
                c = len(cells)
                cells.append({"compression": compression, "phase": phase, "seen": int(seen), "item": i,
                              "layer": layer, "kv_head": h, "held": n, "kept": int(kept.size),
                              **self._fact_counts(pos.numpy(), kept)})
                rows.values.append(values[i, h, :n].to("cpu", torch.float64).numpy())
                start = rows.v_used
                rows.v_used += n
                for j in range(g):
                    for t, n_r in enumerate(visible):
                        a = kept[kept < n_r]
                        if a.size == 0:
                            continue
                        p = probs[j, t, :n_r]
                        rows.p.append(p / p.sum())
                        rows.v_start.append(start)
                        rows.kept.append(a)
                        rows.cell.append(c)
        self._measure(rows, cells)
        self.rows.extend({**self.labels, **c} for c in cells)

    def _fact_counts(self, pos: np.ndarray, kept: np.ndarray) -> dict[str, int | None]:
        """``fact_held`` / ``fact_kept``: entries of a cell at the fact's positions among the
        held positions ``pos`` and among the kept ones ``pos[kept]`` (None without facts)."""
        if self.facts is None:
            return {"fact_held": None, "fact_kept": None}
        return {"fact_held": int(np.isin(pos, self.facts).sum()),
                "fact_kept": int(np.isin(pos[kept], self.facts).sum())}

    def _measure(self, rows: _Rows, cells: list[dict[str, Any]]) -> None:
        """Fill the per-cell means of ``cells`` from the layer's observation rows."""
        from evictlab.core.kernels import batch_dropped_mass, batch_forced_error, batch_top_mass
        from evictlab.solve.kernels import batch_solve

        R = len(rows.p)
        cell = np.asarray(rows.cell, dtype=np.int64)
        if R == 0:
            for c in cells:
                c.update(rows=0, dropped_kept=None, dropped_top=None, e_kept=None, e_top=None, es_hat=None,
                         gap_closed=None, rows_e_top_zero=0, es_hat_note="no observation row sees a kept entry")
            return
        n = np.array([p.size for p in rows.p], dtype=np.int64)
        off = np.concatenate([[0], np.cumsum(n)])
        p = np.concatenate(rows.p)
        vals = np.concatenate(rows.values)
        vs = np.asarray(rows.v_start, dtype=np.int64)
        s = np.array([a.size for a in rows.kept], dtype=np.int64)
        kept = np.full((R, int(s.max())), -1, dtype=np.int64)
        for r, a in enumerate(rows.kept):
            kept[r, :a.size] = a
        e_kept = batch_forced_error(p, off, vals, vs, kept)
        d_kept = batch_dropped_mass(p, off, kept)
        e_top, d_top = np.empty(R), np.empty(R)
        es_hat = np.full(R, np.nan)
        pool = np.minimum(n, s + self.r_m + self.r_e)
        subsets = np.array([comb(int(c), int(k)) for c, k in zip(pool, s)], dtype=object)
        for size in np.unique(s):
            idx = np.flatnonzero(s == size)
            sub_n = n[idx]
            sub_off = np.concatenate([[0], np.cumsum(sub_n)])
            sub_p = np.concatenate([p[off[r]:off[r + 1]] for r in idx])
            top = batch_top_mass(sub_p, sub_off, int(size))
            e_top[idx] = batch_forced_error(sub_p, sub_off, vals, vs[idx], top)
            d_top[idx] = batch_dropped_mass(sub_p, sub_off, top)
            small = np.array([subsets[r] <= self.max_subsets for r in idx], dtype=bool)
            if small.any():
                sel = idx[small]
                sel_n = n[sel]
                sel_off = np.concatenate([[0], np.cumsum(sel_n)])
                sel_p = np.concatenate([p[off[r]:off[r + 1]] for r in sel])
                out = batch_solve(sel_p, sel_off, vals, vs[sel], np.array([size], dtype=np.int64), self.r_m,
                                  self.r_e, 0)
                es_hat[sel] = out[1][:, 0]
        for c, info in enumerate(cells):
            m = cell == c
            k = int(m.sum())
            info["rows"] = k
            if k == 0:
                info.update(dropped_kept=None, dropped_top=None, e_kept=None, e_top=None, es_hat=None,
                            gap_closed=None, rows_e_top_zero=0, es_hat_note="no observation row sees a kept entry")
                continue
            et, eh = e_top[m], es_hat[m]
            info.update(dropped_kept=float(d_kept[m].mean()), dropped_top=float(d_top[m].mean()),
                        e_kept=float(e_kept[m].mean()), e_top=float(et.mean()), rows_e_top_zero=int((et <= 0).sum()))
            if np.isnan(eh).any():
                worst = int(np.argmax([subsets[r] for r in np.flatnonzero(m)]))
                r = int(np.flatnonzero(m)[worst])
                info.update(es_hat=None, gap_closed=None,
                            es_hat_note=f"pool enumeration C({int(pool[r])}, {int(s[r])}) = {subsets[r]:,} subsets "
                                        f"per row > max_subsets {self.max_subsets:,}")
            else:
                pos = et > 0
                info.update(es_hat=float(eh.mean()),
                            gap_closed=float(np.median((et[pos] - eh[pos]) / et[pos])) if pos.any() else None,
                            es_hat_note=None)

    def table(self) -> pl.DataFrame:
        """The trace so far: one row per recorded cell (labels first, then :data:`TRACE_COLUMNS`)."""
        if not self.rows:
            return pl.DataFrame(schema={c: pl.Null for c in TRACE_COLUMNS})
        labels = [k for k in self.rows[0] if k not in TRACE_COLUMNS]
        return pl.DataFrame(self.rows, infer_schema_length=None).select([*labels, *TRACE_COLUMNS])

    def write(self, path: Any) -> None:
        """Write :meth:`table` as Parquet (atomically, with its checksum)."""
        from evictlab.io import write_checked_parquet

        write_checked_parquet(self.table(), path)
