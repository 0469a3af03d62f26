"""`tasks = ["suite"]`: the suite's tasks with the full cache's floor cells left out of the grid.

The floor table here is made up (a fixture), so the tests do not depend on the shipped
measurement; the shipped tables are checked against the rule in test_task_floor_shipped.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from cli_helpers import run_cli
from evictlab.capture.testing import save_tiny_folder
from evictlab.errors import InputError
from evictlab.eval.grid import MANIFEST, RESULTS, read_manifest, run_grid
from evictlab.eval.report import evaluation_markdown
from evictlab.eval.spec import GridSpec, LoopSettings
from evictlab.io import read_checked_parquet
from evictlab.tasks.suite import KEEP_ACCURACY, SUITE_TASKS, suite_grid

LOOP = LoopSettings(sinks=2, recent=8, chunk_size=64, compress_every=8, window=16, block_size=8)


def _table(models: list[str], contexts: list[int], acc: dict[tuple[str, str, int], float]) -> pl.DataFrame:
    """A floor table holding every suite cell of ``models`` x ``contexts``: accuracy 1.0 unless ``acc`` says."""
    rows = [{"model": m, "task": t, "context": c, "accuracy": acc.get((m, t, c), 1.0),
             "lo": max(0.0, acc.get((m, t, c), 1.0) - 0.1), "hi": min(1.0, acc.get((m, t, c), 1.0) + 0.1)}
            for m in models for t in SUITE_TASKS for c in contexts]
    return pl.DataFrame(rows)


def test_suite_expands_in_place_and_names_each_floor_with_its_accuracy() -> None:
    floor = {("a", "multi_key", 1024): 0.22, ("b", "keys_tagged", 2048): 0.79}
    t = _table(["a", "b"], [1024, 2048], floor | {("a", "needle", 1024): KEEP_ACCURACY})  # the rule is >=
    tasks, floors = suite_grid(["lines", "suite"], ["a", "b"], [1024, 2048], t)
    assert tasks == ["lines", *SUITE_TASKS]
    assert [f[:3] for f in floors] == [("a", "multi_key", 1024), ("b", "keys_tagged", 2048)]
    assert "0.22 [0.12, 0.32]" in floors[0][3] and "0.79" in floors[1][3]
    assert suite_grid(["needle"], ["a"], [1024], t) == (["needle"], [])  # named tasks run as asked


@pytest.mark.parametrize("tasks,models,contexts,needle", [
    (["suite"], ["a"], [8192], "no full-cache measurement for (a, needle, 8192"),  # nobody measured it
    (["suite"], ["mine"], [1024], "no full-cache measurement for (mine"),
    (["suite", "suite"], ["a"], [1024], "named twice"),
    (["suite", "needle"], ["a"], [1024], "already one of the suite's tasks"),
])
def test_suite_cells_nobody_measured_are_refused(tasks, models, contexts, needle) -> None:
    with pytest.raises(InputError) as e:
        suite_grid(tasks, models, contexts, _table(["a"], [1024], {}))
    assert e.value.field == "tasks" and needle in str(e.value)


def test_a_suite_of_floors_only_is_refused() -> None:
    t = _table(["a"], [1024], {("a", task, 1024): 0.1 for task in SUITE_TASKS})
    with pytest.raises(InputError, match="every cell of the suite is a floor"):
        suite_grid(["suite"], ["a"], [1024], t)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_folder(folder, "llama")
    return folder


def test_a_suite_grid_runs_only_kept_cells_and_its_report_lists_the_floors(tiny: Path, tmp_path: Path) -> None:
    m = str(tiny)
    kept = {"needle"}
    t = _table([m], [192], {(m, task, 192): 0.0 for task in SUITE_TASKS if task not in kept})
    spec = GridSpec.build(models=[m], tasks=["suite"], contexts=[192], methods=["snapkv"], budgets=["24"], n=1,
                          seed=0, loop=LOOP, floor_table=t)
    assert spec.tasks == SUITE_TASKS and {f[1] for f in spec.floors} == set(SUITE_TASKS) - kept
    assert {c.task for c in spec.cells()} == kept
    assert GridSpec.from_dict(spec.to_dict()) == spec  # the manifest round-trips the floors
    plain = GridSpec.build(models=[m], tasks=["needle"], contexts=[192], methods=["snapkv"], budgets=["24"], n=1,
                           seed=0, loop=LOOP)
    assert "floors" not in plain.to_dict()  # grids without the suite keep their manifests' keys
    out = tmp_path / "grid"
    run_grid(spec, out)
    results = read_checked_parquet(out / RESULTS, "rerun")
    assert set(results["task"].unique()) == kept
    manifest = read_manifest(out)
    assert (out / MANIFEST).is_file() and len(manifest["spec"]["floors"]) == len(SUITE_TASKS) - 1
    from evictlab.eval.compare import TieRule, compare as compare_pairs

    rule = TieRule(kind="em-logprob", tolerance=0.1, level=0.95, n_boot=50, seed=0)
    md = evaluation_markdown(results, compare_pairs(results, rule), rule=rule.describe(),
                             floors=manifest["spec"]["floors"], n_boot=50)
    section = md.split("the suite's floor cells", 1)[1].split("## The full cache", 1)[0]
    assert all(task in section for task in set(SUITE_TASKS) - kept) and "0.00 [0.00, 0.10]" in section


def test_eval_run_with_the_suite_at_an_unmeasured_length_is_one_line(capsys, monkeypatch, tmp_path: Path) -> None:
    code, _, err = run_cli(["eval", "run", "--models", "smollm2-135m", "--tasks", "suite", "--context", "8192",
                            "--methods", "snapkv", "--out", str(tmp_path / "g")], capsys, monkeypatch)
    assert code == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: --tasks: ") and "task_floor.py" in lines[0], err
    assert not (tmp_path / "g").exists()  # refused before anything is written


def test_a_cell_measured_in_two_shipped_folders_is_refused_naming_the_folder(tmp_path: Path) -> None:
    from evictlab.io import write_checked_parquet
    from evictlab.tasks.suite import shipped_floors

    t = _table(["a"], [1024], {})
    for name in ("a", "a-again"):
        (tmp_path / name).mkdir()
        write_checked_parquet(t, tmp_path / name / "floor.parquet")
    with pytest.raises(InputError) as e:
        shipped_floors(tmp_path)
    assert e.value.field == "tasks" and str(tmp_path) in str(e.value) and "appears 2 times" in str(e.value)
    assert shipped_floors(tmp_path / "none").height == 0
