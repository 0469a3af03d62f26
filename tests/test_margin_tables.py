"""paper_repro/margin_tables.py on a hand-made grid: the pooled row equals the claim row, the
per-budget and per-task rows, the configuration counts, bad input refused with exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.eval.claims.margin import query_aware_margin
from evictlab.eval.runner import RESULT_COLUMNS
from evictlab.io import write_checked_parquet

SCRIPT = Path(__file__).resolve().parents[1] / "paper_repro" / "margin_tables.py"


@pytest.fixture()
def script(repro_script):
    return repro_script("margin_tables")


def _rows(method: str, protocol: str, budget: str | None, em: list[int], peak: int, task: str = "needle"
          ) -> list[dict[str, Any]]:
    full = method == "full"
    return [{c: None for c in RESULT_COLUMNS} | {
        "model": "m", "task": task, "context": 1024, "method": method, "mode": "full" if full else "physical",
        "scorer": None if full else method, "allocator": None if full else "uniform",
        "protocol": protocol, "prefill": "one-pass", "budget": budget,
        "budget_unit": None if full else "tokens_per_cell", "budget_value": None if full else int(budget.split("/")[0]),
        "example": i, "exact_match": float(e), "answer_logprob": -1.0 - (1 - e), "kl": 0.0,
        "bytes_live": 2**20 if not full else 2**22, "bytes_live_peak": peak, "bytes_full": 2**22,
        "bytes_budget": 2**20, "ppl": 1.0} for i, e in enumerate(em)]


def _results() -> pl.DataFrame:
    """snapkv on needle: at 64/cell query-aware right on 4 of 4, agnostic on 1 (+75 points); at
    128/cell both right on 3 of 4 (0); the aware arm peaks at 4 MiB, the agnostic at 1.5 MiB.
    On `needle_word` (64/cell only) aware 2 of 4, agnostic 2 of 4. `variable_tracking` is not a
    retrieval task: left out."""
    parts = [_rows("full", "none", None, [1, 1, 1, 1], 2**22), _rows("full", "none", None, [1, 1, 0, 1], 2**22,
                                                                       "needle_word")]
    for b, aware, agnostic in (("64/cell", [1, 1, 1, 1], [1, 0, 0, 0]), ("128/cell", [1, 1, 1, 0], [0, 1, 1, 1])):
        parts += [_rows("snapkv", "query-aware", b, aware, 2**22),
                  _rows("snapkv", "query-agnostic", b, agnostic, 3 * 2**19)]
    parts += [_rows("snapkv", "query-aware", "64/cell", [1, 0, 1, 0], 2**22, "needle_word"),
              _rows("snapkv", "query-agnostic", "64/cell", [0, 1, 1, 0], 3 * 2**19, "needle_word"),
              _rows("snapkv", "query-aware", "64/cell", [1, 1, 1, 1], 2**22, "variable_tracking"),
              _rows("snapkv", "query-agnostic", "64/cell", [0, 0, 0, 0], 3 * 2**19, "variable_tracking")]
    return pl.DataFrame([r for p in parts for r in p], schema=RESULT_COLUMNS)


def test_tables_pool_as_the_claim_rows_and_split_by_budget_and_task(script) -> None:
    res = _results()
    text = script.tables(res, n_boot=300)
    claims, detail = query_aware_margin(res, n_boot=300)
    assert len(claims) == 1 and detail.height == 3                 # variable_tracking left out
    pooled = claims[0].our_value.split(" points")[0]
    row = next(line for line in text.splitlines() if line.startswith("| m | `snapkv` | ") and "MiB" not in line)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2] == pooled and pooled.startswith("+25.0")       # (3 + 0 + 0) / 12 answers, the claim's key
    assert cells[3] == "+0.0 to +75.0"                             # per comparison
    assert cells[4] == "0.750 / 0.500 (0.917)"                     # 9 and 6 of 12; full cache (8 x 1 + 4 x 0.75) / 12
    assert cells[6] == "4.00 / 1.50" and cells[7] == "1.00"        # peak held, held after compression
    assert cells[8] == "1 / 2 / 0"                                 # 64/cell needle won by 3 answers; the others tie
    assert cells[9] == "below, by at least " + f"{87.6 - float(pooled.split(', ')[1].rstrip(']')):.1f} points"
    assert script._against_paper(90.0, 95.0) == "above, by at least 2.4 points"
    assert script._against_paper(80.0, 90.0) == "holds it"
    lines = text.splitlines()
    by_budget = lines[lines.index("| model | method | 64/cell | 128/cell |") + 2]   # budgets in numeric order
    b64, b128 = [c.strip() for c in by_budget.split("|")[3:5]]
    assert b64.startswith("+37.5 [") and b128.startswith("+0.0 [-")  # 64/cell: (3 + 0) / 8; 128/cell: +1 and -1
    needle = next(line for line in lines if line.startswith("| m | needle | "))
    word = next(line for line in lines if line.startswith("| m | needle_word | "))
    assert needle.split("|")[3].strip() == "1.000" and needle.split("|")[4].strip().startswith("+37.5")
    assert word.split("|")[3].strip() == "0.750" and word.split("|")[4].strip().startswith("+0.0")
    assert "variable_tracking" not in text


def test_nothing_to_pair_is_refused(script) -> None:
    res = _results().filter(pl.col("protocol") != "query-aware")
    with pytest.raises(InputError, match="query-aware and a query-agnostic"):
        script.tables(res, n_boot=300)


def test_cli_writes_the_tables_and_refuses_bad_input(script, tmp_path: Path) -> None:
    g = tmp_path / "grid"
    g.mkdir()
    with pytest.raises(InputError, match="results.parquet"):       # not a finished grid
        script.main([str(g)])
    write_checked_parquet(_results(), g / "results.parquet")
    with pytest.raises(InputError, match="--out"):
        script.main([str(g), "--out", str(tmp_path / "t.txt")])
    with pytest.raises(InputError, match="--out"):
        script.main([str(g), "--out", str(tmp_path / "nothere" / "t.md")])
    with pytest.raises(InputError, match="--n-boot"):
        script.main([str(g), "--n-boot", "5"])
    assert script.main([str(g), "--out", str(tmp_path / "t.md"), "--n-boot", "200"]) == 0   # no pairs.parquet needed
    assert "`snapkv`" in (tmp_path / "t.md").read_text()
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nothere")], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("error:") and len(done.stderr.strip().splitlines()) == 1


def test_partial_reads_the_examples_done_everywhere(script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--partial reads the rows as `eval compare --partial` does (no comparison needed first)
    and says PARTIAL above the tables."""
    import _grid
    from evictlab.eval.grid import PartialResults

    g = tmp_path / "grid"
    g.mkdir()
    with pytest.raises(InputError, match="grid.json"):
        script.main([str(g), "--partial"])
    (g / "grid.json").write_text("{}")
    got = PartialResults(results=_results(), examples=4, n=50, units_done=8, units=100)
    monkeypatch.setattr(_grid, "read_manifest", lambda folder: {"spec": {}})
    monkeypatch.setattr(_grid.GridSpec, "from_dict", classmethod(lambda cls, d: None))
    monkeypatch.setattr(_grid, "partial_results", lambda spec, folder: got)
    out = tmp_path / "t.md"
    assert script.main([str(g), "--partial", "--out", str(out), "--n-boot", "200"]) == 0
    text = out.read_text()
    assert text.startswith("**PARTIAL: the grid is not finished (8 of 100 context units done)")
    assert "`snapkv`" in text
