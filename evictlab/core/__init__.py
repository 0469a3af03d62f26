"""Single-row math of forced-weight KV-cache eviction.

``reference`` is plain numpy for one row (obviously correct, validated inputs);
``kernels`` is the Numba fast path over ragged batches of rows (layout in
``docs/architecture.md``); ``validate`` holds the input checks both use.
Definitions: ``docs/theory.md``, "Single-row definitions".
"""
