"""Capture attention rows from real models.

- :mod:`evictlab.capture.hooks`: a context manager that records post-RoPE queries, keys and
  values from the stock transformers attention modules (no copied forwards, no patches).
- :mod:`evictlab.capture.runner`: the resumable, sharded capture run behind ``evictlab capture``
  (its settings in :mod:`~evictlab.capture.config`, one forward -> verified rows in
  :mod:`~evictlab.capture.forward`, the manifest's provenance and the resume check in
  :mod:`~evictlab.capture.provenance`, remote executors in :mod:`~evictlab.capture.remote`).
- :mod:`evictlab.capture.testing`: tiny random-initialised models for tests (no downloads).

Prompts (the Shakespeare corpus, text sources, seeded RULER-style tasks) are :mod:`evictlab.tasks`;
models themselves (registry, loading, geometry, attention sites) are :mod:`evictlab.models`.
Heavy libraries (torch, transformers) are imported inside functions where possible so that
``evictlab --help`` stays fast.
"""
