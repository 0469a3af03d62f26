"""The Markdown report of an evaluation grid and its paired comparisons.

Every comparison is printed next to the full cache's own accuracy on the same task and
context length, so a floor is never read as a method effect; where exact match sits at a
floor or a ceiling the answer log-probability and KL columns rank the methods instead.
Results are read at both levels: per answer (paired by (example, question), intervals over
whole contexts) and per configuration, the papers' unit
(:func:`evictlab.eval.compare.configurations`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl

from evictlab.eval.compare import CONFIG_RULE, configurations, context_design, with_question_columns, wtl_table
from evictlab.report.markdown import ci, claims_table, table
from evictlab.stats.bootstrap import bootstrap_mean
from evictlab.stats.claims import weights_for

__all__ = ["FLOOR", "configurations_section", "evaluation_markdown", "full_cache_table", "protocol_bytes_table"]

FLOOR = 0.1
"""A full cache whose exact match is at most this is "at the floor" on that task and length."""


def _ci_column(df: pl.DataFrame, name: str, digits: int) -> pl.Series:
    """Column ``name`` with its interval (``name_lo``, ``name_hi``) as text (:func:`ci`)."""
    return pl.Series(name, [ci(v, lo, hi, digits) for v, lo, hi in zip(df[name], df[f"{name}_lo"], df[f"{name}_hi"])],
                     dtype=pl.Utf8)


def full_cache_table(results: pl.DataFrame, *, seed: int = 0, n_boot: int = 2000) -> pl.DataFrame:
    """Per (model, task, context): the full cache's exact match (95% whole-context bootstrap
    CI: a context brings all its questions), mean answer log-probability, perplexity of the
    answer tokens, and its regime (``floor``: exact match <= :data:`FLOOR`; ``ceiling``:
    every answer right). ``n``: answers; ``contexts``: the contexts they come from."""
    rows = []
    full = with_question_columns(results).filter(pl.col("method") == "full")
    for (model, task, context), g in full.group_by(["model", "task", "context"], maintain_order=True):
        g = g.unique(["example", "question"], keep="first", maintain_order=True)
        scored = g.filter(pl.col("exact_match").is_not_null())
        em = scored["exact_match"].cast(pl.Float64).to_numpy()
        est = bootstrap_mean(em, seed=seed, key=f"full|{model}|{task}|{context}", n_boot=n_boot,
                             clusters=context_design(scored["example"].to_numpy()))
        regime = "n/a" if em.size == 0 else "floor" if est.value <= FLOOR else "ceiling" if est.value == 1 else "open"
        rows.append({"model": model, "task": task, "context": context, "n": g.height,
                     "contexts": g["example"].n_unique(),
                     "exact_match [95% CI]": est.fmt(2) if em.size else "n/a (perplexity)",
                     "answer_logprob": g["answer_logprob"].mean(), "answer_ppl": g["ppl"].mean(), "regime": regime,
                     "context_tokens": g["context_tokens"].mean()})
    return pl.DataFrame(rows)


def protocol_bytes_table(results: pl.DataFrame) -> pl.DataFrame:
    """Per (model, context, budget, mode, protocol, prefill): K/V bytes held after compressions, the
    peak held at any step (what the protocol needs), the peak allocated, the budget's and the
    full cache's bytes (means over examples and methods, MiB)."""
    ev = with_question_columns(results).filter(pl.col("method") != "full")
    if ev.height == 0:
        return pl.DataFrame()
    mib = 2.0**20
    return (ev.group_by(["model", "context", "budget", "mode", "protocol", "prefill"], maintain_order=True)
            .agg((pl.col("bytes_budget").mean() / mib).alias("budget MiB"),
                 (pl.col("bytes_live").mean() / mib).alias("held after compression MiB"),
                 (pl.col("bytes_live_peak").mean() / mib).alias("peak held MiB"),
                 (pl.col("bytes_allocated").mean() / mib).alias("peak allocated MiB"),
                 (pl.col("bytes_full").mean() / mib).alias("full cache MiB"))
            .sort(["model", "context", "budget", "mode", "protocol", "prefill"]))


