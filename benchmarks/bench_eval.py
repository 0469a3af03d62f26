"""The evaluation grid's speed: one shared prefill per context against today's per-arm path
(issue 23, item 7; results and commands in docs/performance.md, "The evaluation grid").

Side by side in one run, each grid in a fresh process through ``evictlab eval run`` (the
command itself, in-process after the model is loaded, so the load is outside the clock), on
the same seeded examples (``--task`` at ``--context`` tokens, ``--n`` contexts, seed 0):

- ``full``: the full-cache cell alone (``--methods full``);
- ``one-pass``: a grid of ``--arms`` (10 evicting arms by default) plus the full cache with
  ``--prefill one-pass`` (every context prefilled once, every arm starting from it);
- ``chunked``: the same grid with ``--prefill chunked``: today's per-arm path (every arm
  re-runs the prefill of the same context, compressing after every ``--chunk`` tokens);
- ``kvpress``: the kvpress pipeline on the same examples as outside reference (its own venv,
  ``benchmarks/peer_kvpress.py`` as ``bench_decode.py`` runs it, one process per example and
  press: no press, and SnapKV keeping the same entries per head; every question of a context
  answered from its own copy of the one compressed cache), wall time excluding its model
  load; skipped with ``--no-peer``.

It reports, per run, the wall and CPU seconds, ``examples x arms per minute`` (arms = the
evicting arms plus the full cache; kvpress: its two presses) and the issue's ratios:
``one-pass / full`` (target <= 3x) and ``one-pass throughput / chunked throughput``
(target >= 8x). The 1-minute load average is recorded before and after every run. Output:
the numbers as JSON (``--out``, with a run record) and a Markdown table in the layout of
docs/performance.md (``--out`` with ``.md``), both with the command line.

    .venv/bin/python benchmarks/bench_eval.py --n 3 --context 1024 --out runs/bench/bench_eval.json
    .venv/bin/python benchmarks/bench_eval.py --n 1 --context 128 --arms snapkv,h2o --no-peer   # a check

``--breakdown`` adds one more run: the one-pass grid again under ``cProfile``, split into what
bounds it (the shared prefill, KVzip's reconstruction pass, each scorer's shared scoring,
ContourKV's window statistics, the arms' compressions and teacher-forced answers), as seconds
and shares of the profiled grid (cProfile slows Python-heavy code, so read the shares, not
the seconds, against the unprofiled runs).

``--questions Q`` asks Q questions of every context (the engine's ``--questions``); before
the engine has ``--prefill``, the grids run without it and the output says so (those are
then both the per-arm path). ``--stores`` runs the older benchmark instead: SnapKV + AdaKV
in the three stores (physical, uniform, masked), their per-example wall-time ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ARMS = ("snapkv", "snapkv+adakv", "snapkv+pyramidkv", "snapkv+contourkv", "h2o", "expected_attention", "kvzip",
        "kvzip+adakv", "streaming_llm", "compactor")
"""The 10 evicting arms of the grid (scorer or scorer+allocator)."""
TARGETS = {"one-pass / full": "<= 3", "one-pass / chunked throughput": ">= 8"}


# ------------------------------------------------------------------ child: one grid, one process


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``evictlab eval run`` (the arguments after ``--``) in this process, the model
    loaded first; the wall and CPU time of the command alone."""
    import torch

    torch.set_num_threads(args.threads)
    from evictlab.cli import run as cli_run
    from evictlab.kv.cache import register_ragged_attention
    from evictlab.models.loading import load_cached

    t = time.perf_counter()
    load_cached(args.model, "cpu", attn_implementation=register_ragged_attention())
    load_s = time.perf_counter() - t
    argv = ["eval", "run", *args.eval_args]
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    code = cli_run(argv)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    if code != 0:
        raise SystemExit(f"evictlab {shlex.join(argv)} exited {code}")
    return {"load_s": load_s, "wall_s": wall, "cpu_s": cpu, "argv": argv}


# ------------------------------------------------------------------ parent


def eval_run_options() -> set[str]:
    """The option names ``evictlab eval run`` declares (e.g. to see whether ``--prefill`` has landed)."""
    import typer

    from evictlab.eval.commands import eval_app

    cmd = typer.main.get_command(eval_app).commands["run"]
    return {o for p in cmd.params for o in getattr(p, "opts", [])}


def _grid_args(args: argparse.Namespace, methods: list[str], out: Path, prefill: str | None) -> list[str]:
    a = ["--models", args.model, "--tasks", args.task, "--context", str(args.context), "--methods", ",".join(methods),
         "--n", str(args.n), "--seed", "0", "--threads", str(args.threads), "--quiet", "--out", str(out)]
    if prefill in ("chunked", None):  # a one-pass prefill has no chunk (eval run refuses one)
        a += ["--chunk", str(args.chunk)]
    if any(m != "full" for m in methods):
        a += ["--budget", args.budget]
    if prefill is not None:
        a += ["--prefill", prefill]
    if args.questions:
        a += ["--questions", str(args.questions)]
    return a


