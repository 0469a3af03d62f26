"""The shared prefill (evictlab.decode.shared): an arm started from one prefilled context keeps
the same entries and gives the same logits and bytes as the same arm run alone through the
loop with a one-pass chunk, for every registered scorer and allocator, both stores and both
protocols; several questions are each answered from their own copy of one compressed cache;
the full cache's answers are the loop's. Tiny models (a Llama and a Gemma 3 with sliding
layers), byte vocabulary."""

from __future__ import annotations

import pytest
import torch

from evictlab.capture.testing import tiny_model
from evictlab.decode.config import DecodeConfig
from evictlab.decode.loop import DecodeOutput, run_sequence
from evictlab.decode.shared import QA, SharedContext, answer_arm, answer_full
from evictlab.kv.budget import Budget
from evictlab.kv.cache import register_ragged_attention
from evictlab.methods import ALLOCATORS, REGISTRY
from evictlab.methods.testing import example_predictor, model_profile

N_CTX = 96
LOOP = dict(sinks=2, recent=6, window=8, compress_every=4, block_size=8)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request: pytest.FixtureRequest):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, _ = tiny_model(request.param, attn_implementation=register_ragged_attention())
    g = torch.Generator().manual_seed(7)
    ctx = torch.randint(3, 256, (1, N_CTX), generator=g)
    qas = [QA(tuple(torch.randint(3, 256, (6,), generator=g).tolist()),
              tuple(torch.randint(3, 256, (3,), generator=g).tolist())) for _ in range(3)]
    return request.param, model, ctx, qas, SharedContext.prefill(model, ctx, hidden=True)


def _tensors(qa: QA) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([qa.question_ids]), torch.tensor([qa.answer_ids])


def _alone(model, ctx, qa: QA, cfg: DecodeConfig) -> DecodeOutput:
    """The per-arm path: the loop with a chunk as long as the whole prefix (one pass)."""
    q, a = _tensors(qa)
    return run_sequence(model, ctx, q, cfg, answer_ids=a)


def _same(shared: DecodeOutput, alone: DecodeOutput, exact: bool) -> None:
    assert len(shared.context_kept) == len(alone.context_kept)
    for x, y in zip(shared.context_kept, alone.context_kept):
        assert torch.equal(x, y)  # the same kept entries, cell by cell
    if exact:  # query-agnostic: the same forwards over the same entries
        torch.testing.assert_close(shared.logits, alone.logits, rtol=0, atol=2e-5)
    else:  # query-aware: the question's prefix went through the stock cache
        torch.testing.assert_close(shared.logits, alone.logits, rtol=1e-4, atol=1e-4)
    for attr in ("bytes_live", "live_tokens", "bytes_allocated", "bytes_index"):
        assert shared.after_compression(attr) == alone.after_compression(attr), attr
        assert shared.peak(attr) == alone.peak(attr), attr
    assert shared.budget_tokens == alone.budget_tokens
    assert shared.budget_effective_tokens == alone.budget_effective_tokens
    assert shared.bytes_full_cache == alone.bytes_full_cache
    assert shared.compressions == alone.compressions


def _arms(gates_dir, profile) -> list[tuple[str, str, dict, dict]]:
    """Every registered scorer with uniform sizes, and every allocator with SnapKV (and the
    global allocator with trimkv, whose scores share one scale); ``profile``: a fitted
    profile of the tiny model (no shipped one describes it) for ``contourkv_offline``."""
    out = []
    for scorer in sorted(REGISTRY):
        sp = {"gates": str(gates_dir)} if scorer == "trimkv" else {}
        if scorer == "oracle_labels":
            sp = {"useful": "10:20,50:55"}
        out.append((scorer, "uniform", sp, {}))
    for alloc in sorted(ALLOCATORS):
        if alloc != "uniform":
            ap = {"contourkv_pred": {"predictor": str(example_predictor())},
                  "contourkv_offline": {"profile": str(profile)}}.get(alloc, {})
            out.append(("snapkv", alloc, {}, ap))
    out.append(("trimkv", "global", {"gates": str(gates_dir)}, {}))
    return out


@pytest.fixture(scope="module")
def gates_dirs(tmp_path_factory: pytest.TempPathFactory):
    """Seeded untrained gates per tiny family (trimkv needs a gates folder)."""
    from evictlab.gates.files import geometry_meta, save_gates
    from evictlab.gates.modules import GateSpec, RetentionGates

    out = {}
    for family in ("llama", "gemma3"):
        model, _ = tiny_model(family)
        folder = tmp_path_factory.mktemp(f"gates-{family}")
        save_gates(folder, RetentionGates(GateSpec.for_model(model), seed=0),
                   {"model": f"tiny-{family}", "geometry": geometry_meta(model)})
        out[family] = folder
    return out


