"""Shared figure plumbing: headless backend, atomic PNG + PDF writes, the returned record."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evictlab.io import atomic_path


@dataclass(frozen=True)
class Figure:
    """Files written for one figure and the caption (definitions) to print beside it."""

    png: Path
    pdf: Path
    caption: str


def setup() -> Any:
    """Import pyplot with the non-interactive Agg backend and a readable seaborn theme."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(context="paper", style="whitegrid", font_scale=1.0)
    return plt


def save(fig: Any, out: str | os.PathLike[str], caption: str, dpi: int = 130) -> Figure:
    """Save ``fig`` as ``out.png`` and ``out.pdf`` (``out`` has no suffix), atomically, then close it."""
    import matplotlib.pyplot as plt

    base = Path(out)
    base = base.with_suffix("") if base.suffix in (".png", ".pdf") else base
    png, pdf = base.parent / (base.name + ".png"), base.parent / (base.name + ".pdf")
    try:
        fig.tight_layout()
        with atomic_path(png, suffix=".png") as tmp:
            fig.savefig(tmp, format="png", dpi=dpi)
        with atomic_path(pdf, suffix=".pdf") as tmp:
            fig.savefig(tmp, format="pdf")
    finally:
        plt.close(fig)
    return Figure(png, pdf, caption)


def require(df: Any, columns: list[str], what: str) -> None:
    """Clear error when a figure's input table lacks a column."""
    from evictlab.errors import InputError

    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise InputError(what, f"table lacks columns {missing}", "build it with evictlab.stats (see docs/statistics.md)")
    if df.height == 0:
        raise InputError(what, "table is empty", "plot a table with at least one row")
