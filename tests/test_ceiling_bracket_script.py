"""paper_repro/claim_ceiling_bracket.py: the sizes' layer lists fit the registry models (read
from their config files), and bad input is refused in one line before anything is captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evictlab.errors import InputError

SCRIPT = Path(__file__).resolve().parents[1] / "paper_repro" / "claim_ceiling_bracket.py"


@pytest.fixture()
def script(repro_script):
    return repro_script("claim_ceiling_bracket")


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_medium_takes_every_third_layer_ending_at_the_last(script, real_model_dir, model: str) -> None:
    from transformers import AutoConfig

    from evictlab.capture.config import parse_layers
    from evictlab.models.geometry import text_config

    cfg = text_config(AutoConfig.from_pretrained(real_model_dir(model)))
    n_layers = int(cfg.num_hidden_layers)
    layers = parse_layers(script.layers_for("medium", model), n_layers)  # raises if a layer does not exist
    assert layers == list(range(n_layers - 1, -1, -3))[::-1]
    # Gemma 3: every global-attention layer is among them (the layers that see the whole context)
    globals_ = [i for i, kind in enumerate(getattr(cfg, "layer_types", None) or []) if kind == "full_attention"]
    assert set(globals_) <= set(layers)
    if model == "gemma3-270m":
        assert globals_ == [5, 11, 17]


def test_sizes_share_the_prompts_the_intervals_resample(script) -> None:
    assert script.SIZES["medium"]["prompts"] == script.SIZES["full"]["prompts"] == 8
    assert script.SIZES["medium"]["contexts"] == script.SIZES["full"]["contexts"]
    assert script.layers_for("full", "anything") == "all"
    with pytest.raises(InputError, match="--models"):
        script.layers_for("medium", "some-other-model")


def test_a_larger_node_budget_gets_results_of_its_own(script, tmp_path: Path) -> None:
    default = script.results_path(tmp_path, "medium", "smollm2-135m", 1024, script.SIZES["medium"]["nodes"])
    more = script.results_path(tmp_path, "medium", "smollm2-135m", 1024, 4096)
    assert default.name == "results-medium-smollm2-135m-1024.parquet"
    assert more.name == "results-medium-smollm2-135m-1024-nodes4096.parquet"
    assert script.results_path(tmp_path, "small", "smollm2-135m", 1024, 64).name.endswith("-nodes64.parquet")


@pytest.mark.parametrize("args, names", [
    (["--size", "medium", "--models", "nope"], "--models"),
    (["--threads", "0"], "--threads"),
    (["--size", "medium", "--contexts", "512"], "--contexts"),
    (["--size", "small", "--contexts", "4096"], "--contexts"),
    (["--bound-nodes", "0"], "--bound-nodes"),
    (["--bound-nodes", "1000000"], "--bound-nodes"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], names: str) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), *args, "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert names in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()  # refused before anything is created


def test_a_second_run_on_the_same_work_folder_is_refused(tmp_path: Path) -> None:
    from evictlab.io import exclusive_lock

    work = tmp_path / "w"
    work.mkdir()
    with exclusive_lock(work, "--work"):  # as a first run holds it
        r = subprocess.run([sys.executable, str(SCRIPT), "--work", str(work), "--out", str(tmp_path / "o")],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--work" in r.stderr and "another evictlab run" in r.stderr and "Traceback" not in r.stderr
    assert list(work.iterdir()) == []  # nothing captured
