"""Packaging metadata (issue 28, item 11): the license is an SPDX string (PEP 639), so
setuptools builds the metadata without its deprecation warning for a license table."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_an_spdx_string_and_setuptools_supports_it() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    (req,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(re.fullmatch(r"setuptools>=(\d+).*", req).group(1)) >= 77  # PEP 639 support


def test_metadata_builds_without_a_deprecation_warning(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    (src / "evictlab").mkdir()
    (src / "evictlab" / "__init__.py").write_text("")
    (tmp_path / "out").mkdir()
    code = ("from setuptools import build_meta; "
            f"print(build_meta.prepare_metadata_for_build_wheel({str(tmp_path / 'out')!r}))")
    res = subprocess.run([sys.executable, "-W", "always", "-c", code], cwd=src, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Deprecat" not in res.stderr + res.stdout, res.stderr
    (dist,) = (tmp_path / "out").glob("*.dist-info")
    assert "License-Expression: Apache-2.0" in (dist / "METADATA").read_text()
