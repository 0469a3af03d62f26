"""The README's Python code runs as written (its "From Python" section)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    """Every fenced ```python block of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def test_the_blocks_are_found() -> None:
    assert python_blocks("a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n```\n") == ["x = 1\n", "y = 2\n"]


@pytest.mark.model
@pytest.mark.slow
def test_readme_python_blocks_run(real_model, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from evictlab.models import loading

    # the same model, loaded once per test session (real_model) instead of once more here
    real_model("smollm2-135m", "ragged")
    monkeypatch.setattr(loading, "load_model", lambda name, device="cpu", dtype=None, attn_implementation="eager":
                        real_model(name, attn_implementation))
    blocks = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert blocks, "the README has no Python block"
    for i, code in enumerate(blocks):
        namespace: dict = {"__name__": f"readme_block_{i}"}
        exec(compile(code, f"README.md python block {i}", "exec"), namespace)
    out = capsys.readouterr().out
    assert out.strip(), "the README's example prints its result"
    cache, summary = namespace["cache"], namespace["summary"]
    assert cache.compressions >= 1 and cache.bytes().live < cache.bytes().full
    assert summary.agreed == summary.tried == 4
    assert namespace["results"].height == 2 * namespace["rows"].n_rows
