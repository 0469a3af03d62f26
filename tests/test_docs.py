"""The documentation stands alone: no pointer to a specification file outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# "SPEC" as a word (not ModelSpec / get_spec), a "spec section", or the shared folder
_OUTSIDE = re.compile(r"\bSPEC\b|(?i:spec\.md|spec section|shared/)")


def _files() -> list[Path]:
    out = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("evictlab", "paper_repro", "benchmarks"):
        out += sorted((ROOT / folder).rglob("*.py"))
    return out


def test_no_reference_to_an_outside_specification() -> None:
    hits = []
    for f in _files():
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if _OUTSIDE.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_theory_defines_every_listed_quantity() -> None:
    text = (ROOT / "docs" / "theory.md").read_text(encoding="utf-8")
    for term in ("Row.", "dense output", "forced error", "Identity.", "ES(s)", "Top-mass set", "dropped mass",
                 "Candidate pool", "ES_hat", "Gap closed", "kappa_hat", "1.11", "Free-weight error", "Penalty pi(s)",
                 "Balancing selector", "Certified optimum", "ZERO-ES", "alpha_rho", "cell", "Bytes held",
                 "`physical`", "`uniform`", "`masked`", "`query-agnostic`", "`query-aware`", "PyramidKV", "AdaKV",
                 "ContourKV (ours", "DBTrimKV global budget", "StreamingLLM", "H2O", "SnapKV", "oracle",
                 "Learned retention gates", "Training bias.", "eviction limit", "Capacity loss.", "Objective."):
        assert term in text, term


def test_docs_link_to_existing_theory_sections() -> None:
    text = (ROOT / "docs" / "theory.md").read_text(encoding="utf-8")
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip("# ").lower()).replace(" ", "-")
               for h in re.findall(r"^#+ .*$", text, flags=re.M)}
    anchors |= set(re.findall(r'<a id="([^"]+)"></a>', text))
    for f in sorted((ROOT / "docs").glob("*.md")):
        for anchor in re.findall(r"\(theory\.md#([^)]+)\)", f.read_text(encoding="utf-8")):
            assert anchor in anchors, f"{f.name}: theory.md#{anchor}"
