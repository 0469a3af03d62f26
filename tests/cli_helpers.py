"""Helpers for tests that run the console entry point in-process."""

from __future__ import annotations

import sys

import pytest


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str],
            monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """Run ``evictlab.cli.main`` (the console entry point) with ``argv``; (exit code, stdout, stderr)."""
    from evictlab import cli

    monkeypatch.setattr(sys, "argv", ["evictlab", *argv])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err
