"""paper_repro/grids_agree.py on hand-made grids: shared answers joined on every key, differences
counted per (model, method), bad input refused with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.io import write_checked_parquet

SCRIPT = Path(__file__).resolve().parents[1] / "paper_repro" / "grids_agree.py"


@pytest.fixture()
def script(repro_script):
    return repro_script("grids_agree")


def _grid(methods: list[str], examples: range, logprob_shift: float = 0.0, em_flip: int | None = None) -> pl.DataFrame:
    rows = []
    for method in methods:
        for ex in examples:
            rows.append({"model": "m", "task": "needle", "context": 1024, "method": method, "mode": "physical",
                         "protocol": "query_agnostic", "prefill": "one_pass", "budget": 64, "budget_unit": "per_cell",
                         "seed": 0, "example": ex, "example_seed": 100 + ex, "question": 0,
                         "exact_match": float(ex != em_flip), "bytes_live": 1000 + ex,
                         "answer_logprob": -1.0 - ex / 8 + (logprob_shift if ex % 2 else 0.0),
                         "wall_s": 1.0 + ex})   # timings differ between runs; not a key
    return pl.DataFrame(rows)


def test_counts_only_shared_answers_and_their_differences(script) -> None:
    a = _grid(["full", "snapkv"], range(4))
    b = _grid(["snapkv", "snapkv+adakv"], range(2, 6), logprob_shift=1e-3, em_flip=3)
    t = script.agreement(a, b)
    assert t["method"].to_list() == ["snapkv"]            # full and adakv are in one grid only
    r = t.row(0, named=True)
    assert r["rows"] == 2                                  # examples 2 and 3
    assert r["em_equal"] == 1                              # example 3 flipped in b
    assert r["bytes_equal"] == 2
    assert r["logprob_bitequal"] == 1                      # the odd example is shifted
    assert r["max_abs_dlogprob"] == pytest.approx(1e-3)


def test_identical_grids_agree_bit_for_bit(script) -> None:
    a = _grid(["full", "snapkv"], range(3))
    t = script.agreement(a, a.with_columns(wall_s=pl.col("wall_s") * 2))
    assert t["rows"].to_list() == t["logprob_bitequal"].to_list() == [3, 3]
    assert t["max_abs_dlogprob"].to_list() == [0.0, 0.0]


def test_cli_refuses_missing_folder_and_bad_range(script, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_checked_parquet(_grid(["snapkv"], range(3)), tmp_path / name / "results.parquet")
    with pytest.raises(InputError, match="no results.parquet"):
        script.main([str(tmp_path / "a"), str(tmp_path / "nothere")])
    with pytest.raises(InputError, match="--examples"):
        script.main([str(tmp_path / "a"), str(tmp_path / "b"), "--examples", "5"])
    # as a command: one line on stderr, exit 2, no traceback (the scripts' shared entry)
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "a"), str(tmp_path / "nothere")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("error:") and len(done.stderr.strip().splitlines()) == 1
    out = tmp_path / "agree.md"
    assert script.main([str(tmp_path / "a"), str(tmp_path / "b"), "--examples", "1:3", "--out", str(out)]) == 0
    assert "| m | snapkv | 2 | 2 | 2 | 2 | 0 |" in out.read_text()


def test_same_pairs_one_arm_under_two_names(script, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A method text may hold '=' inside its brackets (trimkv[gates=DIR]): --same splits outside them."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    write_checked_parquet(_grid(["trimkv+global"], range(2)), tmp_path / "a" / "results.parquet")
    write_checked_parquet(_grid(["trimkv[gates=default]+global"], range(2)), tmp_path / "b" / "results.parquet")
    assert script.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 2          # nothing shared by name
    assert "share no answers" in capsys.readouterr().err
    assert script.main([str(tmp_path / "a"), str(tmp_path / "b"),
                        "--same", "trimkv+global=trimkv[gates=default]+global"]) == 0
    assert "| m | trimkv[gates=default]+global | 2 | 2 | 2 | 2 | 0 |" in capsys.readouterr().out
    assert script._split_same("a[x=1]=b[y=2]") == ("a[x=1]", "b[y=2]")


def test_versus_pairs_two_methods_of_two_grids(script, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Grid a's trimkv+global against grid b's snapkv on the same answers: a right on all 4
    examples, b on examples != 2 (em_flip) -> +25 points, the interval around it."""
    a = _grid(["trimkv+global"], range(4))
    b = _grid(["snapkv"], range(4), em_flip=2)
    t = script.versus(a, b, "trimkv+global", "snapkv", n_boot=200)
    r = t.row(0, named=True)
    assert (r["answers"], r["em_a"], r["em_b"]) == (4, 1.0, 0.75)
    assert r["points"] == pytest.approx(25.0) and r["lo"] <= 25.0 <= r["hi"] and r["hi"] <= 100.0
    assert script.versus(a, b, "trimkv+global", "nothere").height == 0
    for name, df in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        write_checked_parquet(df, tmp_path / name / "results.parquet")
    assert script.main([str(tmp_path / "a"), str(tmp_path / "b"), "--versus", "trimkv+global=snapkv"]) == 0
    assert "| m | trimkv+global | snapkv | 4 | 1.000 | 0.750 | +25.0" in capsys.readouterr().out
    with pytest.raises(InputError, match="--versus"):
        script.main([str(tmp_path / "a"), str(tmp_path / "b"), "--versus", "snapkv"])
