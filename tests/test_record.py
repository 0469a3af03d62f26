"""Run records name the installed packages that differ from the pins in constraints.txt."""

from __future__ import annotations

import importlib.metadata as md
import json
import re

import pytest

from evictlab import cli
from evictlab import record
from evictlab.record import RunRecord, drift_lines, read_constraints, version_drift


def _pin(tmp_path, text: str):
    path = tmp_path / "constraints.txt"
    path.write_text(text)
    return path


def test_no_drift_when_pins_match(tmp_path):
    path = _pin(tmp_path, f"# header\nnumpy=={md.version('numpy')}\npolars=={md.version('polars')}  # comment\n")
    assert version_drift(path) == {}


def test_drift_names_installed_and_pinned(tmp_path):
    path = _pin(tmp_path, f"NumPy==0.0.1\npolars=={md.version('polars')}\nnot-installed-pkg==1.0\n")
    assert version_drift(path) == {"numpy": {"installed": md.version("numpy"), "pinned": "0.0.1"}}
    (line,) = drift_lines(version_drift(path))
    assert line == f"numpy {md.version('numpy')} installed, 0.0.1 pinned in constraints.txt"


def test_names_are_compared_as_pip_does_and_local_labels_ignored(tmp_path):
    te = md.version("typing_extensions")
    path = _pin(tmp_path, f"typing-extensions=={te}+cpu\nTyping.Extensions=={te}\n")
    assert version_drift(path) == {}
    assert read_constraints(path) == {"typing-extensions": te}


def test_no_constraints_file_means_unknown(tmp_path):
    assert version_drift(tmp_path / "absent.txt") is None
    assert drift_lines(None) == []


def test_run_record_carries_version_drift(tmp_path, monkeypatch):
    monkeypatch.setattr(record, "CONSTRAINTS", _pin(tmp_path, "numpy==0.0.1\n"))
    out = RunRecord(kind="test").write(tmp_path / "run_record.json")
    drift = json.loads(out.read_text())["version_drift"]
    assert drift == {"numpy": {"installed": md.version("numpy"), "pinned": "0.0.1"}}


def test_version_command_notes_drift(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(record, "CONSTRAINTS", _pin(tmp_path, "numpy==0.0.1\n"))
    assert cli.run(["version"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "0.1.0"
    assert err.strip() == f"note: numpy {md.version('numpy')} installed, 0.0.1 pinned in constraints.txt"


def _closure() -> set[str]:
    """Canonical names of every distribution evictlab[test,ray] and torch pull in, as installed."""
    from packaging.requirements import Requirement

    canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    seen: set[tuple[str, frozenset[str]]] = set()
    stack = [("evictlab", frozenset({"test", "ray"})), ("torch", frozenset())]
    while stack:
        name, extras = stack.pop()
        if (canon(name), extras) in seen:
            continue
        seen.add((canon(name), extras))
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            envs = [{"extra": e} for e in (extras or {""})]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                stack.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen} - {"evictlab"}


def test_constraints_pin_every_installed_dependency():
    """constraints.txt pins the whole transitive closure (regenerate it with `make constraints`)."""
    try:
        md.distribution("evictlab")
    except md.PackageNotFoundError:
        pytest.skip("evictlab is not installed as a distribution here")
    pins = read_constraints()
    assert pins is not None, "constraints.txt is missing at the top of the repository"
    missing = sorted(_closure() - set(pins))
    assert not missing, f"constraints.txt lacks {missing}; run `make constraints`"


def test_run_record_names_the_commit_the_run_started_from(tmp_path, monkeypatch):
    import evictlab.record as record

    states = iter([{"commit": "a" * 40, "dirty": False}, {"commit": "b" * 40, "dirty": False}])
    monkeypatch.setattr(record, "git_state", lambda: next(states))
    d = record.RunRecord(kind="t").to_dict()  # a commit lands while the run goes on
    assert d["git"]["commit"] == "a" * 40 and d["git_at_end"]["commit"] == "b" * 40
    monkeypatch.setattr(record, "git_state", lambda: {"commit": "c" * 40, "dirty": False})
    assert "git_at_end" not in record.RunRecord(kind="t").to_dict()  # unchanged: one state
