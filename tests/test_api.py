"""The Python API (evictlab/api.py, docs/api.md): the evicting cache in a stock
``model.generate`` against the decode loop and ``evictlab decode``, its bytes against the
store's, hooks removed after an exception, errors under argument names, nothing printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import evictlab
from evictlab.errors import InputError

from cli_helpers import run_cli


def real(test):  # noqa: ANN001, ANN201 - a test decorator
    """Marks a test that loads a real model (from the user cache; pulled on first use)."""
    return pytest.mark.model(pytest.mark.slow(test))


SMOL = "smollm2-135m"
GEMMA = "gemma3-270m"
CONTEXT = 128  # tokens: short, so the real-model tests stay quick
T = 8


def _prompt(tok, context: int = CONTEXT, seed: int = 0):
    from evictlab.tasks.examples import tokenize_task
    from evictlab.tasks.synthetic import make_task

    p = tokenize_task(make_task("needle", context, tok, seed), tok)
    return torch.tensor([p.context_ids]), torch.tensor([p.question_ids])


def _loop_tokens(model, tok, ctx, q, method: str, budget: str, **loop) -> list[int]:
    """The decode loop's greedy tokens (what `evictlab decode` runs), independently of the API."""
    from evictlab.decode.config import DecodeConfig, LoopSettings
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import Budget
    from evictlab.methods import build_method

    cfg = DecodeConfig(mode="physical", budget=Budget.parse(budget), method=build_method(method),
                       loop=LoopSettings(**loop))
    return run_sequence(model, ctx, q, cfg, max_new_tokens=T, tokenizer=tok).tokens[0].tolist()


def _generated(model, ids, cache, **kw) -> list[int]:
    with cache.attached():
        out = model.generate(ids, cache=cache, max_new_tokens=T, **kw)
    return out[0, ids.shape[1]:].tolist()


def _same_until_eos(gen: list[int], ref: list[int], eos) -> None:
    """generate stops at an end-of-sequence token, the loop does not: equal up to there."""
    assert gen == ref[:len(gen)], (gen, ref)
    assert len(gen) == T or gen[-1] in (eos if isinstance(eos, list) else [eos])


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@real
@pytest.mark.parametrize("name, method, budget", [(SMOL, "snapkv", "32"), (GEMMA, "snapkv+pyramidkv", "24/cell")])
def test_generate_matches_the_decode_loop(real_model, name: str, method: str, budget: str) -> None:
    model, tok = real_model(name, "ragged")
    ctx, q = _prompt(tok)
    ref = _loop_tokens(model, tok, ctx, q, method, budget, chunk_size=64)
    before = _hooks(model)
    cache = evictlab.EvictingCache(model, method, budget, question_tokens=q.shape[1], chunk_size=64, max_new_tokens=T)
    gen = _generated(model, torch.cat([ctx, q], 1), cache, do_sample=False)
    _same_until_eos(gen, ref, model.generation_config.eos_token_id)
    assert _hooks(model) == before
    assert cache.compressions >= 2  # the chunked context was compressed (CONTEXT > budget per cell)
    # the bytes reported are the store's own
    b = cache.bytes()
    report = cache.runner.store.bytes()
    assert (b.live, b.allocated) == (report.bytes_live, report.bytes_allocated) and b.report == report
    g = cache.geometry
    assert b.full == g.full_cache_tokens(cache.seen) * 2 * g.head_dim * 4  # float32 K and V
    assert b.live < b.full
    after = [s for s in cache.steps if s.phase == "compress"]
    assert after and all(s.report.live_tokens <= cache.budget_tokens for s in after)


