"""The evaluation grid: methods at matched bytes on seeded examples, paired comparisons.

- :mod:`evictlab.eval.spec`: :class:`GridSpec` (the grid the user asked for, validated
  before any model loads) and :class:`CellSpec` (one self-contained, picklable unit of work);
- :mod:`evictlab.eval.runner`: :func:`run_cell` (one cell -> one polars row per example);
- :mod:`evictlab.eval.grid`: :func:`run_grid` (resumable, cell by cell, any executor);
- :mod:`evictlab.eval.compare`: pairing, the tie rule, wins / ties / losses;
- :mod:`evictlab.eval.claims`: the papers' claims, one module per claim (enforcement cost,
  query-aware margin, ContourKV against the allocators);
- :mod:`evictlab.eval.report`: the grid's Markdown report;
- :mod:`evictlab.eval.commands`: ``evictlab eval run`` and ``evictlab eval compare``.

Definitions (modes, protocols, metrics, the tie rule): docs/evaluation.md.
"""
