"""The shipped full-cache tables (data/task_floor/<model>/): what `--tasks suite` reads.

Each folder is a finished `benchmarks/task_floor.py --out` (rows.parquet, floor.parquet,
floor.md, the run record): `<model>/` the first run of the suite's families, `<model>-<task>/`
a family measured later (facts_word). Checked here: each folder on its own (its cells are its
rows', the contexts asked, the floor rule, each cell's accuracy recomputed from its rows), and
together for both suite models: every suite task at the same contexts, each cell once.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from evictlab.io import read_checked_parquet
from evictlab.tasks.suite import (FLOOR_DIR, KEEP_ACCURACY, SUITE_CONTEXTS, SUITE_MODELS, SUITE_TASKS,
                                  shipped_floors, suite_grid)

#: Contexts per cell of the shipped run (``--n 50 --n-at 4096:20``).
CONTEXTS_ASKED = {1024: 50, 2048: 50, 4096: 20}


def _folders(model: str) -> list:
    return sorted(p for p in FLOOR_DIR.iterdir() if p.is_dir() and (p.name == model or p.name.startswith(model + "-")))


@pytest.mark.parametrize("model", SUITE_MODELS)
def test_each_suite_model_ships_a_complete_checked_table(model: str) -> None:
    folders = _folders(model)
    assert folders and folders[0].name == model
    cells: list[tuple[str, int]] = []
    for folder in folders:
        table = read_checked_parquet(folder / "floor.parquet", "git checkout -- data/task_floor")
        rows = read_checked_parquet(folder / "rows.parquet", "git checkout -- data/task_floor")
        assert set(table["model"]) == {model} == set(rows["model"])
        own = [(t, c) for t, c in table.select("task", "context").iter_rows()]
        assert set(own) == {(t, c) for t, c in rows.select("task", "context").unique().iter_rows()}
        for r in table.to_dicts():
            g = rows.filter((pl.col("task") == r["task"]) & (pl.col("context") == r["context"]))
            assert r["contexts"] == g["example"].n_unique() == CONTEXTS_ASKED[r["context"]]
            assert r["answers"] == g.height
            assert r["accuracy"] == pytest.approx(float(np.mean(g["exact_match"].to_numpy())))
            assert r["lo"] <= r["accuracy"] <= r["hi"]
            assert r["label"] == ("kept" if r["accuracy"] >= KEEP_ACCURACY else "floor")
        record = json.loads((folder / "run_record.json").read_text())
        assert record["kind"] == "bench.task_floor"
        cells += own
    contexts = {c for _, c in cells}  # 1k and 2k at least; 4k once its run is finished (docs/evaluation.md)
    assert {1024, 2048} <= contexts <= set(SUITE_CONTEXTS)
    assert len(cells) == len(set(cells)) and set(cells) == {(t, c) for t in SUITE_TASKS for c in contexts}


def test_the_suite_of_the_shipped_tables_runs_on_both_models_at_every_length() -> None:
    table = shipped_floors()
    contexts = sorted(set(table["context"]))
    tasks, floors = suite_grid(["suite"], list(SUITE_MODELS), contexts)
    assert tasks == list(SUITE_TASKS)
    expected = {(m, t, c) for m, t, c, k in table.select("model", "task", "context", "kept").iter_rows() if not k}
    assert {f[:3] for f in floors} == expected
    assert len(floors) < len(SUITE_MODELS) * len(SUITE_TASKS) * len(contexts)
