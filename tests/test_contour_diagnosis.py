"""paper_repro/contour_diagnosis.py on a hand-made trace: the fact columns and the cells figure."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.plots.contour import allocation_cells


def _trace() -> pl.DataFrame:
    """Two examples x 2 layers x 2 KV heads, uniform (8 per cell) against a variant that moves
    4 entries from layer 0 to layer 1 and, in layer 0 head 1, drops 3 of the fact's 4 entries."""
    rows = []
    for method in ("kvzip", "kvzip+contourkv_mass"):
        for ex in (0, 1):
            for layer in (0, 1):
                for head in (0, 1):
                    moved = method != "kvzip"
                    kept = 8 + (4 if moved and layer == 1 else -4 if moved else 0)
                    held = 4 if (layer, head) == (0, 1) else 0
                    fact_kept = 1 if moved and held else held
                    rows.append({"method": method, "example": ex, "compression": 0, "phase": "prefill",
                                 "layer": layer, "kv_head": head, "held": 100, "kept": kept,
                                 "dropped_top": 0.1, "dropped_kept": 0.2 + 0.1 * moved, "e_kept": 0.5,
                                 "e_top": 0.3, "fact_held": held, "fact_kept": fact_kept})
    return pl.DataFrame(rows)


@pytest.fixture()
def script(repro_script):
    return repro_script("contour_diagnosis")


def test_fact_columns_say_which_arm_lost_the_answer(script) -> None:
    table = script.diagnose(_trace())
    got = {r["method"]: r for r in table.iter_rows(named=True)}
    assert got["kvzip"]["fact kept"] == 1.0 and got["kvzip"]["cells losing fact"] == 0.0
    assert got["kvzip+contourkv_mass"]["fact kept"] == pytest.approx(2 / 8)  # 1 of 4, twice
    assert got["kvzip+contourkv_mass"]["cells losing fact"] == 1.0
    assert got["kvzip+contourkv_mass"]["size diff vs uniform"] == 4.0
    # the one cell holding the fact is one where uniform keeps all of it: the variant keeps 1/4 there
    assert got["kvzip"]["fact kept where uniform keeps >= 80%"] == 1.0 and got["kvzip"]["such cells"] == 1
    assert got["kvzip+contourkv_mass"]["fact kept where uniform keeps >= 80%"] == 0.25
    assert got["kvzip+contourkv_mass"]["of those, below half"] == 1


def test_per_layer_shows_where_the_budget_and_the_fact_went(script) -> None:
    """The variant moves 4 entries per cell from layer 0 to layer 1; layer 0 holds the fact
    (4 entries in head 1, per example): uniform keeps all 8, the variant 2."""
    t = script.per_layer(_trace())
    assert t["layer"].to_list() == [0, 1]
    assert t["kept_kvzip"].to_list() == [8.0, 8.0]
    assert t["kept_kvzip+contourkv_mass"].to_list() == [4.0, 12.0]
    assert t["held_kvzip"].to_list() == t["held_kvzip+contourkv_mass"].to_list() == [100.0, 100.0]
    assert t["fact held_kvzip"].to_list() == [8, 0] and t["fact kept_kvzip"].to_list() == [8, 0]
    assert t["fact kept_kvzip+contourkv_mass"].to_list() == [2, 0]
    no_facts = script.per_layer(_trace().drop("fact_held", "fact_kept"))
    assert not any(c.startswith("fact") for c in no_facts.columns)


def test_script_tabulates_a_trace_and_draws_the_cells(script, tmp_path: Path) -> None:
    _trace().write_parquet(tmp_path / "t.parquet")
    assert script.main(["--trace", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "diagnosis.md").read_text()
    assert "fact kept" in text and "![cells](cells.png)" in text and "| layer | held_kvzip |" in text
    assert (tmp_path / "out" / "cells.png").stat().st_size > 0 and (tmp_path / "out" / "cells.pdf").exists()
    # no run record beside the trace: labelled by the trace's own columns, not by this call's defaults
    assert text.startswith("model not recorded, ") and "smollm2" not in text.splitlines()[0]


def test_a_retabulated_trace_keeps_the_labels_of_its_run(script, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _trace().with_columns(task=pl.lit("needle"), budget_value=pl.lit(128.0)).write_parquet(run / "trace.parquet")
    (run / "diagnosis.run_record.json").write_text(json.dumps(
        {"config": {"model": "gemma3-270m", "task": "needle", "context": "1024", "budget": "128"}}))
    assert script.main(["--trace", str(run / "trace.parquet"), "--out", str(tmp_path / "out")]) == 0
    first = (tmp_path / "out" / "diagnosis.md").read_text().splitlines()[0]
    assert first.startswith("gemma3-270m, needle at 1024 tokens, budget 128, n = 2 examples")
    assert "re-tabulated from" in first and "load average" not in first


def test_cells_figure_refuses_a_missing_uniform_arm(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="uniform"):
        allocation_cells(_trace(), tmp_path / "x", uniform="snapkv")
