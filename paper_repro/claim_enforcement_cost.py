"""Claim: forcing a real budget on one fixed per-head selection costs 14.1-62.2 points (LongBench/RULER).

Runs (or resumes) a grid: SnapKV + AdaKV and KVzip-style + AdaKV (per-head selections) held masked (the full cache
stays in memory), forced uniform (equal per-cell sizes, the budget's bytes) and ragged
physical (the same selection, the budget's bytes, freed), query-agnostic, on the tasks the
full cache solves; writes the points lost (masked - uniform) and the bytes each mode held,
with 95% bootstrap CIs over examples, to the claims table, and the per-comparison detail
beside it. Our numbers are never adjusted to agree; the full cache's accuracy is printed
beside each row.

    .venv/bin/python paper_repro/claim_enforcement_cost.py [--grid runs/paper_repro/grid-enforcement --n 4]
"""

from __future__ import annotations


import _grid

from evictlab.eval.claims.enforcement import enforcement_cost

DEFAULTS = {
    "grid": "runs/paper_repro/grid-enforcement", "models": ["smollm2-135m"], "tasks": ["needle", "needle_word"],
    "contexts": [1024], "budgets": ["128", "512"], "methods": ["snapkv+adakv", "kvzip+adakv"],
    "modes": ["physical", "uniform", "masked"], "protocols": ["query-agnostic"], "n": 4,
}


def main(argv: list[str] | None = None) -> int:
    return _grid.claim_main(argv, __doc__, DEFAULTS, "claim_enforcement_cost.py", enforcement_cost, "enforcement_cost")


if __name__ == "__main__":
    from _common import entry

    entry(main)
