"""evictlab: exact analysis of KV-cache eviction.

The stable Python API (docs/api.md) is re-exported here from :mod:`evictlab.api` and loaded
on first use, so ``import evictlab`` (and ``evictlab --help``) imports neither torch nor
transformers.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["CacheBytes", "EvictingCache", "RowDataset", "capture_rows", "check_hardness", "decide_hardness",
           "fit_contour", "fit_predictor", "load_model", "reduce_hardness", "solve_rows"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from evictlab import api

        return getattr(api, name)
    raise AttributeError(f"module 'evictlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
