"""The converging gate recipe on tiny models: the top-k KL against the exact one, the cached
teacher (reused, checked, recomputed when damaged or stale), the pool's epochs, the
schedule, the start at the budget, the capacity weight that drives the retained mass to the
budget, and ``gates=default`` (the shipped gates of the loaded model; another model's run
refused in one line). The shipped SmolLM2 gates reproduce their recorded validation loss
(real model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evictlab.capture.testing import ByteTokenizer, tiny_model
from evictlab.errors import InputError
from evictlab.gates import files
from evictlab.gates import teacher as teacher_mod
from evictlab.gates.data import DataSpec, TrainingData, step_indices
from evictlab.gates.loss import distillation_terms, retained_mass, topk_distillation_terms
from evictlab.gates.teacher import teacher_targets, topk_of_logits
from evictlab.gates.train import Recipe, _lr, budget_bias, convergence, train_gates


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = "the quick brown fox jumps over a lazy dog while birds sing in tall green trees".split()
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(200)))
    return path


def _recipe(text: Path, **kw) -> Recipe:
    base = dict(steps=4, batch=2, lr=2e-2, warmup=1, capacity=8, checkpoint_every=2, pool=6, val=2, val_every=2,
                data=DataSpec(seq_len=48, text=f"file:{text}", text_fraction=1.0))
    base.update(kw)
    return Recipe(**base)


# ------------------------------------------------------------------ the top-k KL


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 12), scale=st.floats(0.1, 5.0))
def test_topk_kl_is_a_lower_bound_and_exact_at_the_vocabulary(seed: int, k: int, scale: float) -> None:
    """Coarsening to the teacher's top k plus the rest never raises the KL (data processing),
    and with k = V it is the full KL of ``distillation_terms``; the cross-entropy is the same."""
    g = torch.Generator().manual_seed(seed)
    b, T, V = 2, 5, 12
    s, t = torch.randn(b, T, V, generator=g) * scale, torch.randn(b, T, V, generator=g) * scale
    ids = torch.randint(0, V, (b, T), generator=g)
    lengths = torch.tensor([5, 3])
    ce, kl = distillation_terms(s, t, ids, lengths)
    idx, lp, tail = topk_of_logits(t[:, :-1], k)
    ce_k, kl_k = topk_distillation_terms(s, ids, lengths, idx, lp, tail)
    assert float(ce_k) == pytest.approx(float(ce), abs=1e-5)
    assert float(kl_k) <= float(kl) + 1e-5 and float(kl_k) >= -1e-6
    idx, lp, tail = topk_of_logits(t[:, :-1], V)
    assert torch.isinf(tail).all()
    assert float(topk_distillation_terms(s, ids, lengths, idx, lp, tail)[1]) == pytest.approx(float(kl), abs=1e-5)


def test_topk_kl_gradient_is_finite_at_full_coverage() -> None:
    s = torch.randn(1, 4, 6, requires_grad=True)
    t = torch.randn(1, 4, 6)
    ids = torch.randint(0, 6, (1, 4))
    for k in (2, 6):
        idx, lp, tail = topk_of_logits(t[:, :-1], k)
        ce, kl = topk_distillation_terms(s, ids, None, idx, lp, tail)
        (grad,) = torch.autograd.grad(ce + kl, s)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0


# ------------------------------------------------------------------ the teacher cache


def test_teacher_outputs_are_cached_checked_and_recomputed_when_damaged(tmp_path: Path, text_file: Path,
                                                                         monkeypatch) -> None:
    model, _ = tiny_model("llama")
    data = TrainingData(ByteTokenizer(), DataSpec(seq_len=40, text=f"file:{text_file}", text_fraction=1.0), 0)
    ids, lengths = data.pool(5, 2)
    key = {"model": "tiny", "seed": 0}
    first, path = teacher_targets(model, ids, lengths, 8, tmp_path, key, chunk=3)
    with torch.no_grad():  # the cached values are the teacher's own top-k
        want = topk_of_logits(model(input_ids=ids, use_cache=False).logits[:, :-1], 8)
    assert torch.equal(first.top_idx, want[0]) and torch.allclose(first.top_logp, want[1], atol=1e-5)
    assert torch.allclose(first.tail_logp, want[2], atol=1e-5)
    calls: list[int] = []
    real = teacher_mod._compute
    monkeypatch.setattr(teacher_mod, "_compute", lambda *a, **k: calls.append(1) or real(*a, **k))
    again, path2 = teacher_targets(model, ids, lengths, 8, tmp_path, key, chunk=3)
    assert path2 == path and not calls and torch.equal(again.top_logp, first.top_logp)  # read, not recomputed
    notes: list[str] = []
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    fixed, _ = teacher_targets(model, ids, lengths, 8, tmp_path, key, chunk=3, note=notes.append)
    assert calls == [1] and len(notes) == 1 and "SHA-256" in notes[0] and path.name in notes[0]
    assert torch.equal(fixed.top_idx, first.top_idx)
    # other sequences or another k: another file (the key), never the old one
    _, other = teacher_targets(model, ids, lengths, 4, tmp_path, key, chunk=3)
    assert other != path


def test_pool_epochs_visit_every_sequence_once_and_steps_are_pure() -> None:
    pool, batch = 7, 3
    draws = [i for s in range(7) for i in step_indices(5, s, batch, pool)]  # 21 draws = 3 epochs
    for e in range(3):
        assert sorted(draws[e * pool:(e + 1) * pool]) == list(range(pool))
    assert step_indices(5, 4, batch, pool) == draws[12:15]
    assert draws != [i for s in range(7) for i in step_indices(6, s, batch, pool)]


# ------------------------------------------------------------------ schedule and start


def test_cosine_schedule_warms_up_decays_to_its_floor_and_ignores_the_total(text_file: Path) -> None:
    r = _recipe(text_file, steps=20, warmup=4, lr=1.0, min_lr=0.1)
    assert r.decay_steps == 20
    assert [_lr(r, s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert _lr(r, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert _lr(r, 20) == pytest.approx(0.1) and _lr(r, 50) == pytest.approx(0.1)
    longer = _recipe(text_file, steps=40, warmup=4, lr=1.0, decay_steps=20)
    assert [_lr(longer, s) for s in range(30)] == [_lr(r, s) for s in range(30)]
    assert _recipe(text_file, schedule="constant", warmup=0, lr=0.5).lr == 0.5
    assert _lr(_recipe(text_file, schedule="constant", warmup=0, lr=0.5), 3) == 0.5


@pytest.mark.parametrize("T,M", [(256, 64), (48, 8), (2048, 100)])
def test_auto_bias_starts_every_cell_at_the_budget(T: int, M: int) -> None:
    """Uniform ``log beta = logsigmoid(budget_bias)``: ``S_{T-1}`` is exactly ``M`` per cell."""
    lb = torch.nn.functional.logsigmoid(torch.tensor(budget_bias(T, M))).expand(1, T, 1)
    assert float(retained_mass([lb])[0, -1]) == pytest.approx(M, rel=1e-4)
    assert budget_bias(64, 64) == 8.0


def test_bad_recipe_values_are_refused_naming_the_option(text_file: Path) -> None:
    for kw, option in ((dict(schedule="linear"), "--schedule"), (dict(min_lr=2.0), "--min-lr"),
                       (dict(pool=0), "--pool"), (dict(pool=1000), "--pool"), (dict(val=-1), "--val"),
                       (dict(topk=0), "--topk"), (dict(capacity_adapt=-1.0), "--capacity-adapt"),
                       (dict(budget_weight=-1.0), "--budget-weight"),
                       (dict(bias_init="high"), "--bias-init"), (dict(decay_steps=0), "--decay-steps")):
        with pytest.raises(InputError, match=f"^{option}: "):
            _recipe(text_file, **kw)


# ------------------------------------------------------------------ the capacity term reaches its target


def test_the_budget_term_drives_the_retained_mass_to_the_budget(text_file: Path, tmp_path: Path) -> None:
    """Started far above the budget (beta ~ 1: 6x M_global), the capacity hinge alone at a
    small fixed weight leaves the mass far above it; with the two-sided budget term the
    training batches' mass over the last quarter averages within 10% of the budget and the
    validation sequences' within 20% (a tiny random model: its mass varies a lot from one
    sequence to the next; SmolLM2's numbers are in docs/gates.md)."""
    import polars as pl

    model, _ = tiny_model("llama")
    tok = ByteTokenizer()
    common = dict(steps=40, batch=2, lr=2e-2, warmup=2, capacity=10, bias_init=8.0, pool=12, val=4, val_every=10,
                  checkpoint_every=40, capacity_weight=0.05,
                  data=DataSpec(seq_len=64, text=f"file:{text_file}", text_fraction=1.0))
    hinge, budget = tmp_path / "hinge", tmp_path / "budget"
    train_gates(model, tok, Recipe(**common, budget_weight=0.0), hinge, model_name="tiny")
    train_gates(model, tok, Recipe(**common, budget_weight=100.0), budget, model_name="tiny")
    v_hinge = files.read_config(hinge)["validation"]
    v = files.read_config(budget)["validation"]
    assert v[0]["step"] == 0 and v[0]["retained_mean"] > 4.0  # the start: everything kept
    assert v_hinge[-1]["retained_mean"] > 4.0
    rows = pl.read_parquet(budget / files.LOSSES_FILE).to_dicts()
    last_quarter = [r["retained_mean"] for r in rows[30:]]
    assert abs(float(np.mean(last_quarter)) - 1.0) <= 0.10, last_quarter
    assert abs(v[-1]["retained_mean"] - 1.0) <= 0.20, v[-1]
    assert v[-1]["budget"] == pytest.approx((v[-1]["retained_mean"] - 1.0) ** 2)
    conv = convergence(rows, v)
    assert conv["retained_over_budget"]["mean"] == v[-1]["retained_mean"]
    assert conv["kl_last_quarter"]["steps"] == [30, 39]
    assert conv["kl_validation_last_quarter"]["first"]["step"] == 30


