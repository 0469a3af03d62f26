"""Shared pytest settings.

Hypothesis runs derandomized (a fixed seed per test) so CI is deterministic, with no
per-example deadline because the first call of a Numba kernel includes its compile time.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

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

#: The folder of the paper-reproduction scripts (not a package: each imports its ``_common``).
PAPER_REPRO = Path(__file__).resolve().parents[1] / "paper_repro"


@pytest.fixture()
def repro_script(monkeypatch: pytest.MonkeyPatch):
    """``repro_script(name)`` -> the module ``paper_repro/<name>.py``, imported afresh, with
    its folder on ``sys.path`` for this test only (so the script finds its ``_common``)."""
    monkeypatch.syspath_prepend(str(PAPER_REPRO))

    def load(name: str):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load


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


@pytest.fixture(scope="session")
def real_model():
    """The registry's real models, loaded once per test session and shared by every test:
    ``real_model(name, attn_implementation="eager") -> (model, tokenizer)``.

    Loads go through :func:`evictlab.models.loading.load_cached` (the cache every
    long-running command uses), which pulls a model into the user cache on first use, so a
    clean clone runs these tests instead of skipping them. Its cache is raised for the
    session so the models the suite uses (SmolLM2 eager and ragged, Gemma 3) all stay
    loaded, and library code that loads through it (the eval grid) finds them too. Tests
    must not change a shared model (weights, config, hooks left behind)."""
    from evictlab.models import loading

    old = loading.CACHE_SIZE
    loading.CACHE_SIZE = max(old, 4)

    def get(name: str, attn_implementation: str = "eager"):
        if attn_implementation != "eager":
            from evictlab.kv.cache import register_ragged_attention

            if attn_implementation == "ragged":
                attn_implementation = register_ragged_attention()
        return loading.load_cached(name, "cpu", attn_implementation=attn_implementation)

    try:
        yield get
    finally:
        loading.CACHE_SIZE = old
        loading.clear_loaded()


@pytest.fixture(scope="session")
def real_model_dir():
    """``real_model_dir(name) -> folder`` of a registry model, pulled into the user cache if it
    is not there yet (for tests that read only its files, e.g. the tokenizer)."""
    from evictlab.models.pull import pull
    from evictlab.models.registry import MANIFEST, model_dir

    def get(name: str):
        folder = model_dir(name)
        return folder if (folder / MANIFEST).is_file() else pull(name)

    return get


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder (``evictlab.capture.testing.save_tiny_folder``), one per
    test module: what the engine's grid tests run on in seconds."""
    from evictlab.capture.testing import save_tiny_folder

    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_folder(folder, "llama")
    return folder


@pytest.fixture()
def one_torch_thread() -> None:
    """One torch thread for the test (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``):
    the engine's grids compare bits across runs, and two xdist workers share the 2 cores."""
    import torch

    torch.set_num_threads(1)
