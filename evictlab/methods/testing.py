"""Helpers that let registry-driven tests call every allocator on hand-made inputs.

Most allocators need only :class:`~evictlab.methods.base.AllocInputs`; some need more:
``contourkv`` (online) reads the observation window's profile (``needs``), and
``contourkv_pred`` a fitted predictor file. :func:`allocator_for_tests` builds any registered
allocator with what it requires, and :func:`with_needs` adds to hand-made inputs what the
decode loop would compute (seeded, realistic: the tail masses of random attention rows).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evictlab.methods.base import AllocInputs, Allocator, WindowProfile

__all__ = ["example_predictor", "example_profile", "model_profile", "example_ranked_window", "example_window", "allocator_for_tests", "scorers_on_tensors", "with_needs"]

_DIR: Path | None = None


def example_predictor(folder: str | Path | None = None, coef: float = 2.0, intercept: float = -1.0) -> Path:
    """A mass-only predictor file (``evictlab.stats.predictors`` JSON): probability of a
    significant gap ``sigmoid(coef * (m - 0.5) / 0.25 + intercept)`` at dropped mass ``m``."""
    from evictlab.stats.predictors import Predictor

    global _DIR
    if folder is None:
        _DIR = _DIR or Path(tempfile.mkdtemp(prefix="evictlab-test-"))
        folder = _DIR
    path = Path(folder) / f"predictor-{coef}-{intercept}.json"
    if not path.exists():
        Predictor(["dropped_mass"], [0.5], [0.25], [coef], intercept, 1.0, 0.0, 1.11,
                  {"trained_on": "hand-made test predictor"}).save(path)
    return path


def allocator_for_tests(name: str, **params: Any) -> Allocator:
    """``make_allocator(name, **params)``, adding a hand-made predictor for ``contourkv_pred``."""
    from evictlab.methods import make_allocator

    if name == "contourkv_pred" and "predictor" not in params and "profile" not in params:
        params["predictor"] = example_predictor()
    return make_allocator(name, **params)


def example_window(inputs: AllocInputs, seed: int = 0, rows: int = 8) -> WindowProfile:
    """A window profile for ``inputs``: per cell, ``rows`` random attention rows over its held
    entries (softmax of Gaussian logits with a per-cell temperature, so cells differ from
    peaked to flat), through :func:`evictlab.contour.profile.tail_mass`."""
    from evictlab.contour.profile import normalised_entropy, tail_mass

    gen = torch.Generator().manual_seed(seed)
    batch = inputs.scores[0].shape[0]
    tails = []
    ent = np.zeros((batch, inputs.n_layers, inputs.kv_heads))
    for l, sc in enumerate(inputs.scores):
        t = np.zeros((batch, inputs.kv_heads, sc.shape[2] + 1))
        for b in range(batch):
            for h in range(inputs.kv_heads):
                n = int(inputs.lengths[l, h])
                if n == 0:
                    t[b, h, 0] = 1.0
                    continue
                scale = float(torch.rand((), generator=gen)) * 4.0
                p = torch.softmax(torch.randn(rows, n, generator=gen, dtype=torch.float64) * scale, -1)
                t[b, h, :n + 1] = tail_mass(p).mean(0)
                ent[b, l, h] = float(normalised_entropy(p, np.full(rows, n)).mean())
        tails.append(t)
    return WindowProfile(tuple(tails), ent)


def example_ranked_window(inputs: AllocInputs, seed: int = 0, rows: int = 8, dim: int = 4) -> WindowProfile:
    """A window profile with the scorer-ranked curves too: per cell, ``rows`` random attention
    rows over its held entries and random values ``(n, dim)``, the keep order that of
    ``inputs.scores`` (sinks and recent from the inputs, else 0), through
    :func:`evictlab.contour.profile.ranked_curves` (the decode loop's computation on given rows)."""
    from evictlab.contour.profile import ranked_curves
    from evictlab.methods.base import keep_order

    base = example_window(inputs, seed, rows)
    gen = torch.Generator().manual_seed(seed + 1)
    batch = inputs.scores[0].shape[0]
    ranked, errors = [], []
    for l, sc in enumerate(inputs.scores):
        d = np.zeros((batch, inputs.kv_heads, sc.shape[2] + 1))
        e = np.zeros_like(d)
        for b in range(batch):
            for h in range(inputs.kv_heads):
                n = int(inputs.lengths[l, h])
                scale = float(torch.rand((), generator=gen)) * 4.0
                p = torch.softmax(torch.randn(rows, n, generator=gen, dtype=torch.float64) * scale, -1)
                v = torch.randn(n, dim, generator=gen, dtype=torch.float64)
                order = keep_order(sc[b, h, :n], sinks=inputs.sinks or 0, recent=inputs.recent or 0)
                d[b, h, :n + 1], e[b, h, :n + 1] = ranked_curves(p, v, order)
        ranked.append(d)
        errors.append(e)
    return WindowProfile(base.tail, base.entropy_norm, tuple(ranked), tuple(errors))


def _peaked_to_flat(n_layers: int, kv_heads: int, seed: int) -> np.ndarray:
    """Hand-made relative dropped-mass curves ``(n_layers, kv_heads, len(GRID))``:
    ``D(r) = (1 - r) ** (1 / power)`` (0 at r = 1), ``power`` seeded in [0.05, 3] per cell,
    from peaked to flat."""
    from evictlab.contour.profile import GRID

    power = np.random.default_rng(seed).uniform(0.05, 3.0, size=(n_layers, kv_heads, 1))
    return (1.0 - GRID[None, None, :]) ** (1.0 / power) * (GRID[None, None, :] < 1)


def example_profile(inputs: AllocInputs, seed: int = 0) -> tuple[Any, Any]:
    """A hand-made fitted profile of ``inputs``' cells and a model geometry it describes
    (``q_heads = kv_heads``, head dim 8, the inputs' windows): ``(geometry, profile)``.
    Cells from peaked to flat: ``D(r) = (1 - r) ** (1 / power)``, ``power`` in [0.05, 3]."""
    from evictlab.contour.profile import GRID, ContourProfile
    from evictlab.models.geometry import ModelGeometry, RopeSpec

    L, hk = inputs.lengths.shape
    dropped = _peaked_to_flat(L, hk, seed)
    windows = [None if w is None else int(w) for w in inputs.windows]
    geometry = ModelGeometry(L, hk, hk, 8, torch.float32, 8 ** -0.5, tuple(windows), (RopeSpec(10000.0),) * L)
    shape = {"n_layers": L, "kv_heads": hk, "q_heads": hk, "head_dim": 8, "windows": windows}
    ones = np.ones((L, hk))
    prof = ContourProfile("hand-made", shape, GRID.copy(), dropped, ones * 0.5, np.ones((L, hk), np.int64),
                          ones * 100, {"rows": "hand-made"})
    return geometry, prof


def model_profile(model: Any, path: str | Path, seed: int = 0) -> Path:
    """A hand-made fitted profile of ``model``'s geometry saved at ``path`` (cells from peaked
    to flat, as :func:`example_profile`): what ``contourkv_offline`` reads for a model no
    shipped profile describes (the tiny test models)."""
    from evictlab.contour.profile import GRID, ContourProfile
    from evictlab.models.geometry import model_geometry

    g = model_geometry(model)
    dropped = _peaked_to_flat(g.n_layers, g.kv_heads, seed)
    ones = np.ones((g.n_layers, g.kv_heads))
    geometry = {"n_layers": g.n_layers, "kv_heads": g.kv_heads, "q_heads": g.q_heads, "head_dim": g.head_dim,
                "windows": list(g.windows)}
    return ContourProfile("tiny", geometry, GRID.copy(), dropped, ones * 0.5, np.ones_like(ones, dtype=np.int64),
                          ones * 50, {"rows": "hand-made"}).save(Path(path))


def with_needs(allocator: Allocator, inputs: AllocInputs, seed: int = 0) -> AllocInputs:
    """``inputs`` plus what ``allocator.needs`` asks the decode loop for (:func:`example_window`,
    :func:`example_ranked_window` when it reads the scorer-ranked curves); for an allocator on
    the shipped profile (``profile=default``) and inputs that name no model, a model geometry
    of the inputs' cells with a hand-made profile for it (:func:`example_profile`)."""
    if getattr(allocator, "is_default", False) and inputs.geometry is None:
        geometry, prof = example_profile(inputs, seed)
        allocator.use_default(geometry, prof)  # type: ignore[attr-defined]
        inputs = dataclasses.replace(inputs, geometry=geometry)
    if inputs.window is None and {"window_ranked", "window_error"} & allocator.needs:
        return dataclasses.replace(inputs, window=example_ranked_window(inputs, seed))
    if "window_profile" in allocator.needs and inputs.window is None:
        return dataclasses.replace(inputs, window=example_window(inputs, seed))
    return inputs


def scorers_on_tensors() -> list[str]:
    """Names of the registered scorers that score hand-made :class:`ScoreInputs` alone, sorted:
    every scorer except those whose ``needs`` include ``"gates"`` (``trimkv`` reads a log-beta
    side table that hooks on a model fill while it runs; it is tested with a model in
    tests/test_gates.py, tests/test_methods_global.py and tests/test_decode_methods.py) or
    ``"labels"`` (``oracle_labels`` needs a task's labels, which it has no default for; tested
    in tests/test_dilution_sweep.py and tests/test_oracle_labels.py)."""
    from evictlab.methods.registry import REGISTRY

    return sorted(n for n, cls in REGISTRY.items() if not {"gates", "labels"} & cls.needs)