# ------------------------------------------------------------------ gates=default


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> Path:
    """A data/gates-like root holding tiny-llama gates (with the model's weights digest)."""
    root = tmp_path_factory.mktemp("shipped")
    model, _ = tiny_model("llama")
    train_gates(model, ByteTokenizer(), _recipe(text_file, steps=2, capacity=12), root / "tiny-llama",
                model_name="tiny-llama")
    return root


def test_default_gates_pick_the_loaded_models_set_and_refuse_another(shipped: Path, monkeypatch) -> None:
    from evictlab.models.loading import weights_digest

    llama, _ = tiny_model("llama")
    assert files.read_config(shipped / "tiny-llama")["weights_digest"] == weights_digest(llama)
    assert files.default_gates_for(llama, root=shipped) == shipped / "tiny-llama"
    gemma, _ = tiny_model("gemma3")
    with pytest.raises(InputError) as exc:
        files.default_gates_for(gemma, root=shipped)
    text = str(exc.value)
    assert "\n" not in text and text.startswith("scorer_param: gates=default: no shipped gates for this model")
    assert "shipped: tiny-llama (2 layers x 2 KV heads)" in text and "evictlab gates train" in text
    with pytest.raises(InputError, match="shipped: none under"):
        files.default_gates_for(llama, root=shipped / "nothing")