def _method_means(results: pl.DataFrame) -> pl.DataFrame:
    ev = with_question_columns(results).filter(pl.col("method") != "full")
    return (ev.group_by(["model", "task", "context", "protocol", "prefill", "budget", "method", "mode"],
                        maintain_order=True)
            .agg(pl.len().alias("n"), pl.col("example").n_unique().alias("contexts"), pl.col("exact_match").mean(), pl.col("answer_logprob").mean(),
                 pl.col("kl").mean(), pl.col("top1_agreement").mean(), pl.col("ppl").mean(),
                 (pl.col("bytes_live").mean() / 2**20).alias("held MiB")))


def _verdicts(pairs: pl.DataFrame, kind: str) -> pl.DataFrame:
    p = pairs.filter(pl.col("kind") == kind)
    if p.height == 0:
        return p
    return (p.group_by(["a_method", "a_mode", "b_method", "b_mode", "protocol", "prefill"], maintain_order=True)
            .agg(pl.len().alias("comparisons"), (pl.col("verdict") == "win").sum().alias("wins"),
                 (pl.col("verdict") == "tie").sum().alias("ties"), (pl.col("verdict") == "loss").sum().alias("losses"),
                 pl.col("wins").sum().alias("answer wins"), pl.col("ties").sum().alias("answer ties"),
                 pl.col("losses").sum().alias("answer losses"), pl.col("n").sum().alias("answers"),
                 pl.col("contexts").sum().alias("contexts")))


def configurations_section(pairs: pl.DataFrame) -> list[str]:
    """The report's lines on the papers' unit: wins / ties / losses over configurations per
    comparison family (:func:`evictlab.eval.compare.configurations`), with the rule."""
    if pairs.height == 0:
        return []
    c = configurations(pairs)
    if c.height == 0:
        return []
    return ["## Configurations: the papers' unit", "",
            f"One comparison per configuration, as the papers count them (\"93 wins / 22 ties / 22 losses over 160 "
            f"comparisons\"). Rule: {CONFIG_RULE}. Two allocators under the same scorer read `+allocator` and are "
            "pooled over scorers (listed); configurations without exact match (`unscored`) are not counted. The "
            "per-answer reading (paired, whole-context intervals) is in the sections below.", "",
            table(c.drop("rule")), ""]


def glance_table(summary: pl.DataFrame) -> pl.DataFrame:
    """:func:`evictlab.eval.claims.contour.contour_summary` as printed: counts, shares and
    differences with their intervals in one column each."""
    return summary.select(
        "variant", "baseline", "split",
        pl.format("{} / {} / {}", "wins", "ties", "losses").alias("W / T / L"),
        pl.format("{} / {}", "clear_wins", "clear_losses").alias("clear W / L"),
        pl.struct("share_won", "share_lo", "share_hi").map_elements(
            lambda r: ci(r["share_won"], r["share_lo"], r["share_hi"], 2), return_dtype=pl.Utf8).alias("share won"),
        pl.struct("d_em", "d_em_lo", "d_em_hi").map_elements(
            lambda r: ci(r["d_em"], r["d_em_lo"], r["d_em_hi"], 1, signed=True), return_dtype=pl.Utf8)
        .alias("EM diff (points)"),
        pl.col("d_logprob").round(3).alias("log-prob diff"), "answers")