@real
def test_generate_tokens_equal_evictlab_decode(real_model, tmp_path: Path, capsys, monkeypatch) -> None:
    model, tok = real_model(SMOL, "ragged")
    from evictlab.models import loading

    # the CLI's load finds the session's model (loaded above, so the patch never recurses)
    monkeypatch.setattr(loading, "load_model", lambda name, device="cpu", dtype=None, attn_implementation="eager":
                        real_model(name, attn_implementation))
    out = tmp_path / "d.json"
    code, _, err = run_cli(["decode", "--model", SMOL, "--method", "snapkv+adakv", "--budget", "2MiB",
                            "--context", str(CONTEXT), "--max-new-tokens", str(T), "--chunk", "64", "--quiet",
                            "--out", str(out)], capsys, monkeypatch)
    assert code == 0, err
    ref = json.loads(out.read_text())["tokens"]
    ctx, q = _prompt(tok)
    cache = evictlab.EvictingCache(model, "snapkv+adakv", "2MiB", question_tokens=q.shape[1], chunk_size=64)
    gen = _generated(model, torch.cat([ctx, q], 1), cache, do_sample=False)
    _same_until_eos(gen, ref, model.generation_config.eos_token_id)


@real
def test_sampling_runs_and_top_k_1_is_greedy(real_model) -> None:
    model, tok = real_model(SMOL, "ragged")
    ctx, q = _prompt(tok)
    ids = torch.cat([ctx, q], 1)
    kw = dict(question_tokens=q.shape[1], chunk_size=64, compress_every=2)

    def gen(**sample):
        return _generated(model, ids, evictlab.EvictingCache(model, "h2o", "32", **kw), **sample)

    greedy = gen(do_sample=False)
    assert gen(do_sample=True, top_k=1) == greedy
    torch.manual_seed(0)
    first = gen(do_sample=True, temperature=1.5, top_k=0, top_p=1.0)
    torch.manual_seed(0)
    assert gen(do_sample=True, temperature=1.5, top_k=0, top_p=1.0) == first and len(first) >= 1


@real
def test_batch_of_equal_prompts_and_refusals(real_model) -> None:
    model, tok = real_model(SMOL, "ragged")
    ctx, q = _prompt(tok)
    ids = torch.cat([ctx, q], 1)
    before = _hooks(model)
    cache = evictlab.EvictingCache(model, "snapkv", "32", question_tokens=q.shape[1], chunk_size=64)
    with cache.attached():
        out = model.generate(ids.repeat(2, 1), cache=cache, max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 2 and torch.equal(out[0], out[1])  # two copies of one prompt: one answer
    for kw, field in [({"attention_mask": torch.cat([torch.zeros(1, 1, dtype=torch.long),
                                                     torch.ones(1, ids.shape[1] - 1, dtype=torch.long)], 1)},
                       "attention_mask"),
                      ({"num_beams": 2}, "num_beams")]:
        cache = evictlab.EvictingCache(model, "snapkv", "32", question_tokens=q.shape[1], chunk_size=64)
        with pytest.raises(InputError) as exc, cache.attached():
            model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, **kw)
        assert exc.value.field == field
        assert _hooks(model) == before  # detached after the error inside generate


@real
def test_hooks_are_removed_after_an_exception(real_model) -> None:
    model, tok = real_model(SMOL, "ragged")
    ctx, q = _prompt(tok)
    before = _hooks(model)
    cache = evictlab.EvictingCache(model, "snapkv", "32", question_tokens=q.shape[1], chunk_size=64)
    with pytest.raises(RuntimeError, match="user code"):
        with cache.attached():
            model(input_ids=torch.cat([ctx, q], 1), cache=cache, use_cache=True)
            assert _hooks(model) > before  # attached: the model's and the attention modules' hooks
            raise RuntimeError("user code")
    assert _hooks(model) == before
    # the model runs as before without the cache, and the cache goes on after re-attaching
    with cache.attached():
        model(input_ids=torch.tensor([[tok.eos_token_id]]), cache=cache, use_cache=True)
    assert _hooks(model) == before and cache.seen == ctx.shape[1] + q.shape[1] + 1


