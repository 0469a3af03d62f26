"""Output paths and inputs the commands refuse before doing any work (issue 10, items 5-6).

``--out`` that is a directory where a file is written (or a file where a folder is), an
``--out`` in a folder that does not exist, an existing ``--out`` without ``--overwrite``, and a
results file given twice (same path, or the same bytes under another name). Each refusal is
one ``error:`` line naming the option, exit 2, and leaves the existing files untouched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from evictlab import cli
from evictlab.stats.planted import planted_results

SOURCE = {"problem": "k-subset-sum", "values": [3, -1, 4, 1, 5], "k": 2, "target": 9}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.run(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, option: str, needle: str, *args: str) -> str:
    code, out, err = run(capsys, *args)
    assert code == 2, (out, err)
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {option}: ") and needle in line, line
    assert "Traceback" not in err
    return out


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    path = tmp_path / "src.json"
    path.write_text(json.dumps(SOURCE))
    return path


def test_reduce_refuses_a_directory_out(capsys, tmp_path, source):
    (tmp_path / "d").mkdir()
    refused(capsys, "--out", "is a directory", "hardness", "reduce", str(source), "--out", str(tmp_path / "d"))


def test_reduce_refuses_a_missing_folder(capsys, tmp_path, source):
    refused(capsys, "--out", "does not exist", "hardness", "reduce", str(source), "--out", str(tmp_path / "no" / "x.json"))
    assert not (tmp_path / "no").exists()


def test_reduce_overwrites_only_with_the_flag(capsys, tmp_path, source):
    out = tmp_path / "img.json"
    out.write_text("keep me")
    refused(capsys, "--out", "--overwrite", "hardness", "reduce", str(source), "--out", str(out))
    assert out.read_text() == "keep me"
    assert run(capsys, "hardness", "reduce", str(source), "--out", str(out), "--overwrite")[0] == 0
    assert json.loads(out.read_text())["problem"] == "zero-es"


def test_check_out_refusals_come_before_the_run(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(capsys, "--out", "is a file", "hardness", "check", "--trials", "2", "--size", "4", "--out", str(afile))
    folder = tmp_path / "hc"
    assert run(capsys, "hardness", "check", "--trials", "2", "--size", "4", "--out", str(folder))[0] == 0
    stdout = refused(capsys, "--out", "--overwrite", "hardness", "check", "--trials", "2", "--size", "4",
                     "--out", str(folder))
    assert "tried" not in stdout  # refused before checking anything
    assert run(capsys, "hardness", "check", "--trials", "2", "--size", "4", "--out", str(folder), "--overwrite")[0] == 0


def test_capture_refuses_a_file_or_foreign_folder_out(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(capsys, "--out", "is a file", "capture", "--out", str(afile))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    refused(capsys, "--out", "not a row dataset", "capture", "--out", str(foreign))
    assert (foreign / "notes.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("res") / "a.parquet"
    planted_results(600, seed=1).write_parquet(path)
    return path


@pytest.mark.parametrize("twice,needle", [("same path", "is given twice"), ("other spelling", "are one file"),
                                          ("copy", "has the same content as")])
@pytest.mark.parametrize("command", ["fit", "eval"])
def test_predictor_refuses_a_results_file_given_twice(capsys, tmp_path, results, twice, needle, command):
    """Before: the rows entered twice (fit: the same row fitted, then tested as a new one)."""
    if twice == "same path":
        second = results
    elif twice == "other spelling":
        second = results.parent / ".." / results.parent.name / results.name
    else:
        second = tmp_path / "copy.parquet"
        shutil.copyfile(results, second)
    pj = tmp_path / "p.json"
    if command == "fit":
        refused(capsys, "RESULTS", needle, "predictor", "fit", str(results), str(second), "--out", str(pj))
        assert not pj.exists()
    else:
        assert run(capsys, "predictor", "fit", str(results), "--out", str(pj), "--n-boot", "20")[0] == 0
        refused(capsys, "RESULTS", needle, "predictor", "eval", str(pj), str(results), str(second), "--n-boot", "20")


def test_predictor_out_needs_overwrite(capsys, tmp_path, results):
    pj = tmp_path / "p.json"
    pj.write_text("keep me")
    refused(capsys, "--out", "--overwrite", "predictor", "fit", str(results), "--out", str(pj), "--n-boot", "20")
    assert pj.read_text() == "keep me"
    assert run(capsys, "predictor", "fit", str(results), "--out", str(pj), "--n-boot", "20", "--overwrite")[0] == 0
    ev = tmp_path / "e.parquet"
    ev.write_text("keep me")
    refused(capsys, "--out", "--overwrite", "predictor", "eval", str(pj), str(results), "--out", str(ev))
    assert ev.read_text() == "keep me"
    assert run(capsys, "predictor", "eval", str(pj), str(results), "--out", str(ev), "--n-boot", "20",
               "--overwrite")[0] == 0
    refused(capsys, "--out", "is a directory", "predictor", "fit", str(results), "--out", str(tmp_path))


@pytest.mark.parametrize("args,option", [
    (["predictor", "fit", "R", "--out", "p.json", "--seed", "-1"], "--seed"),
    (["predictor", "fit", "R", "--out", "p.json", "--n-boot", "0"], "--n-boot"),
    (["predictor", "eval", "P", "R", "--seed", "-1"], "--seed"),
    (["hardness", "check", "--trials", "2", "--seed", "-1"], "--seed"),
    (["capture", "--out", "c", "--seed", "-1"], "--seed"),
])
def test_negative_seed_and_zero_resamples_are_usage_errors(capsys, tmp_path, results, args, option):
    """Before: a numpy ValueError traceback (negative seed) or an error naming `n_boot`."""
    args = [str(results) if a == "R" else str(tmp_path / "p.json") if a == "P" else a for a in args]
    code, _, err = run(capsys, *args)
    assert code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert f"'{option}'" in line, line
