"""Atomic writes (all or nothing, the mode a plain write gives), write locks, output paths."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

from evictlab.errors import InputError
from evictlab.io import (
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    check_output_path,
    exclusive_lock,
    lock_path_for,
    remove_temp_files,
    sha256_file,
)


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


# --------------------------------------------------------------------------------------
# write locks and output paths
# --------------------------------------------------------------------------------------

_HOLD = textwrap.dedent("""
    import sys, time
    from evictlab.io import exclusive_lock
    with exclusive_lock(sys.argv[1], "--out"):
        print("held", flush=True)
        time.sleep(60)
""")


def _holder(target) -> subprocess.Popen:
    """A second process holding the lock of ``target`` (until killed)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(target)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_refuses_another_process_at_once_and_dies_with_it(tmp_path):
    target = tmp_path / "out.parquet"
    proc = _holder(target)
    try:
        with pytest.raises(InputError, match=rf"--out: .*out.parquet is being written by another "
                                             rf"evictlab run \(pid {proc.pid};.*Fix: wait"):
            exclusive_lock(target).acquire()
    finally:
        proc.kill()  # SIGKILL: no cleanup runs in the holder
        proc.wait()
    assert lock_path_for(target).exists()  # a stale lock file, but no stale lock
    with exclusive_lock(target):
        pass
    assert not lock_path_for(target).exists()  # removed on release


def test_lock_is_reentrant_in_its_thread_only(tmp_path):
    target = tmp_path / "ds"
    outer = exclusive_lock(target).acquire()
    with exclusive_lock(target):  # the same thread may take it again (command -> library)
        pass
    assert lock_path_for(target).exists()  # still held by the outer acquisition
    errors = []

    def other():
        try:
            exclusive_lock(target).acquire()
        except InputError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "another evictlab run" in str(errors[0])
    outer.release()
    assert not lock_path_for(target).exists()


def test_output_path_rule(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    (tmp_path / "d").mkdir()
    with pytest.raises(InputError, match=r"--out: the parent folder .*nowhere.* does not exist.*"
                                         r"Fix: create the folder first \(mkdir -p"):
        check_output_path(tmp_path / "nowhere" / "x.parquet", "--out", directory=False)
    assert not (tmp_path / "nowhere").exists()
    with pytest.raises(InputError, match="is not a folder"):
        check_output_path(tmp_path / "f.txt" / "x", "--out", directory=True)
    with pytest.raises(InputError, match="is a directory, not a file"):
        check_output_path(tmp_path / "d", "--out", directory=False)
    with pytest.raises(InputError, match="is a file, not a dataset directory"):
        check_output_path(tmp_path / "f.txt", "--out", directory=True)
    assert check_output_path(tmp_path / "d", "--out", directory=True) == tmp_path / "d"
    with pytest.raises(InputError, match="parent folder"):  # the lock applies the rule too
        exclusive_lock(tmp_path / "nowhere" / "x").acquire()


def test_remove_temp_files_touches_only_the_named_destinations(tmp_path):
    names = [".index.parquet.ab12.parquet.tmp", ".shard-00003.npz.x.npz.tmp",
             ".notes.txt.q.tmp", ".index.parquet.lock", "index.parquet", ".shardy.tmp"]
    for n in names:
        (tmp_path / n).write_text("x")
    remove_temp_files(tmp_path, ("index.parquet", "shard-"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
