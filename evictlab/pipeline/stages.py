"""The main job's stages that run evictlab's own commands in a subprocess: rows (``capture`` /
``rows synth``) and solver results (``solve``), both cached, and the hardness check.

Nothing here computes statistics (:mod:`evictlab.pipeline.analysis`) or writes Markdown
(:mod:`evictlab.pipeline.report`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from evictlab.io import read_checked_parquet
from evictlab.pipeline.config import AnalysisConfig, CaptureSpec, StageError


# --------------------------------------------------------------------------------------
# stages 1-2: rows and solver results (subprocesses, cached)
# --------------------------------------------------------------------------------------
def _evictlab(args: list[str], log: Any, ok: tuple[int, ...] = (0,), quiet: bool = False) -> float:
    """Run ``evictlab ARGS`` with this interpreter (``quiet``: with ``--quiet``); return wall
    seconds; raise StageError when its exit status is not in ``ok``."""
    args = [*args, "--quiet"] if quiet else args
    cmd = [sys.executable, "-m", "evictlab.cli", *args]
    log(f"$ evictlab {' '.join(args)}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    if proc.returncode not in ok:
        raise StageError(f"`evictlab {' '.join(args)}` exited with status {proc.returncode}; see its message above")
    return time.perf_counter() - t0


def ensure_rows(spec: CaptureSpec, cache: Path, log: Any, threads: int = 1,
                quiet: bool = False) -> tuple[Path, bool, float]:
    """Rows for ``spec``, from the cache or freshly produced. Returns (path, cached?, seconds).

    ``threads``: torch threads of the capture (rows do not depend on it beyond rounding);
    ``quiet``: the command runs without progress bars.
    """
    cache.mkdir(parents=True, exist_ok=True)  # the commands want an existing parent folder
    rows = cache / spec.key()
    done = cache / (spec.key() + ".done.json")
    if done.exists() and rows.exists():
        log(f"rows cached: {rows}")
        return rows, True, 0.0
    if spec.synthetic:
        args = ["rows", "synth", "--count", str(spec.synthetic_rows), "--keys", str(spec.synthetic_keys),
                "--dim", str(spec.synthetic_dim), "--seed", str(spec.seed), "--out", str(rows)]
        if rows.exists():
            args.append("--overwrite")
    else:
        args = ["capture", "--model", spec.model, "--source", spec.source, "--context", str(spec.context),
                "--positions", str(spec.positions), "--prompts", str(spec.prompts), "--seed", str(spec.seed),
                "--threads", str(threads), "--out", str(rows)]
    secs = _evictlab(args, log, quiet=quiet)
    from evictlab.io import atomic_write_json

    atomic_write_json(done, {"spec": asdict(spec), "seconds": round(secs, 2)})
    return rows, False, secs


def solve_key(cfg: AnalysisConfig, certify: bool) -> str:
    """Cache key of solver results: budgets, pool, certification and a hash of the solver's source.

    Hashing the source of evictlab/solve and evictlab/core means a solver change never
    reuses stale results.
    """
    import hashlib

    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for sub in ("solve", "core"):
        for f in sorted((root / sub).glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    b = ",".join(map(str, cfg.budgets))
    search = "-all" if cfg.search == "all" else ""
    return f"b{b}-p{cfg.pool[0]},{cfg.pool[1]}{search}{'-cert' if certify else ''}-{h.hexdigest()[:12]}"


def _copy(src: Path, dest: Path) -> None:
    import shutil

    from evictlab.io import atomic_path

    with atomic_path(dest, suffix=".parquet") as tmp:
        shutil.copyfile(src, tmp)


def solve_stage(rows: Path, out: Path, cfg: AnalysisConfig, certify: bool, log: Any) -> float:
    """``evictlab solve ROWS --keep ... --pool r_m r_e --search pool|all [--certify] --out RESULTS``."""
    args = ["solve", str(rows), "--keep", *map(str, cfg.budgets), "--pool", *map(str, cfg.pool),
            "--search", cfg.search, "--out", str(out)]
    if certify:
        args.append("--certify")
    if out.exists():
        args.append("--overwrite")
    return _evictlab(args, log, quiet=cfg.quiet)


def rows_and_results(spec: CaptureSpec, cfg: AnalysisConfig, certify: bool, res: Path, runs: Path, resolve: bool,
                     timings: dict[str, float], facts: dict[str, str], log: Any, tag: str = "") -> tuple[Path, Path]:
    """Rows (cached or produced) -> solver results (cached or solved) -> copied to ``res``.

    Returns ``(res, rows)``: the results file and the row dataset they were solved from.
    """
    rows, cached, secs = ensure_rows(spec, runs / "cache" / "rows", log, cfg.threads, cfg.quiet)
    timings[f"{tag}rows {spec.label()}"] = secs
    cached_res = runs / "cache" / "results" / f"{spec.key()}-{solve_key(cfg, certify)}.parquet"
    if cached_res.exists() and not resolve:
        log(f"solver results cached: {cached_res}")
        timings[f"{tag}solve {spec.label()}"] = 0.0
    else:
        cached_res.parent.mkdir(parents=True, exist_ok=True)
        timings[f"{tag}solve {spec.label()}"] = solve_stage(rows, cached_res, cfg, certify, log)
        _label_model(cached_res, spec.label())
    _copy(cached_res, res)
    facts[f"{tag}rows {spec.label()}"] = (
        f"`{rows}` ({'cached' if cached else f'produced in {secs:.0f}s'}; "
        + (f"synthetic: {spec.synthetic_rows} rows x {spec.synthetic_keys} keys, d={spec.synthetic_dim}" if spec.synthetic
           else f"{spec.source}, context {spec.context}, {spec.positions} positions x {spec.prompts} prompts")
        + f"; budgets {', '.join(map(str, cfg.budgets))}{', all-key search' if cfg.search == 'all' else ''}"
        + f"{', certified' if certify else ''})")
    return res, rows


def _label_model(path: Path, label: str) -> None:
    """Make sure the results carry a model column (synthetic rows have none)."""
    import polars as pl

    df = read_checked_parquet(path, "run the demo again with --resolve")
    if "model" in df.columns and df["model"].null_count() == 0 and (df["model"] != "").all():
        return
    write_parquet(df.with_columns(pl.lit(label).alias("model")), path)


def write_parquet(df: Any, path: Path) -> Path:
    """Write a polars frame atomically, with its checksum; return ``path``."""
    from evictlab.io import write_checked_parquet

    write_checked_parquet(df, path)
    return path


def hardness_stage(cfg: AnalysisConfig, work: Path, log: Any) -> Any:
    """``evictlab hardness check --trials N --size n --seed S --out WORK`` (a subprocess, like
    stages 1-2, so its input errors name that command's options); returns its trial table.

    Exit status 1 means the exact methods disagreed: that is a result (the claims table
    reports the disagreements), not a failed stage.
    """
    args = ["hardness", "check", "--trials", str(cfg.hardness_trials), "--size", str(cfg.hardness_size),
            "--seed", str(cfg.seed), "--out", str(work), "--overwrite"]
    work.mkdir(parents=True, exist_ok=True)
    _evictlab(args, log, ok=(0, 1), quiet=cfg.quiet)
    trials = work / "trials.parquet"
    if not trials.is_file():
        raise StageError(f"`evictlab {' '.join(args)}` wrote no {trials}; see its message above")
    return read_checked_parquet(trials, f"delete {work} and run the demo again")
