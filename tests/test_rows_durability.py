"""Durability of the row dataset: interrupted writes resume to the same bytes, an
unfinished dataset never reads as complete, and a second writer is refused at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from evictlab.errors import InputError
from evictlab.io import exclusive_lock
from evictlab.rows.export import export_npz
from evictlab.rows.reader import RowStore
from evictlab.rows.synth import SynthConfig, synthesize
from evictlab.rows.writer import RowWriter
from evictlab.solve.runner import SolveConfig, solve_rows

CFG = SynthConfig(rows=300, keys=20, dim=4, seed=7, rows_per_block=25, rows_per_shard=50)
#: Files that must be byte-identical between an interrupted-and-resumed and a straight run.
DATA_FILES = ("index.parquet", "prompts.parquet")


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evictlab.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def _assert_same_dataset(a: Path, b: Path) -> None:
    """Same shards, index and prompts bytes; manifests equal but for their timestamps."""
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    for m in (ma, mb):
        del m["created"], m["updated"]
    assert ma == mb
    shards = [sh["file"] for sh in ma["shards"]]
    assert shards
    for name in (*DATA_FILES, *shards):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    left = {p.name for p in a.iterdir()} - {p.name for p in b.iterdir()}
    assert not left, f"stray files after resume: {left}"


class _Stop(Exception):
    pass


def _interrupt_after(rows: int):
    seen = [0]

    def progress(r: int) -> None:
        seen[0] += r
        if seen[0] >= rows:
            raise _Stop

    return progress


def test_interrupted_synth_is_incomplete_and_resumes_to_identical_files(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    synthesize(straight, CFG)
    part = tmp_path / "part"
    with pytest.raises(_Stop):
        synthesize(part, CFG, progress=_interrupt_after(130))
    man = json.loads((part / "manifest.json").read_text())
    assert man["complete"] is False and man["expected"] == {"rows": 300}
    assert 0 < man["counts"]["rows"] < 300
    with pytest.raises(InputError, match=rf"{part}: is an incomplete row dataset \(\d+ of 300 rows "
                                         r"committed\).*rerun the same `evictlab rows synth`"):
        RowStore.open(part)
    partial = RowStore.open(part, allow_incomplete=True)
    assert not partial.complete and partial.n_rows == man["counts"]["rows"]
    s = synthesize(part, CFG)
    assert (s.rows, s.rows_resumed, s.already_complete) == (300, man["counts"]["rows"], False)
    _assert_same_dataset(part, straight)
    again = synthesize(part, CFG)  # finished: nothing to do, nothing rewritten
    assert again.already_complete
    _assert_same_dataset(part, straight)


def test_synth_refuses_other_settings_and_overwrite_starts_over(tmp_path: Path) -> None:
    out = tmp_path / "s"
    with pytest.raises(_Stop):
        synthesize(out, CFG, progress=_interrupt_after(60))
    other = SynthConfig(**{**CFG.__dict__, "keys": 21})
    with pytest.raises(InputError, match=r"--out: .* holds an unfinished dataset made with "
                                         r"different settings \(--keys: 20 there, 21 now\).*"
                                         r"Fix: rerun with the same arguments"):
        synthesize(out, other)
    synthesize(out, other, overwrite=True)
    assert RowStore.open(out).meta["n"].max() <= 21
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a row dataset"):
        synthesize(tmp_path / "junk", CFG, overwrite=True)
    assert (tmp_path / "junk" / "notes.txt").exists()  # never deleted


def test_killed_synth_subprocess_resumes_to_identical_files(tmp_path: Path) -> None:
    """SIGKILL mid-run (no Python cleanup at all): `rows inspect` says INCOMPLETE, every
    reader refuses the dataset, and the same command resumes it to an uninterrupted run's
    bytes."""
    args = ["rows", "synth", "--count", "20000", "--keys", "128", "--dim", "32", "--seed", "3",
            "--rows-per-shard", "512", "--rows-per-block", "64", "--kind", "logits"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args, "--out", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    man = killed / "manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if len(json.loads(man.read_text())["shards"]) >= 3:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "synth finished before it could be killed"
    committed = json.loads(man.read_text())["counts"]["rows"]
    assert 0 < committed < 20000

    ins = _cli("rows", "inspect", str(killed))
    assert ins.returncode == 0
    assert f"INCOMPLETE ({committed} of 20000 rows committed" in ins.stdout
    assert "warning:" in ins.stderr and "rerun the same `evictlab rows synth`" in ins.stderr
    js = _cli("rows", "inspect", "--json", str(killed))
    assert json.loads(js.stdout)["complete"] is False
    for cmd in (["rows", "export", str(killed), "--out", str(tmp_path / "x.npz")],
                ["solve", str(killed), "--keep", "2", "--out", str(tmp_path / "x.parquet")]):
        r = _cli(*cmd)
        assert r.returncode == 2, r.stderr
        line = r.stderr.strip()
        assert "\n" not in line and "incomplete row dataset" in line and str(killed) in line
        assert "rerun the same `evictlab rows synth` command" in line
    assert not (tmp_path / "x.npz").exists() and not (tmp_path / "x.parquet").exists()

    r = _cli(*args, "--out", str(killed))
    assert r.returncode == 0, r.stderr
    assert f"resumed after {committed} committed rows" in r.stdout
    straight = tmp_path / "straight"
    assert _cli(*args, "--out", str(straight)).returncode == 0
    _assert_same_dataset(killed, straight)
    r = _cli(*args, "--out", str(killed))
    assert r.returncode == 0 and "nothing to do" in r.stdout


def test_library_readers_refuse_an_incomplete_dataset(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    with pytest.raises(_Stop):
        synthesize(ds, CFG, progress=_interrupt_after(100))
    with pytest.raises(InputError, match="incomplete row dataset"):
        export_npz(ds, tmp_path / "x.npz")
    with pytest.raises(InputError, match="incomplete row dataset"):
        solve_rows(ds, tmp_path / "x.parquet", SolveConfig(budgets=(2,)), progress=False)
    assert not (tmp_path / "x.parquet.parts").exists()


def test_second_writer_is_refused_at_once(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    w = RowWriter(ds, model="m", capture_mode="synthetic", head_dim=4)
    try:
        r = _cli("rows", "synth", "--count", "10", "--keys", "4", "--dim", "4", "--seed", "0",
                 "--out", str(ds), "--overwrite")
        assert r.returncode == 2
        line = r.stderr.strip()
        assert "\n" not in line and f"--out: {ds} is being written by another evictlab run" in line
        assert (ds / "manifest.json").exists()  # --overwrite deleted nothing
    finally:
        w.close()
    # released: the same command now runs (and replaces the dataset, as asked)
    r = _cli("rows", "synth", "--count", "10", "--keys", "4", "--dim", "4", "--seed", "0",
             "--out", str(ds), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert RowStore.open(ds).n_rows == 10


def test_writer_output_path_rules(tmp_path: Path) -> None:
    kw = dict(model="m", capture_mode="synthetic", head_dim=4)
    with pytest.raises(InputError, match="parent folder .* does not exist"):
        RowWriter(tmp_path / "no" / "ds", **kw)
    assert not (tmp_path / "no").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file, not a dataset directory"):
        RowWriter(tmp_path / "file", **kw)  # capture --out FILE used to be a traceback
    r = _cli("rows", "synth", "--count", "10", "--keys", "4", "--dim", "4", "--seed", "0",
             "--out", str(tmp_path / "file"))
    assert r.returncode == 2 and "is a file" in r.stderr and r.stderr.strip().count("\n") == 0
    r = _cli("rows", "synth", "--count", "10", "--keys", "4", "--dim", "4", "--seed", "0",
             "--out", str(tmp_path / "no" / "ds"))
    assert r.returncode == 2 and "mkdir -p" in r.stderr and not (tmp_path / "no").exists()


def test_export_needs_overwrite_and_an_existing_folder(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    synthesize(ds, CFG)
    out = tmp_path / "x.npz"
    assert _cli("rows", "export", str(ds), "--out", str(out)).returncode == 0
    before = out.read_bytes()
    r = _cli("rows", "export", str(ds), "--out", str(out), "--limit", "3")
    assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
    assert out.read_bytes() == before
    r = _cli("rows", "export", str(ds), "--out", str(out), "--limit", "3", "--overwrite")
    assert r.returncode == 0, r.stderr
    with np.load(out) as z:
        assert z["p"].shape[0] == 3
    for bad, what in ((tmp_path / "none" / "x.npz", "does not exist"),
                      (tmp_path, "is a directory")):
        r = _cli("rows", "export", str(ds), "--out", str(bad))
        assert r.returncode == 2 and what in r.stderr and r.stderr.strip().count("\n") == 0
    with exclusive_lock(out):  # this process writes the file; another export must wait
        r = _cli("rows", "export", str(ds), "--out", str(out), "--overwrite")
        assert r.returncode == 2 and "being written by another evictlab run" in r.stderr
