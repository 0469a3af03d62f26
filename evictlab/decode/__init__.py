"""Decoding with evicted KV caches: the loop (``loop.run_sequence``; its settings in
``config``, the evicting engine in ``compress``, the KVzip/oracle inputs in ``extras``), the
masked-vs-physical audit (``audit.run_audit``, its report ``audit_report``), metrics, and the
``audit``/``decode`` CLI commands. Tasks and prompts are :mod:`evictlab.tasks`.

Nothing heavy is imported here, so ``evictlab --help`` stays fast; import the submodules.
See docs/kv.md.
"""
