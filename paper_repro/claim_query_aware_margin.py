"""Claim: rankings computed while the question is visible carry an 87.6-point retrieval margin.

Runs (or resumes) a grid: SnapKV, KVzip-style, ExpectedAttention and H2O, physical mode,
each under the query-agnostic protocol (the context compressed before the question) and the
query-aware one (one compression after the question is fed, whatever the chunk), on the
retrieval tasks the full cache solves; writes the margin (exact match aware - agnostic, in
points, 95% bootstrap CI over examples) and the peak bytes each protocol held to the claims
table, and the per-comparison detail beside it.

    .venv/bin/python paper_repro/claim_query_aware_margin.py [--grid runs/paper_repro/grid-margin --n 4]
"""

from __future__ import annotations


import _grid

from evictlab.eval.claims.margin import query_aware_margin

DEFAULTS = {
    "grid": "runs/paper_repro/grid-margin", "models": ["smollm2-135m"], "tasks": ["needle", "needle_word"],
    "contexts": [1024], "budgets": ["256", "512"], "methods": ["snapkv", "kvzip", "expected_attention", "h2o"],
    "modes": ["physical"], "protocols": ["query-agnostic", "query-aware"], "n": 4,
}


def main(argv: list[str] | None = None) -> int:
    return _grid.claim_main(argv, __doc__, DEFAULTS, "claim_query_aware_margin.py", query_aware_margin,
                            "query_aware_margin")


if __name__ == "__main__":
    from _common import entry

    entry(main)
