"""Claim: rankings computed while the question is visible carry an 87.6-point retrieval margin.

Runs (or resumes) a grid: SnapKV, KVzip-style, ExpectedAttention and H2O, physical mode,
each under the query-agnostic protocol (the context compressed before the question) and the
query-aware one (one compression after the question is fed, whatever the chunk), on the
retrieval tasks the full cache solves; writes the margin (exact match aware - agnostic, in
points, 95% bootstrap CI over examples) and the peak bytes each protocol held to the claims
table, and the per-comparison detail beside it.

    .venv/bin/python paper_repro/claim_query_aware_margin.py [--grid runs/paper_repro/grid-margin --n 5]
"""

from __future__ import annotations

import sys

import _common
import _grid

from evictlab.eval.claims import query_aware_margin
from evictlab.plots.evaluation import accuracy_vs_bytes
from evictlab.report.record import RunRecord

DEFAULTS = {
    "grid": "runs/paper_repro/grid-margin", "models": ["smollm2-135m"], "tasks": ["needle", "multi_key_word"],
    "contexts": [1024], "budgets": ["32"], "methods": ["snapkv", "kvzip", "expected_attention", "h2o"],
    "modes": ["physical"], "protocols": ["query-agnostic", "query-aware"], "n": 5,
}


def main(argv: list[str] | None = None) -> int:
    args = _grid.parser(__doc__.splitlines()[0], DEFAULTS).parse_args(argv)
    record = RunRecord(kind="paper-repro-query-aware-margin", seed=args.seed, config=_common.config(args))
    results = _grid.run(args)
    claims, detail = query_aware_margin(results, seed=args.seed, n_boot=args.n_boot)
    args.out.mkdir(parents=True, exist_ok=True)
    _grid.markdown_detail("Query-aware margin per comparison", detail, args.out / "query_aware_margin_detail.md")
    made = [accuracy_vs_bytes(results, _common.figures_dir(args) / "query_aware_margin_accuracy_vs_bytes")]
    _common.publish(args, "claim_query_aware_margin.py", claims, made, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
