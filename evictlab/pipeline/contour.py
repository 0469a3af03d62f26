"""The main job's ContourKV section: a small evaluation grid in the decode loop (an
``evictlab eval run`` subprocess, resumable, in the background), then ContourKV against the
other allocators at matched bytes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evictlab.pipeline.config import AnalysisConfig, StageError


@dataclass
class ContourResult:
    """The ContourKV section's inputs to the report: the grid as run, its results, the
    claim rows and the per-comparison table of :func:`evictlab.eval.claims.contour.contourkv_versus`."""

    grid: dict[str, Any]
    folder: Path
    results: Any
    claims: list[Any]
    detail: Any


@dataclass
class ContourJob:
    """A running ContourKV grid (:func:`contour_start`): the subprocess, its grid and folder."""

    proc: subprocess.Popen
    grid: dict[str, Any]
    work: Path
    args: list[str]
    t0: float

    def stop(self) -> None:
        """Stop the grid (the main job failed or was interrupted); a rerun resumes it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def contour_start(grid: dict[str, Any], work: Path, cfg: AnalysisConfig, log: Any) -> ContourJob:
    """Start ``evictlab eval run`` over ``grid`` (keys of
    :data:`evictlab.eval.claims.contour.CONTOUR_FULL_GRID`) into ``work`` (a rerun resumes it) as a
    subprocess, and return at once: the grid needs only the model, so it runs on a second
    core while the single-threaded capture and solve stages run (docs/reproduction.md).
    :func:`contour_finish` waits for it. A subprocess like stages 1-2, so its input errors
    name that command's options."""
    args = ["eval", "run", "--models", ",".join(grid["models"]), "--tasks", ",".join(grid["tasks"]),
            "--context", ",".join(map(str, grid["contexts"])), "--budget", ",".join(grid["budgets"]),
            "--methods", ",".join(grid["methods"]), "--store", ",".join(grid["modes"]),
            "--protocol", ",".join(grid["protocols"]), "--n", str(grid["n"]), "--seed", str(cfg.seed),
            "--threads", str(cfg.threads), "--quiet", "--out", str(work)]
    work.parent.mkdir(parents=True, exist_ok=True)
    log(f"$ evictlab {' '.join(args)}  (in the background)")
    proc = subprocess.Popen([sys.executable, "-m", "evictlab.cli", *args])
    return ContourJob(proc=proc, grid=dict(grid), work=work, args=args, t0=time.perf_counter())


def contour_finish(job: ContourJob, cfg: AnalysisConfig, log: Any) -> ContourResult:
    """Wait for :func:`contour_start`'s grid, then ContourKV against the other allocators at
    matched bytes; raise StageError when the grid failed."""
    from evictlab.eval.claims.contour import contourkv_versus
    from evictlab.io import read_checked_parquet

    if job.proc.poll() is None:
        log("waiting for the ContourKV grid")
    code = job.proc.wait()
    if code != 0:
        raise StageError(f"`evictlab {' '.join(job.args)}` exited with status {code}; see its message above")
    results = read_checked_parquet(job.work / "results.parquet", f"delete {job.work} and run the demo again")
    claims, detail = contourkv_versus(results, seed=cfg.seed, n_boot=cfg.n_boot)
    return ContourResult(grid=job.grid, folder=job.work, results=results, claims=claims, detail=detail)


def contour_stage(grid: dict[str, Any], work: Path, cfg: AnalysisConfig, log: Any) -> ContourResult:
    """:func:`contour_start` then :func:`contour_finish` (the grid in the foreground)."""
    job = contour_start(grid, work, cfg, log)
    try:
        return contour_finish(job, cfg, log)
    finally:
        job.stop()
