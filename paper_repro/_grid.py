"""Shared plumbing for the paper_repro scripts that run or read the evaluation grid.

A script names a default grid (the smallest that tests its claim on our models); every
field can be overridden on the command line. The grid runs (or resumes) into ``--grid``
with the same :func:`evictlab.eval.grid.run_grid` as ``evictlab eval run``, so a killed
script picks up where it stopped, and a finished grid is only read. The table scripts
(``enforcement_tables.py``, ``margin_tables.py``) read a grid folder with :func:`read_grid`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from collections.abc import Callable
from typing import Any

import polars as pl

import _common

from evictlab.cliutil import parse_list
from evictlab.errors import InputError
from evictlab.eval.grid import MANIFEST, RESULTS, partial_results, read_manifest, run_grid
from evictlab.eval.spec import GridSpec, LoopSettings
from evictlab.io import atomic_write_text, read_checked_parquet

PAIRS = "pairs.parquet"
"""The table `evictlab eval compare` writes into a grid folder (``partial/`` for ``--partial``)."""


def parser(description: str, defaults: dict[str, Any]) -> argparse.ArgumentParser:
    p = _common.parser(description, needs_results=False)
    p.add_argument("--grid", type=Path, default=Path(defaults["grid"]),
                   help=f"grid folder, run or resumed there (default {defaults['grid']})")
    # the spellings of `evictlab eval run` (--budget, --store, --protocol); the old plural ones still parse
    flags = {"budgets": ("--budget", "--budgets"), "modes": ("--store", "--modes"), "protocols": ("--protocol", "--protocols")}
    for name in ("models", "tasks", "contexts", "budgets", "methods", "modes", "protocols"):
        p.add_argument(*flags.get(name, (f"--{name}",)), dest=name, default=",".join(map(str, defaults[name])),
                       help=f"comma-separated (default {','.join(map(str, defaults[name]))})")
    p.add_argument("--n", type=int, default=defaults["n"], help=f"examples per task (default {defaults['n']})")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples (default 2000)")
    return p


def run(args: argparse.Namespace) -> pl.DataFrame:
    """Run or resume the grid the arguments describe; its results."""
    import torch
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    spec = GridSpec.build(models=parse_list(args.models, "--models", "model"),
                          tasks=parse_list(args.tasks, "--tasks", "task"),
                          contexts=parse_list(args.contexts, "--contexts", "context length"),
                          methods=parse_list(args.methods, "--methods", "method"),
                          budgets=parse_list(args.budgets, "--budget", "budget"),
                          modes=parse_list(args.modes, "--store", "store"),
                          protocols=parse_list(args.protocols, "--protocol", "protocol"), n=args.n, seed=args.seed,
                          loop=LoopSettings(chunk_size=args.chunk))
    args.grid.parent.mkdir(parents=True, exist_ok=True)
    bar: Any = None

    def on_start(total: int, done: int) -> None:
        nonlocal bar
        bar = tqdm(total=total, initial=done, unit="ex", desc=args.grid.name)

    try:
        run_grid(spec, args.grid, progress=lambda k: bar.update(k) if bar else None, on_start=on_start)
    finally:
        if bar is not None:
            bar.close()
    return pl.read_parquet(args.grid / RESULTS)


def claim_main(argv: list[str] | None, doc: str, defaults: dict[str, Any], script: str,
               claims: Callable[..., tuple[list[Any], pl.DataFrame]], name: str) -> int:
    """A claim script: parse, run or resume the grid, compute ``claims(results, seed=,
    n_boot=)`` (rows and the per-comparison detail), write ``<out>/<name>_detail.md`` and
    the accuracy-vs-bytes figure ``<figures>/<name>_accuracy_vs_bytes``, publish the rows."""
    from evictlab.plots.evaluation import accuracy_vs_bytes
    from evictlab.report import markdown as md
    from evictlab.record import RunRecord

    args = parser(doc.splitlines()[0], defaults).parse_args(argv)
    record = RunRecord(kind=f"paper-repro-{name.replace('_', '-')}", seed=args.seed, config=_common.config(args))
    results = run(args)
    rows, detail = claims(results, seed=args.seed, n_boot=args.n_boot)
    args.out.mkdir(parents=True, exist_ok=True)
    md.write(args.out / f"{name}_detail.md", [f"# {name.replace('_', ' ')}: per comparison\n",
                                              md.table(detail, digits=3)])
    made = [accuracy_vs_bytes(results, _common.figures_dir(args) / f"{name}_accuracy_vs_bytes")]
    _common.publish(args, script, rows, made, record)
    return 0


def read_grid(folder: Path, partial: bool = False, pairs: bool = True
              ) -> tuple[pl.DataFrame, pl.DataFrame | None, str | None]:
    """``(results, pairs, note)`` of a grid folder: a finished one (``results.parquet``, and
    with ``pairs`` the ``pairs.parquet`` of `evictlab eval compare`), or with ``partial`` a
    running or stopped one-pass grid (the examples done in every cell, as ``eval compare
    --partial`` reads them, and with ``pairs`` its ``partial/pairs.parquet``; ``note`` says
    what the tables hold). ``pairs`` is None when not asked for. One clear error otherwise."""
    if partial:
        if not (folder / MANIFEST).is_file():
            raise InputError(str(folder), f"no {MANIFEST} here (not an `evictlab eval run` folder)",
                             "pass a grid folder such as runs/experiments/enforcement_cost")
        if pairs and not (folder / "partial" / PAIRS).is_file():
            raise InputError(str(folder), f"no partial/{PAIRS} here (the grid was not compared)",
                             f"run `evictlab eval compare {folder} --partial` first")
        got = partial_results(GridSpec.from_dict(read_manifest(folder)["spec"]), folder)
        if not pairs:
            return got.results, None, got.describe()
        compared = pl.read_parquet(folder / "partial" / PAIRS)
        seen = set(compared["contexts"].unique().to_list())
        if seen and seen != {got.examples}:  # the grid went on after that comparison
            raise InputError(str(folder), f"partial/{PAIRS} compared {sorted(seen)} contexts per comparison, the "
                             f"grid now has {got.examples} done everywhere",
                             f"rerun `evictlab eval compare {folder} --partial --overwrite`, then this")
        return got.results, compared, got.describe()
    if not (folder / RESULTS).is_file():
        raise InputError(str(folder), f"no {RESULTS} here (not a finished `evictlab eval run` folder)",
                         "pass a finished grid folder such as data/grids/enforcement_cost, or --partial")
    if pairs and not (folder / PAIRS).is_file():
        raise InputError(str(folder), f"no {PAIRS} here (the grid was not compared)",
                         f"run `evictlab eval compare {folder}` first")
    results = read_checked_parquet(folder / RESULTS, "rerun `evictlab eval run` into a new folder")
    return results, (pl.read_parquet(folder / PAIRS) if pairs else None), None


def tables_main(argv: list[str] | None, doc: str, tables: Callable[..., str], *, pairs: bool, out_example: str) -> int:
    """A table script's command line: ``GRID [--partial] [--out FILE.md] [--n-boot N] [--seed S]``;
    reads the grid (:func:`read_grid`, with ``pairs`` when the tables need `eval compare`'s),
    prints ``tables(results, pairs, seed=, n_boot=)`` (``PARTIAL`` above it for a running grid)
    and with ``--out`` writes it too (atomically). Bad input: one :class:`InputError`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("grid", type=Path, help="a finished grid folder (results.parquet"
                    + (" and pairs.parquet of `eval compare`)" if pairs else ")"))
    ap.add_argument("--partial", action="store_true",
                    help="a one-pass grid not finished yet: the examples done in every cell"
                    + (" (after `eval compare --partial`)" if pairs else ""))
    ap.add_argument("--out", type=Path, help="also write the tables to this .md file")
    ap.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples (default 2000, as eval compare)")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0, as eval compare)")
    args = ap.parse_args(argv)
    if args.n_boot < 100:
        raise InputError("--n-boot", f"must be >= 100, got {args.n_boot}", "pass --n-boot 2000")
    if args.out is not None and args.out.suffix != ".md":
        raise InputError("--out", f"{args.out} does not end in .md", f"use e.g. --out {out_example}")
    if args.out is not None and not args.out.parent.is_dir():
        raise InputError("--out", f"folder {args.out.parent} does not exist", f"create it: mkdir -p {args.out.parent}")
    results, compared, note = read_grid(args.grid, args.partial, pairs=pairs)
    text = tables(results, compared, seed=args.seed, n_boot=args.n_boot)
    if note is not None:
        text = f"**{note}.**\n\n{text}"
    print(text, end="")
    if args.out is not None:
        atomic_write_text(args.out, text)
    return 0
