"""Atomic file writes and checksums shared by every module that writes results.

A write goes to a temporary file in the destination folder, is flushed and fsynced, then
renamed over the destination, so a crash never leaves a half-written file under the final
name (``os.replace`` is atomic on POSIX within one filesystem).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike[str], suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; rename it onto ``dest`` on success.

    The caller writes the file at the yielded path (any library, any format). On an
    exception the temporary file is removed and ``dest`` is left untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix + ".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        # mkstemp creates 0600 files; give the result the mode a plain open() would have.
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, dest)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    """The process umask (os.umask can only be read by setting it, so set it back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(dest: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``dest`` atomically."""
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(dest: str | os.PathLike[str], text: str) -> None:
    """Write UTF-8 ``text`` to ``dest`` atomically."""
    atomic_write_bytes(dest, text.encode("utf-8"))


def atomic_write_json(dest: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON to ``dest`` atomically."""
    atomic_write_text(dest, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def check_output_file(path: str | os.PathLike[str], option: str, *, overwrite: bool) -> Path:
    """Refuse, before any work, an output file path that would fail or clobber something.

    A directory, a path whose folder does not exist (a typo should not create folders) and,
    without ``overwrite``, an existing file are refused with an
    :class:`~evictlab.errors.InputError` naming ``option`` (e.g. ``"--out"``).
    """
    from evictlab.errors import InputError

    path = Path(path)
    if path.is_dir():
        raise InputError(option, f"{path} is a directory", f"pass a file name for {option}, not a folder")
    if not path.parent.is_dir():
        raise InputError(option, f"folder {path.parent} does not exist",
                         f"create it first or pass a {option} inside an existing folder")
    if path.exists() and not overwrite:
        raise InputError(option, f"{path} already exists",
                         f"pass --overwrite to replace it, or choose another {option}")
    return path
