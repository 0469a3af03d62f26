"""Figure functions: PNG + PDF written, captions carry definitions, clear errors on bad input."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from evictlab.errors import InputError
from evictlab.plots.heatmap import gap_heatmap
from evictlab.plots.penalty import penalty_curve
from evictlab.plots.roc import roc_table
from evictlab.stats.ceilings import summarize
from evictlab.stats.planted import planted_results
from evictlab.stats.results import prepare


@pytest.fixture(scope="module")
def df() -> pl.DataFrame:
    return prepare(planted_results(300, seed=5))


def test_penalty_and_heatmap_files(df: pl.DataFrame, tmp_path: Path) -> None:
    s = summarize(df, ("model", "s"), n_boot=30)
    f = penalty_curve(s, tmp_path / "pi")
    assert f.png.stat().st_size > 5000 and f.pdf.read_bytes()[:5] == b"%PDF-"
    assert "e_free" in f.caption and "ours" in f.caption
    cells = summarize(df, ("model", "s", "layer", "head"), n_boot=10)
    h = gap_heatmap(cells, tmp_path / "hm.png", "planted")  # a suffix is replaced by .png/.pdf
    assert h.png.name == "hm.png" and h.pdf.name == "hm.pdf" and h.png.stat().st_size > 5000
    with pytest.raises(InputError, match="no cells for model"):
        gap_heatmap(cells, tmp_path / "x", "nope")


def test_bad_tables_are_clear_errors(df: pl.DataFrame, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="lacks columns"):
        penalty_curve(df, tmp_path / "x")
    one_class = pl.DataFrame({"predictor": ["a"] * 3, "model": ["m"] * 3, "s": ["4"] * 3,
                              "y": [True] * 3, "score": [0.1, 0.2, 0.3]})
    with pytest.raises(InputError, match="both classes"):
        roc_table(one_class)
    assert not list(tmp_path.glob("*.png"))  # nothing half-written
