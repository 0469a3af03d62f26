"""The query-aware margin of a grid, as docs/evaluation.md prints it.

`evictlab eval compare` writes the claim rows (one per model and method, pooled over tasks,
contexts and budgets) and the detail per (task, context, budget). The pairs table of
`eval compare` pairs arms within one protocol, so it has no aware-vs-agnostic rows; this
script pairs them itself (:func:`evictlab.eval.claims.margin.margin_pairs`, the claim's own
pairing) and prints, with the claim rows' whole-context bootstrap
(:func:`evictlab.eval.claims.common.pooled_mean`; the pooled rows use the claim rows'
resampling keys, so their intervals are the report's):

* per (model, method): the margin (query-aware - query-agnostic, points of exact match) with
  its interval, the range over comparisons, exact match under each protocol and the full
  cache's, the answer log-probability difference, the peak MiB each protocol held (the
  query-aware arm holds the whole context until the question is read) and the MiB held after
  compression, the comparisons (one per task, context and budget: the papers' unit) won /
  tied / lost by the query-aware arm under `eval compare`'s configuration rule (a tie when
  the numbers of correct answers differ by at most one), and how far the interval lies from
  the paper's 87.6 points;
* the margin per budget, per (model, method);
* the margin per task, per (model, method), with the full cache's exact match on that task.

    python paper_repro/margin_tables.py data/grids/query_aware_margin
    python paper_repro/margin_tables.py data/grids/query_aware_margin --out runs/margin_tables.md
    python paper_repro/margin_tables.py runs/experiments/query_aware_margin --partial   # part-way
"""

from __future__ import annotations


import polars as pl

from _grid import tables_main

from evictlab.errors import InputError
from evictlab.eval.claims.common import full_em, pooled_mean
from evictlab.eval.claims.margin import MARGIN_PAPER, margin_pairs, pooled_key
from evictlab.eval.compare import accuracy_verdict
from evictlab.report.markdown import ci

MIB = 2.0**20


def _against_paper(lo: float, hi: float) -> str:
    if hi < MARGIN_PAPER:
        return f"below, by at least {MARGIN_PAPER - hi:.1f} points"
    if lo > MARGIN_PAPER:
        return f"above, by at least {lo - MARGIN_PAPER:.1f} points"
    return "holds it"


def _wtl(g: pl.DataFrame) -> str:
    """Comparisons (task, context, budget) won / tied / lost by the query-aware arm."""
    v = [accuracy_verdict(float(c["exact_match"].sum()), float(c["exact_match_b"].sum()), c.height)
         for _, c in g.group_by(["task", "context", "budget"], maintain_order=True)]
    return f"{v.count('win')} / {v.count('tie')} / {v.count('loss')}"


def _split(j: pl.DataFrame, by: str, values: list[str], name: str, seed: int, n_boot: int
           ) -> list[tuple[str, str, dict[str, str]]]:
    """Per (model, method): the margin with its interval for each value of column ``by``."""
    rows = []
    for (model, method), g in j.group_by(["model", "method"], maintain_order=True):
        cells = {}
        for v in values:
            gv = g.filter(pl.col(by) == v)
            cells[v] = "-" if gv.height == 0 else ci(
                *pooled_mean(gv, "d", f"{pooled_key(model, method)}|{name}|{v}", seed, n_boot), 1, signed=True)
        rows.append((model, method, cells))
    return rows


def tables(results: pl.DataFrame, *, seed: int = 0, n_boot: int = 2000) -> str:
    """The three markdown tables (per model and method; per budget; per task) of the margin."""
    j = margin_pairs(results)
    if j.height == 0:
        raise InputError("grid", "no margin arm (SnapKV, KVzip-style, ExpectedAttention or H2O in the physical "
                         "store, a retrieval task) has both a query-aware and a query-agnostic run here",
                         "pass a grid run with --protocol query-agnostic,query-aware (e.g. "
                         "experiments/query_aware_margin.toml)")
    fem = full_em(results)
    j = j.join(fem, on=["model", "task", "context"], how="left")
    out = ["| model | method | margin, aware - agnostic [95% CI] (points) | per comparison | exact match aware / "
           "agnostic (full cache) | answer log-prob, aware - agnostic (nats) | peak held aware / agnostic, MiB "
           "| held after compression, MiB | comparisons aware vs agnostic W / T / L | paper's "
           f"{MARGIN_PAPER} |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for (model, method), g in j.group_by(["model", "method"], maintain_order=True):
        v, lo, hi = pooled_mean(g, "d", pooled_key(model, method), seed, n_boot)
        per = g.group_by(["task", "context", "budget"]).agg(pl.col("d").mean() * 100.0)["d"]
        full = g["full_em"].drop_nulls()
        full_txt = f"{full.mean():.3f}" if full.len() else "n/a"
        out.append(
            f"| {model} | `{method}` | {ci(v, lo, hi, 1, signed=True)} | {per.min():+.1f} to {per.max():+.1f} "
            f"| {g['exact_match'].mean():.3f} / {g['exact_match_b'].mean():.3f} ({full_txt}) "
            f"| {(g['answer_logprob'] - g['answer_logprob_b']).mean():+.2f} "
            f"| {g['bytes_live_peak'].mean() / MIB:.2f} / {g['bytes_live_peak_b'].mean() / MIB:.2f} "
            f"| {g['bytes_live'].mean() / MIB:.2f} | {_wtl(g)} | {_against_paper(lo, hi)} |")

    budgets = sorted(j["budget"].unique().to_list(), key=lambda b: (len(b), b))
    out += ["", "The margin per budget (points), 95% bootstrap over whole contexts:", "",
            "| model | method | " + " | ".join(budgets) + " |", "|---|---|" + "---|" * len(budgets)]
    out += [f"| {m} | `{me}` | " + " | ".join(c[b] for b in budgets) + " |"
            for m, me, c in _split(j, "budget", budgets, "budget", seed, n_boot)]

    tasks = list(dict.fromkeys(j.sort(["model", "task"])["task"].to_list()))
    task_full = j.group_by(["model", "task"]).agg(pl.col("full_em").mean())
    out += ["", "The margin per task (points; contexts and budgets pooled), 95% bootstrap over whole contexts; "
            "the full cache's exact match on the task beside it:", ""]
    methods = list(dict.fromkeys(j["method"].to_list()))
    out += ["| model | task | full cache | " + " | ".join(f"`{m}`" for m in methods) + " |",
            "|---|---|---|" + "---|" * len(methods)]
    per_task = {(m, me): c for m, me, c in _split(j, "task", tasks, "task", seed, n_boot)}
    for model in dict.fromkeys(j["model"].to_list()):
        for task in tasks:
            f = task_full.filter((pl.col("model") == model) & (pl.col("task") == task))["full_em"]
            if f.len() == 0:
                continue
            fe = "n/a" if f[0] is None else f"{f[0]:.3f}"
            out.append(f"| {model} | {task} | {fe} | "
                       + " | ".join(per_task.get((model, me), {}).get(task, "-") for me in methods) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    return tables_main(argv, __doc__, lambda results, _, **kw: tables(results, **kw), pairs=False,
                       out_example="runs/margin_tables.md")


if __name__ == "__main__":
    from _common import entry

    entry(main)
