"""Inputs evictlab reads are checked (issue 28, item 8): a ContourKV profile whose dropped
mass rises with the budget is refused on load, naming the file and the cell; a gates.json
whose geometry is missing or edited is refused by `gates info` and by the trimkv scorer
(decode), since the geometry is checked against the spec and the spec against the tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evictlab import cli
from evictlab.capture.testing import tiny_model
from evictlab.contour.fit import fit_profile
from evictlab.contour.profile import ContourProfile
from evictlab.errors import CorruptFileError
from evictlab.gates.files import CONFIG_FILE, geometry_meta, load_gates, save_gates
from evictlab.gates.modules import GateSpec, RetentionGates
from evictlab.methods import make_allocator, make_scorer
from evictlab.rows.synth import SynthConfig, synthesize


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("profile")
    synthesize(root / "rows", SynthConfig(rows=60, keys=32, dim=8, seed=0))
    path = root / "p.json"
    fit_profile(root / "rows").save(path)
    return path


def test_a_profile_whose_dropped_mass_rises_is_refused(profile: Path, tmp_path: Path, capsys) -> None:
    d = json.loads(profile.read_text())
    dropped = d["cells"][0]["dropped"]
    j = max(i for i in range(len(dropped) - 1) if dropped[i] < 0.8)
    dropped[j + 1] = dropped[j] + 0.1  # more dropped with a larger budget
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(CorruptFileError, match=r"bad.json: cell \(layer 0, KV head 0\): the dropped mass rises"):
        ContourProfile.load(bad)
    with pytest.raises(Exception, match="dropped mass rises"):
        make_allocator("contourkv", profile=str(bad))
    assert ContourProfile.load(profile).dropped.shape[-1] == len(d["grid"])  # the fitted one loads
    code = cli.run(["decode", "--model", "smollm2-135m", "--method", "snapkv+contourkv", "--allocator-param",
                    f"profile={bad}", "--out", str(tmp_path / "d.json")])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert code == 2 and "dropped mass rises" in line and str(bad) in line


@pytest.fixture(scope="module")
def gates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, _ = tiny_model("llama")
    folder = tmp_path_factory.mktemp("gates") / "g"
    folder.mkdir()
    save_gates(folder, RetentionGates(GateSpec.for_model(model), seed=0),
               {"model": "tiny-llama", "geometry": geometry_meta(model)})
    return folder


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.pop("geometry"), "has no complete geometry"),
    (lambda c: c["geometry"].pop("head_dim"), "head_dim missing or not valid"),
    (lambda c: c["geometry"].update(n_layers=3), "n_layers 3 in the geometry, 2 in the spec"),
    (lambda c: (c["geometry"].update(n_layers=3), c["spec"].update(n_layers=3)), "does not match its spec"),
])
def test_gates_with_a_missing_or_edited_geometry_are_refused(gates: Path, tmp_path: Path, capsys, edit,
                                                              words) -> None:
    import shutil

    folder = tmp_path / "g"
    shutil.copytree(gates, folder)
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    edit(cfg)
    (folder / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(CorruptFileError, match=words):
        load_gates(folder)
    code = cli.run(["gates", "info", str(folder)])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert code == 2 and words.split()[0] in line
    if "spec" not in words or "geometry" in words:  # decode: the trimkv scorer reads the config before any load
        with pytest.raises(CorruptFileError, match=words):
            make_scorer("trimkv", gates=str(folder))
    assert load_gates(gates)[0].spec.n_layers == 2  # the untouched folder loads
