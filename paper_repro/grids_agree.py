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
    python paper_repro/grids_agree.py data/grids/gates_ablation data/grids/gates \
        --versus 'trimkv[gates=data/ablation/gates-smollm2-135m-local]+global=snapkv'

``--versus A=B`` asks another question of the same pairing: how far grid A's method A lies
from grid B's method B on the same seeded answers (points = 100 x exact-match difference per
answer, pooled per model with the claims' whole-context bootstrap,
:func:`evictlab.eval.claims.common.pooled_mean`), for two arms that no single grid holds.

Keys: every configuration column of a result row except timings and the device it ran on, so
a row computed on another CPU kind still pairs (the differences then show what that costs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import polars as pl

from evictlab.errors import InputError
from evictlab.eval.claims.common import pooled_mean, points_text
from evictlab.eval.grid import RESULTS
from evictlab.io import atomic_write_text, read_checked_parquet

KEYS = ["model", "task", "context", "method", "mode", "protocol", "prefill", "budget", "budget_unit",
        "chunk_size", "compress_every", "window", "sinks", "recent", "block_size", "seed", "example",
        "example_seed", "question"]
"""Columns that name one answer of one arm; rows equal on all of them computed the same thing."""


def read_grid(folder: Path) -> pl.DataFrame:
    """A finished grid's result rows (``FOLDER/results.parquet``, checksum verified as `eval
    compare` reads it); one clear error otherwise."""
    path = folder / RESULTS
    if not path.is_file():
        raise InputError(str(folder), f"no {RESULTS} here (not a finished `evictlab eval run` folder)",
                         "pass a grid folder such as data/grids/gates")
    return read_checked_parquet(path, "rerun `evictlab eval run` into a new folder")


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


def versus(a: pl.DataFrame, b: pl.DataFrame, method_a: str, method_b: str, *, seed: int = 0,
           n_boot: int = 2000) -> pl.DataFrame:
    """One row per model: ``method_a`` of ``a`` against ``method_b`` of ``b`` on the answers both
    hold (every key of :data:`KEYS` but the method equal): ``answers``, ``em_a`` / ``em_b``
    (exact-match rates) and ``points`` = 100 x the mean exact-match difference with its
    whole-context bootstrap interval ``lo`` / ``hi`` (95%)."""
    keys = [k for k in KEYS if k != "method" and k in a.columns and k in b.columns]
    j = (a.filter(pl.col("method") == method_a).select(*keys, "exact_match")
         .join(b.filter(pl.col("method") == method_b).select(*keys, "exact_match"), on=keys, how="inner",
               suffix="_b", nulls_equal=True)
         .with_columns(d=pl.col("exact_match") - pl.col("exact_match_b")))
    rows = []
    for (model,), g in j.sort(keys).group_by(["model"], maintain_order=True):
        v, lo, hi = pooled_mean(g, "d", f"versus|{model}|{method_a}|{method_b}", seed, n_boot)
        rows.append({"model": model, "method_a": method_a, "method_b": method_b, "answers": g.height,
                     "em_a": g["exact_match"].mean(), "em_b": g["exact_match_b"].mean(),
                     "points": v, "lo": lo, "hi": hi})
    return pl.DataFrame(rows)


def _split_same(text: str, option: str = "--same") -> tuple[str, str]:
    depth = 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "=" and depth == 0 and 0 < i < len(text) - 1:
            return text[:i], text[i + 1:]
    raise InputError(option, f"{text!r} is not A=B (two method texts joined by '=' outside brackets)",
                     f"write e.g. {option} 'trimkv+global=trimkv[gates=default]+global'")


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


def versus_markdown(table: pl.DataFrame, a: Path, b: Path) -> str:
    lines = [f"Method of `{a}` against method of `{b}` on the answers both hold (points = 100 x exact-match "
             "difference; 95% bootstrap over whole contexts).", "",
             "| model | method (A) | method (B) | answers | exact match A | exact match B | A - B |",
             "|---|---|---|---|---|---|---|"]
    for r in table.iter_rows(named=True):
        lines.append(f"| {r['model']} | {r['method_a']} | {r['method_b']} | {r['answers']} | {r['em_a']:.3f} | "
                     f"{r['em_b']:.3f} | {points_text(r['points'], r['lo'], r['hi'])} |")
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
    p.add_argument("--versus", nargs="*", default=[], metavar="A=B",
                   help="instead of the agreement: grid A's method A against grid B's method B, in points "
                        "of exact match with a whole-context bootstrap interval")
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
    if args.versus:
        table = pl.concat([versus(a, b, *_split_same(pair, "--versus")) for pair in args.versus], how="diagonal")
    else:
        table = agreement(a, b)
    if table.height == 0:
        print(f"error: {args.grid_a} and {args.grid_b} share no answers (no arm with the same keys, or a "
              "method named in --same / --versus that one of them lacks); pass two grids that ran a common arm", file=sys.stderr)
        return 2
    text = versus_markdown(table, args.grid_a, args.grid_b) if args.versus else markdown(table, args.grid_a, args.grid_b)
    print(text, end="")
    if args.out is not None:
        atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
