"""Figures: one function per figure, each from a polars table to PNG + PDF files.

| module | figure |
|---|---|
| `gap.py` | gap-closed distributions per budget and model (ECDF) |
| `penalty.py` | forced-weight penalty pi(s) against s, with CIs and the paper's values |
| `roc.py` | ROC curves of the gap predictors, AUC in the legend |
| `mass_kappa.py` | dropped mass against kappa-hat, with the significance threshold |
| `heatmap.py` | per-(layer, head) median gap closed |

Each function returns a :class:`~evictlab.plots.common.Figure` (paths and caption).
"""
