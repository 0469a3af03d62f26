"""The enforcement cost claim ("Trust the Mass"): forcing a real budget on one fixed per-head
selection costs 14.1-62.2 points on LongBench/RULER. Here: a method whose allocator gives
ragged per-head sizes (``+adakv``, ``+pyramidkv``, ``+global``: kvpress's KVzipPress ranks
KVzip scores over all layers and heads at once, ``kvzip+global`` here), held ``masked`` (the full cache
stays in memory) vs forced ``uniform`` (equal per-cell sizes, the same bytes as the
budget) vs ``physical`` (the same ragged sizes in a store that frees the rest, the same
bytes as the budget). Points lost = 100 x (exact match masked - exact match uniform);
physical - masked is the check that a ragged store gives the masked accuracy at the
budget's bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from evictlab.eval.claims import common as C
from evictlab.stats.claims import ClaimRow

ENFORCEMENT_PAPER = (14.1, 62.2)
"""Points lost by forcing a real budget on a fixed selection (LongBench/RULER), the paper's range."""


def _pm_text(detail: pl.DataFrame) -> str:
    pm = detail["physical_minus_masked"].cast(pl.Float64).drop_nulls()
    return "not run" if pm.len() == 0 else f"{float(pm.mean()):+.1f} points"


def _mib(v: float | None) -> float | None:
    return None if v is None else v / 2**20


def _mib_text(v: float | None) -> str:
    return "not run" if v is None or not np.isfinite(v) else f"{v:.2f} MiB"


ON = ["model", "task", "context", "protocol", "prefill", "budget", "method"]
"""Columns of one enforcement comparison (the answers of each are paired by ``PAIR_ON``)."""


def enforcement_pairs(results: pl.DataFrame) -> pl.DataFrame:
    """The answers of every ragged method's masked arm paired with its uniform arm (and its
    physical arm, left-joined), one row per (comparison, example, question): ``exact_match`` /
    ``exact_match_b`` (masked / uniform), ``em_physical``, the bytes each held, ``d`` = masked -
    uniform and ``d_phys`` = physical - masked (exact match, 0-1). Empty when nothing pairs."""
    results = C.with_question_columns(results)
    ragged = C.family("allocator") != "uniform"
    j = C.paired(results.filter(pl.col("method") != "full"), ON,
                (pl.col("mode") == "masked") & ragged, pl.col("mode") == "uniform")
    if j.height == 0:
        return j
    phys = results.filter((pl.col("mode") == "physical") & ragged).select(
        [*ON, *C.PAIR_ON, pl.col("exact_match").alias("em_physical"), pl.col("bytes_live").alias("bytes_physical")])
    return j.join(phys, on=[*ON, *C.PAIR_ON], how="left").with_columns(
        d=pl.col("exact_match") - pl.col("exact_match_b"),
        d_phys=pl.col("em_physical") - pl.col("exact_match"),
    ).filter(pl.col("d").is_not_null())


def pooled_key(model: str, method: str, protocol: str) -> str:
    """The resampling key of one (model, method, protocol) claim row: the same key gives the same interval."""
    return f"enforcement|{model}|{method}|{protocol}"


def enforcement_cost(results: pl.DataFrame, *, seed: int = 0, n_boot: int = 2000
                     ) -> tuple[list[ClaimRow], pl.DataFrame]:
    """Claim rows (one per model, per-head method and protocol) and the detail table (one
    row per (model, method, protocol, prefill, task, context, budget)) of the enforcement cost;
    answers paired by (example, question) (:func:`enforcement_pairs`)."""
    on = ON
    j = enforcement_pairs(results)
    if j.height == 0:
        return [], pl.DataFrame()
    results = C.with_question_columns(results)

    def stats(g: pl.DataFrame) -> dict[str, Any]:
        dp = g["d_phys"].drop_nulls().to_numpy()
        return {
            "em_masked": g["exact_match"].mean(), "em_uniform": g["exact_match_b"].mean(),
            "em_physical": g["em_physical"].mean(),
            "physical_minus_masked": float(dp.mean() * 100.0) if dp.size else None,
            "MiB_masked": g["bytes_live"].mean() / 2**20, "MiB_uniform": g["bytes_live_b"].mean() / 2**20,
            "MiB_physical": _mib(g["bytes_physical"].mean()), "MiB_budget": g["bytes_budget"].mean() / 2**20,
            "MiB_full": g["bytes_full"].mean() / 2**20,
            "d_logprob": float((g["answer_logprob"] - g["answer_logprob_b"]).mean()),
        }

    detail = C.detail_table(j, on, "points_lost", stats, results, seed, n_boot)
    claims: list[ClaimRow] = []
    for (model, method, protocol), g in j.group_by(["model", "method", "protocol"], maintain_order=True):
        v, lo, hi = C.pooled_mean(g, "d", pooled_key(model, method, protocol), seed, n_boot)
        d = detail.filter((pl.col("model") == model) & (pl.col("method") == method) & (pl.col("protocol") == protocol))
        rng = f"{d['points_lost'].min():+.1f} to {d['points_lost'].max():+.1f}"
        bytes_note = (f"held: masked {d['MiB_masked'].mean():.2f} MiB, uniform {d['MiB_uniform'].mean():.2f} MiB, "
                      f"physical {_mib_text(d['MiB_physical'].mean())} (full {d['MiB_full'].mean():.2f} MiB)")
        claims.append(ClaimRow(
            claim_id=f"enforcement_cost:{method}:{protocol}",
            claim=f"forcing a real (uniform) budget on {method}'s per-head selection costs points "
                  f"(masked vs uniform at the same nominal budget; {protocol})",
            paper_value=f"{ENFORCEMENT_PAPER[0]}-{ENFORCEMENT_PAPER[1]} points (LongBench/RULER)",
            our_value=f"{C.points_text(v, lo, hi)}; per comparison {rng}; physical - masked {_pm_text(d)}; "
                      f"{bytes_note}; {C.full_note(d)}",
            verdict=C.versus(lo, hi, *ENFORCEMENT_PAPER),
            **C.claim_fields(model, g, d),
            interval=C.INTERVAL,
            definitions="exact match = greedy reproduces the answer (teacher-forced argmax); points = 100 x mean "
                        "difference; 95% bootstrap CI over whole contexts (ours)",
        ))
    return claims, detail
