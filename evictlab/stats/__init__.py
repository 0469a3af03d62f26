"""Statistics over solver results: selection ceilings, penalties, predictors, bootstrap.

| module | holds |
|---|---|
| `results.py` | reading/checking the solver-results table, derived columns, e(T_s) = 0 split |
| `bootstrap.py` | seeded percentile bootstrap of medians, means and ROC AUC |
| `ceilings.py` | per-(model, s[, layer, head]) summaries: gap closed, kappa-hat, pi(s), selector, certificates |
| `predictors.py` | dropped-mass predictors (calibrated logistic regression) as versioned JSON; AUC tables |
| `penalty.py` | pi(s) against s / head_dim per free-weight definition (from `evictlab.solve.ablation`'s table) |
| `claims.py` | the "Trust the Mass" claims as report rows (paper value vs ours) |
| `planted.py` | planted results tables with a known AUC, for tests |
| `commands.py` | `evictlab predictor fit/eval` |
"""
