"""The ContourKV profiles shipped in data/contour/: each loads, describes its model's geometry,
carries its provenance (commands, commit, rows, the profile's SHA-256), and ``profile=default``
picks it for that model's geometry and refuses any other."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from evictlab.contour.profile import ContourProfile
from evictlab.contour.shipped import SHIPPED_DIR, default_profile, shipped_profiles
from evictlab.errors import InputError
from evictlab.methods import AllocInputs, check_sizes, make_allocator
from evictlab.models.geometry import ModelGeometry, RopeSpec

#: the geometry of each shipped model (SmolLM2-135M: 30 layers, 9 query / 3 KV heads of 64;
#: Gemma 3 270M: 18 layers, 4 query / 1 KV head of 256, five sliding (512) layers per full one)
GEOMETRIES = {"smollm2-135m": (30, 9, 3, 64, (None,) * 30),
              "gemma3-270m": (18, 4, 1, 256, (512, 512, 512, 512, 512, None) * 3)}


def _geometry(model: str) -> ModelGeometry:
    n, q, k, d, windows = GEOMETRIES[model]
    return ModelGeometry(n, q, k, d, torch.bfloat16, d ** -0.5, windows, (RopeSpec(100000.0),) * n)


def test_every_shipped_profile_loads_with_its_provenance() -> None:
    files = shipped_profiles()
    assert {f.stem for f in files} >= set(GEOMETRIES)
    for path in files:
        prof = ContourProfile.load(path)
        prov = json.loads((SHIPPED_DIR / f"{path.stem}.provenance.json").read_text())
        assert prov["profile"] == path.name and prov["model"] == prof.model
        assert prov["profile_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert len(prov["commit"]) == 40 and any("contour fit" in c for c in prov["commands"])
        assert prov["rows"]["rows_used"] == prof.source["rows_used"] > 0
        assert (prof.rows > 0).all() and path.stat().st_size < 1_000_000  # small enough for the repository


@pytest.mark.parametrize("model", sorted(GEOMETRIES))
def test_default_picks_the_models_profile(model: str) -> None:
    g = _geometry(model)
    path, prof = default_profile(g)
    assert path.stem == model and prof.shape == (g.n_layers, g.kv_heads)
    alloc = make_allocator("contourkv_offline")
    alloc.check(g)
    rng = np.random.default_rng(0)
    scores = [torch.from_numpy(rng.random((1, g.kv_heads, 300)).astype(np.float32)) for _ in range(g.n_layers)]
    inp = AllocInputs.build(scores, 64 * g.cells, floor=20, geometry=g, next_position=300, sinks=4, recent=16)
    sizes = check_sizes(inp, alloc.allocate(inp))
    assert sizes.std() > 0  # the fitted cells differ
    same = make_allocator("contourkv", profile="default")
    np.testing.assert_array_equal(same.allocate(inp), sizes)
    mass = check_sizes(inp, make_allocator("contourkv_mass", profile="default").allocate(inp))
    assert mass.sum() == sizes.sum()


def test_default_is_refused_for_another_geometry() -> None:
    other = ModelGeometry(18, 4, 1, 256, torch.bfloat16, 256 ** -0.5, (1024, 1024, 1024, 1024, 1024, None) * 3,
                          (RopeSpec(10000.0),) * 18)  # Gemma 3 270M's shape, other sliding windows
    with pytest.raises(InputError, match="no shipped profile describes this model's geometry .*shipped: "
                       "gemma3-270m, smollm2-135m"):
        default_profile(other)
    with pytest.raises(InputError, match=r"allocator_param: contourkv_offline parameter profile=default: no shipped"):
        make_allocator("contourkv_offline").check(other)
