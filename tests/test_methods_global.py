"""The global allocator against a brute-force optimum, and the trimkv scorer + global
allocator through the decode loop on tiny models (scores equal a reference, physical ==
masked, the store holds exactly the budget with ragged cells)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from evictlab.errors import InputError
from evictlab.methods import AllocInputs, check_sizes, make_allocator, parse_method, select_keep


def _kept_sets(inputs: AllocInputs, sizes: np.ndarray, sinks: int, recent: int) -> set[tuple[int, int, int]]:
    """The entries (layer, head, index) select_keep keeps with these sizes (batch item 0)."""
    kept = set()
    for l, sc in enumerate(inputs.scores):
        for h in range(inputs.kv_heads):
            n = int(inputs.lengths[l, h])
            pos = inputs.positions[l][0, h, :n] if inputs.positions is not None else torch.arange(n)
            sel = select_keep(sc[:1, h:h + 1, :n], [int(sizes[l, h])], pos, sinks=sinks, recent=recent)[0][0]
            kept |= {(l, h, int(i)) for i in sel}
    return kept


def _brute_force(scores: list[np.ndarray], lengths: np.ndarray, target: int, sinks: int, recent: int,
                 minimum: int) -> set[tuple[int, int, int]]:
    """The best kept set by enumeration: it holds every always-kept entry, at least
    min(minimum, length) entries per cell and ``target`` entries in all; the highest total
    score wins (scores are distinct, so the optimum is unique)."""
    forced: set[tuple[int, int, int]] = set()
    free: list[tuple[int, int, int]] = []
    for l in range(len(scores)):
        for h in range(lengths.shape[1]):
            n = int(lengths[l, h])
            for i in range(n):
                if i < sinks or i >= n - recent:
                    forced.add((l, h, i))
                else:
                    free.append((l, h, i))
    best, best_val = None, -np.inf
    for extra in itertools.combinations(free, target - len(forced)):
        chosen = forced | set(extra)
        counts = {}
        for l, h, _ in chosen:
            counts[(l, h)] = counts.get((l, h), 0) + 1
        if any(counts.get((l, h), 0) < min(minimum, int(lengths[l, h]))
               for l in range(lengths.shape[0]) for h in range(lengths.shape[1])):
            continue
        val = sum(scores[l][h, i] for l, h, i in chosen)
        if val > best_val:
            best, best_val = chosen, val
    assert best is not None
    return best


@st.composite
def global_problems(draw: st.DrawFn):
    n_layers = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 2))
    lengths = np.array([[draw(st.integers(1, 5)) for _ in range(kv_heads)] for _ in range(n_layers)], dtype=np.int64)
    if lengths.sum() > 14:  # keep the enumeration small
        lengths = np.minimum(lengths, 2)
    sinks, recent = draw(st.integers(0, 1)), draw(st.integers(0, 2))
    minimum = draw(st.integers(0, 3))
    rng = np.random.default_rng(draw(st.integers(0, 10_000)))
    values = rng.permutation(int(lengths.sum()) * 4)[: int(lengths.sum())].astype(np.float64)  # distinct
    scores, k = [], 0
    S = int(lengths.max())
    for l in range(n_layers):
        sc = np.full((kv_heads, S), -1e30)
        for h in range(kv_heads):
            n = int(lengths[l, h])
            sc[h, :n] = values[k:k + n]
            k += n
        scores.append(sc)
    floors = np.minimum(lengths, sinks + recent)
    base = np.maximum(floors, np.minimum(minimum, lengths))
    target = draw(st.integers(int(base.sum()), int(lengths.sum())))
    return scores, lengths, target, sinks, recent, minimum


@given(problem=global_problems())
def test_global_keeps_the_budget_and_the_globally_best_entries(problem) -> None:
    scores, lengths, target, sinks, recent, minimum = problem
    S = scores[0].shape[1]
    positions = tuple(torch.where(torch.arange(S)[None, None, :] < torch.as_tensor(lengths[l])[None, :, None],
                                  torch.arange(S)[None, None, :], -1) for l in range(len(scores)))
    inputs = AllocInputs(tuple(torch.tensor(s, dtype=torch.float32)[None] for s in scores), lengths,
                         np.minimum(lengths, sinks + recent), (None,) * len(scores), target, positions=positions,
                         sinks=sinks, recent=recent)
    sizes = check_sizes(inputs, make_allocator("global", min_per_head=minimum).allocate(inputs))
    assert int(sizes.sum()) == target
    assert (sizes >= np.minimum(minimum, lengths)).all()
    kept = _kept_sets(inputs, sizes, sinks, recent)
    assert len(kept) == target
    assert kept == _brute_force(scores, lengths, target, sinks, recent, minimum)


def test_global_is_one_ranking_across_layers() -> None:
    # Layer 0 holds the four best scores, layer 1 the worst: a budget of 6 with floor 1 gives
    # layer 0 everything it can take.
    scores = [torch.tensor([[[9.0, 8.0, 7.0, 6.0]]]), torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])]
    inputs = AllocInputs.build(scores, 6, floor=1)
    assert make_allocator("global").allocate(inputs).tolist() == [[4], [2]]
    assert make_allocator("global", min_per_head=3).allocate(inputs).tolist() == [[3], [3]]
    with pytest.raises(InputError, match="min_per_head=4.*need 8 entries, the budget is 6"):
        make_allocator("global", min_per_head=4).allocate(inputs)
    with pytest.raises(InputError, match="min_per_head"):
        make_allocator("global", min_per_head=-1)
    # Equal scores everywhere (StreamingLLM-like): the tie rule spreads the budget evenly.
    flat = AllocInputs.build([torch.zeros(1, 3, 10)] * 2, 31, floor=2)
    sizes = make_allocator("global").allocate(flat)
    assert sizes.sum() == 31 and sizes.max() - sizes.min() <= 1
    assert parse_method("trimkv+global") == ("trimkv", "global")


# ---------------------------------------------------------------- trimkv through the decode loop


@pytest.fixture(scope="module")
def tiny_gates(tmp_path_factory) -> tuple[Path, Path]:
    """Shared and local gates for the tiny llama, trained for a few steps on a small text."""
    from evictlab.capture.testing import ByteTokenizer, tiny_model
    from evictlab.gates.data import DataSpec
    from evictlab.gates.train import Recipe, train_gates

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("gates")
    text = root / "text.txt"
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while birds sing in tall green trees".split()
    text.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(300)))
    model, _ = tiny_model("llama")
    out = []
    for shared in (True, False):
        recipe = Recipe(steps=6, batch=2, lr=2e-2, warmup=1, capacity=12, shared=shared, checkpoint_every=3,
                        data=DataSpec(seq_len=64, text=f"file:{text}", text_fraction=1.0))
        folder = root / ("shared" if shared else "local")
        train_gates(model, ByteTokenizer(), recipe, folder, model_name="tiny-llama")
        out.append(folder)
    return out[0], out[1]


def _run(model, ctx, q, a, **kw):
    from evictlab.decode.config import DecodeConfig
    from evictlab.decode.loop import run_sequence
    from evictlab.kv.budget import Budget

    base = dict(mode="physical", budget=Budget("tokens_per_cell", 30), scorer="trimkv", allocator="global",
                chunk_size=40, compress_every=6, block_size=8, sinks=2, recent=6)
    base.update(kw)
    return run_sequence(model, ctx, q, DecodeConfig(**base), answer_ids=a)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_trimkv_global_physical_equals_masked_and_frees(tiny_gates, family: str, tmp_path) -> None:
    from evictlab.capture.testing import ByteTokenizer, tiny_model
    from evictlab.gates.data import DataSpec
    from evictlab.gates.train import Recipe, train_gates

    model, _ = tiny_model(family)
    gates = tiny_gates[0]
    if family != "llama":  # gates are per model: train a tiny set for this one
        text = tiny_gates[0].parent / "text.txt"
        gates = tmp_path / "g"
        train_gates(model, ByteTokenizer(), Recipe(steps=2, batch=1, warmup=1, capacity=12, data=DataSpec(
            seq_len=48, text=f"file:{text}", text_fraction=1.0)), gates, model_name=family)
    g = torch.Generator().manual_seed(0)
    ctx, q, a = (torch.randint(3, 256, (1, n), generator=g) for n in (150, 5, 12))
    params = {"gates": str(gates)}
    config = model.config.to_dict()
    phys = _run(model, ctx, q, a, scorer_params=params)
    mask = _run(model, ctx, q, a, scorer_params=params, mode="masked")
    from evictlab.models.sites import find_attention_sites

    assert model.config.to_dict() == config  # the gates are hooks, never configuration
    assert all(not s.module._forward_pre_hooks for s in find_attention_sites(model))  # removed after the run
    torch.testing.assert_close(phys.logits, mask.logits, rtol=1e-4, atol=1e-4)
    cells = model.config.num_hidden_layers * model.config.num_key_value_heads
    assert phys.compressions >= 3
    assert phys.after_compression("live_tokens") == 30 * cells
    assert mask.after_compression("bytes_live") > phys.after_compression("bytes_live")
    assert all(torch.equal(x, y) for x, y in zip(phys.context_kept, mask.context_kept))
    # one global ranking: the cells kept different numbers of context entries
    per_cell = torch.cat([(p >= 0).sum(-1).flatten() for p in phys.context_kept])
    assert per_cell.sum() == 30 * cells and per_cell.max() > per_cell.min()


def test_trimkv_scores_are_age_times_the_gates_log_beta(tiny_gates, monkeypatch) -> None:
    """At the first compression nothing was evicted yet, so the scores the loop hands the
    allocator must equal (t - i) log beta_i from the gates applied to a plain forward's
    normed hidden states (the attention modules' input)."""
    from evictlab.capture.testing import tiny_model
    from evictlab.gates.files import load_gates
    from evictlab.kv.budget import Budget
    from evictlab.methods import allocators
    from evictlab.models.sites import find_attention_sites

    model, _ = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    ctx, q, a = (torch.randint(3, 256, (1, n), generator=g) for n in (60, 4, 3))
    seen: list[AllocInputs] = []
    original = allocators.Global.allocate

    def spy(self, inputs):  # noqa: ANN001, ANN202
        seen.append(inputs)
        return original(self, inputs)

    monkeypatch.setattr(allocators.Global, "allocate", spy)
    _run(model, ctx, q, a, scorer_params={"gates": str(tiny_gates[0])}, chunk_size=60,
         budget=Budget("tokens_per_cell", 20))
    first = seen[0]
    assert first.next_position == 60
    gates, _ = load_gates(tiny_gates[0])
    hidden: dict[int, torch.Tensor] = {}
    handles = [s.module.register_forward_pre_hook(
        lambda m, args, kwargs, l=s.layer: hidden.__setitem__(l, kwargs["hidden_states"]), with_kwargs=True)
        for s in find_attention_sites(model)]
    try:
        with torch.no_grad():
            model(input_ids=ctx, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    age = (60 - torch.arange(60)).float()
    for l in range(2):
        ref = (age[None, :] * gates.log_beta(l, hidden[l])[0].T)  # (hk, 60)
        torch.testing.assert_close(first.scores[l][0], ref, rtol=1e-5, atol=1e-6)
    assert first.sinks == 2 and first.recent == 6


def test_shared_and_local_gates_differ_and_both_run(tiny_gates) -> None:
    from evictlab.capture.testing import tiny_model
    from evictlab.gates.files import load_gates

    s, cfg_s = load_gates(tiny_gates[0])
    loc, cfg_l = load_gates(tiny_gates[1])
    assert s.spec.shared and not loc.spec.shared
    assert cfg_s["recipe"]["shared"] is True and cfg_l["recipe"]["shared"] is False
    model, _ = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    ctx, q, a = (torch.randint(3, 256, (1, n), generator=g) for n in (120, 4, 6))
    out = _run(model, ctx, q, a, scorer_params={"gates": str(tiny_gates[1])})
    assert torch.isfinite(out.logits).all()


def test_trimkv_refuses_missing_or_unfinished_gates(tmp_path) -> None:
    from evictlab.decode.config import DecodeConfig
    from evictlab.kv.budget import Budget

    with pytest.raises(InputError, match="scorer_param: trimkv needs trained gates"):
        DecodeConfig(scorer="trimkv", allocator="global", budget=Budget("tokens_per_cell", 8))
    with pytest.raises(InputError, match="gates=.*is not a folder"):
        DecodeConfig(scorer="trimkv", scorer_params={"gates": str(tmp_path / "nope")})
    (tmp_path / "checkpoint.pt").write_bytes(b"x")
    with pytest.raises(InputError, match="no finished gates.*did not finish"):
        DecodeConfig(scorer="trimkv", scorer_params={"gates": str(tmp_path)})


def test_trimkv_gates_of_another_model_are_refused_at_run_start(tiny_gates) -> None:
    from transformers import AutoModelForCausalLM

    from evictlab.capture.testing import tiny_config

    cfg = tiny_config("llama")  # the tiny llama with one more layer
    cfg.num_hidden_layers = 3
    three = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(2)
    ctx, q, a = (torch.randint(3, 256, (1, n), generator=g) for n in (80, 4, 3))
    with pytest.raises(InputError, match="scorer_param: the gates are for 2 layers"):
        _run(three, ctx, q, a, scorer_params={"gates": str(tiny_gates[0])})
