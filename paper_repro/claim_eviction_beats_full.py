"""Claim: eviction can beat the full cache (paper B, attention dilution; +14% on MMDU at 512 tokens).

Reads the results of finished `evictlab dilution sweep` runs (one folder per model), compares
each method with the full cache on the same examples (`evictlab.dilution.sweep.verdicts`, so
the current rule applies to older runs too), writes per model one claim row for the query-agnostic methods and one for the ORACLE that
evicts distractors only, and copies each sweep's figure to figures/.

    .venv/bin/python paper_repro/claim_eviction_beats_full.py --sweep runs/dilution/smollm2-135m [DIR ...]
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import polars as pl

import _common

from evictlab.dilution.claim import beats_full_claims
from evictlab.dilution.sweep import verdicts
from evictlab.errors import InputError
from evictlab.record import RunRecord


def main(argv: list[str] | None = None) -> int:
    p = _common.parser(__doc__.splitlines()[0], needs_results=False)
    p.add_argument("--sweep", type=Path, nargs="+", required=True,
                   help="finished `evictlab dilution sweep` folders (each holds results.parquet)")
    p.add_argument("--weights", default="weights quantised (Q4 GGUF)",
                   help="how the model weights were stored (printed next to every number)")
    args = p.parse_args(argv)
    record = RunRecord(kind="paper-repro-dilution", seed=args.seed, config=_common.config(args))
    frames = []
    for d in args.sweep:
        f = d / "results.parquet"
        if not f.is_file():
            raise InputError("--sweep", f"{d} holds no results.parquet (not a finished sweep)",
                             "run `evictlab dilution sweep --out DIR` to the end first")
        frames.append(pl.read_parquet(f))
    results = pl.concat(frames, how="diagonal_relaxed")
    verdict = verdicts(results, seed=args.seed)
    n_ex = results.height
    args.read = {"pairs": n_ex, "files": [str(d / "results.parquet") for d in args.sweep]}
    print(f"read {n_ex:,} (example, method) runs from {', '.join(map(str, args.sweep))}")
    figs = _common.figures_dir(args)
    made = []
    for d in args.sweep:
        for suffix in (".png", ".pdf"):
            if (d / f"sweep{suffix}").is_file():
                shutil.copyfile(d / f"sweep{suffix}", figs / f"dilution_sweep_{d.name}{suffix}")
        made.append(SimpleNamespace(png=figs / f"dilution_sweep_{d.name}.png"))  # publish() records .png
    _common.publish(args, "claim_eviction_beats_full.py", beats_full_claims(verdict, args.weights), made, record)
    return 0


if __name__ == "__main__":
    from _common import entry

    entry(main)
