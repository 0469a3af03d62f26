"""Attention dilution: useful mass, its bounds on captured rows, and the distractor sweep.

* :mod:`evictlab.dilution.labels` -- useful keys U from a dataset's fact labels; refuses unlabelled data.
* :mod:`evictlab.dilution.measures` -- alpha, margins, bounds, alpha_A, error scaling on one block (numpy).
* :mod:`evictlab.dilution.reference` -- the same quantities for one row, written out (tests compare).
* :mod:`evictlab.dilution.keptsets` -- kept sets: top-mass, the row-evaluable scorers, the pool optimum.
* :mod:`evictlab.dilution.check` -- ``evictlab dilution check`` (tables, bound checks, report).
* :mod:`evictlab.dilution.sweep` -- ``evictlab dilution sweep`` (decode loop at matched bytes), on the
  needle tasks with k near-miss distractors of :mod:`evictlab.tasks.distractors`.
* :mod:`evictlab.dilution.report` -- both commands' Markdown reports.

Definitions and proofs: docs/theory.md section 7; usage and results: docs/dilution.md.
"""
