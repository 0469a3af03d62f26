"""Generic Markdown helpers for reports (tables, intervals, figures, the claims table); each
report itself lives with its domain (pipeline/report.py, eval/report.py, dilution/report.py,
decode/audit_report.py)."""
