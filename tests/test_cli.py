"""The console entry point: evictlab errors become one line and exit 2; typer.Exit codes pass through."""

from __future__ import annotations

import sys

import pytest
import typer

from evictlab import cli
from evictlab.errors import InputError


@pytest.fixture()
def temp_commands():
    """Register two throwaway commands and remove them afterwards."""
    before = list(cli.app.registered_commands)

    @cli.app.command("zz-exit")
    def _exit() -> None:
        raise typer.Exit(3)

    @cli.app.command("zz-bad")
    def _bad() -> None:
        raise InputError("--budget", "must be positive, got -1", "pass a budget >= 1")

    yield
    cli.app.registered_commands[:] = before


def _run(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["evictlab", *argv])
    with pytest.raises(SystemExit) as info:
        cli.main()
        raise SystemExit(0)
    return int(info.value.code or 0)


def test_exit_code_passes_through(temp_commands, monkeypatch):
    assert _run(monkeypatch, "zz-exit") == 3


def test_input_error_is_one_line_and_exit_2(temp_commands, monkeypatch, capsys):
    assert _run(monkeypatch, "zz-bad") == 2
    err = capsys.readouterr().err
    assert "--budget: must be positive, got -1. Fix: pass a budget >= 1" in err
    assert "Traceback" not in err


def test_version_succeeds(monkeypatch, capsys):
    assert _run(monkeypatch, "version") == 0
    assert capsys.readouterr().out.strip() == "0.1.0"
