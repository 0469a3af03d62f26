"""Do two grids agree where they computed the same thing? (determinism across runs and machines)

Two `evictlab eval run` grids that share arms (the same model, task, context, method, budget,
mode, protocol, seed, example and question) must give the same answers: the engine promises
"same seed, same bits" on one machine. This script joins the shared rows of two finished grid
folders (their ``results.parquet``) and prints, per model and method, how many rows they share, how many
agree exactly on exact match and on bytes held, how many answer log-probabilities are
bit-identical and the largest difference (nats). docs/gates.md and docs/evaluation.md quote
its numbers.

    python paper_repro/grids_agree.py data/grids/contourkv data/grids/gates
    python paper_repro/grids_agree.py data/grids/gates data/grids/gates_ablation \
        --same 'trimkv+global=trimkv[gates=default]+global'    # one arm under two names
    python paper_repro/grids_agree.py A B --examples 28:50 --out runs/agree.md   # examples 28-49 only;
                                                                                 # also writes the table

Keys: every configuration column of a result row except timings and the device it ran on, so
a row computed on another CPU kind still pairs (the differences then show what that costs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import polars as pl

from evictlab.errors import InputError
from evictlab.io import atomic_write_text

KEYS = ["model", "task", "context", "method", "mode", "protocol", "prefill", "budget", "budget_unit",
        "chunk_size", "compress_every", "window", "sinks", "recent", "block_size", "seed", "example",
        "example_seed", "question"]
"""Columns that name one answer of one arm; rows equal on all of them computed the same thing."""


def read_grid(folder: Path) -> pl.DataFrame:
    """A finished grid's result rows (``FOLDER/results.parquet``); one clear error otherwise."""
    path = folder / "results.parquet"
    if not path.is_file():
        raise InputError(str(folder), "no results.parquet here (not a finished `evictlab eval run` folder)",
                         "pass a grid folder such as data/grids/gates")
    return pl.read_parquet(path)


def agreement(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """One row per (model, method) shared by ``a`` and ``b``: ``rows`` (shared answers), ``em_equal`` and
    ``bytes_equal`` (answers whose exact match / bytes held are equal), ``logprob_bitequal``
    (answer log-probabilities equal to the bit) and ``max_abs_dlogprob`` (nats)."""
    keys = [k for k in KEYS if k in a.columns and k in b.columns]
    cols = ["exact_match", "bytes_live", "answer_logprob"]
    j = a.select(*keys, *cols).join(b.select(*keys, *cols), on=keys, how="inner", suffix="_b", nulls_equal=True)
    return (j.group_by("model", "method", maintain_order=True)
            .agg(rows=pl.len(),
                 em_equal=(pl.col("exact_match") == pl.col("exact_match_b")).sum(),
                 bytes_equal=(pl.col("bytes_live") == pl.col("bytes_live_b")).sum(),
                 logprob_bitequal=(pl.col("answer_logprob") == pl.col("answer_logprob_b")).sum(),
                 max_abs_dlogprob=(pl.col("answer_logprob") - pl.col("answer_logprob_b")).abs().max())
            .sort("model", "method"))


def _split_same(text: str) -> tuple[str, str]:
    depth = 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "=" and depth == 0 and 0 < i < len(text) - 1:
            return text[:i], text[i + 1:]
    raise InputError("--same", f"{text!r} is not A=B (two method texts joined by '=' outside brackets)",
                     "write e.g. --same 'trimkv+global=trimkv[gates=default]+global'")


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not (sep and lo.isdigit() and hi.isdigit() and int(lo) < int(hi)):
        raise InputError("--examples", f"{text!r} is not a range LO:HI of example numbers with LO < HI",
                         "write e.g. --examples 28:50")
    return int(lo), int(hi)


def markdown(table: pl.DataFrame, a: Path, b: Path) -> str:
    lines = [f"Shared rows of `{a}` and `{b}` (joined on {', '.join(KEYS)}).", "",
             "| model | method | shared answers | exact match equal | bytes held equal | log-prob bit-equal | max abs difference (nats) |",
             "|---|---|---|---|---|---|---|"]
    for r in table.iter_rows(named=True):
        lines.append(f"| {r['model']} | {r['method']} | {r['rows']} | {r['em_equal']} | {r['bytes_equal']} | "
                     f"{r['logprob_bitequal']} | {r['max_abs_dlogprob']:.3g} |")
    t = table.select(pl.col("rows", "em_equal", "bytes_equal", "logprob_bitequal").sum()).row(0, named=True) if table.height else {}
    if t:
        lines.append(f"| all | all | {t['rows']} | {t['em_equal']} | {t['bytes_equal']} | {t['logprob_bitequal']} | "
                     f"{table['max_abs_dlogprob'].max():.3g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grid_a", type=Path, help="a finished grid folder (holds results.parquet)")
    p.add_argument("grid_b", type=Path, help="another finished grid folder")
    p.add_argument("--examples", default=None, metavar="LO:HI",
                   help="only examples LO..HI-1 (e.g. 28:50: the part computed on one machine)")
    p.add_argument("--same", nargs="*", default=[], metavar="A=B",
                   help="grid A's method A is grid B's method B under another name "
                        "(e.g. 'trimkv+global=trimkv[gates=default]+global')")
    p.add_argument("--out", type=Path, default=None, help="also write the table (Markdown) here")
    args = p.parse_args(argv)
    a, b = read_grid(args.grid_a), read_grid(args.grid_b)
    for pair in args.same:
        # a method text may hold '=' inside brackets: split at the '=' outside them
        old, new = _split_same(pair)
        a = a.with_columns(method=pl.col("method").replace(old, new))
    if args.examples is not None:
        lo, hi = _range(args.examples)
        a, b = (t.filter(pl.col("example").is_between(lo, hi - 1)) for t in (a, b))
    table = agreement(a, b)
    if table.height == 0:
        print(f"error: {args.grid_a} and {args.grid_b} share no answers (no arm with the same keys); "
              "pass two grids that ran a common arm", file=sys.stderr)
        return 2
    text = markdown(table, args.grid_a, args.grid_b)
    print(text, end="")
    if args.out is not None:
        atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
