"""Diagnosis (issue 24): what ContourKV's allocations plan against what the selection incurs.

For one task, context and budget, every method of ``--methods`` runs on ``--n`` examples
through the audit (``evictlab.decode.audit.run_audit``: teacher-forced, physical store, the
full cache as reference for KL) with a per-compression trace
(:class:`evictlab.decode.trace.CompressionTrace`: one row per compression x layer x KV head).
Per method, over the cells of the ``--phase`` compressions (default prefill):

* ``top-s drop``: the trace's ``dropped_top``, the window rows' mean mass outside each row's
  *own* top-``s`` keys at the cell's kept size ``s``: the per-query profile, what
  ``contourkv_query`` (ContourKV before issue 24) plans with;
* ``incurred drop``: ``dropped_kept``, the mass outside the set the scorer really kept (what
  the scorer-ranked variants plan with: for them planned = incurred, tested in
  tests/test_contour_variants_loop.py);
* ``e(A)``, ``e(T_s)``: the forced error of the kept set and of the own top-``s`` sets;
* ``size diff vs uniform``, ``size diff vs adakv``: mean absolute difference of the cells' kept
  sizes against the uniform arm (the bare scorer) and the AdaKV arm, same example and
  compression;
* ``fact kept``: of the asked fact's entries the cells held, the share they kept (the
  trace's ``fact_kept`` over ``fact_held``, summed over cells and examples); ``cells losing
  fact``: the share of the cells holding some of the fact that dropped at least one of its
  entries; ``fact kept where uniform keeps >= 80%``: the same share in the cells where the
  scorer's uniform arm keeps at least 80% of the fact (the cells that hold the answer; their
  number in ``such cells``, and ``of those, below half``). These say directly whether an
  allocation starved the cells that hold the answer;
* ``KL``, ``EM``: the audit's mean next-token KL to the full cache and exact match.

The figure ``cells.png`` (``evictlab.plots.contour.allocation_cells``) shows per (layer, KV
head) how far each method's sizes move from uniform's and how much of the fact each cell kept.

    .venv/bin/python paper_repro/contour_diagnosis.py --n 3 --context 512 --budget 64 \
        --out runs/contour_diagnosis            # -> diagnosis.md, cells.png, audit.parquet, trace.parquet
    # KVzip-style scores on the needle at 1k tokens, one-pass prefill as the verdict grid runs it:
    .venv/bin/python paper_repro/contour_diagnosis.py --task needle --context 1024 --budget 64 --n 5 \
        --chunk 4096 --methods kvzip,kvzip+adakv,kvzip+contourkv,kvzip+contourkv_mass,kvzip+contourkv_error,kvzip+contourkv_offline \
        --out runs/contour_diagnosis_kvzip

``--trace FILE`` re-tabulates an existing trace (and ``--audit FILE`` its audit table)
without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import polars as pl

DEFAULT_METHODS = ("snapkv,snapkv+adakv,snapkv+contourkv_query,snapkv+contourkv,snapkv+contourkv_mass,"
                   "snapkv+contourkv_error")


def diagnose(trace: pl.DataFrame, phase: str = "prefill") -> pl.DataFrame:
    """One row per method: the drop and error statistics over the ``phase`` cells (module
    docstring), and the kept-size differences against the uniform and AdaKV arms of the same
    scorer when the trace holds them."""
    t = trace.filter(pl.col("phase") == phase)
    key = ["example", "compression", "layer", "kv_head"]
    out = t.group_by("method", maintain_order=True).agg(
        pl.len().alias("cells"),
        pl.col("dropped_top").mean().alias("top-s drop mean"), pl.col("dropped_top").std().alias("top-s drop sd"),
        pl.col("dropped_top").max().alias("top-s drop max"),
        pl.col("dropped_kept").mean().alias("incurred drop mean"),
        pl.col("dropped_kept").std().alias("incurred drop sd"), pl.col("dropped_kept").max().alias("incurred drop max"),
        pl.col("e_kept").mean().alias("e(A) mean"), pl.col("e_top").mean().alias("e(T_s) mean"),
        pl.col("kept").std().alias("sizes sd"),
    )
    if "fact_held" in t.columns and t["fact_held"].drop_nulls().sum() > 0:
        with_fact = t.filter(pl.col("fact_held") > 0)
        facts = with_fact.group_by("method").agg(
            (pl.col("fact_kept").sum() / pl.col("fact_held").sum()).alias("fact kept"),
            (pl.col("fact_kept") < pl.col("fact_held")).mean().alias("cells losing fact"))
        out = out.join(facts, on="method", how="left").join(_reading_cells(t), on="method", how="left")
    for ref_name, suffix in (("uniform", ""), ("adakv", "+adakv")):
        cols = []
        for method in out["method"].to_list():
            scorer = method.split("+")[0]
            ref = t.filter(pl.col("method") == scorer + suffix).select(*key, pl.col("kept").alias("ref"))
            mine = t.filter(pl.col("method") == method).select(*key, "kept")
            j = mine.join(ref, on=key, how="inner")
            cols.append(None if j.height == 0 else float((j["kept"] - j["ref"]).abs().mean()))
        out = out.with_columns(pl.Series(f"size diff vs {ref_name}", cols, dtype=pl.Float64))
    return out


def per_layer(trace: pl.DataFrame, phase: str = "prefill") -> pl.DataFrame:
    """One row per layer, columns per method: the entries its cells held and kept (mean
    over examples, compressions and KV heads), and, where the trace has fact labels, the asked
    facts' entries held and kept (summed): where an allocation moves the budget, and whether
    the answer went with it."""
    t = trace.filter(pl.col("phase") == phase)
    facts = "fact_held" in t.columns and t["fact_held"].drop_nulls().sum() > 0
    aggs = [pl.col("held").mean().alias("held"), pl.col("kept").mean().alias("kept")]
    if facts:
        aggs += [pl.col("fact_held").sum().alias("fact held"), pl.col("fact_kept").sum().alias("fact kept")]
    g = t.group_by("method", "layer", maintain_order=True).agg(aggs)
    # per method even what was held: after the first compression (decode, question) it differs
    return g.pivot(on="method", index="layer", values=[a.meta.output_name() for a in aggs],
                   sort_columns=False).sort("layer")


def _reading_cells(t: pl.DataFrame, hold: float = 0.8) -> pl.DataFrame:
    """Per method, over the (layer, KV head) cells where its scorer's uniform arm keeps at
    least ``hold`` of the fact (pooled over examples: the cells that hold the answer): the
    mean share of the fact the method keeps there, and how many of them keep below half."""
    share = (t.filter(pl.col("fact_held") > 0).group_by("method", "layer", "kv_head")
             .agg((pl.col("fact_kept").sum() / pl.col("fact_held").sum()).alias("f"))
             .with_columns(pl.col("method").str.split("+").list.first().alias("uniform")))
    ref = share.select(pl.col("method").alias("uniform"), "layer", "kv_head", pl.col("f").alias("f_uniform"))
    hot = share.join(ref, on=["uniform", "layer", "kv_head"]).filter(pl.col("f_uniform") >= hold)
    return hot.group_by("method").agg(
        pl.col("f").mean().alias(f"fact kept where uniform keeps >= {hold:.0%}"),
        (pl.col("f") < 0.5).sum().alias("of those, below half"), pl.len().alias("such cells"))


def markdown(table: pl.DataFrame, audit: pl.DataFrame | None) -> str:
    """The diagnosis table as Markdown (3 decimals), with the audit's KL and EM when given."""
    if audit is not None:
        a = audit.filter(pl.col("mode") != "full").select("method", pl.col("kl").alias("KL"),
                                                            pl.col("exact_match").alias("EM"))
        table = table.join(a, on="method", how="left")
    head = "| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns) + "\n"
    def cell(v: object) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    return head + "".join("| " + " | ".join(cell(v) for v in row) + " |\n" for row in table.iter_rows())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="needle_word")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--budget", default="64", help="kept budget text (64 = entries per cell)")
    p.add_argument("--n", type=int, default=3, help="examples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--phase", default="prefill", help="compressions tabulated: prefill, question or decode")
    p.add_argument("--chunk", type=int, default=256,
                   help="context tokens per prefill chunk (a chunk as long as the context: the grid's one-pass prefill)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/contour_diagnosis"))
    p.add_argument("--trace", type=Path, default=None, help="tabulate this trace instead of running")
    p.add_argument("--audit", type=Path, default=None, help="with --trace: its audit table (KL, EM)")
    args = p.parse_args(argv)

    from evictlab.io import atomic_write_text, write_checked_parquet
    from evictlab.record import RunRecord

    record = RunRecord(kind="paper_repro.contour_diagnosis", model=args.model, seed=args.seed,
                       config={k: str(v) for k, v in vars(args).items()})
    from evictlab.errors import InputError
    from evictlab.kv.budget import Budget

    budget = Budget.parse(args.budget)
    if args.trace is None and budget.unit == "tokens_per_cell" and budget.value >= args.context:
        raise InputError("--budget", f"{args.budget} per cell keeps all {args.context} context tokens: nothing "
                         "is evicted, so there is nothing to diagnose", f"use a budget below {args.context}, e.g. 64")
    for opt, path in (("--trace", args.trace), ("--audit", args.audit)):
        if path is not None and not path.is_file():
            p.exit(2, f"error: {opt} {path}: no such file (pass a trace.parquet / audit.parquet this script wrote)\n")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trace is not None:
        trace = pl.read_parquet(args.trace)
        audit = pl.read_parquet(args.audit) if args.audit is not None else None
    else:
        import torch

        from evictlab.decode.audit import audit_configs, run_audit, task_examples
        from evictlab.decode.config import LoopSettings
        from evictlab.decode.trace import CompressionTrace
        from evictlab.kv.cache import register_ragged_attention
        from evictlab.models.loading import load_model

        torch.set_num_threads(args.threads)
        model, tok = load_model(args.model, device="cpu", attn_implementation=register_ragged_attention())
        examples = task_examples(tok, [args.task], args.n, args.context, args.seed)
        loop = LoopSettings(chunk_size=args.chunk)
        configs = audit_configs([m.strip() for m in args.methods.split(",")], [budget],
                                loop=loop, modes=("physical",))
        tracer = CompressionTrace(max_subsets=1)  # ES_hat off: the drops and errors are what is read
        audit = run_audit(model, examples, configs, loop=loop, tokenizer=tok, compression_trace=tracer,
                          progress=lambda m: print(m, file=sys.stderr, flush=True))
        trace = tracer.table()
        if trace.height == 0:
            raise InputError("--budget", f"no compression happened at {args.budget} with {args.context} context "
                             "tokens (the budget holds everything)", "use a smaller --budget or a longer --context")
        write_checked_parquet(trace, args.out / "trace.parquet")
        write_checked_parquet(audit, args.out / "audit.parquet")
    label, provenance = _labels(args, trace)
    text = markdown(diagnose(trace, args.phase), audit)
    text += f"\nPer layer ({args.phase} compressions; held and kept: mean entries per cell; facts: summed):\n\n"
    text += markdown(per_layer(trace, args.phase), None)
    outputs = [str(args.out / "diagnosis.md")]
    uniform = next((m for m in trace["method"].unique(maintain_order=True).to_list() if "+" not in m), None)
    if uniform is not None and "fact_held" in trace.columns:
        from evictlab.plots.contour import allocation_cells

        fig = allocation_cells(trace, args.out / "cells", uniform=uniform, phase=args.phase,
                               title=label)
        outputs.append(str(fig.png))
        text += f"\n![cells]({fig.png.name})\n\n{fig.caption}\n"
    note = f"{label}, n = {trace['example'].n_unique()} examples, {args.phase} compressions; {provenance}\n\n"
    atomic_write_text(args.out / "diagnosis.md", note + text)
    record.write(args.out / "diagnosis.run_record.json", outputs=outputs)
    print(note + text)
    return 0


