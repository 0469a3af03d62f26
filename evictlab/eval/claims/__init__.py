"""The papers' evaluation claims as rows: our numbers from a grid beside the paper's, one module per claim.

- :mod:`evictlab.eval.claims.enforcement`: the enforcement cost ("Trust the Mass").
- :mod:`evictlab.eval.claims.margin`: the query-aware retrieval margin.
- :mod:`evictlab.eval.claims.contour`: ContourKV against the standard allocators at matched bytes.
- :mod:`evictlab.eval.claims.common`: what they share (pairing arms, pooled intervals, the
  "paper vs ours" wording, the fields of a claim row).
"""
