"""Markdown rendering: tables from polars frames or dicts, and whole reports written atomically."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from evictlab.io import atomic_write_text


def _cell(v: Any, digits: int) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        if v != 0 and (abs(v) < 10 ** -digits or abs(v) >= 1e6):
            return f"{v:.{digits}g}"
        return f"{v:.{digits}f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def table(rows: Iterable[dict[str, Any]] | Any, columns: Sequence[str] | None = None,
          headers: Sequence[str] | None = None, digits: int = 3) -> str:
    """A GitHub-flavoured Markdown table from a polars DataFrame or an iterable of dicts."""
    if hasattr(rows, "to_dicts"):
        rows = rows.to_dicts()
    rows = list(rows)
    if columns is None:
        columns = list(rows[0].keys()) if rows else []
    headers = list(headers) if headers is not None else list(columns)
    if len(headers) != len(columns):
        raise ValueError("headers and columns differ in length")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c), digits) for c in columns) + " |")
    if not rows:
        lines.append("| " + " | ".join("(none)" if i == 0 else "" for i in range(len(columns))) + " |")
    return "\n".join(lines) + "\n"


def ci(v: float, lo: float, hi: float, digits: int = 3) -> str:
    """``v [lo, hi]`` or ``n/a``."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def figure(path: str | os.PathLike[str], caption: str, relative_to: str | os.PathLike[str]) -> str:
    """An image link (relative to the report's folder) with its caption in italics below."""
    rel = os.path.relpath(Path(path), Path(relative_to))
    pdf = os.path.splitext(rel)[0] + ".pdf"
    return f"![{Path(path).stem}]({rel})\n\n*{caption}* (PDF: `{pdf}`)\n"


def write(path: str | os.PathLike[str], sections: Sequence[str]) -> Path:
    """Join sections with blank lines and write the report atomically."""
    text = "\n".join(s.rstrip("\n") + "\n" for s in sections)
    atomic_write_text(path, text)
    return Path(path)


CLAIM_COLUMNS = ("claim", "paper_value", "our_value", "interval", "verdict", "model", "rows", "budgets", "definitions")
CLAIM_HEADERS = ("claim", "paper value", "our value [95% CI]", "interval method", "paper vs ours", "model", "rows",
                 "budgets", "definitions used")


def claims_table(claims: Iterable[Any]) -> str:
    """The claims table (rows are :class:`evictlab.stats.claims.ClaimRow` or their dicts)."""
    rows = [c.to_dict() if hasattr(c, "to_dict") else dict(c) for c in claims]
    return table(rows, CLAIM_COLUMNS, CLAIM_HEADERS)
