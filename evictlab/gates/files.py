"""Gates on disk: a folder with the weights (safetensors), a JSON config, checkpoints.

A finished gates folder ``DIR`` holds

- ``gates.safetensors``: the :class:`~evictlab.gates.modules.RetentionGates` parameters,
  float32, named as its ``state_dict`` (``first.{l}.weight``, ``projection.weight``, ...);
- ``gates.json`` (written LAST, so its presence marks a finished folder): ``format``
  (``"evictlab-gates"``), ``version``, ``spec`` (the :class:`~evictlab.gates.modules.
  GateSpec`), ``model`` (the ``--model`` given), ``geometry`` (layers, heads, head size,
  hidden size, dtype), ``recipe``, ``data``, ``seed``, ``training`` (steps, wall and CPU
  seconds, final loss terms) and ``sha256`` of the safetensors file;
- ``losses.parquet`` (one row per step) and ``run_record.json``.

Shipped gates (``data/gates/<name>/``, a finished folder each, plus ``training.json``: the
command, commit, data, steps and final losses of the run that made them) are found by
:func:`default_gates_for` (``--scorer-param gates=default``): the folder whose
``gates.json`` records the loaded model's ``weights_digest``
(:func:`evictlab.models.loading.weights_digest`, float32 weights as the registry loads
them); another model is refused in one line.

During training ``checkpoint.pt`` (:func:`save_checkpoint`) holds the step, the gate
parameters, the optimizer state, the RNG states and the loss history; it is replaced
atomically every K steps and removed once the folder is finished.
"""

from __future__ import annotations

import functools
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evictlab.errors import CorruptFileError, InputError
from evictlab.gates.modules import GateSpec, RetentionGates
from evictlab.io import atomic_path, atomic_write_json, read_json, sha256_file

__all__ = [
    "CHECKPOINT_FILE", "CONFIG_FILE", "DEFAULT", "FORMAT", "FORMAT_VERSION", "LOSSES_FILE", "SHIPPED_DIR",
    "WEIGHTS_FILE", "capture_rng", "default_gates_for", "shipped_folders", "geometry_meta", "is_finished", "load_checkpoint", "load_gates", "read_config", "restore_rng",
    "save_checkpoint", "save_gates",
]

FORMAT = "evictlab-gates"
FORMAT_VERSION = 1
WEIGHTS_FILE = "gates.safetensors"
CONFIG_FILE = "gates.json"
CHECKPOINT_FILE = "checkpoint.pt"
LOSSES_FILE = "losses.parquet"
#: ``gates=default``: the shipped gates of the loaded model
DEFAULT = "default"
#: Where the shipped gates live (the repository's ``data/gates/``).
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "data" / "gates"


#: The ``geometry`` entry of ``gates.json``: its keys and their types.
GEOMETRY_KEYS: dict[str, type] = {"n_layers": int, "q_heads": int, "kv_heads": int, "head_dim": int,
                                  "hidden_size": int, "dtype": str}


def geometry_meta(model: Any) -> dict[str, Any]:
    """The ``geometry`` entry of ``gates.json`` for gates of ``model`` (a transformers model)."""
    from evictlab.models.geometry import model_geometry, text_config

    g = model_geometry(model)
    return {"n_layers": g.n_layers, "q_heads": g.q_heads, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
            "hidden_size": int(text_config(model).hidden_size), "dtype": str(g.dtype).removeprefix("torch.")}


def _check_geometry(cfg: dict[str, Any], path: Path, fix: str) -> None:
    """Refuse a config whose geometry is missing, incomplete or disagrees with its spec (the
    spec is what the weights' shapes are checked against when they are loaded)."""
    geo = cfg.get("geometry")
    bad = [k for k, t in GEOMETRY_KEYS.items()
           if not isinstance(geo, dict) or not isinstance(geo.get(k), t) or isinstance(geo.get(k), bool)
           or (t is int and geo[k] <= 0)]
    if bad:
        raise CorruptFileError(str(path), f"has no complete geometry ({', '.join(bad)} missing or not valid)", fix)
    spec = cfg.get("spec")
    if not isinstance(spec, dict):
        raise CorruptFileError(str(path), "has no spec", fix)
    diff = [f"{k} {geo[k]} in the geometry, {spec.get(k)!r} in the spec" for k in ("n_layers", "kv_heads", "hidden_size")
            if geo[k] != spec.get(k)]
    if diff:
        raise CorruptFileError(str(path), f"disagrees with itself ({'; '.join(diff)})", fix)


def is_finished(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds finished gates (its ``gates.json`` exists)."""
    return (Path(folder) / CONFIG_FILE).is_file()


def save_gates(folder: str | os.PathLike[str], gates: RetentionGates, meta: dict[str, Any]) -> Path:
    """Write ``gates.safetensors`` then ``gates.json`` (``meta`` plus format, version, spec,
    checksum) atomically into ``folder``; returns the JSON's path."""
    from safetensors.torch import save_file

    folder = Path(folder)
    weights = folder / WEIGHTS_FILE
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in gates.state_dict().items()}
    with atomic_path(weights, suffix=".safetensors") as tmp:
        # One metadata key: safetensors writes a metadata map in hash order, so two keys
        # could be written in either order and the same gates would not give the same bytes.
        save_file(state, str(tmp), metadata={"format": f"{FORMAT}/{FORMAT_VERSION}"})
    config = {**meta, "format": FORMAT, "version": FORMAT_VERSION, "spec": gates.spec.to_dict(),
              "sha256": sha256_file(weights)}
    atomic_write_json(folder / CONFIG_FILE, config)
    return folder / CONFIG_FILE


