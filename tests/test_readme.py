"""The README shows what the main job produces, from files under figures/ that a documented command regenerates."""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]


def test_readme_figure_and_claims_excerpt_come_from_figures() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](figures/readme_selection_ceiling.png)" in readme
    png = ROOT / "figures" / "readme_selection_ceiling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 500_000
    block = re.search(r"<!-- claims-excerpt:start -->\n(.*?)<!-- claims-excerpt:end -->", readme, flags=re.S)
    assert block, "README lacks the claims excerpt markers"
    assert block.group(1).strip() == (ROOT / "figures" / "readme_claims.md").read_text(encoding="utf-8").strip()
    assert "paper_repro/readme_figures.py" in readme  # the command that regenerates both


def test_excerpt_selects_headline_rows() -> None:
    import sys

    sys.path.insert(0, str(ROOT / "paper_repro"))
    from readme_figures import EXCERPT_COLUMNS, excerpt

    rows = [{"claim_id": cid, "claim": cid, "paper_value": "p", "our_value": "o", "verdict": "v", "model": m,
             "rows": "r", "budgets": b, "definitions": "d", "interval": "i"}
            for cid, m, b in [("ceiling", "a (w)", "s=4"), ("ceiling", "a (w)", "s=8"), ("ceiling", "a (w)", "s=32"),
                              ("ceiling", "pooled (a + b) (w)", "s=4"), ("penalty", "a (w)", "s=4"),
                              ("penalty-trend", "a (w)", "s=4,32"), ("auc", "a (w)", "s=all"), ("auc", "a (w)", "s=4"),
                              ("np-hardness", "-", "seed=0")]]
    out = excerpt(pl.DataFrame(rows))
    assert out.columns == list(EXCERPT_COLUMNS)
    assert out["budgets"].to_list() == ["s=4", "s=32", "s=4", "s=4,32", "s=all", "seed=0"]
    assert "pooled (a + b)" in out["model"].to_list() and "a" in out["model"].to_list()
