"""The main job (``evictlab demo``, run by ``make demo``): capture -> solve -> stats -> predictors -> figures -> report.

Layout:

- :mod:`evictlab.pipeline.config`: settings (:class:`CaptureSpec`, :class:`AnalysisConfig`)
  and :class:`StageError`.
- :mod:`evictlab.pipeline.stages`: the subprocess stages (rows and solver results, cached;
  the hardness check).
- :mod:`evictlab.pipeline.analysis`: :func:`compute` (statistics, predictors, claims,
  figures) returning an :class:`Analysis`; :func:`analyse` = :func:`compute` + the report.
- :mod:`evictlab.pipeline.contour`: the ContourKV section (an evaluation grid in the
  background, then ContourKV against the allocators).
- :mod:`evictlab.pipeline.command`: the typer command ``evictlab demo`` (which rows for
  which model, timings, the run record).
- :mod:`evictlab.pipeline.report`: the report's Markdown text, from an :class:`Analysis`.

Stages 1-2 call the package's own commands (``evictlab capture`` / ``evictlab rows synth``,
then ``evictlab solve``) in a subprocess, exactly as a user would, so the job exercises the
documented interfaces and shows their progress bars. Captured rows are cached under
``runs/cache/rows/<key>`` (the key holds every capture setting), so a second run skips the
model fetch and capture; solver results are cached under ``runs/cache/results/`` keyed by the
rows, budgets, pool and a hash of the solver's source (``--resolve`` re-solves). Stages 3-6
run in-process and write, under ``runs/<name>/``:

    results/<model>.parquet       solver results (one row per (row_id, s))
    tables/*.parquet              summaries, AUC tables, claims (one row per observation)
    predictors/<model>-<set>.json fitted predictors (versioned JSON)
    figures/*.png, *.pdf          the figures
    report.md                     the Markdown report (claims table first)
    run_record.json               git commit, package versions, config, seeds, wall time
"""

from evictlab.pipeline.analysis import Analysis, analyse, compute
from evictlab.pipeline.command import demo
from evictlab.pipeline.config import AnalysisConfig, CaptureSpec, StageError, parse_budgets

__all__ = ["Analysis", "AnalysisConfig", "CaptureSpec", "StageError", "analyse", "compute", "demo",
           "parse_budgets"]