def _labels(args: argparse.Namespace, trace: pl.DataFrame) -> tuple[str, str]:
    """The run's "model, task at N tokens, budget B" and where it came from. A re-tabulated
    ``--trace`` is labelled by its own run record (``diagnosis.run_record.json`` beside it), else
    by the trace's task and budget columns with the model and context "not recorded": never by
    this invocation's defaults, which describe another run."""
    if args.trace is None:
        load = os.getloadavg()
        return (f"{args.model}, {args.task} at {args.context} tokens, budget {args.budget}",
                f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    rec = args.trace.parent / "diagnosis.run_record.json"
    try:
        cfg = json.loads(rec.read_text())["config"]
        return (f"{cfg['model']}, {cfg['task']} at {cfg['context']} tokens, budget {cfg['budget']}",
                f"re-tabulated from {args.trace} (run record {rec.name})")
    except (OSError, ValueError, KeyError, TypeError):
        tasks = ",".join(map(str, trace["task"].unique(maintain_order=True))) if "task" in trace.columns else "?"
        budgets = (",".join(map(str, trace["budget_value"].unique(maintain_order=True)))
                   if "budget_value" in trace.columns else "?")
        return (f"model not recorded, {tasks} at context not recorded, budget {budgets}",
                f"re-tabulated from {args.trace} (no run record beside it)")


if __name__ == "__main__":
    from _common import entry

    entry(main)
