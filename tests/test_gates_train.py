"""Training retention gates on a tiny model: the loss goes down, a resumed run equals an
uninterrupted one bit for bit, the model comes back untouched (parameters, mode, hooks,
config) even when a step fails, and ``evictlab gates train|info`` through the entry point
(outputs, resume after an interrupted run, one-line refusals naming the option)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import run_cli
from evictlab.capture.testing import ByteTokenizer, save_tiny_folder, tiny_model
from evictlab.errors import InputError
from evictlab.gates import files
from evictlab.gates.data import DataSpec, TrainingData
from evictlab.gates.modules import GateSpec, RetentionGates
from evictlab.gates.train import Recipe, train_gates, train_step


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # bit-identical runs need the same thread count; and it is faster here


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = "the quick brown fox jumps over a lazy dog while birds sing in tall green trees".split()
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(200)))
    return path


def _recipe(text: Path, **kw) -> Recipe:
    # decay_steps fixed: the schedule (so the fingerprint) stays the same when steps changes
    base = dict(steps=6, batch=2, lr=2e-2, warmup=1, capacity=8, checkpoint_every=2, decay_steps=6, pool=8, val=2,
                val_every=3,
                data=DataSpec(seq_len=48, text=f"file:{text}", text_fraction=1.0))
    base.update(kw)
    return Recipe(**base)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(text_file: Path, tmp_path: Path) -> None:
    """The loss of one held batch (not a training batch) before and after 6 steps: it falls,
    and the capacity term (far above budget at beta ~ 1, ``bias_init=8``) carries the fall."""
    model, _ = tiny_model("llama")
    recipe = _recipe(text_file, bias_init=8.0)
    ids, lengths = TrainingData(ByteTokenizer(), recipe.data, seed=99).batch(0, 2)
    spec = GateSpec.for_model(model, intermediate=recipe.intermediate, bias_init=recipe.bias_init)
    m_global = float(spec.n_layers * spec.kv_heads * recipe.capacity)
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        before, t0 = train_step(model, RetentionGates(spec, seed=recipe.seed), ids, lengths, m_global, 1.0)
    train_gates(model, ByteTokenizer(), recipe, tmp_path / "g", model_name="tiny-llama")
    trained, _ = files.load_gates(tmp_path / "g")
    with torch.no_grad():
        after, t1 = train_step(model, trained, ids, lengths, m_global, 1.0)
    assert float(after) < float(before) - 0.05
    assert t1["capacity"] < t0["capacity"] and t1["retained_ratio"] < t0["retained_ratio"]
    assert t1["mean_log_beta"] < t0["mean_log_beta"]  # the gates learned to forget


def _history(folder: Path) -> list[dict]:
    import polars as pl

    return [{k: v for k, v in row.items() if k not in ("wall_s", "cpu_s")}
            for row in pl.read_parquet(folder / files.LOSSES_FILE).to_dicts()]


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(text_file: Path, tmp_path: Path) -> None:
    model, _ = tiny_model("llama")
    tok = ByteTokenizer()
    recipe = _recipe(text_file, data=DataSpec(seq_len=48, text=f"file:{text_file}", text_fraction=1.0))
    whole = train_gates(model, tok, recipe, tmp_path / "whole", model_name="tiny-llama")
    # Interrupted twice (``stop_after`` returns with a checkpoint, as a kill after that
    # checkpoint would leave it), then finished.
    torch.manual_seed(12345)  # global RNG state the resumed run must not depend on
    part = train_gates(model, tok, recipe, tmp_path / "cut", model_name="tiny-llama", stop_after=1)
    assert len(part.history) == 1 and not files.is_finished(tmp_path / "cut")
    assert (tmp_path / "cut" / files.CHECKPOINT_FILE).is_file()
    notes: list[str] = []
    part = train_gates(model, tok, recipe, tmp_path / "cut", model_name="tiny-llama", stop_after=3, note=notes.append)
    assert part.resumed_from == 1 and any("resuming" in n and "step 1" in n for n in notes)
    rest = train_gates(model, tok, recipe, tmp_path / "cut", model_name="tiny-llama")
    assert rest.resumed_from == 4 and files.is_finished(tmp_path / "cut")
    assert not (tmp_path / "cut" / files.CHECKPOINT_FILE).exists()
    assert (tmp_path / "whole" / files.WEIGHTS_FILE).read_bytes() == (tmp_path / "cut" / files.WEIGHTS_FILE).read_bytes()
    a, b = files.load_gates(tmp_path / "whole")[0].state_dict(), files.load_gates(tmp_path / "cut")[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _history(tmp_path / "whole") == _history(tmp_path / "cut")
    assert [asdict(h)["loss"] for h in whole.history] == [r["loss"] for r in _history(tmp_path / "cut")]
    # Same seed, fresh folder: the same bits again; another seed: other gates.
    again = tmp_path / "again"
    train_gates(model, tok, recipe, again, model_name="tiny-llama")
    assert (again / files.WEIGHTS_FILE).read_bytes() == (tmp_path / "whole" / files.WEIGHTS_FILE).read_bytes()
    other = tmp_path / "other"
    train_gates(model, tok, _recipe(text_file, seed=1), other, model_name="tiny-llama")
    assert (other / files.WEIGHTS_FILE).read_bytes() != (again / files.WEIGHTS_FILE).read_bytes()


def test_a_run_can_be_ended_or_extended_at_a_checkpoint(text_file: Path, tmp_path: Path) -> None:
    """``steps`` is not part of the fingerprint: a run stopped at step 4 of 6 and finished
    with ``steps=4`` equals an uninterrupted 4-step run; extended to 6 it equals a 6-step run."""
    model, _ = tiny_model("llama")
    tok = ByteTokenizer()
    train_gates(model, tok, _recipe(text_file, steps=4), tmp_path / "four", model_name="m")
    train_gates(model, tok, _recipe(text_file, steps=6), tmp_path / "six", model_name="m")
    for steps, ref in ((4, "four"), (6, "six")):
        cut = tmp_path / f"cut{steps}"
        train_gates(model, tok, _recipe(text_file, steps=6), cut, model_name="m", stop_after=4)
        res = train_gates(model, tok, _recipe(text_file, steps=steps), cut, model_name="m")
        assert res.resumed_from == 4 and len(res.history) == steps
        assert (cut / files.WEIGHTS_FILE).read_bytes() == (tmp_path / ref / files.WEIGHTS_FILE).read_bytes()
        assert files.read_config(cut)["recipe"]["steps"] == steps
    train_gates(model, tok, _recipe(text_file, steps=6), tmp_path / "late", model_name="m", stop_after=4)
    with pytest.raises(InputError, match="--steps: .*checkpoint at step 4, past --steps 3"):
        train_gates(model, tok, _recipe(text_file, steps=3), tmp_path / "late", model_name="m")


def test_a_checkpoint_of_another_run_is_refused(text_file: Path, tmp_path: Path) -> None:
    model, _ = tiny_model("llama")
    train_gates(model, ByteTokenizer(), _recipe(text_file), tmp_path, model_name="tiny-llama", stop_after=1)
    with pytest.raises(InputError, match=r"--out: .*another run \(recipe.lr: 0.02 -> 0.05\)"):
        train_gates(model, ByteTokenizer(), _recipe(text_file, lr=0.05), tmp_path, model_name="tiny-llama")
    with pytest.raises(InputError, match="--dtype: the recipe trains with a bfloat16 model, this one is float32"):
        train_gates(model, ByteTokenizer(), _recipe(text_file, dtype="bfloat16"), tmp_path / "x", model_name="t")
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_training_leaves_the_model_as_it_found_it_even_when_a_step_fails(text_file: Path, tmp_path: Path) -> None:
    from evictlab.models.sites import find_attention_sites

    model, _ = tiny_model("qwen2")
    model.train()
    model.lm_head.weight.requires_grad_(False)  # a mixed state, restored exactly
    config = model.config.to_dict()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}

    def unchanged() -> None:
        assert model.config.to_dict() == config
        assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
        assert model.training
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        assert all(not s.module._forward_pre_hooks and not s.module._forward_hooks for s in find_attention_sites(model))

    train_gates(model, ByteTokenizer(), _recipe(text_file, steps=2), tmp_path / "ok", model_name="tiny-qwen2")
    unchanged()

    def boom(log, done, total):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_gates(model, ByteTokenizer(), _recipe(text_file, steps=3), tmp_path / "cut", model_name="tiny-qwen2",
                    progress=boom)
    unchanged()
    assert not files.is_finished(tmp_path / "cut")


# ---------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_folder(folder, family="llama")
    return folder


def _main(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    return run_cli(argv, capsys, monkeypatch)


def _train_args(folder: Path, out: Path, text: Path, *extra: str) -> list[str]:
    return ["gates", "train", "--model", str(folder), "--out", str(out), "--steps", "3", "--seq-len", "32",
            "--capacity", "4", "--source", f"file:{text}", "--text-fraction", "1", "--threads", "1",
            "--dtype", "float32", "--checkpoint-every", "1", *extra]


def test_gates_train_and_info_write_what_they_say(tiny_folder: Path, text_file: Path, tmp_path: Path, capsys,
                                                  monkeypatch) -> None:
    out = tmp_path / "g"
    rc, stdout, err = _main(_train_args(tiny_folder, out, text_file), capsys, monkeypatch)
    assert rc == 0, err
    assert "3 steps, final loss" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["gates.json", "gates.safetensors", "losses.parquet",
                                                     "run_record.json"]
    cfg = json.loads((out / "gates.json").read_text())
    assert cfg["model"] == str(tiny_folder) and cfg["recipe"]["steps"] == 3 and cfg["recipe"]["dtype"] == "float32"
    assert cfg["geometry"]["n_layers"] == 2 and cfg["spec"]["shared"] is True and cfg["seed"] == 0
    record = json.loads((out / "run_record.json").read_text())
    assert record["kind"] == "gates.train"
    rc, stdout, err = _main(["gates", "info", str(out)], capsys, monkeypatch)
    assert rc == 0, err
    assert "shared by all layers" in stdout and "M_global: 16 entries" in stdout and "3 steps" in stdout
    # finished gates are not overwritten by accident
    rc, _, err = _main(_train_args(tiny_folder, out, text_file), capsys, monkeypatch)
    assert rc == 2 and "error: --out: " in err and "already holds finished gates" in err
    rc, _, err = _main(_train_args(tiny_folder, out, text_file, "--overwrite", "--local"), capsys, monkeypatch)
    assert rc == 0, err
    assert json.loads((out / "gates.json").read_text())["spec"]["shared"] is False


def test_gates_trained_in_bfloat16_are_found_for_the_float32_model(tiny_folder: Path, text_file: Path,
                                                                     tmp_path: Path, capsys, monkeypatch) -> None:
    """``--dtype bfloat16`` (what ``auto`` picks on CPUs with bfloat16 units) trains on a cast
    copy, but gates.json records the digest of the weights as the registry loads them, so
    ``gates=default`` finds the gates for the float32 model that decode loads (before the fix
    it recorded the bfloat16 copy's digest and refused the model the gates were trained on)."""
    from evictlab.models.loading import load_model, weights_digest

    root = tmp_path / "shipped"
    root.mkdir()
    args = [a if a != "float32" else "bfloat16" for a in _train_args(tiny_folder, root / "tiny", text_file,
                                                                     "--pool", "8", "--val", "2")]
    rc, _, err = _main(args, capsys, monkeypatch)
    assert rc == 0, err
    cfg = json.loads((root / "tiny" / "gates.json").read_text())
    assert cfg["recipe"]["dtype"] == "bfloat16"
    model, _ = load_model(str(tiny_folder))
    assert cfg["weights_digest"] == weights_digest(model)
    assert files.default_gates_for(model, root=root) == root / "tiny"


def test_gates_train_resumes_a_killed_run_from_the_command_line(tiny_folder: Path, text_file: Path, tmp_path: Path,
                                                                capsys, monkeypatch) -> None:
    from evictlab.gates import train as train_mod

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert _main(_train_args(tiny_folder, whole, text_file), capsys, monkeypatch)[0] == 0
    real = train_mod.train_step
    calls = {"n": 0}

    def dies_on_third(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "train_step", dies_on_third)
    rc, _, err = _main(_train_args(tiny_folder, cut, text_file), capsys, monkeypatch)
    assert rc == 130 and "rerun the same command to resume" in err
    assert (cut / files.CHECKPOINT_FILE).is_file() and not files.is_finished(cut)
    monkeypatch.setattr(train_mod, "train_step", real)
    rc, stdout, err = _main(_train_args(tiny_folder, cut, text_file), capsys, monkeypatch)
    assert rc == 0 and "note: resuming" in stdout + err and "at step 2 of 3" in stdout + err
    assert (whole / files.WEIGHTS_FILE).read_bytes() == (cut / files.WEIGHTS_FILE).read_bytes()
    # info on a missing folder: one line
    rc, _, err = _main(["gates", "info", str(tmp_path / "nope")], capsys, monkeypatch)
    assert rc == 2 and err.count("error:") == 1 and "is not a folder" in err


BAD = [
    (["--steps", "0"], "--steps"),
    (["--batch", "0"], "--batch"),
    (["--lr", "-1"], "--lr"),
    (["--seq-len", "8"], "--seq-len"),
    (["--text-fraction", "1.5"], "--text-fraction"),
    (["--text-fraction", "0.5", "--seq-len", "100"], "--seq-len"),  # too short for a synthetic task
    (["--source", "nowhere:x"], "--source"),
    (["--dtype", "float16"], "--dtype"),
    (["--threads", "-1"], "--threads"),
    (["--device", "tpu"], "--device"),
    (["--seed", "-3"], "--seed"),
    (["--capacity", "0"], "--capacity"),
    (["--text-fraction", "0.5", "--seq-len", "256", "--tasks", "needle,nope"], "--tasks"),
]


@pytest.mark.parametrize(("extra", "option"), BAD, ids=[o + "=" + e[1] for e, o in BAD])
def test_gates_train_refuses_bad_input_in_one_line_before_loading(extra: list[str], option: str, tmp_path: Path,
                                                                   text_file: Path, capsys, monkeypatch) -> None:
    import typer.main

    from evictlab import cli

    args = ["gates", "train", "--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "o"),
            "--source", f"file:{text_file}", "--text-fraction", "1", *extra]
    rc, _, err = _main(args, capsys, monkeypatch)
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}: ") and "Fix:" in lines[0], err
    cmd = typer.main.get_command(cli.app).commands["gates"].commands["train"]
    assert option in {o for p in cmd.params for o in p.opts}
    assert not (tmp_path / "o").exists()  # refused before anything was written or loaded


