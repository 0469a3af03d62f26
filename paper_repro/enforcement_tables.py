"""The enforcement cost of a finished grid, as docs/evaluation.md prints it.

`evictlab eval compare` writes the claim rows (one per model and method, pooled over tasks,
contexts and budgets) and the detail per (task, context, budget). This script adds the two
views a reader of the claim asks for next, from the same paired answers
(:func:`evictlab.eval.claims.enforcement.enforcement_pairs`) and the same whole-context
bootstrap (:func:`evictlab.eval.claims.common.pooled_mean`; the pooled rows use the claim
rows' resampling keys, so their intervals are the report's):

* per (model, method): points lost (masked - uniform) with its interval, the range over
  comparisons, exact match of the three stores over the paired answers, physical - masked,
  the MiB each store held beside the full cache's, the comparisons (one per task, context
  and budget: ``pairs.parquet``'s verdicts under the report's per-answer tie rule) won / tied /
  lost by masked against uniform and by physical against masked, and how far the interval
  lies from the paper's 14.1-62.2 points;
* points lost per budget, per (model, method), each with its interval.

    python paper_repro/enforcement_tables.py data/grids/enforcement_cost
    python paper_repro/enforcement_tables.py data/grids/enforcement_cost --out runs/enforcement_tables.md
    python paper_repro/enforcement_tables.py runs/experiments/enforcement_cost --partial   # part-way
"""

from __future__ import annotations


import polars as pl

from _grid import tables_main

from evictlab.errors import InputError
from evictlab.eval.claims.common import pooled_mean
from evictlab.eval.claims.enforcement import ENFORCEMENT_PAPER, enforcement_pairs, pooled_key
from evictlab.report.markdown import ci


def _against_paper(lo: float, hi: float) -> str:
    p_lo, p_hi = ENFORCEMENT_PAPER
    if hi < p_lo:
        return f"below, by at least {p_lo - hi:.1f} points"
    if lo > p_hi:
        return f"above, by at least {lo - p_hi:.1f} points"
    return "overlaps"


def _wtl(pairs: pl.DataFrame, model: str, method: str, a_mode: str, b_mode: str) -> str:
    p = pairs.filter((pl.col("kind") == "mode") & (pl.col("model") == model) & (pl.col("a_method") == method)
                     & (pl.col("b_method") == method) & (pl.col("a_mode") == a_mode) & (pl.col("b_mode") == b_mode))
    v = p["verdict"]
    return f"{(v == 'win').sum()} / {(v == 'tie').sum()} / {(v == 'loss').sum()}"


def tables(results: pl.DataFrame, pairs: pl.DataFrame, *, seed: int = 0, n_boot: int = 2000) -> str:
    """The two markdown tables (per model and method; per budget); ``pairs`` is the grid's
    ``eval compare`` table (its ``mode`` rows give the configuration counts)."""
    j = enforcement_pairs(results)
    if j.height == 0:
        raise InputError("grid", "no ragged method has both a masked and a uniform arm here",
                         "compare a grid with --store masked,uniform (e.g. experiments/enforcement_cost.toml)")
    mib = 2.0**20
    out = ["| model | protocol | method | points lost, masked - uniform [95% CI] | per comparison | exact match "
           "masked / uniform / physical | physical - masked (points) | held masked / uniform / physical (full), MiB "
           "| comparisons masked vs uniform W / T / L | physical vs masked W / T / L | paper's "
           f"{ENFORCEMENT_PAPER[0]}-{ENFORCEMENT_PAPER[1]} |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_budget: list[tuple[str, str, str, dict[str, str]]] = []
    budgets = sorted(j["budget"].unique().to_list(), key=lambda b: (len(b), b))
    for (model, protocol, method), g in j.group_by(["model", "protocol", "method"], maintain_order=True):
        v, lo, hi = pooled_mean(g, "d", pooled_key(model, method, protocol), seed, n_boot)
        per = (g.group_by(["task", "context", "budget"]).agg(pl.col("d").mean() * 100.0)["d"])
        dp = g["d_phys"].drop_nulls()
        phys = "not run" if dp.len() == 0 else f"{dp.mean() * 100.0:+.1f}"
        em_p = g["em_physical"].drop_nulls()
        em_phys = f"{em_p.mean():.3f}" if em_p.len() else "not run"
        b_p = g["bytes_physical"].drop_nulls()
        mib_phys = f"{b_p.mean() / mib:.2f}" if b_p.len() else "not run"
        out.append(
            f"| {model} | {protocol} | `{method}` | {ci(v, lo, hi, 1, signed=True)} | {per.min():+.1f} to {per.max():+.1f} "
            f"| {g['exact_match'].mean():.3f} / {g['exact_match_b'].mean():.3f} / {em_phys} | {phys} "
            f"| {g['bytes_live'].mean() / mib:.2f} / {g['bytes_live_b'].mean() / mib:.2f} / {mib_phys} "
            f"({g['bytes_full'].mean() / mib:.2f}) | {_wtl(pairs, model, method, 'masked', 'uniform')} "
            f"| {_wtl(pairs, model, method, 'physical', 'masked')} | {_against_paper(lo, hi)} |")
        cells = {}
        for b in budgets:
            gb = g.filter(pl.col("budget") == b)
            cells[b] = "-" if gb.height == 0 else ci(*pooled_mean(gb, "d", f"{pooled_key(model, method, protocol)}|{b}", seed, n_boot),
                                                      1, signed=True)
        by_budget.append((model, protocol, method, cells))
    out += ["", "Points lost (masked - uniform) per budget, 95% bootstrap over whole contexts:", "",
            "| model | protocol | method | " + " | ".join(budgets) + " |",
            "|---|---|---|" + "---|" * len(budgets)]
    out += [f"| {m} | {p} | `{me}` | " + " | ".join(c[b] for b in budgets) + " |" for m, p, me, c in by_budget]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return tables_main(argv, __doc__, tables, pairs=True,
                       out_example="runs/enforcement_tables.md")


if __name__ == "__main__":
    from _common import entry

    entry(main)