@pytest.mark.parametrize("protocol", ["query-agnostic", "query-aware"])
@pytest.mark.parametrize("mode", ["physical", "masked"])
def test_every_arm_equals_the_arm_run_alone(setup, gates_dirs, mode: str, protocol: str, tmp_path) -> None:
    family, model, ctx, qas, shared = setup
    qa = qas[0]
    aware = protocol == "query-aware"
    extended = {}  # the query-aware prefix of the question, shared by the arms

    def prefix(qa: QA) -> SharedContext:
        if qa not in extended:
            extended[qa] = shared.extended(torch.tensor([qa.question_ids[:-1]]))
        return extended[qa]

    for scorer, alloc, sp, ap in _arms(gates_dirs[family], model_profile(model, tmp_path / "tiny.json")):
        cfg = DecodeConfig.of(mode=mode, budget=Budget("tokens_per_cell", 20), scorer=scorer, allocator=alloc,
                              scorer_params=sp, allocator_params=ap, query_aware=aware, chunk_size=4096, **LOOP)
        alone = _alone(model, ctx, qa, cfg)
        (out,) = answer_arm(shared, cfg, [qa], protocol=protocol, extended=prefix)
        try:
            _same(out, alone, exact=not aware)
        except AssertionError as exc:
            raise AssertionError(f"{scorer}+{alloc} ({mode}, {protocol}, {family}): {exc}") from None


def test_several_questions_each_from_its_own_copy(setup, gates_dirs) -> None:
    """One compression serves every question: answering three questions from copies of the
    compressed cache equals answering each alone (same kept set: query-agnostic), and the
    context is not changed by answering (the third question after two others is the same
    as first)."""
    family, model, ctx, qas, shared = setup
    for scorer in ("snapkv", "h2o", "kvzip"):
        cfg = DecodeConfig.of(mode="physical", budget=Budget("tokens_per_cell", 20), scorer=scorer,
                              chunk_size=4096, **LOOP)
        outs = answer_arm(shared, cfg, qas)
        assert len(outs) == len(qas)
        for qa, out in zip(qas, outs):
            _same(out, _alone(model, ctx, qa, cfg), exact=True)
        again = answer_arm(shared, cfg, list(reversed(qas)))
        torch.testing.assert_close(again[0].logits, outs[-1].logits, rtol=0, atol=0)


def test_the_oracle_compresses_per_question(setup) -> None:
    family, model, ctx, qas, shared = setup
    cfg = DecodeConfig.of(mode="physical", budget=Budget("tokens_per_cell", 20), scorer="oracle", chunk_size=4096,
                          **LOOP)
    outs = answer_arm(shared, cfg, qas)
    for qa, out in zip(qas, outs):
        _same(out, _alone(model, ctx, qa, cfg), exact=True)
    assert any(not torch.equal(x, y) for x, y in zip(outs[0].context_kept, outs[1].context_kept))


def test_full_cache_answers_are_the_loops(setup) -> None:
    family, model, ctx, qas, shared = setup
    fulls = answer_full(shared, qas)
    for qa, full in zip(qas, fulls):
        q, a = _tensors(qa)
        ref = run_sequence(model, ctx, q, DecodeConfig(mode="full"), answer_ids=a)
        torch.testing.assert_close(full.logits, ref.logits, rtol=1e-4, atol=1e-4)
        assert full.bytes_full_cache == ref.bytes_full_cache
    # answering left the shared cache as it was: the same answers again
    torch.testing.assert_close(answer_full(shared, qas[:1])[0].logits, fulls[0].logits, rtol=0, atol=0)


def test_scoring_is_shared_between_arms_of_one_scorer(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first compression's scores depend only on the context and the scorer: a second
    arm with the same scorer (another allocator, budget or store) scores nothing."""
    from evictlab.methods import scorers

    family, model, ctx, qas, _ = setup
    shared = SharedContext.prefill(model, ctx)
    calls = []
    real = scorers.H2O.score

    def counting(self, inputs):  # noqa: ANN001, ANN202
        calls.append(inputs.layer)
        return real(self, inputs)

    monkeypatch.setattr(scorers.H2O, "score", counting)
    for alloc, budget, mode in [("uniform", 20, "physical"), ("adakv", 20, "physical"), ("uniform", 30, "masked")]:
        cfg = DecodeConfig.of(mode=mode, budget=Budget("tokens_per_cell", budget), scorer="h2o", allocator=alloc,
                              chunk_size=4096, **LOOP)
        answer_arm(shared, cfg, qas[:1])
        if alloc == "uniform" and budget == 20:
            first = len(calls)
    assert first > 0 and len(calls) == first
