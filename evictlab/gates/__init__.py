"""Learned retention gates (TRIM-KV / DBTrimKV): the gates, their hooks, training and files.

A retention gate predicts, for every KV entry ``i`` of every (layer, KV head) cell, a
retention ``beta_i`` in (0, 1) from the token's normed hidden state; at step ``t`` the
entry's retention is ``beta_i ** (t - i)`` and its eviction score ``(t - i) log beta_i``.
The base model stays frozen; only the gates are trained. Definitions: docs/theory.md
(section 13; the global allocator: section 10); usage: docs/gates.md.

- :mod:`evictlab.gates.modules`: :class:`GateSpec` and :class:`RetentionGates` (one small
  MLP per layer; the final projection and bias shared by all layers, or per layer for the
  ``local`` ablation).
- :mod:`evictlab.gates.hooks`: context managers that attach gates to a stock model through
  forward pre-hooks on its attention modules: :func:`gated_attention` (training: adds the
  retention bias ``(t - i) log beta_i`` to the attention mask) and :func:`recording_gates`
  (inference: hands every appended token's ``log beta`` to a callback).
- :mod:`evictlab.gates.side`: :class:`LogBetaTable`, the per-cell side array of ``log beta``
  kept beside the KV store (synced by position with what the store holds).
- :mod:`evictlab.gates.loss`: the retention bias, the capacity loss and the distillation loss.
- :mod:`evictlab.gates.data`: training sequences (Shakespeare windows before the held-out
  split, synthetic tasks with seeds disjoint from evaluation seeds).
- :mod:`evictlab.gates.files`: gates as safetensors + JSON, checkpoints.
- :mod:`evictlab.gates.train`: the recipe and the resumable training loop.
- :mod:`evictlab.gates.commands`: ``evictlab gates train|info``.

Nothing heavy is imported here, so ``evictlab --help`` stays fast; import the submodules.
"""