@real
def test_own_loop_logits_come_from_the_compressed_cache(real_model) -> None:
    model, tok = real_model(SMOL, "ragged")
    ctx, q = _prompt(tok)
    from evictlab.decode.trace import CompressionTrace

    plain = evictlab.EvictingCache(model, "snapkv", "32", question_tokens=q.shape[1], chunk_size=64)
    with pytest.raises(InputError, match="trace=True"):
        plain.trace()
    # one compression (chunk = context); ES_hat's enumeration skipped (max_subsets=1) to stay quick
    cache = evictlab.EvictingCache(model, "snapkv", "32", question_tokens=q.shape[1], chunk_size=ctx.shape[1],
                                   trace=CompressionTrace(max_subsets=1))
    with torch.no_grad(), cache.attached():
        out = model(input_ids=torch.cat([ctx, q], 1), cache=cache, use_cache=True)
    assert out.logits.shape[1] == q.shape[1]  # the question, fed through the compressed cache
    trace = cache.trace()
    assert cache.compressions == 1 and trace.height == cache.geometry.cells
    assert (trace["kept"] <= trace["held"]).all() and trace["es_hat"].null_count() == trace.height
    assert 0 < int(trace["kept"].sum()) <= cache.budget_tokens  # kept after the compression: within the budget


@real
def test_a_local_model_folder(real_model_dir, capsys) -> None:
    model, tok = evictlab.load_model(str(real_model_dir(SMOL)))
    ctx, q = _prompt(tok)
    cache = evictlab.EvictingCache(model, "streaming_llm", "32", question_tokens=q.shape[1], chunk_size=64)
    gen = _generated(model, torch.cat([ctx, q], 1), cache, do_sample=False)
    assert gen and cache.compressions >= 1
    assert capsys.readouterr().out == ""


@real
@pytest.mark.parametrize("kwargs, field", [
    ({"budget": "lots"}, "budget"), ({"budget": "0"}, "budget"), ({"method": "nope"}, "method"),
    ({"method": "snapkv+nope"}, "method"), ({"store": "full"}, "store"), ({"protocol": "aware"}, "protocol"),
    ({"chunk_size": 0}, "chunk_size"), ({"compress_every": -1}, "compress_every"), ({"chunck": 3}, "chunck"),
    ({"scorer_params": {"nonsense": 1}}, "scorer_params"), ({"method": "oracle"}, "method"),
    ({"protocol": "query-aware", "question_tokens": 1}, "question_tokens"),
])
def test_cache_errors_name_the_argument(real_model, kwargs: dict, field: str) -> None:
    model, _ = real_model(SMOL, "ragged")
    args = {"method": "snapkv", "budget": "32", **kwargs}
    with pytest.raises(InputError) as exc:
        evictlab.EvictingCache(model, args.pop("method"), args.pop("budget"), **args)
    assert exc.value.field == field, exc.value


@real
def test_a_budget_below_the_floor_is_refused_at_the_first_forward(real_model) -> None:
    model, tok = real_model(SMOL, "ragged")
    before = _hooks(model)
    cache = evictlab.EvictingCache(model, "snapkv", "8")  # below sinks + recent = 20 per cell
    with pytest.raises(InputError) as exc, cache.attached():
        model.generate(torch.tensor([[1, 2, 3, 4]]), cache=cache, max_new_tokens=2)
    assert exc.value.field == "budget" and _hooks(model) == before


def test_analysis_errors_name_the_argument(tmp_path: Path) -> None:
    with pytest.raises(InputError) as exc:
        evictlab.check_hardness(trials=2, size=4, time_limit=0)
    assert exc.value.field == "time_limit"
    with pytest.raises(InputError) as exc:
        evictlab.check_hardness(trials=0, size=4)
    assert exc.value.field == "trials"
    with pytest.raises(InputError) as exc:
        evictlab.decide_hardness([1, 2, 3], 1, method="guess")
    assert exc.value.field == "method"
    with pytest.raises(InputError) as exc:
        evictlab.capture_rows("smollm2-135m", "a text, not a list")
    assert exc.value.field == "texts"
    with pytest.raises(InputError) as exc:
        evictlab.capture_rows("smollm2-135m", ["x"], source="shakespeare")
    assert exc.value.field == "texts"