def evaluation_markdown(results: pl.DataFrame, pairs: pl.DataFrame, *, rule: str, claims: Sequence[Any] = (),
                        enforcement: pl.DataFrame | None = None, margin: pl.DataFrame | None = None,
                        contour: pl.DataFrame | None = None, contour_glance: pl.DataFrame | None = None,
                        gates: pl.DataFrame | None = None,
                        figures: Sequence[tuple[str, str]] = (), config: dict[str, Any] | None = None,
                        skipped: Sequence[dict[str, str]] = (), floors: Sequence[Sequence[Any]] = (),
                        seed: int = 0, n_boot: int = 2000, note: str | None = None) -> str:
    """The grid's report (Markdown). ``figures``: ``(relative path, caption)``; ``floors``:
    the ``(model, task, context, reason)`` cells a ``suite`` grid left out; ``note``: a line
    set in bold under the title (a partial grid's, :class:`evictlab.eval.grid.PartialResults`);
    ``contour_glance``: :func:`evictlab.eval.claims.contour.contour_summary`; ``gates``: the
    detail of :func:`evictlab.eval.claims.gates.retention_gates`."""
    models = list(dict.fromkeys(results["model"].to_list()))
    ev = results.filter(pl.col("method") != "full")
    lines = [
        "# Evaluation grid: paired comparisons at matched bytes",
        "",
        *([f"**{note}.**", ""] if note else []),
        "Models: " + "; ".join(f"{m} ({weights_for(m, 'weights as loaded')})" for m in models) + ".",
        "",
        "**Protocols.** `query-agnostic`: the context is compressed before the question is appended (prefill "
        "`one-pass`: once after the whole context, every arm starting from one shared prefill; `chunked`: after "
        "every chunk, per arm), so no ranking that evicts context sees it. `query-aware` (labelled option): nothing is "
        "compressed before the question (all but its last token) is fed; one compression then fixes the kept "
        "set with the question in view, and the last question token goes through the compressed cache. It holds "
        "the whole context until then: see the peak bytes below.",
        "",
        "**Modes.** `physical`: the allocator's ragged per-cell sizes in the paged store that frees evicted "
        "entries (bytes = the budget). `uniform`: the same scorer with equal per-cell sizes, same store (a fixed "
        "selection forced to a real budget). `masked`: the allocator's ragged sizes held in a masked store, the "
        "audit of others: the full cache stays in memory and no masked entry is counted as freed.",
        "",
        "**Metrics** (teacher-forced over the answer tokens, per example): `exact_match` = greedy decoding "
        "reproduces the answer tokens; `answer_logprob` = sum of log p(answer token), nats; `kl` = mean "
        "next-token KL(full || compressed), nats; `top1_agreement`; `ppl` = exp(mean answer NLL) (the held-out "
        "Shakespeare perplexity on `heldout_ppl`). Budgets count *kept* entries summed over cells "
        "(cell = layer x KV head), as given (`/cell`, `total`, `B`).",
        "",
        f"**Tie rule.** {rule}. Answers are paired by (example, question); intervals: 95% percentile "
        "bootstrap over whole contexts (a context is drawn with all its questions; its answers are never "
        "resampled separately). `n` counts paired answers, `contexts` the contexts they come from.",
        "",
    ]
    if config:
        lines += ["```", *(f"{k}: {v}" for k, v in config.items()), "```", ""]
    if skipped:
        lines += ["Not run (not meaningful):", "",
                  table(pl.DataFrame(list(skipped)).unique(["method", "mode", "protocol", "reason"],
                                                           maintain_order=True).select("method", "mode", "protocol",
                                                                                       "reason")), ""]
    if floors:
        lines += ["Not run (the suite's floor cells: the full cache cannot do them, so no method can lose there; "
                  "measured by benchmarks/task_floor.py, shipped in data/task_floor):", "",
                  table(pl.DataFrame([{"model": m, "task": t, "context": int(c), "reason": r}
                                      for m, t, c, r in floors])), ""]
    fc = full_cache_table(results, seed=seed, n_boot=n_boot)
    lines += ["## The full cache (read every comparison against it)", "",
              "A `floor` row means the model does not solve the task at that length even with the full cache: "
              "differences in exact match there are not method effects; use `answer_logprob` and `kl`.", "",
              table(fc, digits=3), ""]
    if ev.height:
        lines += ["## Bytes each protocol and mode needs", "",
                  "`held after compression` = the budget in physical/uniform mode and the full cache in masked mode; "
                  "`peak held` = the most K/V bytes held at any step (query-agnostic chunked: budget + one chunk; "
                  "one-pass: the whole context before its compression; query-aware: the whole context and question "
                  "before its compression).", "",
                  table(protocol_bytes_table(results), digits=3), ""]
    if claims:
        lines += ["## The papers' claims, our numbers beside theirs", "", claims_table(claims), ""]
    if enforcement is not None and enforcement.height:
        lines += ["### Enforcement cost per comparison (points = 100 x exact-match difference)", "",
                  table(enforcement, digits=2), ""]
    if margin is not None and margin.height:
        lines += ["### Query-aware margin per comparison (points)", "", table(margin, digits=2), ""]
    if contour_glance is not None and contour_glance.height:
        lines += ["### ContourKV at a glance: each variant against each allocator, pooled and by scorer", "",
                  "Comparisons (one per model, task, context, budget and scorer) won / tied / lost by the rule above; "
                  "*clear*: the verdict holds in at least 97.5% of prompt resamples; share won and the mean "
                  "exact-match difference per answer (points, ContourKV minus baseline) with 95% percentile "
                  "bootstrap intervals resampling prompts; log-prob difference in nats.", "",
                  table(glance_table(contour_glance)), ""]
    if contour is not None and contour.height:
        lines += ["### ContourKV against the other allocators, same scorer, matched bytes (physical)", "",
                  "One row per comparison, from ContourKV's side: answer wins / ties / losses under the tie rule, "
                  "the comparison's verdict (more answer wins than losses), and the bytes each arm held (MiB; "
                  "`MiB_baseline_masked`: the baseline held masked, where the grid ran it); `p_win` / `p_loss`: "
                  "the share of prompt resamples in which the comparison is won / lost, and `clear` the verdict "
                  "where that share reaches 97.5% (else undecided).", "",
                  table(contour, digits=3), ""]
    if gates is not None and gates.height:
        lines += ["### Learned retention gates (`trimkv ... +global`) against each other arm, per comparison", "",
                  "Points = 100 x exact-match difference per answer (the gates' arm minus `method_b`), 95% percentile "
                  "bootstrap over whole contexts; `d_logprob` in nats; MiB held by each arm (physical: equal).", "",
                  table(gates, digits=3), ""]
    lines += configurations_section(pairs)
    if ev.height:
        lines += ["## Methods (means over answers)", "", table(_method_means(results), digits=3), ""]
    for kind, title in (("method", "Method pairs (same mode, same budget)"),
                        ("mode", "Mode pairs (same method, same budget): the enforcement cost"),
                        ("full", "Against the full cache")):
        p = pairs.filter(pl.col("kind") == kind) if pairs.height else pairs
        if p.height == 0:
            continue
        lines += [f"## {title}", "", "Per comparison group (model, task, context, protocol, prefill, budget), "
                  "verdicts under the tie rule; answer counts beside them:", "", table(_verdicts(pairs, kind)), ""]
        if kind != "full":
            lines += ["Wins/ties/losses over answers (arm A's side), tasks x budgets; the full cache's exact match "
                      "per task and length is printed above each table:", ""]
            wide = wtl_table(pairs, kind)
            for (model, context), g in wide.group_by(["model", "context"], maintain_order=True):
                f = fc.filter((pl.col("model") == model) & (pl.col("context") == context))
                floor = ", ".join(f"{r['task']} {r['exact_match [95% CI]']} ({r['regime']})" for r in f.to_dicts())
                lines += [f"**{model}, {context} tokens.** Full cache exact match: {floor}.", "",
                          table(g.drop("model", "context")), ""]
        flat = p.filter(pl.col("regime").is_in(["floor", "ceiling"]))
        if flat.height:
            lines += [f"At a floor or ceiling of exact match ({flat.height} comparisons), ranked by answer "
                      "log-probability and KL (differences A - B, 95% CI):", "",
                      table(flat.select("model", "task", "context", "protocol", "budget", "a_method", "a_mode",
                                        "b_method", "b_mode", "regime", "full_em",
                                        _ci_column(flat, "d_logprob", 3), _ci_column(flat, "d_kl", 4), "verdict")), ""]
    if figures:
        lines += ["## Figures", ""]
        for path, caption in figures:
            lines += [f"![{path}]({path})", "", f"*{caption}*", ""]
    return "\n".join(lines)
