"""The full cache's accuracy per (model, task, context): which cells of the task suite can
discriminate, and which are floors (docs/evaluation.md, "The task suite").

For every (model, task, context) cell, ``--n`` seeded contexts (``eval_examples``: the
grid's own examples, seed ``--seed``), each prefilled once with the stock cache
(``decode.shared.SharedContext.prefill``, no eviction) and asked every one of its questions
from that cache (``answer_full``: teacher forcing; exact match = every answer token is the
argmax, the grid's ``exact_match``). One row per (context, question) goes to ``rows.parquet``;
per cell the accuracy over its questions with a 95% prompt-clustered bootstrap interval
(``stats.bootstrap``: contexts drawn with replacement, each with all its questions;
``--n-boot`` resamples) goes to ``floor.parquet`` and ``floor.md``, labelled ``kept``
(accuracy >= ``tasks.suite.KEEP_ACCURACY``) or ``floor`` (``tasks.suite.label_floors``), with
a run record beside the table. No timing is reported (run it on an idle machine anyway: one
process per core). Resumable: every finished cell is kept as a checksummed part in
``OUT/parts``; rerun the same command after a kill or Ctrl-C (exit 130) and only the missing
cells are computed.

The probe (a few contexts) and the full size:

    nice -n 10 .venv/bin/python benchmarks/task_floor.py --n 4 --contexts 1024 --threads 1 --out runs/floor-probe
    .venv/bin/python benchmarks/task_floor.py --models smollm2-135m,gemma3-270m --contexts 1024,2048,4096 \\
        --n 50 --n-at 4096:20 --threads 1 --out runs/task-floor

``--tasks`` defaults to ``tasks.suite.SUITE_TASKS``; ``--tasks all`` runs every synthetic task.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import polars as pl

from evictlab.errors import InputError

ROW_SCHEMA = {"model": pl.Utf8, "task": pl.Utf8, "context": pl.Int64, "example": pl.Int64, "example_seed": pl.Int64,
              "question": pl.Int64, "context_tokens": pl.Int64, "question_tokens": pl.Int64,
              "answer_tokens": pl.Int64, "exact_match": pl.Float64, "first_token": pl.Float64,
              "answer_logprob": pl.Float64}


def _parse_n_at(items: list[str]) -> dict[int, int]:
    out = {}
    for item in items:
        ctx, sep, n = item.partition(":")
        try:
            if not sep:
                raise ValueError
            out[int(ctx)] = int(n)
        except ValueError:
            raise InputError("--n-at", f"{item!r} is not CONTEXT:N", "e.g. --n-at 4096:20") from None
        if out[int(ctx)] < 1:
            raise InputError("--n-at", f"{item!r} asks for no contexts", "use N >= 1")
    return out


def cell_rows(model: object, tokenizer: object, name: str, task: str, context: int, n: int, seed: int,
              questions: int | None) -> list[dict[str, object]]:
    """One row per (context, question) of one cell (module docstring)."""
    import torch

    from evictlab.decode.metrics import token_nll
    from evictlab.decode.shared import QA, SharedContext, answer_full
    from evictlab.tasks.examples import eval_examples

    rows = []
    dev = next(model.parameters()).device  # type: ignore[attr-defined]
    for ex in eval_examples(task, n, context, tokenizer, seed, questions=questions):
        ctx = SharedContext.prefill(model, torch.tensor([ex.context_ids], dtype=torch.long, device=dev))
        qs = ex.questions
        outs = answer_full(ctx, [QA(tuple(q.question_ids), tuple(q.answer_ids)) for q in qs])
        for j, (q, out) in enumerate(zip(qs, outs)):
            logits, answer = out.logits[0].float().cpu(), torch.tensor(q.answer_ids)
            hit = logits.argmax(-1) == answer
            rows.append({"model": name, "task": task, "context": context, "example": ex.index,
                         "example_seed": ex.seed, "question": j, "context_tokens": len(ex.context_ids),
                         "question_tokens": len(q.question_ids), "answer_tokens": len(q.answer_ids),
                         "exact_match": float(bool(hit.all())), "first_token": float(bool(hit[0])),
                         "answer_logprob": -float(token_nll(logits, answer).sum())})
    return rows


def floor_table(rows: pl.DataFrame, *, seed: int, n_boot: int) -> pl.DataFrame:
    """Per (model, task, context) of ``rows``: contexts, answers, accuracy (exact match) and
    first-token accuracy with 95% prompt-clustered bootstrap intervals, and the suite's
    label (``tasks.suite.label_floors``)."""
    from evictlab.stats.bootstrap import Design, bootstrap_mean
    from evictlab.tasks.suite import label_floors

    out = []
    for (model, task, context), g in rows.group_by(["model", "task", "context"], maintain_order=True):
        design = Design.whole_clusters(g["example"].to_numpy(), name="context")
        key = f"{model}/{task}/{context}"
        em = bootstrap_mean(g["exact_match"].to_numpy(), seed=seed, key=key, n_boot=n_boot, clusters=design)
        ft = bootstrap_mean(g["first_token"].to_numpy(), seed=seed, key=key, n_boot=n_boot, clusters=design)
        out.append({"model": model, "task": task, "context": int(context), "contexts": g["example"].n_unique(),
                    "answers": g.height, "accuracy": em.value, "lo": em.lo, "hi": em.hi,
                    "first_token": ft.value, "first_token_lo": ft.lo, "first_token_hi": ft.hi,
                    "answer_logprob": float(np.mean(g["answer_logprob"].to_numpy())), "interval": em.method})
    order = {t: i for i, t in enumerate(dict.fromkeys(rows["task"].to_list()))}
    out.sort(key=lambda r: (r["model"], order[r["task"]], r["context"]))
    return label_floors(pl.DataFrame(out))


def markdown(table: pl.DataFrame) -> str:
    """The table as Markdown: one row per cell, accuracy with its interval, the label."""
    from evictlab.report.markdown import ci, table as md_table

    rows = [{"model": r["model"], "task": f"`{r['task']}`", "context": r["context"],
             "contexts x questions": f"{r['contexts']} ({r['answers']} answers)",
             "accuracy [95% CI]": ci(r["accuracy"], r["lo"], r["hi"], 2),
             "first token [95% CI]": ci(r["first_token"], r["first_token_lo"], r["first_token_hi"], 2),
             "label": r["label"]} for r in table.to_dicts()]
    return md_table(rows)


def main(argv: list[str] | None = None) -> int:
    from evictlab.cliutil import parse_ints, parse_list
    from evictlab.tasks.suite import KEEP_ACCURACY, SUITE_CONTEXTS, SUITE_MODELS, SUITE_TASKS
    from evictlab.tasks.synthetic import TASKS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SUITE_MODELS))
    p.add_argument("--tasks", default=",".join(SUITE_TASKS), help="comma-separated, or 'all' (every synthetic task)")
    p.add_argument("--contexts", default=",".join(map(str, SUITE_CONTEXTS)))
    p.add_argument("--n", type=int, default=50, help="contexts per cell")
    p.add_argument("--n-at", action="append", default=[], metavar="CONTEXT:N", help="contexts per cell at CONTEXT")
    p.add_argument("--questions", type=int, default=None, help="questions per context (default: each task's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-boot", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True, help="folder for rows.parquet, floor.parquet, floor.md")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        models = parse_list(args.models, "--models")
        tasks = list(TASKS) if args.tasks == "all" else parse_list(args.tasks, "--tasks")
        bad = [t for t in tasks if t not in TASKS]
        if bad:
            raise InputError("--tasks", f"unknown task(s) {bad}", f"use some of: {', '.join(TASKS)}")
        contexts = parse_ints(args.contexts, "--contexts")
        n_at = _parse_n_at(args.n_at)
        if args.n < 1:
            raise InputError("--n", f"{args.n} contexts", "use --n 1 or more")
        if not args.out.parent.is_dir():
            raise InputError("--out", f"{args.out.parent} is not a folder", "create the parent folder first")
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run(models, tasks, contexts, args.n, n_at, args.questions, args.seed, args.n_boot, args.threads,
               args.out, args.quiet, KEEP_ACCURACY, vars(args))


def cells(models: list[str], tasks: list[str], contexts: list[int], n: int,
          n_at: dict[int, int]) -> list[tuple[str, str, int, int]]:
    """Every ``(model, task, context, contexts asked)`` cell, in the order computed: context
    before task, so that an interrupted run has whole short-context columns done (the long
    contexts cost the most); the tables sort by model, task, context."""
    return [(m, t, c, n_at.get(c, n)) for m in models for c in contexts for t in tasks]


def run(models: list[str], tasks: list[str], contexts: list[int], n: int, n_at: dict[int, int],
        questions: int | None, seed: int, n_boot: int, threads: int, out: Path, quiet: bool, keep: float,
        config: dict[str, object]) -> int:
    """Every cell, then the tables (module docstring). Resumable: each finished cell is a
    checksummed part in ``OUT/parts`` (``evictlab.parts.PartStore``); a rerun of the same
    command verifies them and computes only the missing cells (another command's parts are
    refused in one line), and the tables and run record are written once every cell is
    there. A second run on the same ``--out`` is refused at once (the lock)."""
    from evictlab.cli import INTERRUPTED_LINE
    from evictlab.io import write_checked_parquet
    from evictlab.parts import PartStore
    from evictlab.record import RunRecord, record_path
    from evictlab.report.markdown import write

    todo = cells(models, tasks, contexts, n, n_at)
    keys = [f"cell-{i:04d}" for i in range(len(todo))]
    job = {"kind": "bench.task_floor", "cells": [list(c) for c in todo], "questions": questions, "seed": seed}
    out.mkdir(exist_ok=True)
    store = PartStore(out / "parts", job, keys, field="--out", manifest=out / "job.json")
    try:
        with store.lock(out / "rows.parquet"):
            if store.finished(out / "rows.parquet") and store.resume():  # another job's: refused
                if not quiet:
                    print(f"{out} already holds this run, complete; nothing to do", flush=True)
                return 0
            store.open()
            record = RunRecord(kind="bench.task_floor", seed=seed, config={k: str(v) for k, v in config.items()})
            _compute(store, dict(zip(keys, todo)), questions, seed, threads, quiet)
            frame = store.collect(empty=pl.DataFrame(schema=ROW_SCHEMA))
            table = floor_table(frame, seed=seed, n_boot=n_boot)
            write_checked_parquet(frame, out / "rows.parquet")
            write_checked_parquet(table, out / "floor.parquet")
            write(out / "floor.md", [f"# The full cache's accuracy per cell (kept at >= {keep})", markdown(table)])
            record.write(record_path(out, folder=True), outputs=[str(out / f) for f in ("rows.parquet", "floor.parquet",
                                                                                        "floor.md")])
            store.remove()
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(INTERRUPTED_LINE, file=sys.stderr)
        return 130
    if not quiet:
        print(markdown(table))
    return 0


def _compute(store: object, units: dict[str, tuple[str, str, int, int]], questions: int | None, seed: int,
             threads: int, quiet: bool) -> None:
    """The cells still missing from ``store``, one model loaded at a time."""
    import torch

    from evictlab.kv.cache import register_ragged_attention
    from evictlab.models.loading import load_cached

    torch.set_num_threads(threads)
    pending = store.pending()  # type: ignore[attr-defined]
    done = len(units) - len(pending)
    if done and not quiet:
        print(f"resuming: {done} of {len(units)} cells already done", flush=True)
    loaded: dict[str, tuple[object, object]] = {}
    for key in pending:
        name, task, context, n = units[key]
        if name not in loaded:
            loaded.clear()  # one model in memory at a time
            loaded[name] = load_cached(name, "cpu", attn_implementation=register_ragged_attention())
        lm, tok = loaded[name]
        got = cell_rows(lm, tok, name, task, context, n, seed, questions)
        store.write(key, pl.DataFrame(got, schema=ROW_SCHEMA))  # type: ignore[attr-defined]
        if not quiet:
            em = np.mean([r["exact_match"] for r in got])
            print(f"{name} {task} {context}: {em:.2f} over {len(got)} answers", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