def read_config(folder: str | os.PathLike[str], field: str = "gates") -> dict[str, Any]:
    """The ``gates.json`` of a finished folder; :class:`InputError` naming ``field`` when the
    folder is missing or unfinished, :class:`CorruptFileError` when the JSON is damaged or of
    another format/version."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise InputError(field, f"{folder} is not a folder", "pass the --out folder of `evictlab gates train`")
    if not is_finished(folder):
        hint = (" (it holds a checkpoint: the training did not finish)" if (folder / CHECKPOINT_FILE).is_file()
                else "")
        raise InputError(field, f"{folder} holds no finished gates: {CONFIG_FILE} is missing{hint}",
                         "finish the training (rerun the same `evictlab gates train` command to resume) or pass "
                         "another folder")
    fix = f"retrain the gates into a new folder (evictlab gates train --out ...), or delete {folder}"
    cfg = read_json(folder / CONFIG_FILE, fix)
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise CorruptFileError(str(folder / CONFIG_FILE), f"is not an {FORMAT} config", fix)
    if cfg.get("version") != FORMAT_VERSION:
        raise CorruptFileError(str(folder / CONFIG_FILE), f"has version {cfg.get('version')!r}, this evictlab reads "
                               f"version {FORMAT_VERSION}", fix)
    _check_geometry(cfg, folder / CONFIG_FILE, fix)
    return cfg


def load_gates(folder: str | os.PathLike[str], field: str = "gates",
               device: str | torch.device = "cpu") -> tuple[RetentionGates, dict[str, Any]]:
    """``(gates, config)`` from a finished folder (checksum verified), in eval mode, on ``device``."""
    folder = Path(folder).expanduser()
    cfg = read_config(folder, field)
    weights = folder / WEIGHTS_FILE
    st = weights.stat() if weights.is_file() else None
    state = _read_weights(str(weights.resolve()), st.st_mtime_ns if st else 0, st.st_size if st else 0,
                          cfg.get("sha256", ""))
    try:
        spec = GateSpec.from_dict(cfg["spec"])
    except (InputError, TypeError) as exc:
        raise CorruptFileError(str(folder / CONFIG_FILE), f"has an invalid spec ({exc})",
                               "retrain the gates into a new folder") from None
    gates = RetentionGates(spec)
    try:
        gates.load_state_dict(state, strict=True)  # the tensors' names and shapes against the spec
    except RuntimeError as exc:
        raise CorruptFileError(str(weights), f"does not match its spec ({str(exc).splitlines()[0]})",
                               "retrain the gates into a new folder") from None
    gates.requires_grad_(False)
    return gates.to(device).eval(), cfg


@functools.lru_cache(maxsize=4)
def _read_weights(path: str, mtime_ns: int, size: int, sha256: str) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, checksum verified (cached per path, mtime, size)."""
    from safetensors.torch import load_file

    from evictlab.io import check_sha256

    del mtime_ns, size  # only part of the cache key: a rewritten file is read again
    fix = f"retrain the gates into a new folder, or delete {Path(path).parent}"
    check_sha256(path, sha256, fix)
    try:
        return load_file(path)
    except Exception as exc:  # safetensors raises assorted types on damaged files
        raise CorruptFileError(path, f"cannot be read as safetensors ({type(exc).__name__})", fix) from None


# --------------------------------------------------------------------------- checkpoints


def capture_rng() -> dict[str, Any]:
    """Every RNG state a training step could touch (torch CPU and CUDA, numpy, random)."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], torch.from_numpy(np.asarray(np_state[1])), *np_state[2:]],
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the RNG states of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy(), *n[2:]))
    random.setstate(state["python"])


def save_checkpoint(folder: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` (step, gates, optimizer, rng, history, fingerprint) atomically."""
    path = Path(folder) / CHECKPOINT_FILE
    with atomic_path(path, suffix=".pt") as tmp:
        torch.save(state, tmp)
    return path


def load_checkpoint(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The checkpoint in ``folder`` (None if there is none); damaged -> :class:`CorruptFileError`."""
    path = Path(folder) / CHECKPOINT_FILE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises assorted types on damaged files
        raise CorruptFileError(str(path), f"cannot be read ({type(exc).__name__})",
                               f"delete {path} to restart the training from step 0") from None


# --------------------------------------------------------------------------- shipped gates


def shipped_folders(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The finished gates folders under ``root`` (default :data:`SHIPPED_DIR`), sorted."""
    base = Path(root) if root is not None else SHIPPED_DIR
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and is_finished(p))


def default_gates_for(model: Any, field: str = "scorer_param", root: str | os.PathLike[str] | None = None) -> Path:
    """The shipped gates folder for ``model`` (``gates=default``): the one whose config's
    ``weights_digest`` is the model's. :class:`InputError` (``field``) naming the shipped
    sets when none is for this model."""
    from evictlab.models.geometry import model_geometry
    from evictlab.models.loading import weights_digest

    folders = shipped_folders(root)
    digest = weights_digest(model)
    have = []
    for folder in folders:
        cfg = read_config(folder, field)
        if cfg.get("weights_digest") == digest:
            return folder
        geo = cfg["geometry"]
        have.append(f"{cfg.get('model')} ({geo['n_layers']} layers x {geo['kv_heads']} KV heads)")
    g = model_geometry(model)
    shipped = "; ".join(have) or f"none under {root or SHIPPED_DIR}"
    raise InputError(field, f"gates=default: no shipped gates for this model ({g.n_layers} layers x {g.kv_heads} KV "
                     f"heads, weights digest {digest}); shipped: {shipped}",
                     "train gates for it (evictlab gates train --model ... --out DIR) and pass gates=DIR")
