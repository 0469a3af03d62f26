"""Shared pytest settings.

Hypothesis runs derandomized (a fixed seed per test) so CI is deterministic, with no
per-example deadline because the first call of a Numba kernel includes its compile time.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "evictlab",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("EVICTLAB_HYPOTHESIS_PROFILE", "evictlab"))


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (2 CPUs, no dashboard), shut down at the
    end; the executor reuses it (a connected process keeps its connection). Ray starts in
    ~10 s, so every test that needs it lives in tests/test_ray_executor.py."""
    ray = pytest.importorskip("ray", reason="the Ray extra is not installed (pip install 'evictlab[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
