"""One rule for list options in every command (issue 28, item 9; docs/architecture.md, CLI
conventions): a duplicate entry and an empty entry are refused with one line naming the
option, and an option that only applies with another is refused without it. Every case is
refused before any work (no model is loaded, nothing is written), so the cases run fast."""

from __future__ import annotations

from pathlib import Path

import pytest

from evictlab import cli
from evictlab.cliutil import parse_ints, parse_list
from evictlab.errors import InputError


def _refused(capsys: pytest.CaptureFixture[str], option: str, needle: str, *args: str) -> None:
    code = cli.run(list(args))
    out, err = capsys.readouterr()
    assert code == 2, (args, out, err)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {option}: ") and needle in lines[0], lines[0]


def test_parse_list_rule() -> None:
    assert parse_list(" a, b,c", "--x") == ["a", "b", "c"]
    assert parse_list(["a", "b,c"], "--x") == ["a", "b", "c"]
    assert parse_list(None, "--x") == []
    for bad, word in (("a,", "empty entry"), ("a,,b", "empty entry"), (",a", "empty entry"), ("", "is empty"),
                      ("a,a", "a is given twice"), (["a", "a"], "a is given twice")):
        with pytest.raises(InputError, match=word) as e:
            parse_list(bad, "--x", "thing")
        assert e.value.field == "--x"
    assert parse_ints("4, 8", "--b") == [4, 8]
    with pytest.raises(InputError, match="8 is given twice"):
        parse_ints("8,08", "--b", "budget")
    with pytest.raises(InputError, match="not a whole number"):
        parse_ints("4,x", "--b")


@pytest.mark.parametrize("option,needle,args", [
    ("--methods", "empty entry", ["eval", "run", "--methods", "snapkv,", "--out", "{tmp}/g"]),
    ("--tasks", "needle is given twice", ["eval", "run", "--tasks", "needle,needle", "--out", "{tmp}/g"]),
    ("--context", "empty entry", ["eval", "run", "--context", "128,,256", "--out", "{tmp}/g"]),
    ("--methods", "h2o is given twice", ["audit", "--methods", "h2o,h2o", "--out", "{tmp}/a.parquet"]),
    ("--task", "empty entry", ["audit", "--task", "needle,", "--out", "{tmp}/a.parquet"]),
    ("--budget", "64 is given twice", ["audit", "--budget", "64", "--budget", "64", "--out", "{tmp}/a.parquet"]),
    ("--layers", "layer 1 is given twice", ["capture", "--model", "{tmp}/nomodel", "--layers", "1,1",
                                            "--out", "{tmp}/rows"]),
    ("--layers", "layer 2 is given twice", ["capture", "--model", "{tmp}/nomodel", "--layers", "0-2,2",
                                            "--out", "{tmp}/rows"]),
    ("--methods", "h2o is given twice", ["dilution", "check", "{tmp}/norows", "--methods", "h2o,h2o",
                                         "--out", "{tmp}/t.parquet"]),
    ("--keep", "empty entry", ["dilution", "check", "{tmp}/norows", "--keep", "32,",
                                  "--out", "{tmp}/t.parquet"]),
    ("--distractors", "4 is given twice", ["dilution", "sweep", "--distractors", "0,4,4", "--out", "{tmp}/s"]),
    ("--layers", "layer 3 is given twice", ["dilution", "sweep", "--layers", "3,3", "--out", "{tmp}/s"]),
    ("--tasks", "needle is given twice", ["gates", "train", "--tasks", "needle,needle", "--out", "{tmp}/gates"]),
    ("--features", "dropped_mass is given twice", ["predictor", "fit", "{tmp}/r.parquet", "--features",
                                                   "dropped_mass,dropped_mass", "--out", "{tmp}/p.json"]),
    ("--keep", "empty entry", ["solve", "{tmp}/norows", "--keep", "4,,8", "--out", "{tmp}/r.parquet"]),
    ("--keep", "4 is given twice", ["solve", "{tmp}/norows", "--keep", "4", "4", "--out", "{tmp}/r.parquet"]),
    ("--keep", "8 is given twice", ["demo", "--keep", "4,8,8", "--runs", "{tmp}"]),
])
def test_list_options_refuse_duplicates_and_empty_entries(capsys, tmp_path: Path, option: str, needle: str,
                                                          args: list[str]) -> None:
    _refused(capsys, option, needle, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert [p.name for p in tmp_path.iterdir()] == []  # refused before anything was written


@pytest.mark.parametrize("option,needle,args", [
    ("--clusters", "only applies with --values clustered",
     ["rows", "synth", "--count", "4", "--keys", "8", "--dim", "4", "--seed", "0", "--clusters", "3",
      "--out", "{tmp}/rows"]),
    ("--cert-max-n", "only applies with --certify", ["solve", "{tmp}/norows", "--keep", "4",
                                                      "--cert-max-n", "10", "--out", "{tmp}/r.parquet"]),
    ("--ls-pairs", "only applies with --search all", ["solve", "{tmp}/norows", "--keep", "4",
                                                       "--ls-pairs", "4", "--out", "{tmp}/r.parquet"]),
    ("--trace-max-subsets", "only applies with --trace", ["decode", "--trace-max-subsets", "5",
                                                           "--out", "{tmp}/d.json"]),
    ("--pool-max-s", "only applies with pool in --methods", ["dilution", "check", "{tmp}/norows", "--methods",
                                                              "h2o", "--pool-max-s", "8", "--out", "{tmp}/t.parquet"]),
])
def test_options_that_need_another_are_refused_without_it(capsys, tmp_path: Path, option: str, needle: str,
                                                           args: list[str]) -> None:
    _refused(capsys, option, needle, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert [p.name for p in tmp_path.iterdir()] == []


def test_clusters_with_clustered_values_is_accepted(capsys, tmp_path: Path) -> None:
    args = ["rows", "synth", "--count", "4", "--keys", "8", "--dim", "4", "--seed", "0", "--values", "clustered",
            "--clusters", "3", "--out", str(tmp_path / "rows")]
    assert cli.run(args) == 0, capsys.readouterr().err