def test_gates_default_through_the_decode_loop(shipped: Path, monkeypatch) -> None:
    """``trimkv+global`` with ``gates=default`` runs on the model the shipped gates are for,
    exactly as with their folder named, and refuses another model's run in one line."""
    from evictlab.decode.config import DecodeConfig
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import Budget
    from evictlab.methods.registry import make_scorer

    monkeypatch.setattr(files, "SHIPPED_DIR", shipped)
    assert make_scorer("trimkv", gates="default").is_default

    def run(model, gates: str):
        g = torch.Generator().manual_seed(0)
        ctx, q, a = (torch.randint(3, 256, (1, n), generator=g) for n in (100, 5, 8))
        cfg = DecodeConfig.of(mode="physical", budget=Budget("tokens_per_cell", 30), scorer="trimkv",
                              allocator="global", chunk_size=40, compress_every=6, block_size=8, sinks=2, recent=6,
                              scorer_params={"gates": gates})
        return run_sequence(model, ctx, q, cfg, answer_ids=a)

    llama, _ = tiny_model("llama")
    by_default, by_folder = run(llama, "default"), run(llama, str(shipped / "tiny-llama"))
    assert torch.equal(by_default.logits, by_folder.logits)
    assert all(torch.equal(x, y) for x, y in zip(by_default.context_kept, by_folder.context_kept))
    gemma, _ = tiny_model("gemma3")
    with pytest.raises(InputError, match="^scorer_param: gates=default: no shipped gates for this model"):
        run(gemma, "default")
    monkeypatch.setattr(files, "SHIPPED_DIR", shipped / "nothing")
    with pytest.raises(InputError, match="gates=default: no shipped gates under"):
        make_scorer("trimkv", gates="default")