def test_gates_train_refuses_a_foreign_out_folder(tmp_path: Path, text_file: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, _, err = _main(["gates", "train", "--model", "x", "--out", str(out), "--source", f"file:{text_file}",
                        "--text-fraction", "1"], capsys, monkeypatch)
    assert rc == 2 and "error: --out: " in err and "not a gates folder" in err
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_and_trimkv_on_cuda(text_file: Path, tmp_path: Path) -> None:
    """The same code on a GPU: training in bfloat16 (what --dtype auto picks there), then
    trimkv+global in the physical store on the device."""
    from evictlab.decode.config import DecodeConfig
    from evictlab.decode.loop import run_sequence
    from evictlab.gates.train import resolve_dtype
    from evictlab.kv.budget import Budget

    model, _ = tiny_model("llama")
    dtype = resolve_dtype("auto", torch.device("cuda"))
    model = model.to("cuda", getattr(torch, dtype))
    train_gates(model, ByteTokenizer(), _recipe(text_file, steps=2, dtype=dtype), tmp_path / "g", model_name="m")
    cfg = files.read_config(tmp_path / "g")
    assert cfg["training"]["device"].startswith("cuda") and cfg["recipe"]["dtype"] == dtype
    g = torch.Generator().manual_seed(0)
    ctx, q, a = (torch.randint(3, 256, (1, n), generator=g).to("cuda") for n in (120, 4, 6))
    out = run_sequence(model, ctx, q, DecodeConfig.of(mode="physical", budget=Budget("tokens_per_cell", 24),
                                                   scorer="trimkv", allocator="global", chunk_size=40,
                                                   scorer_params={"gates": str(tmp_path / "g")}), answer_ids=a)
    assert torch.isfinite(out.logits.float()).all() and out.compressions >= 2
