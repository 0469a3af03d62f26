"""paper_repro scripts: each writes its claim rows and figures on a tiny planted input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evictlab.stats.planted import planted_results

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "paper_repro" / script), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_claim_scripts_write_rows_and_figures(tmp_path: Path) -> None:
    res = tmp_path / "r.parquet"
    planted_results(300, seed=4).write_parquet(res)
    out = tmp_path / "out"
    figs = tmp_path / "figs"  # the default is the repository's figures/ folder
    common = ["--results", str(res), "--out", str(out), "--figures", str(figs), "--n-boot", "30",
              "--weights", "planted (test)"]
    _run("claim_selection_ceiling.py", *common)
    _run("claim_np_hardness.py", "--trials", "4", "--size", "6", "--out", str(out), "--figures", str(figs))
    rows = json.loads((out / "claims.json").read_text())
    ids = {r["claim_id"] for r in rows}
    assert ids == {"ceiling", "np-hardness"}
    # re-running a script replaces its rows instead of duplicating them
    _run("claim_selection_ceiling.py", *common)
    assert len(json.loads((out / "claims.json").read_text())) == len(rows)
    md = (out / "claims.md").read_text()
    assert "| claim | paper value |" in md and "0.021-0.047" in md and "NP-complete" in md
    for name in ("ceiling_gap_closed_ecdf", "ceiling_gap_heatmap_planted", "np_hardness_times"):
        for ext in ("png", "pdf"):
            assert (figs / f"{name}.{ext}").stat().st_size > 3000
    assert "](../figs/np_hardness_times.png)" in md
    assert (out / "claim_np_hardness.run_record.json").exists()
