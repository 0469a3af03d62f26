"""Users' own text as capture sources (file:PATH, jsonl:PATH:FIELD): round trips, provenance, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evictlab.tasks.sources import build_capture_prompt
from evictlab.capture.config import CaptureConfig
from evictlab.capture.runner import run_capture
from evictlab.capture.testing import ByteTokenizer, tiny_model
from evictlab.tasks.texts import load_text_source, tokens_sha256
from evictlab.errors import InputError
from evictlab.rows import RowStore

TOK = ByteTokenizer()


def _prose(seed: int, lines: int = 60) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "river", "ran", "past", "a", "quiet", "mill", "and", "seven", "geese", "watched", "it"]
    return "\n".join(" ".join(rng.choice(words, size=int(rng.integers(5, 12)))) for _ in range(lines)) + "\n"


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=5)[0]


def _capture(source: str, out: Path, model, prompts: int = 3, context: int = 120):
    cfg = CaptureConfig(model="tiny-llama", source=source, context=context, positions=3, prompts=prompts, seed=2)
    return run_capture(cfg, out, model=model, tokenizer=TOK, progress=False)


def _origins(path: Path) -> list[dict]:
    st = RowStore.open(path)
    return [json.loads(t)["origin"] for t in st.prompts.sort("prompt_id")["text"].to_list()]


def _rebuilt(text: str, origin: dict, n: int) -> list[int]:
    return TOK(text[origin["char_start"]:])["input_ids"][:n]


def test_file_source_round_trip_and_provenance(tmp_path: Path, llama) -> None:
    f = tmp_path / "notes.txt"
    f.write_text(_prose(1), encoding="utf-8")
    s = _capture(f"file:{f}", tmp_path / "rows", llama)
    assert s.rows_total == 3 * 2 * 4 * 3
    st = RowStore.open(tmp_path / "rows")
    assert set(st.prompts["source"].to_list()) == {f"file:{f}"}
    assert st.summary()["source"]["text_sha256"] == load_text_source(f"file:{f}").sha256()
    text = f.read_text()
    for toks, o in zip(st.prompts.sort("prompt_id")["tokens"].to_list(), _origins(tmp_path / "rows")):
        assert o["document"] == "notes.txt" and o["source"] == f"file:{f}" and o["line"] is None
        assert toks == _rebuilt(text, o, 120)  # the recorded offsets rebuild the tokens
        assert o["tokens_sha256"] == tokens_sha256(toks)
        assert o["char_start"] == 0 or text[o["char_start"] - 1] == "\n"  # windows start at a line start


def test_folder_source_spreads_prompts_over_files(tmp_path: Path, llama) -> None:
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    for i, name in enumerate(["a.txt", "b.md", "sub/c.txt"]):
        (d / name).write_text(_prose(10 + i), encoding="utf-8")
    (d / ".hidden").write_text("ignored")
    _capture(f"file:{d}", tmp_path / "rows", llama)
    docs = [o["document"] for o in _origins(tmp_path / "rows")]
    assert sorted(docs) == ["a.txt", "b.md", "sub/c.txt"]  # three prompts, three different files


def test_jsonl_source_round_trip_nested_field(tmp_path: Path, llama) -> None:
    f = tmp_path / "docs.jsonl"
    recs = [{"id": i, "meta": {"body": _prose(20 + i, 30)}} for i in range(4)]
    f.write_text("\n".join(json.dumps(r) for r in recs[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in recs[2:]) + "\n")
    _capture(f"jsonl:{f}:meta.body", tmp_path / "rows", llama, prompts=4)
    st = RowStore.open(tmp_path / "rows")
    lines = {1: 0, 2: 1, 4: 2, 5: 3}  # the blank line 3 is skipped
    seen = set()
    for toks, o in zip(st.prompts.sort("prompt_id")["tokens"].to_list(), _origins(tmp_path / "rows")):
        rec = recs[lines[o["line"]]]
        assert o["document"] == f"docs.jsonl:{o['line']}"
        assert toks == _rebuilt(rec["meta"]["body"], o, 120)
        seen.add(o["line"])
    assert seen == {1, 2, 4, 5}


def test_prompts_are_deterministic_and_resume_refuses_changed_text(tmp_path: Path, llama) -> None:
    f = tmp_path / "t.txt"
    f.write_text(_prose(3), encoding="utf-8")
    a = build_capture_prompt(f"file:{f}", 100, TOK, 7, 1)
    assert a == build_capture_prompt(f"file:{f}", 100, TOK, 7, 1) and a.tokens != build_capture_prompt(f"file:{f}", 100, TOK, 8, 1).tokens
    _capture(f"file:{f}", tmp_path / "rows", llama, prompts=2)
    s = _capture(f"file:{f}", tmp_path / "rows", llama, prompts=3)  # resume: one more prompt
    assert s.prompts_skipped == 2 and s.prompts_written == 1
    f.write_text(_prose(4), encoding="utf-8")
    with pytest.raises(InputError, match="different text"):
        _capture(f"file:{f}", tmp_path / "rows", llama, prompts=4)


@pytest.mark.parametrize("content, field, match", [
    ('{"text": "ok"}\n{"text": \n', "text", r"line 2 is not valid JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', "text", r"line 2 has no field 'text'"),
    ('{"text": ""}\n', "text", r"line 1: field 'text' is empty"),
    ('{"text": 3}\n', "text", r"line 1: field 'text' is a int, not a string"),
    ("\n\n", "text", r"holds no JSON lines"),
])
def test_jsonl_errors_name_file_and_line(tmp_path: Path, content: str, field: str, match: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(InputError, match=match) as exc:
        load_text_source(f"jsonl:{f}:{field}")
    assert str(f) in str(exc.value) and exc.value.field == "--source"


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file or folder"):
        load_text_source(f"file:{tmp_path / 'missing.txt'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no files"):
        load_text_source(f"file:{tmp_path / 'empty'}")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(InputError, match="not UTF-8"):
        load_text_source(f"file:{tmp_path / 'bin.txt'}")
    with pytest.raises(InputError, match="jsonl:PATH:FIELD"):
        load_text_source(f"jsonl:{tmp_path / 'x.jsonl'}")
    with pytest.raises(InputError, match="unknown source"):
        CaptureConfig(source="files:x").check()
    with pytest.raises(InputError, match="query-aware"):
        CaptureConfig(source=f"file:{tmp_path}", mode="query-aware").check()


def test_text_shorter_than_context_names_the_fix(tmp_path: Path) -> None:
    f = tmp_path / "short.txt"
    f.write_text("a few words only\n")
    with pytest.raises(InputError, match=r"longer than short.txt .*longest: 18 tokens") as exc:
        build_capture_prompt(f"file:{f}", 64, TOK, 0, 0)
    assert exc.value.field == "--context" and "--context 18" in str(exc.value)
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "short.txt").write_text("tiny\n")
    (d / "long.txt").write_text(_prose(5))
    # short documents are skipped; every prompt comes from the long one
    assert {build_capture_prompt(f"file:{d}", 64, TOK, 0, i).origin["document"] for i in range(3)} == {"long.txt"}


def test_cli_missing_file_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "evictlab.cli", "capture", "--source", f"file:{tmp_path / 'nope.txt'}",
                           "--context", "64", "--positions", "2", "--prompts", "1", "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no such file or folder" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()


def test_batched_capture_equals_one_prompt_per_forward(tmp_path: Path, llama) -> None:
    f = tmp_path / "t.txt"
    f.write_text(_prose(6, 200), encoding="utf-8")
    base = dict(model="tiny-llama", source=f"file:{f}", context=96, positions=4, prompts=5, seed=1)
    one = run_capture(CaptureConfig(**base, batch=1), tmp_path / "one", model=llama, tokenizer=TOK, progress=False)
    four = run_capture(CaptureConfig(**base, batch=4), tmp_path / "four", model=llama, tokenizer=TOK, progress=False)
    assert one.rows_total == four.rows_total == 5 * 2 * 4 * 4
    a, b = RowStore.open(tmp_path / "one"), RowStore.open(tmp_path / "four")
    assert a.prompts["tokens"].to_list() == b.prompts["tokens"].to_list()
    assert a.meta.equals(b.meta)
    ra, rb = a.get_rows(np.arange(a.n_rows)), b.get_rows(np.arange(b.n_rows))
    assert np.allclose(ra.p, rb.p, rtol=0, atol=1e-6) and np.allclose(ra.values, rb.values, rtol=0, atol=1e-6)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_cuda_capture_equals_cpu(tmp_path: Path) -> None:
    import torch

    f = tmp_path / "t.txt"
    f.write_text(_prose(7, 200), encoding="utf-8")
    base = dict(model="tiny-llama", source=f"file:{f}", context=96, positions=4, prompts=3, seed=1)
    cpu_model = tiny_model("llama", seed=5)[0]
    gpu_model = tiny_model("llama", seed=5)[0].to("cuda")
    run_capture(CaptureConfig(**base), tmp_path / "cpu", model=cpu_model, tokenizer=TOK, progress=False)
    s = run_capture(CaptureConfig(**base, device="cuda"), tmp_path / "gpu", model=gpu_model, tokenizer=TOK,
                    progress=False)
    assert s.max_verify_error < 1e-4 and torch.cuda.is_available()
    a, b = RowStore.open(tmp_path / "cpu"), RowStore.open(tmp_path / "gpu")
    ra, rb = a.get_rows(np.arange(a.n_rows)), b.get_rows(np.arange(b.n_rows))
    assert a.meta.equals(b.meta) and np.allclose(ra.p, rb.p, atol=1e-4)


def test_too_short_text_refused_before_the_dataset_exists(tmp_path: Path, llama) -> None:
    f = tmp_path / "short.txt"
    f.write_text("only a few words\n")
    with pytest.raises(InputError, match="longest: 17 characters"):  # before the model is touched
        _capture(f"file:{f}", tmp_path / "a", None, context=64)

    class PairTokenizer(ByteTokenizer):  # two characters per token
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            b = text.encode("utf-8")
            return {"input_ids": ([1] if add_special_tokens else []) + [b[i] for i in range(0, len(b), 2)]}

    g = tmp_path / "mid.txt"
    g.write_text("x" * 120 + "\n")  # enough characters for 100 tokens, not enough tokens (BOS + 61)
    cfg = CaptureConfig(model="tiny-llama", source=f"file:{g}", context=100, positions=3, prompts=2, seed=2)
    with pytest.raises(InputError, match="longest: 62 tokens"):
        run_capture(cfg, tmp_path / "b", model=llama, tokenizer=PairTokenizer(), progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
