"""The ContourKV profiles shipped in ``data/contour/``: ``profile=default`` picks the loaded model's.

Each shipped profile is a file of :mod:`evictlab.contour.profile` (``<model slug>.json``)
with its provenance beside it (``<model slug>.provenance.json``: the commands, the commit,
the rows it was fitted on). :func:`default_profile` returns the one whose geometry is the
model's (layers, KV heads, query heads, head dim, sliding windows); a model no shipped
profile describes is an :class:`~evictlab.errors.InputError` that lists what is shipped.
Geometry is all a profile can be checked against (the decode loop knows the model's
geometry, not its weights): a fine-tune of a shipped model shares its profile's geometry,
so it is accepted, with the caveat that its statistics may differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from evictlab.errors import InputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from evictlab.contour.profile import ContourProfile
    from evictlab.models.geometry import ModelGeometry

__all__ = ["DEFAULT", "SHIPPED_DIR", "default_profile", "shipped_profiles"]

#: The parameter value that selects a shipped profile (``profile=default``).
DEFAULT = "default"
#: Where the shipped profiles live (the repository's ``data/contour/``).
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "data" / "contour"


def shipped_profiles(folder: Path = SHIPPED_DIR) -> list[Path]:
    """The shipped profile files, sorted (the provenance records are not profiles)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("*.json")
                  if not p.name.endswith((".provenance.json", ".run_record.json")))


def default_profile(geometry: ModelGeometry, folder: Path = SHIPPED_DIR) -> tuple[Path, ContourProfile]:
    """The shipped profile fitted on a model of ``geometry``: ``(path, profile)``.

    :class:`InputError` (field ``profile``) when none matches, naming the shipped profiles'
    models and how to fit one for this model.
    """
    from evictlab.contour.profile import ContourProfile

    files = shipped_profiles(folder)
    models = []
    for path in files:
        prof = ContourProfile.load(path)
        try:
            prof.check(geometry, source=str(path))
        except InputError:
            models.append(prof.model)
            continue
        return path, prof
    have = ", ".join(models) if models else f"none (no profile in {folder})"
    raise InputError("profile", f"default: no shipped profile describes this model's geometry ({geometry.n_layers} "
                     f"layers x {geometry.kv_heads} KV heads, head dim {geometry.head_dim}); shipped: {have}",
                     "fit one on this model's rows: `evictlab capture --model MODEL --out ROWS`, then "
                     "`evictlab contour fit ROWS --out PROFILE.json` and pass profile=PROFILE.json")
