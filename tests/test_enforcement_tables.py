"""paper_repro/enforcement_tables.py on a hand-made grid: the pooled row equals the claim row,
the per-budget rows, the configuration counts, bad input refused with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.eval.claims.enforcement import enforcement_cost
from evictlab.eval.compare import compare
from evictlab.eval.runner import RESULT_COLUMNS
from evictlab.io import write_checked_parquet

SCRIPT = Path(__file__).resolve().parents[1] / "paper_repro" / "enforcement_tables.py"


@pytest.fixture()
def script(repro_script):
    return repro_script("enforcement_tables")


def _rows(method: str, mode: str, budget: str | None, em: list[int], bytes_live: int) -> list[dict[str, Any]]:
    full = method == "full"
    return [{c: None for c in RESULT_COLUMNS} | {
        "model": "m", "task": "needle", "context": 1024, "method": method, "mode": mode,
        "scorer": None if full else method.split("+")[0],
        "allocator": None if full else ("uniform" if mode == "uniform" else method.split("+")[1]),
        "protocol": "none" if full else "query-agnostic", "prefill": "one-pass", "budget": budget,
        "budget_unit": None if full else "tokens_per_cell", "budget_value": None if full else int(budget.split("/")[0]),
        "example": i, "exact_match": float(e), "answer_logprob": -1.0 - (1 - e), "kl": 0.0,
        "bytes_live": bytes_live, "bytes_live_peak": bytes_live, "bytes_full": 2**20 * 4, "bytes_budget": 2**20,
        "ppl": 1.0} for i, e in enumerate(em)]


def _results() -> pl.DataFrame:
    """snapkv+adakv: at 64/cell masked right on 4 of 4, uniform on 2 (+50 points); at 128/cell
    both right on all (0); physical = masked everywhere; 2 MiB vs 1 MiB held."""
    parts = [_rows("full", "full", None, [1, 1, 1, 1], 2**22)]
    for b, uni in (("64/cell", [1, 0, 1, 0]), ("128/cell", [1, 1, 1, 1])):
        parts += [_rows("snapkv+adakv", "masked", b, [1, 1, 1, 1], 2**22),
                  _rows("snapkv+adakv", "uniform", b, uni, 2**20),
                  _rows("snapkv+adakv", "physical", b, [1, 1, 1, 1], 2**20)]
    return pl.DataFrame([r for p in parts for r in p], schema=RESULT_COLUMNS)


def test_tables_pool_as_the_claim_rows_and_split_by_budget(script) -> None:
    res = _results()
    text = script.tables(res, compare(res), n_boot=300)
    claims, _ = enforcement_cost(res, n_boot=300)
    pooled = claims[0].our_value.split(" points")[0]            # "+25.0 [+a, +b]"
    row = next(line for line in text.splitlines() if "`snapkv+adakv`" in line)   # the first table
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3] == pooled and pooled.startswith("+25.0")  # the claim row's interval, same key
    assert cells[4] == "+0.0 to +50.0"                        # per comparison (budget)
    assert cells[5] == "1.000 / 0.750 / 1.000" and cells[6] == "+0.0"
    assert cells[7] == "4.00 / 1.00 / 1.00 (4.00)"            # MiB held
    assert cells[8] == "1 / 1 / 0" and cells[9] == "0 / 2 / 0"  # 64/cell won, 128/cell tied; physical = masked
    assert cells[10] == "overlaps"                            # [+0, +50] holds part of 14.1-62.2
    assert script._against_paper(0.4, 2.5) == "below, by at least 11.6 points"
    assert script._against_paper(70.0, 80.0) == "above, by at least 7.8 points"
    by_budget = [line for line in text.splitlines() if line.startswith("| m | query-agnostic | `snapkv+adakv` |")][1]
    b64, b128 = [c.strip() for c in by_budget.split("|")[4:6]]
    assert b64.startswith("+50.0") and b128 == "+0.0 [+0.0, +0.0]"
    assert "| 64/cell | 128/cell |" in text                    # budgets in numeric order


def test_nothing_to_pair_is_refused(script) -> None:
    res = _results().filter(pl.col("mode") != "uniform")
    with pytest.raises(InputError, match="masked and a uniform"):
        script.tables(res, compare(res), n_boot=300)


def test_cli_writes_the_tables_and_refuses_bad_input(script, tmp_path: Path) -> None:
    g = tmp_path / "grid"
    g.mkdir()
    res = _results()
    write_checked_parquet(res, g / "results.parquet")
    with pytest.raises(InputError, match="eval compare"):    # not compared yet
        script.main([str(g)])
    compare(res).write_parquet(g / "pairs.parquet")
    with pytest.raises(InputError, match="--out"):
        script.main([str(g), "--out", str(tmp_path / "t.txt")])
    with pytest.raises(InputError, match="--out"):
        script.main([str(g), "--out", str(tmp_path / "nothere" / "t.md")])
    with pytest.raises(InputError, match="--n-boot"):
        script.main([str(g), "--n-boot", "5"])
    assert script.main([str(g), "--out", str(tmp_path / "t.md"), "--n-boot", "200"]) == 0
    assert "`snapkv+adakv`" in (tmp_path / "t.md").read_text()
    # as a command: one line on stderr, exit 2, no traceback
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nothere")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("error:") and len(done.stderr.strip().splitlines()) == 1


def test_partial_reads_the_examples_done_everywhere(script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--partial reads the rows as `eval compare --partial` does (evictlab.eval.grid.partial_results,
    tested with the grid) and that comparison's pairs, and says PARTIAL above the tables."""
    from evictlab.eval.grid import PartialResults

    g = tmp_path / "grid"
    g.mkdir()
    with pytest.raises(InputError, match="grid.json"):
        script.main([str(g), "--partial"])
    (g / "grid.json").write_text("{}")
    with pytest.raises(InputError, match="--partial` first"):
        script.main([str(g), "--partial"])
    res = _results()
    (g / "partial").mkdir()
    compare(res).write_parquet(g / "partial" / "pairs.parquet")
    got = PartialResults(results=res, examples=4, n=50, units_done=8, units=100)
    stale = PartialResults(results=res, examples=5, n=50, units_done=10, units=100)
    import _grid  # read_grid lives there; the script imported it

    monkeypatch.setattr(_grid, "read_manifest", lambda folder: {"spec": {}})
    monkeypatch.setattr(_grid.GridSpec, "from_dict", classmethod(lambda cls, d: None))
    monkeypatch.setattr(_grid, "partial_results", lambda spec, folder: stale)
    with pytest.raises(InputError, match="--overwrite"):   # pairs of 4 examples, the grid has 5 done now
        script.main([str(g), "--partial"])
    monkeypatch.setattr(_grid, "partial_results", lambda spec, folder: got)
    out = tmp_path / "t.md"
    assert script.main([str(g), "--partial", "--out", str(out), "--n-boot", "200"]) == 0
    text = out.read_text()
    assert text.startswith("**PARTIAL: the grid is not finished (8 of 100 context units done)")
    assert "`snapkv+adakv`" in text
