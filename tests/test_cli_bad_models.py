"""Hostile or damaged local model folders (issue 28, item 5): one line naming the file and
the fix, exit 2, nothing written; never a traceback, and a blocked pickle is never run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evictlab import cli
from evictlab.capture.testing import save_tiny_folder

RAN = "/tmp/evictlab-test-pickle-payload-ran"


class _Payload:
    """Unpickling this would call os.system (touch RAN): the safe loader must refuse it."""

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {RAN}",))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    base = tmp_path_factory.mktemp("models")
    out = {}
    for name in ("random_safetensors", "blocked_pickle"):
        folder = base / name
        save_tiny_folder(folder, "llama")
        out[name] = folder
    (out["random_safetensors"] / "model.safetensors").write_bytes(os.urandom(4096))
    (out["blocked_pickle"] / "model.safetensors").unlink()
    torch.save({"weight": _Payload()}, out["blocked_pickle"] / "pytorch_model.bin")
    return out


@pytest.mark.parametrize("command", [["decode", "--context", "64", "--out", "{tmp}/d.json"],
                                     ["capture", "--context", "64", "--positions", "2", "--prompts", "1",
                                      "--out", "{tmp}/rows"]])
@pytest.mark.parametrize("folder,file,words", [("random_safetensors", "model.safetensors", "not a readable safetensors"),
                                               ("blocked_pickle", "pytorch_model.bin", "will not load safely")])
def test_bad_weights_are_one_line_naming_the_file(folders, tmp_path: Path, capsys, command, folder, file,
                                                  words) -> None:
    Path(RAN).unlink(missing_ok=True)
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    code = cli.run([args[0], "--model", str(folders[folder]), *args[1:]])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"error: {folders[folder] / file}: ") and words in lines[0] and "Fix:" in lines[0]
    assert "weights_only` set to `False" not in lines[0]  # never the advice to load it unsafely
    assert not Path(RAN).exists()  # the payload did not run
    assert not (tmp_path / "d.json").exists() and not (tmp_path / "rows" / "manifest.json").exists()
