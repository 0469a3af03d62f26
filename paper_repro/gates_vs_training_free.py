"""Trained retention gates (trimkv + global) against the training-free methods, on the grid.

Paper B's claims tested here: one global ranking of learned retention scores keeps a
better cache than the training-free methods at the same bytes, and removing the shared
final projection (per-layer ``local`` gates) hurts. Three grids of ``evictlab eval run``
over the same examples (query-agnostic; budgets in tokens per cell, so equal budgets are
equal bytes: every cell has the same head size and dtype; the report prints the bytes
each arm held):

- ``GRID_ROOT/baselines``: the full cache, StreamingLLM, SnapKV and SnapKV+AdaKV in the
  physical store (it needs no gates, so it can run while the gates train);
- ``GRID_ROOT/shared``: trimkv+global with the shared gates (``--shared``), physical and
  uniform (uniform = the same scores at equal per-cell sizes: trimkv alone);
- ``GRID_ROOT/local``: trimkv+global with the ``--local`` gates, physical.

The gated grids' full-cache cells are the baselines' (same cell key): copied, not run
again. The results are joined (the local rows' method renamed ``trimkv+global[local]``)
and paired by :func:`evictlab.eval.compare.compare` with the grid's default tie rule;
``OUT/gates_eval.md`` is the grid's report of the joined results plus the trained gates'
pairs, ``OUT/gates_pairs.parquet`` every pair. A rerun resumes every grid.

    python paper_repro/gates_vs_training_free.py     # the baselines only (while gates train)
    python paper_repro/gates_vs_training_free.py --grids shared,local --shared ... --local ...   # side by side
    python paper_repro/gates_vs_training_free.py --shared runs/gates/smollm2-shared \
        --local runs/gates/smollm2-local          # defaults: smollm2-135m, 256 tokens, budget 32
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import polars as pl

import _common

BASELINES = ("streaming_llm", "snapkv", "snapkv+adakv")
GATED = "trimkv+global"
LOCAL = "trimkv+global[local]"


def _grid(args: argparse.Namespace, methods: list[str], modes: list[str], gates: Path | None,
          out: Path) -> pl.DataFrame:
    from evictlab.eval.grid import RESULTS, run_grid
    from evictlab.cliutil import parse_list
    from evictlab.eval.spec import GridSpec, LoopSettings

    spec = GridSpec.build(models=parse_list(args.models, "--models", "model"),
                          tasks=parse_list(args.tasks, "--tasks", "task"),
                          contexts=parse_list(args.contexts, "--contexts", "context length"), methods=methods,
                          budgets=parse_list(args.budgets, "--budget", "budget"),
                          modes=modes, protocols=["query-agnostic"], n=args.n, seed=args.seed,
                          loop=LoopSettings(chunk_size=args.chunk),
                          scorer_params={"trimkv.gates": str(gates)} if gates is not None else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    bar: list[tqdm] = []
    try:
        run_grid(spec, out, map_cells=_pool(args.workers, args.threads, lambda k: bar[0].update(k) if bar else None),
                 on_start=lambda total, done: bar.append(tqdm(total=total, initial=done, unit="ex", desc=out.name)))
    finally:
        for b in bar:
            b.close()
    return pl.read_parquet(out / RESULTS)


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _pool(workers: int, threads: int, progress: Callable[[int], None]) -> Callable[..., Iterator[Any]]:
    """``map_cells`` for :func:`evictlab.eval.grid.run_grid`: cells in ``workers`` processes
    (spawned, ``threads`` torch threads each), yielded as they finish; one process runs them
    in order with a per-example progress bar."""
    from evictlab.eval.grid import local_map

    if workers <= 1:
        return local_map(progress)

    def map_cells(fn: Callable[..., Any], cells: list[Any]) -> Iterator[tuple[Any, Any]]:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(threads,)) as ex:
            futures = {ex.submit(fn, cell): cell for cell in cells}
            for fut in as_completed(futures):
                frame = fut.result()
                progress(frame.height)
                yield futures[fut], frame

    return map_cells


def _reuse_full_cells(src: Path, dst: Path) -> None:
    """Copy the full-cache parts of ``src`` into ``dst`` (same cells, same keys: not run twice)."""
    from evictlab.eval.grid import PARTS

    (dst / PARTS).mkdir(parents=True, exist_ok=True)
    for part in (src / PARTS).glob("*_full_full_*.parquet"):
        if not (dst / PARTS / part.name).exists():
            shutil.copyfile(part, dst / PARTS / part.name)


def main(argv: list[str] | None = None) -> int:
    import torch

    from evictlab.eval.compare import TieRule, compare, wtl_table
    from evictlab.report import markdown as md
    from evictlab.eval.report import evaluation_markdown
    from evictlab.record import RunRecord

    p = _common.parser(__doc__.splitlines()[0], needs_results=False)
    p.add_argument("--shared", type=Path, default=None, help="gates folder (shared projection); without it only "
                   "the baselines run")
    p.add_argument("--local", type=Path, default=None, help="gates folder of the local ablation (optional)")
    p.add_argument("--grid-root", type=Path, default=Path("runs/paper_repro/gates"), help="grid folders go here")
    p.add_argument("--models", default="smollm2-135m")
    p.add_argument("--tasks", default="needle_word,heldout_ppl")
    p.add_argument("--contexts", default="256")
    p.add_argument("--budget", "--budgets", dest="budgets", default="32")
    p.add_argument("--n", type=int, default=4, help="examples per task (default 4)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (default 1)")
    p.add_argument("--workers", type=int, default=1, help="processes running cells side by side (default 1)")
    p.add_argument("--grids", default="baselines,shared,local",
                   help="grids to run (or resume) here; the others are read if finished (two invocations can run "
                        "different grids side by side)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = RunRecord(kind="paper-repro-gates", seed=args.seed, config=_common.config(args))

    base_dir = args.grid_root / "baselines"
    plan = {"baselines": (list(BASELINES), ["physical"], None, "full"),
            "shared": ([GATED], ["physical", "uniform"], args.shared, GATED),
            "local": ([GATED], ["physical"], args.local, LOCAL)}
    grids = {g.strip() for g in args.grids.split(",") if g.strip()}
    frames = []
    for name, (methods, modes, gates, label) in plan.items():
        folder = args.grid_root / name
        if name not in grids or (name != "baselines" and gates is None):
            if (folder / "results.parquet").is_file():  # run by another invocation: read it
                frame = pl.read_parquet(folder / "results.parquet")
            else:
                continue
        else:
            if name != "baselines":
                _reuse_full_cells(base_dir, folder)
            frame = _grid(args, methods, modes, gates, folder)
        frames.append(frame if name == "baselines" else
                      frame.filter(pl.col("method") != "full").with_columns(pl.lit(label).alias("method")))
    if not frames or not (base_dir / "results.parquet").is_file() or len(frames) < 2:
        print(f"grids finished so far: {[f for f in plan if (args.grid_root / f / 'results.parquet').is_file()]}; "
              "the report needs the baselines and the gates (--shared DIR)")
        return 0
    results = pl.concat(frames, how="vertical")
    rule = TieRule()
    pairs = compare(results, rule)
    args.out.mkdir(parents=True, exist_ok=True)
    pairs.write_parquet(args.out / "gates_pairs.parquet")
    ours = pairs.filter((pl.col("kind") == "method") & (pl.col("a_mode") == "physical")
                        & ((pl.col("a_method").is_in([GATED, LOCAL])) | (pl.col("b_method").is_in([GATED, LOCAL]))))
    report = evaluation_markdown(results, pairs, rule=rule.describe(), config=_common.config(args), seed=args.seed)
    detail = ours.select("task", "budget", "a_method", "b_method", "wins", "ties", "losses", "verdict", "em_a", "em_b",
                         "logprob_a", "logprob_b", "d_logprob", "d_logprob_lo", "d_logprob_hi", "kl_a", "kl_b",
                         "bytes_live_a", "bytes_live_b")
    md.write(args.out / "gates_eval.md", [report, "\n## Trained gates against the rest (physical mode)\n",
                                          md.table(wtl_table(ours), digits=3), "\n", md.table(detail, digits=3)])
    record.write(args.out / "gates_eval.run_record.json", outputs=[str(args.out / "gates_eval.md"),
                                                                   str(args.out / "gates_pairs.parquet")])
    print(md.table(wtl_table(ours), digits=3))
    print(md.table(detail, digits=3))
    print(f"report: {args.out / 'gates_eval.md'}")
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
