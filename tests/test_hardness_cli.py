"""`evictlab hardness check | reduce | decide`: formats, answers, exit codes, error messages.

Commands run in-process through ``evictlab.cli.main`` (the console-script entry point, which
turns an InputError into one line and exit code 2); one test runs a real subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from evictlab.cli import main
from evictlab.hardness import check as check_module
from evictlab.hardness.deciders import Decision
from evictlab.hardness.instances import KSubsetSum
from evictlab.hardness.reduction import reduce_instance


def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["evictlab", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def write(path: Path, obj: object) -> Path:
    path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return path


SOURCE = {"problem": "k-subset-sum", "values": [3, -1, 4, 1, 5], "k": 2, "target": 9}


def test_reduce_writes_the_image_format(tmp_path: Path, monkeypatch, capsys) -> None:
    src = write(tmp_path / "src.json", SOURCE)
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "reduce", str(src), "--out", str(tmp_path / "img.json"))
    assert code == 0 and "11 values, s = 4" in out
    image = json.loads((tmp_path / "img.json").read_text())
    assert set(image) == {"problem", "values", "s"} and image["problem"] == "zero-es"
    expected = reduce_instance(KSubsetSum(tuple(SOURCE["values"]), 2, 9))
    assert image["values"] == list(expected.values) and image["s"] == expected.s
    assert not list(tmp_path.glob(".img.json*"))  # atomic write left no temporary file


def test_decide_yes_and_no_plain_and_json(tmp_path: Path, monkeypatch, capsys) -> None:
    src = write(tmp_path / "src.json", SOURCE)
    img = tmp_path / "img.json"
    run_cli(monkeypatch, capsys, "hardness", "reduce", str(src), "--out", str(img))
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "decide", str(img))
    lines = out.strip().splitlines()
    assert code == 0 and lines[0] == "yes" and lines[1].startswith("kept: ")
    kept = [int(i) for i in lines[1].split()[1:]]
    values = json.loads(img.read_text())["values"]
    assert len(kept) == 4 and 11 * sum(values[i] for i in kept) == 4 * sum(values)
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "decide", str(img), "--json")
    assert code == 0 and json.loads(out) == {"answer": "yes", "kept": kept}
    for method in ("dp", "cpsat"):
        code, out, _ = run_cli(monkeypatch, capsys, "hardness", "decide", str(img), "--json", "--method", method)
        obj = json.loads(out)
        assert code == 0 and obj["answer"] == "yes" and 11 * sum(values[i] for i in obj["kept"]) == 4 * sum(values)

    no = write(tmp_path / "no.json", {"problem": "zero-es", "values": [0, 1, 5], "s": 1})  # mean 2
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "decide", str(no))
    assert code == 0 and out.strip() == "no"
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "decide", str(no), "--json")
    assert code == 0 and json.loads(out) == {"answer": "no", "kept": []}


def test_reduce_then_decide_agrees_with_the_source(tmp_path: Path, monkeypatch, capsys) -> None:
    for target, answer in ((9, "yes"), (10, "no"), (0, "yes")):
        k = 0 if target == 0 else 2
        src = write(tmp_path / "s.json", {**SOURCE, "k": k, "target": target})
        run_cli(monkeypatch, capsys, "hardness", "reduce", str(src), "--out", str(tmp_path / "i.json"), "--overwrite")
        code, out, _ = run_cli(monkeypatch, capsys, "hardness", "decide", str(tmp_path / "i.json"), "--json")
        assert code == 0 and json.loads(out)["answer"] == answer


@pytest.mark.parametrize(
    "content, needle",
    [
        ({"problem": "zero-es", "values": [1, 2.5], "s": 1}, "values[1]"),
        ({"problem": "zero-es", "values": [1, 2.0], "s": 1}, "values[1]"),
        ({"problem": "zero-es", "values": [1, True], "s": 1}, "values[1]"),
        ({"problem": "zero-es", "values": ["1", 2], "s": 1}, "values[0]"),
        ({"problem": "zero-es", "values": [], "s": 1}, "values: the list is empty"),
        ({"problem": "zero-es", "values": [1, 2], "s": 0}, "s: s = 0"),
        ({"problem": "zero-es", "values": [1, 2], "s": 3}, "s: s = 3"),
        ({"problem": "zero-es", "values": [2**62, -(2**62), 1], "s": 1}, "2^62"),
        ({"problem": "k-subset-sum", "values": [1, 2], "k": 1, "target": 1}, "needs a 'zero-es'"),
        ({"problem": "zero-es", "values": [1, 2], "s": 1, "extra": 0}, "extra: unknown field"),
        ('{"problem": "zero-es", "values": [1, 2], "s": 1', "not valid JSON"),
        ('{"problem": "zero-es", "values": [NaN], "s": 1}', "values[0]"),
        ('{"problem": "zero-es", "values": [1' + "0" * 5000 + '], "s": 1}', "integer too long"),
    ],
)
def test_decide_rejects_malformed_instances(tmp_path: Path, monkeypatch, capsys, content, needle: str) -> None:
    path = write(tmp_path / "bad.json", content)
    code, out, err = run_cli(monkeypatch, capsys, "hardness", "decide", str(path))
    assert code == 2 and out == ""
    assert needle in err and "Fix:" in err and len(err.strip().splitlines()) == 1


def test_decide_huge_numbers_work_with_the_dp_only(tmp_path: Path, monkeypatch, capsys) -> None:
    path = write(tmp_path / "big.json", {"problem": "zero-es", "values": [2**70, -(2**70), 0], "s": 1})
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "decide", str(path), "--json", "--method", "dp")
    assert code == 0 and json.loads(out) == {"answer": "yes", "kept": [2]}


def test_decide_time_limit_without_answer_exits_3(tmp_path: Path, monkeypatch, capsys) -> None:
    from evictlab.hardness import deciders

    def undecided(image, method="cpsat", **kw):
        raise deciders.UndecidedError("CP-SAT returned UNKNOWN within 0.001 s")

    monkeypatch.setattr(deciders, "decide_image", undecided)
    path = write(tmp_path / "i.json", {"problem": "zero-es", "values": [1, 2, 3], "s": 1})
    code, out, err = run_cli(monkeypatch, capsys, "hardness", "decide", str(path), "--time-limit", "0.001")
    assert code == 3 and out == "" and err.startswith("undecided: CP-SAT returned UNKNOWN")


def test_reduce_accepts_huge_sources_and_says_the_image_needs_the_dp(tmp_path: Path, monkeypatch, capsys) -> None:
    src = write(tmp_path / "s.json", {"problem": "k-subset-sum", "values": [2**80, 1, -(2**80)], "k": 2, "target": 0})
    img = tmp_path / "i.json"
    code, _, err = run_cli(monkeypatch, capsys, "hardness", "reduce", str(src), "--out", str(img))
    assert code == 0 and "--method dp" in err
    code, _, err = run_cli(monkeypatch, capsys, "hardness", "decide", str(img))
    assert code == 2 and "2^62" in err
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "decide", str(img), "--method", "dp", "--json")
    assert code == 0 and json.loads(out)["answer"] == "yes"


def test_decide_bad_options_and_missing_file(tmp_path: Path, monkeypatch, capsys) -> None:
    good = write(tmp_path / "g.json", {"problem": "zero-es", "values": [1, 2], "s": 1})
    code, _, err = run_cli(monkeypatch, capsys, "hardness", "decide", str(good), "--method", "float")
    assert code == 2 and "--method" in err
    code, _, err = run_cli(monkeypatch, capsys, "hardness", "decide", str(tmp_path / "missing.json"))
    assert code == 2 and "file not found" in err


@pytest.mark.parametrize(
    "content, needle",
    [
        ({**SOURCE, "k": 6}, "k: k = 6"),
        ({**SOURCE, "k": -1}, "k: k = -1"),
        ({**SOURCE, "target": 9.0}, "target"),
        ({**SOURCE, "values": []}, "values: the list is empty"),
        ({**SOURCE, "values": [1, None]}, "values[1]"),
        ({"problem": "zero-es", "values": [1], "s": 1}, "needs a 'k-subset-sum'"),
        ({"problem": "knapsack", "values": [1], "k": 1, "target": 1}, "unknown problem"),
        ({"values": [1], "k": 1}, "problem"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_reduce_rejects_malformed_sources(tmp_path: Path, monkeypatch, capsys, content, needle: str) -> None:
    path = write(tmp_path / "bad.json", content)
    out_path = tmp_path / "img.json"
    code, _, err = run_cli(monkeypatch, capsys, "hardness", "reduce", str(path), "--out", str(out_path))
    assert code == 2 and needle in err and not out_path.exists()


def test_check_prints_the_summary_and_writes_results(tmp_path: Path, monkeypatch, capsys) -> None:
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "check", "--trials", "20", "--size", "5",
                           "--seed", "3", "--out", str(tmp_path / "run"))
    assert code == 0
    for word in ("tried", "yes", "no", "agreed", "disagreed", "source cpsat", "image dp"):
        assert word in out
    table = pl.read_parquet(tmp_path / "run" / "trials.parquet")
    assert table.height == 20 and table["agreed"].all()
    record = json.loads((tmp_path / "run" / "run_record.json").read_text())
    assert record["seed"] == 3 and record["summary"] == {"tried": 20, "agreed": 20, "disagreed": 0}


def test_check_exits_nonzero_on_disagreement(monkeypatch, capsys) -> None:
    real = check_module.decide_image

    def flipped(image, method="cpsat", **kw):  # a deliberately wrong image decider
        d = real(image, method, **kw)
        return Decision(not d.yes, (), d.method, d.seconds) if method == "dp" else d

    monkeypatch.setattr(check_module, "decide_image", flipped)
    code, out, _ = run_cli(monkeypatch, capsys, "hardness", "check", "--trials", "4", "--size", "3")
    assert code == 1 and "image_dp answered against the known" in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--trials", "0"], "--trials"),
        (["--size", "0"], "--size"),
        (["--size", "3", "--magnitude", str(10**30)], "--magnitude"),
        (["--time-limit", "0"], "--time-limit"),
    ],
)
def test_check_rejects_bad_arguments(monkeypatch, capsys, args: list[str], needle: str) -> None:
    code, _, err = run_cli(monkeypatch, capsys, "hardness", "check", *args)
    assert code == 2 and needle in err


def test_console_entry_point_exit_code(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.json", {"problem": "zero-es", "values": [1.5], "s": 1})
    proc = subprocess.run([sys.executable, "-m", "evictlab.cli", "hardness", "decide", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: values[0]") and "Traceback" not in proc.stderr
