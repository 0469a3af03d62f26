"""Limits where they matter (issue 28, item 7): generators refuse an output above
``--max-gib`` before writing anything (``rows synth``, ``capture``; ``rows export`` already
did), and ``dilution check`` refuses budgets no row can use, as ``solve`` refuses s > n."""

from __future__ import annotations

from pathlib import Path

import pytest

from evictlab import cli
from evictlab.capture.testing import save_tiny_folder
from evictlab.rows.synth import SynthConfig, estimated_bytes, synthesize


def _refused(capsys, option: str, needle: str, *args: str) -> str:
    code = cli.run(list(args))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"error: {option}: ") and needle in lines[0], lines[0]
    return lines[0]


def test_rows_synth_refuses_a_dataset_above_max_gib_at_once(capsys, tmp_path: Path) -> None:
    """Used to run for ten minutes (memory growing) until killed."""
    line = _refused(capsys, "--count", "above the --max-gib limit of 4 GiB", "rows", "synth", "--count",
                    "99999999999999", "--keys", "1000", "--dim", "64", "--seed", "0", "--out", str(tmp_path / "d"))
    assert "raise --max-gib" in line
    _refused(capsys, "--count", "limit of 0.001 GiB", "rows", "synth", "--count", "100000", "--keys", "64", "--dim", "8",
             "--seed", "0", "--max-gib", "0.001", "--out", str(tmp_path / "d"))
    _refused(capsys, "--max-gib", "must be > 0", "rows", "synth", "--count", "10", "--keys", "8", "--dim", "4",
             "--seed", "0", "--max-gib", "0", "--out", str(tmp_path / "d"))
    assert list(tmp_path.iterdir()) == []


def test_synth_size_estimate_is_close(tmp_path: Path) -> None:
    cfg = SynthConfig(rows=600, keys=200, dim=16, seed=0, spread=0.0, rows_per_block=100)
    synthesize(tmp_path / "d", cfg)
    real = sum(f.stat().st_size for f in (tmp_path / "d").iterdir())
    assert 0.8 * real <= estimated_bytes(cfg) <= 1.25 * real


def test_capture_refuses_a_dataset_above_max_gib_before_writing(capsys, tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    save_tiny_folder(folder, "llama")
    out = tmp_path / "rows"
    _refused(capsys, "--prompts", "above the --max-gib limit", "capture", "--model", str(folder), "--context", "64",
             "--positions", "4", "--prompts", "100000000", "--out", str(out))
    assert not (out / "manifest.json").exists()
    _refused(capsys, "--max-gib", "must be > 0", "capture", "--model", str(folder), "--max-gib", "-1",
             "--out", str(out))
