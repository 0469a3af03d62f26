"""Decoding with evicted KV caches: the loop (``loop.run_sequence``), the masked-vs-physical
audit (``audit.run_audit``), tasks and metrics, and the ``audit``/``decode`` CLI commands.

Nothing heavy is imported here, so ``evictlab --help`` stays fast; import the submodules.
See docs/kv.md.
"""