# ------------------------------------------------------------------ the shipped SmolLM2 gates


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, folder", [
    ("smollm2-135m", files.SHIPPED_DIR / "smollm2-135m"),
    ("gemma3-270m", files.SHIPPED_DIR / "gemma3-270m"),
    ("smollm2-135m", ROOT / "data" / "ablation" / "gates-smollm2-135m-local"),  # the ablation's, not a default
], ids=["smollm2", "gemma3", "smollm2-local"])
def test_shipped_gates_load_and_reproduce_their_validation(name: str, folder: Path, real_model,
                                                           tmp_path: Path) -> None:
    """The committed gates (data/gates/<model>, and the ablation's local gates): those under
    data/gates are picked by gates=default for their registry model, and on their recorded
    validation sequences (regenerated, the teacher recomputed) every set gives the recorded
    validation loss terms and retained mass."""
    from evictlab.gates.train import validate
    from evictlab.models.loading import load_model

    if not files.is_finished(folder):
        pytest.skip(f"no gates in {folder} in this checkout")
    model, tok = real_model(name)
    if folder.parent == files.SHIPPED_DIR:
        assert files.default_gates_for(model) == folder
    else:
        assert files.default_gates_for(model) != folder
    gates, cfg = files.load_gates(folder)
    recipe = Recipe.from_dict(cfg["recipe"])
    if recipe.dtype != "float32":  # validated as trained: the frozen model in the recipe's dtype (a copy)
        model, _ = load_model(name, dtype=getattr(torch, recipe.dtype))
    ids, lengths = TrainingData(tok, recipe.data, recipe.seed).pool(recipe.pool, recipe.val)
    val = slice(recipe.pool, recipe.pool + recipe.val)
    targets, _ = teacher_targets(model, ids[val], lengths[val], recipe.topk, tmp_path, {"test": True},
                                 chunk=recipe.batch)
    recorded = cfg["validation"][-1]
    m_global = float(cfg["m_global"])
    got = validate(model, gates, targets, m_global, recorded["capacity_weight"], chunk=recipe.batch)
    # bfloat16 matrix products differ between CPU kernels (matrix units or not): 1% there, and
    # 3% for the KL, a small difference of two close distributions that magnifies rounding
    # (Gemma 3's gates, recorded on an Intel Xeon with AMX: 0.04674; on an AMD EPYC: 0.04615, 1.3%)
    for key in ("ce", "kl", "retained_mean", "retained_max"):
        rel = 2e-3 if recipe.dtype == "float32" else (3e-2 if key == "kl" else 1e-2)
        assert got[key] == pytest.approx(recorded[key], rel=rel, abs=1e-4), key
    record = json.loads((folder / "training.json").read_text())
    assert record["steps"] == cfg["training"]["steps"] and record["command"].startswith("evictlab gates train")


