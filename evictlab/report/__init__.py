"""Markdown reports and run records."""
