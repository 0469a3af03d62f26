"""Exact solvers: candidate-pool enumeration, balancing selector, certified optimum, runner.

* :mod:`evictlab.solve.kernels` -- Numba kernels: pool enumeration (ES_hat), balancing
  selector, and the fused per-batch driver :func:`batch_solve`.
* :mod:`evictlab.solve.localsearch` -- all-key local search (single/pair swaps, kicks): ES_ls.
* :mod:`evictlab.solve.certify` -- branch and bound for the true ES(s) over all keys.
* :mod:`evictlab.solve.bound` -- a certified lower bound on ES(s) at any n (the relaxation, best first).
* :mod:`evictlab.solve.reference` -- itertools / numpy references the kernels are tested against.
* :mod:`evictlab.solve.runner` -- rows -> results Parquet (``evictlab solve``), resumable.
* :mod:`evictlab.solve.ablation` -- the free-weight ablation re-solve of a row sample (``ablation_rows``).

The single-row kernels they build on (ranking, dense output, the candidate pool, the
free-weight solver) are :mod:`evictlab.core`'s; this package has no copies of its own.

Algorithms, limits and certificates: ``docs/solvers.md``.
"""

from __future__ import annotations

__all__ = [
    "BOUND_COLUMNS", "CERT_COLUMNS", "KAPPA_EPS", "LS_COLUMNS", "MAX_SUBSETS", "RESULT_COLUMNS", "SEARCH_MODES", "ZERO_REL", "SolveConfig",
    "SolveSummary", "check_config", "solve_batch", "solve_rows",
]


def __getattr__(name: str) -> object:
    """Lazy re-exports from :mod:`evictlab.solve.runner` (keeps ``evictlab --help`` fast)."""
    if name in __all__:
        from evictlab.solve import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'evictlab.solve' has no attribute {name!r}")