# ------------------------------------------------------------------ the distractor sweep with learned gates


def test_distractor_sweep_runs_trimkv_global_with_the_shipped_gates(shipped: Path, tmp_path: Path,
                                                                    monkeypatch) -> None:
    """``dilution sweep --methods ...,trimkv+global --scorer-param gates=default``: the learned
    policy beside the ORACLE and the full cache at the same budget, with the bytes it held."""
    import polars as pl

    from evictlab.dilution.sweep import SweepConfig, run_sweep

    monkeypatch.setattr(files, "SHIPPED_DIR", shipped)
    llama, _ = tiny_model("llama")
    cfg = SweepConfig(model="tiny-llama", distractors=(0, 3), n=2,
                      methods=("full", "oracle_labels", "snapkv", "trimkv+global"), budget="96", context=160, sinks=2,
                      recent=4, chunk=64, window=4, compress_every=8, scorer_params=(("gates", "default"),))
    run_sweep(cfg, tmp_path / "s", progress=False, model=llama, tokenizer=ByteTokenizer())
    res = pl.read_parquet(tmp_path / "s" / "results.parquet")
    mine = res.filter(pl.col("method") == "trimkv+global")
    assert mine.height == 4 and set(mine["allocator"]) == {"global"}
    snap = res.filter(pl.col("method") == "snapkv")
    assert mine["budget_tokens"].to_list() == snap["budget_tokens"].to_list()
    assert (mine["bytes_live"] <= snap["bytes_live"].max()).all() and mine["answer_logprob"].is_finite().all()
    assert "trimkv+global" in (tmp_path / "s" / "report.md").read_text()


def test_sweep_refuses_another_models_default_gates_before_any_part(shipped: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """``gates=default`` on a model the shipped gates are not for: refused naming
    ``--scorer-param`` once the model is loaded, before the parts folder exists (the
    corrected command then runs into the same --out)."""
    from evictlab.dilution.sweep import SweepConfig, run_sweep

    monkeypatch.setattr(files, "SHIPPED_DIR", shipped)
    gemma, _ = tiny_model("gemma3")
    cfg = SweepConfig(model="tiny-gemma3", distractors=(0,), n=1, methods=("full", "trimkv+global"), budget="96",
                      context=160, sinks=2, recent=4, chunk=64, window=4, compress_every=8,
                      scorer_params=(("gates", "default"),))
    with pytest.raises(InputError, match="^--scorer-param: gates=default: no shipped gates for this model"):
        run_sweep(cfg, tmp_path / "s", progress=False, model=gemma, tokenizer=ByteTokenizer())
    assert not (tmp_path / "s" / "results.parts").exists()


@pytest.mark.parametrize("extra,problem", [
    (["--methods", "full,trimkv+global"], "trimkv needs trained gates"),
    (["--methods", "full,trimkv+global", "--scorer-param", "gates=/no/such/folder"], "is not a folder"),
    (["--methods", "full,snapkv", "--scorer-param", "gates=default"], "scorer snapkv has no parameter gates"),
    (["--methods", "full,trimkv", "--scorer-param", "gates"], "is not of the form key=value"),
])
def test_sweep_refuses_bad_gates_in_one_line_before_loading(tmp_path: Path, capsys, monkeypatch, extra,
                                                            problem) -> None:
    from cli_helpers import run_cli

    monkeypatch.setattr("evictlab.models.loading.load_model", lambda *a, **k: pytest.fail("model loaded"))
    code, _, err = run_cli(["dilution", "sweep", "--out", str(tmp_path / "s"), *extra], capsys, monkeypatch)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --scorer-param: "), err
    assert problem in lines[0]