def _run_child(name: str, args: argparse.Namespace, eval_args: list[str], work: Path,
               profile: Path | None = None) -> dict[str, Any]:
    result = work / f"{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--threads",
           str(args.threads), "--result", str(result), *(["--profile", str(profile)] if profile else []),
           "--", *eval_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(result.read_text())
    res.update(run=name, process_wall_s=time.perf_counter() - t0, load_before=load0, load_after=os.getloadavg()[0])
    return res


def _rows_of(grid: Path) -> dict[str, Any]:
    import polars as pl

    res = pl.read_parquet(grid / "results.parquet")
    q = res["question"].n_unique() if "question" in res.columns else 1
    return {"rows": res.height, "cells": res["cell"].n_unique(), "questions": int(q),
            "em": {m: float(g["exact_match"].mean()) for (m,), g in res.group_by(["method"], maintain_order=True)
                   if g["exact_match"].null_count() < g.height}}


def _peer(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """kvpress on the same examples: per example and press, ``peer_kvpress.py`` in its venv."""
    from bench_decode import ensure_peer

    from evictlab.models.loading import load_model, resolve
    from evictlab.tasks.examples import eval_examples

    py = ensure_peer(Path(args.peer_venv), [])
    _, tok = load_model(args.model)
    examples = eval_examples(args.task, args.n, args.context, tok, 0)
    model_dir = str(resolve(args.model)[1])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = str(args.threads)
    kept = _kept_per_cell(args.budget)
    runs, load0, answers = [], os.getloadavg()[0], 0
    for ex in examples:
        prompt = work / f"prompt.{ex.index}.json"
        qs = list(ex.questions)[:args.questions or None]  # the grid's --questions: the first K (all when 0)
        prompt.write_text(json.dumps({"context_ids": list(ex.context_ids), "question_ids": list(qs[0].question_ids),
                                      "questions": [{"question_ids": list(q.question_ids),
                                                     "new": max(1, len(q.answer_ids))} for q in qs]}))
        answers += len(qs)
        for press in ("none", "snapkv"):
            out = work / f"kvpress.{ex.index}.{press}.json"
            cmd = [str(py), str(HERE / "peer_kvpress.py"), "--model-dir", model_dir, "--prompt", str(prompt),
                   "--press", press, "--kept", str(kept), "--new", "1",
                   "--threads", str(args.threads), "--device", args.peer_device, "--result", str(out)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"kvpress {press} on example {ex.index} failed:\n{proc.stderr[-3000:]}")
            runs.append(json.loads(out.read_text()))
    wall = sum(r["wall_s"] for r in runs)
    return {"run": "kvpress", "wall_s": wall, "cpu_s": sum(r["cpu_s"] for r in runs), "arms": 2,
            "examples": len(examples), "rows": 2 * answers, "kept_per_head": kept, "tool": runs[0]["tool"] if runs else "",
            "load_before": load0, "load_after": os.getloadavg()[0], "per_run": runs}


def _kept_per_cell(budget: str) -> int:
    """Kept entries per cell of a per-cell budget text (``128`` or ``128/cell``)."""
    text = budget.removesuffix("/cell")
    if not text.isdigit():
        raise SystemExit(f"--budget {budget}: the kvpress reference needs a per-cell budget (e.g. 128), or --no-peer")
    return int(text)


def markdown(out: dict[str, Any]) -> str:
    """The runs and ratios as docs/performance.md prints them, with the command and load."""
    lines = [f"    {out['command']}", "",
             "| run | cells | answers | arms | wall s | cpu s | examples x arms / min | load before -> after |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in out["runs"]:
        lines.append(f"| {r['run']} | {r.get('cells', '-')} | {r.get('rows', '-')} | {r['arms']} | {r['wall_s']:.1f} | "
                     f"{r['cpu_s']:.1f} | {r['examples_x_arms_per_min']:.2f} | {r['load_before']:.1f} -> "
                     f"{r['load_after']:.1f} |")
    lines += ["", "| ratio | value | target |", "|---|---:|---|"]
    lines += [f"| {k} | {v:.2f} | {TARGETS.get(k, '(info)')} |" for k, v in out["ratios"].items()]
    if not out["prefill_option"]:
        lines += ["", "`eval run` has no `--prefill` yet: both grids ran the per-arm path (not the shared prefill)."]
    if out.get("breakdown"):
        b = out["breakdown"]
        lines += ["", f"Where the one-pass grid's time goes (one more run, under cProfile: {b['wall_s']:.1f} s, load "
                      f"{b['load_before']:.1f} -> {b['load_after']:.1f}; nested parts indented):", "",
                  "| part | s | calls | share |", "|---|---:|---:|---:|"]
        lines += [f"| {k.replace(' ', '&nbsp;', len(k) - len(k.lstrip()))} | {v['s']:.2f} | {v['calls']} | "
                  f"{v['share']:.1%} |" for k, v in b["parts"].items()]
    return "\n".join(lines) + "\n"


def breakdown(profile: Path) -> dict[str, dict[str, float]]:
    """What one profiled grid spent where (cumulative seconds of the functions that bound a
    one-pass grid, from a ``cProfile`` dump): ``{part: {"s": seconds, "calls": n, "share": of
    the contexts' total}}``. The parts nest (scoring and window statistics are inside the
    compressions); ``contexts`` is their whole."""
    import inspect
    import pstats

    from evictlab.methods import scorers

    stats = pstats.Stats(str(profile)).stats  # {(file, line, name): (cc, calls, tottime, cumtime, callers)}

    def cum(file: str, name: str, line: int | None = None) -> tuple[float, int]:
        hits = [(v[3], v[1]) for (f, ln, n), v in stats.items()
                if f.endswith(file) and n == name and (line is None or ln == line)]
        return sum(h[0] for h in hits), sum(h[1] for h in hits)

    parts = {
        "contexts (all)": cum("eval/runner.py", "_run_context"),
        "shared prefill": cum("decode/shared.py", "prefill"),
        "full cache's answers": cum("decode/shared.py", "answer_full"),
        "arms: context into the store": cum("decode/compress.py", "inject_context"),
        "arms: compressions": cum("decode/compress.py", "after_chunk"),
        "  KVzip reconstruction pass": cum("decode/compress.py", "reconstruction_queries"),
        "  scoring (shared per scorer)": cum("decode/compress.py", "_score_cells"),
        **{f"    {cls.name} scores": cum("methods/scorers.py", "score", inspect.getsourcelines(cls.score)[1])
           for cls in (scorers.H2O, scorers.SnapKV, scorers.ExpectedAttention, scorers.KVzip, scorers.Compactor)},
        "  window statistics (ContourKV)": cum("decode/compress.py", "_window_profile"),
        "arms: teacher-forced answers": cum("decode/loop.py", "answer"),
    }
    total = parts["contexts (all)"][0] or float("nan")
    return {k: {"s": t, "calls": n, "share": t / total} for k, (t, n) in parts.items() if n}


def grid_bench(args: argparse.Namespace) -> dict[str, Any]:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    has_prefill = "--prefill" in eval_run_options()
    if not has_prefill:
        print("note: `evictlab eval run` has no --prefill yet (the engine's shared prefill); both grids run the "
              "per-arm path", file=sys.stderr)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_eval_"))
    work.mkdir(parents=True, exist_ok=True)
    plan = [("full", ["full"], "one-pass" if has_prefill else None), ("one-pass", [*arms, "full"], "one-pass" if has_prefill else None),
            ("chunked", [*arms, "full"], "chunked" if has_prefill else None)]
    runs = []
    for name, methods, prefill in plan:
        grid = work / f"grid-{name}"
        r = _run_child(name, args, _grid_args(args, methods, grid, prefill), work)
        r.update(_rows_of(grid), arms=len(methods), examples=args.n)
        r["examples_x_arms_per_min"] = 60.0 * args.n * len(methods) / r["wall_s"]
        runs.append(r)
        print(f"{name}: {r['wall_s']:.1f} s ({r['cells']} cells, {r['rows']} rows), load {r['load_before']:.1f} -> "
              f"{r['load_after']:.1f}", file=sys.stderr, flush=True)
    if not args.no_peer:
        r = _peer(args, work)
        r["examples_x_arms_per_min"] = 60.0 * r["examples"] * r["arms"] / r["wall_s"]
        runs.append(r)
    parts = None
    if args.breakdown and has_prefill:
        prof = work / "one-pass.prof"
        r = _run_child("one-pass-profiled", args, _grid_args(args, [*arms, "full"], work / "grid-profiled", "one-pass"),
                       work, profile=prof)
        parts = {"wall_s": r["wall_s"], "load_before": r["load_before"], "load_after": r["load_after"],
                 "parts": breakdown(prof)}
        print(f"one-pass, profiled: {r['wall_s']:.1f} s, load {r['load_before']:.1f} -> {r['load_after']:.1f}",
              file=sys.stderr, flush=True)
    by = {r["run"]: r for r in runs}
    ratios = {"one-pass / full": by["one-pass"]["wall_s"] / by["full"]["wall_s"],
              "chunked / full": by["chunked"]["wall_s"] / by["full"]["wall_s"],
              "one-pass / chunked throughput": (by["one-pass"]["examples_x_arms_per_min"]
                                                / by["chunked"]["examples_x_arms_per_min"])}
    if "kvpress" in by:
        ratios["one-pass / kvpress throughput"] = (by["one-pass"]["examples_x_arms_per_min"]
                                                   / by["kvpress"]["examples_x_arms_per_min"])
    return {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "prefill_option": has_prefill,
            "model": args.model, "task": args.task, "context": args.context, "n": args.n, "budget": args.budget,
            "arms": arms, "questions": args.questions or 1, "threads": args.threads, "runs": runs, "ratios": ratios,
            "targets": TARGETS, "cpus": os.cpu_count(), "breakdown": parts}


def stores_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The older benchmark: SnapKV + AdaKV in the three stores on ``needle``, per-example
    wall-time ratios masked / physical and uniform / physical (same run, same process)."""
    import numpy as np
    import polars as pl
    import torch

    from evictlab.eval.grid import run_grid
    from evictlab.eval.runner import load_cached
    from evictlab.eval.spec import GridSpec

    torch.set_num_threads(args.threads)
    spec = GridSpec.build(models=[args.model], tasks=["needle"], contexts=[args.context], methods=["snapkv+adakv"],
                          budgets=[args.budget], modes=["physical", "uniform", "masked"],
                          protocols=["query-agnostic"], n=args.n, seed=0)
    load_cached(args.model)  # outside the clock
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run_grid(spec, Path(tmp) / "g")
        wall = time.perf_counter() - t0
        res = pl.read_parquet(Path(tmp) / "g" / "results.parquet")
    per_mode = res.group_by("mode", maintain_order=True).agg(
        pl.len().alias("examples"), pl.col("wall_s").sum().alias("wall_s"),
        pl.col("bytes_live").mean().alias("bytes_live"), pl.col("bytes_allocated").mean().alias("bytes_allocated"))
    ev = res.filter(pl.col("mode") != "full")
    phys = ev.filter(pl.col("mode") == "physical").sort("example")["wall_s"].to_numpy()
    ratios = {m: ev.filter(pl.col("mode") == m).sort("example")["wall_s"].to_numpy() / phys
              for m in ("masked", "uniform")}
    return {"examples": res.height, "wall_s": wall, "examples_per_minute": 60.0 * res.height / wall,
            "per_mode": per_mode.to_dicts(),
            "ratio_vs_physical": {m: {"median": float(np.median(r)), "min": float(r.min()), "max": float(r.max())}
                                  for m, r in ratios.items()},
            "threads": args.threads, "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="needle")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--budget", default="128", help="KV budget of the evicting arms (kept entries per cell)")
    p.add_argument("--n", type=int, default=3, help="contexts (seeded examples)")
    p.add_argument("--questions", type=int, default=0, help="questions per context (0: the task's default)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated evicting arms")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk of the chunked (per-arm) path")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-peer", action="store_true", help="skip the kvpress reference")
    p.add_argument("--peer-venv", default=str(Path.home() / ".cache" / "evictlab" / "bench" / "kvpress-0.5.5"))
    p.add_argument("--peer-device", default="cpu")
    p.add_argument("--work", default="", help="folder for the grids and per-run results (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="JSON of the numbers (and OUT.md: the Markdown rows)")
    p.add_argument("--stores", action="store_true", help="the older stores benchmark (physical/uniform/masked)")
    p.add_argument("--breakdown", action="store_true",
                   help="also profile the one-pass grid (cProfile) and split its time into prefill, reconstruction, "
                        "scoring, compressions and answers")
    p.add_argument("--profile", default="", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    raw = list(argv if argv is not None else sys.argv[1:])
    eval_args = raw[raw.index("--") + 1:] if "--" in raw else []
    args = p.parse_args(raw[:raw.index("--")] if "--" in raw else raw)
    args.eval_args = eval_args
    if args.stores and args.breakdown:
        p.error("--breakdown profiles the one-pass grid; drop it with --stores (the stores benchmark)")
    if args.child:
        Path(args.result).write_text(json.dumps(_child(args)))
        return 0
    sys.path.insert(0, str(HERE))  # bench_decode's peer helpers
    from evictlab.record import RunRecord, record_path

    record = RunRecord(kind="bench.eval", model=args.model, seed=0, config={**vars(args), "out": str(args.out)})
    out = stores_bench(args) if args.stores else grid_bench(args)
    if not args.stores:
        text = markdown(out)
        print(text)
    else:
        print(json.dumps({k: v for k, v in out.items() if k != "per_mode"}, indent=1))
    if args.out:
        from evictlab.io import atomic_write_json, atomic_write_text

        atomic_write_json(args.out, out)
        if not args.stores:
            atomic_write_text(args.out.with_suffix(".md"), text)
        record.write(record_path(args.out), outputs=[str(args.out)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
