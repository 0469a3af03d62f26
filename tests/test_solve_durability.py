"""`evictlab solve` under misuse and interruption: argument parsing, one run per --out,
damaged or foreign part files, output paths, Ctrl-C and kill -9 followed by a resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.io import exclusive_lock
from evictlab.rows.synth import SynthConfig, synthesize
from evictlab.solve.runner import SolveConfig, parts_dir_for, solve_rows


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evictlab.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("solve_dur") / "rows"
    synthesize(path, SynthConfig(rows=120, keys=16, dim=4, seed=5, rows_per_block=20,
                                 rows_per_shard=40))
    return path


@pytest.fixture(scope="module")
def reference(rows: Path, tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    """An uninterrupted run with CFG."""
    out = tmp_path_factory.mktemp("solve_ref") / "ref.parquet"
    solve_rows(rows, out, CFG, progress=False)
    return pl.read_parquet(out)


CFG = SolveConfig(budgets=(2, 5), chunk_rows=20)


@pytest.mark.parametrize("args, option, words", [
    (["--keep", "4", "--pool", "2", "2", "2"], "--pool", "takes exactly two numbers"),
    (["--keep", "4", "8", "--certify", "3"], "--certify", "takes no value"),
    (["--keep", "4", "--threads", "1", "7"], "--threads", "takes 1 value"),
    (["--keep", "4", "8", "x"], "--keep", "'x' is not a kept-key count"),
])
def test_stray_numbers_are_usage_errors(rows: Path, tmp_path: Path, args, option, words) -> None:
    """`--pool 2 2 2` used to solve s = [4, 2]: a trailing number became a budget."""
    out = tmp_path / "t.parquet"
    r = _cli("solve", str(rows), *args, "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {option}: ") and words in line
    assert "--keep" in line  # says where budgets go
    assert not out.exists() and not parts_dir_for(out).exists()


def test_extra_dataset_and_budget_lists(rows: Path, tmp_path: Path) -> None:
    r = _cli("solve", str(rows), str(rows), "--keep", "4", "--out", str(tmp_path / "t.parquet"))
    assert r.returncode == 2 and "error: ROWS: unexpected extra argument" in r.stderr
    # the documented spellings of --keep work, in any position
    for spelling in (["--keep", "2", "5"], ["--keep", "2,5"], ["--keep", "5", "--keep", "2"]):
        out = tmp_path / f"{len(spelling)}-{spelling[1]}.parquet"
        r = _cli("solve", "--chunk-rows", "20", *spelling, str(rows), "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert sorted(pl.read_parquet(out)["s"].unique().to_list()) == [2, 5]


def test_second_run_on_the_same_out_is_refused_at_once(rows: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    with exclusive_lock(out):  # a run of this process holds --out
        t0 = time.time()
        r = _cli("solve", str(rows), "--keep", "2", "--out", str(out))
        assert r.returncode == 2
        line = r.stderr.strip()
        assert "\n" not in line
        assert f"error: --out: {out} is being written by another evictlab run (pid {os.getpid()}" in line
        assert time.time() - t0 < 60  # refused, not waiting
    assert not parts_dir_for(out).exists()


def test_parts_of_another_job_say_what_differs(rows: Path, tmp_path: Path, reference) -> None:
    out = tmp_path / "t.parquet"
    part = solve_rows(rows, out, CFG, progress=False, stop_after=2)
    assert not part.complete
    with pytest.raises(InputError, match=r"--out: .*t.parquet.parts holds the parts of a run with other "
                                         r"settings: config.budgets \[2, 5\] there, \[2\] "
                                         r"now.*rerun with the options recorded in job.json.*"
                                         r"--restart"):
        solve_rows(rows, out, SolveConfig(budgets=(2,), chunk_rows=20), progress=False)
    (parts_dir_for(out) / "job.json").unlink()  # a run killed while starting
    with pytest.raises(InputError, match="it has no job.json.*--restart"):
        solve_rows(rows, out, CFG, progress=False)
    (parts_dir_for(out) / "job.json").write_text("{ trunc")
    with pytest.raises(InputError, match="its job.json is damaged.*--restart"):
        solve_rows(rows, out, CFG, progress=False)
    s = solve_rows(rows, out, CFG, progress=False, restart=True)
    assert s.complete and s.parts_done_before == 0
    assert pl.read_parquet(out).equals(reference)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "wrong_rows"])
def test_damaged_part_is_found_before_any_computation(rows: Path, tmp_path: Path, reference,
                                                      damage: str) -> None:
    """A damaged part used to give a traceback on resume after recomputing everything else;
    now every part is checked first, a bad one is reported, discarded and recomputed."""
    out = tmp_path / "t.parquet"
    solve_rows(rows, out, CFG, progress=False, stop_after=3)
    parts = parts_dir_for(out)
    f = parts / "part-00001.parquet"
    raw = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "flip":
        raw[len(raw) // 2] ^= 0x04
        f.write_bytes(bytes(raw))
    elif damage == "garbage":
        f.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    else:  # a readable part with an intact checksum, holding other rows
        f.write_bytes((parts / "part-00000.parquet").read_bytes())
    events: list[str] = []
    s = solve_rows(rows, out, CFG, progress=False, notify=lambda m: events.append(m),
                   on_rows=lambda n: events.append(f"rows {n}"))
    assert events[0].startswith(f"warning: discarded the damaged part file {f}")
    assert sum(e.startswith("warning") for e in events) == 1  # reported before any solving
    assert s.complete and s.parts_done_before == 2 and s.extra["parts_discarded"] == [f.name]
    assert pl.read_parquet(out).equals(reference)


def test_part_without_a_checksum_is_recomputed(rows: Path, tmp_path: Path, reference) -> None:
    """A part written by an evictlab older than the checksums (same rows, no checksum in
    its footer) cannot be verified: it is discarded with one warning and recomputed."""
    out = tmp_path / "t.parquet"
    solve_rows(rows, out, CFG, progress=False, stop_after=2)
    f = parts_dir_for(out) / "part-00001.parquet"
    pl.read_parquet(f).write_parquet(f)  # the same content, no checksum
    events: list[str] = []
    s = solve_rows(rows, out, CFG, progress=False, notify=events.append)
    assert events == [f"warning: discarded the damaged part file {f} (carries no checksum (written by an older "
                      f"evictlab), so it cannot be verified); it is recomputed"]
    assert s.complete and s.parts_done_before == 1
    assert pl.read_parquet(out).equals(reference)


def test_output_path_rules(rows: Path, tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    with pytest.raises(InputError, match="--out: .*adir is a directory, not a file"):
        solve_rows(rows, tmp_path / "adir", CFG, progress=False)
    r = _cli("solve", str(rows), "--keep", "2", "--out", str(tmp_path / "adir"))
    assert r.returncode == 2 and "is a directory" in r.stderr and r.stderr.strip().count("\n") == 0
    r = _cli("solve", str(rows), "--keep", "2", "--out", str(tmp_path / "nodir" / "x.parquet"))
    assert r.returncode == 2 and "parent folder" in r.stderr and "mkdir -p" in r.stderr
    assert not (tmp_path / "nodir").exists()  # used to be created silently
    r = _cli("solve", str(tmp_path / "adir"), "--keep", "2", "--out", str(tmp_path / "x.parquet"))
    assert r.returncode == 2 and "not a row dataset" in r.stderr


def _wait_for_parts(parts: Path, proc: subprocess.Popen, n: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if len(list(parts.glob("part-*.parquet"))) >= n:
            return
        time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_cli_run_leaves_complete_parts_and_resumes_bit_identical(
        tmp_path: Path, sig: int) -> None:
    """Ctrl-C (SIGINT: Python unwinds, numba may wrap the KeyboardInterrupt) or kill -9
    mid-solve: only complete parts stay on disk, no temporary files, no lock; rerunning
    the same command finishes and equals an uninterrupted run bit for bit."""
    ds = tmp_path / "rows"
    synthesize(ds, SynthConfig(rows=3000, keys=48, dim=8, seed=2, rows_per_block=50))
    args = ["solve", str(ds), "--keep", "4", "8", "--chunk-rows", "100", "--threads", "1"]
    out = tmp_path / "t.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_parts(parts_dir_for(out), proc, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, "solve finished before it could be interrupted"
    assert not out.exists()
    parts = sorted(parts_dir_for(out).glob("part-*.parquet"))
    assert 2 <= len(parts) < 30
    for f in parts:
        df = pl.read_parquet(f)  # every part on disk is complete
        assert df.height == 100 * 2
    left = [p.name for p in [*parts_dir_for(out).iterdir(), *tmp_path.iterdir()]
            if p.name.endswith((".tmp", ".lock"))]
    assert left == [] or sig == signal.SIGKILL  # kill -9 may leave a lock file, never a lock
    r = _cli(*args, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"{len(parts)} parts resumed" in r.stdout
    full = tmp_path / "full.parquet"
    assert _cli(*args, "--out", str(full)).returncode == 0
    assert pl.read_parquet(out).equals(pl.read_parquet(full))
    assert out.read_bytes() == full.read_bytes()
