"""Shared pytest settings.

Hypothesis runs derandomized (a fixed seed per test) so CI is deterministic, with no
per-example deadline because the first call of a Numba kernel includes its compile time.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "evictlab",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("EVICTLAB_HYPOTHESIS_PROFILE", "evictlab"))