def test_hardness_functions_are_the_checker(capsys) -> None:
    from evictlab.hardness.deciders import enumerate_subset

    table, summary = evictlab.check_hardness(trials=4, size=5, seed=1)
    assert table.height == 4 and summary.agreed == 4 and summary.yes == 2
    image = evictlab.reduce_hardness([3, 1, 4, 1, 5], k=2, target=5)
    assert image["problem"] == "zero-es"
    yes, kept = evictlab.decide_hardness(image["values"], image["s"])
    # independent check: plain enumeration of the source instance (1 + 4 = 5: yes)
    assert yes is (enumerate_subset([3, 1, 4, 1, 5], 2, 5) is not None) is True
    assert len(kept) == image["s"]
    assert capsys.readouterr().out == ""


@real
def test_capture_solve_fit_from_python(real_model, tmp_path: Path, capsys) -> None:
    """capture -> solve -> fit_contour -> fit_predictor, in memory, printing nothing; the
    rows and results are those of the commands' own code (re-solved from the files)."""
    import polars as pl

    from evictlab.rows.reader import RowStore

    model, tok = real_model(SMOL)
    texts = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
             "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. " * 4] * 2
    rows = evictlab.capture_rows(model, texts, tokenizer=tok, context=48, positions=2, seed=0)
    assert isinstance(rows, RowStore) and rows.n_rows == 2 * 2 * 30 * 9
    results = evictlab.solve_rows(rows, keep=[4, 8], out=tmp_path / "r.parquet")
    assert results.height == 2 * rows.n_rows and set(results["s"].unique()) == {4, 8}
    again = evictlab.solve_rows(rows.path, keep=[4, 8], out=tmp_path / "again.parquet")
    assert results.drop("wall_s", strict=False).equals(again.drop("wall_s", strict=False))
    prof = evictlab.fit_contour(rows, results)
    assert prof.dropped.shape[:2] == (30, 3) and prof.selection is not None
    with pytest.raises(InputError) as exc:
        evictlab.fit_predictor(results, threshold=0)
    assert exc.value.field == "threshold"
    try:
        pred = evictlab.fit_predictor(results, out=tmp_path / "p.json")
    except InputError as e:  # a short capture may give one class only: then the refusal names why
        assert "both classes" in e.problem
    else:
        assert pred.features == ["dropped_mass"] and (tmp_path / "p.json").exists()
        assert pred.metadata["held_out_auc"]
    assert capsys.readouterr().out == ""
    assert isinstance(results, pl.DataFrame)


def test_every_public_name_is_documented_and_import_is_light() -> None:
    import subprocess
    import sys

    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    for name in evictlab.__all__:
        obj = getattr(evictlab, name)
        assert f"## `{name}" in doc, f"docs/api.md has no section for {name}"
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
    code = "import sys, evictlab; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@real
def test_masked_store_gives_the_physical_tokens_and_holds_everything(real_model) -> None:
    model, tok = real_model(SMOL, "ragged")
    ctx, q = _prompt(tok)
    ids = torch.cat([ctx, q], 1)
    kw = dict(question_tokens=q.shape[1], chunk_size=64)
    physical = evictlab.EvictingCache(model, "snapkv", "32", **kw)
    masked = evictlab.EvictingCache(model, "snapkv", "32", store="masked", **kw)
    assert _generated(model, ids, masked, do_sample=False) == _generated(model, ids, physical, do_sample=False)
    b = masked.bytes()
    assert b.report.kind == "masked" and b.live == b.full  # masking frees nothing (docs/kv.md)
    assert physical.bytes().live < b.live
