"""The claim row "eviction can beat the full cache" (paper B) from finished distractor sweeps.

Input: the ``verdict.parquet`` of one or more ``evictlab dilution sweep`` runs
(:func:`evictlab.dilution.sweep.verdicts`: per model, distractor kind and count, each
method's paired difference from the full cache over the same examples, with 95% bootstrap
intervals over examples). Output: per model two rows of the claims table, one for the real
(query-agnostic) methods and one for the ORACLE that evicts distractors only, each naming
where (method, k) the method beat the full cache, or that it never did, and the largest
exact-match difference with its interval.
"""

from __future__ import annotations

import polars as pl

from evictlab.report.markdown import ci
from evictlab.stats.claims import ClaimRow

__all__ = ["PAPER_VALUE", "beats_full_claims"]

PAPER_VALUE = "+14% (MMDU, 512-token budget; DBTrimKV vs full cache)"
_DEFS = ("needle retrieval with k near-miss distractors (docs/dilution.md); exact match and answer log-probability, "
         "teacher-forced; every method at the same kept-entry budget, physical eviction, query-agnostic; "
         "beats = the 95% paired interval of (method - full) excludes 0 above")


def _where(rows: pl.DataFrame) -> str:
    wins = rows.filter(pl.col("verdict").str.starts_with("beats"))
    if wins.height == 0:
        return "never"
    return "; ".join(f"{r['method']} at k={r['distractors']} ({r['verdict']})" for r in wins.to_dicts())


def beats_full_claims(verdict: pl.DataFrame, weights: str = "weights quantised (Q4 GGUF)") -> list[ClaimRow]:
    """Claim rows per (model, oracle or not) from the concatenated ``verdict.parquet`` tables."""
    out = []
    for (model,), grp in verdict.group_by("model", maintain_order=True):
        for oracle in (False, True):
            g = grp.filter(pl.col("oracle") == oracle)
            if g.height == 0:
                continue
            best = g.sort("em_diff", "logprob_diff", descending=True).row(0, named=True)
            wins = _where(g)
            judged = g.filter(pl.col("verdict") != "too few examples").height
            if judged == 0:
                verdict_text = "not tested (too few examples per cell)"
            elif wins == "never":
                verdict_text = "not reproduced on this model and task"
            else:
                verdict_text = "reproduced (eviction beats the full cache somewhere)"
            ks = sorted(set(g["distractors"].to_list()))
            out.append(ClaimRow(
                "dilution-beats-full" + ("-oracle" if oracle else ""),
                "eviction can beat the full cache (paper B, attention dilution)"
                + (" - ORACLE that evicts distractors only (labels)" if oracle else " - query-agnostic methods"),
                PAPER_VALUE,
                f"best em diff {ci(best['em_diff'], best['em_diff_lo'], best['em_diff_hi'], 3, signed=True)} "
                f"({best['method']}, k={best['distractors']}; em full {best['em_full']:.2f}); beats full: {wins}",
                verdict_text, f"{model} ({weights})",
                f"{int(g['n'].max())} examples per cell, k in {ks}, kinds {sorted(set(g['kind'].to_list()))}",
                "the sweep's --budget (see its report.md)", _DEFS,
                "95% paired percentile bootstrap over examples (per method and k; no correction for the "
                f"{g.height} comparisons)"))
    return out
