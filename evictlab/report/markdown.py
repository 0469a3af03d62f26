"""Markdown rendering: tables from polars frames or dicts, and whole reports written atomically."""

from __future__ import annotations

import math
import numbers
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


def ci(v: float | None, lo: float | None, hi: float | None, digits: int = 3, *, signed: bool = False,
       unit: str = "") -> str:
    """A number with its interval, the one format every report and command prints:
    ``v [lo, hi]`` with ``digits`` decimals (``signed``: ``+v [+lo, +hi]``), then ``unit``
    (e.g. ``" points"``); ``n/a`` without a finite value; the value alone (with ``unit``)
    when the interval is not finite (e.g. no resample had both classes)."""
    def finite(x: Any) -> bool:
        return isinstance(x, numbers.Real) and math.isfinite(x)

    if not finite(v):
        return "n/a"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    if not (finite(lo) and finite(hi)):
        return f.format(v) + unit
    return f"{f.format(v)} [{f.format(lo)}, {f.format(hi)}]{unit}"


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
