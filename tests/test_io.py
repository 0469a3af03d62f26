"""Atomic writes: all or nothing, and the same file mode a plain write would give."""

from __future__ import annotations

import os
import stat

import pytest

from evictlab.io import atomic_path, atomic_write_json, atomic_write_text, sha256_file


def test_atomic_write_replaces_and_uses_umask_mode(tmp_path):
    dest = tmp_path / "out.txt"
    atomic_write_text(dest, "one")
    atomic_write_text(dest, "two")
    assert dest.read_text() == "two"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temp file left


def test_failed_write_leaves_destination_untouched(tmp_path):
    dest = tmp_path / "r.json"
    atomic_write_json(dest, {"a": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(dest) as tmp:
            tmp.write_text("half")
            raise RuntimeError("crash mid-write")
    assert dest.read_text() == '{\n  "a": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_sha256_matches_hashlib(tmp_path):
    import hashlib

    dest = tmp_path / "b.bin"
    data = os.urandom(3 << 20)
    dest.write_bytes(data)
    assert sha256_file(dest) == hashlib.sha256(data).hexdigest()
