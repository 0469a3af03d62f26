"""Dropped-mass profiles: the statistic, its online estimate, and the versioned profile file.

**The statistic (ours, ``docs/theory.md`` section 10.1).** For one attention row ``p`` over
``n`` keys, ``D_p(b)`` is the mass outside the row's ``b`` largest masses, ``b = 0..n``
(the dropped-mass statistic ``m_b = D(T_b)`` of every budget at once). A cell's profile is
the mean of ``D_p`` over the cell's rows, where a cell (layer, KV head) owns the rows of
every query head of its GQA group (each query head's row counts once: the group's heads are
pooled, not averaged into one row first).

* **Offline** (:class:`ContourProfile`, fitted by :mod:`evictlab.contour.fit` from a row
  dataset): rows see different numbers of keys, so the profile is stored against the
  *relative* budget ``r = b / n`` on the fixed grid :data:`GRID`, each row's ``D_p``
  linearly interpolated at ``b = r n``. A profile fitted at one context length is read at
  another by scaling the grid with the reference length of the run (:meth:`ContourProfile.knots`).
* **Online** (:func:`window_stats`): at a compression, the observation window's queries
  (the scorers' last ``window`` queries) x the group's query heads are the rows, attending
  causally over the cell's *held* keys; the profile is kept per integer ``b``.

Both go through :func:`tail_mass`, so they are the same statistic on the same rows
(tested: a dataset written from the window's queries fits to the online estimate).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numba import njit

from evictlab.errors import CorruptFileError, InputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from evictlab.models.geometry import ModelGeometry

__all__ = ["FORMAT", "GRID", "VERSION", "ContourProfile", "ranked_curves", "ranked_window_stats", "forced_error_reference", "relative_tail", "tail_mass",
           "window_stats"]

FORMAT = "evictlab.contour"
#: The profile file version this code writes and reads; any change of layout or meaning bumps it.
VERSION = 1
#: Relative budgets ``r = b / n`` of an offline profile: 0, then 2^-12 .. 1 with eight points
#: per octave (98 points). Dense at small r, where budgets live (64 of 2048 keys is r = 2^-5).
GRID = np.concatenate([[0.0], 2.0 ** (np.arange(-96, 1) / 8.0)])

_REFIT = "fit it again with `evictlab contour fit ROWS --out PROFILE.json`"


# --------------------------------------------------------------------------- the statistic


def _as_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu").numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def tail_mass(probs: np.ndarray | torch.Tensor) -> np.ndarray:
    """Mass outside each row's top-b keys, for every b.

    Args:
        probs: ``(rows, n)`` non-negative masses, numpy or torch (zero padding allowed:
            zeros sort last and carry no mass). Rows are normalised to sum 1 here (sums in
            float64); an all-zero row stays zero.

    Returns:
        float64 ``(rows, n + 1)``: entry ``b`` is ``sum of the n - b smallest masses``,
        i.e. ``D(T_b)``; entry 0 is 1 (0 for an all-zero row), entry n is 0. Summed from the
        small end, so small tails keep their relative accuracy (no ``1 - P`` cancellation).
        The sort runs in the input's dtype (numpy's vectorised sort: ~20x torch's on the CPU).
    """
    asc = np.sort(_as_numpy(probs), axis=-1)
    prefix = np.cumsum(asc, axis=-1, dtype=np.float64)  # entry i = sum of the i + 1 smallest
    n = asc.shape[-1]
    out = np.zeros((*asc.shape[:-1], n + 1))
    out[..., :n] = prefix[..., ::-1]  # entry b = sum of the n - b smallest
    total = prefix[..., -1:] if n else np.zeros((*asc.shape[:-1], 1))
    return np.divide(out, total, out=out, where=total > 0)


def relative_tail(tail: np.ndarray, n: np.ndarray, grid: np.ndarray = GRID) -> np.ndarray:
    """Each row's ``D(b)`` read at ``b = r n`` for every ``r`` of ``grid``, linear between integers.

    Args:
        tail: float64 ``(rows, N + 1)`` from :func:`tail_mass` (``N >= max(n)``).
        n: int ``(rows,)`` keys each row sees.
        grid: relative budgets in ``[0, 1]``.

    Returns:
        float64 ``(rows, len(grid))``.
    """
    x = grid[None, :] * n[:, None].astype(np.float64)
    j = np.minimum(np.floor(x).astype(np.int64), n[:, None])
    j1 = np.minimum(j + 1, n[:, None])
    frac = x - j
    rows = np.arange(tail.shape[0])[:, None]
    lo, hi = tail[rows, j], tail[rows, j1]
    return lo + (hi - lo) * frac


def normalised_entropy(probs: np.ndarray | torch.Tensor, n: np.ndarray | torch.Tensor) -> np.ndarray:
    """``H(p) / log(n)`` per row (nats over nats; 0 when ``n <= 1``), float64 ``(rows,)``.

    ``probs`` ``(rows, N)`` is normalised per row first (zero padding allowed); ``n`` the keys
    each row sees. The same normalisation as the predictors' ``entropy_norm`` feature.
    Logarithms in the input's dtype, sums in float64.
    """
    p = _as_numpy(probs)
    nn = _as_numpy(n).astype(np.float64)
    total = p.sum(-1, dtype=np.float64)
    logs = np.log(p, out=np.zeros_like(p), where=p > 0)
    # H(p / t) = log t - sum(p log p) / t for a row of total t
    with np.errstate(divide="ignore", invalid="ignore"):
        h = np.log(total) - (p * logs).sum(-1, dtype=np.float64) / total
    h = np.where(total > 0, h, 0.0)
    return np.where(nn > 1, h / np.log(np.maximum(nn, 2.0)), 0.0)


def window_stats(queries: torch.Tensor, keys: torch.Tensor, scaling: float, q_positions: torch.Tensor,
                 k_positions: torch.Tensor) -> tuple[np.ndarray, float]:
    """The online profile of one cell from the observation window.

    Args:
        queries: ``(g, w, d)`` the window's post-RoPE queries of the cell's ``g`` query heads.
        keys: ``(n, d)`` the cell's held post-RoPE keys.
        scaling: the attention logit scale.
        q_positions: ``(w,)`` int64 positions of the queries; k_positions ``(n,)`` of the keys
            (causal: a query sees the held keys at or before its position).

    Returns:
        ``(tail, entropy_norm)``: float64 ``(n + 1,)`` the mean of :func:`tail_mass` over the
        ``g x w`` rows (rows that see no key are left out), and the mean normalised entropy
        of those rows (:func:`normalised_entropy`). The attention is the scorers' own
        (:func:`evictlab.kv.attention.attention_probs`, float32).
    """
    from evictlab.kv.attention import attention_probs

    g, w, d = queries.shape
    n = keys.shape[0]
    probs = attention_probs(queries[None], keys[None, None], scaling, q_positions, k_positions)
    rows = probs.reshape(g * w, n)
    seen = (k_positions.to(q_positions.device)[None, :] <= q_positions[:, None]).sum(-1).repeat(g)
    ok = rows.sum(-1) > 0
    if not bool(ok.any()):
        tail = np.zeros(n + 1)
        tail[0] = 1.0
        return tail, 0.0
    rows, seen = rows[ok].cpu().numpy(), seen[ok].cpu().numpy()
    return tail_mass(rows).mean(0), float(normalised_entropy(rows, seen).mean())


def ranked_window_stats(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, scaling: float,
                        q_positions: torch.Tensor, k_positions: torch.Tensor,
                        order: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """The scorer-ranked profiles of one cell: dropped mass and forced error along ``order``.

    The rows are :func:`window_stats`' (the window's queries x the group's query heads,
    attending causally over the held keys; rows that see no key left out). For ``b = 0..n``
    let ``A_b`` be the first ``b`` entries of ``order`` (the scorer's keep order,
    :func:`evictlab.methods.base.keep_order`, so ``A_b`` is the kept set at size ``b``); per
    row, the kept part it sees is ``A_b`` intersected with its visible keys. Prefix sums
    along ``order`` give every ``b`` in one pass:

    * ``D(A_b) = 1 - sum_{j in A_b} p_j`` (``p`` normalised over the visible keys);
    * ``e(A_b) = ||o - o_A||``, ``o = sum_j p_j v_j``, ``o_A = sum_{A_b} p_j v_j / P(A_b)``
      (``= D(A_b) ||m_{A^c} - m_A||``, docs/theory.md; ``o_A = 0`` when ``P(A_b) = 0``).

    Args:
        queries: ``(g, w, d)`` post-RoPE window queries of the cell's query heads.
        keys: ``(n, d)`` held post-RoPE keys; ``values`` ``(n, d)`` (None: no error curve).
        scaling: the attention logit scale.
        q_positions: ``(w,)`` int64; ``k_positions`` ``(n,)`` int64 ascending.
        order: ``(n,)`` int64, a permutation of ``0..n-1``.

    Returns:
        ``(dropped, error)``: float64 ``(n + 1,)`` each, means over the rows (``dropped[0] =
        1``, ``dropped[n] = 0``, ``error[n] = 0``); ``error`` is None without ``values``.
        The attention is the scorers' own (float32), the sums float64.
    """
    from evictlab.kv.attention import attention_probs

    g, w, _ = queries.shape
    n = keys.shape[0]
    probs = attention_probs(queries[None], keys[None, None], scaling, q_positions, k_positions)
    rows = probs.reshape(g * w, n).to(torch.float64)
    total = rows.sum(-1)
    ok = total > 0
    if n == 0 or not bool(ok.any()):
        dropped = np.zeros(n + 1)
        dropped[0] = 1.0
        return dropped, (None if values is None else np.zeros(n + 1))
    return ranked_curves((rows[ok] / total[ok, None]).cpu(), values, order)


def ranked_curves(p: torch.Tensor, values: torch.Tensor | None,
                  order: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """Mean dropped mass and forced error of every prefix of ``order`` (:func:`ranked_window_stats`).

    Args:
        p: ``(R, n)`` attention rows, each summing to 1 (zeros where a row sees no key).
        values: ``(n, d)`` or None (no error curve).
        order: ``(n,)`` int64 permutation: the keep order.

    Returns:
        float64 ``(n + 1,)`` each: ``dropped[b]`` = mean over rows of the mass outside the
        first ``b`` entries of ``order``; ``error[b]`` = mean of ``||o - o_A||`` for that set
        (``o_A = 0`` when the row has no mass on it). The error curve is the Numba kernel
        :func:`_k_forced_error` (reference: :func:`forced_error_reference`).
    """
    p = torch.as_tensor(p).to("cpu", torch.float64)
    R, n = p.shape
    perm = torch.as_tensor(order).to("cpu", torch.int64)
    pr = p[:, perm]  # (R, n) masses in keep order
    # D(A_b) summed from the small end: the mass after position b of the order
    after = torch.zeros(R, n + 1, dtype=torch.float64)
    after[:, :n] = torch.flip(torch.cumsum(torch.flip(pr, [-1]), -1), [-1])
    dropped = after.mean(0).numpy()
    if values is None:
        return dropped, None
    v = torch.as_tensor(values).to("cpu", torch.float64)[perm]  # (n, d) in keep order
    err = _k_forced_error(np.ascontiguousarray(pr.numpy()), np.ascontiguousarray(v.numpy()))
    return dropped, err


@njit(cache=True)
def _k_forced_error(pr: np.ndarray, v: np.ndarray) -> np.ndarray:
    # Per row: o = sum_j p_j v_j, then the kept prefix's sum and mass grown one entry at a
    # time, e(A_b) = ||o - S_b / P_b|| (o_A = 0 while P_b = 0); O(rows x n x d), no
    # (rows, n, d) block. err[n] = 0: A_n holds every key.
    R, n = pr.shape
    d = v.shape[1]
    err = np.zeros(n + 1)
    out = np.zeros(d)
    acc = np.zeros(d)
    for r in range(R):
        out[:] = 0.0
        for j in range(n):
            w = pr[r, j]
            for k in range(d):
                out[k] += w * v[j, k]
        s = 0.0
        for k in range(d):
            s += out[k] * out[k]
        err[0] += np.sqrt(s)
        acc[:] = 0.0
        mass = 0.0
        for b in range(n - 1):
            w = pr[r, b]
            mass += w
            for k in range(d):
                acc[k] += w * v[b, k]
            s = 0.0
            if mass > 0.0:
                for k in range(d):
                    x = out[k] - acc[k] / mass
                    s += x * x
            else:
                for k in range(d):
                    s += out[k] * out[k]
            err[b + 1] += np.sqrt(s)
    if R:
        err /= R
    return err


def forced_error_reference(p: torch.Tensor, values: torch.Tensor, order: torch.Tensor) -> np.ndarray:
    """Plain torch beside :func:`_k_forced_error`: the forced-error curve of
    :func:`ranked_curves` from one ``(rows, n, d)`` block of prefix sums.

    Args: as :func:`ranked_curves` (``values`` required). Returns float64 ``(n + 1,)``."""
    p = torch.as_tensor(p).to("cpu", torch.float64)
    R, n = p.shape
    perm = torch.as_tensor(order).to("cpu", torch.int64)
    pr = p[:, perm]
    v = torch.as_tensor(values).to("cpu", torch.float64)[perm]
    out = pr @ v  # (R, d) the dense outputs o
    part = torch.cumsum(pr[:, :, None] * v[None], 1)  # (R, n, d) kept prefix sums
    mass = torch.cumsum(pr, -1)[:, :, None]
    o_a = torch.where(mass > 0, part / torch.where(mass > 0, mass, torch.ones_like(mass)), torch.zeros_like(part))
    err = torch.zeros(R, n + 1, dtype=torch.float64)
    err[:, 1:] = torch.linalg.vector_norm(out[:, None, :] - o_a, dim=-1)
    err[:, 0] = torch.linalg.vector_norm(out, dim=-1)
    if n:
        err[:, n] = 0.0
    return err.mean(0).numpy()


# --------------------------------------------------------------------------- the file


def _windows_text(windows: list[int | None]) -> str:
    """``[None, 512, 512]`` -> ``"sliding 512 on 2 of 3 layers"`` (short, for messages)."""
    sliding = sorted({w for w in windows if w is not None})
    if not sliding:
        return f"none sliding ({len(windows)} layers)"
    n = sum(w is not None for w in windows)
    return f"sliding {'/'.join(map(str, sliding))} on {n} of {len(windows)} layers"


def _geometry_dict(n_layers: int, kv_heads: int, q_heads: int, head_dim: int,
                   windows: list[int | None]) -> dict[str, Any]:
    return {"n_layers": int(n_layers), "kv_heads": int(kv_heads), "q_heads": int(q_heads),
            "head_dim": int(head_dim), "windows": [None if w is None else int(w) for w in windows]}


@dataclass
class ContourProfile:
    """A fitted ContourKV profile: per cell, the mean dropped mass at each relative budget.

    Attributes:
        model: the model name of the rows (informational; :meth:`check` compares geometry).
        geometry: ``{"n_layers", "kv_heads", "q_heads", "head_dim", "windows"}`` of the
            model the rows came from (``windows``: per layer the sliding window or None).
        grid: float64 ``(G,)`` relative budgets ``r = b / n`` (:data:`GRID`).
        dropped: float64 ``(n_layers, kv_heads, G)``: mean over the cell's rows of the mass
            outside the row's top-``r n`` keys; non-increasing in ``r``, 1 at ``r = 0``.
        entropy_norm: float64 ``(n_layers, kv_heads)``: mean ``H(p) / log n`` of the rows.
        rows: int64 ``(n_layers, kv_heads)``: rows per cell.
        n_mean: float64 ``(n_layers, kv_heads)``: mean keys a row saw.
        source: where the rows came from (dataset path, manifest SHA-256, counts, capture
            mode and the rows' key-count range).
        selection: per-cell selection ceilings from solver results (or None): see
            :func:`evictlab.contour.fit.selection_table`.
        predictor: an embedded dropped-mass predictor (``evictlab.stats.predictors``
            JSON) for ``contourkv_pred``, or None.
        created: ISO time of the fit.
    """

    model: str
    geometry: dict[str, Any]
    grid: np.ndarray
    dropped: np.ndarray
    entropy_norm: np.ndarray
    rows: np.ndarray
    n_mean: np.ndarray
    source: dict[str, Any]
    selection: dict[str, Any] | None = None
    predictor: dict[str, Any] | None = None
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    @property
    def shape(self) -> tuple[int, int]:
        """``(n_layers, kv_heads)``."""
        return int(self.geometry["n_layers"]), int(self.geometry["kv_heads"])

    # -- use ---------------------------------------------------------------------------
    def check(self, geometry: ModelGeometry | None, shape: tuple[int, int] | None = None,
              source: str = "profile") -> None:
        """Refuse a model whose cells this profile does not describe.

        Compares layers, KV heads, head dim and sliding windows with ``geometry`` (the
        model's), or only ``shape`` = ``(n_layers, kv_heads)`` when no geometry is known.
        :class:`InputError` naming ``source`` and every difference.
        """
        mine = self.geometry
        if geometry is not None:
            theirs = _geometry_dict(geometry.n_layers, geometry.kv_heads, geometry.q_heads, geometry.head_dim,
                                    list(geometry.windows))
            keys = ("n_layers", "kv_heads", "head_dim", "windows")
        else:
            if shape is None:
                return
            theirs = {"n_layers": shape[0], "kv_heads": shape[1]}
            keys = ("n_layers", "kv_heads")
        def show(k: str, v: Any) -> str:
            return _windows_text(v) if k == "windows" else str(v)

        diff = [f"{k} {show(k, mine[k])} in the profile, {show(k, theirs[k])} in the model"
                for k in keys if mine[k] != theirs[k]]
        if diff:
            raise InputError(source, f"was fitted on another model geometry ({'; '.join(diff)}; profile from "
                             f"{self.model!r})", "fit a profile on this model's rows: `evictlab capture --model "
                             "MODEL --out ROWS`, then `evictlab contour fit ROWS --out PROFILE.json`")

    def knots(self, n_ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The profile in absolute budgets for a run whose cells see ``n_ref`` keys.

        Args:
            n_ref: ``(n_layers, kv_heads)`` reference key counts (> 0): the tokens a row of
                the cell would see now (the context so far, or the window on sliding layers).

        Returns:
            ``(x, y)`` float64 ``(cells, G)``, cells layer-major: knot ``j`` of cell ``c`` is
            ``(grid_j * n_ref_c, dropped_c,j)``; ``D_c(b)`` is the linear interpolation.
        """
        nr = np.asarray(n_ref, dtype=np.float64).reshape(-1)
        if (nr <= 0).any():
            raise InputError("n_ref", "reference key counts must be positive", "pass the tokens seen per cell")
        x = self.grid[None, :] * nr[:, None]
        return x, self.dropped.reshape(nr.size, -1).copy()

    # -- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        n_layers, kv_heads = self.shape
        cells = [{"layer": l, "kv_head": h, "rows": int(self.rows[l, h]), "n_mean": float(self.n_mean[l, h]),
                  "entropy_norm": float(self.entropy_norm[l, h]), "dropped": [float(v) for v in self.dropped[l, h]]}
                 for l in range(n_layers) for h in range(kv_heads)]
        return {
            "format": FORMAT, "version": VERSION, "model": self.model, "geometry": self.geometry,
            "statistic": {
                "name": "mean dropped mass outside the row's top-b keys (D(T_b)), per cell",
                "budget_axis": "relative: r = b / n, n = keys the row sees; linear between grid points",
                "gqa": "every query head of the cell's group contributes its own rows",
            },
            "grid": [float(r) for r in self.grid], "cells": cells, "source": self.source,
            "selection": self.selection, "predictor": self.predictor, "created": self.created,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as versioned JSON (atomically)."""
        from evictlab.io import atomic_write_json

        atomic_write_json(path, self.to_dict())
        return Path(path)

    @classmethod
    def from_dict(cls, d: Any, source: str = "profile") -> ContourProfile:
        """Rebuild from :meth:`to_dict` output, checking the format, version and every field."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CorruptFileError(source, f"is not a ContourKV profile (format {got!r}, expected {FORMAT!r})",
                                   "pass a file written by `evictlab contour fit`")
        if d.get("version") != VERSION:
            raise InputError(source, f"profile version {d.get('version')!r} is not supported (this evictlab reads "
                             f"version {VERSION})", _REFIT)
        try:
            geo = d["geometry"]
            geometry = _geometry_dict(geo["n_layers"], geo["kv_heads"], geo["q_heads"], geo["head_dim"],
                                      list(geo["windows"]))
            grid = np.asarray(d["grid"], dtype=np.float64)
            n_layers, kv_heads = geometry["n_layers"], geometry["kv_heads"]
            cells = d["cells"]
            dropped = np.empty((n_layers, kv_heads, grid.size))
            ent = np.empty((n_layers, kv_heads))
            rows = np.empty((n_layers, kv_heads), dtype=np.int64)
            n_mean = np.empty((n_layers, kv_heads))
            seen = np.zeros((n_layers, kv_heads), dtype=bool)
            for c in cells:
                l, h = int(c["layer"]), int(c["kv_head"])
                if not (0 <= l < n_layers and 0 <= h < kv_heads) or seen[l, h]:
                    raise ValueError(f"cell ({l}, {h}) is outside the geometry or repeated")
                seen[l, h] = True
                dropped[l, h] = np.asarray(c["dropped"], dtype=np.float64)
                ent[l, h], rows[l, h], n_mean[l, h] = float(c["entropy_norm"]), int(c["rows"]), float(c["n_mean"])
            model, src = str(d["model"]), dict(d["source"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptFileError(source, f"missing or malformed field ({exc})", _REFIT) from None
        if len(geometry["windows"]) != n_layers or not seen.all():
            raise CorruptFileError(source, f"describes {int(seen.sum())} of {n_layers} x {kv_heads} cells "
                                   f"({len(geometry['windows'])} windows)", _REFIT)
        ok = (grid.ndim == 1 and grid.size >= 2 and grid[0] == 0.0 and grid[-1] == 1.0
              and bool((np.diff(grid) > 0).all()))
        if not ok:
            raise CorruptFileError(source, "grid must rise strictly from 0 to 1", _REFIT)
        if not (np.isfinite(dropped).all() and (dropped >= -1e-9).all() and (dropped <= 1 + 1e-9).all()
                and np.isfinite(ent).all() and (rows > 0).all()):
            raise CorruptFileError(source, "dropped masses must lie in [0, 1] and every cell needs rows", _REFIT)
        rise = np.diff(dropped, axis=-1) > 1e-9  # a mean of non-increasing curves never rises (but for rounding)
        if rise.any():
            l, h, j = (int(v) for v in np.argwhere(rise)[0])
            raise CorruptFileError(source, f"cell (layer {l}, KV head {h}): the dropped mass rises with the budget "
                                   f"({dropped[l, h, j]:.6g} at b/n = {grid[j]:g}, {dropped[l, h, j + 1]:.6g} at "
                                   f"{grid[j + 1]:g}); a dropped-mass profile never rises", _REFIT)
        return cls(model, geometry, grid, dropped, ent, rows, n_mean, src, d.get("selection"), d.get("predictor"),
                   str(d.get("created", "")))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ContourProfile:
        """Read a profile file; missing, foreign, corrupt or other-version files are refused."""
        p = Path(path)
        if not p.is_file():
            raise InputError(str(p), "no such profile file" if not p.exists() else "is not a file",
                             "check the path, or fit a profile with `evictlab contour fit ROWS --out PROFILE.json`")
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptFileError(str(p), f"is not valid JSON ({exc})", _REFIT) from None
        return cls.from_dict(d, source=str(p))
