"""Fitting ContourKV profiles from an attention-row dataset (``evictlab contour fit``).

:func:`fit_profile` streams a dataset written by ``evictlab capture`` (or ``rows synth``)
and averages, per cell (layer, KV head), every row's dropped-mass curve on the relative
grid (:func:`evictlab.contour.profile.tail_mass`, :func:`~evictlab.contour.profile.relative_tail`);
the rows of every query head of a GQA group count for their KV head. It also records each
cell's mean normalised entropy (a predictor feature) and where the rows came from.

Optional inputs:

* solver results of the same rows (``evictlab solve ROWS --out RESULTS``): the per-cell
  selection ceilings at the solved budgets are stored beside the profile
  (:func:`selection_table`), so a profile says which cells have gaps to close;
* a fitted dropped-mass predictor (``evictlab predictor fit``): embedded in the profile for
  the ``contourkv_pred`` allocator.

The model geometry (layers, KV and query heads, head dim, sliding windows) is read from the
dataset's manifest (``evictlab capture`` records it); a synthetic dataset has one layer and
no windows. Every cell of that geometry must have rows: a capture with ``--layers`` that
skips layers cannot describe the whole cache and is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from evictlab.contour.profile import GRID, ContourProfile, normalised_entropy, relative_tail, tail_mass
from evictlab.errors import InputError

__all__ = ["fit_profile", "rows_geometry", "selection_table"]

#: Rows per streamed batch (a batch is padded to its longest row to sort all rows at once).
BATCH_ROWS = 512


def rows_geometry(manifest: dict[str, Any], meta: pl.DataFrame, source: str) -> dict[str, Any]:
    """The geometry the rows describe: ``{"n_layers", "kv_heads", "q_heads", "head_dim", "windows"}``.

    From the capture's per-layer ``gqa`` and ``sliding_window`` records when present,
    otherwise (synthetic rows) from the index: layers ``0..max``, no windows.
    """
    src = manifest.get("source", {})
    gqa = src.get("gqa")
    if isinstance(gqa, dict) and gqa:
        layers = sorted(int(k) for k in gqa)
        heads = {tuple(gqa[str(l)]) for l in layers}
        if layers != list(range(len(layers))) or len(heads) != 1:
            raise InputError(source, f"the manifest's per-layer heads {gqa} are not one geometry over layers "
                             f"0..{len(layers) - 1}", "use a dataset captured from one decoder model")
        q_heads, kv_heads = heads.pop()
        sw = src.get("sliding_window", {}) or {}
        windows = [sw.get(str(l)) for l in layers]
        n_layers = len(layers)
    else:
        n_layers = int(meta["layer"].max()) + 1
        kv_heads = int(meta["kv_head"].max()) + 1
        q_heads = int(meta["q_head"].max()) + 1
        windows = [None] * n_layers
    return {"n_layers": int(n_layers), "kv_heads": int(kv_heads), "q_heads": int(q_heads),
            "head_dim": int(manifest["head_dim"]), "windows": [None if w is None else int(w) for w in windows]}


def selection_table(results: pl.DataFrame, meta: pl.DataFrame, source: str, threshold: float = 1.11) -> dict[str, Any]:
    """Per-cell selection ceilings from solver results of these rows.

    ``results``: a prepared results table (``evictlab.stats.results.load_results``);
    ``meta``: the dataset's index (``row_id, layer, kv_head, n``). Every result row must
    name a row of the dataset with the same layer, KV head and key count, or the results
    are refused (they were solved from other rows).

    Returns ``{"threshold", "budgets", "cells": [{"layer", "kv_head", "s": [...], "rows",
    "rows_e_top_zero", "significant_rate", "gap_closed_median"} ...]}``: per budget ``s``,
    the rows, the rows with e(T_s) = 0 (counted, not analysed), the share of the others
    with ``kappa_hat > threshold``, and their median gap closed g(s).
    """
    ids = meta.select("row_id", pl.col("layer").alias("_layer"), pl.col("kv_head").alias("_kv"),
                      pl.col("n").alias("_n"))
    cols = ["row_id", "s", "layer", "n", "e_top", "kappa_hat", "gap_closed", "e_top_zero"]
    if "kv_head" not in results.columns:
        raise InputError(source, "lacks the kv_head column", "solve the rows with `evictlab solve` (it writes kv_head)")
    joined = results.select(*cols, "kv_head").join(ids, on="row_id", how="left")
    bad = joined.filter(pl.col("_layer").is_null() | (pl.col("_layer") != pl.col("layer"))
                        | (pl.col("_kv") != pl.col("kv_head")) | (pl.col("_n") != pl.col("n")))
    if bad.height:
        r = bad.row(0, named=True)
        where = "is not in ROWS" if r["_layer"] is None else (
            f"has layer {r['layer']}, kv_head {r['kv_head']}, n {r['n']} there and layer {r['_layer']}, kv_head "
            f"{r['_kv']}, n {r['_n']} in ROWS")
        raise InputError(source, f"were not solved from ROWS: row_id {r['row_id']} {where} ({bad.height} such rows)",
                         "pass the results of `evictlab solve ROWS --out RESULTS`")
    zero = pl.col("e_top_zero") | (pl.col("e_top") <= 0)
    agg = (joined.group_by("layer", "kv_head", "s")
           .agg(pl.len().alias("rows"), zero.sum().alias("rows_e_top_zero"),
                (pl.col("kappa_hat").filter(~zero) > threshold).mean().alias("significant_rate"),
                pl.col("gap_closed").filter(~zero).median().alias("gap_closed_median"))
           .sort("layer", "kv_head", "s"))
    cells = []
    for (l, h), g in agg.group_by("layer", "kv_head", maintain_order=True):
        cells.append({"layer": int(l), "kv_head": int(h), "s": g["s"].to_list(), "rows": g["rows"].to_list(),
                      "rows_e_top_zero": g["rows_e_top_zero"].to_list(),
                      "significant_rate": g["significant_rate"].to_list(),
                      "gap_closed_median": g["gap_closed_median"].to_list()})
    return {"threshold": float(threshold), "budgets": sorted(int(s) for s in results["s"].unique()), "cells": cells}


def fit_profile(rows: str | os.PathLike[str], results: str | os.PathLike[str] | None = None,
                predictor: str | os.PathLike[str] | None = None, *,
                progress: Callable[[int], None] | None = None) -> ContourProfile:
    """Fit a :class:`ContourProfile` from the row dataset ``rows`` (module docstring).

    ``results``: solver results of these rows (optional, per-cell selection ceilings);
    ``predictor``: a predictor JSON to embed (optional, for ``contourkv_pred``);
    ``progress``: called with the number of rows done after each batch.
    """
    from evictlab.io import sha256_file
    from evictlab.rows.reader import RowStore

    path = Path(rows)
    store = RowStore.open(path)
    man, meta = store.manifest, store.meta
    geometry = rows_geometry(man, meta, str(path))
    n_layers, kv_heads = geometry["n_layers"], geometry["kv_heads"]
    if int(meta["layer"].max()) >= n_layers or int(meta["kv_head"].max()) >= kv_heads:
        raise InputError(str(path), "has rows outside the geometry its manifest records", "re-capture the dataset")
    counts = meta.group_by("layer", "kv_head").len()
    have = np.zeros((n_layers, kv_heads), dtype=np.int64)
    have[counts["layer"].to_numpy(), counts["kv_head"].to_numpy()] = counts["len"].to_numpy()
    missing = np.argwhere(have == 0)
    if missing.size:
        shown = ", ".join(f"({l}, {h})" for l, h in missing[:5].tolist())
        raise InputError(str(path), f"has no rows for {len(missing)} of {n_layers * kv_heads} cells (layer, kv_head): "
                         f"{shown}{' ...' if len(missing) > 5 else ''}",
                         "capture every layer (`evictlab capture` without --layers) so the profile covers the cache")
    G = GRID.size
    dropped = np.zeros((n_layers * kv_heads, G))
    ent = np.zeros(n_layers * kv_heads)
    nsum = np.zeros(n_layers * kv_heads)
    for batch in store.iter_batches(BATCH_ROWS):
        n = np.diff(batch.p_off)
        R, width = n.size, int(n.max())
        padded = np.zeros((R, width))
        mask = np.arange(width)[None, :] < n[:, None]
        padded[mask] = batch.p  # rows left-aligned: the ragged layout, row-major
        curves = relative_tail(tail_mass(padded), n)
        h = normalised_entropy(padded, n)
        cell = batch.meta["layer"].to_numpy() * kv_heads + batch.meta["kv_head"].to_numpy()
        np.add.at(dropped, cell, curves)
        np.add.at(ent, cell, h)
        np.add.at(nsum, cell, n)
        if progress is not None:
            progress(R)
    rows_per_cell = have.reshape(-1)
    source: dict[str, Any] = {
        "rows": str(path), "manifest_sha256": sha256_file(path / "manifest.json"), "rows_used": int(store.n_rows),
        "prompts": int(store.prompts.height), "capture_mode": man["capture_mode"],
        "n_min": int(meta["n"].min()), "n_max": int(meta["n"].max()), "n_mean": float(meta["n"].mean()),
    }
    selection = None
    if results is not None:
        from evictlab.stats.results import load_results

        res_path = Path(results)
        selection = selection_table(load_results(res_path), meta, str(res_path))
        selection.update(path=str(res_path), sha256=sha256_file(res_path))
    embedded = None
    if predictor is not None:
        from evictlab.stats.predictors import Predictor

        pred_path = Path(predictor)
        embedded = Predictor.load(pred_path).to_dict()
        embedded["source"] = {"path": str(pred_path), "sha256": sha256_file(pred_path)}
    shape = (n_layers, kv_heads)
    return ContourProfile(
        model=str(man["model"]), geometry=geometry, grid=GRID.copy(),
        dropped=(dropped / rows_per_cell[:, None]).reshape(*shape, G),
        entropy_norm=(ent / rows_per_cell).reshape(shape), rows=have,
        n_mean=(nsum / rows_per_cell).reshape(shape), source=source, selection=selection, predictor=embedded)
