"""Paper B's (DBTrimKV's) claims on a grid with learned retention gates (``trimkv`` arms):

- **the global budget**: one budget over every layer and KV head (``trimkv+global``) beats the
  same gates' scores at equal per-cell sizes (``trimkv``);
- **learned beats training-free**: ``trimkv+global`` against every other evicting method of
  the grid (SnapKV, AdaKV, ContourKV, ...) at the same physical bytes;
- **"matches or beats the full cache"**: ``trimkv+global`` against the full cache;
- **the shared projection** (the ablation): two ``+global`` arms with different gates
  (``trimkv[gates=DIR]+global``) against each other.

Points = 100 x (exact match of the gates' arm - the other arm) per answer, answers paired by
(example, question); pooled per model over tasks, context lengths and budgets with the
whole-context bootstrap of :mod:`evictlab.eval.claims.common`. Every ``+global`` arm with a
``trimkv`` scorer is an arm A (a grid with two gate sets, ``trimkv[gates=DIR]+global``, gets
rows for each, and the pair of them is the ablation's row). The paper gives directions, not
numbers we can compare, except for the full cache (0 points: matched), so the other rows'
verdict is ``no paper value`` with the direction said in the value.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from evictlab.eval.claims import common as C
from evictlab.stats.claims import ClaimRow

GATES_SCORER = "trimkv"
"""The registry family of the learned scorer."""
GATES_DEFS = ("physical store (bytes held = the budget on both sides), query-agnostic; answers paired by "
              "(example, question); points = 100 x exact-match difference per answer; a configuration "
              "(model, task, context, budget) is tied when the two arms' correct answers differ by at most one (ours)")


_TEXTS = {
    # kind of the other arm -> (the claim, with {a} / {b} the two methods; paper B's value)
    "global": ("{a}: one global budget beats equal per-cell sizes with the same gates ({b})",
               "the global budget is what makes the learned scores pay (a direction; no comparable number)"),
    "gates": ("{a} against {b}: two gate sets under the same global budget",
              "the shared projection beats per-layer ('local') ones (paper B's ablation; a direction): "
              "each arm names its gates in its method text"),
    "other": ("{a} beats {b} at the same physical bytes",
              "learned retention beats training-free eviction (a direction; no comparable number)"),
    "full": ("{a} matches or beats the full cache", "0 points (matches the full cache; above 0: beats it)"),
}


def _direction(lo: float, hi: float) -> str:
    if lo > 0:
        return "the paper's direction (interval above 0)"
    if hi < 0:
        return "the opposite direction (interval below 0)"
    return "undecided (interval holds 0)"


def _configurations(detail: pl.DataFrame) -> str:
    """Configurations won / tied / lost by accuracy (within one answer: a tie), arm A's side."""
    from evictlab.eval.compare import accuracy_verdict

    v = [accuracy_verdict(r["em_a"] * r["n"], r["em_b"] * r["n"], r["n"]) for r in detail.iter_rows(named=True)]
    return f"configurations {v.count('win')} won / {v.count('tie')} tied / {v.count('loss')} lost of {len(v)}"


def _stats(g: pl.DataFrame) -> dict[str, Any]:
    return {"em_a": g["exact_match"].mean(), "em_b": g["exact_match_b"].mean(),
            "d_logprob": float((g["answer_logprob"] - g["answer_logprob_b"]).mean()),
            "MiB_a": g["bytes_live"].mean() / 2**20, "MiB_b": g["bytes_live_b"].mean() / 2**20}


def retention_gates(results: pl.DataFrame, *, seed: int = 0, n_boot: int = 2000) -> tuple[list[ClaimRow], pl.DataFrame]:
    """Claim rows (one per model, gates arm and other arm) and the detail table (one row per
    (model, task, context, protocol, prefill, budget, method, method_b): ``d_em`` in points with
    its whole-context interval, ``em_a`` / ``em_b``, ``d_logprob`` (nats), MiB held by each,
    the full cache's exact match) of the gates' claims; empty where the grid has no
    ``trimkv ... +global`` arm in physical mode."""
    results = C.with_question_columns(results)
    phys = results.filter(pl.col("mode") == "physical")
    if phys.height == 0:
        return [], pl.DataFrame()
    learned = C.family("scorer") == GATES_SCORER
    arms = (phys.filter(learned & (C.family("allocator") == "global"))
            .select("method", "scorer").unique(maintain_order=True).rows())
    if not arms:
        return [], pl.DataFrame()
    others = phys.filter(~learned)["method"].unique(maintain_order=True).to_list()
    on = ["model", "task", "context", "protocol", "prefill", "budget"]
    claims: list[ClaimRow] = []
    details = []
    for k, (a, scorer) in enumerate(arms):
        equal = (phys.filter((pl.col("scorer") == scorer) & (pl.col("allocator") == "uniform"))["method"]
                 .unique(maintain_order=True).to_list())
        plan = ([(b, "global") for b in equal] + [(b, "gates") for b, _ in arms[k + 1:]]
                + [(b, "other") for b in others] + [("full", "full")])
        for b, kind in plan:
            if kind == "full":
                j = C.paired(results, ["model", "task", "context", "prefill"],
                             (pl.col("method") == a) & (pl.col("mode") == "physical"), pl.col("method") == "full")
            else:
                j = C.paired(phys, on, pl.col("method") == a, pl.col("method") == b)
            if j.height == 0:
                continue
            j = j.with_columns(d=pl.col("exact_match") - pl.col("exact_match_b"),
                               method_b=pl.lit(b), bytes_live_b=pl.col("bytes_live_b").cast(pl.Float64))
            detail = C.detail_table(j, [*on, "method", "method_b"], "d_em", _stats, results, seed, n_boot)
            details.append(detail)
            for (model,), g in j.group_by(["model"], maintain_order=True):
                v, lo, hi = C.pooled_mean(g, "d", f"gates|{model}|{a}|{b}", seed, n_boot)
                d = detail.filter(pl.col("model") == model)
                ours = (f"{C.points_text(v, lo, hi)}; exact match {g['exact_match'].mean():.3f} vs "
                        f"{g['exact_match_b'].mean():.3f}; {_configurations(d)}; per comparison "
                        f"{d['d_em'].min():+.1f} to {d['d_em'].max():+.1f}; {C.full_note(d)}")
                claim, paper = _TEXTS[kind]
                claims.append(ClaimRow(
                    claim_id=f"gates:{a}_vs_{b}", claim=claim.format(a=a, b=b), paper_value=paper,
                    our_value=ours if kind == "full" else f"{ours}; {_direction(lo, hi)}",
                    verdict=C.versus(lo, hi, 0.0, 0.0) if kind == "full" else "no paper value",
                    **C.claim_fields(model, g, d), interval=C.INTERVAL, definitions=GATES_DEFS))
    return claims, pl.concat(details, how="diagonal_relaxed") if details else pl.DataFrame()
